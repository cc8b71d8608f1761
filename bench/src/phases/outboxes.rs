//! Several outboxes in one relay process (issue #16): one busy outbox drained by a relay that
//! serves it alone, then by a relay that also serves 19 idle outboxes (same rows, same broker,
//! same run), then that 20-outbox relay's CPU and memory while every outbox is idle.
//!
//! The drain rate is timed from the relay's first claim in the busy outbox to the last
//! confirm: start-up (one schema check per outbox) is reported apart, since it is paid once
//! per process, not per message.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::json;
use tokio_postgres::Client;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, Relay, fill, wait_drained};

/// Outboxes in the crowded case: one busy, the rest idle.
const OUTBOXES: usize = 20;
/// How long the idle relay is watched.
const IDLE_WATCH: Duration = Duration::from_secs(20);

/// The busy outbox alone, then among 19 idle ones; then the idle cost of 20.
pub async fn outboxes(ctx: &mut Ctx) -> Result<()> {
    let exchange = ctx.new_binding("mo").await?;
    let alone = drain(ctx, &exchange, 1).await?;
    let crowded = drain(ctx, &exchange, OUTBOXES).await?;
    let ratio = crowded.rate / alone.rate;
    ctx.progress(format!(
        "outboxes: busy outbox alone {:.0} msgs/s, among {} {:.0} msgs/s (ratio {ratio:.2}); {} idle outboxes: {:.2}% of a core, peak RSS {:.1} MiB",
        alone.rate,
        OUTBOXES,
        crowded.rate,
        OUTBOXES,
        crowded.idle_cores * 100.0,
        crowded.peak_rss_mib,
    ));
    let phase = "10 several outboxes";
    ctx.report.figure(
        phase,
        "outboxes_busy_alone_msgs_per_s",
        "one busy outbox, relay serving it alone (RabbitMQ, ordering none)",
        alone.rate,
        "msgs/s",
    );
    ctx.report.figure(
        phase,
        "outboxes_busy_among_20_msgs_per_s",
        "the same outbox, relay also serving 19 idle outboxes",
        crowded.rate,
        "msgs/s",
    );
    ctx.report.figure(
        phase,
        "outboxes_busy_among_20_ratio",
        "busy among 20 / busy alone (target ≥ 0.90)",
        ratio,
        "ratio",
    );
    ctx.report.figure(
        phase,
        "outboxes_20_idle_core_percent",
        "relay with 20 idle outboxes: CPU (user+sys), % of one core (target < 1)",
        crowded.idle_cores * 100.0,
        "%",
    );
    ctx.report.figure(
        phase,
        "outboxes_20_peak_rss_mib",
        "relay with 20 outboxes: peak RSS over drain and idle (target < 64)",
        crowded.peak_rss_mib,
        "MiB",
    );
    ctx.report.detail(
        "outboxes",
        json!({
            "rows": ctx.rows, "alone_seconds": alone.seconds, "crowded_seconds": crowded.seconds,
            "alone_startup_seconds": alone.startup_seconds,
            "crowded_startup_seconds": crowded.startup_seconds,
            "alone_idle_core_percent": alone.idle_cores * 100.0,
            "alone_peak_rss_mib": alone.peak_rss_mib,
        }),
    );
    Ok(())
}

struct Drained {
    rate: f64,
    seconds: f64,
    startup_seconds: f64,
    idle_cores: f64,
    peak_rss_mib: f64,
}

/// A relay serving `n` outboxes, the first filled with the run's rows, the rest empty: its
/// drain rate, then its CPU over [`IDLE_WATCH`] once everything is idle.
async fn drain(ctx: &mut Ctx, exchange: &str, n: usize) -> Result<Drained> {
    let busy = ctx.new_table(&format!("mo{n}_busy")).await?;
    ctx.progress(format!(
        "outboxes: {n} outbox(es), filling {} rows into {busy}",
        ctx.rows
    ));
    fill(&ctx.pg, &busy, ctx.rows, ctx.args.aggregates).await?;
    let mut file = format!("[[outboxes]]\nname = \"busy\"\ntable = \"{busy}\"\n");
    for i in 1..n {
        let idle = ctx.new_table(&format!("mo{n}_idle{i}")).await?;
        file.push_str(&format!(
            "[[outboxes]]\nname = \"idle{i}\"\ntable = \"{idle}\"\n"
        ));
    }
    let path = ctx.dir.join(format!("outboxes_{n}.toml"));
    std::fs::write(&path, file)?;

    let mut env: Vec<(String, String)> = ctx
        .relay_env(&busy)
        .into_iter()
        .filter(|(k, _)| k != "RELAY_DATABASE__TABLE")
        .collect();
    env.push(("RELAY_CONFIG".into(), path.to_string_lossy().into_owned()));
    env.push(("RELAY_RELAY__ORDERING".into(), "none".into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), "rabbitmq".into()));
    env.push((
        "RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(),
        exchange.into(),
    ));
    env.extend(ctx.extra_env.iter().cloned());

    let key = format!("outboxes_{n}");
    let log = ctx.dir.join(format!("{key}.log"));
    let sentinel = ctx.sentinel().await;
    let spawned = Instant::now();
    let mut relay = Relay::spawn(&key, &env, &log)?;
    let (started, pending) = wait_first_claim(&ctx.pg, &busy, ctx.rows, ctx.timeout(), || {
        relay.check_alive()
    })
    .await?;
    let startup = started.duration_since(spawned);
    let waited = wait_drained(&ctx.pg, &busy, ctx.timeout(), || relay.check_alive()).await;
    let elapsed = started.elapsed();
    // Idle: let the last batches settle, then watch.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let cpu = CpuSample::take();
    tokio::time::sleep(IDLE_WATCH).await;
    let usage = cpu.usage();
    let peak_rss_mib = relay.peak_rss_kib().unwrap_or(0) as f64 / 1024.0;
    super::stop_drained(ctx, &mut relay, sentinel, waited, &busy).await?;
    let idle_cores = usage.cores.get("relay").copied().unwrap_or(0.0);
    ctx.progress(format!(
        "outboxes: {n} outbox(es): started in {startup:.2?}, then {:.0} msgs/s in {elapsed:.2?}; idle {}",
        rate(pending, elapsed),
        cpu_text(&usage)
    ));
    Ok(Drained {
        rate: rate(pending, elapsed),
        seconds: elapsed.as_secs_f64(),
        startup_seconds: startup.as_secs_f64(),
        idle_cores,
        peak_rss_mib,
    })
}

/// Waits for the relay's first claim in `table` (filled with `rows` pending rows): when it
/// came, and how many rows were still pending then (what the timed drain covers).
async fn wait_first_claim(
    pg: &Client,
    table: &str,
    rows: usize,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<(Instant, usize)> {
    let stmt = pg
        .prepare(&format!(
            "SELECT count(*) FROM {table} WHERE status = 'pending'"
        ))
        .await?;
    let deadline = Instant::now() + timeout;
    loop {
        let pending: i64 = pg.query_one(&stmt, &[]).await?.try_get(0)?;
        let pending = usize::try_from(pending).unwrap_or(0);
        if pending < rows {
            return Ok((Instant::now(), pending));
        }
        alive()?;
        if Instant::now() > deadline {
            bail!("the relay claimed nothing from {table} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
