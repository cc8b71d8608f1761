//! `tail` on NATS: a core NATS subscription to the subjects the relay publishes to. A stream
//! capturing those subjects stores each message as before; the subscription sees it as it is
//! published and takes nothing from the stream (no consumer is created).

use async_nats::{ConnectOptions, Message};
use futures::StreamExt;
use futures::stream::select_all;
use tokio_util::sync::CancellationToken;

use super::{Shown, TailError, describe};
use crate::config::nats::{ServerUrl, redact};
use crate::publish::nats::authenticate;

/// The longest wait to connect and to have the subscriptions confirmed.
const WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why `pattern` cannot be subscribed to, if it cannot: empty, whitespace or control
/// characters, an empty token, a wildcard inside a token (`a*`), or `>` before the last token.
pub fn check_pattern(pattern: &str) -> Result<(), String> {
    if pattern.is_empty() {
        return Err("it is empty".to_owned());
    }
    if pattern.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it contains whitespace or control characters".to_owned());
    }
    let tokens: Vec<&str> = pattern.split('.').collect();
    for (i, token) in tokens.iter().enumerate() {
        if token.is_empty() {
            return Err("it has an empty token (a leading, trailing or double '.')".to_owned());
        }
        if *token == ">" && i + 1 < tokens.len() {
            return Err("'>' may only be the last token".to_owned());
        }
        if token.len() > 1 && token.contains(['*', '>']) {
            return Err(format!(
                "{token:?} mixes a wildcard with other characters ('*' and '>' are whole tokens)"
            ));
        }
    }
    Ok(())
}

/// Subscribes to `subjects` on the server at `url` and prints each message to stdout until
/// `count` messages were printed (all of them when `None`) or `shutdown` is cancelled.
pub async fn tail_nats(
    url: &str,
    subjects: &[String],
    count: Option<u64>,
    shutdown: CancellationToken,
) -> Result<u64, TailError> {
    let connect = |reason: String| TailError::NatsConnect {
        url: redact(url),
        reason,
    };
    let server = ServerUrl::parse(url).map_err(&connect)?;
    let client = authenticate(&server, ConnectOptions::new())
        .name("outbox-relay tail")
        .connection_timeout(WAIT)
        .connect(server.address.as_str())
        .await
        .map_err(|e| connect(e.to_string()))?;
    let mut subscriptions = Vec::with_capacity(subjects.len());
    for subject in subjects {
        let refused = |reason: String| TailError::Subscribe {
            subject: subject.clone(),
            reason,
        };
        let sub = client
            .subscribe(subject.clone())
            .await
            .map_err(|e| refused(e.to_string()))?;
        subscriptions.push(sub);
    }
    // The server has the subscriptions once it answered the flush's PING.
    match tokio::time::timeout(WAIT, client.flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(connect(e.to_string())),
        Err(_) => return Err(connect(format!("no answer within {WAIT:?}"))),
    }
    eprintln!(
        "tail: waiting for messages on NATS subjects {subjects:?} (a core subscription: nothing is taken from any stream); Ctrl-C to stop"
    );
    let mut messages = select_all(subscriptions);
    let mut printed = 0u64;
    while count.is_none_or(|c| printed < c) {
        let next = tokio::select! {
            m = messages.next() => m,
            () = shutdown.cancelled() => break,
        };
        let Some(message) = next else {
            break;
        };
        printed += 1;
        println!("{}", describe(printed, &shown(&message)));
    }
    drop(messages);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), client.drain()).await;
    Ok(printed)
}

/// A NATS message as `tail` shows it: `Nats-Msg-Id` as its id, `ce-type` as its type,
/// `Content-Type`, every header (sorted by name; each value of a repeated one).
pub fn shown(message: &Message) -> Shown<'_> {
    let mut headers: Vec<(String, String)> = message
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |v| (name.to_string(), v.as_str().to_owned()))
        })
        .collect();
    headers.sort();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    Shown {
        origin: format!("subject {:?}", message.subject.as_str()),
        id: header("Nats-Msg-Id"),
        kind: header("ce-type"),
        content_type: header("Content-Type"),
        body: &message.payload,
        headers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_checked_like_the_server_does() {
        for ok in ["outbox.>", "outbox.*.created", ">", "a.b", "*"] {
            assert_eq!(check_pattern(ok), Ok(()), "{ok}");
        }
        for (bad, says) in [
            ("", "empty"),
            ("a b", "whitespace"),
            ("a..b", "empty token"),
            ("a.>.b", "last token"),
            ("a.b*", "whole tokens"),
            ("outbox.", "empty token"),
        ] {
            let e = check_pattern(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_message_shows_its_subject_id_type_and_sorted_headers() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("ce-type", "created");
        headers.insert("Nats-Msg-Id", "id-1");
        headers.insert("Content-Type", "application/json");
        let message = Message {
            subject: "outbox.order.created".into(),
            reply: None,
            payload: "{}".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 0,
        };
        assert_eq!(
            describe(1, &shown(&message)),
            "message 1: subject \"outbox.order.created\"\n  id: id-1\n  type: created\n  content_type: application/json\n  header Content-Type: application/json\n  header Nats-Msg-Id: id-1\n  header ce-type: created\n  body: {}"
        );
    }
}
