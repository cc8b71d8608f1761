//! The relay's side of the wake-up (schema version 3): an idle relay records in
//! `<table>_waiters` that it waits, and the insert trigger NOTIFYs only while such a record is
//! alive, once per transaction. A busy relay has no record, so the application's commits pay no
//! NOTIFY (PostgreSQL serialises the commits of notifying transactions). Nor does one that
//! found rows less than `LINGER` ago: it keeps claiming on a short delay instead, so a relay
//! keeping up with a steady writer never publishes its record.
//!
//! The race between the relay's last empty claim and its sleep is closed in two steps: the
//! relay first publishes its record, then checks that no transaction which might have passed its
//! (commit-time) check before the record existed is still running, and claims once more. While
//! such a transaction runs, the relay rechecks on a doubling delay (2 ms up to 250 ms)
//! instead of sleeping the whole poll interval. Only an application transaction in
//! REPEATABLE READ or SERIALIZABLE that took its snapshot before the record but inserted after
//! the check can still go unnoticed; `relay.poll_interval` bounds that wait (with ordering
//! `aggregate`, about 5 s plus one poll: an armed relay's polls reuse the last watermark for
//! up to 5 s).
//!
//! A relay that dies while waiting leaves its record behind: the trigger ignores records past
//! their `alive_until` (renewed while the relay waits), and live relays delete records whose
//! LISTEN session has ended ([`crate::store::Store::clean_waiters`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use crate::backoff::doubled;
use crate::store::PgStore;

/// The backend pid of the relay's LISTEN session, 0 while it is not listening.
pub type ListenerPid = Arc<AtomicI32>;

/// First delay between rechecks while a writer that may have missed the record runs: about
/// one commit's WAL flush, the time a transaction spends between its check and its commit.
const FIRST_RECHECK: Duration = Duration::from_millis(2);

/// Longest delay between rechecks. A transaction in READ COMMITTED that is still in its body
/// will see the record at commit and notify; rechecks only catch the rare one that cannot.
const LAST_RECHECK: Duration = Duration::from_millis(250);

/// How long after its last rows the relay keeps claiming on a short, doubling delay before it
/// publishes its record. A steady writer's next row comes within this, so the relay that keeps
/// up with it is never marked waiting, and the application's commits pay no NOTIFY (each would
/// take PostgreSQL's commit-wide notify lock). About 20 empty claims per linger; a row that
/// comes meanwhile waits at most `LINGER_LAST_STEP` for its claim.
const LINGER: Duration = Duration::from_millis(200);
/// The first delay between claims while lingering: a few commits at a moderate rate.
const LINGER_FIRST_STEP: Duration = Duration::from_millis(2);
/// The longest delay between claims while lingering.
const LINGER_LAST_STEP: Duration = Duration::from_millis(10);
/// The delay between claims while rows flow and batches are in flight: a row committed
/// meanwhile waits at most this for its claim instead of a whole publish → confirm → settle
/// cycle. After a claim that found rows, settled batches do not cut it short, so a relay
/// keeping up with a steady writer claims at most 200 times a second, however many batches it
/// settles.
const FLOWING_STEP: Duration = Duration::from_millis(5);
/// The step once a claim brings `FLOWING_MANY` rows or more: at such rates a claim every
/// 10 ms still waits only a few ms per row, and half the claims cost the database (and the
/// application beside it) half as much.
const FLOWING_STEP_MANY: Duration = Duration::from_millis(10);
/// See `FLOWING_STEP_MANY`.
const FLOWING_MANY: usize = 16;

/// What the loop should do after an empty claim with nothing in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// Claim again at once (the record was just published).
    Recheck,
    /// Wait this long for a NOTIFY, a finished batch or the shutdown.
    Sleep(Duration),
}

/// Where the relay is in the protocol.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// No record: inserts do not notify on this relay's account.
    Busy,
    /// Record published under `pid` at `at`; not yet proven that nothing was missed. `writers`
    /// is what the check before the last claim found (`None`: check again before the next).
    Verifying {
        pid: i32,
        at: Instant,
        writers: Option<bool>,
        next: Duration,
    },
    /// Record published under `pid` at `at`, nothing missed: sleep until woken.
    Armed { pid: i32, at: Instant },
}

