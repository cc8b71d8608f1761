//! The instance lock, kept: for each outbox table it serves, the relay holds a lock on its
//! `relay.instance_id` and that table ([`LockSession::lock`]: an advisory lock on PostgreSQL,
//! `GET_LOCK` on MySQL) for as long as it runs.
//! Two relays with one id would renew, settle and hand back each other's rows in a table,
//! defeating crash recovery; with the lock, the second refuses to start. The locks of one
//! database's outboxes share a session of their own ([`InstanceLockSlot`]); a keeper task
//! checks it every [`CHECK_EVERY`] and, when it is lost, takes every lock again. The claim
//! loops of that database claim only while the locks are held ([`LockHeld`]): if another
//! relay took one meanwhile, they stop and the keeper says so, until it can take it back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Tasks;
use crate::backoff::{Backoff, sleep_or_cancel};
use crate::store::{LockHolder, LockSession, SessionId, Store, StoreError};

/// How often the keeper checks that the locks' session still answers.
pub const CHECK_EVERY: Duration = Duration::from_secs(5);

/// How long a starting relay keeps trying when a lock is taken before it refuses to start: a
/// relay with this id that has just stopped may hold a session the database has not ended
/// yet.
const START_GRACE: Duration = Duration::from_secs(5);

/// Whether this relay holds its instance locks in a database; the claim loops of that
/// database claim only while it does. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct LockHeld(Arc<AtomicBool>);

impl LockHeld {
    /// Whether the locks are held now.
    pub fn is_held(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self, held: bool) {
        self.0.store(held, Ordering::Release);
    }
}

/// This relay's instance locks in one database (one connection pool), shared by the outboxes
/// of that database. Clones share it.
#[derive(Clone)]
pub struct InstanceLockSlot(Arc<SlotState>);

struct SlotState {
    /// The database, its URL's password masked (for messages).
    database: String,
    held: LockHeld,
    locks: tokio::sync::Mutex<Locks>,
}

/// The session and the tables whose locks it holds.
#[derive(Default)]
struct Locks {
    /// Until the first lock is taken, and while the keeper takes them again.
    session: Option<LockSession>,
    /// A store of each table locked, in the order they were.
    tables: Vec<Store>,
}

impl InstanceLockSlot {
    /// The locks of one database, named `database` in messages.
    pub fn new(database: String) -> Self {
        Self(Arc::new(SlotState {
            database,
            held: LockHeld::default(),
            locks: tokio::sync::Mutex::new(Locks::default()),
        }))
    }

    /// Takes the lock of `store`'s table (which must exist), waiting out database outages;
    /// the first of the database also starts the keeper on `tasks` (named
    /// `instance-lock:<outbox>`). Returns the flag the claim loop reads, or `None` when shut
    /// down first. An error when another relay with this id holds the table's lock for longer
    /// than a starting relay waits ([`START_GRACE`]).
    pub async fn acquire(
        &self,
        store: &Store,
        outbox: &str,
        tasks: &Tasks,
        shutdown: &CancellationToken,
    ) -> Result<Option<LockHeld>, StoreError> {
        let s = &self.0;
        let mut locks = s.locks.lock().await;
        let mut backoff = Backoff::session();
        let mut taken_since: Option<Instant> = None;
        loop {
            let delay = match self.try_lock(&mut locks, store).await {
                Ok(Ok(())) => break,
                Ok(Err(Some(holder))) => {
                    let since = *taken_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= START_GRACE {
                        return Err(taken_error(store, &s.database, &holder));
                    }
                    Duration::from_millis(500)
                }
                // Let go meanwhile: try again at once.
                Ok(Err(None)) => Duration::ZERO,
                Err(e) if e.is_connection() => {
                    locks.session = None;
                    let delay = backoff.next_delay();
                    tracing::warn!(database = %s.database, error = %e, retry_in = ?delay, "database unavailable at start; retrying");
                    delay
                }
                Err(e) => return Err(e),
            };
            if !sleep_or_cancel(delay, shutdown).await {
                return Ok(None);
            }
        }
        tracing::info!(table = %store.table(), instance = %store.instance_id(), "took the instance lock: no other relay with this relay.instance_id serves the table");
        let first = locks.tables.is_empty();
        locks.tables.push(store.clone());
        if first {
            s.held.set(true);
            let keeper = Keeper { slot: self.clone() };
            tasks.spawn(format!("instance-lock:{outbox}"), move |token| {
                keeper.run(token)
            });
        }
        Ok(Some(s.held.clone()))
    }

