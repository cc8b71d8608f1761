//! The broker-less sink for development and piping (`publisher.kind = "stdout"`): every message
//! is one CloudEvents *structured mode* JSON object on its own line of standard output,
//! confirmed once the line is written and flushed. Logs go to standard error, so standard
//! output carries nothing but these lines (`outbox-relay run | jq .`).
//!
//! A failed write (the reader went away: `EPIPE`) is connection-level: the row is handed back
//! without spending an attempt and the relay stops claiming, since nothing will read further
//! lines; nothing is lost.

use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use base64::Engine as _;
use serde_json::Value;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex;

use super::envelope::{self, EnvelopeConfig};
use super::{ConnectError, Outcome, Publisher};
use crate::message::{OutboxMessage, PayloadKind};

/// Writes messages as JSON lines to standard output (or, in tests, any writer).
pub struct StdoutPublisher {
    // One writer, one line at a time: lines of concurrent chains never interleave.
    out: Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
    // Cleared by a failed write: the reader is gone and will not come back.
    writable: AtomicBool,
}

impl Default for StdoutPublisher {
    fn default() -> Self {
        Self::new()
    }
}

impl StdoutPublisher {
    /// Writes to the process's standard output.
    pub fn new() -> Self {
        Self::with_writer(Box::new(tokio::io::stdout()))
    }

    /// Writes to `out` instead of standard output.
    pub fn with_writer(out: Box<dyn AsyncWrite + Send + Unpin>) -> Self {
        Self {
            out: Mutex::new(out),
            writable: AtomicBool::new(true),
        }
    }
}

/// The message as one CloudEvents structured-mode JSON object (no trailing newline):
/// the context attributes, `datacontenttype`, and `data` (a JSON payload, re-serialised on one
/// line) or `data_base64` (a bytea payload). Attributes without a value are left out.
pub fn structured_event(msg: &OutboxMessage, cfg: &EnvelopeConfig) -> Result<String, String> {
    let mut fields: Vec<(&str, Value)> = envelope::cloud_event_attributes(msg, cfg)
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect();
    fields.push((
        "datacontenttype",
        Value::String(cfg.payload_kind.content_type().to_owned()),
    ));
    match cfg.payload_kind {
        PayloadKind::Json => {
            // A `json` column keeps the text as inserted, newlines included: parse and write
            // it compactly so that one message stays one line.
            let data: Value = serde_json::from_slice(&msg.payload)
                .map_err(|e| format!("payload is not valid JSON: {e}"))?;
            fields.push(("data", data));
        }
        PayloadKind::Binary => fields.push((
            "data_base64",
            Value::String(base64::engine::general_purpose::STANDARD.encode(&msg.payload)),
        )),
    }
    serde_json::to_string(&InOrder(&fields)).map_err(|e| format!("cannot serialise: {e}"))
}

/// Fields serialised as one JSON object in the order given (a `serde_json::Map` would sort
/// them).
struct InOrder<'a>(&'a [(&'a str, Value)]);

impl serde::Serialize for InOrder<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[async_trait]
impl Publisher for StdoutPublisher {
    fn kind(&self) -> &'static str {
        "stdout"
    }

    fn describe(&self) -> String {
        "stdout (CloudEvents JSON lines)".to_owned()
    }

    fn destination_name(&self, _msg: &OutboxMessage, _env: &EnvelopeConfig) -> String {
        "stdout".to_owned()
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        if self.is_connected() {
            Ok(())
        } else {
            Err(ConnectError(
                "standard output is closed (the reading end of the pipe went away); stopped publishing"
                    .to_owned(),
            ))
        }
    }

    fn is_connected(&self) -> bool {
        self.writable.load(Ordering::Relaxed)
    }

    async fn publish(&self, msg: &OutboxMessage, envelope: &EnvelopeConfig) -> Outcome {
        let mut line = match structured_event(msg, envelope) {
            Ok(line) => line,
            Err(reason) => return Outcome::Rejected(reason),
        };
        line.push('\n');
        let mut out = self.out.lock().await;
        let written = async {
            out.write_all(line.as_bytes()).await?;
            out.flush().await
        }
        .await;
        match written {
            Ok(()) => Outcome::Confirmed,
            Err(e) => {
                self.writable.store(false, Ordering::Relaxed);
                Outcome::Unavailable(format!("cannot write to standard output: {e}"))
            }
        }
    }

    async fn close(&self) {
        let _ = self.out.lock().await.flush().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::envelope::tests::message;

    fn cfg(payload_kind: PayloadKind) -> EnvelopeConfig {
        EnvelopeConfig {
            source: "/outbox/test/outbox_messages".into(),
            payload_kind,
            signer: None,
            route: crate::template::Template::parse("r").unwrap(),
        }
    }

    #[test]
    fn json_payload_is_data_on_one_line() {
        let mut m = message("{}");
        m.payload = b"{\n  \"total\": 12.50,\n  \"items\": [1, 2]\n}".to_vec();
        let line = structured_event(&m, &cfg(PayloadKind::Json)).unwrap();
        assert!(!line.contains('\n'), "{line}");
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000000");
        assert_eq!(v["type"], "created");
        assert_eq!(v["source"], "/outbox/test/outbox_messages");
        assert_eq!(v["subject"], "42");
        assert_eq!(v["aggregatetype"], "order");
        assert_eq!(v["time"], "2026-01-02T03:04:05.000000Z");
        assert_eq!(v["datacontenttype"], "application/json");
        // arbitrary_precision keeps the number as written.
        assert!(line.contains("\"total\":12.50"), "{line}");
        assert_eq!(v["data"]["items"][1], 2);
        assert!(v.get("data_base64").is_none());
    }

    #[test]
    fn binary_payload_is_base64_and_missing_subject_is_omitted() {
        let mut m = message("{}");
        m.payload = vec![0, 159, 146, 150, b'\n'];
        m.aggregate_id = None;
        let line = structured_event(&m, &cfg(PayloadKind::Binary)).unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["data_base64"], "AJ+Slgo=");
        assert_eq!(v["datacontenttype"], "application/octet-stream");
        assert!(v.get("data").is_none() && v.get("subject").is_none(), "{v}");
    }

    #[test]
    fn invalid_json_payload_is_rejected_not_written() {
        let mut m = message("{}");
        m.payload = b"{not json".to_vec();
        assert!(structured_event(&m, &cfg(PayloadKind::Json)).is_err());
    }

    #[tokio::test]
    async fn confirmed_after_the_line_is_written_and_a_closed_pipe_stops_publishing() {
        let (writer, mut reader) = tokio::io::duplex(1 << 16);
        let p = StdoutPublisher::with_writer(Box::new(writer));
        let env = cfg(PayloadKind::Json);
        assert_eq!(p.publish(&message("{}"), &env).await, Outcome::Confirmed);
        let mut buf = vec![0u8; 4096];
        let n = tokio::io::AsyncReadExt::read(&mut reader, &mut buf)
            .await
            .unwrap();
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        assert!(
            text.ends_with("}\n") && text.matches('\n').count() == 1,
            "{text}"
        );

        drop(reader);
        assert!(matches!(
            p.publish(&message("{}"), &env).await,
            Outcome::Unavailable(_)
        ));
        assert!(!p.is_connected());
        assert!(p.connect().await.is_err());
    }
}
