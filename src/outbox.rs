//! One outbox: its table's start-up (schema plan, migration, inspection, waiting out its
//! database), its claim loop ([`crate::relay`]) and the background tasks that serve that table
//! ([`crate::tasks`]). [`crate::run`] starts one per configured outbox; they share the
//! publisher, the in-flight window ([`crate::window`]), the health flags and (per database)
//! the connection pool, and nothing else: one outbox's database being down, its table missing
//! or a burst in it does not hold the others up.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::config::{Config, OutboxConfig};
use crate::message::PayloadKind;
use crate::publish::Publisher;
use crate::publish::envelope::EnvelopeConfig;
use crate::relay::{LoopSettings, Relay, RelayParts};
use crate::store::{OnConfirm, PgStore, Store, StoreError};
use crate::tasks::instance::InstanceLockSlot;
use crate::tasks::lease::Held;
use crate::tasks::{Tasks, backlog, cleanup, lease, listen, partitions, vacuum};
use crate::telemetry::{DatabaseHealth, Health, OutboxMetrics};
use crate::wakeup::{ListenerPid, Waiter};
use crate::window::Lane;

/// With several outboxes, how often one whose table cannot be used (missing without
/// `auto_migrate`, wrong payload type) is looked at again while the others run.
const SCHEMA_RETRY: Duration = Duration::from_secs(30);

/// What every outbox of the relay shares.
#[derive(Clone)]
pub struct SharedParts {
    /// The publisher.
    pub publisher: Arc<dyn Publisher>,
    /// The process's health flags.
    pub health: Arc<Health>,
    /// The tracer when tracing is on.
    pub tracing: Option<crate::otel::Tracing>,
    /// The web console, which shows every outbox.
    pub console: Arc<crate::console::Console>,
}

/// An outbox table to relay.
pub struct Outbox {
    /// Its configuration.
    pub config: OutboxConfig,
    /// Its table (sharing the pool of its database).
    pub store: Store,
    /// Its share of the in-flight window.
    pub lane: Lane,
    /// The instance locks of its database (shared with the outboxes of the same database).
    pub instance_lock: InstanceLockSlot,
}

impl Outbox {
    /// Waits for the table to be usable (migrating it when configured), takes its instance
    /// lock, starts its background tasks on `tasks` (named `<task>:<outbox>`), then runs its
    /// claim loop until `shutdown` and its drain. The tasks keep running: the caller stops
    /// them with [`Tasks::stop`].
    ///
    /// An error when another relay with this relay's `relay.instance_id` serves the table
    /// ([`StoreError::InstanceTaken`]: the relay stops), or when the table can never
    /// be used as configured and `alone` (the relay's only outbox): the relay then stops with
    /// it. Beside other outboxes the latter is logged and the table looked at again every 30 s.
    pub async fn run(
        self,
        config: &Config,
        shared: SharedParts,
        tasks: &Tasks,
        alone: bool,
        shutdown: CancellationToken,
    ) -> Result<(), StoreError> {
        let Self {
            config: outbox,
            store,
            lane,
            instance_lock,
        } = self;
        let metrics = OutboxMetrics::new(&outbox.name);
        let database = shared.health.database_slot(&outbox.name);
        shared
            .console
            .register(&outbox, &store, &metrics, &database);
        let Some((payload_kind, table_oid)) =
            prepare(&store, &outbox, config, &database, alone, &shutdown).await?
        else {
            return Ok(()); // shut down before the table could be used
        };
        let lock = instance_lock.acquire(&store, &outbox.name, tasks, &shutdown);
        let Some(lock_held) = lock.await? else {
            return Ok(()); // shut down before the lock could be taken
        };
        tracing::info!(
            outbox = %outbox.name,
            database = %outbox.database.redacted_url(),
            table = %outbox.database.table,
            payload = ?payload_kind,
            ordering = ?outbox.ordering,
            route = outbox.route.as_ref().map_or("as the publisher's", |r| r.as_str()),
            "relaying outbox"
        );
        let Services { waiter, held, wake } =
            start_services(tasks, &outbox, &store, &metrics, config, table_oid).await;
        let envelope = EnvelopeConfig::for_outbox(config, &outbox, payload_kind);
        let engine = Relay::new(RelayParts {
            store,
            publisher: shared.publisher,
            envelope,
            settings: loop_settings(config, &outbox, table_oid),
            health: shared.health,
            database,
            metrics,
            lane,
            wake,
            held,
            lock_held,
            tracer: shared.tracing.as_ref().map(|t| t.for_outbox(&outbox.name)),
        });
        engine.run(shutdown, waiter).await;
        Ok(())
    }
}

