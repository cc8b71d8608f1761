//! The built-in web console (docs/console.md), served at `/` of `metrics.listen` beside
//! `/metrics` and the health checks: per outbox, the counts by status, the lag, the last 15
//! minutes of throughput and failures, the database and broker connections and the blocked
//! aggregates; the dead letters with their errors, payloads and headers; a lookup by message id;
//! and, when `console.allow_actions` and `console.token` are set, retry and discard of dead
//! letters.
//!
//! Plain HTML rendered here ([`render`]), small charts drawn as inline SVG ([`chart`]) from a
//! ring of samples the console takes of the relay's own counters every 10 s ([`history`]), and a
//! stylesheet and a script embedded in the binary; the pages' script polls the JSON endpoints
//! of [`routes`] so the figures change in place. Nothing is fetched from elsewhere.
//!
//! Its reads stay cheap whatever the table's size: the ready, waiting and dead-letter counts,
//! the lag and the blocked aggregates are the backlog task's last figures
//! ([`OutboxMetrics::last_backlog`]); the rest is one bounded statement per outbox and refresh
//! ([`Store::console_counts`]), shared by every open page for [`COUNTS_FRESH_FOR`].

pub mod chart;
pub mod history;
pub mod render;
mod routes;

use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::config::{ConsoleConfig, Ordering, OutboxConfig};
use crate::store::{ConsoleCounts, Store, StoreError};
use crate::telemetry::{DatabaseHealth, Health, OutboxMetrics};
use history::{History, SAMPLE_EVERY, Sample};

/// How long one reading of an outbox's counts serves every page that asks: a page polls every
/// few seconds, and ten open pages must not cost ten statements.
pub const COUNTS_FRESH_FOR: Duration = Duration::from_secs(2);

/// How long a page waits for one of its reads before it says the database did not answer.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a console read gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The statement failed or no connection could be had.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// No answer within [`READ_TIMEOUT`] (a database that stalls rather than refuses).
    #[error("no answer within {}s", READ_TIMEOUT.as_secs())]
    Timeout,
}

/// `read`, or [`ReadError::Timeout`] when it takes longer than [`READ_TIMEOUT`].
async fn within<T>(
    read: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, ReadError> {
    match tokio::time::timeout(READ_TIMEOUT, read).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ReadError::Timeout),
    }
}

/// The console: what it shows of each outbox, and its settings. One per relay; the outboxes
/// register as they start ([`Console::register`]).
pub struct Console {
    config: ConsoleConfig,
    health: Arc<Health>,
    instance: String,
    // Where the relay publishes, secrets masked: known once the publisher is built.
    publisher: OnceLock<String>,
    // The outboxes' names in the configuration's order, which the pages keep (they start in
    // any order).
    order: Vec<String>,
    outboxes: RwLock<Vec<Arc<View>>>,
    // Refused actions are logged at most once a minute.
    refusals: Mutex<routes::RateLimit>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("config", &self.config)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

/// One outbox as the console sees it.
struct View {
    name: String,
    table: String,
    // The outbox's database URL with its password masked.
    database: String,
    ordering: Ordering,
    store: Store,
    metrics: OutboxMetrics,
    database_health: DatabaseHealth,
    history: Mutex<History>,
    // The last counts read and when; the lock is held while reading, so pages that ask at once
    // share one statement.
    counts: tokio::sync::Mutex<Option<(Instant, ConsoleCounts)>>,
}

impl View {
    /// The counts, read again when older than [`COUNTS_FRESH_FOR`].
    async fn counts(&self) -> Result<ConsoleCounts, ReadError> {
        let mut cached = self.counts.lock().await;
        if let Some((at, counts)) = *cached
            && at.elapsed() < COUNTS_FRESH_FOR
        {
            return Ok(counts);
        }
        let counts = within(self.store.console_counts()).await?;
        *cached = Some((Instant::now(), counts));
        Ok(counts)
    }

