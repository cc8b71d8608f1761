//! Confirms and returns → outcomes: a confirm split from the returned message it carries
//! (charged by `message_id`), a settled message's answer, and the confirm of a message
//! published alone. A return means the message was unroutable (`mandatory`): message-level,
//! whatever the confirm says.

use std::collections::HashMap;

use lapin::Confirmation;

use super::settler::Settled;
use crate::publish::Outcome;

/// A confirm as the settler keeps it, its returned message (if any) taken out.
pub(super) enum Answer {
    Ack,
    Nack,
    NotRequested,
    Failed(lapin::Error),
}

/// The answer to a message: its return (if one carried its id), else its confirm.
pub(super) fn settle(returned: Option<String>, answer: Option<Answer>, connected: bool) -> Settled {
    match (returned, answer) {
        (Some(why), _) => Settled::Outcome(Outcome::Rejected(why)),
        (None, Some(Answer::Ack)) => Settled::Outcome(Outcome::Confirmed),
        (None, Some(Answer::Nack)) => {
            Settled::Outcome(Outcome::Rejected("nacked by the broker".to_owned()))
        }
        (None, Some(Answer::NotRequested)) => Settled::Outcome(Outcome::Unavailable(
            "channel is not in confirm mode".to_owned(),
        )),
        (None, Some(Answer::Failed(e))) if connected => Settled::ChannelClosed(e.to_string()),
        (None, Some(Answer::Failed(e))) => Settled::ConnectionLost(e.to_string()),
        (None, None) => Settled::ConnectionLost("no answer".to_owned()),
    }
}

/// Moves the returned message a confirm carries into `returned`, keyed by its `message_id`.
pub(super) fn strip_return(
    answer: Result<Confirmation, lapin::Error>,
    returned: &mut HashMap<String, String>,
) -> Answer {
    let (message, ack) = match answer {
        Ok(Confirmation::Ack(Some(m))) => (m, true),
        Ok(Confirmation::Nack(Some(m))) => (m, false),
        Ok(Confirmation::Ack(None)) => return Answer::Ack,
        Ok(Confirmation::Nack(None)) => return Answer::Nack,
        Ok(Confirmation::NotRequested) => return Answer::NotRequested,
        Err(e) => return Answer::Failed(e),
    };
    match message.delivery.properties.message_id() {
        Some(id) => {
            returned.insert(id.to_string(), returned_reason(&message));
        }
        None => tracing::error!(
            reply_code = message.reply_code,
            reply_text = %message.reply_text,
            "the broker returned a message without message_id; it cannot be charged to a row"
        ),
    }
    if ack { Answer::Ack } else { Answer::Nack }
}

fn returned_reason(m: &lapin::message::BasicReturnMessage) -> String {
    format!(
        "returned by the broker: {} {} (no queue bound for exchange {:?}, routing key {:?})",
        m.reply_code,
        m.reply_text,
        m.delivery.exchange.as_str(),
        m.delivery.routing_key.as_str()
    )
}

/// Maps the confirm of message `id`, published on a channel with nothing else unconfirmed, to
/// an outcome. An ack that carries a
/// returned message means the message was unroutable (`mandatory`): a failure, not a success.
/// A returned message that is not this one would mean the attribution is broken: the row is
/// handed back rather than guessed about.
pub fn classify_confirmation(confirmation: Confirmation, id: &str) -> Outcome {
    match confirmation {
        Confirmation::Ack(None) => Outcome::Confirmed,
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))
            if returned
                .delivery
                .properties
                .message_id()
                .as_ref()
                .is_some_and(|m| m.as_str() != id) =>
        {
            Outcome::Unavailable(format!(
                "a return for another message arrived with this confirm ({} {})",
                returned.reply_code, returned.reply_text
            ))
        }
        Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
            Outcome::Rejected(returned_reason(&returned))
        }
        Confirmation::Nack(None) => Outcome::Rejected("nacked by the broker".to_owned()),
        Confirmation::NotRequested => {
            Outcome::Unavailable("channel is not in confirm mode".to_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ack_is_confirmed_and_nack_rejected() {
        assert_eq!(
            classify_confirmation(Confirmation::Ack(None), "x"),
            Outcome::Confirmed
        );
        assert!(matches!(
            classify_confirmation(Confirmation::Nack(None), "x"),
            Outcome::Rejected(_)
        ));
        assert!(matches!(
            classify_confirmation(Confirmation::NotRequested, "x"),
            Outcome::Unavailable(_)
        ));
    }
}