/// What the claim loop shares with an outbox's background services.
struct Services {
    /// The NOTIFY wake-up's waiting record (PostgreSQL, `relay.notify`).
    waiter: Option<Waiter>,
    /// The rows in flight, whose leases the lease task renews.
    held: Held,
    /// Wakes the claim loop (a notification, rows handed back).
    wake: Arc<Notify>,
}

/// Starts `outbox`'s background services on `tasks` (named `<task>:<outbox>`): PostgreSQL's
/// VACUUM and NOTIFY wake-up (a MySQL outbox is woken by its poll and purged by InnoDB),
/// lease renewal and reclaim, the backlog gauges and retention.
async fn start_services(
    tasks: &Tasks,
    outbox: &OutboxConfig,
    store: &Store,
    metrics: &OutboxMetrics,
    config: &Config,
    table_oid: u32,
) -> Services {
    let name = |task: &str| format!("{task}:{}", outbox.name);
    let wake = Arc::new(Notify::new());
    let waiter = match store.as_postgres() {
        Some(pg) => {
            let (s, m) = (pg.clone(), metrics.clone());
            tasks.spawn(name("vacuum"), move |token| {
                vacuum::vacuum_loop(s, m, table_oid, token)
            });
            if config.relay.notify {
                listen(tasks, outbox, pg, table_oid, config, &wake).await
            } else {
                None
            }
        }
        None => None,
    };
    let held = Held::default();
    let (s, m, h, w) = (
        store.clone(),
        metrics.clone(),
        held.clone(),
        Arc::clone(&wake),
    );
    let (lease_timeout, retry) = (config.relay.lease_timeout, config.retry);
    tasks.spawn(name("lease"), move |token| {
        lease::lease_loop(s, m, h, lease_timeout, retry, w, token)
    });
    let (s, m, clean_waiters) = (store.clone(), metrics.clone(), waiter.is_some());
    let ordering = outbox.ordering;
    tasks.spawn(name("backlog"), move |token| {
        backlog::backlog_loop(s, m, ordering, clean_waiters, token)
    });
    spawn_retention(tasks, store, metrics, config, name).await;
    Services { waiter, held, wake }
}

/// The claim loop's settings for `outbox`: the relay's, with the outbox's own ordering and
/// source.
fn loop_settings(config: &Config, outbox: &OutboxConfig, table_oid: u32) -> LoopSettings {
    let mut relay = config.relay.clone();
    relay.ordering = outbox.ordering;
    relay.source = outbox.source.clone();
    LoopSettings {
        relay,
        retry: config.retry,
        on_confirm: if config.cleanup.retention.is_zero() {
            OnConfirm::Delete
        } else {
            OnConfirm::MarkSent
        },
        table_oid,
    }
}

/// Starts the LISTEN session's task (`listen:<outbox>`), which wakes the loop through `wake`,
/// and returns the idle relay's waiter when the table has the wake-up record.
async fn listen(
    tasks: &Tasks,
    outbox: &OutboxConfig,
    store: &PgStore,
    table_oid: u32,
    config: &Config,
    wake: &Arc<Notify>,
) -> Option<Waiter> {
    let listener = ListenerPid::default();
    let configured = store.table().channel();
    // Listen where the trigger notifies: a table migrated as `t` and configured as `public.t`
    // would otherwise never wake the relay, which would fall back to polling unsaid.
    let channel = match store.bounded(store.notify_channel()).await {
        Ok(Some(made)) if made != configured => {
            tracing::warn!(table = %store.table(), trigger_channel = %made, "the table's wake-up trigger notifies the channel named after the table as it was written when it was migrated, not as it is configured now; listening on the trigger's channel (write database.table as it was migrated to make them one)");
            made
        }
        _ => configured,
    };
    let url = outbox.database.url.clone();
    let (wake, pid) = (Arc::clone(wake), Arc::clone(&listener));
    let stale = store.stale_sessions().clone();
    let timeout = store.query_timeout();
    tasks.spawn(format!("listen:{}", outbox.name), move |token| {
        listen::listen_loop(url, channel, timeout, wake, pid, stale, token)
    });
    wake_up_waiter(store, listener, table_oid, config).await
}

