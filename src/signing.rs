//! Message signatures (docs/wire-format.md): an HMAC-SHA256 over the identity of a message, so that a
//! consumer can tell a relayed event from one published by anyone else holding broker
//! credentials.
//!
//! The header `outbox-signature` carries `v1;kid=<key id>;sig=<base64 of the MAC>`. The MAC
//! covers the lines of [`canonical`]: the attributes that say what the message is and where it
//! was routed, and the SHA-256 of the body — never what the relay changes between attempts, so
//! a retried message carries the same signature.
//!
//! HMAC and SHA-256 come from aws-lc-rs, the crypto library rustls already links into the
//! binary for TLS: no second implementation, and its SHA-256 uses the CPU's SHA extensions.

use std::fmt;

use aws_lc_rs::{digest, hmac};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// The header name on both brokers.
pub const HEADER: &str = "outbox-signature";

/// Version tag of the canonical string and the header value.
pub const VERSION: &str = "v1";

/// The fields a signature covers, as they are sent.
#[derive(Debug, Clone, Copy)]
pub struct Signed<'a> {
    /// CloudEvents `id` (the row id).
    pub id: &'a str,
    /// CloudEvents `source`.
    pub source: &'a str,
    /// CloudEvents `type` (the event type).
    pub event_type: &'a str,
    /// CloudEvents `subject` (the aggregate id), if any.
    pub subject: Option<&'a str>,
    /// The rendered RabbitMQ routing key or Kafka topic.
    pub route: &'a str,
    /// CloudEvents `time`, exactly as sent.
    pub time: &'a str,
    /// `datacontenttype`.
    pub content_type: &'a str,
    /// The body.
    pub body: &'a [u8],
}

/// The string the MAC is computed over: `v1`, id, source, type, subject (empty if none),
/// route, time, datacontenttype and the lowercase hex SHA-256 of the body, joined by `\n`.
pub fn canonical(s: &Signed<'_>) -> String {
    let body_hash = digest::digest(&digest::SHA256, s.body);
    let mut hex = String::with_capacity(64);
    for b in body_hash.as_ref() {
        hex.push(char::from(HEX[usize::from(b >> 4)]));
        hex.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    [
        VERSION,
        s.id,
        s.source,
        s.event_type,
        s.subject.unwrap_or(""),
        s.route,
        s.time,
        s.content_type,
        &hex,
    ]
    .join("\n")
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Signs messages with one key (the `[signing]` section). Its `Debug` shows the key id only.
pub struct Signer {
    key_id: String,
    key: hmac::Key,
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signer")
            .field("key_id", &self.key_id)
            .field("key", &"<redacted>")
            .finish()
    }
}

impl Signer {
    /// A signer for `key` (already validated: at least 32 bytes) under `key_id`.
    pub fn new(key_id: &str, key: &[u8]) -> Self {
        Self {
            key_id: key_id.to_owned(),
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
        }
    }

    /// The key id written into every signature.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The `outbox-signature` header value for `s`.
    pub fn sign(&self, s: &Signed<'_>) -> String {
        let tag = hmac::sign(&self.key, canonical(s).as_bytes());
        format!(
            "{VERSION};kid={};sig={}",
            self.key_id,
            STANDARD.encode(tag.as_ref())
        )
    }
}

/// The Standard Webhooks headers (HTTP sink): the message id, the unix time of the attempt
/// and the signature, as the Standard Webhooks libraries verify them.
pub const WEBHOOK_ID: &str = "webhook-id";
/// See [`WEBHOOK_ID`].
pub const WEBHOOK_TIMESTAMP: &str = "webhook-timestamp";
/// See [`WEBHOOK_ID`].
pub const WEBHOOK_SIGNATURE: &str = "webhook-signature";

impl Signer {
    /// The Standard Webhooks `webhook-signature` value: `v1,<base64 HMAC-SHA256 of
    /// "<id>.<timestamp>.<body>">`, with this signer's key bytes as the secret.
    pub fn webhook_signature(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(id.as_bytes());
        ctx.update(b".");
        ctx.update(timestamp.to_string().as_bytes());
        ctx.update(b".");
        ctx.update(body);
        format!("v1,{}", STANDARD.encode(ctx.sign().as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(body: &[u8]) -> Signed<'_> {
        Signed {
            id: "0b9f8a4e-8c43-4c57-9d0e-3c1f3c6f3d11",
            source: "/outbox/app/outbox_messages",
            event_type: "OrderPlaced",
            subject: Some("order-42"),
            route: "order.OrderPlaced",
            time: "2026-01-02T03:04:05.123456Z",
            content_type: "application/json",
            body,
        }
    }

    #[test]
    fn canonical_string_lists_the_contract_fields_in_order() {
        let c = canonical(&fields(b"{}"));
        let lines: Vec<&str> = c.split('\n').collect();
        assert_eq!(
            lines,
            [
                "v1",
                "0b9f8a4e-8c43-4c57-9d0e-3c1f3c6f3d11",
                "/outbox/app/outbox_messages",
                "OrderPlaced",
                "order-42",
                "order.OrderPlaced",
                "2026-01-02T03:04:05.123456Z",
                "application/json",
                // sha256("{}")
                "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
            ]
        );
        let mut no_subject = fields(b"{}");
        no_subject.subject = None;
        assert_eq!(canonical(&no_subject).split('\n').nth(4), Some(""));
    }

    #[test]
    fn signature_matches_a_known_hmac_sha256() {
        // Computed independently with Python's hmac, hashlib and base64 modules over the
        // canonical string above and this 32-byte key.
        let signer = Signer::new("k1", b"0123456789abcdef0123456789abcdef");
        let header = signer.sign(&fields(b"{}"));
        assert_eq!(
            header,
            "v1;kid=k1;sig=IWvJfqq1WUZwI5isWSYXBP6kRp+RbIfcj+x7oA2rmvc="
        );
        // Same input, same signature (a retry); another body, another signature.
        assert_eq!(signer.sign(&fields(b"{}")), header);
        assert_ne!(signer.sign(&fields(b"{ }")), header);
    }

    #[test]
    fn webhook_signature_matches_the_standard_webhooks_example() {
        // The example of the Standard Webhooks specification: secret
        // whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw (its base64 decoded), id msg_p5jXN8AQM9LWM0D4loKWxJek,
        // timestamp 1614265330, body {"test": 2432232314}.
        let key = STANDARD.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let signer = Signer::new("k1", &key);
        assert_eq!(
            signer.webhook_signature(
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn debug_never_shows_the_key() {
        let signer = Signer::new("k1", b"super-secret-key-material-0123456789");
        let shown = format!("{signer:?}");
        assert!(
            shown.contains("k1") && !shown.contains("super-secret"),
            "{shown}"
        );
    }
}