/// One relay's waiting record for one outbox table.
pub struct Waiter {
    store: PgStore,
    listener: ListenerPid,
    table_oid: u32,
    poll: Duration,
    // How long a record stays alive without renewal: a few polls, so a relay that died stops
    // costing NOTIFYs within seconds, while a live one renews it every few polls.
    lifetime: Duration,
    state: State,
    // When a claim last found rows (`found_rows`), and the next delay while lingering.
    last_busy: Option<Instant>,
    linger_step: Duration,
    // How many rows the last claim that found any brought (for `flowing`).
    last_found: usize,
}

impl Waiter {
    /// A waiter for the table `table_oid` whose LISTEN session reports its pid in `listener`.
    pub fn new(store: PgStore, listener: ListenerPid, table_oid: u32, poll: Duration) -> Self {
        Self {
            store,
            listener,
            table_oid,
            poll,
            lifetime: lifetime(poll),
            state: State::Busy,
            last_busy: None,
            linger_step: LINGER_FIRST_STEP,
            last_found: 0,
        }
    }

    /// Called before each claim: while verifying, checks for writers that may have missed the
    /// record (this must precede the claim it vouches for).
    pub async fn before_claim(&mut self) {
        if let State::Verifying {
            writers: writers @ None,
            ..
        } = &mut self.state
        {
            let store = &self.store;
            *writers = match store.bounded(store.writers_active(self.table_oid)).await {
                Ok(active) => Some(active),
                Err(e) => {
                    tracing::debug!(error = %e, "wake-up recheck failed");
                    None
                }
            };
        }
    }

    /// The claim found `n` rows: drop the record ([`Waiter::busy`]), and linger after the
    /// last rows before publishing it again.
    pub async fn found_rows(&mut self, n: usize) {
        self.last_busy = Some(Instant::now());
        self.last_found = n;
        self.linger_step = LINGER_FIRST_STEP;
        self.busy().await;
    }

    /// Whether the record is published, verified and alive, under the LISTEN session still
    /// open: every insert committed from now on by a READ COMMITTED transaction NOTIFYs this
    /// relay.
    pub fn armed(&self) -> bool {
        matches!(self.state, State::Armed { pid, at }
            if pid == self.listener.load(Ordering::Acquire) && at.elapsed() < self.lifetime)
    }

    /// Drops the record so that inserts stop notifying.
    pub async fn busy(&mut self) {
        if self.state == State::Busy {
            return;
        }
        self.state = State::Busy;
        tracing::trace!("busy: waiting record deleted");
        if let Err(e) = self.store.bounded(self.store.unmark_waiting()).await {
            // The record expires on its own; meanwhile inserts notify needlessly.
            tracing::debug!(error = %e, "cannot clear the waiting record");
        }
    }

    /// After a claim while batches are in flight: within `LINGER` of the last rows, the fixed
    /// step to sleep before claiming again (`FLOWING_STEP`, or `FLOWING_STEP_MANY` when the
    /// last claim brought many rows; after a claim that found rows the loop ignores settled
    /// batches meanwhile); `None` otherwise (wait for a settled batch or the poll).
    pub fn flowing(&self) -> Option<Duration> {
        let step = if self.last_found >= FLOWING_MANY {
            FLOWING_STEP_MANY
        } else {
            FLOWING_STEP
        };
        self.lingering(Instant::now()).then_some(step)
    }

    fn lingering(&self, now: Instant) -> bool {
        self.last_busy
            .is_some_and(|t| now.duration_since(t) < LINGER)
    }

    /// The claim found nothing and nothing is in flight: within `LINGER` of the last rows,
    /// sleep a short step; otherwise publish or renew the record. Says whether to claim again
    /// or how long to sleep. `jittered_poll` is the normal idle wait.
    pub async fn idle(&mut self, jittered_poll: Duration) -> Idle {
        let now = Instant::now();
        if self.lingering(now) {
            let step = self.linger_step.min(jittered_poll);
            self.linger_step = doubled(step, 1, LINGER_LAST_STEP);
            return Idle::Sleep(step);
        }
        let pid = self.listener.load(Ordering::Acquire);
        if pid == 0 {
            // Not listening: a record would only make inserts notify for nothing.
            self.busy().await;
            return Idle::Sleep(jittered_poll);
        }
        let alive = |at: Instant| now.duration_since(at) < self.lifetime;
        // Renewed once half its life is gone: a poll (jittered up to 1.1 × the interval) later
        // it still has 0.4 × the interval + 1 s to live (and a record that lapsed costs at
        // most one poll's delay: it is published again).
        let fresh = |at: Instant| now.duration_since(at) < self.lifetime / 2;
        match self.state {
            State::Armed { pid: p, at } if p == pid && fresh(at) => Idle::Sleep(jittered_poll),
            State::Armed { pid: p, at } if p == pid && alive(at) => {
                // Renewed while still alive: nothing can have been missed.
                let at = self.renew(pid, at, now).await;
                self.state = State::Armed { pid, at };
                Idle::Sleep(jittered_poll)
            }
            State::Verifying {
                pid: p,
                at,
                writers,
                next,
            } if p == pid && alive(at) => {
                let at = if fresh(at) {
                    at
                } else {
                    self.renew(pid, at, now).await
                };
                if writers == Some(false) {
                    self.state = State::Armed { pid, at };
                    Idle::Sleep(jittered_poll)
                } else {
                    self.state = State::Verifying {
                        pid,
                        at,
                        writers: None,
                        next: doubled(next, 1, self.poll.min(LAST_RECHECK)),
                    };
                    Idle::Sleep(next)
                }
            }
            // Busy, a new LISTEN session, or a record that may have expired: publish it.
            _ => self.publish(pid, now, jittered_poll).await,
        }
    }

