//! Commit → consumer receive at a steady insert rate, with and without NOTIFY.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::json;
use tokio::task::JoinSet;
use tokio_postgres::Client;
use uuid::Uuid;

use super::{cpu_text, scrape};
use crate::flow::{Consumer, Flow};
use crate::util::{CpuSample, CpuUsage, Relay, payload, percentile, pg_connect};
use crate::{Ctx, Sentinel};

/// The commit → consume targets with the wake-up on (they were a test's assertions; a loaded
/// machine misses them, so the benchmark reports them instead).
const TARGETS_MS: [(&str, f64); 2] = [("p50", 10.0), ("p99", 50.0)];

/// Waits for every inserter of a latency run, checking after each that the relay is still up;
/// what they recorded, or the first inserter's error.
pub(super) async fn join_inserters<T: Send + 'static>(
    mut tasks: JoinSet<Result<Vec<T>>>,
    relay: &mut Relay,
) -> Result<Vec<T>> {
    let mut recorded = Vec::new();
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(v)) => recorded.extend(v),
            Ok(Err(e)) => errors.push(format!("{e:#}")),
            Err(e) => errors.push(format!("inserter task: {e}")),
        }
        relay.check_alive()?;
    }
    match errors.first() {
        Some(e) => bail!("inserter failed: {e}"),
        None => Ok(recorded),
    }
}

/// From `start` to the latest of `commits` (zero when there are none).
pub(super) fn since(
    start: tokio::time::Instant,
    commits: impl Iterator<Item = Instant>,
) -> Duration {
    commits
        .max()
        .map_or(Duration::ZERO, |last| last.duration_since(start.into_std()))
}

/// Commit → consumer receive, RabbitMQ, ordering aggregate, with and without NOTIFY.
pub async fn latency(ctx: &mut Ctx) -> Result<()> {
    let mut errors = Vec::new();
    for notify in [true, false] {
        let what = format!("latency notify={notify}");
        let result = ctx
            .measured(&what, async |ctx: &mut Ctx| latency_run(ctx, notify).await)
            .await;
        if let Err(e) = result {
            ctx.progress(format!("ERROR {what}: {e:#}"));
            errors.push(format!("{what}: {e:#}"));
        }
    }
    super::all_ok(errors)
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

    // The consumer: pairs each message with its row's commit.
    let flow = Flow::new();
    let consumer = Consumer::rabbitmq(&ctx.args.amqp_url, &name, Arc::clone(&flow)).await?;

    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__NOTIFY".into(), notify.to_string()));
    let (mut relay, metrics_port) = spawn_relay(ctx, key, env, &name)?;

    let insert_sql = format!("{} RETURNING id", super::insert::app_insert_sql(&table));

    // Warm-up: one row through the whole path (the relay is connected and listening).
    let warm = pg_connect(&ctx.args.database_url).await?;
    let id: Uuid = warm
        .query_one(&insert_sql, &[&"warmup", &payload(0, AGGREGATES)])
        .await?
        .try_get(0)?;
    flow.warm_up(&[id], &mut relay).await?;

    let (rate_per_s, total, period, workers) = pace(ctx);
    ctx.progress(format!(
        "latency notify={notify}: inserting {total} rows at {rate_per_s}/s over {} aggregates ({workers} connections)",
        AGGREGATES
    ));
    let mut clients = Vec::new();
    for _ in 0..workers {
        clients.push(pg_connect(&ctx.args.database_url).await?);
    }
    let cpu = CpuSample::take();
    let mut tasks = JoinSet::new();
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    for (k, client) in clients.into_iter().enumerate() {
        let sql = insert_sql.clone();
        tasks.spawn(insert_worker(
            client,
            sql,
            (k as u64, workers, total),
            (start, period),
            AGGREGATES,
            Arc::clone(&flow),
        ));
    }
    let commits = join_inserters(tasks, &mut relay).await?;
    let insert_window = since(start, commits.iter().map(|(at, _)| *at));
    let max_sched_lag = commits.iter().map(|c| c.1).max().unwrap_or_default();

    let end = RunEnd {
        key,
        sentinel,
        commits: commits.len(),
        metrics_port,
        cpu,
    };
    let e = end.finish(ctx, &flow, relay, consumer).await?;
    let (p50, p95, p99, max) = (e.p50, e.p95, e.p99, e.max);
    if let Some(k) = e.rss {
        ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
    }
    let achieved = commits.len() as f64 / insert_window.as_secs_f64().max(1e-9);
    ctx.progress(format!(
        "latency notify={notify}: p50 {p50:.1} ms, p95 {p95:.1} ms, p99 {p99:.1} ms, max {max:.1} ms \
         ({} msgs, achieved {achieved:.0} inserts/s, worst schedule lag {max_sched_lag:.1?}); {}",
        e.lat.len(),
        cpu_text(&e.usage)
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
        let target = TARGETS_MS
            .iter()
            .find(|(name, _)| notify && *name == p)
            .map(|(_, ms)| format!(" (target < {ms} ms)"))
            .unwrap_or_default();
        ctx.report.figure(
            "5 latency",
            &format!("{key}_{p}_ms"),
            &format!("{label}, {p}{target}"),
            v,
            "ms",
        );
    }
    if notify {
        let missed: Vec<String> = [("p50", p50), ("p99", p99)]
            .iter()
            .zip(TARGETS_MS)
            .filter(|((_, v), (_, ms))| *v >= *ms)
            .map(|((p, v), (_, ms))| format!("{p} {v:.1} ms ≥ {ms} ms"))
            .collect();
        ctx.progress(if missed.is_empty() {
            "latency targets met (NOTIFY on: p50 < 10 ms, p99 < 50 ms)".to_owned()
        } else {
            format!("latency targets MISSED: {}", missed.join(", "))
        });
    }
    ctx.report.detail(
        key,
        json!({
            "rate_per_s": rate_per_s, "seconds": ctx.lat_secs, "messages": e.lat.len(),
            "achieved_inserts_per_s": achieved, "worst_schedule_lag_ms": max_sched_lag.as_secs_f64() * 1000.0,
            "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "max_ms": max,
            "peak_rss_mib": e.rss.map(|k| k as f64 / 1024.0), "cpu": e.usage,
            "relay_metrics": e.metrics,
        }),
    );
    Ok(())
}

/// The pace of a latency run's writers: rows per second, rows in all, the time between two
/// rows, and how many connections insert them (8 at most).
pub(super) fn pace(ctx: &Ctx) -> (u32, u64, Duration, u64) {
    let rate_per_s = ctx.lat_rate.max(1);
    let total = (u64::from(rate_per_s) * ctx.lat_secs).max(1);
    let period = Duration::from_secs_f64(1.0 / f64::from(rate_per_s));
    (rate_per_s, total, period, 8u64.min(total))
}

/// Spawns the relay of a latency run as `key` with `env` (the database's settings): ordering
/// aggregate, publishing to the RabbitMQ exchange `exchange`; with its metrics port.
pub(super) fn spawn_relay(
    ctx: &Ctx,
    key: &str,
    mut env: Vec<(String, String)>,
    exchange: &str,
) -> Result<(Relay, Option<u16>)> {
    env.push(("RELAY_RELAY__ORDERING".into(), "aggregate".into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), "rabbitmq".into()));
    env.push((
        "RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(),
        exchange.to_owned(),
    ));
    let metrics_port = ctx.metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());
    let log = ctx.dir.join(format!("{key}.log"));
    Ok((Relay::spawn(key, &env, &log)?, metrics_port))
}

