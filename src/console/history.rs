//! The last 15 minutes of one outbox, sampled in-process every 10 s from the relay's own
//! counters ([`crate::telemetry::OutboxMetrics::totals`]) and backlog figures: what the
//! console's charts draw. A ring of samples; the intervals between neighbours are the charts'
//! points. Pure: the sampler passes the time in.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::telemetry::TotalsSnapshot;

/// How often the sampler reads the counters.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// How far back the charts reach.
pub const WINDOW: Duration = Duration::from_secs(15 * 60);

/// Samples kept: one per [`SAMPLE_EVERY`] over [`WINDOW`], and the one before (the first
/// interval's start).
const CAPACITY: usize = (WINDOW.as_secs() / SAMPLE_EVERY.as_secs()) as usize + 1;

/// The counters and the lag at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When it was read.
    pub at: Instant,
    /// The outbox's totals since start.
    pub totals: TotalsSnapshot,
    /// The lag (oldest ready row's age, seconds) as the backlog task last read it; `None`
    /// before its first reading.
    pub lag: Option<f64>,
}

/// One interval between two samples: a point of each chart.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// How long before `now` the interval ended.
    pub ago: Duration,
    /// Messages confirmed per second over the interval.
    pub per_second: f64,
    /// Message-level failures in the interval.
    pub message_failures: u64,
    /// Connection-level failures in the interval.
    pub connection_failures: u64,
    /// Rows dead-lettered in the interval.
    pub dead_lettered: u64,
    /// The lag at the interval's end.
    pub lag: Option<f64>,
}

/// The ring of samples.
#[derive(Debug, Clone, Default)]
pub struct History {
    samples: VecDeque<Sample>,
}

impl History {
    /// Adds a sample, dropping the oldest past the window.
    pub fn push(&mut self, sample: Sample) {
        self.samples.push_back(sample);
        while self.samples.len() > CAPACITY {
            self.samples.pop_front();
        }
    }

    /// The charts' points, oldest first, each at its age relative to `now`. Intervals that
    /// ended more than [`WINDOW`] ago are left out.
    pub fn points(&self, now: Instant) -> Vec<Point> {
        let pairs = self.samples.iter().zip(self.samples.iter().skip(1));
        pairs
            .filter_map(|(a, b)| {
                let ago = now.saturating_duration_since(b.at);
                let span = b.at.saturating_duration_since(a.at).as_secs_f64();
                (ago <= WINDOW && span > 0.0).then(|| {
                    let (x, y) = (a.totals, b.totals);
                    Point {
                        ago,
                        per_second: y.published.saturating_sub(x.published) as f64 / span,
                        message_failures: y.message_failures.saturating_sub(x.message_failures),
                        connection_failures: y
                            .connection_failures
                            .saturating_sub(x.connection_failures),
                        dead_lettered: y.dead_lettered.saturating_sub(x.dead_lettered),
                        lag: b.lag,
                    }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant, published: u64, failures: u64, lag: f64) -> Sample {
        Sample {
            at,
            totals: TotalsSnapshot {
                published,
                message_failures: failures,
                connection_failures: 2 * failures,
                dead_lettered: failures / 2,
            },
            lag: Some(lag),
        }
    }

    #[test]
    fn points_are_the_rates_between_neighbouring_samples() {
        let t0 = Instant::now();
        let mut h = History::default();
        h.push(sample(t0, 0, 0, 0.0));
        assert!(h.points(t0).is_empty(), "one sample has no interval yet");
        h.push(sample(t0 + SAMPLE_EVERY, 50, 4, 1.5));
        h.push(sample(t0 + 2 * SAMPLE_EVERY, 250, 4, 3.0));
        let now = t0 + 2 * SAMPLE_EVERY;
        let p = h.points(now);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].ago, SAMPLE_EVERY);
        assert!((p[0].per_second - 5.0).abs() < 1e-9);
        assert_eq!((p[0].message_failures, p[0].connection_failures), (4, 8));
        assert_eq!(p[0].dead_lettered, 2);
        assert_eq!(p[0].lag, Some(1.5));
        assert_eq!(p[1].ago, Duration::ZERO);
        assert!((p[1].per_second - 20.0).abs() < 1e-9);
        assert_eq!(p[1].message_failures, 0);
        assert_eq!(p[1].lag, Some(3.0));
    }

    #[test]
    fn the_ring_keeps_fifteen_minutes() {
        let t0 = Instant::now();
        let mut h = History::default();
        for i in 0..200u32 {
            h.push(sample(t0 + i * SAMPLE_EVERY, u64::from(i) * 10, 0, 0.0));
        }
        let now = t0 + 199 * SAMPLE_EVERY;
        let p = h.points(now);
        assert_eq!(p.len(), 90);
        assert_eq!(p.first().map(|p| p.ago), Some(WINDOW - SAMPLE_EVERY));
        assert!(p.iter().all(|p| (p.per_second - 1.0).abs() < 1e-9));
        // Read later, the points age and the ones past the window drop out.
        assert_eq!(h.points(now + 5 * SAMPLE_EVERY).len(), 86);
    }
}
