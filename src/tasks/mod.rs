//! Background services that run beside the claim loop, one file each (like River's
//! `internal/maintenance/`):
//! - [`instance`]: the instance locks on `relay.instance_id` and each table, kept (claims
//!   stop without them);
//! - [`listen`]: the LISTEN session that wakes the loop on NOTIFY;
//! - [`lease`]: renewing this relay's leases ([`lease::Held`]) and reclaiming expired ones;
//! - [`backlog`]: the backlog gauges and stale waiting records;
//! - [`cleanup`]: retention of `sent` and `expired` rows;
//! - [`partitions`]: a partitioned table's partitions ahead and retention by dropping them;
//! - [`vacuum`]: vacuuming the table when autovacuum does not keep up.
//!
//! They run under names on one [`Tasks`] tracker; at shutdown [`Tasks::stop`] cancels them,
//! waits up to a deadline and names the ones that did not stop. The backlog and vacuum checks
//! slow down while their outbox is idle ([`Pace`]).

pub mod backlog;
pub mod cleanup;
pub mod instance;
pub mod lease;
pub mod listen;
pub mod partitions;
pub mod vacuum;

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::telemetry::OutboxMetrics;

/// How often a periodic check runs while its outbox is idle (no rows claimed since the last
/// run, nothing found that needs watching): with twenty idle outboxes, checks every few
/// seconds are most of what an idle relay does.
pub const IDLE_EVERY: Duration = Duration::from_secs(30);

/// Paces a check that runs every few seconds while its outbox has traffic and every
/// [`IDLE_EVERY`] while it is idle. Ask [`Pace::due`] on each tick.
#[derive(Debug)]
pub struct Pace {
    metrics: OutboxMetrics,
    claimed: u64,
    last: Option<Instant>,
}

impl Pace {
    /// A pace whose first [`Pace::due`] is true.
    pub fn new(metrics: OutboxMetrics) -> Self {
        Self {
            claimed: metrics.rows_claimed(),
            metrics,
            last: None,
        }
    }

    /// Whether the check should run now: the first time, when rows were claimed since the
    /// last run, when `watching` (the last run found something worth following closely), or
    /// when `IDLE_EVERY` has passed. A `true` counts as a run.
    pub fn due(&mut self, watching: bool, now: Instant) -> bool {
        let claimed = self.metrics.rows_claimed();
        let due = watching
            || claimed != self.claimed
            || self
                .last
                .is_none_or(|t| now.duration_since(t) >= IDLE_EVERY);
        if due {
            self.claimed = claimed;
            self.last = Some(now);
        }
        due
    }
}

/// Named background tasks sharing one cancellation token (clones share them too).
#[derive(Debug, Default, Clone)]
pub struct Tasks {
    tracker: TaskTracker,
    token: CancellationToken,
    // Names of the tasks still running, so that a stop that times out can say which.
    running: Arc<Mutex<Vec<String>>>,
}

/// Removes its task's name from the running list when the task ends (or is dropped).
struct Running {
    name: String,
    running: Arc<Mutex<Vec<String>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = running.iter().position(|n| *n == self.name) {
            running.remove(i);
        }
    }
}

impl Tasks {
    /// No tasks yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Spawns `task` under `name`; it is given the token that [`Tasks::stop`] cancels and
    /// should return soon after.
    pub fn spawn<F, Fut>(&self, name: impl Into<String>, task: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let name = name.into();
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(name.clone());
        let guard = Running {
            name,
            running: Arc::clone(&self.running),
        };
        let future = task(self.token.clone());
        self.tracker.spawn(async move {
            let _guard = guard;
            future.await;
        });
    }

    /// Names of the tasks still running.
    pub fn running(&self) -> Vec<String> {
        self.running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Cancels every task and waits up to `deadline` for them to end; returns (and logs) the
    /// names of those that did not, which are left to end with the process.
    pub async fn stop(self, deadline: Duration) -> Vec<String> {
        self.token.cancel();
        self.tracker.close();
        if tokio::time::timeout(deadline, self.tracker.wait())
            .await
            .is_ok()
        {
            return Vec::new();
        }
        let stuck = self.running();
        tracing::warn!(tasks = ?stuck, deadline = ?deadline, "background tasks did not stop in time; leaving them");
        stuck
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stop_names_the_tasks_that_did_not_stop() {
        let tasks = Tasks::new();
        tasks.spawn("polite", |token| async move { token.cancelled().await });
        tasks.spawn("stubborn", |_| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
        });
        tasks.spawn("done", |_| async {});
        tokio::task::yield_now().await;
        assert_eq!(
            tasks.stop(Duration::from_millis(50)).await,
            vec!["stubborn"]
        );
    }

    #[test]
    fn a_pace_runs_on_traffic_or_when_watching_else_every_idle_period() {
        let metrics = OutboxMetrics::new("pace_test");
        let mut pace = Pace::new(metrics.clone());
        let t0 = Instant::now();
        assert!(pace.due(false, t0), "the first check runs");
        assert!(!pace.due(false, t0 + Duration::from_secs(5)), "idle");
        assert!(pace.due(true, t0 + Duration::from_secs(10)), "watching");
        metrics.claimed(3);
        assert!(
            pace.due(false, t0 + Duration::from_secs(15)),
            "rows claimed"
        );
        assert!(!pace.due(false, t0 + Duration::from_secs(20)), "idle again");
        assert!(!pace.due(false, t0 + Duration::from_secs(44)));
        assert!(
            pace.due(false, t0 + Duration::from_secs(45)),
            "IDLE_EVERY passed"
        );
    }

    #[tokio::test]
    async fn stop_is_quiet_when_every_task_stops() {
        let tasks = Tasks::new();
        tasks.spawn("a", |token| async move { token.cancelled().await });
        assert!(tasks.stop(Duration::from_secs(5)).await.is_empty());
    }
}