/// What a latency run needs at its end.
pub(super) struct RunEnd<'k> {
    /// The run's name in the report.
    pub key: &'k str,
    /// Taken before the relay started: the run is void if a shared service restarted.
    pub sentinel: Sentinel,
    /// Rows committed.
    pub commits: usize,
    /// The relay's metrics port, if it serves metrics.
    pub metrics_port: Option<u16>,
    /// The machine's CPU counters when the inserts began.
    pub cpu: CpuSample,
}

/// What a latency run measured.
pub(super) struct Ended {
    pub usage: CpuUsage,
    pub metrics: serde_json::Value,
    /// The relay's peak resident set, KiB.
    pub rss: Option<u64>,
    /// Every message's commit → consume latency, ms, sorted.
    pub lat: Vec<f64>,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl RunEnd<'_> {
    /// Waits for every message (30 s after the last commit at most; a shortfall is noted),
    /// stops the relay with SIGTERM (it must exit cleanly) and the consumer, and sorts the
    /// latencies.
    pub(super) async fn finish(
        self,
        ctx: &mut Ctx,
        flow: &Flow,
        mut relay: Relay,
        consumer: Consumer,
    ) -> Result<Ended> {
        let missing = flow
            .wait_delivered(Duration::from_secs(30), || relay.check_alive())
            .await?;
        if missing > 0 {
            ctx.report.note(format!(
                "{}: {missing} of {} messages not received within 30 s",
                self.key, self.commits
            ));
        }
        let usage = self.cpu.usage();
        let rss = relay.peak_rss_kib();
        let metrics = scrape(self.metrics_port).await;
        let status = relay.stop(Duration::from_secs(45)).await?;
        ctx.check(self.sentinel).await?;
        if !status.success() {
            bail!(
                "the relay exited with {status} after SIGTERM; end of its log:\n{}",
                relay.tail(20)
            );
        }
        consumer.stop().await;
        let mut lat: Vec<f64> = flow
            .take_delivered()
            .iter()
            .map(|d| f64::from(d.latency_ms))
            .collect();
        lat.sort_by(f64::total_cmp);
        if lat.is_empty() {
            bail!("no message received");
        }
        Ok(Ended {
            usage,
            metrics,
            rss,
            p50: percentile(&lat, 50.0),
            p95: percentile(&lat, 95.0),
            p99: percentile(&lat, 99.0),
            max: lat.last().copied().unwrap_or(f64::NAN),
            lat,
        })
    }
}

/// Inserts rows `k, k+workers, …` below `total`, each at `start + i·period`, one row per
/// transaction, reporting each commit to `flow`; returns (commit instant, how late the insert
/// started) of each.
async fn insert_worker(
    client: Client,
    sql: String,
    (k, workers, total): (u64, u64, u64),
    (start, period): (tokio::time::Instant, Duration),
    aggregates: u64,
    flow: Arc<Flow>,
) -> Result<Vec<(Instant, Duration)>> {
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
        let at = Instant::now();
        flow.committed(&[id], at);
        out.push((at, late));
        i += workers;
    }
    Ok(out)
}
