//! `outbox-bench`: measures the relay against the ceilings of its parts, in one run, so that
//! every figure can be quoted as a ratio measured on the same (noisy) machine.
//!
//! ```text
//! cargo build --release --workspace
//! target/release/outbox-bench [--rows N] [--quick] [--only db,broker,naive,relay,latency,claim,outboxes,…] [--json-only]
//! ```
//!
//! Phases (each on fresh `bench_<phase>_<run id>` tables, exchanges, queues and topics, removed
//! afterwards unless `--keep`):
//! 1. `db`: the relay's own claim + settle loop (`run_with`, in process) with a no-op publisher.
//! 2. `broker`: the relay's publishers alone, N synthetic messages, ≤1000 in flight.
//! 3. `naive`: the blog-post loop (SKIP LOCKED LIMIT 50 by created_at, confirm and UPDATE per row).
//! 4. `relay`: the `outbox-relay` binary draining N rows, ordering none/aggregate × RabbitMQ/Kafka.
//! 5. `latency`: commit → consumer receive at a steady insert rate, NOTIFY on and off.
//! 6. peak RSS of the relay processes of 4 and 5.
//! 7. `claim`: EXPLAIN (ANALYZE, BUFFERS) of the claim on 10k and 5M-row (99 % sent) tables.
//! 8. `insert`: what the table's NOTIFY trigger costs the application's one-row inserts.
//! 9. `steady` (only when named in `--only`): application writers for minutes beside the relay
//!    (defaults to RabbitMQ and Kafka, poll only to RabbitMQ) and with no relay: commits/s,
//!    commit and commit → consume latency, lag, table size, dead tuples and claim time over time.
//! 10. `outboxes`: one busy outbox drained alone and beside 19 idle ones; a 20-outbox relay's
//!     idle CPU and peak RSS.
//! 11. `nats` (only when named in `--only`): the relay draining N rows into a JetStream stream,
//!     ordering none and aggregate, beside a bare async-nats client publishing the same messages
//!     with the same number of acks outstanding; relay CPU per 100k.
//! 12. `redis` (only when named in `--only`): the relay draining N rows into Redis streams,
//!     ordering none and aggregate, beside a bare redis client pipelining the same `XADD`s.
//! 13. `tracing` (only when named in `--only`): RabbitMQ and Kafka drains with tracing off, on
//!     (every span exported to a receiver in the bench) and on with nothing listening.
//! 14. `http` (only when named in `--only`): the relay draining N rows to a local endpoint that
//!     answers 204 at once, ordering none and aggregate, beside a bare reqwest client sending
//!     the relay's requests with `relay.max_in_flight` outstanding; relay CPU per 100k.
//! 15. `retention` (only when named in `--only`): writers at 2,000 rows/s for minutes beside the
//!     relay with a 2 min retention, on a plain table, a partitioned one
//!     (`database.partition_interval`), and a partitioned one with a REPEATABLE READ transaction
//!     held open for half the run: table size, rows deleted, dead tuples, partitions, claim time,
//!     commits/s and relay CPU.
//! 16. `mysql` (only when named in `--only`): the relay draining N rows from MariaDB to
//!     RabbitMQ, Kafka and NATS, ordering none and aggregate, beside a bare mysql_async client
//!     replaying the relay's claim and mark-sent statements and each sink's bare client (the
//!     shared ceilings); commit → consume latency with `poll_interval` 1s and 100ms.
//! 17. `console` (only when named in `--only`): drains with the web console's overview open
//!     and refreshing every second, against drains with nobody looking.
//! 18. `dbcost` (only when named in `--only`): what PostgreSQL pays per message for the
//!     application's own one-row inserts and for the relay's drain of them to the stdout sink
//!     (defaults; ordering none with retention 0s; a partitioned table): WAL bytes, CPU of the
//!     postgres processes, heap inserts, updates (HOT) and deletes.
//!
//! Progress goes to stderr; stdout gets the plans, a table and finally one JSON line.
//! One file per phase under `phases/`; the relay process, topics and tables come from
//! `outbox-testkit`, shared with the integration tests. See `bench/README.md`.

mod flow;
mod phases;
mod plans;
mod util;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Parser, ValueEnum};
use outbox_relay::config::{Config, RawConfig};
use outbox_relay::store::Store;
use serde_json::{Map, Value, json};
use tokio_postgres::Client;

use crate::util::{
    Rabbit, drop_table, full_pages, no_blocker_index, open_index, pg_connect, postmaster_start,
    scratch_dir,
};

