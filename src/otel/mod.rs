//! OpenTelemetry traces (docs/tracing.md): the export pipeline and the
//! one span per publish attempt, for every sink.
//!
//! The relay loop hands each run to [`attempt::Outbox::publish_run`] instead of the publisher when
//! tracing is on ([`crate::config::TracingConfig`]); nothing here runs when it is off, and the
//! row's headers then pass unchanged. Per attempt ([`attempt`]): a PRODUCER span, child of the
//! row's `traceparent` (every attempt, so a message's retries sit in its producer's trace), whose
//! context replaces the row's `traceparent` header before the publisher renders the headers, so
//! every transport (those of today and any added later) carries it without code of its own.
//!
//! Export never slows relaying: a span ends into a bounded queue ([`BoundedProcessor`], in front
//! of the SDK's batch processor, which exports from a thread of its own); when the queue is full
//! or an export fails the spans are dropped, counted in
//! [`crate::telemetry::names::TRACE_SPANS_DROPPED`] and reported by one warning (and one note
//! when export works again), never one line per span.

pub mod attempt;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
    SpanExporter, SpanProcessor,
};

use crate::config::{OtlpProtocol, TracingConfig};
use crate::redact::redact_url;
use crate::telemetry;

pub use attempt::{AttemptSpan, Outbox};

/// Spans waiting for export, at most (the SDK's default; `OTEL_BSP_MAX_QUEUE_SIZE` overrides).
const DEFAULT_QUEUE: usize = 2048;

/// How long the exporter gets to send what is queued when the relay stops.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The OTLP exporter could not be built from the configuration.
    #[error("cannot build the OTLP exporter for {endpoint}: {reason}")]
    Exporter {
        /// The endpoint, password masked.
        endpoint: String,
        /// The exporter's error.
        reason: String,
    },
}

/// The relay's tracer: the SDK provider (its batch thread and exporter) and what each publish
/// attempt needs. Cheap to clone; every outbox shares one.
#[derive(Clone)]
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl std::fmt::Debug for Tracing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracing").finish_non_exhaustive()
    }
}

impl Tracing {
    /// Builds the exporter, the bounded batch pipeline and the tracer. Call inside the tokio
    /// runtime (the gRPC exporter's channel lives on it) but from a thread allowed to block
    /// (`spawn_blocking`): the HTTP exporter's blocking client must not be built or dropped on
    /// an async worker.
    pub fn install(cfg: &TracingConfig) -> Result<Self, OtelError> {
        let fail = |e: &dyn std::fmt::Display| OtelError::Exporter {
            endpoint: redact_url(&cfg.endpoint),
            reason: e.to_string(),
        };
        let exporter = match cfg.protocol {
            OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(&cfg.endpoint)
                .build(),
            OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(&cfg.endpoint)
                .build(),
        }
        .map_err(|e| fail(&e))?;
        let queue = std::env::var("OTEL_BSP_MAX_QUEUE_SIZE")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n: &usize| n > 0)
            .unwrap_or(DEFAULT_QUEUE);
        let pending = Arc::new(AtomicUsize::new(0));
        let drops = Arc::new(Drops::default());
        let exporter = CountingExporter {
            inner: exporter,
            pending: Arc::clone(&pending),
            drops: Arc::clone(&drops),
        };
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(queue)
                    .build(),
            )
            .build();
        let processor = BoundedProcessor {
            inner: batch,
            pending,
            capacity: queue,
            drops,
        };
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio)));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler)
            .with_resource(
                Resource::builder()
                    .with_service_name(cfg.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer_with_scope(
            opentelemetry::InstrumentationScope::builder("outbox-relay")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        );
        telemetry::register_trace_drops();
        tracing::info!(
            endpoint = %redact_url(&cfg.endpoint),
            protocol = ?cfg.protocol,
            service_name = %cfg.service_name,
            sample_ratio = cfg.sample_ratio,
            "exporting OpenTelemetry traces"
        );
        Ok(Self { provider, tracer })
    }

    /// Sends what is queued (up to a few seconds) and stops the export thread. Blocks: call
    /// from `spawn_blocking`.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_FLUSH) {
            tracing::debug!(error = %e, "trace exporter shutdown");
        }
    }
}

/// Drop accounting shared by the processor and the exporter: the metric, and one warning per
/// stretch of drops (a stretch ends at the next successful export), at most one every
/// [`WARN_EVERY`] (a slow collector that keeps up now and then does not log every few seconds).
#[derive(Debug, Default)]
struct Drops(std::sync::Mutex<DropState>);

#[derive(Debug, Default)]
struct DropState {
    /// Spans were dropped since the last successful export.
    dropping: bool,
    /// This stretch's warning was logged.
    warned: bool,
    last_warning: Option<std::time::Instant>,
}

/// The least time between two warnings about dropped spans.
const WARN_EVERY: Duration = Duration::from_secs(300);

impl Drops {
    fn dropped(&self, n: usize, why: &'static str, detail: &dyn std::fmt::Display) {
        telemetry::record_trace_spans_dropped(why, n as u64);
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if s.dropping {
            return;
        }
        s.dropping = true;
        if s.last_warning.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return;
        }
        s.warned = true;
        s.last_warning = Some(std::time::Instant::now());
        tracing::warn!(
            spans = n,
            reason = why,
            detail = %detail,
            "trace spans are being dropped (relaying goes on; they are counted in outbox_trace_spans_dropped_total, and this is not logged again until export works)"
        );
    }

    fn exported(&self) {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if std::mem::take(&mut s.dropping) && std::mem::take(&mut s.warned) {
            tracing::info!("trace export works again");
        }
    }
}

/// The SDK's batch processor behind a queue bound the relay can count: a span that finds
/// `capacity` spans waiting is dropped here and counted (the SDK's own queue, of the same size,
/// then never fills, and its silent drop never happens).
#[derive(Debug)]
struct BoundedProcessor {
    inner: BatchSpanProcessor,
    /// Spans handed to `inner` and not yet to the exporter.
    pending: Arc<AtomicUsize>,
    capacity: usize,
    drops: Arc<Drops>,
}

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.capacity {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            self.drops
                .dropped(1, "queue_full", &"the export queue is full");
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what leaves the queue and what fails to export.
#[derive(Debug)]
struct CountingExporter<E> {
    inner: E,
    pending: Arc<AtomicUsize>,
    drops: Arc<Drops>,
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        self.pending.fetch_sub(n, Ordering::AcqRel);
        let result = self.inner.export(batch).await;
        match &result {
            Ok(()) => self.drops.exported(),
            Err(e) => self.drops.dropped(n, "export_failed", e),
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_stretch_of_drops_and_at_most_one_every_five_minutes() {
        let drops = Drops::default();
        let state = |d: &Drops| {
            let s = d.0.lock().unwrap();
            (s.dropping, s.warned)
        };
        drops.dropped(1, "queue_full", &"full");
        drops.dropped(3, "export_failed", &"refused");
        assert_eq!(state(&drops), (true, true), "warned once for the stretch");
        drops.exported();
        assert_eq!(state(&drops), (false, false), "the stretch ended");
        drops.dropped(1, "queue_full", &"full");
        assert_eq!(
            state(&drops),
            (true, false),
            "a new stretch within five minutes is counted, not logged"
        );
    }
}
