//! The in-flight window: how many claimed messages the relay holds unconfirmed at once
//! (`relay.max_in_flight`), shared fairly by the outboxes one relay serves.
//!
//! Every outbox's claim loop takes its permits from one [`Window`] through its own [`Lane`].
//! An outbox alone may use the whole window, so one busy outbox among idle ones drains as
//! fast as it would alone: an idle outbox's poll holds a few permits for the length of its
//! claim, but does not make it count. As soon as another outbox found rows in the last second,
//! each such outbox is capped at an equal share, and the permits that come back go first to the
//! lane holding the fewest (a quiet outbox's poll waits behind no burst): a burst in one outbox
//! neither takes the permits another needs nor keeps the broker's queue full ahead of its
//! messages.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// How long a lane that found rows counts as active.
const RECENT: Duration = Duration::from_secs(1);

/// The shared window; cheap to clone.
#[derive(Debug, Clone)]
pub struct Window {
    shared: Arc<WindowState>,
}

/// The window's size, how long a lane counts as active, and the ledger: shared by every lane
/// and permit.
#[derive(Debug)]
struct WindowState {
    total: usize,
    /// How long a lane that found rows counts as active ([`RECENT`]).
    recent: Duration,
    ledger: Mutex<Ledger>,
}

/// Who holds permits and who waits for them.
#[derive(Debug)]
struct Ledger {
    available: usize,
    held: Vec<usize>,
    /// When each lane last found rows to publish ([`Lane::found_work`]).
    busy_at: Vec<Option<Instant>>,
    queue: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    lane: usize,
    min: usize,
    max: usize,
    /// Takes the whole window (ignores the fair share).
    exclusive: bool,
    tx: oneshot::Sender<usize>,
}

impl Window {
    /// A window of `total` permits (at least 1).
    pub fn new(total: usize) -> Self {
        Self::with_recent(total, RECENT)
    }

    fn with_recent(total: usize, recent: Duration) -> Self {
        Self {
            shared: Arc::new(WindowState {
                total: total.max(1),
                recent,
                ledger: Mutex::new(Ledger {
                    available: total.max(1),
                    held: Vec::new(),
                    busy_at: Vec::new(),
                    queue: VecDeque::new(),
                }),
            }),
        }
    }

    /// The window's size.
    pub fn total(&self) -> usize {
        self.shared.total
    }

    /// A new lane (one per outbox).
    pub fn lane(&self) -> Lane {
        let mut ledger = self.shared.lock();
        ledger.held.push(0);
        ledger.busy_at.push(None);
        Lane {
            shared: Arc::clone(&self.shared),
            index: ledger.held.len() - 1,
        }
    }
}

impl WindowState {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Ledger {
    /// Which lanes are active: those whose claims found rows lately. Holding or asking for
    /// permits is not enough: every idle outbox's poll does both for the length of an empty
    /// claim, and counting those would keep halving a busy outbox's share for nothing.
    fn active(&self, recent: Duration) -> Vec<bool> {
        let now = Instant::now();
        self.busy_at
            .iter()
            .map(|b| b.is_some_and(|t| now.duration_since(t) < recent))
            .collect()
    }

