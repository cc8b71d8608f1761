//! JetStream publish errors → [`Outcome`]: what the stream answered about this message is
//! message-level; no answer (a timeout, a lost connection) is connection-level and never
//! spends an attempt.

use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};

use crate::publish::Outcome;

/// JetStream API errors that say the server cannot store anything right now, whatever the
/// message: connection-level.
const SERVER_UNAVAILABLE: [ErrorCode; 9] = [
    ErrorCode::INSUFFICIENT_RESOURCES,
    ErrorCode::CLUSTER_NOT_AVAILABLE,
    ErrorCode::CLUSTER_NOT_ACTIVE,
    ErrorCode::CLUSTER_NO_PEERS,
    ErrorCode::CLUSTER_NOT_LEADER,
    ErrorCode::JETSTREAM_NOT_ENABLED,
    ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
    ErrorCode::STORAGE_RESOURCES_EXCEEDED,
    ErrorCode::MEMORY_RESOURCES_EXCEEDED,
];

/// Classifies a failed publish to `subject`.
///
/// - No stream captures the subject (the server answers "no responders"), the message is
///   larger than the server's `max_payload` (refused before sending) or the stream's
///   `max_msg_size`, the stream refused it (limits with `discard: new`, an expectation header
///   the row set): message-level.
/// - No acknowledgement within `ack_timeout`, the connection gone, the server out of
///   resources or JetStream not running: connection-level.
pub fn classify(err: &PublishError, subject: &str, ack_timeout: Duration) -> Outcome {
    use PublishErrorKind as K;
    match err.kind() {
        K::StreamNotFound => Outcome::Rejected(format!(
            "no JetStream stream captures subject {subject:.200?} (the server answered: no responders)"
        )),
        K::MaxPayloadExceeded => Outcome::Rejected(format!("{err} (the server's max_payload)")),
        K::WrongLastMessageId | K::WrongLastSequence => Outcome::Rejected(err.to_string()),
        K::TimedOut => Outcome::Unavailable(format!(
            "no publish acknowledgement within {} (publisher.nats.ack_timeout)",
            humantime::format_duration(ack_timeout)
        )),
        K::BrokenPipe | K::MaxAckPending => Outcome::Unavailable(err.to_string()),
        K::Other => match api_error(err) {
            Some(api) if SERVER_UNAVAILABLE.contains(&api.error_code()) => {
                Outcome::Unavailable(format!("JetStream cannot store now: {api}"))
            }
            Some(api) => Outcome::Rejected(format!(
                "the stream refused the message on {subject:.200?}: {api}"
            )),
            // Sending failed (the client is shutting down) or the answer was unreadable.
            None => Outcome::Unavailable(err.to_string()),
        },
    }
}

/// The JetStream API error the server answered with, if that is what `err` carries.
fn api_error(err: &PublishError) -> Option<&jetstream::Error> {
    std::error::Error::source(err).and_then(|s| s.downcast_ref::<jetstream::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: usize, err_code: u64, description: &str) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": code, "err_code": err_code, "description": description
        }))
        .unwrap()
    }

    fn kind(err: PublishError) -> &'static str {
        match classify(&err, "outbox.order.created", Duration::from_secs(30)) {
            Outcome::Confirmed => "confirmed",
            Outcome::Rejected(_) => "rejected",
            Outcome::Unavailable(_) => "unavailable",
        }
    }

    #[test]
    fn what_the_stream_answered_is_message_level_and_silence_is_not() {
        use PublishErrorKind as K;
        let with = |k, code, err_code, d| PublishError::with_source(k, api(code, err_code, d));
        for (err, expected) in [
            (PublishError::new(K::StreamNotFound), "rejected"),
            (
                PublishError::with_source(
                    K::MaxPayloadExceeded,
                    "Payload size limit of 1048576 exceeded",
                ),
                "rejected",
            ),
            (
                with(K::WrongLastMessageId, 400, 10070, "wrong last msg ID"),
                "rejected",
            ),
            (
                with(K::Other, 400, 10054, "message size exceeds maximum allowed"),
                "rejected",
            ),
            (
                with(K::Other, 503, 10077, "maximum messages exceeded"),
                "rejected",
            ),
            (
                with(K::Other, 400, 10060, "expected stream does not match"),
                "rejected",
            ),
            (PublishError::new(K::TimedOut), "unavailable"),
            (PublishError::new(K::BrokenPipe), "unavailable"),
            (PublishError::new(K::MaxAckPending), "unavailable"),
            (
                with(K::Other, 503, 10023, "insufficient resources"),
                "unavailable",
            ),
            (
                with(
                    K::Other,
                    503,
                    10008,
                    "JetStream system temporarily unavailable",
                ),
                "unavailable",
            ),
            (
                with(K::Other, 503, 10076, "JetStream not enabled"),
                "unavailable",
            ),
            (
                PublishError::with_source(K::Other, "channel closed"),
                "unavailable",
            ),
        ] {
            let text = err.to_string();
            assert_eq!(kind(err), expected, "{text}");
        }
    }

    #[test]
    fn reasons_name_the_subject_and_the_setting() {
        let t = Duration::from_secs(5);
        let no_stream = PublishError::new(PublishErrorKind::StreamNotFound);
        let Outcome::Rejected(why) = classify(&no_stream, "a.b", t) else {
            panic!("rejected")
        };
        assert!(
            why.contains("\"a.b\"") && why.contains("no responders"),
            "{why}"
        );
        let timeout = PublishError::new(PublishErrorKind::TimedOut);
        let Outcome::Unavailable(why) = classify(&timeout, "a.b", t) else {
            panic!("unavailable")
        };
        assert!(why.contains("5s") && why.contains("ack_timeout"), "{why}");
    }
}