/// Throughput, latency and claim-cost benchmark of outbox-relay against its ceilings.
#[derive(Debug, Clone, Parser)]
#[command(name = "outbox-bench", version, about)]
struct Args {
    /// Rows (or messages) per throughput phase [default: 100000; 10000 with --quick].
    #[arg(long)]
    rows: Option<usize>,
    /// Short run: 10,000 rows, naive loop 2,000 rows, latency 200/s for 5 s, no claim phase.
    #[arg(long)]
    quick: bool,
    /// Only these phases (comma-separated): db, broker, naive, relay, latency, insert, claim,
    /// outboxes, steady, nats, redis, tracing, http, retention, mysql, console, dbcost (steady
    /// and the last eight run only when named here).
    #[arg(long, value_delimiter = ',')]
    only: Vec<Phase>,
    /// Print only the JSON line on stdout (plans and table go nowhere; progress still on stderr).
    #[arg(long)]
    json_only: bool,
    /// PostgreSQL URL (the tables are created there).
    #[arg(
        long,
        env = "BENCH_DATABASE_URL",
        default_value = outbox_testkit::PG_URL
    )]
    database_url: String,
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "BENCH_AMQP_URL",
        default_value = outbox_testkit::AMQP_URL
    )]
    amqp_url: String,
    /// MySQL/MariaDB URL (phase `mysql`: its tables are created there).
    #[arg(long, env = "BENCH_MYSQL_URL", default_value = outbox_testkit::MYSQL_URL)]
    mysql_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "BENCH_KAFKA_BROKERS", default_value = outbox_testkit::kafka::KAFKA)]
    kafka_brokers: String,
    /// The tansu binary, used to create and delete topics (tansu does not auto-create them).
    #[arg(
        long,
        env = "BENCH_TANSU",
        default_value = "/var/cache/outbox-relay/tansu/bin/tansu"
    )]
    tansu: PathBuf,
    /// Rows the naive loop drains out of the N-row backlog [default: min(N, 20000); 2000 with --quick].
    #[arg(long)]
    naive_rows: Option<usize>,
    /// The naive loop also stops after this many seconds.
    #[arg(long, default_value_t = 60)]
    naive_secs: u64,
    /// Latency phase insert rate, rows/s [default: 1000; 200 with --quick].
    #[arg(long)]
    latency_rate: Option<u32>,
    /// Latency phase duration, seconds [default: 10; 5 with --quick].
    #[arg(long)]
    latency_secs: Option<u64>,
    /// Rows of the large table of the claim phase (99 % of them sent).
    #[arg(long, default_value_t = 5_000_000)]
    claim_rows: usize,
    /// Distinct aggregate ids in the backlog tables.
    #[arg(long, default_value_t = 1000)]
    aggregates: usize,
    /// Extra environment for the relay processes (KEY=VALUE, repeatable), e.g.
    /// RELAY_RELAY__MAX_IN_FLIGHT=4000. Recorded in the JSON.
    #[arg(long = "relay-env", value_name = "KEY=VALUE")]
    relay_env: Vec<String>,
    /// Reset the fillfactor of every PostgreSQL table the bench creates with the library's
    /// migration to 100 (the full pages of schema version 4): an A/B against schema version 5
    /// with one binary. Not the tables of `retention` and `dbcost`, which the relay binary
    /// migrates (`dbcost` has a full-pages case of its own).
    #[arg(long)]
    full_pages: bool,
    /// Replace the waiting index of every PostgreSQL table the bench creates with the
    /// library's migration by schema version 5's open index: an A/B against schema version 6
    /// with one binary. Not the tables of `retention` and `dbcost` (`dbcost` has open-index
    /// cases of its own).
    #[arg(long)]
    open_index: bool,
    /// Drop schema version 7's blocker index from every PostgreSQL table the bench creates
    /// with the library's migration: the relay's ordered claim (and pgbench's) then probes
    /// each candidate's head as before version 7, an A/B against version 7 with one binary.
    /// Not the tables of `retention` and `dbcost` (`dbcost` has a case of its own).
    #[arg(long)]
    no_blocker_index: bool,
    /// Give up a drain after this many seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Keep the tables, queues, exchanges and topics.
    #[arg(long)]
    keep: bool,
    /// Profile each relay drain with `perf record -e cpu-clock` (files kept in the scratch dir).
    #[arg(long)]
    perf: bool,
    /// Only these cases of phase `dbcost` (comma-separated keys: default, default_probing,
    /// default_full_pages, default_open_index, none_0s_open_index, none_0s, partitioned)
    /// [default: all].
    #[arg(long, value_delimiter = ',')]
    dbcost_cases: Vec<String>,
    /// Give each relay process a metrics port and record its claim and publish histograms
    /// (scraped just before SIGTERM) in the JSON details.
    #[arg(long)]
    metrics: bool,
    #[command(flatten)]
    steady: phases::SteadyArgs,
    #[command(flatten)]
    retention: phases::RetentionArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Phase {
    /// 1. DB ceiling.
    Db,
    /// 2. Broker ceilings.
    Broker,
    /// 3. Naive loop.
    Naive,
    /// 4. Relay process drains (4 runs).
    Relay,
    /// 5. Latency.
    Latency,
    /// 8. Insert cost of the NOTIFY trigger.
    Insert,
    /// 7. Claim cost.
    Claim,
    /// 10. One busy outbox among idle ones; the idle cost of 20 outboxes.
    Outboxes,
    /// 9. Steady state beside a live application (not part of the default run).
    Steady,
    /// 11. NATS JetStream: the relay against a bare client (only when named in `--only`).
    Nats,
    /// 12. Redis Streams, bare XADDs vs the relay (not part of the default run).
    Redis,
    /// 13. Drains with tracing off, on, and its receiver down (not in the default run).
    Tracing,
    /// 14. HTTP webhooks, a bare reqwest client vs the relay (not part of the default run).
    Http,
    /// 15. Retention on a plain and a partitioned table (not part of the default run).
    Retention,
    /// 16. MySQL/MariaDB outboxes against their shared ceilings (not in the default run).
    Mysql,
    /// 17. Drains with the console open and refreshing vs closed (not in the default run).
    Console,
    /// 18. PostgreSQL's cost per message, app inserts vs relay drains (not in the default run).
    Dbcost,
}

impl Phase {
    /// Whether the phase starts the relay binary.
    fn runs_relay(self) -> bool {
        !matches!(
            self,
            Self::Db | Self::Broker | Self::Naive | Self::Insert | Self::Claim
        )
    }

    /// Whether a run without `--only` measures it (`claim` not with `--quick`).
    fn in_default_run(self, quick: bool) -> bool {
        match self {
            Self::Db | Self::Broker | Self::Naive | Self::Relay => true,
            Self::Latency | Self::Insert | Self::Outboxes => true,
            Self::Claim => !quick,
            _ => false,
        }
    }
}

