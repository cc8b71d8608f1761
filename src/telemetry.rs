//! Metrics, health and the HTTP endpoint that serves them (`/metrics`, `/healthz`, `/readyz`).
//!
//! Every metric name is a constant here and every event has one `record_*` function, so the
//! relay loop never spells a metric name. Labels stay low-cardinality: never a row id, an
//! aggregate id or a rendered routing key.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::store::Backlog;

/// Metric names (docs/operations.md).
pub mod names {
    /// Gauge: pending rows, labelled `state` = `ready` | `waiting`.
    pub const PENDING: &str = "outbox_pending_messages";
    /// Gauge: age of the oldest pending or processing row, rows waiting out a backoff included.
    pub const OLDEST_PENDING_AGE: &str = "outbox_oldest_pending_age_seconds";
    /// Gauge: how long the oldest row that could be published now has been ready (the lag that
    /// alerts use).
    pub const OLDEST_READY_AGE: &str = "outbox_oldest_ready_age_seconds";
    /// Gauge: age of the oldest row waiting out a retry backoff.
    pub const OLDEST_WAITING_AGE: &str = "outbox_oldest_waiting_age_seconds";
    /// Gauge: dead tuples in the outbox table (`pg_stat_user_tables.n_dead_tup`).
    pub const DEAD_TUPLES: &str = "outbox_table_dead_tuples";
    /// Counter: `VACUUM`s the relay ran on the outbox table.
    pub const VACUUMS: &str = "outbox_vacuums_total";
    /// Gauge: dead letters.
    pub const FAILED: &str = "outbox_failed_messages";
    /// Gauge: aggregates whose earliest unsent row is `failed`.
    pub const BLOCKED_AGGREGATES: &str = "outbox_blocked_aggregates";
    /// Counter: confirmed messages, labelled `aggregate_type`.
    pub const PUBLISHED: &str = "outbox_published_total";
    /// Counter: failed publishes, labelled `kind` = `message` | `connection`.
    pub const PUBLISH_FAILURES: &str = "outbox_publish_failures_total";
    /// Gauge: 1 while the relay holds a broker connection, 0 while it has none.
    pub const BROKER_CONNECTED: &str = "outbox_broker_connected";
    /// Counter: rows moved to `failed`.
    pub const DEAD_LETTERED: &str = "outbox_dead_lettered_total";
    /// Counter: rows that passed their `expires_at` before they could be published.
    pub const EXPIRED: &str = "outbox_expired_total";
    /// Histogram: send → confirm.
    pub const PUBLISH_DURATION: &str = "outbox_publish_duration_seconds";
    /// Histogram: created_at → confirmed.
    pub const END_TO_END_LATENCY: &str = "outbox_end_to_end_latency_seconds";
    /// Histogram: rows per claim.
    pub const CLAIM_BATCH_SIZE: &str = "outbox_claim_batch_size";
    /// Gauge: how long the ordering guard has been holding rows back.
    pub const WATERMARK_LAG: &str = "outbox_watermark_lag_seconds";
    /// Gauge (1): version, instance and publisher.
    pub const RELAY_INFO: &str = "outbox_relay_info";
    /// Counter: trace spans dropped instead of exported, labelled `reason` = `queue_full` |
    /// `export_failed` (only with tracing on, so not in [`ALL`]: see [`crate::otel`]).
    pub const TRACE_SPANS_DROPPED: &str = "outbox_trace_spans_dropped_total";
    /// Gauge: range partitions of a partitioned outbox table (DEFAULT not counted).
    pub const PARTITIONS: &str = "outbox_partitions";
    /// Gauge: rows in a partitioned table's DEFAULT partition (rows outside every range).
    pub const DEFAULT_PARTITION_ROWS: &str = "outbox_default_partition_rows";
    /// Gauge: partitions past retention that are kept, labelled `reason` = `failed` |
    /// `processing` | `pending` | `locked`.
    pub const PARTITIONS_KEPT: &str = "outbox_partitions_kept";
    /// Gauge: seconds since the end of the oldest range partition's range.
    pub const OLDEST_PARTITION_AGE: &str = "outbox_oldest_partition_age_seconds";
    /// Counter: partitions retention dropped.
    pub const PARTITIONS_DROPPED: &str = "outbox_partitions_dropped_total";
    /// The names above that the relay exports only when their feature is on (tracing, a
    /// partitioned table).
    pub const OPTIONAL: &[&str] = &[
        TRACE_SPANS_DROPPED,
        PARTITIONS,
        DEFAULT_PARTITION_ROWS,
        PARTITIONS_KEPT,
        OLDEST_PARTITION_AGE,
        PARTITIONS_DROPPED,
    ];
    /// Every name above that the relay always exports, for tests and docs.
    pub const ALL: &[&str] = &[
        PENDING,
        OLDEST_PENDING_AGE,
        OLDEST_READY_AGE,
        OLDEST_WAITING_AGE,
        DEAD_TUPLES,
        VACUUMS,
        FAILED,
        BLOCKED_AGGREGATES,
        PUBLISHED,
        PUBLISH_FAILURES,
        BROKER_CONNECTED,
        DEAD_LETTERED,
        EXPIRED,
        PUBLISH_DURATION,
        END_TO_END_LATENCY,
        CLAIM_BATCH_SIZE,
        WATERMARK_LAG,
        RELAY_INFO,
    ];
}

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder once per process and returns its handle.
pub fn install() -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let latency = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0,
            ];
            let sizes = [1.0, 5.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0];
            PrometheusBuilder::new()
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full(names::CLAIM_BATCH_SIZE.into()),
                    &sizes,
                )
                .and_then(|b| b.set_buckets(&latency))
                .and_then(|b| b.install_recorder())
                .map_err(|e| tracing::warn!("metrics recorder not installed: {e}"))
                .ok()
        })
        .clone()
}

