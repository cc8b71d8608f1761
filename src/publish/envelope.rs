//! The wire format shared by every transport: CloudEvents binary-mode attributes and the
//! row's own headers (docs/wire-format.md).

use chrono::SecondsFormat;
use serde_json::Value;

use crate::config::{Config, OutboxConfig};
use crate::message::{OutboxMessage, PayloadKind, TRACEPARENT, TRACESTATE};
use crate::template::{Fields, Template};

/// One outbox's settings for its messages on the wire: what the envelope needs besides the
/// row, and where the row goes. A publisher is shared by every outbox; each publish names the
/// outbox's envelope.
#[derive(Debug, Clone)]
pub struct EnvelopeConfig {
    /// The routing-key (RabbitMQ) or topic (Kafka) template; the row's `destination` overrides
    /// it. Unused by the stdout sink.
    pub route: Template,
    /// CloudEvents `source`.
    pub source: String,
    /// Payload column type, for `datacontenttype`.
    pub payload_kind: PayloadKind,
    /// Signs every message when `[signing]` is configured.
    pub signer: Option<std::sync::Arc<crate::signing::Signer>>,
}

impl EnvelopeConfig {
    /// The envelope of `outbox`'s messages: its source and route (or the publisher's), the
    /// payload type found in its table, and the `[signing]` key.
    pub fn for_outbox(config: &Config, outbox: &OutboxConfig, payload_kind: PayloadKind) -> Self {
        Self {
            route: outbox
                .route
                .clone()
                .unwrap_or_else(|| config.publisher.route()),
            source: outbox.source.clone(),
            payload_kind,
            signer: config
                .signing
                .as_ref()
                .map(|s| std::sync::Arc::new(crate::signing::Signer::new(&s.key_id, &s.key))),
        }
    }
}

/// CloudEvents `time`: `created_at` in RFC 3339 with microseconds, UTC (`Z`).
pub fn time(msg: &OutboxMessage) -> String {
    msg.created_at.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// The `outbox-signature` header value for `msg` routed to `route`, when signing is on.
pub fn signature(msg: &OutboxMessage, cfg: &EnvelopeConfig, route: &str) -> Option<String> {
    let signer = cfg.signer.as_ref()?;
    let id = msg.id.to_string();
    let time = time(msg);
    Some(signer.sign(&crate::signing::Signed {
        id: &id,
        source: &cfg.source,
        event_type: &msg.event_type,
        subject: subject(msg),
        route,
        time: &time,
        content_type: cfg.payload_kind.content_type(),
        body: &msg.payload,
    }))
}

/// CloudEvents attributes of one message, in binding-neutral form (`(name, value)`).
pub fn cloud_event_attributes<'a>(
    msg: &'a OutboxMessage,
    cfg: &'a EnvelopeConfig,
) -> Vec<(&'static str, String)> {
    let mut attrs = vec![
        ("specversion", "1.0".to_owned()),
        ("id", msg.id.to_string()),
        ("type", msg.event_type.clone()),
        ("source", cfg.source.clone()),
        ("time", time(msg)),
        ("aggregatetype", msg.aggregate_type.clone()),
    ];
    if let Some(subject) = subject(msg) {
        attrs.push(("subject", subject.to_owned()));
    }
    attrs
}

/// The CloudEvents `subject`: the aggregate id, none when it is NULL or empty (CloudEvents:
/// a `subject` that is present is not empty).
pub fn subject(msg: &OutboxMessage) -> Option<&str> {
    msg.aggregate_id.as_deref().filter(|s| !s.is_empty())
}

/// The row's `headers` as `(name, value)` strings: strings as they are, other values as their
/// JSON text, `null` omitted; with the message's `traceparent` (tracing on) in place of the
/// row's, under any spelling, and the row's `tracestate` under its W3C name (the one the
/// context was read with: spelled exactly, else the last other spelling). A `headers` value
/// that is not an object yields no headers and a note saying so (never an error); JSON `null`
/// counts as no headers.
pub fn row_headers(msg: &OutboxMessage) -> (Vec<(String, String)>, Option<String>) {
    let (mut headers, note) = parse_row_headers(&msg.headers);
    if let Some(traceparent) = &msg.traceparent {
        headers.retain(|(name, _)| !name.eq_ignore_ascii_case(TRACEPARENT));
        headers.push((TRACEPARENT.to_owned(), traceparent.clone()));
        let states = || {
            headers
                .iter()
                .enumerate()
                .filter(|(_, (name, _))| name.eq_ignore_ascii_case(TRACESTATE))
        };
        let chosen = states()
            .find(|(_, (name, _))| name == TRACESTATE)
            .or_else(|| states().next_back())
            .map(|(at, _)| at);
        if let Some(chosen) = chosen {
            let (_, state) = headers.swap_remove(chosen);
            headers.retain(|(name, _)| !name.eq_ignore_ascii_case(TRACESTATE));
            headers.push((TRACESTATE.to_owned(), state));
        }
    }
    (headers, note)
}

