//! One PRODUCER span per publish attempt, and the `traceparent` the message carries.
//!
//! The row's `traceparent` header (W3C) is the parent of every attempt's span; the span's own
//! context is the message's `traceparent`, which every transport sends in place of the row's
//! (the row's headers JSON is only read, never rewritten), and the row's `tracestate` stays as
//! written (the relay adds no entry of its own). A row whose context
//! is not sampled gets a span that records nothing but whose context still propagates (flags
//! `00`). A row without a context, or whose `traceparent` does not parse, starts a trace
//! (sampled at `tracing.sample_ratio`); an unparsable `traceparent` is passed through unchanged,
//! never an error.

use std::borrow::Cow;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanKind, Status, TraceContextExt, TraceFlags, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::Tracing;
use crate::message::{OutboxMessage, TRACEPARENT, TRACESTATE};
use crate::publish::envelope::EnvelopeConfig;
use crate::publish::{Outcome, Publisher};

/// How many attributes a recording span starts with ([`Outbox::description`]); a failed
/// attempt adds `error.type`.
const ATTRIBUTES: usize = 10;

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
/// dropped unfinished ends without a status (a run cut by a panic ends its spans with
/// [`AttemptSpan::finish_panicked`]).
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

    /// Ends the span of a publish cut short by a panic (the message `panic`): an error of type
    /// `panic`. The relay then publishes the run again untraced ([`crate::relay`]). Idempotent,
    /// and a no-op on a span already finished.
    pub fn finish_panicked(&mut self, panic: &str) {
        let Some(mut span) = self.0.take() else {
            return;
        };
        span.set_attribute(KeyValue::new("error.type", "panic"));
        span.set_status(Status::error(format!(
            "the relay panicked while publishing: {panic}"
        )));
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

    /// Starts the span of one attempt to publish `msg` and names its context in
    /// `msg.traceparent`, which the transports send instead of the row's `traceparent`
    /// ([`crate::publish::envelope::row_headers`]). The span's name and attributes are only
    /// built when it records (sampled): an unsampled span costs its context and the header.
    pub fn start(
        &self,
        publisher: &dyn Publisher,
        msg: &mut OutboxMessage,
        envelope: &EnvelopeConfig,
        claimed_at: DateTime<Utc>,
    ) -> AttemptSpan {
        let headers = RowHeaders::parse(&msg.headers);
        let parent = headers.parent();
        let writes_header = !parent.keep_row_header && !matches!(headers, RowHeaders::Other);
        let tracer = &self.tracing.tracer;
        // The sampler's decision, foreseen so that a recording span gets its attributes with
        // room for `error.type` in one allocation; checked again once the span has started.
        let describe = || self.description(publisher, msg, envelope, claimed_at);
        let described = self.tracing.records(&parent.context);
        let builder = if described {
            let (name, attributes) = describe();
            let mut builder = tracer.span_builder(name);
            let mut all = Vec::with_capacity(ATTRIBUTES + 1);
            all.extend(attributes);
            builder.attributes = Some(all);
            builder
        } else {
            tracer.span_builder("publish")
        };
        let mut span = builder
            .with_kind(SpanKind::Producer)
            .start_with_context(tracer, &parent.context);
        if !described && span.is_recording() {
            let (name, attributes) = describe();
            span.update_name(name);
            span.set_attributes(attributes);
        }
        msg.traceparent = if writes_header {
            traceparent_of(span.span_context())
        } else {
            None
        };
        AttemptSpan(Some(span))
    }

    /// The name (`publish <destination>`) and attributes of a recording span
    /// (docs/tracing.md).
    fn description(
        &self,
        publisher: &dyn Publisher,
        msg: &OutboxMessage,
        envelope: &EnvelopeConfig,
        claimed_at: DateTime<Utc>,
    ) -> (String, [KeyValue; ATTRIBUTES]) {
        let destination = publisher.destination_name(msg, envelope);
        let name = format!("publish {destination}");
        let queued = (claimed_at - msg.created_at)
            .to_std()
            .unwrap_or_default()
            .as_secs_f64();
        let attributes = [
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
        ];
        (name, attributes)
    }
}

/// The parent of an attempt's span.
struct Parent {
    /// The row's context, or an empty one (the span starts a trace).
    context: Context,
    /// The row's `traceparent` did not parse: the message carries it unchanged.
    keep_row_header: bool,
}

/// The row's `headers`, as far as the trace context is concerned: only the two W3C values
/// are read (borrowed from the row's text where no escape forces a copy); the rest of the
/// object is skipped, never built.
enum RowHeaders<'a> {
    /// No headers (NULL, empty or JSON `null`).
    None,
    /// A JSON object and its W3C entries.
    Object(W3c<'a>),
    /// Anything else: sent as is (the transports note it), no context read or written.
    Other,
}

