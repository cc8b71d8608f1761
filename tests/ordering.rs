//! Per-aggregate ordering (`relay.ordering = "aggregate"`) against the real PostgreSQL and
//! RabbitMQ, with the binary run as a separate process: transactions committing out of `seq`
//! order, backoff and dead letters parking only their own aggregate. Replicas killed mid-run
//! with per-aggregate order checked are in `faults.rs`
//! (`sigkilled_replicas_under_load_lose_nothing_and_keep_aggregate_order`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{
    NewRow, RabbitFixture, RelayBuilder, RelayProcess, RowState, TestTable, finish, insert_rows,
    pg_connect, table_and_exchange, wait_until,
};
use serde_json::json;
use uuid::Uuid;

/// How long a message or row state may take to show up, and a CLI command to finish.
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_holds_back_later_rows_of_its_aggregate() {
    let (table, rabbit) = table_and_exchange("late_commit").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "late")
        .ordered()
        .spawn();

    // A draws seq n for aggregate X and stays open; B draws n+1 for X and commits.
    let mut a = pg_connect().await;
    let tx_a = a.transaction().await.unwrap();
    let x = |event, n| NewRow::new("order", Some("X"), event, json!({ "n": n }));
    let first = insert_rows(&tx_a, &table.name, &[x("first", 1)]).await[0];
    let second = table.insert(&[x("second", 2)]).await[0];
    assert!(first.seq < second.seq);
    // Rows without an aggregate id are never held back: this one proves the relay is running.
    let free = NewRow::new("order", None, "free", json!({}));
    let free = table.insert_one(free).await;
    rabbit.wait_for_ids(&[free], WAIT).await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // several claim rounds while A is open
    let early = rabbit.id_counts().contains_key(&second.id.to_string());
    let why = "X's seq n+1 was published while the transaction holding seq n was still open";
    assert!(!early, "{why}");
    assert_eq!(table.row(second.id).await.status, "pending");

    tx_a.commit().await.unwrap();
    let both = [first.id, second.id];
    rabbit.wait_for_ids(&both, WAIT).await;
    let in_order = [first.id.to_string(), second.id.to_string()];
    let arrivals = rabbit.deliveries().into_iter().map(|d| d.message_id);
    let order: Vec<String> = arrivals.filter(|m| in_order.contains(m)).collect();
    assert_eq!(order, in_order, "n arrives before n+1");
    finish(relay, table, rabbit).await;
}

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

/// The first arrivals of `of`, in arrival order.
fn ids_in_arrival_order(rabbit: &RabbitFixture, of: &[Uuid]) -> Vec<Uuid> {
    let mut seen = std::collections::HashSet::new();
    let ids = rabbit
        .deliveries()
        .into_iter()
        .filter_map(|d| d.message_id.parse().ok());
    ids.filter(|id| of.contains(id) && seen.insert(*id))
        .collect()
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
    assert_eq!(ids_in_arrival_order(&rabbit, &parked), parked);
    table.wait_all_sent(WAIT).await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_blocks_its_aggregate_until_retried() {
    let (table, rabbit, relay) = unroutable("blocked", 2).await;

    let dead = table
        .insert_ids(&NewRow::numbered(3, "dead", Some(("Z", 1)), "e"))
        .await;
    let others = table
        .insert_ids(&NewRow::numbered(50, "ok", Some(("Y", 5)), "e"))
        .await;
    rabbit.wait_for_ids(&others, Duration::from_secs(60)).await;
    let what = "Z's head is dead-lettered";
    let failed = |r: &RowState| r.status == "failed";
    table.wait_row(dead[0], WAIT, what, failed).await;

    let cli = async |args: &[&str]| {
        let cli = RelayBuilder::for_test(&table, &rabbit, "cli");
        cli.output(args, WAIT).await
    };
    let status = async || {
        let out = cli(&["status", "--json"]).await;
        let report: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        (report, out.stdout)
    };
    let (report, text) = status().await;
    assert_eq!(report["blocked_aggregates"], 1, "{text}");
    assert_eq!(report["by_aggregate_type"]["dead"]["blocked_aggregates"], 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in &dead[1..] {
        let r = table.row(*id).await;
        let why = "rows behind a dead letter wait";
        assert_eq!((r.status.as_str(), r.attempts), ("pending", 0), "{why}");
        let out = rabbit.id_counts().contains_key(&id.to_string());
        assert!(!out, "nothing behind a dead letter goes out");
    }

    rabbit.bind("dead.#").await;
    let retried = cli(&["dead-letters", "retry", "--id", &dead[0].to_string()]).await;
    assert!(retried.status.success(), "{}", retried.stderr);
    rabbit.wait_for_ids(&dead, WAIT).await;
    assert_eq!(ids_in_arrival_order(&rabbit, &dead), dead);
    let (report, text) = status().await;
    assert_eq!(report["blocked_aggregates"], 0, "{text}");
    finish(relay, table, rabbit).await;
}