    /// Publishes the waiting record for LISTEN session `pid` and reads whether writers are
    /// active: recheck soon (they may have inserted before seeing it), or poll when that fails.
    async fn publish(&mut self, pid: i32, now: Instant, jittered_poll: Duration) -> Idle {
        let store = &self.store;
        let published = store
            .bounded(store.mark_waiting_then_writers(pid, self.lifetime, self.table_oid))
            .await;
        match published {
            Ok(active) => {
                tracing::trace!(pid, writers = active, "idle: waiting record published");
                self.state = State::Verifying {
                    pid,
                    at: now,
                    writers: Some(active),
                    next: FIRST_RECHECK,
                };
                Idle::Recheck
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot publish the waiting record; polling");
                self.state = State::Busy;
                Idle::Sleep(jittered_poll)
            }
        }
    }

    /// Extends the record; returns when it was renewed (`at` unchanged when that failed).
    async fn renew(&self, pid: i32, at: Instant, now: Instant) -> Instant {
        let store = &self.store;
        match store.bounded(store.mark_waiting(pid, self.lifetime)).await {
            Ok(()) => now,
            Err(e) => {
                tracing::debug!(error = %e, "cannot renew the waiting record");
                at
            }
        }
    }
}

/// How long a waiting record lives without renewal: three polls plus two seconds.
pub fn lifetime(poll: Duration) -> Duration {
    poll * 3 + Duration::from_secs(2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DatabaseConfig, DatabaseKind, TableName};

    /// A waiter whose store never connects (nothing here reaches the database).
    fn waiter() -> Waiter {
        let cfg = DatabaseConfig {
            url: "postgres://u@127.0.0.1:1/none".into(),
            kind: DatabaseKind::Postgres,
            pool_size: 1,
            table: TableName::parse("t").unwrap_or_else(|e| panic!("{e}")),
            auto_migrate: false,
            partition_interval: None,
            query_timeout: Duration::from_secs(30),
        };
        let store = PgStore::new(&cfg, "test").unwrap_or_else(|e| panic!("{e}"));
        Waiter::new(store, ListenerPid::default(), 1, Duration::from_secs(1))
    }

    #[tokio::test]
    async fn flowing_steps_follow_the_last_claim_and_end_with_the_linger() {
        let mut w = waiter();
        assert_eq!(w.flowing(), None, "no rows yet");
        w.found_rows(3).await;
        assert_eq!(w.flowing(), Some(FLOWING_STEP));
        w.found_rows(FLOWING_MANY).await;
        assert_eq!(w.flowing(), Some(FLOWING_STEP_MANY));
        w.found_rows(1).await;
        assert_eq!(w.flowing(), Some(FLOWING_STEP), "the last claim decides");
        w.last_busy = Instant::now().checked_sub(LINGER);
        assert_eq!(w.flowing(), None, "the linger is over");
        assert!(!w.armed(), "never published");
    }

    #[test]
    fn lifetime_outlives_renewal() {
        let poll = Duration::from_secs(1);
        // Renewed after half of it: a late (jittered) poll still finds it alive, by a second.
        for poll in [poll, Duration::from_millis(200), Duration::from_secs(30)] {
            let renewed_by = lifetime(poll) / 2 + poll.mul_f64(1.1);
            assert!(
                renewed_by + Duration::from_secs(1) <= lifetime(poll),
                "{poll:?}"
            );
        }
        assert_eq!(
            lifetime(Duration::from_millis(200)),
            Duration::from_millis(2600)
        );
    }
}
