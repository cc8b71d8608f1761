//! The outbox row as the relay sees it once claimed: what the claim loop hands to a
//! transport and what the transports turn into a broker message. Shared by [`crate::store`]
//! (which reads it) and [`crate::publish`] (which sends it), so no transport depends on the
//! SQL module.

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// The name the relay gives its connections: PostgreSQL `application_name` (the ordering
/// guard ignores sessions with it), Kafka `client.id`, the AMQP connection name.
pub const APPLICATION_NAME: &str = "outbox-relay";

/// The W3C header naming the parent span: a message's [`OutboxMessage::traceparent`] is sent
/// under it, in place of the row's.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header carrying vendor state (passed through as the row wrote it).
pub const TRACESTATE: &str = "tracestate";

/// Whether payloads are JSON text or arbitrary bytes (detected from the column type at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PayloadKind {
    /// `jsonb` or `json`: sent as JSON text, content type `application/json`.
    Json,
    /// `bytea`: sent as is, content type `application/octet-stream`.
    Binary,
}

impl PayloadKind {
    /// The `datacontenttype` sent with the message.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Json => "application/json",
            Self::Binary => "application/octet-stream",
        }
    }
}

/// One claimed outbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// Message id, for downstream dedup.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Aggregate type (may be empty).
    pub aggregate_type: String,
    /// Aggregate id; `None` means no ordering constraint.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Body bytes.
    pub payload: Vec<u8>,
    /// The row's `headers` JSON text (an object, normally).
    pub headers: Vec<u8>,
    /// Per-row routing key / topic override.
    pub destination: Option<String>,
    /// Attempts including this one.
    pub attempts: i32,
    /// When the application inserted the row.
    pub created_at: DateTime<Utc>,
    /// Deadline after which the row is no longer published (`None`: never expires).
    pub expires_at: Option<DateTime<Utc>>,
    /// The `traceparent` sent in place of the row's when tracing is on: this attempt's span
    /// context ([`crate::otel::attempt`]). Never stored; `None` sends the row's headers as
    /// they are.
    pub traceparent: Option<String>,
}
