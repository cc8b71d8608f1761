//! Retention (`retention`): what `cleanup.retention` leaves of a plain and of a partitioned
//! outbox table (`database.partition_interval`) under minutes of steady traffic, each variant on
//! its own fresh table, created by `outbox-relay migrate` as an operator would.
//!
//! Per variant: the application's paced one-row writers (the `steady` phase's) beside the relay
//! binary draining to RabbitMQ with ordering `aggregate`, retention short (`2m`) and the
//! clean-up frequent (`10s`). Sampled every second: table + indexes size, dead tuples and rows
//! deleted (`n_tup_del`), summed over the partitions; the relay's claim timed every
//! `--retention-sample-every`. The third variant, `held`, is partitioned with a `REPEATABLE
//! READ` transaction that has read the table held open from 10 % to 60 % of the run: what
//! grows meanwhile, and whether retention catches up once it ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::ValueEnum;
use outbox_testkit::RelayBuilder;
use serde_json::{Value, json};
use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;

use super::steady::{
    Health, WriterPlan, WriterStats, claim_probe, health_text, insert_sql, lag_sql, mib,
    sample_health, start_relay, start_writing, warm_up, write, writer_clients,
};
use super::{cpu_per_100k, cpu_text};
use crate::Ctx;
use crate::flow::Flow;
use crate::util::{CpuSample, CpuUsage, median, percentile, pg_connect};

/// The retention phase's options.
#[derive(Debug, Clone, clap::Args)]
pub struct RetentionArgs {
    /// Retention phase: length of each variant's run, e.g. 10m, or 3m for a trial.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub retention_duration: Duration,
    /// Retention phase: variants, run in this order (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "plain,partitioned,held")]
    pub retention_variants: Vec<Variant>,
    /// Retention phase: the relay's `cleanup.retention`.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub retention_keep: Duration,
    /// Retention phase: the relay's `cleanup.interval`.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub retention_cleanup_every: Duration,
    /// Retention phase: `database.partition_interval` of the partitioned variants.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    pub retention_partition_interval: Duration,
    /// Retention phase: total rate of the paced writers, rows/s (one row per transaction).
    #[arg(long, default_value_t = 2000)]
    pub retention_rate: u32,
    /// Retention phase: application connections.
    #[arg(long, default_value_t = 4)]
    pub retention_connections: usize,
    /// Retention phase: how often the relay's claim is timed (size and statistics: every second).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub retention_sample_every: Duration,
}

/// Which table, and what else runs beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Variant {
    /// A plain table: retention DELETEs sent rows.
    Plain,
    /// `database.partition_interval` set: retention drops whole partitions.
    Partitioned,
    /// Partitioned, with a REPEATABLE READ transaction that read the table held open from 10 %
    /// to 60 % of the run.
    Held,
}

impl Variant {
    fn tag(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Partitioned => "partitioned",
            Self::Held => "held",
        }
    }

    /// In table, exchange and queue names (the relay limits table names to 40 characters,
    /// partitions add 15).
    fn short(self) -> &'static str {
        match self {
            Self::Plain => "pl",
            Self::Partitioned => "pt",
            Self::Held => "ph",
        }
    }

    fn partitioned(self) -> bool {
        matches!(self, Self::Partitioned | Self::Held)
    }

    fn label(self, a: &RetentionArgs) -> String {
        let interval = humantime::format_duration(a.retention_partition_interval);
        match self {
            Self::Plain => "plain table".to_owned(),
            Self::Partitioned => format!("partitioned ({interval})"),
            Self::Held => format!("partitioned ({interval}), REPEATABLE READ held"),
        }
    }
}

/// Every selected variant, one after the other, then the side-by-side table and the ratios.
pub async fn retention(ctx: &mut Ctx) -> Result<()> {
    let a = ctx.args.retention.clone();
    if a.retention_connections == 0 || a.retention_rate == 0 {
        bail!("--retention-connections and --retention-rate must be at least 1");
    }
    if a.retention_duration.is_zero()
        || a.retention_sample_every.is_zero()
        || a.retention_cleanup_every.is_zero()
        || a.retention_partition_interval.is_zero()
    {
        bail!(
            "--retention-duration, --retention-sample-every, --retention-cleanup-every and \
             --retention-partition-interval must be positive"
        );
    }
    let mut done = Vec::new();
    let mut errors = Vec::new();
    for &variant in &a.retention_variants {
        let what = format!("retention {}", variant.label(&a));
        let run = async |ctx: &mut Ctx| variant_run(ctx, variant).await;
        done.extend(super::measure(ctx, &what, &mut errors, run, report_variant).await);
    }
    report_summary(ctx, &done);
    super::all_ok(errors)
}

