//! One outbox table's relay: its claim loop ([`crate::relay`]) and the background tasks that
//! serve that table ([`crate::tasks`]), started once the table's schema is known and the
//! publisher built. [`crate::run`] starts one; relaying several tables from one process would
//! start one per table on the same [`Tasks`].

use std::sync::Arc;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::publish::Publisher;
use crate::relay::{LoopSettings, Relay};
use crate::store::Store;
use crate::tasks::lease::Held;
use crate::tasks::{Tasks, backlog, cleanup, lease, listen, vacuum};
use crate::telemetry::Health;
use crate::wakeup::{ListenerPid, Waiter};

/// An outbox table ready to be relayed.
pub struct Outbox {
    /// The table's store.
    pub store: Store,
    /// The table's oid (from [`Store::inspect`]).
    pub table_oid: u32,
    /// Where its messages go.
    pub publisher: Arc<dyn Publisher>,
}

impl Outbox {
    /// Starts the table's background tasks on `tasks` (named `<task>:<table>`), then runs its
    /// claim loop until `shutdown` and its drain. The tasks keep running: the caller stops
    /// them with [`Tasks::stop`].
    pub async fn run(
        self,
        config: &Config,
        health: Arc<Health>,
        tasks: &Tasks,
        shutdown: CancellationToken,
    ) {
        let Self {
            store,
            table_oid,
            publisher,
        } = self;
        let table = store.table().to_string();
        let name = |task: &str| format!("{task}:{table}");
        let wake = Arc::new(Notify::new());

        let mut waiter = None;
        if config.relay.notify {
            let listener = ListenerPid::default();
            let (url, channel) = (config.database.url.clone(), store.table().channel());
            let (wake, pid) = (Arc::clone(&wake), Arc::clone(&listener));
            tasks.spawn(name("listen"), move |token| {
                listen::listen_loop(url, channel, wake, pid, token)
            });
            waiter = wake_up_waiter(&store, listener, table_oid, config).await;
        }
        let s = store.clone();
        tasks.spawn(name("vacuum"), move |token| {
            vacuum::vacuum_loop(s, table_oid, token)
        });
        let held = Held::default();
        let (s, h, w) = (store.clone(), held.clone(), Arc::clone(&wake));
        let (lease_timeout, retry) = (config.relay.lease_timeout, config.retry);
        tasks.spawn(name("lease"), move |token| {
            lease::lease_loop(s, h, lease_timeout, retry, w, token)
        });
        let (s, clean_waiters) = (store.clone(), waiter.is_some());
        tasks.spawn(name("backlog"), move |token| {
            backlog::backlog_loop(s, clean_waiters, token)
        });
        if !config.cleanup.retention.is_zero() {
            let (s, cfg) = (store.clone(), config.cleanup.clone());
            tasks.spawn(name("cleanup"), move |token| {
                cleanup::cleanup_loop(s, cfg, token)
            });
        }

        let settings = LoopSettings {
            relay: config.relay.clone(),
            retry: config.retry,
            delete_on_confirm: config.cleanup.retention.is_zero(),
            table_oid,
        };
        let engine = Relay::new(store, publisher, settings, health, wake, held);
        engine.run(shutdown, waiter).await;
    }
}

/// The idle relay's waiting record, when the table has the wake-up of schema version 3.
async fn wake_up_waiter(
    store: &Store,
    listener: ListenerPid,
    table_oid: u32,
    config: &Config,
) -> Option<Waiter> {
    match store.has_waiters().await {
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
