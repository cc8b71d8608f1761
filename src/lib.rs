//! # outbox-relay
//!
//! A transactional outbox relay: applications insert event rows into an outbox table
//! (PostgreSQL, MySQL or MariaDB) in the same transaction as their business change; the relay publishes them to RabbitMQ, Kafka, NATS
//! JetStream, Redis Streams or HTTP endpoints, at least once, in order per aggregate.
//!
//! ## Map of the crate
//! - [`config`]: figment loading (defaults ← `relay.toml` ← `RELAY_*`) and validation, once;
//!   a file per section.
//! - [`message`]: the claimed outbox row ([`message::OutboxMessage`]) shared by the store and
//!   the transports.
//! - [`relay`]: the claim loop — claim → publish → settle; knows no SQL and no broker. One
//!   round is a sequence of named steps (reconnect, window, watermark, suspect, claim, wait).
//! - [`outbox`]: one outbox: its table's start-up, claim loop and background tasks; a relay
//!   runs one per `[[outboxes]]` entry (or one for `database.table`).
//! - [`window`]: the in-flight window the outboxes share fairly.
//! - [`tasks`]: background services beside the loop, one file each: [`tasks::listen`] (NOTIFY
//!   wake-up), [`tasks::lease`] (renew + reclaim), [`tasks::backlog`] (gauges),
//!   [`tasks::cleanup`] (retention), [`tasks::vacuum`], [`tasks::partitions`]; on one named-task
//!   tracker.
//! - [`store`]: every SQL statement, behind one [`store::Store`]: [`store::postgres`]
//!   (PostgreSQL, a file per concern: hot path, wake-up record, maintenance, operator
//!   commands, connection/TLS, schema, partitions) and [`store::mysql`] (MySQL 8 and MariaDB).
//! - [`publish`]: the [`publish::Publisher`] trait, the wire envelope and headers, the
//!   connection slot, one module per broker (with its own tuning).
//! - [`watermark`]: the ordering guard's bookkeeping (which `seq` values are final).
//! - [`wakeup`]: the idle relay's waiting record, which makes inserts NOTIFY only while it waits.
//! - [`backoff`]: reconnect delays (database, broker, LISTEN session).
//! - [`retry`]: the backoff policy of rejected messages (pure).
//! - [`signing`]: the `outbox-signature` header (HMAC-SHA256 over the message's identity).
//! - [`template`]: routing-key, topic, subject, stream and URL templates.
//! - [`otel`]: OpenTelemetry traces: the OTLP export pipeline and the span of each publish
//!   attempt, whose context the message carries as `traceparent` (every sink).
//! - [`telemetry`]: metric names, each outbox's labelled metrics ([`telemetry::OutboxMetrics`]),
//!   the `/metrics` + health server.
//! - [`console`]: the web console that server also serves at `/` (counts, lag, charts, dead
//!   letters, lookup by id; retry and discard behind a token).
//! - [`redact`]: masking passwords before anything is logged.
//! - [`tail`]: the development consumer behind `outbox-relay tail`.
//!
//! Start-up ([`run`]) is here: the metrics server (and the console), the shared publisher, one
//! pool per database, then one [`outbox::Outbox`] per configured outbox, each preparing its own
//! table (migrating when configured, waiting out its database's outages).
//!
//! Around this crate (a Cargo workspace): the binary in `src/main.rs` + `src/cli.rs`, the
//! integration tests in `tests/`, the shared test kit in `testkit/` (`outbox-testkit`: the binary
//! as a child process, database and broker fixtures) and the benchmark in `bench/`
//! (`outbox-bench`, one file per phase).
//!
//! ## Row lifecycle
//! `pending` → (claim) `processing` → (broker confirm) `sent` (or deleted with retention 0);
//! a message-level failure sends it back to `pending` with backoff, and to `failed` after
//! `retry.max_attempts`; a connection-level failure hands it back without spending an attempt.

// No function of the relay over 60 lines (clippy.toml sets the threshold).
#![warn(clippy::too_many_lines)]

pub mod backoff;
pub mod config;
pub mod console;
#[cfg(feature = "fault-injection")]
mod fault_injection;
pub mod message;
pub mod otel;
pub mod outbox;
pub mod publish;
pub mod redact;
pub mod relay;
pub mod retry;
pub mod signing;
pub mod store;
pub mod tail;
pub mod tasks;
pub mod telemetry;
pub mod template;
pub mod wakeup;
pub mod watermark;
pub mod window;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::outbox::Outbox;
use crate::publish::Publisher;
use crate::store::{Store, StoreError};
use crate::tasks::Tasks;
use crate::tasks::instance::InstanceLockSlot;
use crate::telemetry::Health;

/// How long the background tasks get to stop once the claim loop has drained.
const TASKS_STOP_DEADLINE: Duration = Duration::from_secs(5);

