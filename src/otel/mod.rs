//! OpenTelemetry traces (docs/tracing.md): the export pipeline and the
//! one span per publish attempt, for every sink.
//!
//! The relay loop hands each run to [`attempt::Outbox::publish_run`] instead of the publisher when
//! tracing is on ([`crate::config::TracingConfig`]); nothing here runs when it is off, and the
//! row's headers then pass unchanged. Per attempt ([`attempt`]): a PRODUCER span, child of the
//! row's `traceparent` (every attempt, so a message's retries sit in its producer's trace), whose
//! context the message carries ([`crate::message::OutboxMessage::traceparent`]) and
//! [`crate::publish::envelope::row_headers`] sends in place of the row's `traceparent`, so every
//! transport (those of today and any added later) carries it without code of its own.
//!
//! Export never slows relaying: a span ends into a bounded queue ([`BoundedProcessor`], in front
//! of the SDK's batch processor, which exports from a thread of its own); when the queue is full
//! or an export fails the spans are dropped, counted in
//! [`crate::telemetry::names::TRACE_SPANS_DROPPED`] and reported by one warning (and one note
//! when export works again), never one line per span. After a failed export each batch first
//! checks that the collector accepts a connection ([`Probe`]) and is dropped unencoded while it
//! does not, so that a collector that is down costs the relay little CPU.

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
    /// `sample_ratio` > 0: spans that start a trace may be recorded.
    samples_roots: bool,
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
        let processor = BoundedProcessor::new(otlp_exporter(cfg)?, &cfg.endpoint, queue_size());
        let provider = provider(processor, cfg);
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
        Ok(Self {
            provider,
            tracer,
            samples_roots: cfg.sample_ratio > 0.0,
        })
    }

    /// Whether the sampler (parent-based, then `sample_ratio`) may record a span whose
    /// parent is `parent`: a row's context decides by its sampled flag; a span that starts a
    /// trace may be recorded unless `sample_ratio` is 0 (below 1 it still may not be).
    fn records(&self, parent: &opentelemetry::Context) -> bool {
        use opentelemetry::trace::TraceContextExt as _;
        let span = parent.span();
        let cx = span.span_context();
        if cx.is_valid() {
            cx.is_sampled()
        } else {
            self.samples_roots
        }
    }

    /// Sends what is queued (up to a few seconds) and stops the export thread. Blocks: call
    /// from `spawn_blocking`.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_FLUSH) {
            tracing::debug!(error = %e, "trace exporter shutdown");
        }
    }
}

/// The OTLP exporter for `cfg.endpoint`, over the configured protocol.
fn otlp_exporter(cfg: &TracingConfig) -> Result<opentelemetry_otlp::SpanExporter, OtelError> {
    match cfg.protocol {
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
    .map_err(|e| OtelError::Exporter {
        endpoint: redact_url(&cfg.endpoint),
        reason: e.to_string(),
    })
}

/// Spans waiting for export, at most: `OTEL_BSP_MAX_QUEUE_SIZE` when it is a positive number,
/// else [`DEFAULT_QUEUE`].
fn queue_size() -> usize {
    std::env::var("OTEL_BSP_MAX_QUEUE_SIZE")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or(DEFAULT_QUEUE)
}

/// The tracer provider: `processor`, the parent-based ratio sampler and the service name.
fn provider(processor: BoundedProcessor, cfg: &TracingConfig) -> SdkTracerProvider {
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(cfg.sample_ratio)));
    SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler)
        .with_resource(
            Resource::builder()
                .with_service_name(cfg.service_name.clone())
                .build(),
        )
        .build()
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

impl BoundedProcessor {
    /// `exporter` behind the SDK's batch processor and a bound of `capacity` waiting spans,
    /// both counting their drops.
    fn new<E: SpanExporter + 'static>(exporter: E, endpoint: &str, capacity: usize) -> Self {
        let pending = Arc::new(AtomicUsize::new(0));
        let drops = Arc::new(Drops::default());
        let exporter = CountingExporter {
            inner: exporter,
            pending: Arc::clone(&pending),
            drops: Arc::clone(&drops),
            probe: Probe::new(endpoint),
            failing: std::sync::atomic::AtomicBool::new(false),
        };
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(capacity)
                    .build(),
            )
            .build();
        Self {
            inner: batch,
            pending,
            capacity,
            drops,
        }
    }
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

