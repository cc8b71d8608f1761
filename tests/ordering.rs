//! Per-aggregate ordering (`relay.ordering = "aggregate"`) against the real PostgreSQL and
//! RabbitMQ, with the binary run as separate processes: several replicas, a replica killed
//! mid-run, transactions committing out of `seq` order, backoff and dead letters parking only
//! their own aggregate.

// Tests fail by panicking: unwrap/expect are the clearest way to say "this must work here".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{
    NewRow, RabbitFixture, RelayBuilder, RelayProcess, TestTable, insert_rows, pg_connect,
    table_and_exchange, wait_for_count, wait_until,
};
use rand::seq::SliceRandom;
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(180);

fn ordered_relay(table: &TestTable, rabbit: &RabbitFixture, instance: &str) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, instance)
        .set("relay.ordering", "aggregate")
        .set("relay.poll_interval", "200ms")
}

/// For every aggregate, the `seq` of each message in order of first arrival; asserts they
/// increase, and returns how many duplicates arrived.
fn assert_first_arrivals_in_seq_order(
    rabbit: &RabbitFixture,
    rows: &HashMap<Uuid, (String, i64)>,
) -> usize {
    let mut seen = std::collections::HashSet::new();
    let mut duplicates = 0;
    let mut per_aggregate: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for d in rabbit.deliveries() {
        let id: Uuid = d.message_id.parse().expect("message_id is a uuid");
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        if let Some((agg, seq)) = rows.get(&id) {
            per_aggregate.entry(agg.clone()).or_default().push(*seq);
        }
    }
    for (agg, seqs) in &per_aggregate {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "aggregate {agg}: first arrivals out of seq order: {seqs:?}"
        );
    }
    let missing: Vec<&Uuid> = rows.keys().filter(|id| !seen.contains(*id)).collect();
    assert!(
        missing.is_empty(),
        "{} rows never arrived, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_keep_per_aggregate_order_across_a_sigkill() {
    const AGGREGATES: usize = 300;
    const EVENTS: usize = 30;
    let (table, rabbit) = table_and_exchange("replicas").await;
    let aggs = format!("{}_aggregates", table.name);
    table
        .db
        .batch_execute(&format!(
            "CREATE TABLE {aggs} (id text PRIMARY KEY, version int NOT NULL); \
             INSERT INTO {aggs} SELECT 'a' || i, 0 FROM generate_series(1, {AGGREGATES}) i;"
        ))
        .await
        .unwrap();

    let spawn = |name: &str| {
        ordered_relay(&table, &rabbit, name)
            .set("relay.lease_timeout", "3s")
            .spawn()
    };
    let mut replicas: Vec<RelayProcess> = vec![spawn("r1"), spawn("r2"), spawn("r3")];

    // Every aggregate gets exactly EVENTS events, in a random interleaving over 4 writers that
    // serialise per aggregate with SELECT … FOR UPDATE, as applications do.
    let mut events: Vec<usize> = (1..=AGGREGATES)
        .flat_map(|a| std::iter::repeat_n(a, EVENTS))
        .collect();
    events.shuffle(&mut rand::rng());
    let chunks: Vec<Vec<usize>> = events
        .chunks(events.len().div_ceil(4))
        .map(<[usize]>::to_vec)
        .collect();
    let mut writers = Vec::new();
    for chunk in chunks {
        let (table_name, aggs) = (table.name.clone(), aggs.clone());
        writers.push(tokio::spawn(async move {
            let mut db = pg_connect().await;
            for a in chunk {
                let tx = db.transaction().await.unwrap();
                let id = format!("a{a}");
                let row = tx
                    .query_one(
                        &format!("SELECT version FROM {aggs} WHERE id = $1 FOR UPDATE"),
                        &[&id],
                    )
                    .await
                    .unwrap();
                let version: i32 = row.get::<_, i32>(0) + 1;
                tx.execute(
                    &format!("UPDATE {aggs} SET version = $2 WHERE id = $1"),
                    &[&id, &version],
                )
                .await
                .unwrap();
                insert_rows(
                    &tx,
                    &table_name,
                    &[NewRow::new(
                        "account",
                        Some(&id),
                        "changed",
                        json!({ "version": version }),
                    )],
                )
                .await;
                tx.commit().await.unwrap();
            }
        }));
    }

    // Kill one replica once publishing is well under way, then bring a new one up.
    let what = "a third of the events are delivered";
    wait_for_count(LONG, what, AGGREGATES * EVENTS / 3, || rabbit.count()).await;
    replicas[1].sigkill();
    replicas[1].wait_exit(Duration::from_secs(10)).await;
    replicas.push(spawn("r4"));

    for w in writers {
        w.await.unwrap();
    }
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;

    let rows: HashMap<Uuid, (String, i64)> = table
        .rows()
        .await
        .into_iter()
        .map(|r| (r.id, (r.aggregate_id.clone().unwrap(), r.seq)))
        .collect();
    assert_eq!(rows.len(), AGGREGATES * EVENTS);
    let duplicates = assert_first_arrivals_in_seq_order(&rabbit, &rows);
    eprintln!(
        "replicas: {} rows, {duplicates} duplicates after the SIGKILL",
        rows.len()
    );

    // seq order is the writers' version order: the payload versions arrive 1, 2, 3, … per aggregate.
    let mut versions: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for d in rabbit.deliveries() {
        if seen.insert(d.message_id.clone()) {
            let v: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
            let subject = d.headers()["cloudEvents:subject"].clone();
            versions
                .entry(subject)
                .or_default()
                .push(v["version"].as_i64().unwrap());
        }
    }
    for (agg, vs) in versions {
        let expected: Vec<i64> = (1..=EVENTS as i64).collect();
        assert_eq!(vs, expected, "aggregate {agg} versions in arrival order");
    }
    for r in replicas.into_iter().filter(|r| r.label != "r2") {
        r.stop().await;
    }
    rabbit.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_commit_holds_back_later_rows_of_its_aggregate() {
    let (table, rabbit) = table_and_exchange("late_commit").await;
    let relay = ordered_relay(&table, &rabbit, "late").spawn();

    // A draws seq n for aggregate X and stays open; B draws n+1 for X and commits.
    let mut a = pg_connect().await;
    let tx_a = a.transaction().await.unwrap();
    let first = insert_rows(
        &tx_a,
        &table.name,
        &[NewRow::new("order", Some("X"), "first", json!({"n": 1}))],
    )
    .await[0];
    let second = table
        .insert(&[NewRow::new("order", Some("X"), "second", json!({"n": 2}))])
        .await[0];
    assert!(first.seq < second.seq);
    // Rows without an aggregate id are never held back: this one proves the relay is running.
    let free = table
        .insert(&[NewRow::new("order", None, "free", json!({}))])
        .await[0];
    rabbit
        .wait_for_ids(&[free.id], Duration::from_secs(30))
        .await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // several claim rounds while A is open
    assert!(
        !rabbit.id_counts().contains_key(&second.id.to_string()),
        "X's seq n+1 was published while the transaction holding seq n was still open"
    );
    assert_eq!(table.row(second.id).await.status, "pending");

    tx_a.commit().await.unwrap();
    rabbit
        .wait_for_ids(&[first.id, second.id], Duration::from_secs(30))
        .await;
    let order: Vec<String> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| d.message_id)
        .filter(|m| *m == first.id.to_string() || *m == second.id.to_string())
        .collect();
    assert_eq!(
        order,
        vec![first.id.to_string(), second.id.to_string()],
        "n arrives before n+1"
    );
    relay.stop().await;
    rabbit.teardown().await;
}

