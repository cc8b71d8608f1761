//! Per-aggregate ordering (`relay.ordering = "aggregate"`) against the real PostgreSQL and
//! RabbitMQ, with the binary run as a separate process: backoff parking only its own
//! aggregate. The ordering scenarios that are the same on both databases (late commits, a
//! dead letter blocking its aggregate until retried, replicas killed with SIGKILL mid-drain)
//! are in `both_databases.rs`; `faults.rs` also kills replicas under a claim audit
//! (`sigkilled_replicas_under_load_lose_nothing_and_keep_aggregate_order`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{
    NewRow, RabbitFixture, RelayBuilder, RelayProcess, RowState, TestTable, finish, wait_until,
};

/// How long a message or row state may take to show up, and a CLI command to finish.
const WAIT: Duration = Duration::from_secs(30);

/// A table, an exchange whose queue is bound to `ok.#` only, and an ordered relay that
/// backs off fast (100 ms → 400 ms, no jitter) and dead-letters after `max_attempts`.
async fn unroutable(test: &str, max_attempts: u32) -> (TestTable, RabbitFixture, RelayProcess) {
    let table = TestTable::new(test).await;
    let rabbit = RabbitFixture::new(test, "ok.#", "ok.barrier").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, test)
        .ordered()
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "400ms")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", max_attempts.to_string())
        .spawn();
    (table, rabbit, relay)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_parks_only_its_aggregate() {
    let (table, rabbit, relay) = unroutable("parked", 1000).await;

    // Aggregate X routes to `parked.e`, which nothing is bound to yet.
    let parked = table
        .insert_ids(&NewRow::numbered(5, "parked", Some(("X", 1)), "e"))
        .await;
    let others = table
        .insert_ids(&NewRow::numbered(100, "ok", Some(("Y", 20)), "e"))
        .await;
    rabbit.wait_for_ids(&others, Duration::from_secs(60)).await;
    let what = "X's head has been retried";
    let retried = |r: &RowState| r.attempts >= 3;
    table.wait_row(parked[0], WAIT, what, retried).await;
    // X's later rows may be claimed with its head for a moment and handed back when the head
    // is rejected; they never go out and never keep a spent attempt.
    let what = "X's later rows are pending with no attempt spent";
    wait_until(Duration::from_secs(10), what, async || {
        let mut states = Vec::new();
        for id in &parked[1..] {
            let r = table.row(*id).await;
            states.push((r.status, r.attempts));
        }
        match states.iter().all(|(s, a)| s == "pending" && *a == 0) {
            true => Ok(()),
            false => Err(format!("{states:?}")),
        }
    })
    .await;
    let early = rabbit.id_counts();
    let none_early = parked.iter().all(|id| !early.contains_key(&id.to_string()));
    assert!(none_early, "nothing of X went out before its head");

    // Fix the routing: X drains, in order.
    rabbit.bind("parked.#").await;
    rabbit.wait_for_ids(&parked, WAIT).await;
    assert_eq!(rabbit.arrival_order(&parked), parked);
    table.wait_all_sent(WAIT).await;
    finish(relay, table, rabbit).await;
}