/// The `traceparent` and `tracestate` entries of a headers object. Names match ASCII
/// case-insensitively, as W3C header names do; an exact spelling wins over another one, and of
/// several other spellings the one that sorts last (as the message's headers list them, so
/// that the `tracestate` sent is the one read here).
#[derive(Default)]
struct W3c<'a> {
    traceparent: Entry<'a>,
    tracestate: Entry<'a>,
}

/// One W3C entry of the row's headers.
#[derive(Default)]
struct Entry<'a> {
    /// `None`: absent; `Some(None)`: present but not a string (unparsable).
    value: Option<Option<Cow<'a, str>>>,
    /// The name was spelled exactly (lower case).
    exact: bool,
    /// The spelling of the name kept.
    spelling: Option<Cow<'a, str>>,
}

impl<'a> Entry<'a> {
    /// Keeps `value`, found under `name` (spelled exactly or not), unless an exact spelling
    /// was kept before, or another spelling that sorts after `name`.
    fn offer(&mut self, value: Option<Cow<'a, str>>, name: Cow<'a, str>, exact: bool) {
        let later = || self.spelling.as_deref().is_none_or(|kept| *name >= *kept);
        if exact || (!self.exact && later()) {
            self.value = Some(value);
            self.exact = exact;
            self.spelling = Some(name);
        }
    }
}

impl<'a> RowHeaders<'a> {
    fn parse(raw: &'a [u8]) -> Self {
        if raw.is_empty() {
            return Self::None;
        }
        match serde_json::from_slice(raw) {
            Ok(w3c) => Self::Object(w3c),
            Err(_) if raw.trim_ascii() == b"null" => Self::None,
            Err(_) => Self::Other,
        }
    }

    fn parent(&self) -> Parent {
        let Self::Object(w3c) = self else {
            return Parent {
                context: Context::new(),
                keep_row_header: false,
            };
        };
        let Some(traceparent) = &w3c.traceparent.value else {
            return Parent {
                context: Context::new(),
                keep_row_header: false,
            };
        };
        let tracestate = w3c.tracestate.value.as_ref().and_then(|v| v.as_deref());
        let context = traceparent.as_deref().map(|traceparent| {
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
}

impl<'de> Deserialize<'de> for W3c<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(W3cVisitor)
    }
}

/// Reads a headers object's W3C entries, skipping the others.
struct W3cVisitor;

impl<'de> Visitor<'de> for W3cVisitor {
    type Value = W3c<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut w3c = W3c::default();
        while let Some(Name(name)) = map.next_key()? {
            let slot = if name.eq_ignore_ascii_case(TRACEPARENT) {
                &mut w3c.traceparent
            } else if name.eq_ignore_ascii_case(TRACESTATE) {
                &mut w3c.tracestate
            } else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            let exact = name == TRACEPARENT || name == TRACESTATE;
            let StringOrNot(value) = map.next_value()?;
            slot.offer(value, name, exact);
        }
        Ok(w3c)
    }
}

/// A header name, borrowed unless it holds an escape.
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StringOrNotVisitor)
            .and_then(|StringOrNot(s)| {
                s.map(Name)
                    .ok_or_else(|| de::Error::custom("a header name is not a string"))
            })
    }
}

/// A header value: the string (borrowed unless it holds an escape), or `None` for a value of
/// another JSON type, which is skipped.
struct StringOrNot<'a>(Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for StringOrNot<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StringOrNotVisitor)
    }
}

/// Reads a [`StringOrNot`], or a header name (a string).
struct StringOrNotVisitor;

impl<'de> Visitor<'de> for StringOrNotVisitor {
    type Value = StringOrNot<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(StringOrNot(Some(Cow::Borrowed(v))))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(StringOrNot(Some(Cow::Owned(v.to_owned()))))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(StringOrNot(Some(Cow::Owned(v))))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(StringOrNot(None))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(StringOrNot(None))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(StringOrNot(None))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(StringOrNot(None))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(StringOrNot(None))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        IgnoredAny.visit_seq(seq).map(|_| StringOrNot(None))
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        IgnoredAny.visit_map(map).map(|_| StringOrNot(None))
    }
}

