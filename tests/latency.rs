//! Commit → consumer latency of the real binary against the local PostgreSQL and RabbitMQ, at
//! a steady insert rate and one row at a time into an idle relay: with the wake-up the relay is
//! woken by a NOTIFY; without it the latency is bounded by `relay.poll_interval`. The file's
//! only test, so that nothing else in the suite shares the machine with it while it measures.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::{NewRow, RabbitFixture, RelayBuilder, RelayProcess, TestTable};
use common::{finish, table_and_exchange};
use serde_json::json;
use uuid::Uuid;

/// p50, p99 and max of the latencies measured.
#[derive(Debug)]
struct Run {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn percentiles(mut lat: Vec<Duration>) -> Run {
    lat.sort();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let (p50, p99, max) = (pct(0.50), pct(0.99), *lat.last().unwrap());
    Run { p50, p99, max }
}

const MS: Duration = Duration::from_millis(1);

fn row(aggregate: &str, i: u32) -> NewRow {
    NewRow::new("latency", Some(aggregate), "tick", json!({ "i": i }))
}

/// Inserts `rate` rows per second for `secs` seconds, one committed transaction per row, and
/// measures commit → receive for each.
async fn measure(table: &TestTable, rabbit: &RabbitFixture, rate: u32, secs: u32) -> Run {
    let mut committed: HashMap<Uuid, Instant> = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(1) / rate);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for i in 0..rate * secs {
        ticker.tick().await;
        let id = table.insert_one(row(&format!("a{}", i % 50), i)).await;
        committed.insert(id, Instant::now());
    }
    let ids: Vec<Uuid> = committed.keys().copied().collect();
    rabbit.wait_for_ids(&ids, Duration::from_secs(60)).await;
    // The first delivery of each id (newest first, so the earliest is written last).
    let mut first = HashMap::new();
    for d in rabbit.deliveries().into_iter().rev() {
        first.insert(d.message_id, d.received_at);
    }
    let lat = committed
        .iter()
        .map(|(id, at)| first[&id.to_string()].saturating_duration_since(*at));
    percentiles(lat.collect())
}

/// Inserts one row at a time into an idle relay's table and measures commit → receive for
/// each, pausing 300 ms between tries so that the relay is back to waiting.
async fn measure_idle(table: &TestTable, rabbit: &RabbitFixture, tries: u32) -> Run {
    let mut lat = Vec::new();
    for i in 0..tries {
        // Idle: past the relay's linger (200 ms after its last rows), so it waits for a
        // NOTIFY rather than polling on a short delay.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let id = table.insert_one(row("idle", i)).await;
        let committed = Instant::now();
        let got = rabbit.wait_for_delivery(id, Duration::from_secs(30)).await;
        lat.push(got.received_at.saturating_duration_since(committed));
    }
    percentiles(lat)
}

/// This 2-core machine is shared with the services under test: a window hit by an unrelated
/// stall (a checkpoint, another process) is measured again, up to three times, and every
/// window is reported. The targets must hold in one whole window: returns the last.
async fn up_to_3_windows(
    what: &str,
    met: fn(&Run) -> bool,
    mut window: impl AsyncFnMut() -> Run,
) -> Run {
    let mut n = 1;
    loop {
        let run = window().await;
        eprintln!("{what}, window {n}: {run:?}");
        if met(&run) || n == 3 {
            return run;
        }
        n += 1;
    }
}

/// A fresh table and exchange, and a relay (`ordering = "aggregate"`) connected to the broker.
async fn start(test: &str, notify: bool, poll: &str) -> (TestTable, RabbitFixture, RelayProcess) {
    let (table, rabbit) = table_and_exchange(test).await;
    let relay = RelayBuilder::for_test(&table, &rabbit, test)
        .set("relay.ordering", "aggregate")
        .set("relay.notify", notify.to_string())
        .set("relay.poll_interval", poll)
        .spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
    (table, rabbit, relay)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_to_consume_latency_with_and_without_notify() {
    // With NOTIFY: 200 rows/s for 10 s, then one row at a time into the idle relay (it has gone
    // back to waiting before each).
    let (table, rabbit, relay) = start("latency_notify", true, "1s").await;
    let notify = up_to_3_windows(
        "latency with NOTIFY at 200 rows/s",
        |r| r.p50 < 10 * MS && r.p99 < 50 * MS,
        async || measure(&table, &rabbit, 200, 10).await,
    )
    .await;
    let idle = up_to_3_windows(
        "one row into an idle relay, 100 tries",
        |r| r.p50 < 10 * MS,
        async || measure_idle(&table, &rabbit, 100).await,
    )
    .await;
    finish(relay, table, rabbit).await;
    assert!(idle.p50 < 10 * MS, "idle p50 {:?} ≥ 10 ms", idle.p50);
    assert!(notify.p50 < 10 * MS, "p50 {:?} ≥ 10 ms", notify.p50);
    assert!(notify.p99 < 50 * MS, "p99 {:?} ≥ 50 ms", notify.p99);

    // Without NOTIFY: bounded by the poll interval (plus a claim and a publish).
    let poll = 300 * MS;
    let (table, rabbit, relay) = start("latency_poll", false, "300ms").await;
    let polled = measure(&table, &rabbit, 50, 4).await;
    eprintln!("latency without NOTIFY (poll_interval 300ms) at 50 rows/s: {polled:?}");
    finish(relay, table, rabbit).await;
    // The poll is jittered by ±10 %; allow a claim and a publish on top.
    assert!(
        polled.max < poll.mul_f64(1.1) + 150 * MS,
        "max {:?} exceeds the poll interval",
        polled.max
    );
    assert!(
        polled.p50 > notify.p50,
        "polling ({:?}) should be slower than NOTIFY ({:?})",
        polled.p50,
        notify.p50
    );
}
