//! Leases: this relay renews the leases of the rows it holds, and returns rows whose lease
//! ran out (their relay stopped, or lost track of them) to `pending`, like River's rescuer.
//!
//! A `processing` row is safe from other relays only while its lease is renewed; what this
//! relay renews is exactly [`Held`], so a row it lost track of expires and is published again
//! (at least once), never silently kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::sleep_or_cancel;
use crate::retry::RetryPolicy;
use crate::store::Store;
use crate::telemetry::OutboxMetrics;

/// The ids this relay has claimed and not yet settled: the only rows whose leases it renews.
/// A row it lost track of (a claim whose answer never arrived, an outcome it gave up
/// recording) is not renewed, so its lease runs out and another relay (or this one) reclaims it.
/// Each batch holds its ids through a [`Holding`]; an id is counted once per batch holding it
/// (a batch that gave up on a row whose lease ran out may still be settling when this relay
/// claims the row again in another), and renewed until the last of them lets go.
/// It also carries the lease task's note that it reclaimed rows, so the loop looks for them at
/// once. Clones share both.
#[derive(Debug, Clone, Default)]
pub struct Held(Arc<HeldState>);

/// What the clones of a [`Held`] share.
#[derive(Debug, Default)]
struct HeldState {
    /// Each held id with the number of batches holding it.
    ids: Mutex<HashMap<Uuid, u32>>,
    reclaimed: AtomicBool,
}

impl Held {
    /// Starts renewing the leases of `ids` until the returned [`Holding`] is dropped: when a
    /// batch's task ends, however it ends (settled, given up on, or unwound by a panic), its
    /// rows are no longer renewed, so a row it could not settle comes back when its lease runs
    /// out instead of staying `processing` for as long as the relay runs.
    pub fn holding(&self, ids: Vec<Uuid>) -> Holding {
        let mut held = self.lock();
        for id in &ids {
            *held.entry(*id).or_insert(0) += 1;
        }
        drop(held);
        Holding {
            held: self.clone(),
            ids,
        }
    }

    /// Lets go of `ids` once (a [`Holding`] dropped).
    fn release(&self, ids: &[Uuid]) {
        let mut held = self.lock();
        for id in ids {
            if let Some(count) = held.get_mut(id) {
                *count -= 1;
                if *count == 0 {
                    held.remove(id);
                }
            }
        }
    }

    /// Whether no row is held.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The held ids, copied out so the lock is not kept across a database call.
    pub fn ids(&self) -> Vec<Uuid> {
        self.lock().keys().copied().collect()
    }

    /// The lease task returned rows of a stopped relay to `pending`.
    pub fn note_reclaimed(&self) {
        self.0.reclaimed.store(true, Ordering::Release);
    }

    /// Whether rows were reclaimed since the last call (the loop then looks for them now
    /// rather than at its next periodic check).
    pub fn take_reclaimed(&self) -> bool {
        self.0.reclaimed.swap(false, Ordering::AcqRel)
    }

    // A panic while the set was locked leaves it consistent (every operation is one call on
    // the set), so a poisoned lock is used as is.
    fn lock(&self) -> MutexGuard<'_, HashMap<Uuid, u32>> {
        self.0.ids.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One batch's share of [`Held`]: its rows' leases are renewed while it lives.
#[derive(Debug)]
#[must_use = "the rows are renewed only while the Holding lives"]
pub struct Holding {
    held: Held,
    ids: Vec<Uuid>,
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.held.release(&self.ids);
    }
}

/// Every `lease_timeout / 3`: renews the leases of the rows this relay holds (so rows waiting
/// on a slow broker are never taken from a live relay), then hands back rows whose lease
/// expired because their relay stopped or lost track of them, waking the loop when it did.
pub async fn lease_loop(
    store: Store,
    metrics: OutboxMetrics,
    held: Held,
    lease: Duration,
    retry: RetryPolicy,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    let period = (lease / 3).clamp(Duration::from_millis(100), Duration::from_secs(20));
    loop {
        let ids = held.ids();
        if !ids.is_empty()
            && let Err(e) = store.bounded(store.heartbeat(&ids)).await
        {
            store.note_error(&e);
            tracing::warn!(error = %e, "cannot renew leases; rows may be reclaimed by another relay if this lasts longer than lease_timeout");
        }
        let reclaim = store.reclaim_expired(lease, retry.max_attempts);
        match store.bounded(reclaim).await {
            Ok((0, 0)) => {}
            Ok((reclaimed, dead)) => {
                tracing::warn!(
                    reclaimed,
                    dead_lettered = dead,
                    lease = ?lease,
                    "reclaimed rows whose relay stopped while holding them"
                );
                metrics.dead_lettered(dead);
                if reclaimed > 0 {
                    held.note_reclaimed();
                }
                wake.notify_one();
            }
            Err(e) => {
                store.note_error(&e);
                tracing::warn!(error = %e, "lease reclaim failed; retrying");
            }
        }
        if !sleep_or_cancel(period, &shutdown).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The ids `held` renews, in no order.
    fn held_ids(held: &Held) -> HashSet<Uuid> {
        held.ids().into_iter().collect()
    }

    #[test]
    fn held_tracks_until_released_and_clones_share() {
        let held = Held::default();
        let other = held.clone();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let first = held.holding(vec![a, b]);
        assert!(!other.is_empty());
        assert_eq!(held_ids(&other), HashSet::from([a, b]));
        drop(first);
        assert!(held.is_empty());
    }

    #[test]
    fn a_row_held_by_two_batches_is_renewed_until_both_let_go() {
        let held = Held::default();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        // A batch that gave up on `a`, still settling, and a later batch that claimed it again.
        let gave_up = held.holding(vec![a]);
        let again = held.holding(vec![a, b]);
        drop(gave_up);
        let still = HashSet::from([a, b]);
        assert_eq!(held_ids(&held), still, "the later batch still holds a");
        drop(again);
        assert!(held.is_empty());
    }

    #[test]
    fn a_holding_releases_its_rows_when_dropped_even_by_a_panic() {
        let held = Held::default();
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let first = held.holding(vec![a]);
        let unwound = std::panic::catch_unwind({
            let held = held.clone();
            move || {
                let _second = held.holding(vec![b]);
                assert_eq!(held.ids().len(), 2);
                panic!("a batch task panics");
            }
        });
        assert!(unwound.is_err());
        assert_eq!(held.ids(), vec![a], "the unwound holding released b");
        drop(first);
        assert!(held.is_empty());
    }

    #[test]
    fn a_reclaim_note_is_taken_once() {
        let held = Held::default();
        assert!(!held.take_reclaimed());
        held.clone().note_reclaimed();
        assert!(held.take_reclaimed());
        assert!(!held.take_reclaimed());
    }
}
