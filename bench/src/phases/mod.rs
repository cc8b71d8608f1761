//! The measurements, one file per phase. Each phase works on fresh, uniquely named tables,
//! exchanges, queues and topics (registered in the context, removed after the phase) and adds
//! its figures to the report.

mod broker;
mod claim;
mod console;
mod db;
mod dbcost;
mod drain;
mod http;
mod insert;
mod latency;
mod mysql;
mod naive;
mod nats;
mod outboxes;
mod redis;
mod retention;
mod steady;

pub use broker::broker_ceiling;
pub use claim::claim;
pub use console::console;
pub use db::db_ceiling;
pub use dbcost::dbcost;
pub use drain::{relay_runs, tracing_runs};
pub use http::http_runs;
pub use insert::insert_cost;
pub use latency::latency;
pub use mysql::mysql;
pub use naive::naive;
pub use nats::nats;
pub use outboxes::outboxes;
pub use redis::redis_runs;
pub use retention::{RetentionArgs, retention};
pub use steady::{SteadyArgs, steady};

use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::json;

use crate::Ctx;
use crate::util::CpuUsage;

/// Runs the relay process with `env` until it has drained `table`, checks the run
/// ([`stop_drained`]), and reports its rate and CPU per 100k messages as `<key>_msgs_per_s` and
/// `<key>_cpu_s_per_100k` under `section`, described as `what`; msgs/s.
async fn drain_and_report(
    ctx: &mut crate::Ctx,
    key: &str,
    env: &[(String, String)],
    table: &str,
    (section, what): (&str, &str),
) -> Result<f64> {
    let log = ctx.dir.join(format!("{key}.log"));
    let sentinel = ctx.sentinel().await;
    let cpu = crate::util::CpuSample::take();
    let started = std::time::Instant::now();
    let mut relay = crate::util::Relay::spawn(key, env, &log)?;
    profile_if_asked(ctx, &mut relay, key)?;
    let waited =
        crate::util::wait_drained(&ctx.pg, table, ctx.timeout(), || relay.check_alive()).await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    stop_drained(ctx, &mut relay, sentinel, waited, table).await?;
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "{key}: {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report
        .figure(section, &format!("{key}_msgs_per_s"), what, r, "msgs/s");
    if let Some(cpu) = cpu_per_100k(&usage, "relay", elapsed, ctx.rows) {
        ctx.report.figure(
            section,
            &format!("{key}_cpu_s_per_100k"),
            &format!("{what}: relay CPU (user+sys) per 100k msgs"),
            cpu,
            "s",
        );
    }
    ctx.report.detail(
        key,
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
    Ok(r)
}

/// With `--perf`, samples `relay` into `<key>.perf.data` in the scratch dir until it stops.
fn profile_if_asked(ctx: &mut crate::Ctx, relay: &mut crate::util::Relay, key: &str) -> Result<()> {
    if ctx.args.perf {
        let out = ctx.dir.join(format!("{key}.perf.data"));
        relay.attach_perf(&out)?;
        ctx.report
            .note(format!("{key}: perf profile in {}", out.display()));
    }
    Ok(())
}

/// Stops a relay process that drained `table` and checks the run: the services survived it
/// (`sentinel`), the drain finished (`waited`), the relay exited cleanly on SIGTERM, and every
/// row is sent.
async fn stop_drained(
    ctx: &mut crate::Ctx,
    relay: &mut crate::util::Relay,
    sentinel: crate::Sentinel,
    waited: Result<()>,
    table: &str,
) -> Result<()> {
    stop_checked(ctx, relay, sentinel, waited).await?;
    crate::util::verify_sent(&ctx.pg, table, ctx.rows).await
}

/// [`stop_drained`] but for the rows, which the caller checks (a table in another database).
async fn stop_checked(
    ctx: &mut crate::Ctx,
    relay: &mut crate::util::Relay,
    sentinel: crate::Sentinel,
    waited: Result<()>,
) -> Result<()> {
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
    Ok(())
}

/// Measures step `what` (`Ctx::measured`: again after a service restart): `run` gives its
/// result and `report` writes it. A failed step is said and its error added to `errors`, so
/// the phase goes on with the next; returns the result of a step that succeeded.
async fn measure<R>(
    ctx: &mut Ctx,
    what: &str,
    errors: &mut Vec<String>,
    run: impl AsyncFn(&mut Ctx) -> Result<R>,
    report: impl Fn(&mut Ctx, &R),
) -> Option<R> {
    let done = std::sync::Mutex::new(None);
    let result = ctx
        .measured(what, async |ctx: &mut Ctx| {
            let r = run(ctx).await?;
            report(ctx, &r);
            *done.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            Ok(())
        })
        .await;
    if let Err(e) = result {
        ctx.progress(format!("ERROR {what}: {e:#}"));
        errors.push(format!("{what}: {e:#}"));
    }
    done.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// The width of a summary table's first column: its longest label's (3 when there is none).
fn label_width<'a>(labels: impl Iterator<Item = &'a str>) -> usize {
    labels.map(|l| l.chars().count()).max().unwrap_or(3)
}

/// `Ok` when no case failed, else every case's error.
fn all_ok(errors: Vec<String>) -> Result<()> {
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("; "))
    }
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

/// CPU seconds (user + system) that process group `group` (see `CpuUsage::cores`) spent per
/// 100,000 messages, over a phase of `elapsed` that moved `n` messages.
fn cpu_per_100k(u: &CpuUsage, group: &str, elapsed: Duration, n: usize) -> Option<f64> {
    let cores = u.cores.get(group)?;
    Some(cores * elapsed.as_secs_f64() * 100_000.0 / n.max(1) as f64)
}

/// Reports the CPU of the whole machine (every process and the kernel) per 100,000 messages of
/// a bare ceiling, as `<key>_machine_cpu_s_per_100k`: with pgbench's, what a drain that needs
/// both the database statements and the sink pays on the same cores (the shared ceilings in
/// the summary).
fn machine_cpu_figure(
    ctx: &mut Ctx,
    phase: &str,
    key: &str,
    what: &str,
    (elapsed, usage): (Duration, &CpuUsage),
) {
    let seconds = usage.machine_busy * elapsed.as_secs_f64() * 100_000.0 / ctx.rows.max(1) as f64;
    ctx.report.figure(
        phase,
        &format!("{key}_machine_cpu_s_per_100k"),
        &format!("{what}: machine CPU (every process) per 100k"),
        seconds,
        "s",
    );
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
