//! One PRODUCER span per publish attempt, and the `traceparent` the message carries.
//!
//! The row's `traceparent` header (W3C) is the parent of every attempt's span; the span's own
//! context replaces it in the message's headers before the publisher renders them, and the
//! row's `tracestate` stays as written (the relay adds no entry of its own). A row whose context
//! is not sampled gets a span that records nothing but whose context still propagates (flags
//! `00`). A row without a context, or whose `traceparent` does not parse, starts a trace
//! (sampled at `tracing.sample_ratio`); an unparsable `traceparent` is passed through unchanged,
//! never an error.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use serde_json::{Map, Value};

use super::Tracing;
use crate::message::OutboxMessage;
use crate::publish::envelope::EnvelopeConfig;
use crate::publish::{Outcome, Publisher};

/// The W3C header naming the parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor state (passed through as the row wrote it).
pub const TRACESTATE: &str = "tracestate";

/// One outbox's tracer: its spans carry the outbox's name. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Outbox {
    tracing: Tracing,
    name: Arc<str>,
}

impl Tracing {
    /// The tracer of the outbox named `name`.
    pub fn for_outbox(&self, name: &str) -> Outbox {
        Outbox {
            tracing: self.clone(),
            name: name.into(),
        }
    }
}

/// The span of one attempt, ended with the attempt's outcome ([`AttemptSpan::finish`]); a span
/// dropped unfinished ends without a status.
#[derive(Debug)]
pub struct AttemptSpan(Option<opentelemetry_sdk::trace::Span>);

impl AttemptSpan {
    /// Ends the span: no status when confirmed, an error with the reason otherwise (`None`: the
    /// message was not published, because an earlier message of its aggregate failed or the
    /// relay is stopping). Idempotent.
    pub fn finish(&mut self, outcome: Option<&Outcome>) {
        let Some(mut span) = self.0.take() else {
            return;
        };
        let (kind, reason) = match outcome {
            Some(Outcome::Confirmed) => {
                span.end();
                return;
            }
            Some(Outcome::Rejected(reason)) => ("rejected", reason.as_str()),
            Some(Outcome::Unavailable(reason)) => ("unavailable", reason.as_str()),
            None => (
                "not_sent",
                "not published: an earlier message of its aggregate failed, or the relay is stopping",
            ),
        };
        span.set_attribute(KeyValue::new("error.type", kind));
        span.set_status(Status::error(reason.to_owned()));
        span.end();
    }
}

impl Outbox {
    /// Publishes `run` as [`Publisher::publish_run`] does, one span per message: a publisher
    /// that confirms one message at a time gets each message on its own (each span from its
    /// send to its confirm); one that pipelines runs ([`Publisher::pipelines_runs`]) gets the
    /// whole run, every span started before it and ended when it returns. `spans` receives the
    /// spans in run order, so that the caller ends those left open ([`AttemptSpan::finish`])
    /// when the run was cut short.
    pub async fn publish_run(
        &self,
        publisher: &dyn Publisher,
        run: &mut [OutboxMessage],
        envelope: &EnvelopeConfig,
        claimed_at: DateTime<Utc>,
        spans: &mut Vec<AttemptSpan>,
    ) -> Vec<Outcome> {
        if publisher.pipelines_runs() {
            for msg in run.iter_mut() {
                spans.push(self.start(publisher, msg, envelope, claimed_at));
            }
            let outcomes = publisher.publish_run(run, envelope).await;
            for (i, span) in spans.iter_mut().enumerate() {
                span.finish(outcomes.get(i));
            }
            return outcomes;
        }
        let mut outcomes = Vec::with_capacity(run.len());
        for msg in run.iter_mut() {
            spans.push(self.start(publisher, msg, envelope, claimed_at));
            let outcome = publisher.publish(msg, envelope).await;
            if let Some(span) = spans.last_mut() {
                span.finish(Some(&outcome));
            }
            let stop = outcome != Outcome::Confirmed;
            outcomes.push(outcome);
            if stop {
                break;
            }
        }
        outcomes
    }

