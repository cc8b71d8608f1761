//! Per-aggregate ordering (`relay.ordering = "aggregate"`) against the real PostgreSQL and
//! RabbitMQ, with the binary run as a separate process: backoff parking only its own
//! aggregate, and a later row waiting for its aggregate's row in flight when more aggregates
//! are in flight than the claim looks up by hash. The ordering scenarios that are the same on
//! both databases (late commits, a dead letter blocking its aggregate until retried, replicas
//! killed with SIGKILL mid-drain) are in `both_databases.rs`; `faults.rs` also kills
//! replicas under a claim audit
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

/// More aggregates in flight than the ordered claim looks up by hash (200,000 held by another
/// relay, several times its cap, so which of them the hash holds is the planner's choice): a row whose
/// aggregate has an earlier row in flight still waits for it (the claim's head probe reads
/// the waiting rows only, so past the cap each candidate probes the rows in flight), while a
/// free aggregate goes out; once the earlier rows are settled the later ones follow. With the
/// probe switched off this test fails (the claims after the table is analyzed take later
/// rows ahead of their aggregate's row in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_claims_hash_of_aggregates_in_flight_later_rows_still_wait() {
    let table = TestTable::new("busycap").await;
    let rabbit = RabbitFixture::new("busycap", "#", "it.barrier").await;
    let in_flight = format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, \
                          locked_at, locked_by) \
         SELECT CASE WHEN g <= 200 THEN 'x' ELSE 'busy' END, 'b-' || (g - 1), 'first', '{{}}', \
                'processing', 1, now(), 'another-relay' \
           FROM generate_series(1, 200000) g",
        t = table.name
    );
    table.db.batch_execute(&in_flight).await.unwrap();
    let later = table
        .insert_ids(&NewRow::numbered(200, "x", Some(("b-", 200)), "second"))
        .await;
    let later_aggregates = "aggregate_type = 'x' AND event_type = 'second'";
    assert_eq!(table.count_where(later_aggregates).await, 200);
    let free = table
        .insert_ids(&NewRow::numbered(3, "y", Some(("Y", 1)), "e"))
        .await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "busycap")
        .ordered()
        .set("relay.lease_timeout", "10m")
        .spawn();
    rabbit.wait_for_ids(&free, Duration::from_secs(120)).await;
    // With the table's statistics as they are now (the plans of the claim change with them),
    // more claims: the ones that take Z's rows have the later rows, older, among their
    // candidates.
    let analyze = format!("ANALYZE {}", table.name);
    table.db.batch_execute(&analyze).await.unwrap();
    let free = table
        .insert_ids(&NewRow::numbered(3, "z", Some(("Z", 1)), "e"))
        .await;
    rabbit.wait_for_ids(&free, Duration::from_secs(120)).await;
    for id in &later {
        let row = table.row(*id).await;
        let what = format!("{:?} waits for its row in flight", row.aggregate());
        assert_eq!(
            (row.status.as_str(), row.attempts),
            ("pending", 0),
            "{what}"
        );
        assert!(!rabbit.id_counts().contains_key(&id.to_string()), "{what}");
    }

    let settle = format!(
        "UPDATE {} SET status = 'sent', sent_at = now(), locked_by = NULL \
         WHERE status = 'processing'",
        table.name
    );
    table.db.batch_execute(&settle).await.unwrap();
    rabbit.wait_for_ids(&later, Duration::from_secs(120)).await;
    finish(relay, table, rabbit).await;
}