/// [`row_headers`] as the row wrote them.
fn parse_row_headers(raw: &[u8]) -> (Vec<(String, String)>, Option<String>) {
    if raw.is_empty() {
        return (Vec::new(), None);
    }
    match serde_json::from_slice::<Value>(raw) {
        Ok(Value::Object(map)) => {
            let headers = map
                .into_iter()
                .filter_map(|(k, v)| match v {
                    Value::Null => None,
                    Value::String(s) => Some((k, s)),
                    other => Some((k, other.to_string())),
                })
                .collect();
            (headers, None)
        }
        Ok(Value::Null) => (Vec::new(), None),
        Ok(other) => (
            Vec::new(),
            Some(format!(
                "headers is a JSON {} rather than an object; sent without row headers",
                json_kind(&other)
            )),
        ),
        Err(e) => (
            Vec::new(),
            Some(format!(
                "headers is not valid JSON ({e}); sent without row headers"
            )),
        ),
    }
}

/// The names of the CloudEvents attributes the relay may set ([`cloud_event_attributes`]):
/// a sink reserves its header for each, whether or not this message carries it (a row's
/// `subject` header must not stand in for the one a row without aggregate leaves out).
pub const CLOUD_EVENT_ATTRIBUTES: [&str; 7] = [
    "specversion",
    "id",
    "type",
    "source",
    "time",
    "aggregatetype",
    "subject",
];

/// The header `ce-<attr>` of the NATS and HTTP bindings for each of
/// [`CLOUD_EVENT_ATTRIBUTES`], spelled out so that no sink builds the name per message.
pub fn ce_dash_header(attr: &str) -> Option<&'static str> {
    Some(match attr {
        "specversion" => "ce-specversion",
        "id" => "ce-id",
        "type" => "ce-type",
        "source" => "ce-source",
        "time" => "ce-time",
        "aggregatetype" => "ce-aggregatetype",
        "subject" => "ce-subject",
        _ => return None,
    })
}

/// How many distinct colliding header names are logged; rows cannot grow the log's memory
/// beyond this.
const COLLISIONS_LOGGED: usize = 256;

/// Whether the header `name` is, ASCII case-insensitively, `<prefix><attribute>` for one of
/// [`CLOUD_EVENT_ATTRIBUTES`]: the header a sink with that prefix sets for the attribute.
pub fn is_attribute_header(name: &str, prefix: &str) -> bool {
    name.get(..prefix.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(prefix))
        && name.get(prefix.len()..).is_some_and(|attr| {
            CLOUD_EVENT_ATTRIBUTES
                .iter()
                .any(|a| a.eq_ignore_ascii_case(attr))
        })
}

/// The row's headers a sink sends beside its own: [`row_headers`] without those for which
/// `is_ours` holds, the names the sink sets itself on this message (compare them ASCII
/// case-insensitively). The relay's value wins; a dropped name is logged once per process
/// (a warning), and a `headers` value that is not an object is logged with the row's id.
pub fn row_headers_beside(
    msg: &OutboxMessage,
    is_ours: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let (mut headers, note) = row_headers(msg);
    if let Some(note) = note {
        tracing::warn!(id = %msg.id, "{note}");
    }
    headers.retain(|(name, _)| {
        let collides = is_ours(name);
        if collides {
            warn_collision(msg, name);
        }
        !collides
    });
    headers
}

/// Whether `name` is the signature header and `cfg` signs (the header a signing sink sets).
pub fn is_signature_header(name: &str, cfg: &EnvelopeConfig) -> bool {
    cfg.signer.is_some() && name.eq_ignore_ascii_case(crate::signing::HEADER)
}

