//! An OTLP trace receiver on 127.0.0.1, speaking either protocol a collector takes: OTLP/HTTP
//! (`POST /v1/traces` with an `ExportTraceServiceRequest` in protobuf) or OTLP/gRPC (the
//! collector's `TraceService/Export`, a tonic server). Both decode with `opentelemetry-proto`
//! (the wire format a collector reads, not an in-memory exporter) into one store of spans. It
//! keeps every span it receives, and can be stopped and started again on the same port (a
//! collector that goes away).

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
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::wait_until;

/// The OTLP transport a receiver speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OTLP/HTTP with protobuf bodies (`POST /v1/traces`).
    HttpProtobuf,
    /// OTLP/gRPC (`opentelemetry.proto.collector.trace.v1.TraceService/Export`).
    Grpc,
}

impl Protocol {
    /// The relay's `tracing.protocol` value for this transport.
    pub fn config_value(self) -> &'static str {
        match self {
            Self::HttpProtobuf => "http/protobuf",
            Self::Grpc => "grpc",
        }
    }
}

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

impl Received {
    /// Keeps (or only counts) the spans of one export request.
    fn record(&mut self, request: ExportTraceServiceRequest) {
        let spans = decode(request);
        self.requests += 1;
        self.count += spans.len();
        if !self.count_only {
            self.spans.extend(spans);
        }
    }
}

type Store = Arc<Mutex<Received>>;

fn record(store: &Store, request: ExportTraceServiceRequest) {
    let mut r = store.lock().unwrap_or_else(|p| p.into_inner());
    r.record(request);
}

/// The receiver. Dropping it stops the server.
pub struct OtlpReceiver {
    protocol: Protocol,
    addr: SocketAddr,
    received: Store,
    running: Option<(CancellationToken, JoinHandle<()>)>,
}

impl OtlpReceiver {
    /// Listens for OTLP/HTTP on a free port of 127.0.0.1.
    pub async fn start() -> Self {
        Self::start_with(Protocol::HttpProtobuf, false).await
    }

    /// Listens for `protocol` on a free port of 127.0.0.1.
    pub async fn start_speaking(protocol: Protocol) -> Self {
        Self::start_with(protocol, false).await
    }

    /// Listens for OTLP/HTTP on a free port of 127.0.0.1, decoding every request but keeping
    /// only the count of spans ([`OtlpReceiver::span_count`]).
    pub async fn start_counting() -> Self {
        Self::start_with(Protocol::HttpProtobuf, true).await
    }

    async fn start_with(protocol: Protocol, count_only: bool) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("receiver address");
        let received = Received {
            count_only,
            ..Received::default()
        };
        let mut receiver = Self {
            protocol,
            addr,
            received: Arc::new(Mutex::new(received)),
            running: None,
        };
        receiver.serve(listener);
        receiver
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let token = CancellationToken::new();
        let stop = token.clone().cancelled_owned();
        let store = Arc::clone(&self.received);
        let task = match self.protocol {
            Protocol::HttpProtobuf => {
                let app = Router::new()
                    .route("/v1/traces", post(export))
                    .with_state(store);
                tokio::spawn(async move {
                    let _ = axum::serve(listener, app)
                        .with_graceful_shutdown(stop)
                        .await;
                })
            }
            Protocol::Grpc => {
                let service = TraceServiceServer::new(GrpcService(store));
                let incoming = tonic::transport::server::TcpIncoming::from(listener);
                tokio::spawn(async move {
                    let _ = tonic::transport::Server::builder()
                        .serve_with_incoming_shutdown(service, incoming, stop)
                        .await;
                })
            }
        };
        self.running = Some((token, task));
    }

    /// The base URL to configure as `tracing.otlp_endpoint`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What it speaks: the relay's `tracing.protocol` is [`Protocol::config_value`].
    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    /// Stops listening (connections are refused until [`OtlpReceiver::restart`]).
    pub async fn stop(&mut self) {
        if let Some((token, mut task)) = self.running.take() {
            token.cancel();
            // A gRPC server waits for its clients to hang up: cut them after a grace period.
            if tokio::time::timeout(Duration::from_secs(5), &mut task)
                .await
                .is_err()
            {
                task.abort();
                let _ = task.await;
            }
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

async fn export(State(store): State<Store>, body: Bytes) -> impl IntoResponse {
    let count_only = store.lock().unwrap_or_else(|p| p.into_inner()).count_only;
    let decoded = if count_only {
        SpanCount::decode(body).map(|request| {
            let mut r = store.lock().unwrap_or_else(|p| p.into_inner());
            r.requests += 1;
            r.count += request.spans();
        })
    } else {
        ExportTraceServiceRequest::decode(body).map(|request| record(&store, request))
    };
    if let Err(e) = decoded {
        return (StatusCode::BAD_REQUEST, e.to_string()).into_response();
    }
    (
        [(header::CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
        .into_response()
}

/// An `ExportTraceServiceRequest` read only as far as counting its spans needs: each span stays
/// undecoded bytes (the benchmark's receiver stands for a collector on another machine, so it
/// should take as little of this one's CPU as it can).
#[derive(Clone, PartialEq, prost::Message)]
struct SpanCount {
    #[prost(message, repeated, tag = "1")]
    resource_spans: Vec<ResourceSpanCount>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ResourceSpanCount {
    #[prost(message, repeated, tag = "2")]
    scope_spans: Vec<ScopeSpanCount>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ScopeSpanCount {
    #[prost(bytes = "bytes", repeated, tag = "2")]
    spans: Vec<Bytes>,
}

impl SpanCount {
    fn spans(&self) -> usize {
        let scopes = self.resource_spans.iter().flat_map(|r| &r.scope_spans);
        scopes.map(|s| s.spans.len()).sum()
    }
}

/// The collector's gRPC trace service, recording into the receiver's store.
struct GrpcService(Store);

#[tonic::async_trait]
impl TraceService for GrpcService {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        record(&self.0, request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The spans of one export request.
fn decode(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
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
    spans
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

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};

    #[test]
    fn counting_reads_as_many_spans_as_decoding() {
        let scope = |n: usize| ScopeSpans {
            spans: vec![Span::default(); n],
            ..ScopeSpans::default()
        };
        let request = ExportTraceServiceRequest {
            resource_spans: vec![
                ResourceSpans {
                    scope_spans: vec![scope(3), scope(2)],
                    ..ResourceSpans::default()
                },
                ResourceSpans {
                    scope_spans: vec![scope(4)],
                    ..ResourceSpans::default()
                },
            ],
        };
        let body = Bytes::from(request.encode_to_vec());
        assert_eq!(decode(request).len(), 9);
        assert_eq!(SpanCount::decode(body).unwrap().spans(), 9);
    }
}