    /// Grants queued requests, fewest-held lane first, while permits are available.
    fn dispatch(&mut self, total: usize, recent: Duration) {
        while !self.queue.is_empty() && self.available > 0 {
            let Some(pos) = (0..self.queue.len()).min_by_key(|&i| self.held[self.queue[i].lane])
            else {
                return;
            };
            let (lane, min, max, exclusive) = {
                let w = &self.queue[pos];
                (w.lane, w.min, w.max, w.exclusive)
            };
            // The fair share binds only while another lane has been publishing lately: then
            // each active lane, and this one, keeps at most an equal share in flight, so that a
            // burst does not fill the broker's queue ahead of the others' messages.
            let active = self.active(recent);
            let others = active
                .iter()
                .enumerate()
                .filter(|&(i, a)| *a && i != lane)
                .count();
            let cap = if exclusive || others == 0 {
                total
            } else {
                (total / (others + 1)).max(1)
            };
            // The whole window means nothing in flight anywhere, this lane's own batches
            // included.
            let room = if exclusive {
                total
            } else {
                cap.saturating_sub(self.held[lane])
            };
            // What the lane asked for at least, capped by what its share lets it have: half
            // of it while others are active (so that it still pipelines), all of it alone. Not
            // by its room now: a lane with a backlog asks for a refill so as not to claim on
            // every permit that comes back, and granting whatever room its own batches had
            // just freed gave it claims of 1-50 rows.
            let need = if exclusive {
                total
            } else if others == 0 {
                min.min(cap).max(1)
            } else {
                min.min((cap / 2).max(1)).max(1)
            };
            if self.available < need || room < need {
                // The neediest lane waits for more permits to come back; keep them for it.
                return;
            }
            let grant = max.min(room).min(self.available);
            let Some(w) = self.queue.remove(pos) else {
                return;
            };
            if w.tx.send(grant).is_ok() {
                self.available -= grant;
                self.held[lane] += grant;
            }
        }
    }
}

/// One outbox's access to the [`Window`].
#[derive(Debug)]
pub struct Lane {
    shared: Arc<WindowState>,
    index: usize,
}

impl Lane {
    /// Waits until this lane can take at least `min` permits (capped by its fair share: the
    /// whole window while no other lane is active, half an equal share otherwise) and takes up
    /// to `max`. `None` only if the window is gone.
    pub async fn acquire(&self, min: usize, max: usize) -> Option<Permit> {
        self.request(min.max(1), max.max(min).max(1), false).await
    }

    /// Waits until nothing else is in flight in any outbox and takes the whole window.
    pub async fn acquire_all(&self) -> Option<Permit> {
        let total = self.shared.total;
        self.request(total, total, true).await
    }

    async fn request(&self, min: usize, max: usize, exclusive: bool) -> Option<Permit> {
        let (tx, rx) = oneshot::channel();
        {
            let mut ledger = self.shared.lock();
            ledger.queue.push_back(Waiter {
                lane: self.index,
                min,
                max,
                exclusive,
                tx,
            });
            ledger.dispatch(self.shared.total, self.shared.recent);
        }
        // Dropping this future drops `rx`: a later grant then fails to send and is not taken;
        // the queue entry is removed below so that it does not hold permits back meanwhile.
        let mut guard = Cancel {
            shared: &self.shared,
            lane: self.index,
            done: false,
        };
        let n = rx.await.ok()?;
        guard.done = true;
        Some(Permit {
            shared: Arc::clone(&self.shared),
            lane: self.index,
            n,
        })
    }

    /// This lane's claim found rows: for a second (`RECENT`) it counts as active, and the other lanes
    /// are held to their fair share.
    pub fn found_work(&self) {
        self.shared.lock().busy_at[self.index] = Some(Instant::now());
    }

    /// Permits this lane holds now.
    pub fn held(&self) -> usize {
        self.shared.lock().held[self.index]
    }
}

/// Removes an abandoned request from the queue.
struct Cancel<'a> {
    shared: &'a Arc<WindowState>,
    lane: usize,
    done: bool,
}

impl Drop for Cancel<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut ledger = self.shared.lock();
        ledger
            .queue
            .retain(|w| !(w.lane == self.lane && w.tx.is_closed()));
        ledger.dispatch(self.shared.total, self.shared.recent);
    }
}

/// Permits taken from the window, given back when dropped.
#[derive(Debug)]
pub struct Permit {
    shared: Arc<WindowState>,
    lane: usize,
    n: usize,
}

impl Permit {
    /// How many permits this holds.
    pub fn num_permits(&self) -> usize {
        self.n
    }