/// Warns once per process that row headers named `name` are dropped.
pub fn warn_collision(msg: &OutboxMessage, name: &str) {
    static LOGGED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut logged = LOGGED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let lower = name.to_ascii_lowercase();
    if logged.contains(&lower) || logged.len() >= COLLISIONS_LOGGED {
        return;
    }
    logged.push(lower);
    tracing::warn!(
        header = %name,
        id = %msg.id,
        "a row header is named like one the relay sets itself; the relay's value is sent and \
         the row's dropped (logged once per header name)"
    );
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// AMQP `expiration` for a row with a deadline: the milliseconds left at `now`, at least 1 (a
/// row claimed before its deadline is still published when the deadline passes in flight; the
/// broker then drops it at once rather than delivering it late). `None` without a deadline.
pub fn expiration_ms(
    expires_at: Option<chrono::DateTime<chrono::Utc>>,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<String> {
    expires_at.map(|deadline| (deadline - now).num_milliseconds().max(1).to_string())
}

/// The routing key / topic: the row's `destination` when set, else the rendered template.
pub fn destination(msg: &OutboxMessage, template: &Template) -> String {
    match &msg.destination {
        Some(d) if !d.is_empty() => d.clone(),
        _ => template.render(&Fields {
            aggregate_type: &msg.aggregate_type,
            event_type: &msg.event_type,
            aggregate_id: msg.aggregate_id.as_deref(),
        }),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use chrono::TimeZone;
    use uuid::Uuid;

    pub(crate) fn message(headers: &str) -> OutboxMessage {
        OutboxMessage {
            id: Uuid::nil(),
            seq: 1,
            aggregate_type: "order".into(),
            aggregate_id: Some("42".into()),
            event_type: "created".into(),
            payload: b"{}".to_vec(),
            headers: headers.as_bytes().to_vec(),
            destination: None,
            attempts: 1,
            created_at: chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap(),
            expires_at: None,
            traceparent: None,
        }
    }

    #[test]
    fn header_values_become_strings_and_nulls_vanish() {
        let m = message(r#"{"a":"x","b":1,"c":null,"d":{"e":[true]},"f":false}"#);
        let (mut h, note) = row_headers(&m);
        h.sort();
        assert_eq!(
            h,
            vec![
                ("a".into(), "x".into()),
                ("b".into(), "1".into()),
                ("d".into(), r#"{"e":[true]}"#.into()),
                ("f".into(), "false".into()),
            ]
        );
        assert!(note.is_none());
    }

    #[test]
    fn row_headers_named_like_ours_are_dropped_and_ours_win() {
        let m = message(
            r#"{"ce_id":"spoof","CE_Type":"x","ce_other":"ext","outbox-signature":"forged","keep":"1"}"#,
        );
        let ours = |name: &str| is_attribute_header(name, "ce_") || name == "content-type";
        let mut kept = row_headers_beside(&m, ours);
        kept.sort();
        let names: Vec<&str> = kept.iter().map(|(k, _)| k.as_str()).collect();
        // A `ce_` extension the relay does not set passes; so does a signature header when
        // the sink does not sign.
        assert_eq!(names, ["ce_other", "keep", "outbox-signature"]);
        let mut cfg = EnvelopeConfig {
            source: "/s".into(),
            payload_kind: PayloadKind::Json,
            signer: None,
            route: Template::parse("r").unwrap(),
        };
        assert!(!is_signature_header("outbox-signature", &cfg));
        cfg.signer = Some(std::sync::Arc::new(crate::signing::Signer::new(
            "k", &[1u8; 32],
        )));
        assert!(is_signature_header("Outbox-Signature", &cfg));
        assert!(is_attribute_header("cloudEvents:subject", "cloudEvents:"));
        assert!(!is_attribute_header("cloudEvents:", "cloudEvents:"));
        assert!(!is_attribute_header("ce", "ce_"));
    }

    #[test]
    fn the_rows_tracestate_goes_under_its_w3c_name_with_tracing_on() {
        let mut msg = message(r#"{"TRACESTATE":"v=1","a":"b"}"#);
        msg.traceparent = Some("00-ours".into());
        let (mut headers, _) = row_headers(&msg);
        headers.sort();
        let want = [
            ("a", "b"),
            ("traceparent", "00-ours"),
            ("tracestate", "v=1"),
        ];
        assert_eq!(headers, want.map(|(k, v)| (k.to_owned(), v.to_owned())));
        // Of two other spellings the one that sorts last, as the context was read.
        let mut msg = message(r#"{"TRACESTATE":"b=2","TraceState":"a=1"}"#);
        msg.traceparent = Some("00-ours".into());
        let (headers, _) = row_headers(&msg);
        assert!(
            headers.contains(&("tracestate".to_owned(), "a=1".to_owned())),
            "{headers:?}"
        );
        // The exact spelling wins, as when the context was read; the others go.
        let mut msg = message(r#"{"TraceState":"x=1","tracestate":"v=2"}"#);
        msg.traceparent = Some("00-ours".into());
        let (mut headers, _) = row_headers(&msg);
        headers.sort();
        let want = [("traceparent", "00-ours"), ("tracestate", "v=2")];
        assert_eq!(headers, want.map(|(k, v)| (k.to_owned(), v.to_owned())));
        // Tracing off: the row's headers as written.
        let msg = message(r#"{"TRACESTATE":"v=1"}"#);
        assert_eq!(
            row_headers(&msg).0,
            [("TRACESTATE".to_owned(), "v=1".to_owned())]
        );
    }

    #[test]
    fn the_messages_traceparent_replaces_the_rows_under_any_spelling() {
        let mut msg = message(r#"{"TraceParent":"row","tracestate":"v=1","a":"b"}"#);
        msg.traceparent = Some("00-ours".into());
        let (mut headers, note) = row_headers(&msg);
        headers.sort();
        assert_eq!(note, None);
        assert_eq!(
            headers,
            [
                ("a", "b"),
                ("traceparent", "00-ours"),
                ("tracestate", "v=1")
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        for none in ["", "null"] {
            let mut msg = message(none);
            msg.traceparent = Some("00-ours".into());
            assert_eq!(
                row_headers(&msg),
                (vec![("traceparent".into(), "00-ours".into())], None),
                "{none:?}"
            );
        }
    }

    #[test]
    fn non_object_headers_are_noted_not_fatal() {
        let (h, note) = row_headers(&message("[1,2]"));
        assert!(h.is_empty());
        assert!(note.unwrap().contains("array"));
    }

    #[test]
    fn cloud_event_attributes_follow_the_contract() {
        let cfg = EnvelopeConfig {
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: None,
            route: Template::parse("r").unwrap(),
        };
        let m = message("{}");
        let attrs = cloud_event_attributes(&m, &cfg);
        let get = |k: &str| attrs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("specversion"), Some("1.0"));
        assert_eq!(get("id"), Some("00000000-0000-0000-0000-000000000000"));
        assert_eq!(get("type"), Some("created"));
        assert_eq!(get("subject"), Some("42"));
        assert_eq!(get("aggregatetype"), Some("order"));
        assert_eq!(get("time"), Some("2026-01-02T03:04:05.000000Z"));
        // No subject for a NULL or an empty aggregate id (a present subject is not empty).
        for none in [None, Some(String::new())] {
            let mut m = m.clone();
            m.aggregate_id = none;
            assert!(
                cloud_event_attributes(&m, &cfg)
                    .iter()
                    .all(|(k, _)| *k != "subject")
            );
        }
    }

    #[test]
    fn expiration_is_the_remaining_milliseconds_and_at_least_one() {
        let now = chrono::Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap();
        assert_eq!(expiration_ms(None, now), None);
        let later = now + chrono::Duration::milliseconds(1500);
        assert_eq!(expiration_ms(Some(later), now).as_deref(), Some("1500"));
        assert_eq!(expiration_ms(Some(now), now).as_deref(), Some("1"));
        let past = now - chrono::Duration::seconds(10);
        assert_eq!(expiration_ms(Some(past), now).as_deref(), Some("1"));
    }

    #[test]
    fn signature_covers_what_is_sent_and_not_the_attempt() {
        let mut cfg = EnvelopeConfig {
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: None,
            route: Template::parse("r").unwrap(),
        };
        let m = message("{}");
        assert_eq!(signature(&m, &cfg, "order.created"), None);
        cfg.signer = Some(std::sync::Arc::new(crate::signing::Signer::new(
            "k1", &[7u8; 32],
        )));
        let first = signature(&m, &cfg, "order.created").unwrap();
        let mut retried = m.clone();
        retried.attempts = 5;
        retried.expires_at = Some(chrono::Utc::now());
        assert_eq!(signature(&retried, &cfg, "order.created").unwrap(), first);
        assert_ne!(signature(&m, &cfg, "order.other").unwrap(), first);
        let mut other = m.clone();
        other.payload = b"{\"a\":1}".to_vec();
        assert_ne!(signature(&other, &cfg, "order.created").unwrap(), first);
    }

    #[test]
    fn destination_overrides_template() {
        let t = Template::parse("{aggregate_type}.{event_type}").unwrap();
        let mut m = message("{}");
        assert_eq!(destination(&m, &t), "order.created");
        m.destination = Some("special".into());
        assert_eq!(destination(&m, &t), "special");
    }
}
