//! The database ceiling: the relay's own claim + settle loop (`run_with`, in process) with a
//! no-op publisher, then pgbench replaying the same claim and mark-sent statements (rendered by
//! the library, as `migrate --print` renders the DDL) from 4 clients: what PostgreSQL does with
//! the relay's SQL when nothing else is in the way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use async_trait::async_trait;
use outbox_relay::PublisherFactory;
use outbox_relay::config::{Ordering, TableName};
use outbox_relay::message::OutboxMessage;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::publish::{ConnectError, Outcome, Publisher};
use outbox_relay::store::hot_path_sql;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{cpu_per_100k, cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, CpuUsage, avg_payload_bytes, fill, verify_sent, wait_drained};

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

    async fn publish(&self, _msg: &OutboxMessage, _envelope: &EnvelopeConfig) -> Outcome {
        Outcome::Confirmed
    }

    async fn close(&self) {}
}

/// The relay's own claim + settle loop (in process, `run_with`) with a no-op publisher.
pub async fn db_ceiling(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("db").await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let bytes = avg_payload_bytes(&ctx.pg, &table).await?;
    ctx.report
        .detail("payload_bytes_as_sent", json!(bytes.round()));
    let config = ctx.config(&table, |raw| raw.relay.ordering = Ordering::None)?;
    let batch = config.relay.batch_size;
    let token = CancellationToken::new();
    let _stop_on_drop = token.clone().drop_guard();
    let factory: PublisherFactory = Box::new(|| Arc::new(NoopPublisher) as Arc<dyn Publisher>);

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
    let label = format!("claim+settle, no-op publisher, batch {batch}, ordering none");
    let drained = (elapsed, &usage);
    drained_figure(ctx, &table, "db:", drained, "db_ceiling_rows_per_s", &label).await?;
    // The relay loop runs inside the bench process here.
    if let Some(cpu) = cpu_per_100k(&usage, "bench", elapsed, ctx.rows) {
        ctx.report.figure(
            "1 db ceiling",
            "db_ceiling_cpu_s_per_100k",
            "claim+settle, no-op publisher: relay CPU (user+sys) per 100k rows",
            cpu,
            "s",
        );
    }
    ctx.report.detail(
        "db_ceiling",
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
    pgbench_ceiling(ctx, batch).await
}

/// Checks that every row of `table` was sent, then reports the rate of a drain that took
/// `elapsed` and used `usage`: a progress line (`what` ahead of the rate) and the figure `key`
/// (labelled `label`, in rows/s) of the database ceiling.
async fn drained_figure(
    ctx: &mut Ctx,
    table: &str,
    what: &str,
    (elapsed, usage): (Duration, &CpuUsage),
    key: &str,
    label: &str,
) -> Result<()> {
    verify_sent(&ctx.pg, table, ctx.rows).await?;
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "{what} {r:.0} rows/s in {elapsed:.2?}; {}",
        cpu_text(usage)
    ));
    ctx.report.figure("1 db ceiling", key, label, r, "rows/s");
    Ok(())
}

/// pgbench clients replaying the relay's hot path.
const PGBENCH_CLIENTS: usize = 4;

/// pgbench running the relay's own claim (ordering none, `batch` rows, `FOR UPDATE SKIP
/// LOCKED`) and mark-sent statements from [`PGBENCH_CLIENTS`] clients until a table of
/// `ctx.rows` rows is drained. Each transaction is the claim, wrapped to keep the claimed ids
/// (`\gset`), then the mark-sent of those ids, each client with its own instance id.
async fn pgbench_ceiling(ctx: &mut Ctx, batch: usize) -> Result<()> {
    let table = ctx.new_table("pgbench").await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let name = TableName::parse(&table).map_err(|e| anyhow!("table name {table}: {e}"))?;
    let sql = hot_path_sql(&name);
    let instance = "('pgbench-' || :client_id)";
    let claim = sql
        .claim
        .replace("$1", &batch.to_string())
        .replace("$2", instance);
    let mark = sql
        .mark_sent
        .replace("$1", "':ids'::uuid[]")
        .replace("$2", instance);
    let script = format!(
        "WITH claimed AS ({claim}) SELECT coalesce(array_agg(id), '{{}}')::text AS ids FROM claimed \\gset\n{mark};\n"
    );
    let path = ctx.dir.join("pgbench-claim-mark.sql");
    std::fs::write(&path, &script).with_context(|| format!("cannot write {}", path.display()))?;
    // Enough transactions for the clients to drain the table, plus a few empty claims.
    let per_client = ctx.rows.div_ceil(batch * PGBENCH_CLIENTS) + 2;

    ctx.progress(format!(
        "db: pgbench, {PGBENCH_CLIENTS} clients × {per_client} (claim {batch} + mark sent)"
    ));
    let cpu = CpuSample::take();
    let started = Instant::now();
    let out = tokio::process::Command::new("pgbench")
        .args(["-n", "-M", "simple", "-f"])
        .arg(&path)
        .args([
            "-c",
            &PGBENCH_CLIENTS.to_string(),
            "-j",
            &PGBENCH_CLIENTS.to_string(),
        ])
        .args(["-t", &per_client.to_string()])
        .arg(&ctx.args.database_url)
        .output()
        .await
        .context("cannot run pgbench (PostgreSQL's client tools)")?;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    if !out.status.success() {
        bail!(
            "pgbench failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let label = format!(
        "pgbench: the relay's claim (batch {batch}) + mark sent, {PGBENCH_CLIENTS} clients"
    );
    let drained = (elapsed, &usage);
    drained_figure(
        ctx,
        &table,
        "db: pgbench",
        drained,
        "pgbench_claim_mark_rows_per_s",
        &label,
    )
    .await?;
    ctx.report.detail(
        "pgbench_claim_mark",
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage,
               "clients": PGBENCH_CLIENTS, "transactions_per_client": per_client,
               "script": script}),
    );
    Ok(())
}
