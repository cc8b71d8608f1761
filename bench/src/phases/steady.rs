//! Steady state (`steady`): application writers for minutes on end, as a live application
//! writes, beside the relay on its defaults (to RabbitMQ and to Kafka), beside the relay
//! polling only (`relay.notify = false`), and with no relay at all; each run on a fresh table.
//!
//! Per run: the application's commits/s and commit latency, how far paced writers fell behind
//! their schedule, commit → consume latency, the largest lag, and the table's health over time
//! (size, dead tuples, the relay's claim timed once per sampling interval) — the figures of
//! issue #13's targets: the default wake-up against poll-only for the application, and a table
//! that stays the same size for as long as the traffic lasts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::ValueEnum;
use outbox_relay::config::TableName;
use outbox_relay::store::bench::{SESSION_SETTINGS, hot_path_sql, scan_window};
use serde_json::{Value, json};
use tokio_postgres::Client;
use uuid::Uuid;

use super::claim::explain;
use super::{cpu_per_100k, cpu_text, scrape};
use crate::Ctx;
use crate::flow::{Consumer, Flow};
use crate::util::{CpuSample, CpuUsage, Relay, aggregate_id, payload, percentile, pg_connect};

/// The steady phase's options.
#[derive(Debug, Clone, clap::Args)]
pub struct SteadyArgs {
    /// Steady phase: length of each run (one per case and writer mode), e.g. 60s, 10m.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    pub steady_duration: Duration,
    /// Steady phase: total rate of the paced writers, rows/s (spread over the connections).
    #[arg(long, default_value_t = 2000)]
    pub steady_rate: u32,
    /// Steady phase: application connections.
    #[arg(long, default_value_t = 8)]
    pub steady_connections: usize,
    /// Steady phase: rows per transaction of the batched writers.
    #[arg(long, default_value_t = 10)]
    pub steady_batch: usize,
    /// Steady phase: writer modes, run in this order (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "single-paced,single-max,batch-paced,batch-max"
    )]
    pub steady_writers: Vec<Writers>,
    /// Steady phase: cases, run side by side for each writer mode (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "no-relay,default-rabbitmq,default-kafka,poll-rabbitmq"
    )]
    pub steady_cases: Vec<Case>,
    /// Steady phase: the relay's `cleanup.retention` (e.g. 0s, 1m) [default: the relay's, 24h].
    #[arg(long)]
    pub steady_retention: Option<String>,
    /// Steady phase: how often table size, dead tuples and claim time are sampled.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    pub steady_sample_every: Duration,
}

/// How the application writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Writers {
    /// One row per transaction, at `--steady-rate` in total.
    SinglePaced,
    /// One row per transaction, as fast as they go.
    SingleMax,
    /// `--steady-batch` rows per transaction, at `--steady-rate` rows/s in total.
    BatchPaced,
    /// `--steady-batch` rows per transaction, as fast as they go.
    BatchMax,
}

impl Writers {
    fn tag(self) -> &'static str {
        match self {
            Self::SinglePaced => "single_paced",
            Self::SingleMax => "single_max",
            Self::BatchPaced => "batch_paced",
            Self::BatchMax => "batch_max",
        }
    }

    /// In table names, which the relay limits to 40 characters.
    fn short(self) -> &'static str {
        match self {
            Self::SinglePaced => "1p",
            Self::SingleMax => "1m",
            Self::BatchPaced => "np",
            Self::BatchMax => "nm",
        }
    }

    fn batched(self) -> bool {
        matches!(self, Self::BatchPaced | Self::BatchMax)
    }

    fn paced(self) -> bool {
        matches!(self, Self::SinglePaced | Self::BatchPaced)
    }

    fn label(self, a: &SteadyArgs) -> String {
        let rows = if self.batched() { a.steady_batch } else { 1 };
        let pace = if self.paced() {
            format!("{} rows/s", a.steady_rate)
        } else {
            "max".to_owned()
        };
        format!("{} conn × {rows} row/txn, {pace}", a.steady_connections)
    }
}

/// What runs beside the writers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Case {
    /// No relay: the application alone on the migrated table.
    NoRelay,
    /// The relay on its defaults (notify = true), to RabbitMQ.
    DefaultRabbitmq,
    /// The relay on its defaults, to Kafka.
    DefaultKafka,
    /// The relay with `relay.notify = false` (poll only), to RabbitMQ.
    PollRabbitmq,
}

impl Case {
    fn tag(self) -> &'static str {
        match self {
            Self::NoRelay => "none",
            Self::DefaultRabbitmq => "default_rmq",
            Self::DefaultKafka => "default_kafka",
            Self::PollRabbitmq => "poll_rmq",
        }
    }

    /// In table, exchange and topic names.
    fn short(self) -> &'static str {
        match self {
            Self::NoRelay => "none",
            Self::DefaultRabbitmq => "dflt_rmq",
            Self::DefaultKafka => "dflt_kfk",
            Self::PollRabbitmq => "poll_rmq",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::NoRelay => "no relay",
            Self::DefaultRabbitmq => "relay defaults → RabbitMQ",
            Self::DefaultKafka => "relay defaults → Kafka",
            Self::PollRabbitmq => "relay notify=false → RabbitMQ",
        }
    }

    fn broker(self) -> Option<&'static str> {
        match self {
            Self::NoRelay => None,
            Self::DefaultRabbitmq | Self::PollRabbitmq => Some("rabbitmq"),
            Self::DefaultKafka => Some("kafka"),
        }
    }
}

/// Partitions of the bench's topics (`Ctx::new_topic`).
const PARTITIONS: i32 = 3;