    /// Takes `store`'s lock on the slot's session, opening the session first if there is
    /// none.
    async fn try_lock(
        &self,
        locks: &mut Locks,
        store: &Store,
    ) -> Result<Result<(), Option<LockHolder>>, StoreError> {
        if locks.session.is_none() {
            locks.session = Some(store.bounded(store.lock_session()).await?);
        }
        let Some(session) = locks.session.as_ref() else {
            return Ok(Err(None));
        };
        store.bounded(session.lock(store)).await
    }
}

/// The sentence of a lock another relay holds.
fn taken_error(store: &Store, database: &str, holder: &LockHolder) -> StoreError {
    StoreError::InstanceTaken {
        instance: store.instance_id().to_owned(),
        table: store.table().to_string(),
        database: database.to_owned(),
        holder: holder.to_string(),
    }
}

/// Keeps a slot's locks: checks their session, takes them all again when it is lost.
struct Keeper {
    slot: InstanceLockSlot,
}

impl Keeper {
    /// Until `shutdown` (the locks' session ends with the process).
    async fn run(self, shutdown: CancellationToken) {
        let s = &self.slot.0;
        loop {
            if !sleep_or_cancel(CHECK_EVERY, &shutdown).await {
                return;
            }
            let mut locks = s.locks.lock().await;
            let (Some(session), Some(store)) = (locks.session.as_ref(), locks.tables.first())
            else {
                continue;
            };
            // A server that refused a write as read-only (a primary turned read-only, before a
            // failover) still answers: its sessions are given up all the same, this one too.
            let why = if store.stale_since(session.made()) {
                "the server refused the relay's writes as read-only".to_owned()
            } else {
                match store.bounded(session.check()).await {
                    Ok(()) => continue,
                    Err(e) => e.to_string(),
                }
            };
            s.held.set(false);
            tracing::warn!(database = %s.database, error = %why, "lost the session holding the instance locks; not claiming until they are taken again");
            let previous = session.session().clone();
            locks.session = None;
            if !self.retake(&mut locks, &previous, &shutdown).await {
                return;
            }
        }
    }

    /// Takes every lock again on a new session; `false` when shut down first. While another
    /// relay holds one, says so (once per holder) and keeps trying: claims stay stopped until
    /// that relay lets go.
    async fn retake(
        &self,
        locks: &mut Locks,
        previous: &SessionId,
        shutdown: &CancellationToken,
    ) -> bool {
        let s = &self.slot.0;
        let mut backoff = Backoff::new(Duration::from_millis(200), CHECK_EVERY);
        let mut reported: Option<SessionId> = None;
        let tables = locks.tables.clone();
        let mut done = 0;
        while done < tables.len() {
            let store = &tables[done];
            match self.slot.try_lock(locks, store).await {
                Ok(Ok(())) => {
                    done += 1;
                    continue;
                }
                Ok(Err(Some(holder))) if holder.session == *previous => {
                    tracing::debug!(database = %s.database, "the database has not ended this relay's previous session yet");
                }
                Ok(Err(Some(holder))) => {
                    if reported.as_ref() != Some(&holder.session) {
                        let e = taken_error(store, &s.database, &holder);
                        tracing::error!(error = %e, "another relay took this relay's instance lock while its session was lost: this relay does not claim until it can take the lock back");
                        reported = Some(holder.session);
                    }
                }
                Ok(Err(None)) => continue,
                Err(e) => {
                    // A new session, from the first table, next time.
                    locks.session = None;
                    done = 0;
                    tracing::debug!(database = %s.database, error = %e, "cannot take the instance locks yet");
                }
            }
            if !sleep_or_cancel(backoff.next_delay(), shutdown).await {
                return false;
            }
        }
        s.held.set(true);
        tracing::info!(database = %s.database, "took the instance locks again; claiming");
        true
    }
}