/// What the phases create, removed after each phase (and at exit, whatever happened).
#[derive(Default)]
struct Resources {
    tables: Vec<String>,
    /// MySQL/MariaDB outbox tables (phase `mysql`), at `--mysql-url`.
    mysql_tables: Vec<String>,
    bindings: Vec<String>,
    topics: Vec<String>,
}

/// See [`Ctx::sentinel`].
pub(crate) struct Sentinel {
    pg_start: Option<String>,
    amqp: Option<lapin::Connection>,
}

/// Whether an error says that a shared service went away (someone else's restart), so the
/// measurement is worth repeating.
fn is_disruption(text: &str) -> bool {
    [
        "disrupted:",
        "terminating connection",
        "connection closed",
        "Connection refused",
        "CONNECTION_FORCED",
        "onnection reset",
        "the database system is",
        "cannot get a database connection",
        "invalid channel state",
        "IO error",
    ]
    .iter()
    .any(|p| text.contains(p))
}

/// One row of the readable table.
struct Figure {
    key: String,
    phase: String,
    label: String,
    value: f64,
    unit: String,
}

/// Everything measured.
#[derive(Default)]
struct Report {
    figures: Vec<Figure>,
    json: Map<String, Value>,
    details: Map<String, Value>,
    notes: Vec<String>,
    errors: Vec<String>,
    plans: Vec<(String, String)>,
    /// Preformatted blocks (a phase's own table), printed after the plans.
    sections: Vec<(String, String)>,
}

impl Report {
    /// Adds (or, when a phase is retried, replaces) a figure.
    fn figure(&mut self, phase: &str, key: &str, label: &str, value: f64, unit: &str) {
        let figure = Figure {
            key: key.to_owned(),
            phase: phase.to_owned(),
            label: label.to_owned(),
            value,
            unit: unit.to_owned(),
        };
        match self.figures.iter_mut().find(|f| f.key == key) {
            Some(f) => *f = figure,
            None => self.figures.push(figure),
        }
        self.json.insert(key.to_owned(), num(value));
    }

    fn detail(&mut self, key: &str, value: Value) {
        self.details.insert(key.to_owned(), value);
    }

    fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    fn plan(&mut self, title: &str, plan: &str) {
        self.plans.push((title.to_owned(), plan.to_owned()));
    }

    fn section(&mut self, title: &str, text: &str) {
        self.sections.push((title.to_owned(), text.to_owned()));
    }

    fn get(&self, key: &str) -> Option<f64> {
        self.json.get(key).and_then(Value::as_f64)
    }
}

