//! Background services that run beside the claim loop, one file each (like River's
//! `internal/maintenance/`):
//! - [`listen`]: the LISTEN session that wakes the loop on NOTIFY;
//! - [`lease`]: renewing this relay's leases ([`lease::Held`]) and reclaiming expired ones;
//! - [`backlog`]: the backlog gauges and stale waiting records;
//! - [`cleanup`]: retention of `sent` and `expired` rows;
//! - [`vacuum`]: vacuuming the table when autovacuum does not keep up.
//!
//! They run under names on one [`Tasks`] tracker; at shutdown [`Tasks::stop`] cancels them,
//! waits up to a deadline and names the ones that did not stop.

pub mod backlog;
pub mod cleanup;
pub mod lease;
pub mod listen;
pub mod vacuum;

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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

    #[tokio::test]
    async fn stop_is_quiet_when_every_task_stops() {
        let tasks = Tasks::new();
        tasks.spawn("a", |token| async move { token.cancelled().await });
        assert!(tasks.stop(Duration::from_secs(5)).await.is_empty());
    }
}