/// Starts the table's retention: the partition work for a partitioned table (or one that
/// `database.partition_interval` asks for), else the row clean-up unless rows are deleted on
/// confirm.
async fn spawn_retention(
    tasks: &Tasks,
    store: &Store,
    metrics: &OutboxMetrics,
    config: &Config,
    name: impl Fn(&str) -> String,
) {
    let cfg = config.cleanup.clone();
    if let Some(pg) = store.as_postgres() {
        let partitioned = pg
            .bounded(pg.layout())
            .await
            .ok()
            .flatten()
            .is_some_and(|l| l.partitioned);
        if partitioned || pg.partition_interval().is_some() {
            let (s, m) = (pg.clone(), metrics.clone());
            tasks.spawn(name("partitions"), move |token| {
                partitions::partitions_loop(s, m, cfg, token)
            });
            return;
        }
    }
    let s = store.clone();
    if !config.cleanup.retention.is_zero() {
        tasks.spawn(name("cleanup"), move |token| {
            cleanup::cleanup_loop(s, cfg, token)
        });
    }
}

/// Migrates (when configured) and inspects the table, waiting out database outages; `None`
/// when shut down first.
async fn prepare(
    store: &Store,
    outbox: &OutboxConfig,
    config: &Config,
    database: &DatabaseHealth,
    alone: bool,
    shutdown: &CancellationToken,
) -> Result<Option<(PayloadKind, u32)>, StoreError> {
    let mut backoff = Backoff::session();
    loop {
        // Migrations are not bounded: an index build on a large table may take long.
        let attempt = async {
            let plan = store.plan_schema(config.database.auto_migrate);
            let plan = store.bounded(plan).await?;
            if !plan.behind.is_empty() {
                tracing::warn!(outbox = %outbox.name, table = %store.table(), versions = ?plan.behind, "schema versions not applied to the table (database.auto_migrate is off): run `outbox-relay migrate`");
            }
            if !plan.apply.is_empty() || plan.partition {
                let applied = store.migrate().await?;
                if !applied.is_empty() {
                    tracing::info!(outbox = %outbox.name, table = %store.table(), versions = ?applied, "applied schema migrations");
                }
            }
            store.bounded(store.inspect()).await
        }
        .await;
        let delay = match attempt {
            Ok(found) => {
                database.set(true);
                return Ok(Some(found));
            }
            Err(e) if e.is_connection() => {
                let delay = backoff.next_delay();
                tracing::warn!(outbox = %outbox.name, error = %e, retry_in = ?delay, "database unavailable at start; retrying");
                delay
            }
            // A long transaction holds the table: the application's inserts must not queue
            // behind the migration, so it gave up; try again later rather than exit.
            Err(e @ StoreError::Locked(_)) => {
                tracing::warn!(outbox = %outbox.name, error = %e, retry_in = ?SCHEMA_RETRY, "schema migration postponed");
                SCHEMA_RETRY
            }
            Err(e) if alone => return Err(e),
            Err(e) => {
                tracing::error!(outbox = %outbox.name, error = %e, retry_in = ?SCHEMA_RETRY, "this outbox cannot start; the others run meanwhile");
                database.cannot_start(e.to_string());
                SCHEMA_RETRY
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = shutdown.cancelled() => return Ok(None),
        }
    }
}

/// The idle relay's waiting record, when the table has the wake-up of schema version 3.
async fn wake_up_waiter(
    store: &PgStore,
    listener: ListenerPid,
    table_oid: u32,
    config: &Config,
) -> Option<Waiter> {
    match store.bounded(store.has_waiters()).await {
        Ok(true) => Some(Waiter::new(
            store.clone(),
            listener,
            table_oid,
            config.relay.poll_interval,
        )),
        Ok(false) => {
            tracing::warn!(
                table = %store.table(),
                "the table predates schema version 3: every inserting transaction sends a NOTIFY, which serialises the application's commits; run `outbox-relay migrate`"
            );
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot check for the wake-up table; polling only");
            None
        }
    }
}