fn num(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// The run's settings, connections, resources and report.
struct Ctx {
    args: Args,
    rows: usize,
    naive_rows: usize,
    lat_rate: u32,
    lat_secs: u64,
    run_id: String,
    t0: Instant,
    dir: PathBuf,
    pg: Client,
    rabbit: Option<Rabbit>,
    res: Resources,
    report: Report,
    peak_rss_kib: u64,
    extra_env: Vec<(String, String)>,
}

impl Ctx {
    fn progress(&self, msg: impl AsRef<str>) {
        eprintln!(
            "[{:>7.1}s] {}",
            self.t0.elapsed().as_secs_f64(),
            msg.as_ref()
        );
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs(self.args.timeout)
    }

    /// A validated configuration for `table` (defaults, the bench's URLs, no metrics server).
    fn config(&self, table: &str, tweak: impl FnOnce(&mut RawConfig)) -> Result<Config> {
        let mut raw = RawConfig::default();
        raw.database.url = self.args.database_url.clone();
        raw.database.table = Some(table.to_owned());
        raw.database.auto_migrate = false;
        raw.relay.instance_id = Some(format!("outbox-bench-{}", std::process::id()));
        raw.metrics.listen = String::new();
        raw.publisher.rabbitmq.url = self.args.amqp_url.clone();
        raw.publisher.kafka.brokers = self.args.kafka_brokers.clone();
        tweak(&mut raw);
        raw.validate()
            .map_err(|e| anyhow!("bench configuration: {e}"))
    }

    /// Creates `bench_<tag>_<run id>` with the library's migration.
    async fn new_table(&mut self, tag: &str) -> Result<String> {
        let table = format!("bench_{tag}_{}", self.run_id);
        self.migrated(table, false).await
    }

    /// Creates `bench_mysql_<tag>_<run id>` at `--mysql-url` with the library's migration.
    async fn new_mysql_table(&mut self, tag: &str) -> Result<String> {
        let table = format!("bench_mysql_{tag}_{}", self.run_id);
        self.migrated(table, true).await
    }

    /// Creates `table` with the library's migration, at `--mysql-url` when `mysql`, and keeps
    /// its name for the clean-up.
    async fn migrated(&mut self, table: String, mysql: bool) -> Result<String> {
        let url = self.args.mysql_url.clone();
        let config = self.config(&table, |raw| {
            if mysql {
                raw.database.url = url;
            }
        })?;
        let store = Store::new(&config.database, "outbox-bench")?;
        let (created, at) = if mysql {
            (&mut self.res.mysql_tables, " at --mysql-url")
        } else {
            (&mut self.res.tables, "")
        };
        created.push(table.clone());
        store
            .migrate()
            .await
            .with_context(|| format!("cannot migrate {table}{at}"))?;
        if self.args.full_pages && !mysql {
            full_pages(&self.pg, &table).await?;
        }
        if self.args.open_index && !mysql {
            open_index(&self.pg, &table).await?;
        }
        if self.args.no_blocker_index && !mysql {
            no_blocker_index(&self.pg, &table).await?;
        }
        Ok(table)
    }

    /// A fresh durable topic exchange bound to a fresh durable queue (same name).
    async fn new_binding(&mut self, tag: &str) -> Result<String> {
        let name = format!("bench_{tag}_{}", self.run_id);
        self.res.bindings.push(name.clone());
        self.rabbit().await?.binding(&name).await?;
        Ok(name)
    }

    /// A fresh 3-partition topic.
    async fn new_topic(&mut self, tag: &str) -> Result<String> {
        let name = format!("bench_{tag}_{}", self.run_id);
        self.res.topics.push(name.clone());
        outbox_testkit::kafka::try_create_topic(
            &self.args.tansu,
            &self.args.kafka_brokers,
            &name,
            3,
        )
        .await
        .map_err(|e| anyhow!("{e} (set --tansu)"))?;
        Ok(name)
    }

    async fn rabbit(&mut self) -> Result<&Rabbit> {
        let stale = self
            .rabbit
            .as_ref()
            .is_none_or(|r| !r.connection().status().connected());
        if stale {
            self.rabbit = Some(Rabbit::connect(&self.args.amqp_url).await?);
        }
        self.rabbit
            .as_ref()
            .ok_or_else(|| anyhow!("no RabbitMQ connection"))
    }

    /// The relay's environment for `table` (the caller adds publisher and ordering).
    fn relay_env(&self, table: &str) -> Vec<(String, String)> {
        [
            ("RELAY_DATABASE__URL", self.args.database_url.as_str()),
            ("RELAY_DATABASE__TABLE", table),
            ("RELAY_DATABASE__AUTO_MIGRATE", "false"),
            ("RELAY_METRICS__LISTEN", ""),
            (
                "RELAY_PUBLISHER__RABBITMQ__URL",
                self.args.amqp_url.as_str(),
            ),
            (
                "RELAY_PUBLISHER__KAFKA__BROKERS",
                self.args.kafka_brokers.as_str(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    /// Reconnects the bench's own session if someone closed it (e.g. restarted PostgreSQL);
    /// waits up to 60 s for the database to come back.
    async fn ensure_pg(&mut self) -> Result<()> {
        if !self.pg.is_closed() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match pg_connect(&self.args.database_url).await {
                Ok(pg) => {
                    self.pg = pg;
                    return Ok(());
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }

    /// Marks the start of a timed section: PostgreSQL's start time and a sentinel AMQP
    /// connection. [`Ctx::check`] fails with a "disrupted" error if either changed, so that a
    /// figure measured across someone else's service restart is measured again, not reported.
    async fn sentinel(&mut self) -> Sentinel {
        let _ = self.ensure_pg().await;
        let pg_start = postmaster_start(&self.pg).await;
        let amqp = tokio::time::timeout(
            Duration::from_secs(5),
            lapin::Connection::connect(&self.args.amqp_url, lapin::ConnectionProperties::default()),
        )
        .await
        .ok()
        .and_then(Result::ok);
        Sentinel { pg_start, amqp }
    }

    /// See [`Ctx::sentinel`].
    async fn check(&mut self, s: Sentinel) -> Result<()> {
        let amqp_lost = s.amqp.as_ref().is_some_and(|c| !c.status().connected());
        if let Some(c) = s.amqp {
            let _ = c.close(200, "done".into()).await;
        }
        let _ = self.ensure_pg().await;
        let pg_restarted = s.pg_start.is_some() && postmaster_start(&self.pg).await != s.pg_start;
        match (pg_restarted, amqp_lost) {
            (false, false) => Ok(()),
            (true, _) => bail!("disrupted: PostgreSQL was restarted during the measurement"),
            (false, true) => {
                bail!("disrupted: RabbitMQ dropped connections during the measurement")
            }
        }
    }

    /// Runs `attempt`, then [`Ctx::cleanup`]. Other engineers' fault tests restart PostgreSQL
    /// and stop RabbitMQ on this shared machine: an attempt that failed because of that (the
    /// postmaster restarted, or the error says so) is measured again after the services are
    /// back, twice at most.
    async fn measured(
        &mut self,
        what: &str,
        attempt: impl AsyncFn(&mut Ctx) -> Result<()>,
    ) -> Result<()> {
        let mut tries = 0;
        loop {
            tries += 1;
            let notes = self.report.notes.len();
            let pg_before = postmaster_start(&self.pg).await;
            let result = attempt(&mut *self).await;
            self.cleanup().await;
            let Err(e) = result else { return Ok(()) };
            let _ = self.ensure_pg().await;
            let restarted = pg_before.is_some() && postmaster_start(&self.pg).await != pg_before;
            let text = format!("{e:#}");
            if tries >= 3 || !(restarted || is_disruption(&text)) {
                return Err(e);
            }
            // Notes of the abandoned attempt do not describe the figures kept.
            self.report.notes.truncate(notes);
            self.progress(format!(
                "{what}: disrupted by a service restart ({text}); waiting for the services, then measuring it again"
            ));
            self.report.note(format!(
                "{what} measured again after a service restart by someone else"
            ));
            self.wait_for_services().await;
        }
    }

    /// Waits (up to 5 minutes) until PostgreSQL and RabbitMQ accept connections again, then
    /// 5 s more.
    async fn wait_for_services(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            let pg_ok =
                self.ensure_pg().await.is_ok() && self.pg.simple_query("SELECT 1").await.is_ok();
            let amqp_ok = matches!(
                tokio::time::timeout(
                    Duration::from_secs(5),
                    lapin::Connection::connect(
                        &self.args.amqp_url,
                        lapin::ConnectionProperties::default()
                    ),
                )
                .await,
                Ok(Ok(_))
            );
            if pg_ok && amqp_ok {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }

    /// With `--metrics`, a free port for the relay's metrics server (set in `env`).
    fn metrics_port(&self, env: &mut Vec<(String, String)>) -> Result<Option<u16>> {
        if !self.args.metrics {
            return Ok(None);
        }
        with_metrics_port(env).map(Some)
    }

    /// Removes everything created so far (unless `--keep`).
    async fn cleanup(&mut self) {
        if self.args.keep {
            self.res = Resources::default();
            return;
        }
        if let Err(e) = self.ensure_pg().await {
            eprintln!("warning: cannot reconnect to PostgreSQL for cleanup: {e:#}");
        }
        let res = std::mem::take(&mut self.res);
        for t in &res.tables {
            if let Err(e) = drop_table(&self.pg, t).await {
                eprintln!("warning: cannot drop table {t}: {e:#}");
            }
        }
        if !res.mysql_tables.is_empty() {
            match crate::util::mysql_connect(&self.args.mysql_url).await {
                Ok(mut conn) => {
                    for t in &res.mysql_tables {
                        if let Err(e) = crate::util::drop_mysql_table(&mut conn, t).await {
                            eprintln!("warning: cannot drop MySQL table {t}: {e:#}");
                        }
                    }
                }
                Err(e) => eprintln!(
                    "warning: cannot connect to MySQL to drop {:?}: {e:#}",
                    res.mysql_tables
                ),
            }
        }
        for b in &res.bindings {
            let deleted = match self.rabbit().await {
                Ok(r) => r.delete(b).await,
                Err(e) => Err(e),
            };
            if let Err(e) = deleted {
                eprintln!("warning: cannot delete RabbitMQ queue/exchange {b}: {e:#}");
            }
        }
        for t in &res.topics {
            let deleted = outbox_testkit::kafka::try_delete_topic(
                &self.args.tansu,
                &self.args.kafka_brokers,
                t,
            )
            .await;
            if let Err(e) = deleted {
                eprintln!("warning: cannot delete topic {t}: {e:#}");
            }
        }
    }
}

/// A free port for the relay's metrics server, set in `env`.
fn with_metrics_port(env: &mut Vec<(String, String)>) -> Result<u16> {
    let port = outbox_testkit::try_free_port()?;
    env.retain(|(k, _)| k != "RELAY_METRICS__LISTEN");
    env.push(("RELAY_METRICS__LISTEN".into(), format!("127.0.0.1:{port}")));
    Ok(port)
}

/// Words that mark a variable's value as a secret when its name contains one of them.
const SECRET_WORDS: [&str; 4] = ["KEY", "PASSWORD", "SECRET", "TOKEN"];

/// `value` of the variable `name` as the bench may echo it: `<masked>` when the name contains
/// KEY, PASSWORD, SECRET or TOKEN (e.g. `RELAY_SIGNING__KEY`), otherwise the value with any URL
/// password redacted.
fn masked_value(name: &str, value: &str) -> String {
    let upper = name.to_ascii_uppercase();
    if SECRET_WORDS.iter().any(|w| upper.contains(w)) {
        "<masked>".to_owned()
    } else {
        outbox_relay::redact::redact_url(value)
    }
}

/// `env` as the bench may echo it (progress, JSON), each value through [`masked_value`].
fn masked_env(env: &[(String, String)]) -> Vec<(String, String)> {
    env.iter()
        .map(|(k, v)| (k.clone(), masked_value(k, v)))
        .collect()
}

/// The `--relay-env` arguments as (name, value) pairs; a rejected argument is named with its
/// value masked as [`masked_value`] does.
fn parse_relay_env(args: &[String]) -> Result<Vec<(String, String)>> {
    args.iter()
        .map(|kv| match kv.split_once('=') {
            None => {
                let shown = masked_value(kv, kv);
                bail!("--relay-env {shown:?}: expected KEY=VALUE")
            }
            Some((k, v)) if !k.starts_with("RELAY_") => {
                let shown = format!("{k}={}", masked_value(k, v));
                bail!("--relay-env {shown:?}: the name must start with RELAY_")
            }
            Some((k, v)) => Ok((k.to_owned(), v.to_owned())),
        })
        .collect()
}

fn main() -> ExitCode {
    let args = Args::parse();
    plans::init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main_async(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outbox-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn main_async(args: Args) -> Result<ExitCode> {
    let mut ctx = setup(args).await?;
    let interrupted = {
        let mut signals = Signals::new()?;
        tokio::select! {
            () = run(&mut ctx) => false,
            sig = signals.recv() => {
                eprintln!("outbox-bench: {sig}: stopping and cleaning up");
                true
            }
        }
    };
    // The phase future is dropped here: relay children are killed (kill_on_drop) and the
    // in-process loop is cancelled (drop guard). Now remove tables, queues and topics.
    ctx.cleanup().await;
    if interrupted {
        return Ok(ExitCode::from(130));
    }
    finish(&mut ctx);
    if ctx.args.keep || ctx.args.perf {
        eprintln!("outbox-bench: logs kept in {}", ctx.dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&ctx.dir);
    }
    Ok(if ctx.report.errors.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

async fn setup(args: Args) -> Result<Ctx> {
    let rows = args
        .rows
        .unwrap_or(if args.quick { 10_000 } else { 100_000 });
    if rows == 0 {
        bail!("--rows must be at least 1");
    }
    let naive_rows = args
        .naive_rows
        .unwrap_or(if args.quick { 2_000 } else { 20_000 })
        .min(rows);
    let lat_rate = args
        .latency_rate
        .unwrap_or(if args.quick { 200 } else { 1000 });
    let lat_secs = args.latency_secs.unwrap_or(if args.quick { 5 } else { 10 });
    let extra_env = parse_relay_env(&args.relay_env)?;
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let relay_bin = outbox_testkit::relay_bin();
    let needs_relay = args.only.is_empty() || args.only.iter().any(|p| p.runs_relay());
    if needs_relay && !relay_bin.is_file() {
        bail!(
            "{} not found: build both binaries with `cargo build --release --workspace`",
            relay_bin.display()
        );
    }
    let pg = pg_connect(&args.database_url).await?;
    let dir = scratch_dir(&run_id)?;
    Ok(Ctx {
        rows,
        naive_rows,
        lat_rate,
        lat_secs,
        run_id,
        t0: Instant::now(),
        dir,
        pg,
        rabbit: None,
        res: Resources::default(),
        report: Report::default(),
        peak_rss_kib: 0,
        extra_env,
        args,
    })
}

async fn run(ctx: &mut Ctx) {
    let selected = |p: Phase| {
        if ctx.args.only.is_empty() {
            p.in_default_run(ctx.args.quick)
        } else {
            ctx.args.only.contains(&p)
        }
    };
    let plan: Vec<Phase> = Phase::value_variants()
        .iter()
        .copied()
        .filter(|p| selected(*p))
        .collect();
    ctx.progress(format!(
        "outbox-bench run {}: rows {}, naive rows {}, latency {}/s for {} s, phases {:?}{}{}{}{}",
        ctx.run_id,
        ctx.rows,
        ctx.naive_rows,
        ctx.lat_rate,
        ctx.lat_secs,
        plan,
        if ctx.extra_env.is_empty() {
            String::new()
        } else {
            format!(", relay env {:?}", masked_env(&ctx.extra_env))
        },
        if ctx.args.full_pages {
            ", full pages (PostgreSQL tables at fillfactor 100)"
        } else {
            ""
        },
        if ctx.args.open_index {
            ", schema version 5's open index"
        } else {
            ""
        },
        if ctx.args.no_blocker_index {
            ", no blocker index (schema version 6's probing ordered claim)"
        } else {
            ""
        }
    ));
    for phase in plan {
        let name = format!("{phase:?}").to_lowercase();
        ctx.progress(format!("phase {name}: started"));
        let started = Instant::now();
        let result = ctx
            .measured(
                &format!("phase {name}"),
                async |ctx: &mut Ctx| match phase {
                    Phase::Db => phases::db_ceiling(ctx).await,
                    Phase::Broker => phases::broker_ceiling(ctx).await,
                    Phase::Naive => phases::naive(ctx).await,
                    Phase::Relay => phases::relay_runs(ctx).await,
                    Phase::Latency => phases::latency(ctx).await,
                    Phase::Insert => phases::insert_cost(ctx).await,
                    Phase::Claim => phases::claim(ctx).await,
                    Phase::Outboxes => phases::outboxes(ctx).await,
                    Phase::Steady => phases::steady(ctx).await,
                    Phase::Nats => phases::nats(ctx).await,
                    Phase::Redis => phases::redis_runs(ctx).await,
                    Phase::Tracing => phases::tracing_runs(ctx).await,
                    Phase::Http => phases::http_runs(ctx).await,
                    Phase::Retention => phases::retention(ctx).await,
                    Phase::Mysql => phases::mysql(ctx).await,
                    Phase::Console => phases::console(ctx).await,
                    Phase::Dbcost => phases::dbcost(ctx).await,
                },
            )
            .await;
        let secs = started.elapsed().as_secs_f64();
        ctx.report
            .details
            .entry("phase_seconds")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .map(|m| m.insert(name.clone(), num(secs)));
        match result {
            Ok(()) => ctx.progress(format!("phase {name}: finished in {secs:.1} s")),
            Err(e) => {
                ctx.progress(format!("phase {name}: FAILED after {secs:.1} s: {e:#}"));
                ctx.report.errors.push(format!("{name}: {e:#}"));
            }
        }
    }
}

/// Ratios, peak RSS, then the plans, the table and the JSON line.
fn finish(ctx: &mut Ctx) {
    if ctx.peak_rss_kib > 0 {
        let mib = ctx.peak_rss_kib as f64 / 1024.0;
        ctx.report.figure(
            "6 memory",
            "relay_peak_rss_mib",
            "relay peak RSS (VmHWM), max over relay processes",
            mib,
            "MiB",
        );
    }
    let r = &ctx.report;
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let rmq_none = r.get("relay_rabbitmq_none_msgs_per_s");
    let kafka_none = r.get("relay_kafka_none_msgs_per_s");
    let db = r.get("db_ceiling_rows_per_s");
    let rmq_ceiling = r.get("rabbitmq_ceiling_msgs_per_s");
    let min = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        _ => None,
    };
    let min_ceiling = min(db, rmq_ceiling);
    let ratios = [
        (
            "ratio_relay_rabbitmq_none_vs_min_ceiling",
            "relay rabbitmq none / min(db ceiling, rabbitmq ceiling)",
            ratio(rmq_none, min_ceiling),
        ),
        (
            "ratio_relay_rabbitmq_none_vs_raw_broker",
            "relay rabbitmq none / raw lapin ceiling (one channel)",
            ratio(rmq_none, r.get("rabbitmq_raw_ceiling_msgs_per_s")),
        ),
        (
            "ratio_rabbitmq_publisher_vs_raw",
            "RabbitMqPublisher ceiling / raw lapin ceiling",
            ratio(rmq_ceiling, r.get("rabbitmq_raw_ceiling_msgs_per_s")),
        ),
        (
            "ratio_relay_rabbitmq_none_vs_raw_envelope",
            "relay rabbitmq none / raw lapin with the relay's properties and headers",
            ratio(rmq_none, r.get("rabbitmq_raw_envelope_ceiling_msgs_per_s")),
        ),
        (
            "ratio_rabbitmq_publisher_vs_raw_envelope",
            "RabbitMqPublisher ceiling / raw lapin with the relay's properties and headers",
            ratio(
                rmq_ceiling,
                r.get("rabbitmq_raw_envelope_ceiling_msgs_per_s"),
            ),
        ),
        (
            "ratio_db_ceiling_vs_pgbench",
            "relay no-op path (db ceiling) / pgbench claim + mark sent (same SQL)",
            ratio(db, r.get("pgbench_claim_mark_rows_per_s")),
        ),
        (
            "ratio_db_ceiling_aggregate_vs_pgbench_aggregate",
            "relay no-op path, ordering aggregate / pgbench ordered claim + mark sent (same SQL)",
            ratio(
                r.get("db_ceiling_aggregate_rows_per_s"),
                r.get("pgbench_claim_aggregate_mark_rows_per_s"),
            ),
        ),
        (
            "ratio_pgbench_aggregate_vs_none",
            "pgbench: ordered claim / unordered claim (what PostgreSQL allows ordering)",
            ratio(
                r.get("pgbench_claim_aggregate_mark_rows_per_s"),
                r.get("pgbench_claim_mark_rows_per_s"),
            ),
        ),
        (
            "ratio_relay_kafka_none_vs_db_ceiling",
            "relay kafka none / db ceiling",
            ratio(kafka_none, db),
        ),
        (
            "ratio_relay_kafka_aggregate_vs_db_ceiling_aggregate",
            "relay kafka aggregate / db ceiling, ordering aggregate",
            ratio(
                r.get("relay_kafka_aggregate_msgs_per_s"),
                r.get("db_ceiling_aggregate_rows_per_s"),
            ),
        ),
        (
            "ratio_relay_rabbitmq_none_vs_naive",
            "relay rabbitmq none / naive loop",
            ratio(rmq_none, r.get("naive_rabbitmq_msgs_per_s")),
        ),
        (
            "ratio_aggregate_vs_none_rabbitmq",
            "relay rabbitmq: aggregate / none",
            ratio(r.get("relay_rabbitmq_aggregate_msgs_per_s"), rmq_none),
        ),
        (
            "ratio_aggregate_vs_none_kafka",
            "relay kafka: aggregate / none",
            ratio(r.get("relay_kafka_aggregate_msgs_per_s"), kafka_none),
        ),
        (
            "ratio_insert_wakeup_busy_vs_none_c8",
            "app inserts, 8 connections: wake-up trigger, relay busy / no trigger",
            ratio(
                r.get("insert_wakeup_busy_c8_per_s"),
                r.get("insert_no_trigger_c8_per_s"),
            ),
        ),
        (
            "ratio_insert_wakeup_idle_vs_none_c8",
            "app inserts, 8 connections: wake-up trigger, relay waiting (NOTIFY per txn) / no trigger",
            ratio(
                r.get("insert_wakeup_idle_c8_per_s"),
                r.get("insert_no_trigger_c8_per_s"),
            ),
        ),
    ];
    // Each sink's drain against the lower of its two bare ceilings measured in this run:
    // pgbench on the relay's statements and the sink's own client sending the relay's messages.
    let pgbench = r.get("pgbench_claim_mark_rows_per_s");
    let sinks = [
        ("kafka", pgbench),
        ("nats", min(pgbench, r.get("nats_bare_msgs_per_s"))),
        ("redis", min(pgbench, r.get("redis_bare_msgs_per_s"))),
        ("http", min(pgbench, r.get("http_bare_msgs_per_s"))),
    ];
    let per_sink = sinks.map(|(sink, ceiling)| {
        (
            format!("ratio_relay_{sink}_none_vs_bare_ceilings"),
            format!("relay {sink} none / min(pgbench claim + mark sent, bare {sink} client)"),
            ratio(r.get(&format!("relay_{sink}_none_msgs_per_s")), ceiling),
        )
    });
    // The same drains against what the machine allows a drain that runs both on these cores:
    // the CPU (every process) that the database's bare client spends per message on the
    // relay's statements plus the CPU the bare sink client and its server spend per message,
    // over the machine's cores. PostgreSQL: pgbench; MySQL/MariaDB (keys `…_mysql_…`): the
    // bare mysql_async client of phase `mysql`.
    let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    let shared = |db: &str, sink: &str| {
        let cpu = r.get(&format!("{db}_machine_cpu_s_per_100k"))?
            + r.get(&format!("{sink}_machine_cpu_s_per_100k"))?;
        (cpu > 0.0).then(|| cores * 100_000.0 / cpu)
    };
    let databases = [
        (
            "",
            ["pgbench_claim_mark", "pgbench_claim_aggregate_mark"],
            [
                ("nats", "nats_bare"),
                ("redis", "redis_bare"),
                ("http", "http_bare"),
            ],
        ),
        (
            "mysql_",
            ["mysql_bare_claim_mark", "mysql_bare_claim_aggregate_mark"],
            [
                ("rabbitmq", "rabbitmq_raw_envelope_ceiling"),
                ("kafka", "kafka_bare"),
                ("nats", "nats_bare"),
            ],
        ),
    ];
    let mut shared_ceilings = Vec::new();
    let mut shared_ratios = Vec::new();
    for (db_prefix, db_keys, sinks) in databases {
        for (sink, sink_key) in sinks {
            for (ordering, db) in ["none", "aggregate"].into_iter().zip(db_keys) {
                let Some(ceiling) = shared(db, sink_key) else {
                    continue;
                };
                shared_ceilings.push((
                    format!("ceiling_shared_{db_prefix}{sink}_{ordering}_msgs_per_s"),
                    format!(
                        "{cores} cores ÷ (machine CPU per message of {db} + of the bare {sink} client)"
                    ),
                    ceiling,
                ));
                let relay = r.get(&format!("relay_{db_prefix}{sink}_{ordering}_msgs_per_s"));
                let from = match db_prefix {
                    "" => String::new(),
                    p => format!("{} → ", p.trim_end_matches('_')),
                };
                if let Some(relay) = relay {
                    shared_ratios.push((
                        format!("ratio_{db_prefix}relay_{sink}_{ordering}_vs_shared_ceiling"),
                        format!("relay {from}{sink} {ordering} / the shared ceiling ({db} and bare {sink} client on the same cores)"),
                        Some(relay / ceiling),
                    ));
                }
            }
        }
    }
    let ratios = ratios
        .into_iter()
        .map(|(k, l, v)| (k.to_owned(), l.to_owned(), v))
        .chain(per_sink)
        .chain(shared_ratios);
    for (key, label, value) in ratios.collect::<Vec<_>>() {
        if let Some(v) = value {
            ctx.report.figure("ratios", &key, &label, v, "×");
        }
    }
    for (key, label, value) in shared_ceilings {
        ctx.report.figure("ratios", &key, &label, value, "msgs/s");
    }

    ctx.report.figures.sort_by(|a, b| a.phase.cmp(&b.phase));
    let report = &ctx.report;
    let mut text = String::new();
    for (title, plan) in &report.plans {
        text.push_str(&format!("--- plan: {title}\n{plan}\n\n"));
    }
    for (title, block) in &report.sections {
        text.push_str(&format!("--- {title}\n{block}\n"));
    }
    let w = report
        .figures
        .iter()
        .map(|f| f.label.chars().count())
        .max()
        .unwrap_or(10)
        .max(6);
    text.push_str(&format!(
        "{:<18} {:<w$} {:>12}  unit\n",
        "phase", "figure", "value"
    ));
    text.push_str(&format!("{}\n", "-".repeat(18 + w + 20)));
    for f in &report.figures {
        text.push_str(&format!(
            "{:<18} {:<w$} {:>12}  {}\n",
            f.phase,
            f.label,
            fmt_value(f.value, &f.unit),
            f.unit
        ));
    }
    for n in &report.notes {
        text.push_str(&format!("note: {n}\n"));
    }
    for e in &report.errors {
        text.push_str(&format!("ERROR: {e}\n"));
    }
    if ctx.args.json_only {
        eprint!("{text}");
    } else {
        print!("{text}");
    }

    let mut out = Map::new();
    out.insert("run_id".into(), json!(ctx.run_id));
    out.insert("rows".into(), json!(ctx.rows));
    out.insert("naive_rows".into(), json!(ctx.naive_rows));
    out.insert("quick".into(), json!(ctx.args.quick));
    out.insert("full_pages".into(), json!(ctx.args.full_pages));
    out.insert("open_index".into(), json!(ctx.args.open_index));
    out.insert("no_blocker_index".into(), json!(ctx.args.no_blocker_index));
    out.insert("latency_rate_per_s".into(), json!(ctx.lat_rate));
    out.insert("latency_seconds".into(), json!(ctx.lat_secs));
    for (k, v) in &report.json {
        out.insert(k.clone(), v.clone());
    }
    out.insert("total_seconds".into(), num(ctx.t0.elapsed().as_secs_f64()));
    out.insert("notes".into(), json!(report.notes));
    out.insert("errors".into(), json!(report.errors));
    out.insert("details".into(), Value::Object(report.details.clone()));
    println!("{}", Value::Object(out));
}

fn fmt_value(v: f64, unit: &str) -> String {
    if !v.is_finite() {
        return "n/a".into();
    }
    match unit {
        "rows/s" | "msgs/s" | "pages" | "rows" | "tuples" | "vacuums" | "partitions" => {
            group_thousands(v.round() as i64)
        }
        "×" => format!("{v:.2}"),
        "MiB" => format!("{v:.1}"),
        _ if v >= 100.0 => format!("{v:.0}"),
        _ if v >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

fn group_thousands(n: i64) -> String {
    let s = n.abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::{masked_env, parse_relay_env};

    fn pair(k: &str, v: &str) -> (String, String) {
        (k.to_owned(), v.to_owned())
    }

    #[test]
    fn secret_values_are_masked_wherever_the_bench_echoes_them() {
        let env = [
            pair("RELAY_SIGNING__KEY", "k3y-value"),
            pair("RELAY_SIGNING__PREVIOUS_KEYS", "old-k3y"),
            pair("RELAY_X__PASSWORD", "pw-value"),
            pair("RELAY_X__client_secret", "s3cret-value"),
            pair("RELAY_X__TOKEN", "t0ken-value"),
            pair("RELAY_RELAY__MAX_IN_FLIGHT", "4000"),
            pair(
                "RELAY_DATABASE__URL",
                "postgres://app:hunter2@127.0.0.1/test",
            ),
        ];
        let shown = format!("{:?}", masked_env(&env));
        for secret in [
            "k3y-value",
            "old-k3y",
            "pw-value",
            "s3cret-value",
            "t0ken-value",
        ] {
            assert!(!shown.contains(secret), "{secret} echoed: {shown}");
        }
        assert!(!shown.contains("hunter2"), "URL password echoed: {shown}");
        assert!(shown.contains("\"4000\""), "plain values kept: {shown}");
        assert!(shown.contains("app:***@127.0.0.1"), "{shown}");

        let rejected = ["SIGNING_KEY=k3y-value".to_owned()];
        let err = parse_relay_env(&rejected).unwrap_err().to_string();
        assert!(
            !err.contains("k3y-value") && err.contains("SIGNING_KEY"),
            "{err}"
        );
        let rejected = ["RELAY_SIGNING__KEY:k3y-value".to_owned()];
        let err = parse_relay_env(&rejected).unwrap_err().to_string();
        assert!(!err.contains("k3y-value"), "{err}");
        let ok = parse_relay_env(&["RELAY_A=b=c".to_owned()]).unwrap();
        assert_eq!(ok, [pair("RELAY_A", "b=c")]);
    }
}