/// Why `run` could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The database refused a schema step (not a connection problem).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The OTLP trace exporter could not be built.
    #[error(transparent)]
    Tracing(#[from] otel::OtelError),
    /// The metrics address could not be bound.
    #[error("cannot listen on metrics.listen {addr}: {source}")]
    MetricsBind {
        /// The configured address.
        addr: std::net::SocketAddr,
        /// The bind error.
        source: std::io::Error,
    },
}

/// Runs the relay until `shutdown` is cancelled, then drains within `relay.shutdown_timeout`.
///
/// A database may be down at start or at any time: the relay waits and reconnects. Only
/// errors that retrying cannot fix (a missing table without `auto_migrate` or a payload column
/// of the wrong type, when it is the only outbox; a metrics address in use) end it.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    run_with(config, None, shutdown).await
}

/// Makes the publisher (instead of [`publish::build`]).
pub type PublisherFactory = Box<dyn FnOnce() -> Arc<dyn Publisher> + Send>;

/// [`run`] with the publisher supplied by the caller instead of built from the configuration
/// (benchmarks use a no-op publisher to measure the database path alone; tests use fakes).
pub async fn run_with(
    config: Config,
    publisher: Option<PublisherFactory>,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let health = Arc::new(Health::default());
    telemetry::install();
    telemetry::record_info(&config.relay.instance_id, config.publisher.kind());
    // The console is served by the metrics server: without one there is nothing to sample for.
    let console_config = config::ConsoleConfig {
        enabled: config.console.enabled && config.metrics_listen.is_some(),
        ..config.console.clone()
    };
    let console = console::Console::start(
        console_config,
        &config.outboxes,
        Arc::clone(&health),
        &config.relay.instance_id,
        &shutdown,
    );
    let server = serve_metrics(config.metrics_listen, &health, &console, &shutdown).await?;

    let publisher = match publisher {
        Some(make) => make(),
        None => publish::build(&config),
    };
    console.set_publisher(publisher.describe());
    // What the publisher says before any connect: a sink without a broker (stdout) is up from
    // the start, whatever the databases do meanwhile.
    health.set_broker(publisher.is_connected());
    if publisher.is_connected() {
        telemetry::record_broker_connected();
    }
    tracing::info!(
        instance = %config.relay.instance_id,
        outboxes = config.outboxes.len(),
        publisher = %publisher.describe(),
        batch_size = config.relay.batch_size,
        max_in_flight = config.relay.max_in_flight,
        notify = config.relay.notify,
        "outbox-relay starting"
    );
    let tracing = install_tracing(config.tracing.clone()).await?;
    let shared = outbox::SharedParts {
        publisher: Arc::clone(&publisher),
        health,
        tracing: tracing.clone(),
        console,
    };
    let failed = run_outboxes(config, shared, &shutdown).await?;
    publisher.close().await;
    if let Some(tracing) = tracing {
        let _ = tokio::task::spawn_blocking(move || tracing.shutdown()).await;
    }
    if let Some(server) = server {
        if failed.is_some() {
            shutdown.cancel();
        }
        let _ = server.await;
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    tracing::info!("outbox-relay stopped");
    Ok(())
}

/// Serves `/metrics`, `/healthz`, `/readyz` and the console on `listen` (none: no server)
/// until `shutdown`.
async fn serve_metrics(
    listen: Option<std::net::SocketAddr>,
    health: &Arc<Health>,
    console: &Arc<console::Console>,
    shutdown: &CancellationToken,
) -> Result<Option<tokio::task::JoinHandle<()>>, RunError> {
    let Some(addr) = listen else {
        return Ok(None);
    };
    let listener = telemetry::bind(addr)
        .await
        .map_err(|source| RunError::MetricsBind { addr, source })?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    if let Some(mode) = console.mode() {
        tracing::info!(url = %format!("http://{addr}/"), mode, "serving the web console");
    }
    let (health, token, routes) = (Arc::clone(health), shutdown.clone(), console.router());
    Ok(Some(tokio::spawn(async move {
        if let Err(e) = telemetry::serve(listener, health, routes, token).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    })))
}

/// The OpenTelemetry pipeline when `[tracing]` is configured, built off the async workers
/// (the HTTP exporter's client blocks).
async fn install_tracing(
    cfg: Option<config::TracingConfig>,
) -> Result<Option<otel::Tracing>, RunError> {
    let Some(cfg) = cfg else {
        return Ok(None);
    };
    let installed = tokio::task::spawn_blocking(move || otel::Tracing::install(&cfg))
        .await
        .map_err(|e| otel::OtelError::Exporter {
            endpoint: String::new(),
            reason: e.to_string(),
        })??;
    Ok(Some(installed))
}

/// Runs every outbox's loop (and the background tasks) until they all end; the error of an
/// outbox that could not run, if one could not.
async fn run_outboxes(
    config: Config,
    shared: outbox::SharedParts,
    shutdown: &CancellationToken,
) -> Result<Option<StoreError>, RunError> {
    let window = window::Window::new(config.relay.max_in_flight);
    // One pool per database: outboxes in the same database share it, and the session of
    // their instance locks.
    let stores = Store::for_outboxes(&config.outboxes, &config.relay.instance_id)?;
    let mut locks: Vec<(&str, InstanceLockSlot)> = Vec::new();
    let mut outboxes: Vec<Outbox> = Vec::new();
    for (o, store) in config.outboxes.iter().zip(stores) {
        let url = o.database.url.as_str();
        let instance_lock = match locks.iter().find(|(u, _)| *u == url) {
            Some((_, slot)) => slot.clone(),
            None => {
                let slot = InstanceLockSlot::new(o.database.redacted_url());
                locks.push((url, slot.clone()));
                slot
            }
        };
        outboxes.push(Outbox {
            config: o.clone(),
            store,
            lane: window.lane(),
            instance_lock,
        });
    }
    let tasks = Tasks::new();
    let alone = outboxes.len() == 1;
    let config = Arc::new(config);
    let mut loops = tokio::task::JoinSet::new();
    for outbox in outboxes {
        let (config, shared, tasks, shutdown) = (
            Arc::clone(&config),
            shared.clone(),
            tasks.clone(),
            shutdown.clone(),
        );
        loops.spawn(async move { outbox.run(&config, shared, &tasks, alone, shutdown).await });
    }
    drop(shared);
    let mut failed = None;
    while let Some(done) = loops.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                if matches!(e, StoreError::InstanceTaken { .. }) {
                    // Not under this id: the other outboxes stop too.
                    shutdown.cancel();
                }
                failed = Some(e);
            }
            Err(e) => tracing::error!(error = %e, "an outbox's loop panicked"),
        }
    }
    tasks.stop(TASKS_STOP_DEADLINE).await;
    Ok(failed)
}

