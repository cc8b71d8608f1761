//! The ordering guard of `relay.ordering = "aggregate"`: which `seq` values are final.
//!
//! Rows are inserted with a `seq` drawn only after the inserting transaction has an xid and
//! holds a lock on the outbox table. So when the relay reads the sequence's last value `L` and,
//! afterwards, the set `W` of transactions holding a lock on the table, every transaction that
//! could still commit a `seq <= L` is in `W`. Once all of `W` have ended, every `seq <= L` is
//! final: nothing can appear below it any more, and publishing rows up to `L` in `seq` order
//! cannot be overtaken by a late commit. The guard waits only for writers of the outbox table,
//! not for the whole cluster's oldest transaction.
//!
//! This module is the bookkeeping only (pure, unit-tested); the store runs the two queries.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Observation {
    seq: i64,
    writers: BTreeSet<String>,
    at: Instant,
}

/// Tracks observations until the transactions they wait for have ended.
#[derive(Debug, Default)]
pub struct Watermark {
    pending: VecDeque<Observation>,
    released: i64,
}

/// Observations kept at most; older ones are merged away (which only delays release).
const MAX_PENDING: usize = 256;

impl Watermark {
    /// A tracker with nothing released.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that the sequence stood at `last_seq` before `writers` (the transactions now
    /// holding a lock on the table) were read, and returns the new watermark: the highest
    /// `seq` that can no longer be preceded by a late commit.
    pub fn observe(&mut self, last_seq: i64, writers: &[String], now: Instant) -> i64 {
        let current: BTreeSet<String> = writers.iter().cloned().collect();
        let newest = self.pending.back().map_or(self.released, |o| o.seq);
        if last_seq > newest {
            if self.pending.len() >= MAX_PENDING {
                // Drop the second-newest: a later observation waits for a superset of writers.
                let len = self.pending.len();
                self.pending.remove(len.saturating_sub(2).max(1));
            }
            self.pending.push_back(Observation {
                seq: last_seq,
                writers: current.clone(),
                at: now,
            });
        }
        // A writer still running at an earlier observation still holds its lock now, so the
        // queue is blocked from the front: release while the front's writers have all ended.
        while let Some(front) = self.pending.front() {
            if front.writers.is_disjoint(&current) {
                self.released = self.released.max(front.seq);
                self.pending.pop_front();
            } else {
                break;
            }
        }
        self.released
    }

    /// The current watermark.
    pub fn released(&self) -> i64 {
        self.released
    }

    /// How long rows have been held back by running writers (zero when nothing is held).
    pub fn lag(&self, now: Instant) -> Duration {
        self.pending
            .front()
            .map_or(Duration::ZERO, |o| now.saturating_duration_since(o.at))
    }

    /// Whether some rows are being held back.
    pub fn holding(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(xs: &[&str]) -> Vec<String> {
        xs.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn no_writers_releases_immediately() {
        let mut m = Watermark::new();
        let t = Instant::now();
        assert_eq!(m.observe(10, &[], t), 10);
        assert!(!m.holding());
        assert_eq!(m.lag(t), Duration::ZERO);
    }

    #[test]
    fn waits_for_the_writers_seen_then() {
        let mut m = Watermark::new();
        let t = Instant::now();
        assert_eq!(m.observe(5, &w(&["100"]), t), 0);
        assert!(m.holding());
        // 100 still running, a new writer 101 appears, seq moved on.
        assert_eq!(
            m.observe(8, &w(&["100", "101"]), t + Duration::from_secs(1)),
            0
        );
        assert_eq!(m.lag(t + Duration::from_secs(2)), Duration::from_secs(2));
        // 100 ended: the first observation is final; the second still waits for 101.
        assert_eq!(m.observe(8, &w(&["101"]), t), 5);
        // 101 ended.
        assert_eq!(m.observe(8, &[], t), 8);
        assert!(!m.holding());
    }

    #[test]
    fn unrelated_new_writers_do_not_hold_old_rows() {
        let mut m = Watermark::new();
        let t = Instant::now();
        assert_eq!(m.observe(3, &w(&["7"]), t), 0);
        // 7 ended; 9 started after the observation: seq 3 is final.
        assert_eq!(m.observe(4, &w(&["9"]), t), 3);
    }

    #[test]
    fn never_goes_backwards_and_bounds_memory() {
        let mut m = Watermark::new();
        let t = Instant::now();
        for i in 1..=1000 {
            m.observe(i, &w(&["1"]), t);
        }
        assert!(m.pending.len() <= MAX_PENDING);
        assert_eq!(m.released(), 0);
        assert_eq!(m.observe(1000, &[], t), 1000);
        assert_eq!(m.observe(900, &[], t), 1000);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            Begin,
            Draw(usize),
            End(usize),
            Observe,
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                Just(Step::Begin),
                (0usize..8).prop_map(Step::Draw),
                (0usize..8).prop_map(Step::End),
                Just(Step::Observe),
            ]
        }

        proptest! {
            /// Model: writers take the table lock when they begin, draw seqs while running and
            /// may commit any of them later. The watermark must never reach a seq that a
            /// running writer could still commit, and must catch up once nobody writes.
            #[test]
            fn never_passes_a_running_writer(steps in proptest::collection::vec(step(), 1..200)) {
                let mut m = Watermark::new();
                let mut next_seq = 0i64;
                let mut next_xid = 0u32;
                // running writers: (xid, seqs drawn)
                let mut running: Vec<(u32, Vec<i64>)> = Vec::new();
                let t = Instant::now();
                for s in steps {
                    match s {
                        Step::Begin => { next_xid += 1; running.push((next_xid, Vec::new())); }
                        Step::Draw(i) if !running.is_empty() => {
                            next_seq += 1;
                            let k = i % running.len();
                            running[k].1.push(next_seq);
                        }
                        Step::End(i) if !running.is_empty() => { running.remove(i % running.len()); }
                        Step::Observe => {
                            let writers: Vec<String> = running.iter().map(|(x, _)| x.to_string()).collect();
                            let w = m.observe(next_seq, &writers, t);
                            for (xid, seqs) in &running {
                                for s in seqs {
                                    prop_assert!(*s > w, "watermark {w} passed seq {s} of running writer {xid}");
                                }
                            }
                        }
                        _ => {}
                    }
                }
                running.clear();
                prop_assert_eq!(m.observe(next_seq, &[], t), next_seq);
            }
        }
    }
}