    /// Splits `n` permits off into a new permit (`None` if this holds fewer).
    pub fn split(&mut self, n: usize) -> Option<Permit> {
        if n > self.n {
            return None;
        }
        self.n -= n;
        Some(Permit {
            shared: Arc::clone(&self.shared),
            lane: self.lane,
            n,
        })
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.n == 0 {
            return;
        }
        let mut ledger = self.shared.lock();
        ledger.available += self.n;
        ledger.held[self.lane] -= self.n;
        ledger.dispatch(self.shared.total, self.shared.recent);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn soon<T>(f: impl std::future::Future<Output = T>) -> Option<T> {
        tokio::time::timeout(Duration::from_millis(50), f)
            .await
            .ok()
    }

    #[tokio::test]
    async fn a_lane_alone_uses_the_whole_window() {
        let w = Window::new(10);
        let a = w.lane();
        let _b = w.lane(); // idle: does not count
        let p = soon(a.acquire(1, 100)).await.flatten().unwrap();
        assert_eq!(p.num_permits(), 10);
        assert!(soon(a.acquire(1, 1)).await.is_none(), "window is full");
    }

    #[tokio::test]
    async fn a_waiting_lane_gets_the_next_permits_and_caps_the_busy_one() {
        let recent = Duration::from_millis(300);
        let w = Window::with_recent(10, recent);
        let (busy, quiet) = (w.lane(), w.lane());
        let mut all = busy.acquire(1, 10).await.unwrap();
        busy.found_work();
        // The busy lane asks again first, then the quiet one.
        let mut busy2 = Box::pin(busy.acquire(1, 10));
        assert!(soon(&mut busy2).await.is_none());
        let mut quiet1 = Box::pin(quiet.acquire(1, 5));
        assert!(soon(&mut quiet1).await.is_none());
        // Two permits come back: both go to the quiet lane (it holds fewest).
        drop(all.split(2));
        let q = soon(&mut quiet1).await.flatten().unwrap();
        assert_eq!(q.num_permits(), 2);
        assert_eq!(busy.held(), 8);
        // The quiet lane's claim found rows: the busy one stays at its share (5 of 10).
        quiet.found_work();
        drop(all.split(3));
        assert!(soon(&mut busy2).await.is_none());
        drop(q);
        assert!(
            soon(&mut busy2).await.is_none(),
            "the quiet lane published lately"
        );
        // A while later the quiet lane no longer counts: the busy one takes what comes back.
        tokio::time::sleep(recent).await;
        drop(all.split(1));
        assert_eq!(soon(&mut busy2).await.flatten().unwrap().num_permits(), 6);
    }

    #[tokio::test]
    async fn an_idle_lanes_poll_does_not_cap_the_busy_one() {
        let w = Window::new(10);
        let (busy, idle) = (w.lane(), w.lane());
        busy.found_work();
        // An idle lane's poll holds permits for the length of its (empty) claim...
        let poll = soon(idle.acquire(1, 3)).await.flatten().unwrap();
        assert_eq!(poll.num_permits(), 3);
        // ...and the busy lane may still fill the rest of the window.
        let b = soon(busy.acquire(1, 10)).await.flatten().unwrap();
        assert_eq!(b.num_permits(), 7);
        drop(poll);
        assert_eq!(
            soon(busy.acquire(1, 10))
                .await
                .flatten()
                .unwrap()
                .num_permits(),
            3
        );
    }

    #[tokio::test]
    async fn contended_lanes_are_capped_at_an_equal_share() {
        let w = Window::new(10);
        let (busy, quiet) = (w.lane(), w.lane());
        let mut held = busy.acquire(1, 10).await.unwrap();
        busy.found_work();
        quiet.found_work();
        let q = quiet.acquire(1, 1);
        let b = busy.acquire(1, 10);
        let (mut q, mut b) = (Box::pin(q), Box::pin(b));
        assert!(soon(&mut q).await.is_none());
        assert!(soon(&mut b).await.is_none());
        // 6 come back: quiet (0 held) gets its 1; busy (4 held) may grow to its share of 5.
        drop(held.split(6));
        let qp = soon(&mut q).await.flatten().unwrap();
        assert_eq!(qp.num_permits(), 1);
        let bp = soon(&mut b).await.flatten().unwrap();
        assert_eq!(
            bp.num_permits(),
            1,
            "4 held + 1 = its share of 5 while the quiet lane is active"
        );
        drop((qp, bp, held));
        assert_eq!(busy.held() + quiet.held(), 0);
    }

    #[tokio::test]
    async fn a_lane_that_published_lately_holds_the_busy_one_to_its_share() {
        let w = Window::new(10);
        let (busy, quiet) = (w.lane(), w.lane());
        quiet.found_work();
        let p = soon(busy.acquire(1, 10)).await.flatten().unwrap();
        assert_eq!(
            p.num_permits(),
            5,
            "an equal share while the quiet lane is active"
        );
        let alone = Window::new(10);
        let only = alone.lane();
        let _idle = alone.lane();
        only.found_work();
        assert_eq!(only.acquire(1, 10).await.unwrap().num_permits(), 10);
    }

    #[tokio::test]
    async fn acquire_all_waits_for_every_lane_to_give_back() {
        let w = Window::new(4);
        let (a, b) = (w.lane(), w.lane());
        let pa = a.acquire(1, 2).await.unwrap();
        let pb = b.acquire(1, 2).await.unwrap();
        let mut all = Box::pin(a.acquire_all());
        drop(pb);
        assert!(
            soon(&mut all).await.is_none(),
            "a's own batch still holds 2"
        );
        drop(pa);
        assert_eq!(soon(&mut all).await.flatten().unwrap().num_permits(), 4);
    }

    #[tokio::test]
    async fn an_abandoned_request_takes_nothing() {
        let w = Window::new(2);
        let (a, b) = (w.lane(), w.lane());
        let p = a.acquire(2, 2).await.unwrap();
        assert!(soon(b.acquire(2, 2)).await.is_none()); // dropped while queued
        drop(p);
        assert_eq!(b.held(), 0);
        assert_eq!(a.acquire(2, 2).await.unwrap().num_permits(), 2);
    }

    #[tokio::test]
    async fn a_refill_waits_for_its_minimum_rather_than_taking_each_permit_back() {
        let w = Window::new(10);
        let a = w.lane();
        let mut batches = a.acquire(1, 10).await.unwrap();
        // A backlog asks for a refill of 5: permits coming back one by one are not enough.
        let mut refill = Box::pin(a.acquire(5, 5));
        drop(batches.split(1));
        assert!(soon(&mut refill).await.is_none(), "1 free: keep waiting");
        drop(batches.split(3));
        assert!(soon(&mut refill).await.is_none(), "4 free: keep waiting");
        drop(batches.split(1));
        assert_eq!(soon(&mut refill).await.flatten().unwrap().num_permits(), 5);
        // While another lane is active (a share of 5), half the share is enough to go on.
        let b = w.lane();
        b.found_work();
        assert_eq!(a.held(), 5);
        let mut half = Box::pin(a.acquire(5, 5));
        drop(batches.split(1));
        assert!(soon(&mut half).await.is_none(), "room for 1: keep waiting");
        drop(batches.split(1));
        assert_eq!(soon(&mut half).await.flatten().unwrap().num_permits(), 2);
    }

    #[tokio::test]
    async fn split_permits_return_separately() {
        let w = Window::new(6);
        let a = w.lane();
        let mut p = a.acquire(6, 6).await.unwrap();
        let part = p.split(4).unwrap();
        assert!(p.split(3).is_none());
        drop(part);
        assert_eq!(a.held(), 2);
        drop(p);
        assert_eq!(a.held(), 0);
    }
}