// ---------------------------------------------------------------------------------------------
// One variant

/// The REPEATABLE READ transaction of variant `held`: seconds after the origin when it had
/// read the table and when it ended.
#[derive(Debug, Clone, Copy)]
struct Held {
    from_s: f64,
    to_s: f64,
}

/// Everything one variant measured.
struct VariantResult {
    variant: Variant,
    label: String,
    duration_s: f64,
    writes: WriterStats,
    commit_p50_ms: f64,
    commit_p99_ms: f64,
    commit_max_ms: f64,
    lag_max_s: f64,
    /// One per second; those with a finite `claim_ms` also timed the claim.
    samples: Vec<Health>,
    /// Rows in the DEFAULT partition (its `n_live_tup`), one per sample.
    default_rows: Vec<i64>,
    /// Rows deleted over the run: the last `n_tup_del` seen of every relation, summed (a
    /// dropped partition's deletes included).
    deleted: i64,
    /// When the first retention window has passed: retention + clean-up interval, plus one
    /// partition interval for a partitioned table (a partition goes once its upper bound is
    /// older than retention).
    window_s: f64,
    /// The span over which a size is taken (its maximum): one partition interval, the period
    /// of a partitioned table's saw-tooth.
    span_s: f64,
    held: Option<Held>,
    cpu: CpuUsage,
    relay_cpu_s_per_100k: Option<f64>,
    delivered: usize,
    not_received: usize,
    relay_metrics: Value,
}

impl VariantResult {
    fn key(&self) -> String {
        format!("retention_{}", self.variant.tag())
    }

    fn commits_per_s(&self) -> f64 {
        self.writes.txs as f64 / self.duration_s.max(1e-9)
    }

    fn max_over(&self, from_s: f64, to_s: f64, f: fn(&Health) -> i64) -> Option<i64> {
        self.samples
            .iter()
            .filter(|h| h.at_s >= from_s && h.at_s <= to_s)
            .map(f)
            .max()
    }

    /// Table + indexes, the largest over one span from the end of the first window.
    fn size_first(&self) -> Option<i64> {
        self.max_over(self.window_s, self.window_s + self.span_s, |h| {
            h.total_bytes
        })
    }

    /// Table + indexes, the largest over the last span.
    fn size_end(&self) -> Option<i64> {
        self.max_over(self.duration_s - self.span_s, f64::INFINITY, |h| {
            h.total_bytes
        })
    }

    fn dead_max(&self) -> i64 {
        self.samples.iter().map(|h| h.dead).max().unwrap_or(0)
    }

    /// Vacuums (manual and auto) at the end, of the relations there then.
    fn vacuums(&self) -> i64 {
        self.samples.last().map_or(0, Health::vacuum_count)
    }

    fn partitions_max(&self) -> i64 {
        self.samples.iter().map(|h| h.partitions).max().unwrap_or(0)
    }

    /// Median claim time of the probes in `[from_s, to_s]`.
    fn claim_ms(&self, from_s: f64, to_s: f64) -> f64 {
        let v: Vec<f64> = self
            .samples
            .iter()
            .filter(|h| h.at_s >= from_s && h.at_s <= to_s)
            .map(|h| h.claim_ms)
            .collect();
        median(&v)
    }

    fn claim_first(&self) -> f64 {
        self.claim_ms(0.0, 60.0)
    }

    fn claim_last(&self) -> f64 {
        self.claim_ms(self.duration_s - 60.0, f64::INFINITY)
    }
}

