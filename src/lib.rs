//! # outbox-relay
//!
//! A transactional outbox relay: applications insert event rows into an outbox table in the
//! same transaction as their business change; the relay publishes them to RabbitMQ or Kafka,
//! at least once, in order per aggregate.
//!
//! ## Map of the crate
//! - [`config`]: figment loading (defaults ← `relay.toml` ← `RELAY_*`) and validation, once.
//! - [`store`]: PostgreSQL — every SQL statement (claim, settle, reclaim, migrations).
//! - [`relay`]: the loop — claim → publish → settle; knows no SQL and no broker.
//! - [`watermark`]: the ordering guard's bookkeeping (which `seq` values are final).
//! - [`wakeup`]: the idle relay's waiting record, which makes inserts NOTIFY only while it waits.
//! - [`tasks`]: background services beside the loop (table vacuum).
//! - [`publish`]: the [`publish::Publisher`] trait, the wire envelope, one file per broker.
//! - [`retry`]: the backoff policy (pure).
//! - [`signing`]: the `outbox-signature` header (HMAC-SHA256 over the message's identity).
//! - [`template`]: routing-key / topic templates.
//! - [`telemetry`]: metric names, `record_*` functions, the `/metrics` + health server.
//! - [`redact`]: masking passwords before anything is logged.
//! - [`tail`]: the development consumer behind `outbox-relay tail`.
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

pub mod config;
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

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Ordering, PublisherConfig};
use crate::publish::Publisher;
use crate::publish::envelope::EnvelopeConfig;
use crate::relay::{Backoff, LoopSettings, Relay};
use crate::store::{PayloadKind, Store, StoreError};
use crate::telemetry::Health;

/// Why `run` could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The database refused a schema step (not a connection problem).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The metrics address could not be bound.
    #[error("cannot listen on metrics.listen {addr}: {source}")]
    MetricsBind {
        /// The configured address.
        addr: std::net::SocketAddr,
        /// The bind error.
        source: std::io::Error,
    },
}

/// Builds the configured publisher (not yet connected).
pub fn build_publisher(config: &Config, payload_kind: PayloadKind) -> Arc<dyn Publisher> {
    let envelope = EnvelopeConfig {
        source: config.relay.source.clone(),
        payload_kind,
        signer: config
            .signing
            .as_ref()
            .map(|s| Arc::new(signing::Signer::new(&s.key_id, &s.key))),
    };
    match &config.publisher {
        PublisherConfig::RabbitMq(c) => Arc::new(publish::rabbitmq::RabbitMqPublisher::new(
            c.clone(),
            envelope,
        )),
        PublisherConfig::Kafka(c) => {
            let mut c = c.clone();
            if config.relay.ordering == Ordering::Aggregate
                && !c.properties.contains_key("linger.ms")
                && !c.properties.contains_key("queue.buffering.max.ms")
            {
                // An aggregate's next record waits for the previous one's delivery report, so
                // librdkafka's 5 ms batching delay is paid once per record of a chain (bench,
                // 20 aggregates: 2.4k msgs/s at 5 ms, 4.8k at 1 ms).
                c.properties
                    .insert("linger.ms".to_owned(), ORDERED_LINGER_MS.to_owned());
            }
            Arc::new(publish::kafka::KafkaPublisher::new(c, envelope))
        }
        PublisherConfig::Stdout => Arc::new(publish::stdout::StdoutPublisher::new(envelope)),
    }
}

/// librdkafka `linger.ms` with `relay.ordering = "aggregate"`, unless the properties set it.
pub const ORDERED_LINGER_MS: &str = "1";

/// Runs the relay until `shutdown` is cancelled, then drains within `relay.shutdown_timeout`.
///
/// The database may be down at start or at any time: the relay waits and reconnects. Only
/// errors that retrying cannot fix (a missing table without `auto_migrate`, a payload column of
/// the wrong type, a metrics address in use) end it.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    run_with(config, None, shutdown).await
}

