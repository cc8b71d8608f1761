//! `tail` on RabbitMQ: consumes a queue, acknowledging each message once printed.

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio_util::sync::CancellationToken;

use super::{Shown, TailError, describe};
use crate::publish::rabbitmq::declare_queue;
use crate::redact::redact_url;

/// Consumes `queue` on the broker at `url` and prints each message to stdout until `count`
/// messages were printed (all of them when `None`) or `shutdown` is cancelled.
pub async fn tail(
    url: &str,
    queue: &str,
    count: Option<u64>,
    shutdown: CancellationToken,
) -> Result<u64, TailError> {
    let connect = |source| TailError::Connect {
        url: redact_url(url),
        source,
    };
    let props =
        ConnectionProperties::default().with_connection_name(LongString::from("outbox-relay tail"));
    let conn = Connection::connect(url, props).await.map_err(connect)?;
    let channel = conn.create_channel().await.map_err(connect)?;
    let (mut consumer, waiting) = subscribe(&channel, queue).await?;
    eprintln!(
        "tail: waiting for messages on queue {queue:?} ({} already there); Ctrl-C to stop",
        waiting
    );
    let failed = |source| TailError::Consume {
        queue: queue.to_owned(),
        source,
    };
    let mut printed = 0u64;
    while count.is_none_or(|c| printed < c) {
        let next = tokio::select! {
            d = consumer.next() => d,
            () = shutdown.cancelled() => break,
        };
        let delivery = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(failed(e)),
            None => break,
        };
        printed += 1;
        println!(
            "{}",
            describe(
                printed,
                &shown(
                    delivery.exchange.as_str(),
                    delivery.routing_key.as_str(),
                    &delivery.properties,
                    &delivery.data,
                )
            )
        );
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(failed)?;
    }
    let _ = conn.close(200, ShortString::from("tail done")).await;
    Ok(printed)
}

/// Consumes `queue` (which must exist) on `channel`, 16 unacknowledged at most; returns the
/// consumer and how many messages were waiting.
async fn subscribe(
    channel: &lapin::Channel,
    queue: &str,
) -> Result<(lapin::Consumer, u32), TailError> {
    let no_queue = |source| TailError::NoQueue {
        queue: queue.to_owned(),
        source,
    };
    // Passive: never create a queue by accident (a typo would then wait forever).
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = declare_queue(channel, queue, passive)
        .await
        .map_err(no_queue)?;
    channel
        .basic_qos(16, BasicQosOptions::default())
        .await
        .map_err(no_queue)?;
    let consumer = channel
        .basic_consume(
            ShortString::from(queue.to_owned()),
            ShortString::from("outbox-relay-tail"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(no_queue)?;
    Ok((consumer, declared.message_count()))
}

/// A delivery as `tail` shows it.
pub fn shown<'a>(
    exchange: &str,
    routing_key: &str,
    props: &BasicProperties,
    body: &'a [u8],
) -> Shown<'a> {
    let text = |v: &Option<ShortString>| v.as_ref().map(ToString::to_string);
    let headers = props.headers().as_ref().map_or_else(Vec::new, |h| {
        h.inner()
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    AMQPValue::LongString(s) => s.to_string(),
                    AMQPValue::ShortString(s) => s.to_string(),
                    other => format!("{other:?}"),
                };
                (k.to_string(), v)
            })
            .collect()
    });
    Shown {
        origin: format!("exchange {exchange:?}, routing key {routing_key:?}"),
        id: text(props.message_id()),
        kind: text(props.kind()),
        content_type: text(props.content_type()),
        headers,
        body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe_shows_id_type_route_headers_and_body() {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("cloudEvents:type"),
            AMQPValue::LongString(LongString::from("order.created")),
        );
        let props = BasicProperties::default()
            .with_message_id(ShortString::from("id-1"))
            .with_type(ShortString::from("order.created"))
            .with_content_type(ShortString::from("application/json"))
            .with_headers(headers);
        let body = br#"{"total": 99}"#;
        let s = describe(1, &shown("outbox", "order.order.created", &props, body));
        assert_eq!(
            s,
            "message 1: exchange \"outbox\", routing key \"order.order.created\"\n  id: id-1\n  type: order.created\n  content_type: application/json\n  header cloudEvents:type: order.created\n  body: {\"total\": 99}"
        );
        let s = describe(
            2,
            &shown("x", "k", &BasicProperties::default(), &[0xff, 0xfe]),
        );
        assert!(
            s.contains("id: -") && s.ends_with("body: (2 bytes, not UTF-8)"),
            "{s}"
        );
    }
}