/// Records the static `outbox_relay_info` gauge and registers the process-wide metrics so
/// `/metrics` lists them from the start (each outbox registers its own: [`OutboxMetrics`]).
pub fn record_info(instance: &str, publisher: &str) {
    metrics::gauge!(names::RELAY_INFO, "version" => env!("CARGO_PKG_VERSION"), "instance" => instance.to_owned(), "publisher" => publisher.to_owned()).set(1.0);
    metrics::gauge!(names::BROKER_CONNECTED).set(0.0);
}

/// Registers the dropped-spans counter (tracing is on) so `/metrics` lists it from the start.
pub fn register_trace_drops() {
    for reason in ["queue_full", "export_failed"] {
        metrics::counter!(names::TRACE_SPANS_DROPPED, "reason" => reason).increment(0);
    }
}

/// `n` trace spans were dropped for `reason` (`queue_full` or `export_failed`).
pub fn record_trace_spans_dropped(reason: &'static str, n: u64) {
    metrics::counter!(names::TRACE_SPANS_DROPPED, "reason" => reason).increment(n);
}

/// The relay (re)connected to the broker.
pub fn record_broker_connected() {
    metrics::gauge!(names::BROKER_CONNECTED).set(1.0);
}

/// One outbox's metrics: every per-table metric carries its `outbox` label (docs/operations.md).
#[derive(Clone)]
pub struct OutboxMetrics {
    outbox: metrics::SharedString,
    // Rows claimed since start (clones share it): the background tasks read it to tell an
    // outbox with traffic from an idle one.
    claimed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    // The per-message metrics, registered once: looking a metric up by name and labels on
    // every confirm allocated its key each time.
    publish_duration: metrics::Histogram,
    end_to_end: metrics::Histogram,
    published: std::sync::Arc<std::sync::Mutex<HashMap<String, metrics::Counter>>>,
    // What the console reads (clones share them): the Prometheus counters cannot be read back
    // from inside the process, so the events its charts sample are also summed here, and the
    // backlog task's last figures are kept instead of being read from the table again.
    totals: std::sync::Arc<Totals>,
    last_backlog: std::sync::Arc<std::sync::Mutex<Option<(std::time::Instant, Backlog)>>>,
}

/// One outbox's running totals since start, as the console samples them.
#[derive(Debug, Default)]
struct Totals {
    published: AtomicU64,
    message_failures: AtomicU64,
    connection_failures: AtomicU64,
    dead_lettered: AtomicU64,
}

/// One outbox's totals since start, read at one moment (see [`OutboxMetrics::totals`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TotalsSnapshot {
    /// Messages confirmed.
    pub published: u64,
    /// Message-level publish failures.
    pub message_failures: u64,
    /// Connection-level publish failures (lost connections and failed reconnects included).
    pub connection_failures: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
}