/// Every selected writer mode × case, interleaved so that the cases of one mode run close
/// together in time; then the summary table and the ratios.
pub async fn steady(ctx: &mut Ctx) -> Result<()> {
    let a = ctx.args.steady.clone();
    if a.steady_connections == 0 || a.steady_batch == 0 || a.steady_rate == 0 {
        bail!("--steady-connections, --steady-batch and --steady-rate must be at least 1");
    }
    if a.steady_duration.is_zero() || a.steady_sample_every.is_zero() {
        bail!("--steady-duration and --steady-sample-every must be positive");
    }
    server_settings(ctx).await?;
    let mut cases = a.steady_cases.clone();
    if cases.contains(&Case::DefaultKafka)
        && let Err(e) = kafka_up(ctx).await
    {
        let msg = format!("steady: Kafka case skipped: {e}");
        ctx.progress(&msg);
        ctx.report.note(msg);
        cases.retain(|c| *c != Case::DefaultKafka);
    }
    let mut done = Vec::new();
    let mut errors = Vec::new();
    for &mode in &a.steady_writers {
        for &case in &cases {
            let what = format!("steady {} / {}", mode.label(&a), case.label());
            let run = async |ctx: &mut Ctx| steady_run(ctx, mode, case).await;
            done.extend(super::measure(ctx, &what, &mut errors, run, report_run).await);
        }
    }
    report_summary(ctx, &done);
    super::all_ok(errors)
}

/// The server's autovacuum settings as found (and the table's storage parameters, read on a
/// table the migration just created), in a note and in the JSON details.
async fn server_settings(ctx: &mut Ctx) -> Result<()> {
    let rows = ctx
        .pg
        .query(
            "SELECT name, setting || coalesce(unit, '') FROM pg_settings \
             WHERE name LIKE 'autovacuum%' OR name IN ('track_counts', 'server_version') \
             ORDER BY name",
            &[],
        )
        .await?;
    let mut settings = serde_json::Map::new();
    for r in &rows {
        settings.insert(r.try_get(0)?, Value::String(r.try_get(1)?));
    }
    let table = ctx.new_table("st_settings").await?;
    let reloptions: String = ctx
        .pg
        .query_one(
            "SELECT coalesce(array_to_string(reloptions, ', '), '') FROM pg_class \
             WHERE oid = $1::text::regclass",
            &[&table],
        )
        .await?
        .try_get(0)?;
    ctx.cleanup().await;
    let get = |k: &str| settings.get(k).and_then(Value::as_str).unwrap_or("?");
    let msg = format!(
        "steady: server autovacuum = {} (naptime {}, vacuum_scale_factor {}, vacuum_threshold {}, \
         vacuum_cost_delay {}); the migrated table's reloptions: {}",
        get("autovacuum"),
        get("autovacuum_naptime"),
        get("autovacuum_vacuum_scale_factor"),
        get("autovacuum_vacuum_threshold"),
        get("autovacuum_vacuum_cost_delay"),
        if reloptions.is_empty() {
            "none"
        } else {
            &reloptions
        }
    );
    ctx.progress(&msg);
    ctx.report.note(msg);
    ctx.report.detail(
        "steady_server",
        json!({"settings": settings, "table_reloptions": reloptions}),
    );
    Ok(())
}

/// `Ok` when the Kafka broker accepts connections and the tansu CLI (which creates topics) is
/// there.
async fn kafka_up(ctx: &Ctx) -> Result<()> {
    if !ctx.args.tansu.is_file() {
        bail!(
            "no tansu CLI at {} to create topics (--tansu)",
            ctx.args.tansu.display()
        );
    }
    let first = ctx.args.kafka_brokers.split(',').next().unwrap_or_default();
    let addr = first
        .rsplit("://")
        .next()
        .unwrap_or(first)
        .trim()
        .to_owned();
    match tokio::time::timeout(
        Duration::from_secs(3),
        tokio::net::TcpStream::connect(&addr),
    )
    .await
    {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => bail!("no Kafka broker at {addr} ({e}); scripts/services.sh starts tansu"),
        Err(_) => bail!("no answer from the Kafka broker at {addr} within 3 s"),
    }
}

// ---------------------------------------------------------------------------------------------
// One run

/// The table's health at one instant: for a partitioned table, the sums over its partitions.
pub(super) struct Health {
    pub(super) at_s: f64,
    pub(super) total_bytes: i64,
    table_bytes: i64,
    index_bytes: i64,
    live: i64,
    pub(super) dead: i64,
    vacuums: i64,
    autovacuums: i64,
    /// Leaf partitions (0 for a plain table).
    pub(super) partitions: i64,
    /// `n_tup_del` of each relation (the table, or each partition) by oid: a partition that
    /// retention drops takes its count with it, so a caller that wants every delete keeps the
    /// last count it saw of each.
    pub(super) deletes: Vec<(u32, i64)>,
    /// NaN when the claim was not probed in this sample.
    pub(super) claim_ms: f64,
    claim_pages: u64,
}

impl Health {
    pub(super) fn json(&self) -> Value {
        json!({
            "at_s": self.at_s, "total_bytes": self.total_bytes, "table_bytes": self.table_bytes,
            "index_bytes": self.index_bytes, "live_tuples": self.live, "dead_tuples": self.dead,
            "vacuum_count": self.vacuums, "autovacuum_count": self.autovacuums,
            "partitions": self.partitions, "rows_deleted": self.deleted(),
            "claim_ms": self.claim_ms, "claim_pages": self.claim_pages,
        })
    }

    /// Vacuums, manual and auto, summed over the relations there now.
    pub(super) fn vacuum_count(&self) -> i64 {
        self.vacuums + self.autovacuums
    }

    /// `n_tup_del` summed over the relations there now.
    pub(super) fn deleted(&self) -> i64 {
        self.deletes.iter().map(|(_, n)| n).sum()
    }
}