async fn variant_run(ctx: &mut Ctx, variant: Variant) -> Result<VariantResult> {
    let a = ctx.args.retention.clone();
    let label = variant.label(&a);
    let key = format!("retention_{}", variant.tag());
    let table = format!("bench_ret_{}_{}", variant.short(), ctx.run_id);
    let interval = variant
        .partitioned()
        .then(|| humantime::format_duration(a.retention_partition_interval).to_string());
    migrate(ctx, &table, interval.as_deref()).await?;
    let probe = claim_probe(ctx, &table).await?;
    let insert_sql = insert_sql(&table);
    let flow = Flow::new();
    let sentinel = ctx.sentinel().await;
    let mut env = vec![
        ("RELAY_RELAY__ORDERING".to_owned(), "aggregate".to_owned()),
        (
            "RELAY_CLEANUP__RETENTION".to_owned(),
            humantime::format_duration(a.retention_keep).to_string(),
        ),
        (
            "RELAY_CLEANUP__INTERVAL".to_owned(),
            humantime::format_duration(a.retention_cleanup_every).to_string(),
        ),
    ];
    if let Some(interval) = &interval {
        env.push((PARTITION_ENV.to_owned(), interval.clone()));
    }
    let tag = format!("ret_{}", variant.short());
    let mut running = start_relay(ctx, &table, (&tag, "rabbitmq", &key), &flow, env).await?;
    warm_up(ctx, &insert_sql, &flow, &mut running).await?;

    let conns = a.retention_connections;
    let clients = writer_clients(ctx, conns).await?;
    let what = format!("retention {label}");
    let (origin, end) = start_writing(ctx, &flow, &what, &table, a.retention_duration);
    let plan = Arc::new(WriterPlan {
        sql: insert_sql,
        conns,
        batch: 1,
        period: Some(Duration::from_secs_f64(
            conns as f64 / f64::from(a.retention_rate),
        )),
        origin,
        end,
        aggregates: ctx.args.aggregates as u64,
        flow: Some(Arc::clone(&flow)),
    });
    let holder = if variant == Variant::Held {
        let client = pg_connect(&ctx.args.database_url).await?;
        let hold = (
            origin + a.retention_duration.mul_f64(0.1),
            origin + a.retention_duration.mul_f64(0.6),
        );
        Some(AbortOnDropHandle::new(tokio::spawn(hold_snapshot(
            client,
            table.clone(),
            origin,
            hold,
        ))))
    } else {
        None
    };
    let cpu = CpuSample::take();
    let cpu_at = Instant::now();
    let mut writers = tokio::task::JoinSet::new();
    for (k, client) in clients.into_iter().enumerate() {
        writers.spawn(write(client, k, Arc::clone(&plan)));
    }

    let watch = watch(
        ctx,
        (&table, &probe),
        (origin, end),
        &mut running,
        &mut writers,
    )
    .await?;
    let mut stats = watch.stats;
    while let Some(done) = writers.join_next().await {
        stats.merge(done.map_err(|e| anyhow!("writer task: {e}"))??);
    }
    let cpu_window = Instant::now().saturating_duration_since(cpu_at);
    let usage = cpu.usage();
    let held = match holder {
        Some(h) => Some(h.await.map_err(|e| anyhow!("holder task: {e}"))??),
        None => None,
    };
    let mut samples = watch.samples;
    let mut default_rows = watch.default_rows;
    let mut deletes = watch.deletes;
    let last = sample_health(
        &ctx.pg,
        &table,
        Some(&probe),
        a.retention_duration.as_secs_f64(),
    )
    .await?;
    keep_deletes(&mut deletes, &last);
    default_rows.push(default_partition_rows(&ctx.pg, &table).await?);
    samples.push(last);

    let super::steady::Stopped {
        not_received,
        metrics: relay_metrics,
        delivered,
        in_window,
    } = running.stop(ctx, &flow, cpu_window).await?;
    register_detached(ctx, &table).await?;
    ctx.check(sentinel).await?;

    let relay_cpu_s_per_100k = cpu_per_100k(&usage, "relay", cpu_window, in_window);
    let mut lat: Vec<f64> = stats.lat_ms.iter().map(|v| f64::from(*v)).collect();
    lat.sort_by(f64::total_cmp);
    let partition_s = a.retention_partition_interval.as_secs_f64();
    let result = VariantResult {
        variant,
        label,
        duration_s: a.retention_duration.as_secs_f64(),
        commit_p50_ms: percentile(&lat, 50.0),
        commit_p99_ms: percentile(&lat, 99.0),
        commit_max_ms: lat.last().copied().unwrap_or(f64::NAN),
        writes: stats,
        lag_max_s: watch.lag_max_s,
        samples,
        default_rows,
        deleted: deletes.values().sum(),
        window_s: a.retention_keep.as_secs_f64()
            + a.retention_cleanup_every.as_secs_f64()
            + if variant.partitioned() {
                partition_s
            } else {
                0.0
            },
        span_s: partition_s,
        held,
        cpu: usage,
        relay_cpu_s_per_100k,
        delivered: delivered.len(),
        not_received,
        relay_metrics,
    };
    ctx.progress(format!(
        "retention {}: {}; {}",
        result.label,
        result_text(&result),
        cpu_text(&result.cpu)
    ));
    Ok(result)
}