    /// Reads the backlog figures again now (after a retry or discard changed them) and drops
    /// the cached counts, so the next refresh shows the change.
    async fn refresh(&self) {
        match self.store.backlog(self.ordering).await {
            Ok(b) => self.metrics.backlog(&b),
            Err(e) => {
                let outbox = &self.name;
                tracing::debug!(%outbox, error = %e, "backlog not refreshed after a console action");
            }
        }
        *self.counts.lock().await = None;
    }

    fn sample(&self, now: Instant) {
        let sample = Sample {
            at: now,
            totals: self.metrics.totals(),
            lag: self.metrics.last_backlog().map(|(_, b)| b.oldest_ready_age),
        };
        self.history
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sample);
    }
}

impl Console {
    /// The console for a relay with `config` serving `outboxes`, whose health flags are
    /// `health`. When the console is on, a task samples every outbox's counters every 10 s
    /// until `shutdown`.
    pub fn start(
        config: ConsoleConfig,
        outboxes: &[OutboxConfig],
        health: Arc<Health>,
        instance: &str,
        shutdown: &CancellationToken,
    ) -> Arc<Self> {
        let console = Arc::new(Self {
            config,
            health,
            instance: instance.to_owned(),
            publisher: OnceLock::new(),
            order: outboxes.iter().map(|o| o.name.clone()).collect(),
            outboxes: RwLock::new(Vec::new()),
            refusals: Mutex::new(routes::RateLimit::new(routes::REFUSALS_LOGGED_EVERY)),
        });
        if console.config.enabled {
            let (c, token) = (Arc::clone(&console), shutdown.clone());
            tokio::spawn(async move { c.sample_loop(token).await });
        }
        console
    }

    /// The console's routes (none when `console.enabled = false`), to serve beside
    /// `/metrics`.
    pub fn router(self: &Arc<Self>) -> axum::Router {
        if self.config.enabled {
            routes::router(Arc::clone(self))
        } else {
            axum::Router::new()
        }
    }

    /// `read-only` or `retry and discard allowed`; `None` when the console is off.
    pub fn mode(&self) -> Option<&'static str> {
        self.config
            .enabled
            .then_some(if self.config.actions_token.is_some() {
                "retry and discard allowed"
            } else {
                "read-only"
            })
    }

    /// Says where the relay publishes (secrets masked), for the overview's header.
    pub fn set_publisher(&self, description: String) {
        let _ = self.publisher.set(description);
    }

    /// Adds an outbox to the pages (in the order the outboxes start).
    pub fn register(
        &self,
        outbox: &OutboxConfig,
        store: &Store,
        metrics: &OutboxMetrics,
        database: &DatabaseHealth,
    ) {
        if !self.config.enabled {
            return;
        }
        let view = Arc::new(View {
            name: outbox.name.clone(),
            table: outbox.database.table.qualified(),
            database: outbox.database.redacted_url(),
            ordering: outbox.ordering,
            store: store.clone(),
            metrics: metrics.clone(),
            database_health: database.clone(),
            history: Mutex::new(History::default()),
            counts: tokio::sync::Mutex::new(None),
        });
        // The charts' first interval starts now.
        view.sample(Instant::now());
        let position = |name: &str| self.order.iter().position(|n| n == name);
        let mut views = self
            .outboxes
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        views.push(view);
        views.sort_by_key(|v| position(&v.name));
    }

    fn views(&self) -> Vec<Arc<View>> {
        self.outboxes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn view(&self, name: &str) -> Option<Arc<View>> {
        self.views().into_iter().find(|v| v.name == name)
    }

    async fn sample_loop(&self, shutdown: CancellationToken) {
        let mut tick =
            tokio::time::interval_at(tokio::time::Instant::now() + SAMPLE_EVERY, SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => return,
            }
            let now = Instant::now();
            for view in self.views() {
                view.sample(now);
            }
        }
    }
}