/// The OTLP exporter, counting what leaves the queue and what fails to export. After a failed
/// export, each batch first checks that the collector accepts a connection ([`Probe`]): while
/// it refuses, batches are dropped without being encoded.
#[derive(Debug)]
struct CountingExporter<E> {
    inner: E,
    pending: Arc<AtomicUsize>,
    drops: Arc<Drops>,
    probe: Probe,
    /// The last export failed.
    failing: std::sync::atomic::AtomicBool,
}

/// How long a probe waits for the collector to accept a connection.
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);

/// A TCP connection to the collector's host and port, made instead of encoding a batch while
/// exports fail: a collector that is down then costs the relay a refused connection per batch
/// rather than the protobuf encoding of every span, and export resumes with the first batch
/// after it is back.
#[derive(Debug)]
struct Probe {
    /// `host:port` of the endpoint; `None` when it names none (then every batch is exported).
    target: Option<String>,
}

impl Probe {
    fn new(endpoint: &str) -> Self {
        let target = url::Url::parse(endpoint).ok().and_then(|url| {
            let host = url
                .host_str()?
                .trim_start_matches('[')
                .trim_end_matches(']');
            let port = url.port_or_known_default()?;
            Some(if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            })
        });
        Self { target }
    }

    /// Whether the collector accepts a TCP connection now (blocks up to [`PROBE_TIMEOUT`] per
    /// address; called on the SDK's export thread).
    fn reachable(&self) -> bool {
        use std::net::ToSocketAddrs as _;
        let Some(target) = &self.target else {
            return true;
        };
        let Ok(addrs) = target.to_socket_addrs() else {
            return false;
        };
        addrs
            .into_iter()
            .any(|addr| std::net::TcpStream::connect_timeout(&addr, PROBE_TIMEOUT).is_ok())
    }
}

/// An export error as one readable line: the HTTP exporter wraps its client's error as a
/// `Debug` dump (`reqwest::Error { kind: …, source: … }`), which says less than this does.
fn export_failure(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string();
    match text.find("reqwest::Error {") {
        Some(at) => format!(
            "{}the request to the collector failed (no answer in time, or the connection was cut)",
            &text[..at]
        ),
        None => text,
    }
}

impl<E: SpanExporter> SpanExporter for CountingExporter<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        self.pending.fetch_sub(n, Ordering::AcqRel);
        if self.failing.load(Ordering::Acquire) && !self.probe.reachable() {
            let why = "the collector does not accept connections";
            self.drops.dropped(n, "export_failed", &why);
            return Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                why.to_owned(),
            ));
        }
        let result = self.inner.export(batch).await;
        self.failing.store(result.is_err(), Ordering::Release);
        match &result {
            Ok(()) => self.drops.exported(),
            Err(_) if !self.probe.reachable() => self.drops.dropped(
                n,
                "export_failed",
                &"the collector does not accept connections",
            ),
            Err(e) => self.drops.dropped(n, "export_failed", &export_failure(e)),
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
    fn the_probe_tells_a_listening_collector_from_a_closed_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let probe = Probe::new(&format!("http://127.0.0.1:{port}/v1/traces"));
        assert_eq!(probe.target.as_deref(), Some(&*format!("127.0.0.1:{port}")));
        assert!(probe.reachable());
        drop(listener);
        assert!(!probe.reachable(), "nothing listens any more");
        assert_eq!(
            Probe::new("https://collector.example").target.as_deref(),
            Some("collector.example:443")
        );
        assert_eq!(
            Probe::new("http://[::1]:4318").target.as_deref(),
            Some("[::1]:4318")
        );
        assert!(
            Probe::new("not a url").reachable(),
            "no target: always export"
        );
    }

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
