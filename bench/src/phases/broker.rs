//! The broker ceilings: the relay's publishers alone, and raw lapin on one channel.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use futures::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_relay::config::{Ordering, PublisherConfig, PublisherKind};
use outbox_relay::message::{OutboxMessage, PayloadKind};
use outbox_relay::publish::envelope::{self, EnvelopeConfig};
use outbox_relay::publish::{Outcome, Publisher};
use serde_json::json;
use uuid::Uuid;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, CpuUsage, payload};

/// `n` messages as the relay would have claimed them from the bench's tables (first attempt,
/// ~300 B payload, round robin over `aggregates`).
pub(super) fn synthetic(n: usize, aggregates: usize) -> Vec<OutboxMessage> {
    let now = chrono::Utc::now();
    let a = aggregates as u64;
    (1..=n as u64)
        .map(|i| OutboxMessage {
            id: Uuid::new_v4(),
            seq: i64::try_from(i).unwrap_or(i64::MAX),
            aggregate_type: "order".into(),
            aggregate_id: Some(crate::util::aggregate_id(i, a)),
            event_type: "OrderPlaced".into(),
            payload: payload(i, a).into_bytes(),
            headers: b"{}".to_vec(),
            destination: None,
            attempts: 1,
            created_at: now,
            expires_at: None,
            traceparent: None,
        })
        .collect()
}

struct Blast {
    elapsed: Duration,
    usage: CpuUsage,
    confirmed: usize,
    first_failure: Option<String>,
}

/// Publishes every message with at most `in_flight` outstanding.
async fn blast(
    p: &dyn Publisher,
    envelope: &EnvelopeConfig,
    msgs: &[OutboxMessage],
    in_flight: usize,
) -> Blast {
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut outcomes = futures::stream::iter(msgs)
        .map(|m| p.publish(m, envelope))
        .buffer_unordered(in_flight);
    let mut confirmed = 0;
    let mut first_failure = None;
    while let Some(o) = outcomes.next().await {
        match o {
            Outcome::Confirmed => confirmed += 1,
            other => {
                if first_failure.is_none() {
                    first_failure = Some(format!("{other:?}"));
                }
            }
        }
    }
    Blast {
        elapsed: started.elapsed(),
        usage: cpu.usage(),
        confirmed,
        first_failure,
    }
}

/// The relay's publishers alone: N synthetic messages, nothing read from the database.
pub async fn broker_ceiling(ctx: &mut Ctx) -> Result<()> {
    let n = ctx.rows;
    let msgs = synthetic(n, ctx.args.aggregates);
    let avg = msgs.iter().map(|m| m.payload.len()).sum::<usize>() as f64 / n.max(1) as f64;
    ctx.report
        .detail("synthetic_payload_bytes", json!(avg.round()));
    let mut errors = Vec::new();

    // RabbitMQ: a fresh exchange bound to a fresh durable queue.
    if let Err(e) = publisher_ceiling(ctx, Broker::RabbitMq, &msgs).await {
        errors.push(format!("RabbitMQ: {e:#}"));
    }
    ctx.cleanup().await;

    // The broker itself: raw lapin, one confirm-mode channel, ≤1000 unconfirmed, persistent
    // and mandatory (what the broker can take, whatever the relay's publisher design): bare
    // messages, then the same messages with the properties and CloudEvents headers the relay
    // sends (what the broker can take of the relay's wire format).
    if let Err(e) = raw_ceiling(ctx, &msgs, Props::Bare).await {
        errors.push(format!("RabbitMQ raw: {e:#}"));
    }
    ctx.cleanup().await;
    if let Err(e) = raw_envelope_ceiling(ctx, &msgs).await {
        errors.push(format!("RabbitMQ raw: {e:#}"));
    }
    ctx.cleanup().await;

    // Kafka: a fresh 3-partition topic.
    if let Err(e) = publisher_ceiling(ctx, Broker::Kafka, &msgs).await {
        errors.push(format!("Kafka: {e:#}"));
    }
    super::all_ok(errors)
}