/// Commit → consume over a run.
struct Consumed {
    messages: usize,
    not_received: usize,
    unpaired_receipts: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// Per sampling interval (by commit time): (p50, p99) ms.
    by_interval: Vec<(f64, f64)>,
}

/// Everything one run measured.
struct RunResult {
    mode: Writers,
    case: Case,
    label: String,
    window_s: f64,
    writes: WriterStats,
    commit_p50_ms: f64,
    commit_p99_ms: f64,
    commit_max_ms: f64,
    consumed: Option<Consumed>,
    lag_max_s: f64,
    lag_gauge_max_s: Option<f64>,
    health: Vec<Health>,
    // Seconds after the start when the retention window has filled (see `filled_after_s`):
    // growth is measured from the first sample at or after it.
    filled_s: f64,
    cpu: CpuUsage,
    relay_cpu_s_per_100k: Option<f64>,
    relay_metrics: Value,
}

impl RunResult {
    fn key(&self) -> String {
        format!("steady_{}_{}", self.mode.tag(), self.case.tag())
    }

    fn commits_per_s(&self) -> f64 {
        self.writes.txs as f64 / self.window_s.max(1e-9)
    }

    fn rows_per_s(&self) -> f64 {
        self.writes.rows as f64 / self.window_s.max(1e-9)
    }

    /// The first sample after the start (after the first interval) at or after the retention
    /// window has filled (the first interval when it does not fill within the run), and the
    /// last.
    fn first_and_end(&self) -> Option<(&Health, &Health)> {
        match self.health.as_slice() {
            [_, rest @ ..] if rest.len() >= 2 => {
                let end = rest.last()?;
                // A retention longer than the run never fills: from the first interval then.
                let first = rest
                    .iter()
                    .find(|h| h.at_s >= self.filled_s)
                    .filter(|h| !std::ptr::eq(*h, end))
                    .or_else(|| rest.first())?;
                Some((first, end))
            }
            _ => None,
        }
    }
}

/// The relay's default `cleanup.interval`, in seconds.
const CLEANUP_INTERVAL_S: f64 = 60.0;

/// When the table's retained rows stop growing: retention plus one clean-up interval (rows are
/// kept between `retention` and `retention + cleanup.interval`). 0 with retention `0s` and with
/// no `--steady-retention` (the relay's 24 h never fills within a run; nor does any retention
/// longer than the run, for which `RunResult::first_and_end` falls back to the first interval).
fn filled_after_s(retention: Option<&str>) -> f64 {
    match retention.map(humantime::parse_duration) {
        Some(Ok(d)) if d.is_zero() => 0.0,
        Some(Ok(d)) => d.as_secs_f64() + CLEANUP_INTERVAL_S,
        _ => 0.0,
    }
}

/// The relay's side of a run: process, consumer, metrics port.
pub(super) struct Running {
    pub(super) relay: Relay,
    pub(super) consumer: Consumer,
    pub(super) port: u16,
}

impl Running {
    pub(super) fn alive(&mut self) -> Result<()> {
        self.relay.check_alive()
    }

    /// Waits (up to a minute) for what was committed to arrive, reads the relay's `/metrics`,
    /// stops the relay (an error if it does not exit cleanly on SIGTERM) and the consumer, and
    /// records the relay's peak RSS; `cpu_window` bounds the deliveries counted in `in_window`.
    pub(super) async fn stop(
        mut self,
        ctx: &mut Ctx,
        flow: &Flow,
        cpu_window: Duration,
    ) -> Result<Stopped> {
        let not_received = flow
            .wait_delivered(Duration::from_secs(60), || self.alive())
            .await?;
        let metrics = scrape(Some(self.port)).await;
        let stopped = self.relay.stop(Duration::from_secs(45)).await;
        self.consumer.stop().await;
        let status = stopped?;
        if !status.success() {
            bail!(
                "the relay exited with {status} after SIGTERM; end of its log:\n{}",
                self.relay.tail(20)
            );
        }
        if let Some(k) = self.relay.peak_rss_kib() {
            ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
        }
        let delivered = flow.take_delivered();
        let in_window = delivered
            .iter()
            .filter(|d| d.received_s() <= cpu_window.as_secs_f64())
            .count();
        Ok(Stopped {
            not_received,
            metrics,
            delivered,
            in_window,
        })
    }
}

/// What [`Running::stop`] leaves.
pub(super) struct Stopped {
    /// Rows committed but never received.
    pub(super) not_received: usize,
    /// The relay's `/metrics`, as read before it stopped.
    pub(super) metrics: Value,
    /// What arrived.
    pub(super) delivered: Vec<crate::flow::Delivered>,
    /// How many arrived within the CPU window.
    pub(super) in_window: usize,
}

