//! Metrics, health and the HTTP endpoint that serves them (`/metrics`, `/healthz`, `/readyz`).
//!
//! Every metric name is a constant here and every event has one `record_*` function, so the
//! relay loop never spells a metric name. Labels stay low-cardinality: never a row id, an
//! aggregate id or a rendered routing key.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Metric names (contract §7).
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
    /// Every name above, for tests and docs.
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

/// Records the static `outbox_relay_info` gauge and registers every metric so `/metrics`
/// lists them all from the start.
pub fn record_info(instance: &str, publisher: &str) {
    metrics::gauge!(names::RELAY_INFO, "version" => env!("CARGO_PKG_VERSION"), "instance" => instance.to_owned(), "publisher" => publisher.to_owned()).set(1.0);
    metrics::counter!(names::PUBLISH_FAILURES, "kind" => "message").increment(0);
    metrics::counter!(names::PUBLISH_FAILURES, "kind" => "connection").increment(0);
    metrics::counter!(names::DEAD_LETTERED).increment(0);
    metrics::counter!(names::EXPIRED).increment(0);
    metrics::gauge!(names::WATERMARK_LAG).set(0.0);
    metrics::gauge!(names::BROKER_CONNECTED).set(0.0);
    metrics::counter!(names::VACUUMS).increment(0);
}

/// The outbox table's dead tuples, as last read.
pub fn record_dead_tuples(n: i64) {
    metrics::gauge!(names::DEAD_TUPLES).set(n as f64);
}

/// The relay vacuumed the outbox table.
pub fn record_vacuum() {
    metrics::counter!(names::VACUUMS).increment(1);
}

/// A message was confirmed by the broker.
pub fn record_published(aggregate_type: &str, publish: Duration, end_to_end: Duration) {
    metrics::counter!(names::PUBLISHED, "aggregate_type" => aggregate_type.to_owned()).increment(1);
    metrics::histogram!(names::PUBLISH_DURATION).record(publish.as_secs_f64());
    metrics::histogram!(names::END_TO_END_LATENCY).record(end_to_end.as_secs_f64());
}

/// A publish failed; `connection` says whether it was connection-level.
pub fn record_publish_failure(connection: bool) {
    let kind = if connection { "connection" } else { "message" };
    metrics::counter!(names::PUBLISH_FAILURES, "kind" => kind).increment(1);
}

/// The relay (re)connected to the broker.
pub fn record_broker_connected() {
    metrics::gauge!(names::BROKER_CONNECTED).set(1.0);
}

/// The broker connection was lost, or an attempt to (re)connect failed: a connection-level
/// failure even when no message was in flight, and the gauge says the broker is down.
pub fn record_broker_down() {
    metrics::gauge!(names::BROKER_CONNECTED).set(0.0);
    metrics::counter!(names::PUBLISH_FAILURES, "kind" => "connection").increment(1);
}

/// Rows were dead-lettered.
pub fn record_dead_lettered(n: u64) {
    metrics::counter!(names::DEAD_LETTERED).increment(n);
}

/// Rows expired (never published).
pub fn record_expired(n: u64) {
    metrics::counter!(names::EXPIRED).increment(n);
}

/// A claim returned `n` rows.
pub fn record_claim(n: usize) {
    metrics::histogram!(names::CLAIM_BATCH_SIZE).record(n as f64);
}

/// The ordering guard's current hold-back.
pub fn record_watermark_lag(lag: Duration) {
    metrics::gauge!(names::WATERMARK_LAG).set(lag.as_secs_f64());
}

/// Backlog gauges from the periodic table query.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Backlog {
    /// Pending rows ready now.
    pub ready: i64,
    /// Pending rows waiting for a retry.
    pub waiting: i64,
    /// Age of the oldest pending or processing row, seconds.
    pub oldest_pending_age: f64,
    /// How long the oldest ready row has been ready, seconds (0 when none).
    pub oldest_ready_age: f64,
    /// Age of the oldest row waiting out a backoff, seconds (0 when none).
    pub oldest_waiting_age: f64,
    /// Dead letters.
    pub failed: i64,
    /// Aggregates held by a dead letter.
    pub blocked_aggregates: i64,
}

/// Publishes the backlog gauges.
pub fn record_backlog(b: &Backlog) {
    metrics::gauge!(names::PENDING, "state" => "ready").set(b.ready as f64);
    metrics::gauge!(names::PENDING, "state" => "waiting").set(b.waiting as f64);
    metrics::gauge!(names::OLDEST_PENDING_AGE).set(b.oldest_pending_age);
    metrics::gauge!(names::OLDEST_READY_AGE).set(b.oldest_ready_age);
    metrics::gauge!(names::OLDEST_WAITING_AGE).set(b.oldest_waiting_age);
    metrics::gauge!(names::FAILED).set(b.failed as f64);
    metrics::gauge!(names::BLOCKED_AGGREGATES).set(b.blocked_aggregates as f64);
}

/// What `/readyz` reports: the relay can reach both the database and the broker.
#[derive(Debug, Default)]
pub struct Health {
    database: AtomicBool,
    broker: AtomicBool,
}

impl Health {
    /// Records the database's reachability.
    pub fn set_database(&self, up: bool) {
        self.database.store(up, Ordering::Relaxed);
    }

    /// Records the broker's reachability.
    pub fn set_broker(&self, up: bool) {
        self.broker.store(up, Ordering::Relaxed);
    }

    /// Database reachable at last contact.
    pub fn database(&self) -> bool {
        self.database.load(Ordering::Relaxed)
    }

    /// Broker reachable at last contact.
    pub fn broker(&self) -> bool {
        self.broker.load(Ordering::Relaxed)
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

/// Serves `/metrics`, `/healthz` and `/readyz` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: std::sync::Arc<Health>,
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
        .with_state(state);
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
    let body = format!(
        "database: {}\nbroker: {}\n",
        if db { "up" } else { "down" },
        if broker { "up" } else { "down" }
    );
    let code = if db && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body)
}