/// A table, an exchange whose queue is bound to `ok.#` only, and an ordered relay that
/// backs off fast (100 ms → 400 ms, no jitter) and dead-letters after `max_attempts`.
async fn unroutable(test: &str, max_attempts: u32) -> (TestTable, RabbitFixture, RelayProcess) {
    let table = TestTable::new(test).await;
    let rabbit = RabbitFixture::new(test, "ok.#", "ok.barrier").await;
    let relay = ordered_relay(&table, &rabbit, test)
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "400ms")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", max_attempts.to_string())
        .spawn();
    (table, rabbit, relay)
}

fn ids_in_arrival_order(rabbit: &RabbitFixture, of: &[Uuid]) -> Vec<Uuid> {
    let mut seen = std::collections::HashSet::new();
    rabbit
        .deliveries()
        .into_iter()
        .filter_map(|d| d.message_id.parse::<Uuid>().ok())
        .filter(|id| of.contains(id) && seen.insert(*id))
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
    table
        .wait_row(parked[0], Duration::from_secs(30), what, |r| {
            r.attempts >= 3
        })
        .await;
    // X's later rows may be claimed with its head for a moment and handed back when the head
    // is rejected; they never go out and never keep a spent attempt.
    wait_until(
        Duration::from_secs(10),
        "X's later rows are pending with no attempt spent",
        async || {
            let mut states = Vec::new();
            for id in &parked[1..] {
                let r = table.row(*id).await;
                states.push((r.status, r.attempts));
            }
            if states.iter().all(|(s, a)| s == "pending" && *a == 0) {
                Ok(())
            } else {
                Err(format!("{states:?}"))
            }
        },
    )
    .await;
    let early = rabbit.id_counts();
    assert!(
        parked.iter().all(|id| !early.contains_key(&id.to_string())),
        "nothing of X went out before its head"
    );

    // Fix the routing: X drains, in order.
    rabbit.bind("parked.#").await;
    rabbit.wait_for_ids(&parked, Duration::from_secs(30)).await;
    assert_eq!(ids_in_arrival_order(&rabbit, &parked), parked);
    table.wait_all_sent(Duration::from_secs(30)).await;
    relay.stop().await;
    rabbit.teardown().await;
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
    table
        .wait_row(dead[0], Duration::from_secs(30), what, |r| {
            r.status == "failed"
        })
        .await;

    let cli = |args: &'static [&'static str]| {
        RelayBuilder::for_test(&table, &rabbit, "cli").output(args, Duration::from_secs(30))
    };
    let status = cli(&["status", "--json"]).await;
    let report: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(report["blocked_aggregates"], 1, "{}", status.stdout);
    assert_eq!(report["by_aggregate_type"]["dead"]["blocked_aggregates"], 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in &dead[1..] {
        let r = table.row(*id).await;
        assert_eq!(
            (r.status.as_str(), r.attempts),
            ("pending", 0),
            "rows behind a dead letter wait"
        );
        assert!(
            !rabbit.id_counts().contains_key(&id.to_string()),
            "nothing behind a dead letter goes out"
        );
    }

    rabbit.bind("dead.#").await;
    let head = dead[0].to_string();
    let retried = RelayBuilder::for_test(&table, &rabbit, "cli")
        .output(
            &["dead-letters", "retry", "--id", &head],
            Duration::from_secs(30),
        )
        .await;
    assert!(retried.status.success(), "{}", retried.stderr);
    rabbit.wait_for_ids(&dead, Duration::from_secs(30)).await;
    assert_eq!(ids_in_arrival_order(&rabbit, &dead), dead);
    let status = cli(&["status", "--json"]).await;
    let report: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(report["blocked_aggregates"], 0, "{}", status.stdout);
    relay.stop().await;
    rabbit.teardown().await;
}