async fn steady_run(ctx: &mut Ctx, mode: Writers, case: Case) -> Result<RunResult> {
    let a = ctx.args.steady.clone();
    let label = format!("{}, {}", mode.label(&a), case.label());
    let key = format!("steady_{}_{}", mode.tag(), case.tag());
    let table = ctx
        .new_table(&format!("st_{}_{}", case.short(), mode.short()))
        .await?;
    let probe = claim_probe(ctx, &table).await?;
    let batch = if mode.batched() { a.steady_batch } else { 1 };
    let insert_sql = insert_sql(&table);
    let flow = Flow::new();
    let sentinel = ctx.sentinel().await;
    let mut case_env = Vec::new();
    if case == Case::PollRabbitmq {
        case_env.push(("RELAY_RELAY__NOTIFY".to_owned(), "false".to_owned()));
    }
    if let Some(retention) = &a.steady_retention {
        case_env.push(("RELAY_CLEANUP__RETENTION".to_owned(), retention.clone()));
    }
    let tag = format!("st_{}", case.short());
    let mut running = match case.broker() {
        Some(broker) => {
            Some(start_relay(ctx, &table, (&tag, broker, &key), &flow, case_env).await?)
        }
        None => None,
    };
    if let Some(r) = running.as_mut() {
        warm_up(ctx, &insert_sql, &flow, r).await?;
    }

    let conns = a.steady_connections;
    let clients = writer_clients(ctx, conns).await?;
    let mut health = vec![sample_health(&ctx.pg, &table, Some(&probe), 0.0).await?];
    let what = format!("steady {label}");
    let (origin, end) = start_writing(ctx, &flow, &what, &table, a.steady_duration);
    let plan = Arc::new(WriterPlan {
        sql: insert_sql,
        conns,
        batch,
        period: mode
            .paced()
            .then(|| Duration::from_secs_f64((conns * batch) as f64 / f64::from(a.steady_rate))),
        origin,
        end,
        aggregates: ctx.args.aggregates as u64,
        flow: running.is_some().then(|| Arc::clone(&flow)),
    });
    let cpu = CpuSample::take();
    let cpu_at = Instant::now();
    let mut writers = tokio::task::JoinSet::new();
    for (k, client) in clients.into_iter().enumerate() {
        writers.spawn(write(client, k, Arc::clone(&plan)));
    }

    // Once a second: lag (from the table, and the relay's own gauge); once an interval: health.
    let lag_stmt = ctx.pg.prepare(&lag_sql(&table)).await?;
    let mut lag_max_s = 0f64;
    let mut gauge_max: Option<f64> = None;
    let mut next_sample = origin + a.steady_sample_every;
    let mut tick = tokio::time::interval_at(origin.into(), Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stats = WriterStats::default();
    while Instant::now() + Duration::from_millis(500) < end {
        tick.tick().await;
        let lag: f64 = ctx.pg.query_one(&lag_stmt, &[]).await?.try_get(0)?;
        lag_max_s = lag_max_s.max(lag);
        if let Some(r) = running.as_mut() {
            r.alive()?;
            if let Ok(m) = crate::util::scrape_metrics(r.port).await
                && let Some(v) = m.get(outbox_relay::telemetry::names::OLDEST_READY_AGE)
            {
                gauge_max = Some(gauge_max.unwrap_or(0.0).max(*v));
            }
        }
        if let Some(done) = writers.try_join_next() {
            // A writer ends early only when it failed.
            stats.merge(done.map_err(|e| anyhow!("writer task: {e}"))??);
        }
        if Instant::now() >= next_sample && Instant::now() + Duration::from_secs(1) < end {
            let at = origin.elapsed().as_secs_f64();
            let h = sample_health(&ctx.pg, &table, Some(&probe), at).await?;
            ctx.progress(format!(
                "steady {label}: {at:.0} s: {}, lag now {lag:.2} s",
                health_text(&h)
            ));
            health.push(h);
            next_sample += a.steady_sample_every;
        }
    }
    while let Some(done) = writers.join_next().await {
        stats.merge(done.map_err(|e| anyhow!("writer task: {e}"))??);
    }
    let window = end.saturating_duration_since(origin);
    let cpu_window = Instant::now().saturating_duration_since(cpu_at);
    let usage = cpu.usage();
    health.push(sample_health(&ctx.pg, &table, Some(&probe), window.as_secs_f64()).await?);

    let mut consumed = None;
    let mut relay_metrics = Value::Null;
    let mut relay_cpu = None;
    if let Some(r) = running {
        let Stopped {
            not_received,
            metrics,
            delivered,
            in_window,
        } = r.stop(ctx, &flow, cpu_window).await?;
        relay_metrics = metrics;
        relay_cpu = cpu_per_100k(&usage, "relay", cpu_window, in_window);
        consumed = Some(consumed_figures(
            &delivered,
            not_received,
            flow.unpaired_receipts(),
            a.steady_sample_every,
        ));
    }
    ctx.check(sentinel).await?;

    let mut lat: Vec<f64> = stats.lat_ms.iter().map(|v| f64::from(*v)).collect();
    lat.sort_by(f64::total_cmp);
    let result = RunResult {
        mode,
        case,
        label,
        window_s: window.as_secs_f64(),
        commit_p50_ms: percentile(&lat, 50.0),
        commit_p99_ms: percentile(&lat, 99.0),
        commit_max_ms: lat.last().copied().unwrap_or(f64::NAN),
        writes: stats,
        consumed,
        lag_max_s,
        lag_gauge_max_s: gauge_max,
        health,
        filled_s: filled_after_s(a.steady_retention.as_deref()),
        cpu: usage,
        relay_cpu_s_per_100k: relay_cpu,
        relay_metrics,
    };
    ctx.progress(format!(
        "steady {}: {}; {}",
        result.label,
        run_text(&result),
        cpu_text(&result.cpu)
    ));
    Ok(result)
}

/// The application's insert of [`WriterPlan::sql`] into `table`.
pub(super) fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'order', a, 'OrderPlaced', p::jsonb FROM unnest($1::text[], $2::text[]) AS u(a, p) \
         RETURNING id"
    )
}

/// The lag: age in seconds of the oldest row that could be published now (0 when none).
pub(super) fn lag_sql(table: &str) -> String {
    format!(
        "SELECT coalesce(extract(epoch FROM now() - (SELECT created_at FROM {table} \
           WHERE status = 'pending' AND available_at <= now() ORDER BY seq LIMIT 1)), 0)::float8"
    )
}