/// The relay's variable for `database.partition_interval`.
pub(super) const PARTITION_ENV: &str = "RELAY_DATABASE__PARTITION_INTERVAL";

/// Creates `table` with `outbox-relay migrate` (partitioned by `partition_interval` when
/// given), registered for removal first.
pub(super) async fn migrate(
    ctx: &mut Ctx,
    table: &str,
    partition_interval: Option<&str>,
) -> Result<()> {
    ctx.res.tables.push(table.to_owned());
    let mut builder = ctx
        .relay_env(table)
        .into_iter()
        .fold(RelayBuilder::bare(table).unset("RUST_LOG"), |b, (k, v)| {
            b.env(&k, v)
        })
        .log_file(&ctx.dir.join(format!("{table}.migrate.log")))
        .quiet();
    if let Some(interval) = partition_interval {
        builder = builder.env(PARTITION_ENV, interval);
    }
    let mut process = builder
        .try_spawn(&["migrate"])
        .with_context(|| format!("cannot start {}", outbox_testkit::relay_bin().display()))?;
    // The outer timeout ends the wait (and kills the process) before the inner one panics.
    let limit = Duration::from_secs(120);
    let waited = tokio::time::timeout(limit, process.wait_exit(limit * 2)).await;
    match waited {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => bail!(
            "outbox-relay migrate {table} exited with {status}: {}",
            process.tail(10)
        ),
        Err(_) => bail!(
            "outbox-relay migrate {table} did not finish within {limit:?}: {}",
            process.tail(10)
        ),
    }
}

/// Opens a REPEATABLE READ transaction at `from` with one read of `table` (its snapshot and
/// its locks), holds it until `to`, then commits: the seconds after `origin` when it had read
/// and when it ended.
async fn hold_snapshot(
    client: Client,
    table: String,
    origin: Instant,
    (from, to): (Instant, Instant),
) -> Result<Held> {
    tokio::time::sleep_until(from.into()).await;
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT id FROM {table} LIMIT 1"
        ))
        .await
        .context("cannot open the held REPEATABLE READ transaction")?;
    let from_s = origin.elapsed().as_secs_f64();
    eprintln!("           retention: REPEATABLE READ transaction open ({from_s:.0} s)");
    tokio::time::sleep_until(to.into()).await;
    client
        .batch_execute("COMMIT")
        .await
        .context("cannot end the held transaction")?;
    let to_s = origin.elapsed().as_secs_f64();
    eprintln!("           retention: REPEATABLE READ transaction ended ({to_s:.0} s)");
    Ok(Held { from_s, to_s })
}

/// What the watch loop gathered while the writers ran.
struct Watched {
    /// The writers that ended before the loop did (only failed ones do).
    stats: WriterStats,
    samples: Vec<Health>,
    default_rows: Vec<i64>,
    /// The last `n_tup_del` seen of each relation.
    deletes: HashMap<u32, i64>,
    lag_max_s: f64,
}