/// Raw lapin over one channel with the properties and CloudEvents headers the relay sends
/// (`rabbitmq_raw_envelope_ceiling_*`, with the machine's CPU per 100k for the shared
/// ceilings).
pub(super) async fn raw_envelope_ceiling(ctx: &mut Ctx, msgs: &[OutboxMessage]) -> Result<()> {
    let cfg = ctx.config("bench_unused", |raw| {
        raw.publisher.kind = PublisherKind::RabbitMq;
    })?;
    let PublisherConfig::RabbitMq(rabbitmq) = &cfg.publisher else {
        bail!(
            "a RabbitMQ configuration validated as {}",
            cfg.publisher.kind()
        );
    };
    let envelope = EnvelopeConfig::for_outbox(&cfg, &cfg.outboxes[0], PayloadKind::Json);
    let as_the_relay = Props::AsTheRelay {
        envelope: &envelope,
        prefix: rabbitmq.cloudevents_prefix.as_str(),
    };
    raw_ceiling(ctx, msgs, as_the_relay).await
}

/// A bare rdkafka `FutureProducer` with the relay's producer settings
/// (`KafkaPublisher::client_config`: acks=all, idempotent) sending every message with the
/// relay's key (the aggregate id) and headers (`ce_*` CloudEvents attributes, `content-type`)
/// into a fresh 3-partition topic, ≤1000 delivery reports outstanding: `kafka_bare_*`, with
/// the machine's CPU per 100k for the shared ceilings. Records are built in the timed loop,
/// as the relay builds them per message.
pub(super) async fn kafka_bare_ceiling(ctx: &mut Ctx, msgs: &[OutboxMessage]) -> Result<()> {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let n = msgs.len();
    let topic = ctx.new_topic("kbare").await?;
    let cfg = ctx.config("bench_unused", |raw| {
        raw.publisher.kind = PublisherKind::Kafka;
        raw.publisher.kafka.topic = topic.clone();
    })?;
    let PublisherConfig::Kafka(kafka) = &cfg.publisher else {
        bail!(
            "a Kafka configuration validated as {}",
            cfg.publisher.kind()
        );
    };
    let envelope = EnvelopeConfig::for_outbox(&cfg, &cfg.outboxes[0], PayloadKind::Json);
    let producer: FutureProducer =
        outbox_relay::publish::kafka::KafkaPublisher::client_config(kafka, false)
            .create()
            .context("cannot create the bare Kafka producer")?;
    let content_type = envelope.payload_kind.content_type();
    ctx.progress(format!(
        "broker: bare rdkafka producer, {n} messages, ≤1000 outstanding"
    ));
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut delivered = 0;
    let mut first_failure = None;
    let mut settle = |r: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, _>| match r
    {
        Ok(Ok(_)) => delivered += 1,
        Ok(Err((e, _))) => {
            first_failure.get_or_insert_with(|| format!("{e}"));
        }
        Err(e) => {
            first_failure.get_or_insert_with(|| format!("{e}"));
        }
    };
    for m in msgs {
        while pending.len() >= 1000 {
            if let Some(r) = pending.next().await {
                settle(r);
            }
        }
        let mut headers = OwnedHeaders::new_with_capacity(8);
        for (name, value) in envelope::cloud_event_attributes(m, &envelope) {
            let key = format!("ce_{name}");
            headers = headers.insert(Header {
                key: &key,
                value: Some(value.as_bytes()),
            });
        }
        headers = headers.insert(Header {
            key: "content-type",
            value: Some(content_type.as_bytes()),
        });
        let mut record = FutureRecord::to(&topic)
            .payload(&m.payload)
            .headers(headers);
        if let Some(key) = &m.aggregate_id {
            record = record.key(key);
        }
        loop {
            match producer.send_result(record) {
                Ok(delivery) => {
                    pending.push(delivery);
                    break;
                }
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    r,
                )) => {
                    record = r;
                    if let Some(done) = pending.next().await {
                        settle(done);
                    }
                }
                Err((e, _)) => bail!("bare Kafka producer: {e}"),
            }
        }
    }
    while let Some(r) = pending.next().await {
        settle(r);
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    drop(producer);
    ctx.check(sentinel).await?;
    if let Some(f) = first_failure {
        bail!("bare Kafka producer: {delivered} of {n} delivered; first failure: {f}");
    }
    let label = "bare rdkafka producer (the relay's settings: acks=all, idempotent), the relay's key and headers, ≤1000 outstanding";
    report_ceiling(
        ctx,
        "Kafka bare rdkafka",
        ("kafka_bare", label),
        n,
        elapsed,
        &usage,
    );
    super::machine_cpu_figure(
        ctx,
        "2 broker ceiling",
        "kafka_bare",
        "bare rdkafka producer + tansu",
        (elapsed, &usage),
    );
    Ok(())
}

