//! The measurements. Each phase works on fresh, uniquely named tables, exchanges, queues and
//! topics (registered in the context, removed after the phase) and adds its figures to the
//! report.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use outbox_relay::PublisherFactory;
use outbox_relay::config::Ordering;
use outbox_relay::config::PublisherConfig;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::publish::kafka::KafkaPublisher;
use outbox_relay::publish::rabbitmq::RabbitMqPublisher;
use outbox_relay::publish::{ConnectError, Outcome, Publisher};
use outbox_relay::store::{OutboxMessage, PayloadKind, RawBytes, Store};
use serde_json::json;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Ctx;
use crate::util::{
    CpuSample, CpuUsage, IndexDef, RelayProcess, avg_payload_bytes, create_index, drop_index, fill,
    fill_range, fill_range_fast, median, payload, percentile, pg_connect, settle_db, table_indexes,
    verify_sent, wait_drained,
};

/// A publisher that confirms everything at once: the relay's database path alone.
struct NoopPublisher;

#[async_trait]
impl Publisher for NoopPublisher {
    fn kind(&self) -> &'static str {
        "noop"
    }

    fn describe(&self) -> String {
        "no-op publisher (benchmark)".to_owned()
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        Ok(())
    }

    fn is_connected(&self) -> bool {
        true
    }

    async fn publish(&self, _msg: &OutboxMessage) -> Outcome {
        Outcome::Confirmed
    }

    async fn close(&self) {}
}

/// The relay's metrics summary, when `--metrics` gave it a port.
async fn scrape(port: Option<u16>) -> serde_json::Value {
    let Some(port) = port else {
        return serde_json::Value::Null;
    };
    match crate::util::scrape_metrics(port).await {
        Ok(m) => {
            let summary = crate::util::summarize_metrics(&m);
            eprintln!("           relay metrics: {summary}");
            summary
        }
        Err(e) => json!(format!("scrape failed: {e:#}")),
    }
}

fn rate(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64().max(1e-9)
}

fn cpu_text(u: &CpuUsage) -> String {
    let mut parts: Vec<String> = u
        .cores
        .iter()
        .filter(|(_, v)| **v >= 0.01)
        .map(|(k, v)| format!("{k} {v:.2}"))
        .collect();
    parts.push(format!("machine busy {:.2}", u.machine_busy));
    if u.unattributed >= 0.2 {
        parts.push(format!("unattributed {:.2}", u.unattributed));
    }
    if u.steal >= 0.01 {
        parts.push(format!("steal {:.2}", u.steal));
    }
    if !u.other_top.is_empty() {
        let top: Vec<String> = u
            .other_top
            .iter()
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        parts.push(format!("other = {}", top.join(", ")));
    }
    format!("cores: {}", parts.join(", "))
}

// ---------------------------------------------------------------------------------------------
// 1. DB ceiling