/// Once a second until `end`: the lag, the table's size and statistics (the claim too every
/// `--retention-sample-every`), and the relay and writers still alive.
async fn watch(
    ctx: &Ctx,
    (table, probe): (&str, &super::steady::Probe),
    (origin, end): (Instant, Instant),
    running: &mut super::steady::Running,
    writers: &mut tokio::task::JoinSet<Result<WriterStats>>,
) -> Result<Watched> {
    let every = ctx.args.retention.retention_sample_every;
    let lag_stmt = ctx.pg.prepare(&lag_sql(table)).await?;
    let mut w = Watched {
        stats: WriterStats::default(),
        samples: Vec::new(),
        default_rows: Vec::new(),
        deletes: HashMap::new(),
        lag_max_s: 0.0,
    };
    let mut next_probe = origin + every;
    let mut next_progress = origin + Duration::from_secs(30);
    let mut tick = tokio::time::interval_at(origin.into(), Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() + Duration::from_millis(500) < end {
        tick.tick().await;
        let lag: f64 = ctx.pg.query_one(&lag_stmt, &[]).await?.try_get(0)?;
        w.lag_max_s = w.lag_max_s.max(lag);
        running.alive()?;
        if let Some(done) = writers.try_join_next() {
            // A writer ends early only when it failed.
            w.stats
                .merge(done.map_err(|e| anyhow!("writer task: {e}"))??);
        }
        let now = Instant::now();
        let probed = (now >= next_probe).then_some(probe);
        if probed.is_some() {
            next_probe += every;
        }
        let h = sample_health(&ctx.pg, table, probed, origin.elapsed().as_secs_f64()).await?;
        keep_deletes(&mut w.deletes, &h);
        let in_default = default_partition_rows(&ctx.pg, table).await?;
        if now >= next_progress {
            ctx.progress(format!(
                "retention: {:.0} s: {}, {} rows deleted, {in_default} in the default partition, lag {lag:.2} s",
                h.at_s,
                health_text(&h),
                w.deletes.values().sum::<i64>()
            ));
            next_progress += Duration::from_secs(30);
        }
        w.samples.push(h);
        w.default_rows.push(in_default);
    }
    Ok(w)
}

/// Keeps the largest `n_tup_del` seen of each relation in `h`.
fn keep_deletes(seen: &mut HashMap<u32, i64>, h: &Health) {
    for &(oid, n) in &h.deletes {
        let v = seen.entry(oid).or_insert(0);
        *v = (*v).max(n);
    }
}

/// Live rows in `<table>_default` (0 when there is none): rows no partition of its range took.
async fn default_partition_rows(pg: &Client, table: &str) -> Result<i64> {
    let row = pg
        .query_one(
            "SELECT coalesce((SELECT n_live_tup FROM pg_stat_user_tables \
                WHERE relid = to_regclass($1 || '_default')), 0)",
            &[&table],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// Registers for removal any partition of `table` that retention detached and did not drop
/// (e.g. the relay stopped in between): `DROP TABLE` of the parent takes only attached ones.
async fn register_detached(ctx: &mut Ctx, table: &str) -> Result<()> {
    let rows = ctx
        .pg
        .query(
            "SELECT c.relname::text FROM pg_class c \
             WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition \
               AND c.relnamespace = 'public'::regnamespace \
               AND c.relname ~ ('^' || $1 || '_(p[0-9]{8}_[0-9]{4}|default|plain)$')",
            &[&table],
        )
        .await?;
    for r in rows {
        let name: String = r.try_get(0)?;
        ctx.progress(format!(
            "retention: {name} was detached and left behind; removed with the run"
        ));
        ctx.report.note(format!(
            "retention: partition {name} was detached and not dropped"
        ));
        ctx.res.tables.push(name);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Figures

fn fmt_mib(bytes: Option<i64>) -> String {
    bytes.map_or("-".into(), |b| format!("{:.1}", mib(b)))
}

/// `num / den`, NaN when either is missing or `den` is not positive.
fn ratio(num: Option<f64>, den: Option<f64>) -> f64 {
    match (num, den) {
        (Some(n), Some(d)) if d > 0.0 => n / d,
        _ => f64::NAN,
    }
}

fn size_growth(r: &VariantResult) -> f64 {
    ratio(
        r.size_end().map(|b| b as f64),
        r.size_first().map(|b| b as f64),
    )
}

fn result_text(r: &VariantResult) -> String {
    let mut parts = vec![
        format!(
            "{:.0} commits/s, commit p99 {:.2} / max {:.0} ms, max lag {:.2} s",
            r.commits_per_s(),
            r.commit_p99_ms,
            r.commit_max_ms,
            r.lag_max_s
        ),
        format!(
            "table+indexes {} MiB after the first window ({:.0} s) → {} MiB at the end ({:.2} ×)",
            fmt_mib(r.size_first()),
            r.window_s,
            fmt_mib(r.size_end()),
            size_growth(r)
        ),
        format!(
            "{} rows deleted, dead tuples max {}, {} vacuums, claim {:.2} → {:.2} ms",
            r.deleted,
            r.dead_max(),
            r.vacuums(),
            r.claim_first(),
            r.claim_last()
        ),
    ];
    if r.variant.partitioned() {
        parts.push(format!(
            "partitions max {}, default partition max {} rows",
            r.partitions_max(),
            r.default_rows.iter().max().copied().unwrap_or(0)
        ));
    }
    if let Some(cpu) = r.relay_cpu_s_per_100k {
        parts.push(format!("relay CPU {cpu:.2} s per 100k rows"));
    }
    if r.not_received > 0 {
        parts.push(format!("{} messages not received", r.not_received));
    }
    parts.join(", ")
}

/// While the held transaction was open, and after it.
struct HeldFigures {
    size_max: Option<i64>,
    dead_max: Option<i64>,
    partitions_max: Option<i64>,
    default_rows_max: Option<i64>,
    size_at_release: Option<i64>,
}

fn held_figures(r: &VariantResult, h: Held) -> HeldFigures {
    let during = |f: fn(&Health) -> i64| r.max_over(h.from_s, h.to_s, f);
    let default_rows_max = r
        .samples
        .iter()
        .zip(&r.default_rows)
        .filter(|(s, _)| s.at_s >= h.from_s && s.at_s <= h.to_s)
        .map(|(_, n)| *n)
        .max();
    HeldFigures {
        size_max: during(|s| s.total_bytes),
        dead_max: during(|s| s.dead),
        partitions_max: during(|s| s.partitions),
        default_rows_max,
        size_at_release: r
            .samples
            .iter()
            .find(|s| s.at_s >= h.to_s)
            .map(|s| s.total_bytes),
    }
}

fn report_variant(ctx: &mut Ctx, r: &VariantResult) {
    let key = r.key();
    let mut figures: Vec<(&str, String, f64, &str)> = vec![
        (
            "commits_per_s",
            "application commits/s".into(),
            r.commits_per_s(),
            "commits/s",
        ),
        (
            "commit_p99_ms",
            "commit latency p99".into(),
            r.commit_p99_ms,
            "ms",
        ),
        (
            "commit_max_ms",
            "commit latency max".into(),
            r.commit_max_ms,
            "ms",
        ),
        (
            "lag_max_s",
            "max lag (oldest ready row)".into(),
            r.lag_max_s,
            "s",
        ),
        (
            "size_first_mib",
            format!(
                "table+indexes after the first retention window ({:.0} s; max over {:.0} s)",
                r.window_s, r.span_s
            ),
            r.size_first().map_or(f64::NAN, mib),
            "MiB",
        ),
        (
            "size_end_mib",
            format!(
                "table+indexes at the end (max over the last {:.0} s)",
                r.span_s
            ),
            r.size_end().map_or(f64::NAN, mib),
            "MiB",
        ),
        (
            "size_growth",
            "table+indexes, end / after the first window (partitioned: target ≤ 1.2)".into(),
            size_growth(r),
            "×",
        ),
        (
            "rows_deleted",
            "rows deleted (n_tup_del, all partitions; partitioned: target 0)".into(),
            r.deleted as f64,
            "rows",
        ),
        (
            "dead_max",
            "dead tuples, max".into(),
            r.dead_max() as f64,
            "tuples",
        ),
        (
            "vacuums",
            "vacuums (manual + auto) at the end, of the relations there then".into(),
            r.vacuums() as f64,
            "vacuums",
        ),
        (
            "claim_first_ms",
            "claim time, median of the first minute".into(),
            r.claim_first(),
            "ms",
        ),
        (
            "claim_last_ms",
            "claim time, median of the last minute".into(),
            r.claim_last(),
            "ms",
        ),
        (
            "claim_growth",
            "claim time, last / first minute (target ≤ 1.5)".into(),
            r.claim_last() / r.claim_first(),
            "×",
        ),
    ];
    if let Some(cpu) = r.relay_cpu_s_per_100k {
        figures.push((
            "relay_cpu_s_per_100k",
            "relay CPU per 100k rows".into(),
            cpu,
            "s",
        ));
    }
    if r.variant.partitioned() {
        figures.push((
            "partitions_max",
            "partitions, max".into(),
            r.partitions_max() as f64,
            "partitions",
        ));
        figures.push((
            "default_rows_max",
            "rows in the DEFAULT partition, max".into(),
            r.default_rows.iter().max().copied().unwrap_or(0) as f64,
            "rows",
        ));
    }
    let held = r.held.map(|h| (h, held_figures(r, h)));
    if let Some((_, f)) = &held {
        let opt = |v: Option<i64>| v.map_or(f64::NAN, |v| v as f64);
        figures.extend([
            (
                "held_size_max_mib",
                "table+indexes, max while the transaction was open".into(),
                f.size_max.map_or(f64::NAN, mib),
                "MiB",
            ),
            (
                "held_size_at_release_mib",
                "table+indexes when it ended".into(),
                f.size_at_release.map_or(f64::NAN, mib),
                "MiB",
            ),
            (
                "held_dead_max",
                "dead tuples, max while it was open".into(),
                opt(f.dead_max),
                "tuples",
            ),
            (
                "held_partitions_max",
                "partitions, max while it was open".into(),
                opt(f.partitions_max),
                "partitions",
            ),
            (
                "held_default_rows_max",
                "rows in the DEFAULT partition, max while it was open".into(),
                opt(f.default_rows_max),
                "rows",
            ),
        ]);
    }
    for (k, what, v, unit) in figures {
        let label = format!("{}: {what}", r.label);
        ctx.report
            .figure("15 retention", &format!("{key}_{k}"), &label, v, unit);
    }
    let probes: Vec<Value> = r
        .samples
        .iter()
        .zip(&r.default_rows)
        .filter(|(h, _)| h.claim_ms.is_finite())
        .map(|(h, d)| {
            let mut j = h.json();
            if let Some(o) = j.as_object_mut() {
                o.insert("default_partition_rows".into(), json!(d));
            }
            j
        })
        .collect();
    let size_by_s: Vec<i64> = r.samples.iter().map(|h| h.total_bytes).collect();
    ctx.report.detail(
        &key,
        json!({
            "variant": r.variant.tag(), "label": r.label, "seconds": r.duration_s,
            "transactions": r.writes.txs, "rows": r.writes.rows,
            "commits_per_s": r.commits_per_s(), "commit_p50_ms": r.commit_p50_ms,
            "commit_p99_ms": r.commit_p99_ms, "commit_max_ms": r.commit_max_ms,
            "worst_start_late_s": r.writes.max_late.as_secs_f64(),
            "behind_at_end_s": r.writes.behind_at_end.as_secs_f64(),
            "lag_max_s": r.lag_max_s, "first_window_s": r.window_s, "span_s": r.span_s,
            "rows_deleted": r.deleted, "held": r.held.map(|h| json!({"from_s": h.from_s, "to_s": h.to_s})),
            "delivered": r.delivered, "not_received_60s_after": r.not_received,
            "samples_with_claim": probes, "total_bytes_by_second": size_by_s,
            "cpu": r.cpu, "relay_cpu_s_per_100k": r.relay_cpu_s_per_100k,
            "relay_metrics": r.relay_metrics,
            "settings": {
                "retention": humantime::format_duration(ctx.args.retention.retention_keep).to_string(),
                "cleanup_interval": humantime::format_duration(ctx.args.retention.retention_cleanup_every).to_string(),
                "partition_interval": r.variant.partitioned().then(|| humantime::format_duration(ctx.args.retention.retention_partition_interval).to_string()),
                "rate": ctx.args.retention.retention_rate, "connections": ctx.args.retention.retention_connections,
            },
            "extra_env": crate::masked_env(&ctx.extra_env),
        }),
    );
}

/// The side-by-side table, the partitioned ÷ plain ratios, and the held variant's story.
fn report_summary(ctx: &mut Ctx, runs: &[VariantResult]) {
    if runs.is_empty() {
        return;
    }
    let w = super::label_width(runs.iter().map(|r| r.label.as_str()));
    let mut text = format!(
        "{:<w$} {:>8} {:>8} {:>8} {:>7} {:>15} {:>6} {:>9} {:>9} {:>4} {:>15} {:>6} {:>8}\n",
        "variant",
        "commit/s",
        "c p99 ms",
        "c max ms",
        "lag s",
        "MiB 1st → end",
        "growth",
        "deleted",
        "dead max",
        "vac",
        "claim ms 1st/last",
        "parts",
        "cpu/100k"
    );
    for r in runs {
        text.push_str(&format!(
            "{:<w$} {:>8.0} {:>8.2} {:>8.0} {:>7.2} {:>15} {:>6.2} {:>9} {:>9} {:>4} {:>15} {:>6} {:>8}\n",
            r.label,
            r.commits_per_s(),
            r.commit_p99_ms,
            r.commit_max_ms,
            r.lag_max_s,
            format!("{} → {}", fmt_mib(r.size_first()), fmt_mib(r.size_end())),
            size_growth(r),
            r.deleted,
            r.dead_max(),
            r.vacuums(),
            format!("{:.2}/{:.2}", r.claim_first(), r.claim_last()),
            if r.variant.partitioned() {
                r.partitions_max().to_string()
            } else {
                "-".into()
            },
            r.relay_cpu_s_per_100k
                .map_or("-".into(), |v| format!("{v:.2}")),
        ));
    }
    let a = ctx.args.retention.clone();
    text.push_str(&format!(
        "(c = application commit; 1st = table + indexes, the largest over one partition interval \
         ({}) from the end of the first retention window (retention {} + clean-up interval {}, \
         + one partition interval when partitioned); end = the largest over the last partition \
         interval; deleted = n_tup_del over the table and its partitions; vac = vacuums, manual + \
         auto, at the end; parts = partitions, max; \
         claim = the relay's claim in a rolled-back transaction every {:?}, median per minute; \
         cpu = relay CPU s per 100k rows)\n",
        humantime::format_duration(a.retention_partition_interval),
        humantime::format_duration(a.retention_keep),
        humantime::format_duration(a.retention_cleanup_every),
        a.retention_sample_every
    ));
    let find = |v: Variant| runs.iter().find(|r| r.variant == v);
    if let Some(r) = find(Variant::Held)
        && let Some(h) = r.held
    {
        let f = held_figures(r, h);
        let reference = find(Variant::Partitioned).and_then(VariantResult::size_first);
        text.push_str(&format!(
            "held: REPEATABLE READ open {:.0}–{:.0} s: table+indexes up to {} MiB ({} at its end), \
             dead tuples up to {}, partitions up to {}, DEFAULT partition up to {} rows; at the end \
             {} MiB = {:.2} × its own first window, {:.2} × the unheld partitioned table's\n",
            h.from_s,
            h.to_s,
            fmt_mib(f.size_max),
            fmt_mib(f.size_at_release),
            f.dead_max.unwrap_or(0),
            f.partitions_max.unwrap_or(0),
            f.default_rows_max.unwrap_or(0),
            fmt_mib(r.size_end()),
            size_growth(r),
            ratio(
                r.size_end().map(|b| b as f64),
                reference.map(|b| b as f64)
            ),
        ));
        ctx.report.figure(
            "15 retention",
            "retention_held_end_vs_partitioned_first",
            &format!(
                "{}: table+indexes at the end / the unheld partitioned table's after its first window",
                r.label
            ),
            ratio(
                r.size_end().map(|b| b as f64),
                reference.map(|b| b as f64),
            ),
            "×",
        );
    }
    if let (Some(p), Some(plain)) = (find(Variant::Partitioned), find(Variant::Plain)) {
        ctx.report.figure(
            "ratios",
            "ratio_retention_partitioned_vs_plain_commits",
            "retention: application commits/s, partitioned / plain (target ≥ 0.98)",
            ratio(Some(p.commits_per_s()), Some(plain.commits_per_s())),
            "×",
        );
        ctx.report.figure(
            "ratios",
            "ratio_retention_partitioned_vs_plain_relay_cpu",
            "retention: relay CPU per 100k rows, partitioned / plain",
            ratio(p.relay_cpu_s_per_100k, plain.relay_cpu_s_per_100k),
            "×",
        );
        ctx.report.figure(
            "ratios",
            "ratio_retention_partitioned_vs_plain_size_end",
            "retention: table+indexes at the end, partitioned / plain",
            ratio(
                p.size_end().map(|b| b as f64),
                plain.size_end().map(|b| b as f64),
            ),
            "×",
        );
    }
    ctx.report.section("retention, side by side", &text);
}
