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
use outbox_relay::config::PublisherConfig;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::publish::kafka::KafkaPublisher;
use outbox_relay::publish::rabbitmq::RabbitMqPublisher;
use outbox_relay::publish::{ConnectError, Outcome, Publisher};
use outbox_relay::store::{OutboxMessage, PayloadKind, RawBytes};
use serde_json::json;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::Ctx;
use crate::util::{
    CpuSample, CpuUsage, IndexDef, RelayProcess, avg_payload_bytes, create_index, drop_index, fill,
    fill_range, median, payload, percentile, pg_connect, settle_db, table_indexes, verify_sent,
    wait_drained,
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
        let b = blast(&p, &msgs, 1000).await;
        p.close().await;
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
        let b = blast(&p, &msgs, 1000).await;
        p.close().await;
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
    let limit = ctx.timeout();
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
            ctx.report
                .note(format!("naive loop stopped by --timeout after {sent} rows"));
            break;
        }
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let _ = conn.close(200, "done".into()).await;

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
            "naive loop: drained the first {sent} of {} pending rows (a full drain at this rate would take ~{:.0} s); \
             its figure is the rate against a backlog of {} rows",
            ctx.rows,
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
        if let Err(e) = relay_run(ctx, broker, ordering).await {
            let msg = format!("relay {broker}/{ordering}: {e:#}");
            ctx.progress(format!("ERROR {msg}"));
            errors.push(msg);
        }
        ctx.cleanup().await;
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
    env.extend(ctx.extra_env.iter().cloned());

    ctx.progress(format!("relay {broker}/{ordering}: relay process draining"));
    let log = ctx.dir.join(format!("{key}.log"));
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
    let stopped = relay.stop(Duration::from_secs(45)).await;
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
        if let Err(e) = latency_run(ctx, notify).await {
            let msg = format!("latency notify={notify}: {e:#}");
            ctx.progress(format!("ERROR {msg}"));
            errors.push(msg);
        }
        ctx.cleanup().await;
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
    let status = relay.stop(Duration::from_secs(45)).await?;
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

/// The relay's claim statements, copied from `src/store/mod.rs` (`claim_none`,
/// `claim_aggregate`): keep in sync.
fn claim_none_sql(t: &str) -> String {
    const RETURNING: &str = "t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, \
                             t.headers, t.destination, t.attempts, t.created_at";
    format!(
        "WITH cand AS ( \
           SELECT id FROM {t} \
           WHERE status = 'pending' AND available_at <= now() \
           ORDER BY seq LIMIT $1 \
           FOR UPDATE SKIP LOCKED) \
         UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
           locked_by = $2, locked_at = now() \
         FROM cand WHERE t.id = cand.id \
         RETURNING {RETURNING}"
    )
}

fn claim_aggregate_sql(t: &str) -> String {
    const RETURNING: &str = "t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, \
                             t.headers, t.destination, t.attempts, t.created_at";
    format!(
        "WITH cand AS ( \
           SELECT id, seq, aggregate_type, aggregate_id FROM {t} \
           WHERE status = 'pending' AND available_at <= now() \
             AND (aggregate_id IS NULL OR seq <= $3) \
           ORDER BY seq LIMIT $4 \
           FOR UPDATE SKIP LOCKED), \
         ranked AS ( \
           SELECT c.*, lag(c.seq) OVER (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.seq) AS prev_seq \
           FROM cand c), \
         checked AS ( \
           SELECT r.id, r.seq, r.aggregate_type, r.aggregate_id, \
             (r.aggregate_id IS NULL OR NOT EXISTS ( \
                SELECT 1 FROM {t} e \
                WHERE e.aggregate_type = r.aggregate_type AND e.aggregate_id = r.aggregate_id \
                  AND e.status <> 'sent' AND e.seq < r.seq \
                  AND (r.prev_seq IS NULL OR e.seq > r.prev_seq))) AS free \
           FROM ranked r), \
         chained AS ( \
           SELECT id, seq, bool_and(free) OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY seq) AS ok \
           FROM checked), \
         picked AS ( \
           SELECT id FROM chained WHERE ok ORDER BY seq LIMIT $1) \
         UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
           locked_by = $2, locked_at = now() \
         FROM picked WHERE t.id = picked.id \
         RETURNING {RETURNING}"
    )
}

struct Explained {
    times_ms: Vec<f64>,
    plan: String,
}

/// Runs `EXPLAIN (ANALYZE, BUFFERS) <stmt>` `runs` times, each in a transaction rolled back.
async fn explain(pg: &Client, stmt: &str, runs: usize) -> Result<Explained> {
    let mut times_ms = Vec::new();
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
        plan = lines.join("\n");
    }
    Ok(Explained { times_ms, plan })
}

/// Small table (all pending) and large table (99 % sent), claim timings and plans.
pub async fn claim(ctx: &mut Ctx) -> Result<()> {
    claim_table(ctx, "claim_small", 10_000, false).await?;
    ctx.cleanup().await;
    claim_table(ctx, "claim_large", ctx.args.claim_rows, true).await
}

