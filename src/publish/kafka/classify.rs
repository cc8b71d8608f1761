//! Delivery errors to outcomes: message-level (the record is at fault) or connection-level
//! (the cluster could not be reached or did not answer), which records a broker rejects with
//! their whole batch, and what an outcome says about the producer that reported it.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::publish::Outcome;

/// A delivery report: its outcome, and whether the broker's verdict may be about another
/// record of the same produce batch.
pub(super) struct Reported {
    pub(super) outcome: Outcome,
    pub(super) batch_wide: bool,
}

impl From<Outcome> for Reported {
    fn from(outcome: Outcome) -> Self {
        Self {
            outcome,
            batch_wide: false,
        }
    }
}

/// Whether the broker returns `err` for a whole produce batch (the records of one partition
/// sent in one request) when one record is the cause: a record too large for the topic, one
/// the broker finds invalid (a schema, a compacted topic's missing key), a policy. The other
/// records of the batch are not at fault and must not spend an attempt.
pub(super) fn batch_wide(err: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        err.rdkafka_error_code(),
        Some(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidMessage
                | C::InvalidRecord
                | C::PolicyViolation
                | C::UnsupportedForMessageFormat
        )
    )
}

/// What an outcome says about the producer that reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProducerState {
    /// It reaches the broker.
    Reaches,
    /// It does not reach the broker now (it reconnects by itself).
    Unreachable,
    /// It cannot be trusted any more (a fatal error, a record timed out in its queue): it
    /// must be replaced.
    Broken,
}

/// Maps a delivery error to an outcome: problems of this record (too large, unknown topic,
/// not authorised, invalid) are message-level; anything that says the cluster could not be
/// reached or did not answer in time is connection-level and never spends an attempt.
pub fn classify_error(err: &KafkaError) -> Outcome {
    use RDKafkaErrorCode as C;
    let text = err.to_string();
    match err.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::UnknownPartition
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::ClusterAuthorizationFailed
            | C::PolicyViolation
            | C::UnsupportedForMessageFormat
            | C::InvalidArgument
            | C::BadMessage,
        ) => Outcome::Rejected(text),
        _ => Outcome::Unavailable(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_message_and_connection_errors() {
        use RDKafkaErrorCode as C;
        let kind = |c| match classify_error(&KafkaError::MessageProduction(c)) {
            Outcome::Confirmed => "confirmed",
            Outcome::Rejected(_) => "rejected",
            Outcome::Unavailable(_) => "unavailable",
        };
        for (c, expected) in [
            (C::MessageSizeTooLarge, "rejected"),
            (C::UnknownTopicOrPartition, "rejected"),
            (C::UnknownTopic, "rejected"),
            (C::TopicAuthorizationFailed, "rejected"),
            (C::InvalidRecord, "rejected"),
            (C::MessageTimedOut, "unavailable"),
            (C::AllBrokersDown, "unavailable"),
            (C::BrokerTransportFailure, "unavailable"),
            (C::NotEnoughReplicas, "unavailable"),
            (C::RequestTimedOut, "unavailable"),
            (C::QueueFull, "unavailable"),
        ] {
            assert_eq!(kind(c), expected, "{c:?}");
        }
    }
}