/// The broker of a publisher ceiling.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Broker {
    RabbitMq,
    Kafka,
}

/// One publisher ceiling: the relay's own publisher for `broker` (as `publish::build` makes
/// it, `ordering = "none"`), every message, ≤1000 in flight.
async fn publisher_ceiling(ctx: &mut Ctx, broker: Broker, msgs: &[OutboxMessage]) -> Result<()> {
    let n = msgs.len();
    let (name, key, label, target) = match broker {
        Broker::RabbitMq => (
            "RabbitMQ",
            "rabbitmq_ceiling",
            "RabbitMqPublisher, persistent + confirms, ≤1000 in flight",
            ctx.new_binding("brk").await?,
        ),
        Broker::Kafka => (
            "Kafka",
            "kafka_ceiling",
            "KafkaPublisher, acks=all, idempotent, ≤1000 in flight",
            ctx.new_topic("brk").await?,
        ),
    };
    let cfg = ctx.config("bench_unused", |raw| {
        raw.relay.ordering = Ordering::None;
        match broker {
            Broker::RabbitMq => {
                raw.publisher.kind = PublisherKind::RabbitMq;
                raw.publisher.rabbitmq.exchange = target.clone();
            }
            Broker::Kafka => {
                raw.publisher.kind = PublisherKind::Kafka;
                raw.publisher.kafka.topic = target.clone();
            }
        }
    })?;
    let p = outbox_relay::publish::build(&cfg);
    let envelope = EnvelopeConfig::for_outbox(&cfg, &cfg.outboxes[0], PayloadKind::Json);
    p.connect().await.map_err(|e| anyhow!("{e}"))?;
    ctx.progress(format!("broker: {name}, {n} messages, ≤1000 in flight"));
    let sentinel = ctx.sentinel().await;
    let b = blast(p.as_ref(), &envelope, msgs, 1000).await;
    p.close().await;
    ctx.check(sentinel).await?;
    if let Some(f) = &b.first_failure {
        bail!(
            "{name}: {} of {n} confirmed; first failure: {f}",
            b.confirmed
        );
    }
    if broker == Broker::RabbitMq {
        let queued = ctx.rabbit().await?.queue_len(&target).await?;
        if queued as usize != n {
            ctx.report.note(format!(
                "broker ceiling: queue holds {queued} messages, expected {n}"
            ));
        }
    }
    report_ceiling(ctx, name, (key, label), n, b.elapsed, &b.usage);
    Ok(())
}