/// An error and its causes, `outer: inner: innermost`, leaving out a cause whose text is
/// already there (tokio-postgres hides the cause of connection and TLS failures behind a
/// generic message, so a store error spells its causes out; the binary prints its last error
/// this way).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut root = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        root = s.to_string();
        source = s.source();
    }
    let mut out = e.to_string();
    let mut source = e.source();
    // Once the innermost cause is said, the causes left only say it again in other words.
    while let Some(s) = source.filter(|_| root.is_empty() || !out.contains(&root)) {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    without_repeats(&out)
}

/// `text` with a `: `-separated part that repeats the one before it left out (drivers wrap
/// an error in one of the same words: "Input/output error: Input/output error: …").
fn without_repeats(text: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in text.split(": ") {
        if parts.last() != Some(&part) {
            parts.push(part);
        }
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn a_cause_already_spelled_out_is_not_repeated() {
        let inner = std::io::Error::other("connection refused");
        let e = anyhow::Error::new(inner).context("cannot connect: connection refused");
        assert_eq!(
            super::error_chain(e.as_ref()),
            "cannot connect: connection refused"
        );
        let e = anyhow::anyhow!("bad row").context("relay stopped");
        assert_eq!(super::error_chain(e.as_ref()), "relay stopped: bad row");
        // A pool's error wrapping the driver's, each spelling out the same root in other
        // words, and a driver that wraps an error in one of the same words: the root once.
        let root = std::io::Error::other("Connection refused (os error 111)");
        let e = anyhow::Error::new(root)
            .context("error connecting to server: error connecting to server: Connection refused (os error 111)")
            .context("cannot get a database connection: error connecting to server: Connection refused (os error 111)")
            .context("cannot read t");
        assert_eq!(
            super::error_chain(e.as_ref()),
            "cannot read t: cannot get a database connection: error connecting to server: Connection refused (os error 111)"
        );
        let e = anyhow::anyhow!("Input/output error: Input/output error: Connection refused")
            .context("cannot read t");
        assert_eq!(
            super::error_chain(e.as_ref()),
            "cannot read t: Input/output error: Connection refused"
        );
    }

    /// The `.rs` files under `dir` (relative to the crate root), with their text.
    fn sources(dir: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    out.push((path.display().to_string(), text));
                }
            }
        }
        assert!(!out.is_empty(), "no sources under {dir}");
        out
    }

    /// The places under `dir` that name the module `module` (`crate::<module>`).
    fn naming(dir: &str, module: &str) -> Vec<String> {
        let needle = format!("crate::{module}");
        sources(dir)
            .into_iter()
            .flat_map(|(file, text)| {
                text.lines()
                    .enumerate()
                    .filter(|(_, line)| {
                        line.match_indices(&needle).any(|(at, _)| {
                            !line[at + needle.len()..]
                                .starts_with(|c: char| c == '_' || c.is_alphanumeric())
                        })
                    })
                    .map(|(n, line)| format!("{file}:{}: {}", n + 1, line.trim()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn imports_run_one_way() {
        // The configuration is read and validated without the transports, so a transport can
        // become optional without touching `config/`; the transports know nothing of tracing,
        // which wraps them.
        assert_eq!(naming("src/config", "publish"), Vec::<String>::new());
        assert_eq!(naming("src/publish", "otel"), Vec::<String>::new());
        // The check sees what it looks for.
        assert!(!naming("src/otel", "publish").is_empty());
    }
}