/// Makes the publisher once the payload column's type is known.
pub type PublisherFactory = Box<dyn FnOnce(PayloadKind) -> Arc<dyn Publisher> + Send>;

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

    let server = match config.metrics_listen {
        Some(addr) => {
            let listener = telemetry::bind(addr)
                .await
                .map_err(|source| RunError::MetricsBind { addr, source })?;
            tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
            let (health, token) = (Arc::clone(&health), shutdown.clone());
            Some(tokio::spawn(async move {
                if let Err(e) = telemetry::serve(listener, health, token).await {
                    tracing::error!(error = %e, "metrics server stopped");
                }
            }))
        }
        None => None,
    };

    let store = Store::new(&config.database, &config.relay.instance_id)?;
    let Some((payload_kind, table_oid)) =
        prepare_schema(&store, &config, &health, &shutdown).await?
    else {
        return Ok(()); // shut down while waiting for the database
    };
    let publisher = match publisher {
        Some(make) => make(payload_kind),
        None => build_publisher(&config, payload_kind),
    };
    tracing::info!(
        instance = %config.relay.instance_id,
        database = %config.database.redacted_url(),
        table = %config.database.table,
        payload = ?payload_kind,
        publisher = %publisher.describe(),
        ordering = ?config.relay.ordering,
        batch_size = config.relay.batch_size,
        max_in_flight = config.relay.max_in_flight,
        notify = config.relay.notify,
        "outbox-relay starting"
    );

    let wake = Arc::new(Notify::new());
    let background = CancellationToken::new();
    let mut helpers = Vec::new();
    let listener = wakeup::ListenerPid::default();
    let mut waiter = None;
    if config.relay.notify {
        helpers.push(tokio::spawn(listen_loop(
            config.database.url.clone(),
            config.database.table.channel(),
            Arc::clone(&wake),
            Arc::clone(&listener),
            background.clone(),
        )));
        match store.has_waiters().await {
            Ok(true) => {
                waiter = Some(wakeup::Waiter::new(
                    store.clone(),
                    listener,
                    table_oid,
                    config.relay.poll_interval,
                ));
            }
            Ok(false) => tracing::warn!(
                table = %store.table(),
                "the table predates schema version 3: every inserting transaction sends a NOTIFY, which serialises the application's commits; run `outbox-relay migrate`"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check for the wake-up table; polling only")
            }
        }
    }
    helpers.push(tokio::spawn(tasks::vacuum::vacuum_loop(
        store.clone(),
        table_oid,
        background.clone(),
    )));
    let held = relay::Held::default();
    helpers.push(tokio::spawn(relay::lease_loop(
        store.clone(),
        Arc::clone(&held),
        config.relay.lease_timeout,
        config.retry,
        Arc::clone(&wake),
        background.clone(),
    )));
    helpers.push(tokio::spawn(backlog_loop(
        store.clone(),
        waiter.is_some(),
        background.clone(),
    )));
    if !config.cleanup.retention.is_zero() {
        helpers.push(tokio::spawn(cleanup_loop(
            store.clone(),
            config.cleanup.clone(),
            background.clone(),
        )));
    }

    let settings = LoopSettings {
        relay: config.relay.clone(),
        retry: config.retry,
        delete_on_confirm: config.cleanup.retention.is_zero(),
        table_oid,
    };
    let engine = Relay::new(store, Arc::clone(&publisher), settings, health, wake, held);
    engine.run(shutdown.clone(), waiter).await;

    background.cancel();
    for h in helpers {
        let _ = h.await;
    }
    publisher.close().await;
    if let Some(server) = server {
        let _ = server.await;
    }
    tracing::info!("outbox-relay stopped");
    Ok(())
}

/// The start-up decision about the schema, shared by `run` (which acts on it) and `check`
/// (which reports it): a missing table is fine when `database.auto_migrate` will create it,
/// and an error naming the fix otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaPlan {
    /// The table exists now.
    pub table_exists: bool,
    /// Schema versions start-up applies (empty without `auto_migrate`).
    pub apply: Vec<i32>,
}