/// Reports a broker ceiling: a progress line (`name`'s rate), the figure `<key>_msgs_per_s`
/// labelled `label`, and the detail `key`.
fn report_ceiling(
    ctx: &mut Ctx,
    name: &str,
    (key, label): (&str, &str),
    n: usize,
    elapsed: Duration,
    usage: &CpuUsage,
) {
    let r = rate(n, elapsed);
    ctx.progress(format!(
        "broker: {name} {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(usage)
    ));
    ctx.report.figure(
        "2 broker ceiling",
        &format!("{key}_msgs_per_s"),
        label,
        r,
        "msgs/s",
    );
    ctx.report.detail(
        key,
        json!({"messages": n, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
}

/// What raw lapin sends with each message.
#[derive(Clone, Copy)]
enum Props<'a> {
    /// `message_id`, `content_type` and persistent delivery only.
    Bare,
    /// Also `type`, `timestamp` and the CloudEvents headers (`prefix` + attribute), as the
    /// relay sends them.
    AsTheRelay {
        envelope: &'a EnvelopeConfig,
        prefix: &'a str,
    },
}

impl Props<'_> {
    fn of(self, m: &OutboxMessage) -> BasicProperties {
        let bare = BasicProperties::default()
            .with_message_id(m.id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        let Props::AsTheRelay { envelope, prefix } = self else {
            return bare;
        };
        let mut headers = FieldTable::default();
        for (name, value) in envelope::cloud_event_attributes(m, envelope) {
            headers.insert(
                format!("{prefix}{name}").into(),
                AMQPValue::LongString(value.into()),
            );
        }
        let timestamp = u64::try_from(m.created_at.timestamp()).unwrap_or(0);
        bare.with_type(m.event_type.clone().into())
            .with_timestamp(timestamp)
            .with_headers(headers)
    }
}

/// Raw lapin over one channel, every message with `props` (built before the clock starts).
async fn raw_ceiling(ctx: &mut Ctx, msgs: &[OutboxMessage], props: Props<'_>) -> Result<()> {
    let n = msgs.len();
    let (bind, tag, key, label) = match props {
        Props::Bare => (
            "brkraw",
            "",
            "rabbitmq_raw_ceiling",
            "raw lapin, one channel, persistent + mandatory + confirms, ≤1000 unconfirmed",
        ),
        Props::AsTheRelay { .. } => (
            "brkrawenv",
            " (the relay's properties and headers)",
            "rabbitmq_raw_envelope_ceiling",
            "raw lapin as above, with the relay's properties and CloudEvents headers",
        ),
    };
    let name = ctx.new_binding(bind).await?;
    ctx.progress(format!(
        "broker: RabbitMQ raw lapin (one channel){tag}, {n} messages, ≤1000 unconfirmed"
    ));
    let props: Vec<_> = msgs.iter().map(|m| props.of(m)).collect();
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let acked = raw_lapin(&ctx.args.amqp_url, &name, msgs, props, 1000).await?;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    ctx.check(sentinel).await?;
    if acked != n {
        bail!("raw lapin{tag}: {acked} of {n} messages acked");
    }
    let name = format!("RabbitMQ raw lapin{tag}");
    report_ceiling(ctx, &name, (key, label), n, elapsed, &usage);
    let what = format!("raw lapin{tag} + RabbitMQ");
    super::machine_cpu_figure(ctx, "2 broker ceiling", key, &what, (elapsed, &usage));
    Ok(())
}

/// Publishes every message on one confirm-mode channel with at most `in_flight` unconfirmed,
/// each with its `props`; returns how many were acked.
async fn raw_lapin(
    url: &str,
    exchange: &str,
    msgs: &[OutboxMessage],
    props: Vec<BasicProperties>,
    in_flight: usize,
) -> Result<usize> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .context("cannot connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut acked = 0;
    for (m, props) in msgs.iter().zip(props) {
        while pending.len() >= in_flight {
            if let Some(c) = pending.next().await {
                acked += usize::from(matches!(c, Ok(ref c) if lapin_ack(c)));
            }
        }
        let confirm = ch
            .basic_publish(
                exchange.into(),
                "order.OrderPlaced".into(),
                // `mandatory`, as the relay publishes: the broker checks that each message is
                // routed to a queue.
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                &m.payload,
                props,
            )
            .await?;
        pending.push(confirm);
    }
    while let Some(c) = pending.next().await {
        acked += usize::from(matches!(c, Ok(ref c) if lapin_ack(c)));
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(acked)
}

fn lapin_ack(c: &lapin::Confirmation) -> bool {
    c.is_ack()
}