    /// Starts the span of one attempt to publish `msg` and puts its context in `msg`'s
    /// `traceparent` header. The span's name and attributes are only built when it records
    /// (sampled): an unsampled span costs its context and the header.
    pub fn start(
        &self,
        publisher: &dyn Publisher,
        msg: &mut OutboxMessage,
        envelope: &EnvelopeConfig,
        claimed_at: DateTime<Utc>,
    ) -> AttemptSpan {
        let headers = RowHeaders::parse(&msg.headers);
        let parent = headers.parent();
        let tracer = &self.tracing.tracer;
        let mut span = tracer
            .span_builder("publish")
            .with_kind(SpanKind::Producer)
            .start_with_context(tracer, &parent.context);
        if span.is_recording() {
            let destination = publisher.destination_name(msg, envelope);
            span.update_name(format!("publish {destination}"));
            span.set_attributes(self.attributes(publisher, msg, destination, claimed_at));
        }
        if !parent.keep_row_header
            && let Some(rewritten) = headers.with_traceparent(&span)
        {
            msg.headers = rewritten;
        }
        AttemptSpan(Some(span))
    }

    /// The attributes of a recording span (docs/tracing.md).
    fn attributes(
        &self,
        publisher: &dyn Publisher,
        msg: &OutboxMessage,
        destination: String,
        claimed_at: DateTime<Utc>,
    ) -> [KeyValue; 10] {
        let queued = (claimed_at - msg.created_at)
            .to_std()
            .unwrap_or_default()
            .as_secs_f64();
        [
            KeyValue::new("messaging.system", publisher.kind()),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "publish"),
            KeyValue::new("messaging.destination.name", destination),
            KeyValue::new("messaging.message.id", msg.id.to_string()),
            KeyValue::new("outbox.name", Arc::clone(&self.name)),
            KeyValue::new("outbox.aggregate_type", msg.aggregate_type.clone()),
            KeyValue::new("outbox.event_type", msg.event_type.clone()),
            KeyValue::new("outbox.attempt", i64::from(msg.attempts)),
            KeyValue::new("outbox.queued_seconds", queued),
        ]
    }
}

/// The parent of an attempt's span.
struct Parent {
    /// The row's context, or an empty one (the span starts a trace).
    context: Context,
    /// The row's `traceparent` did not parse: the message carries it unchanged.
    keep_row_header: bool,
}

/// The row's `headers`, as far as the trace context is concerned.
enum RowHeaders {
    /// No headers (NULL or empty).
    None,
    /// A JSON object.
    Object(Map<String, Value>),
    /// Anything else: sent as is (the transports note it), no context read or written.
    Other,
}

impl RowHeaders {
    fn parse(raw: &[u8]) -> Self {
        if raw.is_empty() {
            return Self::None;
        }
        match serde_json::from_slice::<Value>(raw) {
            Ok(Value::Object(map)) => Self::Object(map),
            Ok(Value::Null) => Self::None,
            _ => Self::Other,
        }
    }

    /// The value of `name` (case-insensitive, as W3C header names are): a string, or `None`
    /// when absent; a value of another JSON type counts as present and unparsable.
    fn get(&self, name: &str) -> Option<Option<&str>> {
        let Self::Object(map) = self else {
            return None;
        };
        let value = map.get(name).or_else(|| {
            map.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v)
        })?;
        Some(value.as_str())
    }

    fn parent(&self) -> Parent {
        let Some(traceparent) = self.get(TRACEPARENT) else {
            return Parent {
                context: Context::new(),
                keep_row_header: false,
            };
        };
        let tracestate = self.get(TRACESTATE).flatten();
        let context = traceparent.map(|traceparent| {
            TraceContextPropagator::new().extract(&Carrier {
                traceparent,
                tracestate,
            })
        });
        match context {
            Some(cx) if cx.span().span_context().is_valid() => Parent {
                context: cx,
                keep_row_header: false,
            },
            _ => Parent {
                context: Context::new(),
                keep_row_header: true,
            },
        }
    }

    /// The headers JSON with `span`'s context as `traceparent` (any other spelling of the name
    /// removed); `None` when there is nothing to write (headers that are not an object, or a
    /// span without a valid context: the tracer was shut down).
    fn with_traceparent(self, span: &opentelemetry_sdk::trace::Span) -> Option<Vec<u8>> {
        let traceparent = traceparent_of(span.span_context())?;
        let mut map = match self {
            // Hex digits and dashes: nothing to escape.
            Self::None => return Some(format!(r#"{{"{TRACEPARENT}":"{traceparent}"}}"#).into()),
            Self::Object(map) => map,
            Self::Other => return None,
        };
        map.retain(|k, _| !k.eq_ignore_ascii_case(TRACEPARENT));
        map.insert(TRACEPARENT.to_owned(), Value::String(traceparent));
        serde_json::to_vec(&Value::Object(map)).ok()
    }
}

/// The W3C `traceparent` naming `cx` (as `TraceContextPropagator` writes it); `None` for an
/// invalid context.
fn traceparent_of(cx: &SpanContext) -> Option<String> {
    cx.is_valid().then(|| {
        let flags = cx.trace_flags() & TraceFlags::SAMPLED;
        format!("00-{}-{}-{flags:02x}", cx.trace_id(), cx.span_id())
    })
}

/// The propagator's view of the row's two W3C headers.
struct Carrier<'a> {
    traceparent: &'a str,
    tracestate: Option<&'a str>,
}