/// Decides what start-up does about the schema; an error when `run` could not start.
pub async fn plan_schema(store: &Store, auto_migrate: bool) -> Result<SchemaPlan, StoreError> {
    let state = store.schema_state().await?;
    if !state.table_exists && !auto_migrate {
        return Err(StoreError::Schema(format!(
            "table {} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true",
            store.table()
        )));
    }
    Ok(SchemaPlan {
        table_exists: state.table_exists,
        apply: if auto_migrate {
            state.pending
        } else {
            Vec::new()
        },
    })
}

/// Migrates (when configured) and inspects the table, waiting out database outages.
async fn prepare_schema(
    store: &Store,
    config: &Config,
    health: &Health,
    shutdown: &CancellationToken,
) -> Result<Option<(PayloadKind, u32)>, RunError> {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    loop {
        let attempt = async {
            let plan = plan_schema(store, config.database.auto_migrate).await?;
            if !plan.apply.is_empty() {
                let applied = store.migrate().await?;
                if !applied.is_empty() {
                    tracing::info!(table = %store.table(), versions = ?applied, "applied schema migrations");
                }
            }
            store.inspect().await
        }
        .await;
        match attempt {
            Ok(found) => {
                health.set_database(true);
                return Ok(Some(found));
            }
            Err(e) if e.is_connection() => {
                let delay = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?delay, "database unavailable at start; retrying");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = shutdown.cancelled() => return Ok(None),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// LISTENs on the table's channel on a dedicated connection and wakes the loop on every
/// NOTIFY; after a lost connection it reconnects, re-LISTENs and wakes the loop once so that
/// nothing inserted meanwhile waits for the poll. `listener` holds the session's backend pid
/// while it listens (0 otherwise): the relay's waiting record names it.
async fn listen_loop(
    url: String,
    channel: String,
    wake: Arc<Notify>,
    listener: wakeup::ListenerPid,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
    while !shutdown.is_cancelled() {
        let session = async {
            let pg = store::pg_config(&url)?;
            if store::tls_required(&pg) {
                listen_session(
                    &pg,
                    store::make_tls()?,
                    &channel,
                    &wake,
                    &listener,
                    &shutdown,
                )
                .await
            } else {
                listen_session(
                    &pg,
                    tokio_postgres::NoTls,
                    &channel,
                    &wake,
                    &listener,
                    &shutdown,
                )
                .await
            }
        }
        .await;
        listener.store(0, std::sync::atomic::Ordering::Release);
        let delay = backoff.next_delay();
        match session {
            Ok(None) => return,
            Ok(Some(err)) => {
                tracing::warn!(error = ?err, retry_in = ?delay, "LISTEN connection lost; polling until it is back");
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot LISTEN for notifications; polling meanwhile");
            }
        }
        sleep_or(delay, &shutdown).await;
    }
}

/// One LISTEN connection: `Ok(None)` on shutdown, `Ok(Some(reason))` when it was lost.
async fn listen_session<T>(
    pg: &tokio_postgres::Config,
    tls: T,
    channel: &str,
    wake: &Arc<Notify>,
    listener: &wakeup::ListenerPid,
    shutdown: &CancellationToken,
) -> Result<Option<String>, StoreError>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    use futures::StreamExt;
    use tokio_postgres::AsyncMessage;

    let (client, mut conn) = pg.connect(tls).await?;
    let (tx, mut closed) = tokio::sync::oneshot::channel::<String>();
    let wake_on_notify = Arc::clone(wake);
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        let mut reason = "connection closed".to_owned();
        while let Some(msg) = messages.next().await {
            match msg {
                Ok(AsyncMessage::Notification(_)) => wake_on_notify.notify_one(),
                Ok(_) => {}
                Err(e) => {
                    reason = e.to_string();
                    break;
                }
            }
        }
        let _ = tx.send(reason);
    });
    client
        .batch_execute(&format!("LISTEN \"{channel}\""))
        .await?;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .try_get(0)?;
    listener.store(pid, std::sync::atomic::Ordering::Release);
    tracing::debug!(%channel, pid, "listening for NOTIFY");
    wake.notify_one();
    let ended = tokio::select! {
        r = &mut closed => Some(r.unwrap_or_else(|_| "connection task ended".to_owned())),
        () = shutdown.cancelled() => None,
    };
    drop(client);
    Ok(ended)
}