/// The relay's own claim + settle loop (in process, `run_with`) with a no-op publisher.
pub async fn db_ceiling(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("db").await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let bytes = avg_payload_bytes(&ctx.pg, &table).await?;
    ctx.report
        .detail("payload_bytes_as_sent", json!(bytes.round()));
    let config = ctx.config(&table, |raw| raw.relay.ordering = "none".into())?;
    let batch = config.relay.batch_size;
    let token = CancellationToken::new();
    let _stop_on_drop = token.clone().drop_guard();
    let factory: PublisherFactory = Box::new(|_| Arc::new(NoopPublisher) as Arc<dyn Publisher>);

    ctx.progress("db: relay loop (in process, no-op publisher) draining");
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let handle = tokio::spawn(outbox_relay::run_with(config, Some(factory), token.clone()));
    let waited = wait_drained(&ctx.pg, &table, ctx.timeout(), || {
        if handle.is_finished() {
            Err(anyhow!("the relay loop ended before the table was drained"))
        } else {
            Ok(())
        }
    })
    .await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    token.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(30), handle).await;
    match ended {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => bail!("run_with failed: {e}"),
        Ok(Err(e)) => bail!("run_with panicked: {e}"),
        Err(_) => bail!("run_with did not stop within 30 s of cancellation"),
    }
    ctx.check(sentinel).await?;
    waited?;
    verify_sent(&ctx.pg, &table, ctx.rows).await?;

    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "db: {r:.0} rows/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report.figure(
        "1 db ceiling",
        "db_ceiling_rows_per_s",
        &format!("claim+settle, no-op publisher, batch {batch}, ordering none"),
        r,
        "rows/s",
    );
    ctx.report.detail(
        "db_ceiling",
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Broker ceilings

fn synthetic(n: usize, aggregates: usize) -> Vec<OutboxMessage> {
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
async fn blast(p: &dyn Publisher, msgs: &[OutboxMessage], in_flight: usize) -> Blast {
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut outcomes = futures::stream::iter(msgs)
        .map(|m| p.publish(m))
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
    let rabbit = async {
        let name = ctx.new_binding("brk").await?;
        let cfg = ctx.config("bench_unused", |raw| {
            raw.publisher.kind = "rabbitmq".into();
            raw.publisher.rabbitmq.exchange = name.clone();
        })?;
        let PublisherConfig::RabbitMq(rc) = cfg.publisher.clone() else {
            bail!("expected a RabbitMQ configuration");
        };
        let envelope = EnvelopeConfig {
            source: cfg.relay.source.clone(),
            payload_kind: PayloadKind::Json,
        };
        let p = RabbitMqPublisher::new(rc, envelope);
        p.connect().await.map_err(|e| anyhow!("{e}"))?;
        ctx.progress(format!("broker: RabbitMQ, {n} messages, ≤1000 in flight"));
        let sentinel = ctx.sentinel().await;
        let b = blast(&p, &msgs, 1000).await;
        p.close().await;
        ctx.check(sentinel).await?;
        if let Some(f) = &b.first_failure {
            bail!(
                "RabbitMQ: {} of {n} confirmed; first failure: {f}",
                b.confirmed
            );
        }
        let queued = ctx.rabbit().await?.queue_len(&name).await?;
        if queued as usize != n {
            ctx.report.note(format!(
                "broker ceiling: queue holds {queued} messages, expected {n}"
            ));
        }
        let r = rate(n, b.elapsed);
        ctx.progress(format!(
            "broker: RabbitMQ {r:.0} msgs/s in {:.2?}; {}",
            b.elapsed,
            cpu_text(&b.usage)
        ));
        ctx.report.figure(
            "2 broker ceiling",
            "rabbitmq_ceiling_msgs_per_s",
            "RabbitMqPublisher, persistent + confirms, ≤1000 in flight",
            r,
            "msgs/s",
        );
        ctx.report.detail(
            "rabbitmq_ceiling",
            json!({"messages": n, "seconds": b.elapsed.as_secs_f64(), "cpu": b.usage}),
        );
        Ok(())
    }
    .await;
    if let Err(e) = rabbit {
        errors.push(format!("RabbitMQ: {e:#}"));
    }
    ctx.cleanup().await;

    // The broker itself: raw lapin, one confirm-mode channel, ≤1000 unconfirmed (what the
    // broker can take, whatever the relay's publisher design).
    let raw = async {
        let name = ctx.new_binding("brkraw").await?;
        ctx.progress(format!(
            "broker: RabbitMQ raw lapin (one channel), {n} messages, ≤1000 unconfirmed"
        ));
        let sentinel = ctx.sentinel().await;
        let cpu = CpuSample::take();
        let started = Instant::now();
        let acked = raw_lapin(&ctx.args.amqp_url, &name, &msgs, 1000).await?;
        let elapsed = started.elapsed();
        let usage = cpu.usage();
        ctx.check(sentinel).await?;
        if acked != n {
            bail!("raw lapin: {acked} of {n} messages acked");
        }
        let r = rate(n, elapsed);
        ctx.progress(format!(
            "broker: RabbitMQ raw lapin {r:.0} msgs/s in {elapsed:.2?}; {}",
            cpu_text(&usage)
        ));
        ctx.report.figure(
            "2 broker ceiling",
            "rabbitmq_raw_ceiling_msgs_per_s",
            "raw lapin, one channel, persistent + confirms, ≤1000 unconfirmed",
            r,
            "msgs/s",
        );
        ctx.report.detail(
            "rabbitmq_raw_ceiling",
            json!({"messages": n, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
        );
        Ok(())
    }
    .await;
    if let Err(e) = raw {
        errors.push(format!("RabbitMQ raw: {e:#}"));
    }
    ctx.cleanup().await;

    // Kafka: a fresh 3-partition topic.
    let kafka = async {
        let topic = ctx.new_topic("brk").await?;
        let cfg = ctx.config("bench_unused", |raw| {
            raw.publisher.kind = "kafka".into();
            raw.publisher.kafka.topic = topic.clone();
        })?;
        let PublisherConfig::Kafka(kc) = cfg.publisher.clone() else {
            bail!("expected a Kafka configuration");
        };
        let envelope = EnvelopeConfig {
            source: cfg.relay.source.clone(),
            payload_kind: PayloadKind::Json,
        };
        let p = KafkaPublisher::new(kc, envelope);
        p.connect().await.map_err(|e| anyhow!("{e}"))?;
        ctx.progress(format!("broker: Kafka, {n} messages, ≤1000 in flight"));
        let sentinel = ctx.sentinel().await;
        let b = blast(&p, &msgs, 1000).await;
        p.close().await;
        ctx.check(sentinel).await?;
        if let Some(f) = &b.first_failure {
            bail!(
                "Kafka: {} of {n} confirmed; first failure: {f}",
                b.confirmed
            );
        }
        let r = rate(n, b.elapsed);
        ctx.progress(format!(
            "broker: Kafka {r:.0} msgs/s in {:.2?}; {}",
            b.elapsed,
            cpu_text(&b.usage)
        ));
        ctx.report.figure(
            "2 broker ceiling",
            "kafka_ceiling_msgs_per_s",
            "KafkaPublisher, acks=all, idempotent, ≤1000 in flight",
            r,
            "msgs/s",
        );
        ctx.report.detail(
            "kafka_ceiling",
            json!({"messages": n, "seconds": b.elapsed.as_secs_f64(), "cpu": b.usage}),
        );
        Ok(())
    }
    .await;
    if let Err(e) = kafka {
        errors.push(format!("Kafka: {e:#}"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("; "))
    }
}

/// Publishes every message on one confirm-mode channel with at most `in_flight` unconfirmed;
/// returns how many were acked.
async fn raw_lapin(
    url: &str,
    exchange: &str,
    msgs: &[OutboxMessage],
    in_flight: usize,
) -> Result<usize> {
    let conn = Connection::connect(url, ConnectionProperties::default())
        .await
        .context("cannot connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut acked = 0;
    for m in msgs {
        while pending.len() >= in_flight {
            if let Some(c) = pending.next().await {
                acked += usize::from(matches!(c, Ok(ref c) if lapin_ack(c)));
            }
        }
        let props = BasicProperties::default()
            .with_message_id(m.id.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2);
        let confirm = ch
            .basic_publish(
                exchange.into(),
                "order.OrderPlaced".into(),
                BasicPublishOptions::default(),
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

// ---------------------------------------------------------------------------------------------
// 3. The naive loop

/// The blog-post loop: SELECT … FOR UPDATE SKIP LOCKED LIMIT 50 by created_at, publish and
/// wait for each confirm, UPDATE each row, COMMIT.
pub async fn naive(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("naive").await?;
    ctx.progress(format!("naive: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let name = ctx.new_binding("naive").await?;

    let mut pg = pg_connect(&ctx.args.database_url).await?;
    let conn = Connection::connect(&ctx.args.amqp_url, ConnectionProperties::default())
        .await
        .context("cannot connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let select = pg
        .prepare(&format!(
            "SELECT id, payload FROM {table} WHERE status = 'pending' \
             ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED"
        ))
        .await?;
    let update = pg
        .prepare(&format!("UPDATE {table} SET status = 'sent' WHERE id = $1"))
        .await?;

    let target = ctx.naive_rows;
    let limit = Duration::from_secs(ctx.args.naive_secs);
    ctx.progress(format!(
        "naive: draining {target} of {} pending rows",
        ctx.rows
    ));
    let (mut t_select, mut t_publish, mut t_update, mut t_commit) = (
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
    );
    let mut polls = 0u64;
    let mut sent = 0usize;
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    while sent < target {
        let tx = pg.transaction().await?;
        let t = Instant::now();
        let rows = tx.query(&select, &[]).await?;
        t_select += t.elapsed();
        polls += 1;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        for r in &rows {
            let id: Uuid = r.try_get(0)?;
            let body: RawBytes = r.try_get(1)?;
            let props = BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            let t = Instant::now();
            let confirmation = ch
                .basic_publish(
                    name.as_str().into(),
                    "order.OrderPlaced".into(),
                    BasicPublishOptions::default(),
                    &body.0,
                    props,
                )
                .await?
                .await?;
            if !confirmation.is_ack() {
                bail!("naive loop: message {id} was nacked");
            }
            t_publish += t.elapsed();
            let t = Instant::now();
            tx.execute(&update, &[&id]).await?;
            t_update += t.elapsed();
        }
        let t = Instant::now();
        tx.commit().await?;
        t_commit += t.elapsed();
        sent += rows.len();
        if started.elapsed() > limit {
            break;
        }
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let _ = conn.close(200, "done".into()).await;
    ctx.check(sentinel).await?;

    let r = rate(sent, elapsed);
    let ms = |d: Duration, n: u64| d.as_secs_f64() * 1000.0 / n.max(1) as f64;
    let per_poll = ms(t_select, polls);
    ctx.progress(format!(
        "naive: {r:.0} msgs/s ({sent} rows in {elapsed:.2?}); per poll {per_poll:.1} ms, \
         per publish+confirm {:.2} ms, per UPDATE {:.2} ms, per COMMIT {:.2} ms; {}",
        ms(t_publish, sent as u64),
        ms(t_update, sent as u64),
        ms(t_commit, polls),
        cpu_text(&usage)
    ));
    if sent < ctx.rows {
        ctx.report.note(format!(
            "naive loop: drained the first {sent} of {} pending rows (stops at {target} rows or {} s; \
             a full drain at this rate would take ~{:.0} s); its figure is the rate against a backlog of {} rows",
            ctx.rows,
            ctx.args.naive_secs,
            ctx.rows as f64 / r.max(1e-9),
            ctx.rows
        ));
    }
    ctx.report.figure(
        "3 naive loop",
        "naive_rabbitmq_msgs_per_s",
        &format!(
            "SKIP LOCKED LIMIT 50 by created_at, confirm+UPDATE per row ({sent} of {} rows)",
            ctx.rows
        ),
        r,
        "msgs/s",
    );
    ctx.report.figure(
        "3 naive loop",
        "naive_poll_ms",
        "its SELECT … ORDER BY created_at LIMIT 50 (mean per poll)",
        per_poll,
        "ms",
    );
    ctx.report.detail(
        "naive",
        json!({
            "rows_in_table": ctx.rows, "rows_drained": sent, "seconds": elapsed.as_secs_f64(),
            "polls": polls, "ms_per_poll": per_poll,
            "ms_per_publish_confirm": ms(t_publish, sent as u64),
            "ms_per_update": ms(t_update, sent as u64),
            "ms_per_commit": ms(t_commit, polls),
            "share_of_time": {
                "select": t_select.as_secs_f64() / elapsed.as_secs_f64(),
                "publish_confirm": t_publish.as_secs_f64() / elapsed.as_secs_f64(),
                "update": t_update.as_secs_f64() / elapsed.as_secs_f64(),
                "commit": t_commit.as_secs_f64() / elapsed.as_secs_f64(),
            },
            "cpu": usage,
        }),
    );
    drop(pg);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. The relay process draining a backlog

/// `ordering` none/aggregate × RabbitMQ/Kafka, each on a fresh table of N rows.
pub async fn relay_runs(ctx: &mut Ctx) -> Result<()> {
    let mut errors = Vec::new();
    for (broker, ordering) in [
        ("rabbitmq", "none"),
        ("rabbitmq", "aggregate"),
        ("kafka", "none"),
        ("kafka", "aggregate"),
    ] {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let notes = ctx.report.notes.len();
            let result = relay_run(ctx, broker, ordering).await;
            ctx.cleanup().await;
            let Err(e) = result else { break };
            let msg = format!("relay {broker}/{ordering}: {e:#}");
            if attempt < 3 && crate::is_disruption(&msg) {
                // Notes of the abandoned attempt do not describe the figures kept.
                ctx.report.notes.truncate(notes);
                ctx.progress(format!(
                    "{msg}: waiting for the services, then measuring it again"
                ));
                ctx.report
                    .note(format!("relay {broker}/{ordering} measured again after a service restart by someone else"));
                ctx.wait_for_services().await;
                continue;
            }
            ctx.progress(format!("ERROR {msg}"));
            errors.push(msg);
            break;
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("; "))
    }
}

async fn relay_run(ctx: &mut Ctx, broker: &str, ordering: &str) -> Result<()> {
    let short = if broker == "rabbitmq" { "rmq" } else { "kafka" };
    let ord = if ordering == "none" { "none" } else { "agg" };
    let key = format!("relay_{broker}_{ordering}");
    let table = ctx.new_table(&format!("{short}_{ord}")).await?;
    ctx.progress(format!(
        "relay {broker}/{ordering}: filling {} rows into {table}",
        ctx.rows
    ));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;

    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__ORDERING".into(), ordering.into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), broker.into()));
    let queue = if broker == "rabbitmq" {
        let name = ctx.new_binding(&format!("{short}_{ord}")).await?;
        env.push(("RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(), name.clone()));
        Some(name)
    } else {
        let topic = ctx.new_topic(&format!("{short}_{ord}")).await?;
        env.push(("RELAY_PUBLISHER__KAFKA__TOPIC".into(), topic));
        None
    };
    let metrics_port = ctx.metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());

    ctx.progress(format!("relay {broker}/{ordering}: relay process draining"));
    let log = ctx.dir.join(format!("{key}.log"));
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut relay = RelayProcess::spawn(&ctx.relay_bin, &ctx.dir, &env, &log)?;
    if ctx.args.perf {
        let out = ctx.dir.join(format!("{key}.perf.data"));
        relay.attach_perf(&out)?;
        ctx.report
            .note(format!("{key}: perf profile in {}", out.display()));
    }
    let waited = wait_drained(&ctx.pg, &table, ctx.timeout(), || relay.check_alive()).await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let rss = relay.peak_rss_kib();
    let metrics = scrape(metrics_port).await;
    let stopped = relay.stop(Duration::from_secs(45)).await;
    ctx.check(sentinel).await?;
    waited?;
    let status = stopped?;
    if !status.success() {
        bail!(
            "the relay exited with {status} after SIGTERM; end of its log:\n{}",
            relay.tail(20)
        );
    }
    verify_sent(&ctx.pg, &table, ctx.rows).await?;
    let mut duplicates = serde_json::Value::Null;
    if let Some(q) = &queue {
        let queued = ctx.rabbit().await?.queue_len(q).await? as usize;
        duplicates = json!(queued as i64 - ctx.rows as i64);
        if queued != ctx.rows {
            ctx.report.note(format!(
                "{key}: queue holds {queued} messages for {} rows",
                ctx.rows
            ));
        }
    }
    let rss_mib = rss.map(|k| k as f64 / 1024.0);
    if let Some(k) = rss {
        ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
    }

    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "relay {broker}/{ordering}: {r:.0} msgs/s in {elapsed:.2?}, peak RSS {:.1} MiB; {}",
        rss_mib.unwrap_or(f64::NAN),
        cpu_text(&usage)
    ));
    let what = match ordering {
        "none" => format!("relay process → {broker}, ordering none"),
        _ => format!(
            "relay process → {broker}, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    ctx.report.figure(
        "4 relay drain",
        &format!("{key}_msgs_per_s"),
        &what,
        r,
        "msgs/s",
    );
    ctx.report.detail(
        &key,
        json!({
            "rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "peak_rss_mib": rss_mib,
            "queue_surplus": duplicates, "cpu": usage, "extra_env": ctx.extra_env,
            "relay_metrics": metrics,
        }),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Latency at a steady insert rate

/// Commit → consumer receive, RabbitMQ, ordering aggregate, with and without NOTIFY.
pub async fn latency(ctx: &mut Ctx) -> Result<()> {
    let mut errors = Vec::new();
    for notify in [true, false] {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let notes = ctx.report.notes.len();
            let result = latency_run(ctx, notify).await;
            ctx.cleanup().await;
            let Err(e) = result else { break };
            let msg = format!("latency notify={notify}: {e:#}");
            if attempt < 3 && crate::is_disruption(&msg) {
                // Notes of the abandoned attempt do not describe the figures kept.
                ctx.report.notes.truncate(notes);
                ctx.progress(format!(
                    "{msg}: waiting for the services, then measuring it again"
                ));
                ctx.report.note(format!(
                    "latency notify={notify} measured again after a service restart by someone else"
                ));
                ctx.wait_for_services().await;
                continue;
            }
            ctx.progress(format!("ERROR {msg}"));
            errors.push(msg);
            break;
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("; "))
    }
}

type Receipts = Arc<Mutex<HashMap<String, Instant>>>;

fn receipts_has(r: &Receipts, id: &str) -> bool {
    r.lock().unwrap_or_else(|p| p.into_inner()).contains_key(id)
}

async fn latency_run(ctx: &mut Ctx, notify: bool) -> Result<()> {
    let tag = if notify { "lat_notify" } else { "lat_poll" };
    let key = if notify {
        "latency_notify"
    } else {
        "latency_poll"
    };
    let table = ctx.new_table(tag).await?;
    let name = ctx.new_binding(tag).await?;
    const AGGREGATES: u64 = 100;
    let sentinel = ctx.sentinel().await;

    // The consumer: records the first receipt of each message id.
    let conn = Connection::connect(&ctx.args.amqp_url, ConnectionProperties::default())
        .await
        .context("cannot connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    let mut consumer = ch
        .basic_consume(
            name.as_str().into(),
            "outbox-bench".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    let receipts: Receipts = Arc::default();
    let sink = Arc::clone(&receipts);
    let mut consumer_task = tokio::task::JoinSet::new();
    consumer_task.spawn(async move {
        while let Some(delivery) = consumer.next().await {
            let Ok(d) = delivery else { break };
            let at = Instant::now();
            if let Some(id) = d.properties.message_id() {
                sink.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(id.as_str().to_owned())
                    .or_insert(at);
            }
        }
    });

    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__ORDERING".into(), "aggregate".into()));
    env.push(("RELAY_RELAY__NOTIFY".into(), notify.to_string()));
    env.push(("RELAY_PUBLISHER__KIND".into(), "rabbitmq".into()));
    env.push(("RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(), name.clone()));
    let metrics_port = ctx.metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());
    let log = ctx.dir.join(format!("{key}.log"));
    let mut relay = RelayProcess::spawn(&ctx.relay_bin, &ctx.dir, &env, &log)?;

    let insert_sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb) RETURNING id"
    );

    // Warm-up: one row through the whole path (the relay is connected and listening).
    let warm = pg_connect(&ctx.args.database_url).await?;
    let id: Uuid = warm
        .query_one(&insert_sql, &[&"warmup", &payload(0, AGGREGATES)])
        .await?
        .try_get(0)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !receipts_has(&receipts, &id.to_string()) {
        relay.check_alive()?;
        if Instant::now() > deadline {
            bail!(
                "the warm-up message did not arrive within 30 s; relay log:\n{}",
                relay.tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let rate_per_s = ctx.lat_rate.max(1);
    let total = (u64::from(rate_per_s) * ctx.lat_secs).max(1);
    let period = Duration::from_secs_f64(1.0 / f64::from(rate_per_s));
    let workers = 8u64.min(total);
    ctx.progress(format!(
        "latency notify={notify}: inserting {total} rows at {rate_per_s}/s over {} aggregates ({workers} connections)",
        AGGREGATES
    ));
    let mut clients = Vec::new();
    for _ in 0..workers {
        clients.push(pg_connect(&ctx.args.database_url).await?);
    }
    let cpu = CpuSample::take();
    let mut tasks = tokio::task::JoinSet::new();
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    for (k, client) in clients.into_iter().enumerate() {
        let sql = insert_sql.clone();
        tasks.spawn(insert_worker(
            client, sql, k as u64, workers, total, start, period, AGGREGATES,
        ));
    }
    let mut commits: Vec<(Uuid, Instant, Duration)> = Vec::with_capacity(total as usize);
    let mut worker_errors = Vec::new();
    let mut done_workers = 0;
    while done_workers < workers {
        let Some(joined) = tasks.join_next().await else {
            break;
        };
        match joined {
            Ok(Ok(v)) => {
                done_workers += 1;
                commits.extend(v);
            }
            Ok(Err(e)) => {
                done_workers += 1;
                worker_errors.push(format!("{e:#}"));
            }
            Err(e) => worker_errors.push(format!("inserter task: {e}")),
        }
        relay.check_alive()?;
    }
    if let Some(e) = worker_errors.first() {
        bail!("inserter failed: {e}");
    }
    let insert_window = commits
        .iter()
        .map(|(_, at, _)| *at)
        .max()
        .map_or(Duration::ZERO, |last| last.duration_since(start.into_std()));
    let max_sched_lag = commits.iter().map(|c| c.2).max().unwrap_or_default();

    // Wait for every message (30 s after the last commit at most).
    let deadline = Instant::now() + Duration::from_secs(30);
    let ids: Vec<String> = commits.iter().map(|(id, _, _)| id.to_string()).collect();
    loop {
        let missing = {
            let r = receipts.lock().unwrap_or_else(|p| p.into_inner());
            ids.iter().filter(|id| !r.contains_key(*id)).count()
        };
        if missing == 0 || Instant::now() > deadline {
            if missing > 0 {
                ctx.report.note(format!(
                    "{key}: {missing} of {} messages not received within 30 s",
                    ids.len()
                ));
            }
            break;
        }
        relay.check_alive()?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let usage = cpu.usage();
    let rss = relay.peak_rss_kib();
    let metrics = scrape(metrics_port).await;
    let status = relay.stop(Duration::from_secs(45)).await?;
    ctx.check(sentinel).await?;
    if !status.success() {
        bail!(
            "the relay exited with {status} after SIGTERM; end of its log:\n{}",
            relay.tail(20)
        );
    }
    consumer_task.abort_all();
    let _ = conn.close(200, "done".into()).await;
    if let Some(k) = rss {
        ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
    }

    let mut lat: Vec<f64> = {
        let r = receipts.lock().unwrap_or_else(|p| p.into_inner());
        commits
            .iter()
            .filter_map(|(id, at, _)| {
                r.get(&id.to_string())
                    .map(|recv| recv.saturating_duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect()
    };
    lat.sort_by(f64::total_cmp);
    if lat.is_empty() {
        bail!("no message received");
    }
    let (p50, p95, p99) = (
        percentile(&lat, 50.0),
        percentile(&lat, 95.0),
        percentile(&lat, 99.0),
    );
    let max = lat.last().copied().unwrap_or(f64::NAN);
    let achieved = commits.len() as f64 / insert_window.as_secs_f64().max(1e-9);
    ctx.progress(format!(
        "latency notify={notify}: p50 {p50:.1} ms, p95 {p95:.1} ms, p99 {p99:.1} ms, max {max:.1} ms \
         ({} msgs, achieved {achieved:.0} inserts/s, worst schedule lag {max_sched_lag:.1?}); {}",
        lat.len(),
        cpu_text(&usage)
    ));
    let label = if notify {
        "commit → consume, NOTIFY on"
    } else {
        "commit → consume, NOTIFY off (poll 1s)"
    };
    ctx.report.figure(
        "5 latency",
        &format!("{key}_achieved_inserts_per_s"),
        &format!("{label}: insert rate achieved (target {rate_per_s}/s)"),
        achieved,
        "rows/s",
    );
    for (p, v) in [("p50", p50), ("p95", p95), ("p99", p99)] {
        ctx.report.figure(
            "5 latency",
            &format!("{key}_{p}_ms"),
            &format!("{label}, {p}"),
            v,
            "ms",
        );
    }
    ctx.report.detail(
        key,
        json!({
            "rate_per_s": rate_per_s, "seconds": ctx.lat_secs, "messages": lat.len(),
            "achieved_inserts_per_s": achieved, "worst_schedule_lag_ms": max_sched_lag.as_secs_f64() * 1000.0,
            "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "max_ms": max,
            "peak_rss_mib": rss.map(|k| k as f64 / 1024.0), "cpu": usage,
            "relay_metrics": metrics,
        }),
    );
    Ok(())
}

/// Inserts rows `k, k+workers, …` below `total`, each at `start + i·period`, one row per
/// transaction; returns (id, commit instant, how late the insert started).
#[allow(clippy::too_many_arguments)]
async fn insert_worker(
    client: Client,
    sql: String,
    k: u64,
    workers: u64,
    total: u64,
    start: tokio::time::Instant,
    period: Duration,
    aggregates: u64,
) -> Result<Vec<(Uuid, Instant, Duration)>> {
    let stmt = client.prepare(&sql).await?;
    let mut out = Vec::with_capacity((total / workers.max(1) + 1) as usize);
    let mut i = k;
    while i < total {
        let due = start + period.mul_f64(i as f64);
        tokio::time::sleep_until(due).await;
        let late = tokio::time::Instant::now().saturating_duration_since(due);
        let agg = crate::util::aggregate_id(i, aggregates);
        let body = payload(i + 1, aggregates);
        let id: Uuid = client.query_one(&stmt, &[&agg, &body]).await?.try_get(0)?;
        out.push((id, Instant::now(), late));
        i += workers;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// 7. Claim cost on a small and a large table

/// The relay's own claim, measured through the library: `Store::claim` on a pool whose
/// sessions load `auto_explain` (analyze + buffers, reported to the client as a NOTICE that
/// [`crate::plans`] captures), then `Store::mark_sent` as the relay does after publishing, so
/// consecutive claims walk the table like a draining relay. No SQL is copied from the library.
struct ClaimRun {
    wall_ms: f64,
    exec_ms: f64,
    pages: u64,
    rows: usize,
    plan: String,
}

fn explain_url(url: &str) -> String {
    let options = "-c session_preload_libraries=auto_explain -c auto_explain.log_min_duration=0 \
                   -c auto_explain.log_analyze=on -c auto_explain.log_buffers=on \
                   -c auto_explain.log_level=notice -c client_min_messages=notice";
    let encoded = options.replace(' ', "%20").replace('=', "%3D");
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options={encoded}")
}

async fn measure_claims(store: &Store, ordering: Ordering, runs: usize) -> Result<Vec<ClaimRun>> {
    let mut out = Vec::new();
    for _ in 0..runs {
        crate::plans::take();
        let started = Instant::now();
        let rows = store
            .claim(ordering, 500, i64::MAX)
            .await
            .context("Store::claim failed")?;
        let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        store
            .mark_sent(&ids, false)
            .await
            .context("Store::mark_sent failed")?;
        // The NOTICE precedes the statement's result on the connection; allow for scheduling.
        let mut plan = None;
        for _ in 0..50 {
            plan = crate::plans::take()
                .into_iter()
                .find(|p| p.contains("'processing'") || p.contains("processing"));
            if plan.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let plan = plan.ok_or_else(|| {
            anyhow!("auto_explain reported no plan for the claim (is auto_explain installed?)")
        })?;
        let exec_ms = plan
            .split("duration:")
            .nth(1)
            .and_then(|rest| rest.trim_start().split(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        let lines: Vec<String> = plan.lines().map(str::to_owned).collect();
        out.push(ClaimRun {
            wall_ms,
            exec_ms,
            pages: root_pages(&lines).unwrap_or(0),
            rows: rows.len(),
            plan,
        });
    }
    Ok(out)
}

/// The plan text without the (long, one-line) query text, which is printed once separately.
fn plan_body(plan: &str) -> String {
    plan.lines()
        .filter(|l| !l.starts_with("Query Text:"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn query_text(plan: &str) -> Option<String> {
    plan.lines()
        .find_map(|l| l.strip_prefix("Query Text:"))
        .map(|q| q.trim().to_owned())
}

struct Explained {
    times_ms: Vec<f64>,
    /// Shared buffers hit + read by the whole statement (the root node), per run: unlike the
    /// time, this does not depend on what else the machine is doing.
    pages: Vec<u64>,
    plan: String,
}

/// `hit + read` of the first `Buffers: shared …` line (the root node's).
fn root_pages(lines: &[String]) -> Option<u64> {
    let line = lines
        .iter()
        .find(|l| l.trim_start().starts_with("Buffers: shared"))?;
    let mut total = 0;
    for part in line.split([' ', ',']) {
        for key in ["hit=", "read="] {
            if let Some(v) = part.strip_prefix(key) {
                total += v.parse::<u64>().ok()?;
            }
        }
    }
    Some(total)
}

/// Runs `EXPLAIN (ANALYZE, BUFFERS) <stmt>` `runs` times, each in a transaction rolled back.
async fn explain(pg: &Client, stmt: &str, runs: usize) -> Result<Explained> {
    let mut times_ms = Vec::new();
    let mut pages = Vec::new();
    let mut plan = String::new();
    for _ in 0..runs {
        pg.batch_execute("BEGIN").await?;
        let res = pg
            .simple_query(&format!("EXPLAIN (ANALYZE, BUFFERS) {stmt}"))
            .await;
        let _ = pg.batch_execute("ROLLBACK").await;
        let lines: Vec<String> = res?
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .collect();
        let exec = lines
            .iter()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("Execution Time:")
                    .and_then(|v| v.trim().trim_end_matches("ms").trim().parse::<f64>().ok())
            })
            .ok_or_else(|| anyhow!("no Execution Time in the plan"))?;
        times_ms.push(exec);
        pages.push(root_pages(&lines).unwrap_or(0));
        plan = lines.join("\n");
    }
    Ok(Explained {
        times_ms,
        pages,
        plan,
    })
}

/// Small table (all pending) and large table (99 % sent), claim timings and plans.
pub async fn claim(ctx: &mut Ctx) -> Result<()> {
    let sentinel = ctx.sentinel().await;
    claim_table(ctx, "claim_small", 10_000, false, "small").await?;
    ctx.cleanup().await;
    if ctx.rows != 10_000 {
        // The backlog the drain phases start from.
        claim_table(ctx, "claim_backlog", ctx.rows, false, "backlog").await?;
        ctx.cleanup().await;
    }
    ctx.check(sentinel).await?;
    let sentinel = ctx.sentinel().await;
    claim_table(ctx, "claim_large", ctx.args.claim_rows, true, "large").await?;
    ctx.check(sentinel).await
}

fn median_u64(v: &[u64]) -> f64 {
    median(&v.iter().map(|x| *x as f64).collect::<Vec<_>>())
}

/// Adds the figures, plan and details of one series of claims.
fn report_claims(ctx: &mut Ctx, key: &str, label: &str, runs: &[ClaimRun]) {
    if runs.iter().any(|r| r.rows < 500) {
        ctx.report.note(format!(
            "{label}: some claims returned fewer than 500 rows ({:?})",
            runs.iter().map(|r| r.rows).collect::<Vec<_>>()
        ));
    }
    let exec: Vec<f64> = runs.iter().map(|r| r.exec_ms).collect();
    let wall: Vec<f64> = runs.iter().map(|r| r.wall_ms).collect();
    let pages: Vec<u64> = runs.iter().map(|r| r.pages).collect();
    let rows: Vec<usize> = runs.iter().map(|r| r.rows).collect();
    ctx.report.figure(
        "7 claim cost",
        &format!("{key}_ms"),
        &format!("{label}: execution, median of {}", runs.len()),
        median(&exec),
        "ms",
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("{key}_pages"),
        &format!("{label}: buffers touched, median"),
        median_u64(&pages),
        "pages",
    );
    if let Some(last) = runs.last() {
        ctx.report.plan(
            &format!("{label}, last of {} consecutive claims", runs.len()),
            &plan_body(&last.plan),
        );
    }
    ctx.report.detail(
        key,
        json!({"exec_ms": exec, "wall_ms": wall, "pages": pages, "rows": rows}),
    );
}

async fn claim_table(
    ctx: &mut Ctx,
    tag: &str,
    n: usize,
    mostly_sent: bool,
    which: &str,
) -> Result<()> {
    let table = ctx.new_table(tag).await?;
    let label = if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    };
    let n64 = i64::try_from(n)?;
    let aggregates = i64::try_from(ctx.args.aggregates)?;
    // The large table is built fast: without indexes, with explicit seq values. The partial
    // indexes over unsent rows (the ones the claims read) are rebuilt before the 99 % UPDATE,
    // so they carry the dead entries that a real table has until VACUUM; the others (primary
    // key, processing, failed, sent), which the UPDATE would only slow down, after it.
    let indexes = if mostly_sent {
        let all = table_indexes(&ctx.pg, &table).await?;
        for idx in &all {
            drop_index(&ctx.pg, &table, idx).await?;
        }
        all
    } else {
        Vec::new()
    };
    let chunk = 1_000_000i64;
    let mut from = 1;
    while from <= n64 {
        let to = (from + chunk - 1).min(n64);
        if mostly_sent {
            fill_range_fast(&ctx.pg, &table, from, to, aggregates).await?;
        } else {
            fill_range(&ctx.pg, &table, from, to, aggregates).await?;
        }
        ctx.progress(format!("claim: {table}: {to} of {n} rows inserted"));
        from = to + 1;
    }
    let config = ctx.config(&table, |raw| {
        raw.database.url = explain_url(&raw.database.url);
    })?;
    let store = Store::new(&config.database, "outbox-bench-claim")?;
    let runs = 7;
    let naive_poll = format!(
        "SELECT id, payload FROM {table} WHERE status = 'pending' ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED"
    );

    if mostly_sent {
        ctx.pg
            .execute(&format!("SELECT setval('{table}_seq', $1)"), &[&n64])
            .await?;
        let (unsent, rest): (Vec<&IndexDef>, Vec<&IndexDef>) = indexes.iter().partition(|i| {
            i.definition().contains("'pending'") || i.definition().contains("<> 'sent'")
        });
        for idx in &unsent {
            create_index(&ctx.pg, &table, idx).await?;
        }
        let keep_pending = (n64 / 100).max(1);
        let cut = n64 - keep_pending;
        ctx.progress(format!("claim: {table}: marking {cut} rows sent"));
        ctx.pg
            .execute(
                &format!(
                    "UPDATE {table} SET status = 'sent', sent_at = now(), attempts = 1 WHERE seq <= $1"
                ),
                &[&cut],
            )
            .await?;
        ctx.progress(format!("claim: {table}: rebuilding the other indexes"));
        for idx in &rest {
            create_index(&ctx.pg, &table, idx).await?;
        }
        // Before VACUUM: what the table looks like while vacuum lags (autovacuum is off on
        // this machine's PostgreSQL).
        ctx.pg.batch_execute(&format!("ANALYZE {table}")).await?;
        let before = measure_claims(&store, Ordering::None, runs).await?;
        ctx.progress(format!(
            "claim: {label} rows 99% sent, before VACUUM: claim_none execution {:?} ms, buffers {:?}",
            before.iter().map(|r| r.exec_ms.round()).collect::<Vec<_>>(),
            before.iter().map(|r| r.pages).collect::<Vec<_>>()
        ));
        ctx.report.figure(
            "7 claim cost",
            "claim_none_large_unvacuumed_first_ms",
            &format!("claim_none, {label} rows 99% sent, before VACUUM: first claim"),
            before.first().map_or(f64::NAN, |r| r.exec_ms),
            "ms",
        );
        report_claims(
            ctx,
            "claim_none_large_unvacuumed",
            &format!("claim_none, {label} rows 99% sent, before VACUUM"),
            &before,
        );
        ctx.progress(format!("claim: {table}: VACUUM ANALYZE"));
        ctx.pg
            .batch_execute(&format!("VACUUM ANALYZE {table}"))
            .await?;
    } else {
        settle_db(&ctx.pg, &table).await?;
    }
    if let Err(e) = ctx.pg.batch_execute("CHECKPOINT").await {
        tracing::debug!(error = %e, "CHECKPOINT refused");
    }
    let size: String = ctx
        .pg
        .query_one(
            "SELECT pg_size_pretty(pg_total_relation_size($1::text::regclass))",
            &[&table],
        )
        .await?
        .try_get(0)?;

    let c_none = measure_claims(&store, Ordering::None, runs).await?;
    let c_agg = measure_claims(&store, Ordering::Aggregate, runs).await?;
    let c_naive = explain(&ctx.pg, &naive_poll, 3).await?;
    if which == "small" {
        if let Some(q) = c_none.last().and_then(|r| query_text(&r.plan)) {
            ctx.report
                .plan("claim_none statement (as the relay sends it)", &q);
        }
        if let Some(q) = c_agg.last().and_then(|r| query_text(&r.plan)) {
            ctx.report
                .plan("claim_aggregate statement (as the relay sends it)", &q);
        }
    }

    let desc = if mostly_sent {
        format!("{label} rows, 99% sent, vacuumed ({size})")
    } else {
        format!("{label} rows, all pending ({size})")
    };
    let med = |v: &[ClaimRun]| median(&v.iter().map(|r| r.exec_ms).collect::<Vec<_>>());
    ctx.progress(format!(
        "claim: {desc}: claim_none median {:.2} ms, claim_aggregate median {:.2} ms, naive poll median {:.1} ms",
        med(&c_none),
        med(&c_agg),
        median(&c_naive.times_ms)
    ));
    report_claims(
        ctx,
        &format!("claim_none_{which}"),
        &format!("claim_none (batch 500), {desc}"),
        &c_none,
    );
    report_claims(
        ctx,
        &format!("claim_aggregate_{which}"),
        &format!("claim_aggregate (batch 500), {desc}"),
        &c_agg,
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("naive_poll_{which}_ms"),
        &format!("naive SELECT … ORDER BY created_at LIMIT 50, {desc}"),
        median(&c_naive.times_ms),
        "ms",
    );
    ctx.report
        .plan(&format!("naive poll on {desc}"), &c_naive.plan);
    ctx.report.detail(
        &format!("naive_poll_{which}"),
        json!({"rows": n, "size": size, "ms": c_naive.times_ms, "pages": c_naive.pages}),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 8. What the NOTIFY trigger costs the application's inserts

/// One-row insert transactions as fast as possible from `clients` connections for `secs`,
/// with the table's NOTIFY trigger enabled and disabled (alternating, twice each).
pub async fn insert_cost(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("insert").await?;
    let trigger = format!("{table}_notify");
    let secs = if ctx.args.quick { 2 } else { 3 };
    let sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb)"
    );
    let mut results: HashMap<(usize, bool), Vec<f64>> = HashMap::new();
    let sentinel = ctx.sentinel().await;
    for clients in [1usize, 8] {
        for round in 0..3 {
            for on in [true, false] {
                let action = if on { "ENABLE" } else { "DISABLE" };
                ctx.pg
                    .batch_execute(&format!("ALTER TABLE {table} {action} TRIGGER {trigger}"))
                    .await?;
                let r = insert_burst(
                    &ctx.args.database_url,
                    &sql,
                    clients,
                    Duration::from_secs(secs),
                )
                .await?;
                ctx.progress(format!(
                    "insert: {clients} connection(s), NOTIFY trigger {}: {r:.0} commits/s (round {})",
                    if on { "on" } else { "off" },
                    round + 1
                ));
                results.entry((clients, on)).or_default().push(r);
            }
        }
    }
    ctx.check(sentinel).await?;
    for clients in [1usize, 8] {
        for on in [true, false] {
            let v = results.get(&(clients, on)).map_or(f64::NAN, |v| median(v));
            let key = format!(
                "insert_{}_c{clients}_per_s",
                if on { "notify_trigger" } else { "no_trigger" }
            );
            let label = format!(
                "app inserts (1 row/txn), {clients} connection(s), NOTIFY trigger {}",
                if on { "on (as migrated)" } else { "disabled" }
            );
            ctx.report
                .figure("8 insert cost", &key, &label, v, "rows/s");
        }
    }
    ctx.report.detail(
        "insert_cost",
        json!(
            results
                .iter()
                .map(|((c, on), v)| (
                    format!("c{c}_{}", if *on { "trigger" } else { "no_trigger" }),
                    json!(v)
                ))
                .collect::<serde_json::Map<_, _>>()
        ),
    );
    Ok(())
}

async fn insert_burst(url: &str, sql: &str, clients: usize, secs: Duration) -> Result<f64> {
    let mut set = tokio::task::JoinSet::new();
    let start = Instant::now() + Duration::from_millis(200);
    for k in 0..clients {
        let client = pg_connect(url).await?;
        let sql = sql.to_owned();
        set.spawn(async move {
            let stmt = client.prepare(&sql).await?;
            tokio::time::sleep_until(start.into()).await;
            let end = start + secs;
            let mut n = 0u64;
            while Instant::now() < end {
                let i = n * clients as u64 + k as u64;
                let agg = crate::util::aggregate_id(i, 100);
                client.execute(&stmt, &[&agg, &payload(i, 100)]).await?;
                n += 1;
            }
            Ok::<u64, anyhow::Error>(n)
        });
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r??;
    }
    Ok(total as f64 / secs.as_secs_f64())
}
