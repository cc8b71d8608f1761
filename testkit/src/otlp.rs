//! An OTLP/HTTP trace receiver on 127.0.0.1: `POST /v1/traces` with an
//! `ExportTraceServiceRequest` in protobuf, decoded with `opentelemetry-proto` (the wire format
//! a collector reads, not an in-memory exporter). It keeps every span it receives, and can be
//! stopped and started again on the same port (a collector that goes away).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::wait_until;

/// `Span.SpanKind` PRODUCER in OTLP.
pub const KIND_PRODUCER: i32 = 4;
/// `Status.StatusCode` ERROR in OTLP.
pub const STATUS_ERROR: i32 = 2;

/// One span as received.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    /// Lowercase hex, 32 digits.
    pub trace_id: String,
    /// Lowercase hex, 16 digits.
    pub span_id: String,
    /// Lowercase hex, 16 digits; empty for a root span.
    pub parent_span_id: String,
    /// The span's name.
    pub name: String,
    /// OTLP `SpanKind` (see [`KIND_PRODUCER`]).
    pub kind: i32,
    /// OTLP `StatusCode` (0 unset, 1 ok, [`STATUS_ERROR`]).
    pub status_code: i32,
    /// The status message.
    pub status_message: String,
    /// Attributes, each value as text (numbers in Rust's `Display` form).
    pub attributes: BTreeMap<String, String>,
    /// The resource's `service.name`.
    pub service_name: String,
    /// Start and end, unix nanoseconds.
    pub start_end: (u64, u64),
}

impl ReceivedSpan {
    /// The attribute `key`, or `""`.
    pub fn attr(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }

    /// The W3C `traceparent` naming this span with the sampled flag.
    pub fn traceparent(&self) -> String {
        format!("00-{}-{}-01", self.trace_id, self.span_id)
    }
}

#[derive(Default)]
struct Received {
    spans: Vec<ReceivedSpan>,
    requests: usize,
    /// Spans received, kept or not.
    count: usize,
    /// Only count the spans (the benchmark's receiver: 100k spans kept would cost memory).
    count_only: bool,
}

/// The receiver. Dropping it stops the server.
pub struct OtlpReceiver {
    addr: SocketAddr,
    received: Arc<Mutex<Received>>,
    running: Option<(CancellationToken, JoinHandle<()>)>,
}

impl OtlpReceiver {
    /// Listens on a free port of 127.0.0.1.
    pub async fn start() -> Self {
        Self::start_with(false).await
    }

    /// Listens on a free port of 127.0.0.1, decoding every request but keeping only the count
    /// of spans ([`OtlpReceiver::span_count`]).
    pub async fn start_counting() -> Self {
        Self::start_with(true).await
    }

    async fn start_with(count_only: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("receiver address");
        let received = Received {
            count_only,
            ..Received::default()
        };
        let mut receiver = Self {
            addr,
            received: Arc::new(Mutex::new(received)),
            running: None,
        };
        receiver.serve(listener);
        receiver
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let token = CancellationToken::new();
        let app = Router::new()
            .route("/v1/traces", post(export))
            .with_state(Arc::clone(&self.received));
        let stop = token.clone();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        self.running = Some((token, task));
    }

    /// The base URL to configure as `tracing.otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops listening (connections are refused until [`OtlpReceiver::restart`]).
    pub async fn stop(&mut self) {
        if let Some((token, task)) = self.running.take() {
            token.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
    }

    /// Listens again on the same port.
    pub async fn restart(&mut self) {
        self.stop().await;
        let listener = tokio::net::TcpListener::bind(self.addr)
            .await
            .expect("bind the OTLP receiver's port again");
        self.serve(listener);
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.lock().spans.clone()
    }

    /// How many spans arrived (kept or not).
    pub fn span_count(&self) -> usize {
        self.lock().count
    }

    /// How many export requests arrived.
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// The spans received whose attribute `key` is `value`.
    pub fn spans_with(&self, key: &str, value: &str) -> Vec<ReceivedSpan> {
        let received = self.lock();
        let matching = received.spans.iter().filter(|s| s.attr(key) == value);
        matching.cloned().collect()
    }

    /// Waits until at least `n` spans have attribute `key` = `value`, and returns them.
    pub async fn wait_for_spans_with(
        &self,
        key: &str,
        value: &str,
        n: usize,
        timeout: Duration,
    ) -> Vec<ReceivedSpan> {
        let what = format!("{n} span(s) with {key} = {value} reach the receiver");
        wait_until(timeout, &what, async || {
            let spans = self.spans_with(key, value);
            if spans.len() >= n {
                Ok(spans)
            } else {
                Err(format!(
                    "{} so far, {} in all",
                    spans.len(),
                    self.spans().len()
                ))
            }
        })
        .await
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        if let Some((token, task)) = self.running.take() {
            token.cancel();
            task.abort();
        }
    }
}

async fn export(State(received): State<Arc<Mutex<Received>>>, body: Bytes) -> impl IntoResponse {
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut spans = Vec::new();
    for resource_spans in request.resource_spans {
        let service_name = resource_spans
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
            .map(value_text)
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for s in scope.spans {
                let status = s.status.unwrap_or_default();
                spans.push(ReceivedSpan {
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    status_code: status.code,
                    status_message: status.message,
                    attributes: s
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), value_text(a)))
                        .collect(),
                    service_name: service_name.clone(),
                    start_end: (s.start_time_unix_nano, s.end_time_unix_nano),
                });
            }
        }
    }
    {
        let mut r = received.lock().unwrap_or_else(|p| p.into_inner());
        r.requests += 1;
        r.count += spans.len();
        if !r.count_only {
            r.spans.extend(spans);
        }
    }
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}

fn value_text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