impl std::fmt::Debug for OutboxMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxMetrics")
            .field("outbox", &self.outbox)
            .finish_non_exhaustive()
    }
}

impl OutboxMetrics {
    /// The metrics of the outbox named `name`, registered so that `/metrics` lists its
    /// counters from the start.
    pub fn new(name: &str) -> Self {
        let outbox = metrics::SharedString::from(name.to_owned());
        let m = Self {
            publish_duration: metrics::histogram!(names::PUBLISH_DURATION, "outbox" => outbox.clone()),
            end_to_end: metrics::histogram!(names::END_TO_END_LATENCY, "outbox" => outbox.clone()),
            outbox,
            claimed: std::sync::Arc::default(),
            published: std::sync::Arc::default(),
            totals: std::sync::Arc::default(),
            last_backlog: std::sync::Arc::default(),
        };
        let o = m.label();
        metrics::counter!(names::PUBLISH_FAILURES, "outbox" => o.clone(), "kind" => "message")
            .increment(0);
        metrics::counter!(names::PUBLISH_FAILURES, "outbox" => o.clone(), "kind" => "connection")
            .increment(0);
        metrics::counter!(names::DEAD_LETTERED, "outbox" => o.clone()).increment(0);
        metrics::counter!(names::EXPIRED, "outbox" => o.clone()).increment(0);
        metrics::gauge!(names::WATERMARK_LAG, "outbox" => o.clone()).set(0.0);
        metrics::counter!(names::VACUUMS, "outbox" => o).increment(0);
        m
    }

    fn label(&self) -> metrics::SharedString {
        self.outbox.clone()
    }

    /// The outbox table's dead tuples, as last read.
    pub fn dead_tuples(&self, n: i64) {
        metrics::gauge!(names::DEAD_TUPLES, "outbox" => self.label()).set(n as f64);
    }

    /// The relay vacuumed the outbox table.
    pub fn vacuumed(&self) {
        metrics::counter!(names::VACUUMS, "outbox" => self.label()).increment(1);
    }

    /// A message was confirmed by the broker.
    pub fn published(&self, aggregate_type: &str, publish: Duration, end_to_end: Duration) {
        self.totals.published.fetch_add(1, Ordering::Relaxed);
        {
            let mut counters = self.published.lock().unwrap_or_else(|p| p.into_inner());
            match counters.get(aggregate_type) {
                Some(c) => c.increment(1),
                None => {
                    let c = metrics::counter!(names::PUBLISHED, "outbox" => self.label(), "aggregate_type" => aggregate_type.to_owned());
                    c.increment(1);
                    // Bounded like the label itself: aggregate types are a closed, small set.
                    counters.insert(aggregate_type.to_owned(), c);
                }
            }
        }
        self.publish_duration.record(publish.as_secs_f64());
        self.end_to_end.record(end_to_end.as_secs_f64());
    }

    /// A publish failed; `connection` says whether it was connection-level.
    pub fn publish_failure(&self, connection: bool) {
        let (kind, total) = if connection {
            ("connection", &self.totals.connection_failures)
        } else {
            ("message", &self.totals.message_failures)
        };
        total.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(names::PUBLISH_FAILURES, "outbox" => self.label(), "kind" => kind)
            .increment(1);
    }

    /// The broker connection was lost, or an attempt to (re)connect failed, seen by this
    /// outbox's loop: a connection-level failure even when no message was in flight, and the
    /// gauge says the broker is down.
    pub fn broker_down(&self) {
        metrics::gauge!(names::BROKER_CONNECTED).set(0.0);
        self.publish_failure(true);
    }

    /// Rows were dead-lettered.
    pub fn dead_lettered(&self, n: u64) {
        self.totals.dead_lettered.fetch_add(n, Ordering::Relaxed);
        metrics::counter!(names::DEAD_LETTERED, "outbox" => self.label()).increment(n);
    }

    /// Rows expired (never published).
    pub fn expired(&self, n: u64) {
        metrics::counter!(names::EXPIRED, "outbox" => self.label()).increment(n);
    }

    /// A claim returned `n` rows.
    pub fn claimed(&self, n: usize) {
        self.claimed
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        metrics::histogram!(names::CLAIM_BATCH_SIZE, "outbox" => self.label()).record(n as f64);
    }