async fn claim_table(ctx: &mut Ctx, tag: &str, n: usize, mostly_sent: bool) -> Result<()> {
    let table = ctx.new_table(tag).await?;
    let label = if n >= 1_000_000 {
        format!("{}M", n / 1_000_000)
    } else {
        format!("{}k", n / 1000)
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
        fill_range(&ctx.pg, &table, from, to, aggregates, mostly_sent).await?;
        ctx.progress(format!("claim: {table}: {to} of {n} rows inserted"));
        from = to + 1;
    }
    let runs = 7;
    let none = format!("bench_claim_none_{}", ctx.run_id);
    let agg = format!("bench_claim_agg_{}", ctx.run_id);
    let exec_none = format!("EXECUTE {none}(500, 'outbox-bench')");
    let exec_agg = format!("EXECUTE {agg}(500, 'outbox-bench', 9223372036854775807, 2000)");
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
        // Before VACUUM: what a table looks like when vacuum lags (autovacuum is off here).
        ctx.pg.batch_execute(&format!("ANALYZE {table}")).await?;
        prepare_claims(&ctx.pg, &table, &none, &agg).await?;
        let before = explain(&ctx.pg, &exec_none, runs).await?;
        deallocate(&ctx.pg, &none, &agg).await;
        ctx.report.figure(
            "7 claim cost",
            "claim_none_large_unvacuumed_ms",
            &format!("claim_none, {label} rows 99% sent, before VACUUM (first run)"),
            before.times_ms.first().copied().unwrap_or(f64::NAN),
            "ms",
        );
        ctx.report.figure(
            "7 claim cost",
            "claim_none_large_unvacuumed_median_ms",
            &format!("claim_none, {label} rows 99% sent, before VACUUM (median of {runs})"),
            median(&before.times_ms),
            "ms",
        );
        ctx.report.plan(
            &format!("claim_none on {label} rows (99% sent), before VACUUM, last of {runs} runs"),
            &before.plan,
        );
        ctx.report
            .detail("claim_large_unvacuumed_ms", json!(before.times_ms));
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

    prepare_claims(&ctx.pg, &table, &none, &agg).await?;
    let result = async {
        let c_none = explain(&ctx.pg, &exec_none, runs).await?;
        let c_agg = explain(&ctx.pg, &exec_agg, runs).await?;
        Ok::<_, anyhow::Error>((c_none, c_agg))
    }
    .await;
    deallocate(&ctx.pg, &none, &agg).await;
    let (c_none, c_agg) = result?;
    let c_naive = explain(&ctx.pg, &naive_poll, 3).await?;

    let which = if mostly_sent { "large" } else { "small" };
    let desc = if mostly_sent {
        format!("{label} rows, 99% sent, vacuumed ({size})")
    } else {
        format!("{label} rows, all pending ({size})")
    };
    ctx.progress(format!(
        "claim: {desc}: claim_none median {:.2} ms, claim_aggregate median {:.2} ms, naive poll median {:.1} ms",
        median(&c_none.times_ms),
        median(&c_agg.times_ms),
        median(&c_naive.times_ms)
    ));
    ctx.report.figure(
        "7 claim cost",
        &format!("claim_none_{which}_ms"),
        &format!("claim_none (batch 500), {desc}, median of {runs}"),
        median(&c_none.times_ms),
        "ms",
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("claim_aggregate_{which}_ms"),
        &format!("claim_aggregate (batch 500, scan 2000), {desc}, median of {runs}"),
        median(&c_agg.times_ms),
        "ms",
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("naive_poll_{which}_ms"),
        &format!("naive SELECT … ORDER BY created_at LIMIT 50, {desc}"),
        median(&c_naive.times_ms),
        "ms",
    );
    ctx.report.plan(
        &format!("claim_none on {desc}, last of {runs} runs"),
        &c_none.plan,
    );
    ctx.report.plan(
        &format!("claim_aggregate on {desc}, last of {runs} runs"),
        &c_agg.plan,
    );
    ctx.report
        .plan(&format!("naive poll on {desc}"), &c_naive.plan);
    ctx.report.detail(
        &format!("claim_{which}"),
        json!({
            "rows": n, "size": size,
            "claim_none_ms": c_none.times_ms, "claim_aggregate_ms": c_agg.times_ms,
            "naive_poll_ms": c_naive.times_ms,
        }),
    );
    Ok(())
}

async fn prepare_claims(pg: &Client, table: &str, none: &str, agg: &str) -> Result<()> {
    pg.batch_execute(&format!(
        "PREPARE {none}(bigint, text) AS {}; PREPARE {agg}(bigint, text, bigint, bigint) AS {}",
        claim_none_sql(table),
        claim_aggregate_sql(table)
    ))
    .await?;
    Ok(())
}

async fn deallocate(pg: &Client, none: &str, agg: &str) {
    let _ = pg
        .batch_execute(&format!("DEALLOCATE {none}; DEALLOCATE {agg}"))
        .await;
}