/// The W3C `traceparent` naming `cx` (as `TraceContextPropagator` writes it: version `00`,
/// lower-case hex ids, the sampled flag); `None` for an invalid context.
fn traceparent_of(cx: &SpanContext) -> Option<String> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    if !cx.is_valid() {
        return None;
    }
    let flags = (cx.trace_flags() & TraceFlags::SAMPLED).to_u8();
    let mut out = String::with_capacity(55);
    out.push_str("00");
    for bytes in [
        &cx.trace_id().to_bytes()[..],
        &cx.span_id().to_bytes()[..],
        &[flags][..],
    ] {
        out.push('-');
        for b in bytes {
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
    Some(out)
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
    use serde_json::Value;

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
        Tracing {
            provider,
            tracer,
            samples_roots: ratio > 0.0,
        }
        .for_outbox("orders")
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
            given.push(sent(msg).into_bytes());
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

    /// Starts the attempt's span for a row with `headers`; (span context, the headers the
    /// transports send, as a JSON object, and the row's headers afterwards).
    fn attempt(outbox: &Outbox, headers: &str) -> (SpanContext, String, String) {
        let mut msg = message(headers);
        let span = outbox.start(&Sink::default(), &mut msg, &envelope(), Utc::now());
        let cx = span.0.as_ref().unwrap().span_context().clone();
        (cx, sent(&msg), String::from_utf8(msg.headers).unwrap())
    }

    /// The headers the transports send for `msg`, as a JSON object.
    fn sent(msg: &OutboxMessage) -> String {
        let (headers, _) = crate::publish::envelope::row_headers(msg);
        let map: serde_json::Map<String, Value> = headers
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        Value::Object(map).to_string()
    }

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn the_span_is_a_child_of_the_rows_context_and_the_message_names_it() {
        let row = format!(r#"{{"traceparent":"{PARENT}","tracestate":"vendor=x","a":1}}"#);
        let (cx, sent, kept) = attempt(&outbox(1.0), &row);
        assert_eq!(kept, row, "the row's headers are read, not rewritten");
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
        assert_eq!(sent["a"], "1");
    }

    #[test]
    fn an_unsampled_parent_propagates_unsampled() {
        let row = format!(r#"{{"Traceparent":"{UNSAMPLED}"}}"#);
        let (cx, sent, _) = attempt(&outbox(1.0), &row);
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
        let (cx, sent, _) = attempt(&outbox(1.0), "");
        assert!(cx.is_valid() && cx.is_sampled());
        assert_eq!(
            json(&sent)["traceparent"],
            format!("00-{}-{}-01", cx.trace_id(), cx.span_id())
        );
        let (cx, sent, _) = attempt(&outbox(0.0), r#"{"k":"v"}"#);
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
            let (cx, _, kept) = attempt(&outbox(1.0), bad);
            assert!(cx.is_valid(), "{bad}");
            assert_ne!(
                cx.trace_id().to_string(),
                "0af7651916cd43dd8448eb211c80319c"
            );
            assert_eq!(kept, bad, "passed through byte for byte");
            let mut msg = message(bad);
            outbox(1.0).start(&Sink::default(), &mut msg, &envelope(), Utc::now());
            assert_eq!(
                msg.traceparent, None,
                "no traceparent of the relay's: {bad}"
            );
        }
    }

    #[test]
    fn the_exact_spelling_wins_and_escaped_values_are_read() {
        let escaped = PARENT.replacen('0', "\\u0030", 1);
        for row in [
            format!(r#"{{"TRACEPARENT":"garbage","traceparent":"{PARENT}","Traceparent":"x"}}"#),
            format!(r#"{{"k":[{{"traceparent":1}}],"traceparent":"{escaped}","n":1.5e300}}"#),
        ] {
            let (cx, sent, _) = attempt(&outbox(1.0), &row);
            assert_eq!(
                cx.trace_id().to_string(),
                "0af7651916cd43dd8448eb211c80319c",
                "{row}"
            );
            assert!(
                json(&sent)["traceparent"]
                    .as_str()
                    .unwrap()
                    .ends_with("-01")
            );
        }
    }

    #[test]
    fn the_traceparent_is_written_as_the_w3c_propagator_writes_it() {
        for ratio in [1.0, 0.0] {
            let (cx, _, _) = attempt(&outbox(ratio), "");
            let mut carrier = std::collections::HashMap::new();
            TraceContextPropagator::new().inject_context(
                &Context::new().with_remote_span_context(cx.clone()),
                &mut carrier,
            );
            assert_eq!(traceparent_of(&cx).as_ref(), carrier.get(TRACEPARENT));
        }
    }

    #[test]
    fn headers_that_are_not_an_object_are_left_alone() {
        for other in ["[1,2]", "not json"] {
            let (cx, _, kept) = attempt(&outbox(1.0), other);
            assert!(cx.is_valid());
            assert_eq!(kept, other);
            let mut msg = message(other);
            outbox(1.0).start(&Sink::default(), &mut msg, &envelope(), Utc::now());
            assert_eq!(msg.traceparent, None, "{other}");
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
        assert_eq!(run[2].traceparent, None, "the unsent row is untouched");
        let given = publisher.headers.lock().unwrap();
        assert_eq!(given.len(), 2, "published up to the rejection");
        for headers in given.iter() {
            let headers = json(std::str::from_utf8(headers).unwrap());
            assert!(headers["traceparent"].is_string(), "{headers}");
        }
    }
}