    /// What this outbox has published, failed and dead-lettered since start.
    pub fn totals(&self) -> TotalsSnapshot {
        let t = &self.totals;
        TotalsSnapshot {
            published: t.published.load(Ordering::Relaxed),
            message_failures: t.message_failures.load(Ordering::Relaxed),
            connection_failures: t.connection_failures.load(Ordering::Relaxed),
            dead_lettered: t.dead_lettered.load(Ordering::Relaxed),
        }
    }

    /// The backlog figures last published ([`OutboxMetrics::backlog`]) and when; `None` before
    /// the first.
    pub fn last_backlog(&self) -> Option<(std::time::Instant, Backlog)> {
        *self.last_backlog.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rows this outbox's loop has claimed since start.
    pub fn rows_claimed(&self) -> u64 {
        self.claimed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The ordering guard's current hold-back.
    pub fn watermark_lag(&self, lag: Duration) {
        metrics::gauge!(names::WATERMARK_LAG, "outbox" => self.label()).set(lag.as_secs_f64());
    }

    /// Publishes a partitioned table's gauges: range partitions, rows in DEFAULT, the age of
    /// the oldest partition's end, and the partitions past retention kept, by reason.
    pub fn partitions(&self, p: &PartitionGauges) {
        let o = self.label();
        metrics::gauge!(names::PARTITIONS, "outbox" => o.clone()).set(p.partitions as f64);
        metrics::gauge!(names::DEFAULT_PARTITION_ROWS, "outbox" => o.clone())
            .set(p.default_rows as f64);
        metrics::gauge!(names::OLDEST_PARTITION_AGE, "outbox" => o.clone()).set(p.oldest_age);
        for (reason, n) in &p.kept {
            metrics::gauge!(names::PARTITIONS_KEPT, "outbox" => o.clone(), "reason" => *reason)
                .set(*n as f64);
        }
        metrics::counter!(names::PARTITIONS_DROPPED, "outbox" => o).increment(p.dropped);
    }

    /// Publishes the backlog gauges.
    pub fn backlog(&self, b: &Backlog) {
        *self.last_backlog.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((std::time::Instant::now(), *b));
        let o = self.label();
        metrics::gauge!(names::PENDING, "outbox" => o.clone(), "state" => "ready")
            .set(b.ready as f64);
        metrics::gauge!(names::PENDING, "outbox" => o.clone(), "state" => "waiting")
            .set(b.waiting as f64);
        metrics::gauge!(names::OLDEST_PENDING_AGE, "outbox" => o.clone()).set(b.oldest_pending_age);
        metrics::gauge!(names::OLDEST_READY_AGE, "outbox" => o.clone()).set(b.oldest_ready_age);
        metrics::gauge!(names::OLDEST_WAITING_AGE, "outbox" => o.clone()).set(b.oldest_waiting_age);
        metrics::gauge!(names::FAILED, "outbox" => o.clone()).set(b.failed as f64);
        metrics::gauge!(names::BLOCKED_AGGREGATES, "outbox" => o).set(b.blocked_aggregates as f64);
    }
}

/// A partitioned table's gauges, as one round of the partition work found them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PartitionGauges {
    /// Range partitions.
    pub partitions: usize,
    /// Rows in DEFAULT.
    pub default_rows: i64,
    /// Seconds since the oldest range partition's range ended (negative: not yet).
    pub oldest_age: f64,
    /// Partitions past retention kept, per reason label (every reason, zeros included).
    pub kept: Vec<(&'static str, usize)>,
    /// Partitions dropped in this round.
    pub dropped: u64,
}

/// What `/readyz` reports: the relay can reach every outbox's database and the broker.
#[derive(Debug, Default)]
pub struct Health {
    // One entry per outbox.
    databases: std::sync::Mutex<Vec<OutboxDatabase>>,
    broker: AtomicBool,
}

/// One outbox's entry in [`Health`].
#[derive(Debug)]
struct OutboxDatabase {
    name: String,
    /// Its database answered last time.
    up: bool,
    /// Why the outbox cannot start although its database answers (its table missing, say).
    problem: Option<String>,
}

impl Health {
    /// A database flag for the outbox `name` (down until it first answers).
    pub fn database_slot(self: &std::sync::Arc<Self>, name: &str) -> DatabaseHealth {
        let mut dbs = self.databases.lock().unwrap_or_else(|p| p.into_inner());
        dbs.push(OutboxDatabase {
            name: name.to_owned(),
            up: false,
            problem: None,
        });
        DatabaseHealth {
            health: std::sync::Arc::clone(self),
            slot: dbs.len() - 1,
        }
    }

    /// Records the broker's reachability.
    pub fn set_broker(&self, up: bool) {
        self.broker.store(up, Ordering::Relaxed);
    }

    /// Whether some outbox's database did not answer at last contact (rather than answering
    /// while its outbox cannot start).
    pub fn database_unreachable(&self) -> bool {
        let dbs = self.databases.lock().unwrap_or_else(|p| p.into_inner());
        dbs.iter().any(|d| !d.up && d.problem.is_none())
    }

    /// The outboxes whose database did not answer at last contact, or that cannot start
    /// (`<name>: <why>`); none before the first outbox is registered.
    pub fn databases_down(&self) -> Vec<String> {
        let dbs = self.databases.lock().unwrap_or_else(|p| p.into_inner());
        dbs.iter()
            .filter(|d| !d.up)
            .map(|d| match &d.problem {
                Some(why) => format!("{}: {why}", d.name),
                None => d.name.clone(),
            })
            .collect()
    }

    /// Every outbox's database reachable at last contact (and at least one outbox).
    pub fn database(&self) -> bool {
        let dbs = self.databases.lock().unwrap_or_else(|p| p.into_inner());
        !dbs.is_empty() && dbs.iter().all(|d| d.up)
    }

    /// Broker reachable at last contact.
    pub fn broker(&self) -> bool {
        self.broker.load(Ordering::Relaxed)
    }
}

/// One outbox's database flag in [`Health`].
#[derive(Debug, Clone)]
pub struct DatabaseHealth {
    health: std::sync::Arc<Health>,
    slot: usize,
}

impl DatabaseHealth {
    /// Runs `f` on this outbox's entry, under the lock.
    fn with<T>(&self, f: impl FnOnce(&mut OutboxDatabase) -> T) -> T {
        let mut dbs = self
            .health
            .databases
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        f(&mut dbs[self.slot])
    }

    /// Records the database's reachability (an answer ends a [`Self::cannot_start`]);
    /// returns the previous value.
    pub fn set(&self, up: bool) -> bool {
        self.with(|d| {
            if up {
                d.problem = None;
            }
            std::mem::replace(&mut d.up, up)
        })
    }

    /// The database answers but the outbox cannot start, for `why` (its table missing, say):
    /// not ready, and said so rather than "down".
    pub fn cannot_start(&self, why: String) {
        self.with(|d| {
            d.up = false;
            d.problem = Some(why);
        });
    }

    /// Reachable at last contact.
    pub fn get(&self) -> bool {
        self.with(|d| d.up)
    }

    /// Why the outbox cannot start, while it cannot ([`Self::cannot_start`]).
    pub fn problem(&self) -> Option<String> {
        self.with(|d| d.problem.clone())
    }
}

#[derive(Clone)]
struct ServerState {
    health: std::sync::Arc<Health>,
    handle: Option<PrometheusHandle>,
}

/// Binds the metrics address; fails early (at start) when it is taken.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// Serves `/metrics`, `/healthz` and `/readyz`, and the routes of `extra` (the console's),
/// until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: std::sync::Arc<Health>,
    extra: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let state = ServerState {
        health,
        handle: install(),
    };
    let app = Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .with_state(state)
        .merge(extra);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn metrics_handler(State(s): State<ServerState>) -> (StatusCode, String) {
    match &s.handle {
        Some(h) => (StatusCode::OK, h.render()),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics recorder not installed\n".into(),
        ),
    }
}

async fn ready_handler(State(s): State<ServerState>) -> (StatusCode, String) {
    let db = s.health.database();
    let broker = s.health.broker();
    let down = s.health.databases_down();
    let body = format!(
        "database: {}\nbroker: {}\n",
        if db {
            "up".to_owned()
        } else if down.is_empty() {
            "down".to_owned()
        } else if s.health.database_unreachable() {
            format!("down ({})", down.join(", "))
        } else {
            // Every database answers; some outbox cannot start (its table missing, say).
            format!("up, not ready ({})", down.join(", "))
        },
        if broker { "up" } else { "down" }
    );
    let code = if db && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body)
}