/// The consumer (on a fresh exchange and queue, or topic, named after `tag`), then the relay
/// `key` on `broker` (`rabbitmq` or `kafka`) with `case_env` besides the bench's own, its
/// metrics on a free port.
pub(super) async fn start_relay(
    ctx: &mut Ctx,
    table: &str,
    (tag, broker, key): (&str, &str, &str),
    flow: &Arc<Flow>,
    case_env: Vec<(String, String)>,
) -> Result<Running> {
    let mut env = ctx.relay_env(table);
    env.push(("RELAY_PUBLISHER__KIND".into(), broker.into()));
    env.extend(case_env);
    let port = crate::with_metrics_port(&mut env)?;
    let consumer = if broker == "rabbitmq" {
        let name = ctx.new_binding(tag).await?;
        env.push(("RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(), name.clone()));
        Consumer::rabbitmq(&ctx.args.amqp_url, &name, Arc::clone(flow)).await?
    } else {
        let topic = ctx.new_topic(tag).await?;
        env.push(("RELAY_PUBLISHER__KAFKA__TOPIC".into(), topic.clone()));
        Consumer::kafka(
            &ctx.args.kafka_brokers,
            &topic,
            PARTITIONS,
            Arc::clone(flow),
        )?
    };
    env.extend(ctx.extra_env.iter().cloned());
    let relay = Relay::spawn(key, &env, &ctx.dir.join(format!("{key}.log")))?;
    Ok(Running {
        relay,
        consumer,
        port,
    })
}

/// One row through the whole path before the clock starts.
pub(super) async fn warm_up(
    ctx: &Ctx,
    insert_sql: &str,
    flow: &Flow,
    r: &mut Running,
) -> Result<()> {
    let rows = ctx
        .pg
        .query(
            insert_sql,
            &[&vec!["warmup".to_owned()], &vec![payload(0, 1)]],
        )
        .await?;
    let ids = rows
        .iter()
        .map(|row| row.try_get(0))
        .collect::<Result<Vec<Uuid>, _>>()?;
    flow.warm_up(&ids, &mut r.relay).await
}

// ---------------------------------------------------------------------------------------------
// The application's writers

/// `conns` connections to `--database-url` for the writers.
pub(super) async fn writer_clients(ctx: &Ctx, conns: usize) -> Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(conns);
    for _ in 0..conns {
        clients.push(pg_connect(&ctx.args.database_url).await?);
    }
    Ok(clients)
}

/// Says that run `what`'s writers write into `table` for `duration`; returns when they start
/// (in 200 ms, which `flow` counts from) and when they end.
pub(super) fn start_writing(
    ctx: &Ctx,
    flow: &Flow,
    what: &str,
    table: &str,
    duration: Duration,
) -> (Instant, Instant) {
    ctx.progress(format!("{what}: writing for {duration:?} into {table}"));
    let origin = Instant::now() + Duration::from_millis(200);
    flow.restart(origin);
    (origin, origin + duration)
}

/// What every writer connection does.
pub(super) struct WriterPlan {
    /// `INSERT … SELECT … FROM unnest($1 aggregate ids, $2 payloads) RETURNING id`.
    pub(super) sql: String,
    pub(super) conns: usize,
    /// Rows per transaction.
    pub(super) batch: usize,
    /// Between two transactions of one connection; `None`: as fast as it goes.
    pub(super) period: Option<Duration>,
    pub(super) origin: Instant,
    pub(super) end: Instant,
    pub(super) aggregates: u64,
    /// Where commits are reported when a relay runs (commit → consume).
    pub(super) flow: Option<Arc<Flow>>,
}

/// What the writers did.
#[derive(Default)]
pub(super) struct WriterStats {
    pub(super) txs: u64,
    pub(super) rows: u64,
    /// Commit latency (the statement, autocommit) of every transaction, ms.
    pub(super) lat_ms: Vec<f32>,
    /// Rows committed in each second after the origin.
    pub(super) rows_by_second: Vec<u64>,
    /// Largest delay of a transaction's start after its scheduled instant.
    pub(super) max_late: Duration,
    /// How far behind its schedule a connection was when the run ended (the largest).
    pub(super) behind_at_end: Duration,
}

impl WriterStats {
    pub(super) fn merge(&mut self, o: WriterStats) {
        self.txs += o.txs;
        self.rows += o.rows;
        self.lat_ms.extend(o.lat_ms);
        if self.rows_by_second.len() < o.rows_by_second.len() {
            self.rows_by_second.resize(o.rows_by_second.len(), 0);
        }
        for (s, n) in self.rows_by_second.iter_mut().zip(o.rows_by_second) {
            *s += n;
        }
        self.max_late = self.max_late.max(o.max_late);
        self.behind_at_end = self.behind_at_end.max(o.behind_at_end);
    }
}

/// Connection `k`: one `batch`-row INSERT (autocommit) after another until `end`, each at its
/// scheduled instant when paced (connections staggered over one period).
pub(super) async fn write(client: Client, k: usize, plan: Arc<WriterPlan>) -> Result<WriterStats> {
    let stmt = client.prepare(&plan.sql).await?;
    let stagger = plan
        .period
        .map(|p| p.mul_f64(k as f64 / plan.conns as f64))
        .unwrap_or_default();
    tokio::time::sleep_until(plan.origin.into()).await;
    let mut s = WriterStats::default();
    let mut aggs = Vec::with_capacity(plan.batch);
    let mut bodies = Vec::with_capacity(plan.batch);
    for n in 0u64.. {
        let due = plan
            .period
            .map(|p| plan.origin + stagger + p.mul_f64(n as f64));
        if let Some(due) = due {
            if due >= plan.end {
                break;
            }
            tokio::time::sleep_until(due.into()).await;
        }
        let started = Instant::now();
        if started >= plan.end {
            if let Some(due) = due {
                s.behind_at_end = plan.end.saturating_duration_since(due);
            }
            break;
        }
        if let Some(due) = due {
            s.max_late = s.max_late.max(started.saturating_duration_since(due));
        }
        aggs.clear();
        bodies.clear();
        for j in 0..plan.batch as u64 {
            let i = (n * plan.conns as u64 + k as u64) * plan.batch as u64 + j + 1;
            aggs.push(aggregate_id(i, plan.aggregates));
            bodies.push(payload(i, plan.aggregates));
        }
        let rows = client.query(&stmt, &[&aggs, &bodies]).await?;
        let at = Instant::now();
        s.lat_ms
            .push(at.duration_since(started).as_secs_f32() * 1000.0);
        s.txs += 1;
        s.rows += rows.len() as u64;
        // A commit that returns just after the end counts in the last second.
        let second = at
            .min(plan.end - Duration::from_millis(1))
            .saturating_duration_since(plan.origin)
            .as_secs() as usize;
        if s.rows_by_second.len() <= second {
            s.rows_by_second.resize(second + 1, 0);
        }
        s.rows_by_second[second] += rows.len() as u64;
        if let Some(flow) = &plan.flow {
            let ids = rows
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<Vec<Uuid>, _>>()?;
            flow.committed(&ids, at);
        }
    }
    Ok(s)
}

// ---------------------------------------------------------------------------------------------
// Table health and the claim probe

/// The statement the claim probe times: the relay's claim in its default ordering.
const PROBED_CLAIM: &str = "claim_aggregate";

/// The relay's claim for `table` in its default ordering (aggregate), to run with EXPLAIN as
/// the relay runs it: the library's own text (`store::bench::hot_path_sql`) prepared on
/// `ctx.pg` with its placeholders, executed with the relay's session settings (a generic plan)
/// and default parameters, unsplit.
pub(super) async fn claim_probe(ctx: &Ctx, table: &str) -> Result<Probe> {
    let batch = ctx.config(table, |_| {})?.relay.batch_size;
    let name = TableName::parse(table).map_err(|e| anyhow!("table name {table}: {e}"))?;
    let claim = hot_path_sql(&name).claim_aggregate;
    // One per table (each run has its own). A run measured again after a service restart
    // recreates its table under the same name, possibly on the same session: the earlier
    // attempt's statement (planned for the dropped table) goes first.
    let statement: String = format!("probe_{table}")
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let stale = ctx
        .pg
        .query_opt(
            "SELECT 1 FROM pg_prepared_statements WHERE name = $1",
            &[&statement],
        )
        .await?
        .is_some();
    if stale {
        ctx.pg
            .batch_execute(&format!("DEALLOCATE {statement}"))
            .await?;
    }
    ctx.pg
        .batch_execute(&format!("PREPARE {statement} AS {claim}"))
        .await
        .context("cannot prepare the claim probe")?;
    let limit = i64::try_from(batch).unwrap_or(i64::MAX);
    let execute = format!(
        "EXECUTE {statement}({batch}, 'outbox-bench-probe', {}, {}, 1, 0)",
        i64::MAX,
        scan_window(limit)
    );
    // The relay's own session settings, for the probe's transaction only.
    let setup: Vec<String> = SESSION_SETTINGS
        .iter()
        .map(|(name, value)| format!("SET LOCAL {name} = {value}"))
        .collect();
    let setup = setup.join("; ");
    Ok(Probe { setup, execute })
}

/// The claim probe: a setup run in its transaction, then the statement EXPLAINed.
pub(super) struct Probe {
    setup: String,
    execute: String,
}

/// The table's size and statistics, summed over its partitions when it has any (found in
/// `pg_inherits`, which takes no lock), and the claim timed by `probe` if given.
pub(super) async fn sample_health(
    pg: &Client,
    table: &str,
    probe: Option<&Probe>,
    at_s: f64,
) -> Result<Health> {
    let rows = pg
        .query(
            "WITH RECURSIVE tree(relid) AS ( \
               SELECT $1::text::regclass::oid \
               UNION ALL SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid) \
             SELECT t.relid, c.relkind = 'r' AND t.relid <> $1::text::regclass::oid, \
               coalesce(pg_total_relation_size(t.relid), 0), coalesce(pg_relation_size(t.relid), 0), \
               coalesce(pg_indexes_size(t.relid), 0), \
               coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0), \
               coalesce(s.vacuum_count, 0), coalesce(s.autovacuum_count, 0), coalesce(s.n_tup_del, 0) \
             FROM tree t JOIN pg_class c ON c.oid = t.relid \
             LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid",
            &[&table],
        )
        .await
        .context("cannot read the table's size and statistics")?;
    let mut h = Health {
        at_s,
        total_bytes: 0,
        table_bytes: 0,
        index_bytes: 0,
        live: 0,
        dead: 0,
        vacuums: 0,
        autovacuums: 0,
        partitions: 0,
        deletes: Vec::with_capacity(rows.len()),
        claim_ms: f64::NAN,
        claim_pages: 0,
    };
    for r in &rows {
        h.partitions += i64::from(r.try_get::<_, bool>(1)?);
        h.total_bytes += r.try_get::<_, i64>(2)?;
        h.table_bytes += r.try_get::<_, i64>(3)?;
        h.index_bytes += r.try_get::<_, i64>(4)?;
        h.live += r.try_get::<_, i64>(5)?;
        h.dead += r.try_get::<_, i64>(6)?;
        h.vacuums += r.try_get::<_, i64>(7)?;
        h.autovacuums += r.try_get::<_, i64>(8)?;
        h.deletes.push((r.try_get(0)?, r.try_get(9)?));
    }
    if let Some(probe) = probe {
        // In a transaction rolled back: the rows it claims go back at once.
        let claim = explain(pg, (&probe.setup, &probe.execute), 1).await?;
        h.claim_ms = claim.times_ms.first().copied().unwrap_or(f64::NAN);
        h.claim_pages = claim.pages.first().copied().unwrap_or(0);
    }
    Ok(h)
}

pub(super) fn mib(bytes: i64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

pub(super) fn health_text(h: &Health) -> String {
    let partitions = if h.partitions > 0 {
        format!(" in {} partitions", h.partitions)
    } else {
        String::new()
    };
    format!(
        "table+indexes {:.1} MiB{partitions}, {} live / {} dead tuples, claim {:.1} ms ({} buffers), vacuums {} + {} auto",
        mib(h.total_bytes),
        h.live,
        h.dead,
        h.claim_ms,
        h.claim_pages,
        h.vacuums,
        h.autovacuums
    )
}

// ---------------------------------------------------------------------------------------------
// Figures

fn sorted_ms(v: impl Iterator<Item = f32>) -> Vec<f64> {
    let mut v: Vec<f64> = v.map(f64::from).collect();
    v.sort_by(f64::total_cmp);
    v
}

fn consumed_figures(
    delivered: &[crate::flow::Delivered],
    not_received: usize,
    unpaired_receipts: usize,
    every: Duration,
) -> Consumed {
    let all = sorted_ms(delivered.iter().map(|d| d.latency_ms));
    let every = every.as_secs_f64();
    let intervals = delivered
        .iter()
        .map(|d| (f64::from(d.committed_s) / every) as usize + 1)
        .max()
        .unwrap_or(0);
    let by_interval = (0..intervals)
        .map(|i| {
            let v = sorted_ms(
                delivered
                    .iter()
                    .filter(|d| (f64::from(d.committed_s) / every) as usize == i)
                    .map(|d| d.latency_ms),
            );
            (percentile(&v, 50.0), percentile(&v, 99.0))
        })
        .collect();
    Consumed {
        messages: all.len(),
        not_received,
        unpaired_receipts,
        p50_ms: percentile(&all, 50.0),
        p99_ms: percentile(&all, 99.0),
        max_ms: all.last().copied().unwrap_or(f64::NAN),
        by_interval,
    }
}

fn run_text(r: &RunResult) -> String {
    let mut parts = vec![
        format!(
            "{:.0} commits/s ({:.0} rows/s), commit p50 {:.2} / p99 {:.2} ms",
            r.commits_per_s(),
            r.rows_per_s(),
            r.commit_p50_ms,
            r.commit_p99_ms
        ),
        format!("max lag {:.2} s", r.lag_max_s),
    ];
    if r.mode.paced() {
        parts.push(format!(
            "behind schedule at the end {:.1?} (worst start {:.1?} late)",
            r.writes.behind_at_end, r.writes.max_late
        ));
    }
    if let Some(c) = &r.consumed {
        parts.push(format!(
            "commit → consume p50 {:.1} / p99 {:.1} / max {:.0} ms over {} msgs ({} not received)",
            c.p50_ms, c.p99_ms, c.max_ms, c.messages, c.not_received
        ));
    }
    if let Some(cpu) = r.relay_cpu_s_per_100k {
        parts.push(format!("relay CPU {cpu:.1} s per 100k msgs"));
    }
    parts.join(", ")
}

/// `num / den`, NaN when `den` is not positive (e.g. growth from zero dead tuples).
fn ratio(num: f64, den: f64) -> f64 {
    if den > 0.0 { num / den } else { f64::NAN }
}

fn report_run(ctx: &mut Ctx, r: &RunResult) {
    let key = r.key();
    let behind = r.writes.behind_at_end.as_secs_f64();
    let mut figures: Vec<(&str, &str, f64, &str)> = vec![
        (
            "commits_per_s",
            "application commits/s",
            r.commits_per_s(),
            "commits/s",
        ),
        ("commit_p50_ms", "commit latency p50", r.commit_p50_ms, "ms"),
        ("commit_p99_ms", "commit latency p99", r.commit_p99_ms, "ms"),
        ("lag_max_s", "max lag (oldest ready row)", r.lag_max_s, "s"),
    ];
    if r.mode.paced() {
        figures.push((
            "behind_s",
            "writers behind schedule at the end",
            behind,
            "s",
        ));
    }
    if let Some(c) = &r.consumed {
        figures.push(("consume_p50_ms", "commit → consume p50", c.p50_ms, "ms"));
        figures.push(("consume_p99_ms", "commit → consume p99", c.p99_ms, "ms"));
    }
    if let Some(cpu) = r.relay_cpu_s_per_100k {
        figures.push(("relay_cpu_s_per_100k", "relay CPU per 100k msgs", cpu, "s"));
    }
    if let Some((first, end)) = r.first_and_end() {
        let size = ratio(end.total_bytes as f64, first.total_bytes as f64);
        let dead = ratio(end.dead as f64, first.dead as f64);
        let claim = ratio(end.claim_ms, first.claim_ms);
        figures.push((
            "size_growth",
            "table+index size, end / once retention filled (else 1st interval)",
            size,
            "×",
        ));
        figures.push((
            "dead_growth",
            "dead tuples, end / once retention filled (else 1st interval)",
            dead,
            "×",
        ));
        figures.push((
            "claim_growth",
            "claim time, end / once retention filled (else 1st interval)",
            claim,
            "×",
        ));
    }
    for (k, what, v, unit) in figures {
        let label = format!("{}: {what}", r.label);
        ctx.report
            .figure("9 steady", &format!("{key}_{k}"), &label, v, unit);
    }
    let consumed = r.consumed.as_ref().map(|c| {
        let by_interval: Vec<[Value; 2]> = c
            .by_interval
            .iter()
            .map(|(p50, p99)| [crate::num(*p50), crate::num(*p99)])
            .collect();
        json!({
            "messages": c.messages, "not_received_60s_after": c.not_received,
            "unpaired_receipts": c.unpaired_receipts,
            "p50_ms": c.p50_ms, "p99_ms": c.p99_ms, "max_ms": c.max_ms,
            "by_interval_p50_p99_ms": by_interval,
        })
    });
    let every = ctx.args.steady.steady_sample_every.as_secs().max(1) as usize;
    let rows_by_interval: Vec<f64> = r
        .writes
        .rows_by_second
        .chunks(every)
        .map(|c| c.iter().sum::<u64>() as f64 / c.len() as f64)
        .collect();
    ctx.report.detail(
        &key,
        json!({
            "writers": r.mode.tag(), "case": r.case.tag(), "label": r.label,
            "seconds": r.window_s, "transactions": r.writes.txs, "rows": r.writes.rows,
            "commits_per_s": r.commits_per_s(), "rows_per_s": r.rows_per_s(),
            "rows_per_s_by_interval": rows_by_interval,
            "commit_p50_ms": r.commit_p50_ms, "commit_p99_ms": r.commit_p99_ms,
            "commit_max_ms": r.commit_max_ms,
            "worst_start_late_s": r.writes.max_late.as_secs_f64(), "behind_at_end_s": behind,
            "commit_to_consume": consumed,
            "lag_max_s": r.lag_max_s, "relay_oldest_ready_age_max_s": r.lag_gauge_max_s,
            "claim_statement": PROBED_CLAIM,
            "health": r.health.iter().map(Health::json).collect::<Vec<_>>(),
            "cpu": r.cpu, "relay_cpu_s_per_100k": r.relay_cpu_s_per_100k,
            "relay_metrics": r.relay_metrics,
            "retention": ctx.args.steady.steady_retention,
            "extra_env": crate::masked_env(&ctx.extra_env),
        }),
    );
}

/// One row of the side-by-side table.
fn summary_row(r: &RunResult, w: usize) -> String {
    let (first, end) = r
        .first_and_end()
        .map_or((None, None), |(f, e)| (Some(f), Some(e)));
    let at = |hs: &[Option<&Health>], f: fn(&Health) -> String| {
        let v: Vec<String> = hs.iter().map(|h| h.map_or("-".into(), f)).collect();
        v.join("/")
    };
    let three = [r.health.first(), first, end];
    let (cc50, cc99) = r.consumed.as_ref().map_or(("-".into(), "-".into()), |c| {
        (format!("{:.1}", c.p50_ms), format!("{:.1}", c.p99_ms))
    });
    format!(
        "{:<w$} {:>8.0} {:>8.0} {:>8.2} {:>8.2} {:>8} {:>8} {:>7.2} {:>17} {:>20} {:>13} {:>8}\n",
        r.label,
        r.commits_per_s(),
        r.rows_per_s(),
        r.commit_p50_ms,
        r.commit_p99_ms,
        cc50,
        cc99,
        r.lag_max_s,
        at(&three, |h| format!("{:.1}", mib(h.total_bytes))),
        at(&three, |h| h.dead.to_string()),
        at(&[first, end], |h| format!("{:.1}", h.claim_ms)),
        r.relay_cpu_s_per_100k
            .map_or("-".into(), |v| format!("{v:.1}")),
    )
}

/// A figure compared between cases: its name, and how to read it.
type Metric = (&'static str, fn(&RunResult) -> f64);

/// The side-by-side table, and per writer mode the ratios of issue #13's targets (default /
/// poll-only: commits/s ≥ 0.95, commit p99 ≤ 1.1) and each against no relay.
fn report_summary(ctx: &mut Ctx, runs: &[RunResult]) {
    let w = super::label_width(runs.iter().map(|r| r.label.as_str()));
    let mut text = format!(
        "{:<w$} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7} {:>17} {:>20} {:>13} {:>8}\n",
        "run",
        "commit/s",
        "rows/s",
        "c p50 ms",
        "c p99 ms",
        "cc p50ms",
        "cc p99ms",
        "lag s",
        "MiB start/1st/end",
        "dead start/1st/end",
        "claim ms 1st/end",
        "cpu/100k"
    );
    for r in runs {
        text.push_str(&summary_row(r, w));
    }
    let a = ctx.args.steady.clone();
    text.push_str(&format!(
        "(c = application commit, cc = commit → consume, lag = oldest ready row, 1st = the first \
         sample (every {:?}) once the retention window filled, {:.0} s in, or the first if it \
         never does; claim = the relay's claim in a rolled-back transaction, cpu = relay CPU s \
         per 100k msgs; retention {})\n",
        a.steady_sample_every,
        filled_after_s(a.steady_retention.as_deref()),
        a.steady_retention.as_deref().unwrap_or("relay default")
    ));
    ctx.report.section("steady state, side by side", &text);

    let metrics: [Metric; 2] = [
        ("commits", RunResult::commits_per_s),
        ("commit_p99", |r| r.commit_p99_ms),
    ];
    let pairs = [
        ("default_vs_poll", Case::DefaultRabbitmq, Case::PollRabbitmq),
        ("default_vs_none", Case::DefaultRabbitmq, Case::NoRelay),
        ("poll_vs_none", Case::PollRabbitmq, Case::NoRelay),
    ];
    for &mode in &a.steady_writers {
        let find = |case: Case| runs.iter().find(|r| r.mode == mode && r.case == case);
        for (pair, x, y) in pairs {
            let (Some(x), Some(y)) = (find(x), find(y)) else {
                continue;
            };
            for (metric, get) in metrics {
                ctx.report.figure(
                    "ratios",
                    &format!("ratio_steady_{}_{pair}_{metric}", mode.tag()),
                    &format!(
                        "steady {}: {metric}, {} / {}",
                        mode.label(&a),
                        x.case.label(),
                        y.case.label()
                    ),
                    ratio(get(x), get(y)),
                    "×",
                );
            }
        }
    }
}
