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
use outbox_relay::store::bench::{CLAIMED_IDS, SESSION_SETTINGS, hot_path_sql, scan_window};
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

/// The relay's own claim + settle loop (in process, `run_with`) with a no-op publisher, then
/// pgbench on the same statements: with ordering none, then with ordering aggregate.
pub async fn db_ceiling(ctx: &mut Ctx) -> Result<()> {
    for ordering in [Ordering::None, Ordering::Aggregate] {
        let batch = relay_drain(ctx, ordering).await?;
        pgbench_ceiling(ctx, batch, ordering).await?;
    }
    Ok(())
}

/// The relay's own claim + settle loop (in process, `run_with`) with a no-op publisher and
/// `ordering`, draining a table; returns the batch size it claimed with.
async fn relay_drain(ctx: &mut Ctx, ordering: Ordering) -> Result<usize> {
    let (name, suffix) = ordering_names(ordering);
    let table = ctx.new_table(&format!("db{suffix}")).await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let bytes = avg_payload_bytes(&ctx.pg, &table).await?;
    ctx.report
        .detail("payload_bytes_as_sent", json!(bytes.round()));
    let config = ctx.config(&table, |raw| raw.relay.ordering = ordering)?;
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
    let label = format!("claim+settle, no-op publisher, batch {batch}, ordering {name}");
    let drained = (elapsed, &usage);
    let key = format!("db_ceiling{suffix}_rows_per_s");
    drained_figure(ctx, &table, &format!("db ({name}):"), drained, &key, &label).await?;
    // The relay loop runs inside the bench process here.
    if let Some(cpu) = cpu_per_100k(&usage, "bench", elapsed, ctx.rows) {
        ctx.report.figure(
            "1 db ceiling",
            &format!("db_ceiling{suffix}_cpu_s_per_100k"),
            &format!(
                "claim+settle, no-op publisher, ordering {name}: relay CPU (user+sys) per 100k rows"
            ),
            cpu,
            "s",
        );
    }
    ctx.report.detail(
        &format!("db_ceiling{suffix}"),
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
    Ok(batch)
}

/// The rows of the largest of the [`PGBENCH_CLIENTS`] parts an ordered claim splits `table`
/// into (the claim's own part expression).
async fn largest_part(ctx: &Ctx, table: &str, part_key: &str) -> Result<usize> {
    let sql = format!(
        "SELECT coalesce(max(n), 0) FROM (SELECT count(*) AS n FROM {table} \
         GROUP BY {part_key} % {PGBENCH_CLIENTS}) p"
    );
    let n: i64 = ctx.pg.query_one(&sql, &[]).await?.get(0);
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The ordering's name, and the suffix of the figures and tables measured with it.
fn ordering_names(ordering: Ordering) -> (&'static str, &'static str) {
    match ordering {
        Ordering::None => ("none", ""),
        Ordering::Aggregate => ("aggregate", "_aggregate"),
    }
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

/// `sql` with its placeholders `$1`, `$2`, … replaced by `values` in order (pgbench variables:
/// with `-M prepared` they are sent as parameters, as the relay sends its own).
fn bind_pgbench(sql: &str, values: &[&str]) -> String {
    values
        .iter()
        .enumerate()
        .rev()
        .fold(sql.to_owned(), |s, (i, v)| {
            s.replace(&format!("${}", i + 1), v)
        })
}

/// pgbench running the relay's own claim (`ordering`, `batch` rows, `FOR UPDATE SKIP
/// LOCKED`) and mark-sent statements from [`PGBENCH_CLIENTS`] clients until a table of
/// `ctx.rows` rows is drained. Each transaction is the claim, wrapped to keep the claimed ids
/// (`\gset`), then the mark-sent of those ids, each client with its own instance id. With
/// ordering `aggregate` each client claims its own part of the aggregates (as the relay's split
/// claim does), so the clients do not queue behind each other's heads.
async fn pgbench_ceiling(ctx: &mut Ctx, batch: usize, ordering: Ordering) -> Result<()> {
    let table = ctx
        .new_table(&format!("pgbench{}", ordering_names(ordering).1))
        .await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let name = TableName::parse(&table).map_err(|e| anyhow!("table name {table}: {e}"))?;
    let sql = hot_path_sql(&name);
    let instance = "('pgbench-' || :client_id)";
    // The relay's parameters: the batch, no watermark, its scan window, each client its part.
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let params = format!(
        "\\set batch {batch}\n\\set mark {}\n\\set scan {}\n\\set parts {PGBENCH_CLIENTS}\n",
        i64::MAX,
        scan_window(limit)
    );
    // The claim, answering one row `ids` (the claimed ids) for `\gset`.
    let ids = |claim: String| format!("WITH claimed AS ({claim}) {CLAIMED_IDS}");
    let ordered = [":batch", instance, ":mark", ":scan", ":parts", ":client_id"];
    let (claim, key, what) = match ordering {
        Ordering::None => (
            ids(bind_pgbench(&sql.claim, &[":batch", instance])),
            "pgbench_claim_mark_rows_per_s",
            "claim",
        ),
        Ordering::Aggregate if ctx.args.no_blocker_index => (
            ids(bind_pgbench(&sql.claim_aggregate_probing, &ordered)),
            "pgbench_claim_aggregate_mark_rows_per_s",
            "ordered claim",
        ),
        Ordering::Aggregate => (
            bind_pgbench(&sql.claim_aggregate_ids, &ordered),
            "pgbench_claim_aggregate_mark_rows_per_s",
            "ordered claim",
        ),
    };
    // Prepared (`-M prepared`): pgbench sends `:ids` and `:client_id` as parameters.
    let mark = bind_pgbench(&sql.mark_sent, &[":ids::uuid[]", instance]);
    let script = format!("{params}{claim} \\gset\n{mark};\n");
    let path = ctx.dir.join(format!("pgbench-{key}.sql"));
    std::fs::write(&path, &script).with_context(|| format!("cannot write {}", path.display()))?;
    // Enough transactions for the clients to drain the table (with ordering `aggregate`, the
    // largest part), plus a few empty claims.
    let per_client = match ordering {
        Ordering::None => ctx.rows.div_ceil(batch * PGBENCH_CLIENTS),
        Ordering::Aggregate => largest_part(ctx, &table, &sql.part_key)
            .await?
            .div_ceil(batch),
    } + 2;

    ctx.progress(format!(
        "db: pgbench, {PGBENCH_CLIENTS} clients × {per_client} ({what} {batch} + mark sent)"
    ));
    let cpu = CpuSample::take();
    let started = Instant::now();
    // The relay's sessions run prepared statements with its session settings.
    // After the caller's own PGOPTIONS, if any.
    let options: Vec<String> = std::env::var("PGOPTIONS")
        .into_iter()
        .chain(
            SESSION_SETTINGS
                .iter()
                .map(|(name, value)| format!("-c {name}={value}")),
        )
        .collect();
    let out = tokio::process::Command::new("pgbench")
        .env("PGOPTIONS", options.join(" "))
        .args(["-n", "-M", "prepared", "-f"])
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
        "pgbench: the relay's {what} (batch {batch}) + mark sent, {PGBENCH_CLIENTS} clients"
    );
    let drained = (elapsed, &usage);
    drained_figure(ctx, &table, "db: pgbench", drained, key, &label).await?;
    let short = key.trim_end_matches("_rows_per_s");
    super::machine_cpu_figure(ctx, "1 db ceiling", short, &label, drained);
    ctx.report.detail(
        short,
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage,
               "clients": PGBENCH_CLIENTS, "transactions_per_client": per_client,
               "script": script}),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::bind_pgbench;

    #[test]
    fn placeholders_are_bound_highest_first() {
        let values: Vec<String> = (1..=10).map(|i| format!(":v{i}")).collect();
        let values: Vec<&str> = values.iter().map(String::as_str).collect();
        assert_eq!(
            bind_pgbench("$1 $10 $2 ($1)", &values),
            ":v1 :v10 :v2 (:v1)"
        );
    }
}
