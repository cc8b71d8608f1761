//! `outbox-relay tail`: a development consumer that prints every message arriving, so a
//! newcomer can watch their event arrive without another client.
//! - RabbitMQ ([`rabbitmq`]): consumes a queue (by default the
//!   `publisher.rabbitmq.declare_queue` the shipped `relay.toml` declares). Each message is
//!   acknowledged after it was printed, so it is consumed: point `tail` at a development
//!   queue, never at a queue a real consumer reads.
//! - NATS ([`nats`]): a core NATS subscription to the subjects the relay publishes to. It sees
//!   each message as it is published and takes nothing from any stream.

pub mod nats;
pub mod rabbitmq;

pub use nats::tail_nats;
pub use rabbitmq::tail;

/// Why `tail` stopped before its count.
#[derive(Debug, thiserror::Error)]
pub enum TailError {
    /// The broker could not be reached.
    #[error("cannot connect to {url}: {source}")]
    Connect {
        /// The AMQP URL, password masked.
        url: String,
        /// What lapin said.
        source: lapin::Error,
    },
    /// The queue is not there (or not accessible).
    #[error(
        "queue {queue:?} is not available: {source} (start the relay once so that it declares publisher.rabbitmq.declare_queue, or pass --queue)"
    )]
    NoQueue {
        /// The queue name.
        queue: String,
        /// What the broker said.
        source: lapin::Error,
    },
    /// The connection broke while consuming.
    #[error("consuming from {queue:?} failed: {source}")]
    Consume {
        /// The queue name.
        queue: String,
        /// What lapin said.
        source: lapin::Error,
    },
    /// The NATS server could not be reached (or its URL is not usable).
    #[error("cannot connect to NATS at {url}: {reason}")]
    NatsConnect {
        /// The server URL, credentials masked.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The server refused or never confirmed the subscription.
    #[error("cannot subscribe to {subject:?}: {reason}")]
    Subscribe {
        /// The subject pattern.
        subject: String,
        /// What went wrong.
        reason: String,
    },
}

/// A message as `tail` shows it, whatever the broker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shown<'a> {
    /// Where it arrived, e.g. `exchange "outbox", routing key "order.created"` or
    /// `subject "outbox.order.created"`.
    pub origin: String,
    /// The message id (AMQP `message_id`, NATS `Nats-Msg-Id`).
    pub id: Option<String>,
    /// The event type (AMQP `type`, NATS `ce-type`).
    pub kind: Option<String>,
    /// The body's content type.
    pub content_type: Option<String>,
    /// Every header, in the order to print them.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: &'a [u8],
}

/// One message as `tail` prints it: where it came from, its id and type, every header and
/// the body (as text when it is UTF-8). Control characters are printed escaped (`\u{1b}`), so
/// that what a row carries can neither break the layout nor reach the terminal as a command;
/// the body keeps its line breaks and tabs.
pub fn describe(n: u64, m: &Shown<'_>) -> String {
    let text = |v: &Option<String>| printable(v.as_deref().unwrap_or("-"), "");
    let mut out = format!(
        "message {n}: {}\n  id: {}\n  type: {}\n  content_type: {}\n",
        printable(&m.origin, ""),
        text(&m.id),
        text(&m.kind),
        text(&m.content_type),
    );
    for (k, v) in &m.headers {
        out.push_str(&format!(
            "  header {}: {}\n",
            printable(k, ""),
            printable(v, "")
        ));
    }
    match std::str::from_utf8(m.body) {
        Ok(s) => out.push_str(&format!("  body: {}", printable(s, "\n\t"))),
        Err(_) => out.push_str(&format!("  body: ({} bytes, not UTF-8)", m.body.len())),
    }
    out
}

/// `text` with its control characters escaped, but those in `keep`.
fn printable(text: &str, keep: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && !keep.contains(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_printed_escaped() {
        let m = Shown {
            origin: "queue \"q\"".into(),
            id: Some("id\u{1b}[2J".into()),
            headers: vec![("ctl".into(), "a\u{1}b\nline2".into())],
            body: b"{\"a\":\n\t1}\x1b[31m",
            ..Shown::default()
        };
        let shown = describe(1, &m);
        assert!(shown.contains("  id: id\\u{1b}[2J\n"), "{shown}");
        assert!(
            shown.contains("  header ctl: a\\u{1}b\\nline2\n"),
            "{shown}"
        );
        assert!(
            shown.ends_with("  body: {\"a\":\n\t1}\\u{1b}[31m"),
            "{shown}"
        );
    }

    #[test]
    fn describe_shows_origin_id_type_headers_and_body() {
        let m = Shown {
            origin: "subject \"outbox.order.created\"".into(),
            id: Some("id-1".into()),
            kind: Some("created".into()),
            content_type: Some("application/json".into()),
            headers: vec![("ce-type".into(), "created".into())],
            body: br#"{"total": 99}"#,
        };
        assert_eq!(
            describe(3, &m),
            "message 3: subject \"outbox.order.created\"\n  id: id-1\n  type: created\n  content_type: application/json\n  header ce-type: created\n  body: {\"total\": 99}"
        );
        let bare = Shown {
            body: &[0xff, 0xfe],
            ..Shown::default()
        };
        let s = describe(2, &bare);
        assert!(
            s.contains("id: -") && s.ends_with("body: (2 bytes, not UTF-8)"),
            "{s}"
        );
    }
}