impl Extractor for Carrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => Some(self.traceparent),
            TRACESTATE => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        let mut keys = vec![TRACEPARENT];
        keys.extend(self.tracestate.map(|_| TRACESTATE));
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::envelope::tests::message;
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    const UNSAMPLED: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";

    /// A tracer with no exporter: spans get real contexts and are recorded nowhere.
    fn outbox(ratio: f64) -> Outbox {
        let provider = SdkTracerProvider::builder()
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                ratio,
            ))))
            .build();
        let tracer = provider.tracer("test");
        Tracing { provider, tracer }.for_outbox("orders")
    }

    /// A publisher that confirms every message but the `reject`-th (0-based) and keeps the
    /// headers of each message it was given.
    #[derive(Default)]
    struct Sink {
        reject: Option<usize>,
        headers: std::sync::Mutex<Vec<Vec<u8>>>,
    }

    #[async_trait::async_trait]
    impl Publisher for Sink {
        fn kind(&self) -> &'static str {
            "test"
        }
        fn describe(&self) -> String {
            "test".into()
        }
        async fn connect(&self) -> Result<(), crate::publish::ConnectError> {
            Ok(())
        }
        fn is_connected(&self) -> bool {
            true
        }
        async fn publish(&self, msg: &OutboxMessage, _: &EnvelopeConfig) -> Outcome {
            let mut given = self.headers.lock().unwrap();
            given.push(msg.headers.clone());
            if self.reject == Some(given.len() - 1) {
                Outcome::Rejected("no".into())
            } else {
                Outcome::Confirmed
            }
        }
        async fn close(&self) {}
    }

    fn envelope() -> EnvelopeConfig {
        EnvelopeConfig {
            route: crate::template::Template::parse("{aggregate_type}").unwrap(),
            source: "/outbox/test".into(),
            payload_kind: crate::message::PayloadKind::Json,
            signer: None,
        }
    }

    /// Starts the attempt's span for a row with `headers`; (span context, headers sent).
    fn attempt(outbox: &Outbox, headers: &str) -> (opentelemetry::trace::SpanContext, String) {
        let mut msg = message(headers);
        let span = outbox.start(&Sink::default(), &mut msg, &envelope(), Utc::now());
        let cx = span.0.as_ref().unwrap().span_context().clone();
        (cx, String::from_utf8(msg.headers).unwrap())
    }

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn the_span_is_a_child_of_the_rows_context_and_the_message_names_it() {
        let row = format!(r#"{{"traceparent":"{PARENT}","tracestate":"vendor=x","a":1}}"#);
        let (cx, sent) = attempt(&outbox(1.0), &row);
        assert_eq!(
            cx.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert!(cx.is_sampled());
        let sent = json(&sent);
        assert_eq!(
            sent["traceparent"],
            format!("00-{}-{}-01", cx.trace_id(), cx.span_id())
        );
        assert_eq!(sent["tracestate"], "vendor=x");
        assert_eq!(sent["a"], 1);
    }

    #[test]
    fn an_unsampled_parent_propagates_unsampled() {
        let row = format!(r#"{{"Traceparent":"{UNSAMPLED}"}}"#);
        let (cx, sent) = attempt(&outbox(1.0), &row);
        assert!(!cx.is_sampled());
        let sent = json(&sent);
        assert_eq!(sent.as_object().unwrap().len(), 1, "{sent}");
        let tp = sent["traceparent"].as_str().unwrap();
        assert!(
            tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-") && tp.ends_with("-00"),
            "{tp}"
        );
        assert_ne!(tp, UNSAMPLED, "the relay's span, not the row's");
    }

    #[test]
    fn rows_without_a_context_start_a_trace_at_the_sample_ratio() {
        let (cx, sent) = attempt(&outbox(1.0), "");
        assert!(cx.is_valid() && cx.is_sampled());
        assert_eq!(
            json(&sent)["traceparent"],
            format!("00-{}-{}-01", cx.trace_id(), cx.span_id())
        );
        let (cx, sent) = attempt(&outbox(0.0), r#"{"k":"v"}"#);
        assert!(cx.is_valid() && !cx.is_sampled());
        assert!(
            json(&sent)["traceparent"]
                .as_str()
                .unwrap()
                .ends_with("-00")
        );
    }

    #[test]
    fn only_a_recording_span_gets_its_name_and_attributes() {
        let mut msg = message("");
        let span = outbox(1.0).start(&Sink::default(), &mut msg, &envelope(), Utc::now());
        let data = span.0.as_ref().unwrap().exported_data().unwrap();
        assert_eq!(data.name, "publish order");
        let attr = |key: &str| {
            let kv = data.attributes.iter().find(|kv| kv.key.as_str() == key);
            kv.map(|kv| kv.value.to_string())
        };
        assert_eq!(data.attributes.len(), 10, "{:?}", data.attributes);
        assert_eq!(attr("outbox.name").as_deref(), Some("orders"));
        assert_eq!(attr("messaging.destination.name").as_deref(), Some("order"));
        assert_eq!(attr("messaging.system").as_deref(), Some("test"));

        let mut msg = message("");
        let span = outbox(0.0).start(&Sink::default(), &mut msg, &envelope(), Utc::now());
        let span = span.0.as_ref().unwrap();
        assert!(!span.is_recording() && span.exported_data().is_none());
        assert!(
            span.span_context().is_valid(),
            "its context still propagates"
        );
    }

    #[test]
    fn a_bad_traceparent_starts_a_trace_and_passes_unchanged() {
        for bad in [
            r#"{"traceparent":"not-a-traceparent","k":"v"}"#,
            r#"{"traceparent":42}"#,
            r#"{"traceparent":"00-00000000000000000000000000000000-b7ad6b7169203331-01"}"#,
        ] {
            let (cx, sent) = attempt(&outbox(1.0), bad);
            assert!(cx.is_valid(), "{bad}");
            assert_ne!(
                cx.trace_id().to_string(),
                "0af7651916cd43dd8448eb211c80319c"
            );
            assert_eq!(sent, bad, "passed through byte for byte");
        }
    }

    #[test]
    fn headers_that_are_not_an_object_are_left_alone() {
        for other in ["[1,2]", "not json"] {
            let (cx, sent) = attempt(&outbox(1.0), other);
            assert!(cx.is_valid());
            assert_eq!(sent, other);
        }
    }

    #[tokio::test]
    async fn a_traced_run_stops_at_the_first_failure_like_the_default() {
        let publisher = Sink {
            reject: Some(1),
            ..Sink::default()
        };
        let mut run = vec![message(""), message("{}"), message("{}")];
        let mut spans = Vec::new();
        let outcomes = outbox(1.0)
            .publish_run(&publisher, &mut run, &envelope(), Utc::now(), &mut spans)
            .await;
        assert_eq!(
            outcomes,
            vec![Outcome::Confirmed, Outcome::Rejected("no".into())]
        );
        assert_eq!(spans.len(), 2);
        assert!(
            spans.iter().all(|s| s.0.is_none()),
            "each ended at its answer"
        );
        assert_eq!(run[2].headers, b"{}", "the unsent row is untouched");
        let given = publisher.headers.lock().unwrap();
        assert_eq!(given.len(), 2, "published up to the rejection");
        for headers in given.iter() {
            let headers = json(std::str::from_utf8(headers).unwrap());
            assert!(headers["traceparent"].is_string(), "{headers}");
        }
    }
}