async fn sleep_or(d: Duration, token: &CancellationToken) {
    tokio::select! {
        () = tokio::time::sleep(d) => {}
        () = token.cancelled() => {}
    }
}

/// Refreshes the backlog gauges every 5 s, and deletes the waiting records of relays that
/// died (`clean_waiters`).
async fn backlog_loop(store: Store, clean_waiters: bool, shutdown: CancellationToken) {
    loop {
        if clean_waiters {
            match store.clean_waiters().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    records = n,
                    "deleted the waiting records of relays that stopped"
                ),
                Err(e) => tracing::debug!(error = %e, "stale waiting records not cleaned"),
            }
        }
        match store.backlog().await {
            Ok(b) => telemetry::record_backlog(&b),
            Err(e) if e.is_connection() => {
                tracing::debug!(error = %e, "backlog gauges not refreshed")
            }
            Err(e) => tracing::warn!(error = %e, "backlog gauges not refreshed"),
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// Deletes `sent` rows older than `cleanup.retention`, a batch at a time, every
/// `cleanup.interval`. `failed` rows are never deleted automatically.
async fn cleanup_loop(store: Store, cfg: config::CleanupConfig, shutdown: CancellationToken) {
    loop {
        let mut total = 0u64;
        loop {
            match store.cleanup_batch(cfg.retention, cfg.batch_size).await {
                Ok(n) => {
                    total += n;
                    if n < cfg.batch_size as u64 || shutdown.is_cancelled() {
                        break;
                    }
                }
                Err(e) => {
                    if e.is_connection() {
                        tracing::debug!(error = %e, "retention cleanup skipped");
                    } else {
                        tracing::warn!(error = %e, "retention cleanup failed");
                    }
                    break;
                }
            }
        }
        if total > 0 {
            tracing::info!(deleted = total, retention = ?cfg.retention, "deleted sent rows past retention (and expired rows as long past their deadline)");
        }
        tokio::select! {
            () = tokio::time::sleep(cfg.interval) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use figment::Figment;
    use figment::providers::{Format, Serialized, Toml};

    use super::*;
    use crate::config::RawConfig;

    fn kafka_config(ordering: &str, properties: &str) -> Config {
        let toml = format!(
            "[relay]\nordering = \"{ordering}\"\n[publisher]\nkind = \"kafka\"\n\
             [publisher.kafka.properties]\n{properties}\n"
        );
        let raw: RawConfig = Figment::from(Serialized::defaults(RawConfig::default()))
            .merge(Toml::string(&toml))
            .extract()
            .unwrap();
        raw.validate().unwrap()
    }

    #[test]
    fn ordered_kafka_lingers_one_millisecond_unless_told_otherwise() {
        let describe = |c: &Config| build_publisher(c, PayloadKind::Json).describe();
        assert!(describe(&kafka_config("aggregate", "")).contains("linger.ms=1"));
        let own = describe(&kafka_config("aggregate", "\"linger.ms\" = \"20\""));
        assert!(
            own.contains("linger.ms=20") && !own.contains("linger.ms=1,"),
            "{own}"
        );
        let alias = describe(&kafka_config(
            "aggregate",
            "\"queue.buffering.max.ms\" = \"9\"",
        ));
        assert!(!alias.contains("linger.ms"), "{alias}");
        assert!(!describe(&kafka_config("none", "")).contains("linger.ms"));
    }
}
