//! End-to-end tests of `outbox-relay run` against the local PostgreSQL and RabbitMQ: the real
//! binary as a child process, configured only through `RELAY_*` variables, each test on its
//! own table, exchange and queue.

// Tests fail by panicking: unwrap/expect are the clearest way to say "this must work here".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::expected_row_headers;
use common::{
    Analysis, Delivered, NewRow, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, RowState,
    TempDir, TestTable, analyse, assert_none, bulk_row, concurrent_writers, drop_both, finish,
    not_sent_cleanly, not_sent_once, spawn_paced_writer, table_and_exchange, time_problem,
    wait_for_count, wait_until,
};
use serde_json::{Value, json};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

/// Checks one delivery against its row (contract §4); returns the problems found.
fn envelope_problems(d: &Delivered, row: &RowState, source: &str) -> Vec<String> {
    let mut p = Vec::new();
    let props = &d.properties;
    let mut check = |ok: bool, what: String| {
        if !ok {
            p.push(what);
        }
    };
    check(
        props.kind().as_ref().map(|s| s.as_str()) == Some(row.event_type.as_str()),
        format!("type {:?} != {:?}", props.kind(), row.event_type),
    );
    check(
        *props.timestamp() == Some(u64::try_from(row.created_at.timestamp()).unwrap()),
        format!(
            "timestamp {:?} != created_at {}",
            props.timestamp(),
            row.created_at
        ),
    );
    check(
        props.content_type().as_ref().map(|s| s.as_str()) == Some("application/json"),
        format!("content_type {:?}", props.content_type()),
    );
    check(
        *props.delivery_mode() == Some(2),
        format!("delivery_mode {:?}", props.delivery_mode()),
    );
    check(
        d.routing_key == format!("{}.{}", row.aggregate_type, row.event_type),
        format!("routing key {:?}", d.routing_key),
    );
    match serde_json::from_slice::<Value>(&d.body) {
        Ok(body) => check(
            body == row.payload,
            format!("body {body} != payload {}", row.payload),
        ),
        Err(e) => check(false, format!("body is not JSON: {e}")),
    }

    let headers = d.headers();
    let ce = |name: &str| headers.get(&format!("cloudEvents:{name}")).cloned();
    let id = row.id.to_string();
    check(
        ce("id").as_deref() == Some(id.as_str()),
        format!("cloudEvents:id {:?}", ce("id")),
    );
    check(
        ce("type").as_deref() == Some(row.event_type.as_str()),
        format!("cloudEvents:type {:?}", ce("type")),
    );
    check(
        ce("source").as_deref() == Some(source),
        format!("cloudEvents:source {:?}", ce("source")),
    );
    check(
        ce("specversion").as_deref() == Some("1.0"),
        format!("cloudEvents:specversion {:?}", ce("specversion")),
    );
    check(
        ce("aggregatetype").as_deref() == Some(row.aggregate_type.as_str()),
        format!("cloudEvents:aggregatetype {:?}", ce("aggregatetype")),
    );
    check(
        ce("subject") == row.aggregate_id,
        format!(
            "cloudEvents:subject {:?} != {:?}",
            ce("subject"),
            row.aggregate_id
        ),
    );
    if let Some(problem) = time_problem("cloudEvents:time", ce("time").as_deref(), row.created_at) {
        check(false, problem);
    }

    let own: BTreeMap<String, String> = headers
        .iter()
        .filter(|(k, _)| !k.starts_with("cloudEvents:"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let expected = expected_row_headers(&row.headers);
    check(
        own == expected,
        format!("row headers {own:?} != expected {expected:?}"),
    );
    p
}

/// The deliveries checked against `rows`, in arrival order.
fn analysis(rows: &[RowState], rabbit: &RabbitFixture) -> Analysis {
    let deliveries = rabbit.deliveries();
    analyse(rows, deliveries.iter().map(|d| d.message_id.as_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_arrive_exactly_once_with_the_contract_envelope() {
    let (table, rabbit) = table_and_exchange("bulk_none").await;
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "bulk-none")
        .set("relay.ordering", "none")
        .spawn();

    let writers = concurrent_writers(
        &table.name,
        4,
        2500,
        25,
        Duration::from_millis(1),
        |_, n| bulk_row(n),
    );
    assert_eq!(writers.await.len(), 10_000);

    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    assert!(
        relay.is_running(),
        "relay exited early:\n{}",
        relay.stderr()
    );

    let rows = table.rows().await;
    assert_eq!(rows.len(), 10_000);
    analysis(&rows, &rabbit)
        .ignoring_order()
        .assert_exactly_once("bulk");
    let by_id: HashMap<String, Delivered> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| (d.message_id.clone(), d))
        .collect();
    let source = table.default_source();
    let mut problems = not_sent_cleanly(&rows);
    for row in &rows {
        for p in envelope_problems(&by_id[&row.id.to_string()], row, &source) {
            problems.push(format!("{} (seq {}): {p}", row.id, row.seq));
        }
    }
    assert_none("envelope or row problems", &problems);
    // The fixture covers what it claims to: rows without aggregate id, headers with nulls.
    assert!(rows.iter().any(|r| r.aggregate_id.is_none()));
    assert!(by_id.values().all(|d| !d.headers().contains_key("gone")));

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_ordering_delivers_each_aggregate_in_seq_order() {
    let (table, rabbit) = table_and_exchange("bulk_aggregate").await;
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "bulk-aggregate")
        .set("relay.ordering", "aggregate")
        .spawn();

    // 20 aggregates shared by all writers, so one aggregate's rows come from overlapping
    // transactions that may commit out of seq order.
    let inserted = concurrent_writers(&table.name, 4, 500, 10, Duration::from_millis(5), |w, n| {
        let agg = format!("a-{}", (w * 7 + n * 3) % 20);
        NewRow::new(
            "account",
            Some(&agg),
            "changed",
            json!({"n": n, "writer": w}),
        )
    })
    .await;
    assert_eq!(inserted.len(), 2000);

    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    assert!(
        relay.is_running(),
        "relay exited early:\n{}",
        relay.stderr()
    );
    let rows = table.rows().await;
    assert_eq!(rows.len(), 2000);
    // Exactly once, and each aggregate in seq order.
    analysis(&rows, &rabbit).assert_exactly_once("aggregate ordering");
    let aggregates: HashSet<String> = rows.iter().filter_map(RowState::aggregate).collect();
    assert_eq!(aggregates.len(), 20);
    assert_none("rows not sent once", &not_sent_once(&rows));

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_row_backs_off_and_dead_letters_without_blocking_others() {
    let table = TestTable::new("unroutable").await;
    // Only `ok.#` reaches a queue: the row routed to `nowhere` is returned (mandatory).
    let rabbit = RabbitFixture::new("unroutable", "ok.#", "ok.barrier").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "unroutable")
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "2s")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "4")
        .set("relay.poll_interval", "50ms")
        // One message in flight at a time: this test is about backoff and dead-lettering;
        // returns under concurrent publishes are the subject of
        // returned_messages_are_charged_to_the_right_row_under_concurrency.
        .set("relay.batch_size", "1")
        .set("relay.max_in_flight", "1")
        .spawn();
    // Start the clock only once the relay is up (its start-up is not part of any delay).
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;

    let bad = table
        .insert(&[
            NewRow::new("ok", Some("bad-1"), "x", json!({"bad": true})).destination("nowhere")
        ])
        .await[0]
        .id;
    // 200 routable rows (routing key ok.x) inserted while the bad row is being retried.
    let writer = spawn_paced_writer(
        &table.name,
        20,
        10,
        Duration::from_millis(25),
        move |b, i| {
            NewRow::new(
                "ok",
                Some(&format!("good-{}", i % 7)),
                "x",
                json!({"b": b, "i": i}),
            )
        },
    );

    // Watch the bad row closely: one observation per distinct (attempts, status), with the
    // test-clock times that bound when the change happened (same host clock as the database).
    struct Seen {
        row: RowState,
        // When the query that first showed this state returned.
        first_seen: DateTime<Utc>,
        // When the previous query (which still showed the earlier state) was sent.
        prev_asked: DateTime<Utc>,
    }
    let mut seen: Vec<Seen> = Vec::new();
    let mut sent_while_retrying = 0;
    let started = Instant::now();
    let mut prev_asked = Utc::now();
    let last = loop {
        let asked = Utc::now();
        let r = table.row(bad).await;
        let answered = Utc::now();
        if r.status == "pending" && r.attempts > 0 {
            sent_while_retrying = table.count_where("status = 'sent'").await;
        }
        if seen
            .last()
            .is_none_or(|p| (p.row.attempts, &p.row.status) != (r.attempts, &r.status))
        {
            seen.push(Seen {
                row: r.clone(),
                first_seen: answered,
                prev_asked,
            });
        }
        if r.status == "failed" {
            break r;
        }
        prev_asked = asked;
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the unroutable row was not dead-lettered within 30s; observed {:?}\n{}",
            seen.iter()
                .map(|s| (s.row.attempts, s.row.status.clone()))
                .collect::<Vec<_>>(),
            relay.stderr()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };

    assert_eq!(last.attempts, 4, "dead-lettered after max_attempts");
    assert!(last.locked_by.is_none());
    let err = last.last_error.clone().unwrap_or_default();
    assert!(
        err.contains("NO_ROUTE"),
        "last_error should name NO_ROUTE: {err:?}"
    );

    // Backoff: seen pending after attempts 1, 2, 3 (attempts rising), each with NO_ROUTE.
    let pending: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.row.status == "pending" && s.row.attempts > 0)
        .collect();
    let attempts: Vec<i32> = pending.iter().map(|s| s.row.attempts).collect();
    assert_eq!(
        attempts,
        vec![1, 2, 3],
        "attempts seen while pending (backoff states)"
    );
    for s in &pending {
        assert!(
            s.row
                .last_error
                .as_deref()
                .unwrap_or_default()
                .contains("NO_ROUTE"),
            "{:?}",
            s.row
        );
    }
    // available_at gaps: attempt k+1 is claimed only after available_at_k, then waits
    // delay_{k+1}, so gap_k >= delay_{k+1} = 200ms, 400ms.
    let ms = chrono::Duration::milliseconds;
    let av: Vec<DateTime<Utc>> = pending.iter().map(|s| s.row.available_at).collect();
    let (g1, g2) = (av[1] - av[0], av[2] - av[1]);
    println!("unroutable: available_at gaps {g1} then {g2}");
    assert!(g1 >= ms(200), "gap after attempt 2: {g1}");
    assert!(g2 >= ms(400), "gap after attempt 3: {g2}");
    // Each delay (available_at minus the failure's time) is bounded from both sides by the
    // observations; the schedule 100ms, 200ms, 400ms (jitter 0) must fit inside the bounds.
    // Lower bound: the failure committed before the state was first seen. Upper bound: it
    // happened after the previous query was sent (less 100ms for the statement's own run
    // time), and after the previous available_at (no claim before it).
    for (k, s) in pending.iter().enumerate() {
        let nominal = ms(100 << k);
        let lower = s.row.available_at - s.first_seen;
        let mut failed_after = s.prev_asked - ms(100);
        if k > 0 {
            failed_after = failed_after.max(av[k - 1]);
        }
        let upper = s.row.available_at - failed_after;
        assert!(
            lower <= nominal + ms(5) && nominal <= upper + ms(5),
            "delay after attempt {} must be {nominal}, observed between {lower} and {upper}",
            k + 1
        );
    }

    let good = writer.await.unwrap();
    assert_eq!(good.len(), 200);
    table
        .wait_for_counts(LONG, "the 200 routable rows are sent", |c| c["sent"] == 200)
        .await;
    assert!(
        sent_while_retrying > 0,
        "routable rows must flow while the bad row is in backoff"
    );
    rabbit.barrier().await;
    // Every routable row exactly once, and nothing else (the bad row would be foreign).
    let good_rows: Vec<RowState> = table.rows_by_id(&good).await.into_values().collect();
    analysis(&good_rows, &rabbit)
        .ignoring_order()
        .assert_exactly_once("routable rows");
    let counts = table.status_counts().await;
    assert_eq!(
        (
            counts["sent"],
            counts["failed"],
            counts["pending"],
            counts["processing"]
        ),
        (200, 1, 0, 0)
    );
    assert!(relay.log_count("dead-lettered") >= 1, "{}", relay.stderr());

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_held_by_a_killed_relay_are_reclaimed_after_the_lease() {
    let (table, rabbit) = table_and_exchange("sigkill").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let mut a = RelayBuilder::for_test(&table, &rabbit, "a")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.lease_timeout", "3s")
        .spawn();

    // Warm-up: A is connected through the proxy and publishing.
    let warm = table
        .insert_ids(&NewRow::numbered(5, "warm", None, "w"))
        .await;
    rabbit.wait_for_ids(&warm, Duration::from_secs(30)).await;

    // Black-hole the broker: A's publishes are written but never confirmed.
    proxy.stall();
    let rows: Vec<NewRow> = NewRow::numbered(100, "held", Some(("h-", 10)), "e");
    let held: Vec<Uuid> = table.insert_ids(&rows).await;
    let before: HashMap<Uuid, RowState> = wait_until(
        Duration::from_secs(10),
        "A holds all 100 rows",
        async || {
            let by_id = table.rows_by_id(&held).await;
            let by_a = by_id
                .values()
                .filter(|r| r.status == "processing" && r.locked_by.as_deref() == Some("a"))
                .count();
            if by_a == held.len() {
                Ok(by_id)
            } else {
                Err(format!("{by_a} processing by a"))
            }
        },
    )
    .await;
    let leaked = held
        .iter()
        .filter(|id| rabbit.id_counts().contains_key(&id.to_string()))
        .count();
    assert_eq!(leaked, 0, "the stalled proxy let messages through");

    a.sigkill();
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(
        status.signal(),
        Some(9),
        "relay a should die by SIGKILL: {status}"
    );
    proxy.cut(); // drop A's stale connection and whatever it had written
    proxy.heal();
    assert_eq!(
        table
            .count_where("status = 'processing' AND locked_by = 'a'")
            .await,
        100,
        "a dead relay's rows stay processing until the lease expires"
    );

    // Debug logs of the relay loop show why a reclaim is skipped, should this fail.
    let b = RelayBuilder::for_test(&table, &rabbit, "b")
        .set("relay.lease_timeout", "3s")
        .env("RUST_LOG", "info,lapin=error,outbox_relay::relay=debug")
        .spawn();
    table.wait_all_sent(Duration::from_secs(30)).await;
    rabbit.barrier().await;

    let after = table.rows_by_id(&held).await;
    // Every held row arrived; each aggregate's first arrivals are in seq order (ordering held
    // across the crash).
    let held_rows: Vec<RowState> = after.values().cloned().collect();
    let a = analysis(&held_rows, &rabbit);
    assert_none("rows held by the killed relay never arrived", &a.lost);
    assert_none("first arrivals out of seq order", &a.reordered);
    let dups = a.duplicated_ids();
    println!(
        "sigkill: {} ids delivered more than once: {dups:?}",
        dups.len()
    );
    for id in &held {
        let (was, now) = (&before[id], &after[id]);
        assert_eq!(now.status, "sent");
        assert!(now.locked_by.is_none());
        assert_eq!(
            now.attempts,
            was.attempts + 1,
            "reclaimed row {id}: one attempt by a, one by b"
        );
        let lease_end = was.locked_at.unwrap() + chrono::Duration::seconds(3);
        assert!(
            now.sent_at.unwrap() >= lease_end,
            "row {id} sent at {:?}, before a's lease ended at {lease_end}",
            now.sent_at
        );
    }
    assert!(
        b.log_count("reclaimed rows whose relay stopped") >= 1,
        "{}",
        b.stderr()
    );

    finish(b, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_zero_and_leaves_nothing_processing() {
    let (table, rabbit) = table_and_exchange("sigterm").await;
    for chunk in 0..10 {
        let rows: Vec<NewRow> = (0..500)
            .map(|i| {
                NewRow::new(
                    "term",
                    Some(&format!("t-{}", i % 50)),
                    "e",
                    json!({"chunk": chunk, "i": i}),
                )
            })
            .collect();
        table.insert(&rows).await;
    }
    let instance = "sigterm-1";
    let mut relay = RelayBuilder::for_test(&table, &rabbit, instance)
        .set("relay.ordering", "none")
        .set("relay.shutdown_timeout", "10s")
        .spawn();
    wait_for_count(
        Duration::from_secs(60),
        "500 messages delivered",
        500,
        || rabbit.count(),
    )
    .await;

    let t0 = Instant::now();
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(15)).await;
    let took = t0.elapsed();
    assert!(
        status.success(),
        "exit status {status} after SIGTERM\n{}",
        relay.stderr()
    );
    assert!(
        took <= Duration::from_secs(12),
        "shutdown took {took:?} (shutdown_timeout 10s)"
    );

    let counts = table.status_counts().await;
    println!(
        "sigterm after {} deliveries; exited in {took:?}; rows: {counts:?}",
        rabbit.count()
    );
    assert_eq!(
        table
            .count_where(&format!(
                "status = 'processing' AND locked_by = '{instance}'"
            ))
            .await,
        0,
        "rows left processing by the stopped relay: {counts:?}"
    );
    assert_eq!(counts["failed"], 0);
    assert_eq!(counts["sent"] + counts["pending"], 5000);
    assert_eq!(
        table
            .count_where("status = 'pending' AND (attempts <> 0 OR locked_by IS NOT NULL)")
            .await,
        0
    );
    assert_eq!(
        table.count_where("status = 'sent' AND attempts <> 1").await,
        0
    );

    // Every row marked sent was really delivered.
    rabbit.barrier().await;
    let delivered = rabbit.id_counts();
    let sent_ids: Vec<Uuid> = table
        .rows()
        .await
        .into_iter()
        .filter(|r| r.status == "sent")
        .map(|r| r.id)
        .collect();
    let undelivered = sent_ids
        .iter()
        .filter(|id| !delivered.contains_key(&id.to_string()))
        .count();
    assert_eq!(undelivered, 0, "rows marked sent but never delivered");

    // What was handed back is published by the next relay.
    let next = RelayBuilder::for_test(&table, &rabbit, "sigterm-2")
        .set("relay.ordering", "none")
        .spawn();
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    let delivered = rabbit.id_counts();
    assert_eq!(
        table
            .rows()
            .await
            .iter()
            .filter(|r| !delivered.contains_key(&r.id.to_string()))
            .count(),
        0
    );

    finish(next, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_messages_are_charged_to_the_right_row_under_concurrency() {
    let table = TestTable::new("mixed_routes").await;
    let rabbit = RabbitFixture::new("mixed_routes", "ok.#", "ok.barrier").await;
    // One attempt each: a row charged with someone else's NO_ROUTE is dead-lettered at once.
    let relay = RelayBuilder::for_test(&table, &rabbit, "mixed-routes")
        .set("relay.ordering", "none")
        .set("retry.max_attempts", "1")
        .spawn();
    // Every 10th row is unroutable; all are published concurrently on one channel.
    let rows: Vec<NewRow> = (0..2000)
        .map(|i| {
            let row = NewRow::new("ok", None, "x", json!({"i": i}));
            if i % 10 == 3 {
                row.destination("nowhere")
            } else {
                row
            }
        })
        .collect();
    let inserted = table.insert(&rows).await;
    table
        .wait_for_counts(LONG, "every row is settled", |c| {
            c["pending"] + c["processing"] == 0
        })
        .await;
    rabbit.barrier().await;

    let states = table
        .rows_by_id(&inserted.iter().map(|r| r.id).collect::<Vec<_>>())
        .await;
    let delivered = rabbit.id_counts();
    let mut wrong = Vec::new();
    for r in states.values() {
        let unroutable = r.destination.is_some();
        let ok = if unroutable {
            r.status == "failed"
                && r.last_error
                    .as_deref()
                    .unwrap_or_default()
                    .contains("NO_ROUTE")
        } else {
            r.status == "sent" && delivered.contains_key(&r.id.to_string())
        };
        if !ok {
            wrong.push(format!(
                "{} ({}): status {}, delivered {} time(s), last_error {:?}",
                r.id,
                if unroutable { "unroutable" } else { "routable" },
                r.status,
                delivered.get(&r.id.to_string()).copied().unwrap_or(0),
                r.last_error
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} rows classified wrongly (an unroutable row marked sent was dropped by the broker; a routable row failed with NO_ROUTE was charged with another row's return), first 10:\n{}",
        wrong.len(),
        wrong
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );

    finish(relay, table, rabbit).await;
}

/// The publisher keeps thousands of messages unconfirmed on at most 4 channels, so RabbitMQ
/// acks routable and unroutable messages together in `multiple` acks and lapin hands each
/// `basic.return` to whichever confirm it completes first. Every return must still be charged
/// to the row whose `message_id` it carries: no unroutable row marked sent (the broker dropped
/// it), no routable row blamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_messages_share_multiple_acks_and_are_charged_by_message_id() {
    const ROWS: usize = 20_000;
    let table = TestTable::new("shared_acks").await;
    let rabbit = RabbitFixture::new("shared_acks", "ok.#", "ok.barrier").await;
    // 1% unroutable: a `destination` routing key nothing is bound to.
    let rows: Vec<NewRow> = (0..ROWS)
        .map(|i| {
            let row = NewRow::new("ok", None, "x", json!({"i": i}));
            if i % 100 == 37 {
                row.destination("nowhere.at.all")
            } else {
                row
            }
        })
        .collect();
    let mut inserted = Vec::with_capacity(ROWS);
    for chunk in rows.chunks(2000) {
        inserted.extend(table.insert(chunk).await);
    }
    let unroutable = ROWS / 100;
    // Big claims and a big window: thousands of messages unconfirmed at once. A long backoff
    // keeps a failed row pending after its one attempt, so a blamed routable row stays visible.
    let relay = RelayBuilder::for_test(&table, &rabbit, "shared-acks")
        .set("relay.ordering", "none")
        .set("relay.batch_size", "2000")
        .set("relay.max_in_flight", "8000")
        .set("retry.base_delay", "1h")
        .set("retry.max_delay", "1h")
        .spawn();
    let expected_sent = i64::try_from(ROWS - unroutable).unwrap();
    // Every row is published once and settled.
    table
        .wait_count("attempts = 0 OR status = 'processing'", 0, LONG)
        .await;
    rabbit.barrier().await;

    let states = table
        .rows_by_id(&inserted.iter().map(|r| r.id).collect::<Vec<_>>())
        .await;
    let delivered = rabbit.id_counts();
    let (mut unroutable_sent, mut routable_blamed, mut other) =
        (Vec::new(), Vec::new(), Vec::new());
    for r in states.values() {
        let id = r.id.to_string();
        let error = r.last_error.as_deref().unwrap_or_default();
        if r.destination.is_some() {
            if r.status == "sent" {
                unroutable_sent.push(id);
            } else if !(r.status == "pending" && r.attempts == 1 && error.contains("NO_ROUTE"))
                || delivered.contains_key(&id)
            {
                other.push(format!(
                    "unroutable {id}: {} {} {error:?}",
                    r.status, r.attempts
                ));
            }
        } else if r.status != "sent" {
            routable_blamed.push(format!("{id}: {} {} {error:?}", r.status, r.attempts));
        } else if r.attempts != 1 || !delivered.contains_key(&id) {
            other.push(format!(
                "routable {id}: attempts {}, delivered {:?}",
                r.attempts,
                delivered.get(&id)
            ));
        }
    }
    println!(
        "shared acks: {ROWS} rows, {unroutable} unroutable; unroutable marked sent {}, routable blamed {}, other {}",
        unroutable_sent.len(),
        routable_blamed.len(),
        other.len()
    );
    assert!(
        unroutable_sent.is_empty(),
        "{} unroutable rows marked sent (the broker dropped them), e.g. {:?}",
        unroutable_sent.len(),
        &unroutable_sent[..unroutable_sent.len().min(5)]
    );
    assert!(
        routable_blamed.is_empty(),
        "{} routable rows charged with another row's return, e.g. {:?}",
        routable_blamed.len(),
        &routable_blamed[..routable_blamed.len().min(5)]
    );
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(table.count_where("status = 'sent'").await, expected_sent);

    finish(relay, table, rabbit).await;
}

/// Starts a relay whose broker connection goes through `proxy`, proves it is publishing with a
/// few warm-up rows, then black-holes the proxy and inserts `n` rows; returns their ids once
/// the relay holds them all in `processing`.
async fn hold_rows_behind_a_black_hole(
    table: &TestTable,
    rabbit: &RabbitFixture,
    proxy: &Proxy,
    instance: &str,
    n: usize,
) -> Vec<Uuid> {
    let warm = table
        .insert_ids(&NewRow::numbered(3, "warm", None, "w"))
        .await;
    rabbit.wait_for_ids(&warm, Duration::from_secs(30)).await;
    proxy.stall();
    let rows: Vec<NewRow> = NewRow::numbered(n, "hole", Some(("h-", 5)), "e");
    let ids: Vec<Uuid> = table.insert_ids(&rows).await;
    let held = format!("status = 'processing' AND locked_by = '{instance}'");
    let n = i64::try_from(n).unwrap();
    table.wait_count(&held, n, Duration::from_secs(10)).await;
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_publishes_time_out_and_are_handed_back_without_spending_attempts() {
    let (table, rabbit) = table_and_exchange("black_hole").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    // max_attempts 2: were a timed-out publish counted as a message failure, the second
    // round would dead-letter the rows.
    let relay = RelayBuilder::for_test(&table, &rabbit, "black-hole")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "1s")
        .set("relay.ordering", "none")
        .set("relay.lease_timeout", "60s")
        .set("retry.max_attempts", "2")
        .spawn();
    let ids = hold_rows_behind_a_black_hole(&table, &rabbit, &proxy, "black-hole", 50).await;

    // confirm_timeout passes: every row is handed back, attempt refunded.
    let refunded = "status = 'pending' AND attempts = 0 AND locked_by IS NULL";
    table
        .wait_count(refunded, 50, Duration::from_secs(15))
        .await;
    assert!(
        relay.log_count("no confirm within") >= 1,
        "{}",
        relay.stderr()
    );
    assert_eq!(table.count_where("status = 'failed'").await, 0);

    // The network comes back (bytes held by the black hole are delivered late).
    proxy.heal();
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    let counts = rabbit.id_counts();
    let missing = ids
        .iter()
        .filter(|id| !counts.contains_key(&id.to_string()))
        .count();
    assert_eq!(missing, 0, "rows lost after the black hole");
    let dups = counts.values().filter(|n| **n > 1).count();
    println!(
        "black hole: {dups} ids delivered more than once (late bytes of the abandoned connection)"
    );
    assert_eq!(
        table.count_where("status <> 'sent' OR attempts <> 1").await,
        0,
        "every row sent on its first counted attempt"
    );

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_hung_broker_hands_rows_back_and_exits_within_shutdown_timeout() {
    let (table, rabbit) = table_and_exchange("term_hung").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let instance = "term-hung";
    let mut relay = RelayBuilder::for_test(&table, &rabbit, instance)
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.shutdown_timeout", "4s")
        .set("relay.lease_timeout", "60s")
        .spawn();
    let ids = hold_rows_behind_a_black_hole(&table, &rabbit, &proxy, instance, 40).await;

    let t0 = Instant::now();
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(30)).await;
    let took = t0.elapsed();
    println!("sigterm with a hung broker: exited with {status} after {took:?}");
    assert!(status.success(), "exit status {status}\n{}", relay.stderr());
    // The rows were handed back, not left to the lease.
    let rows = table.rows_by_id(&ids).await;
    let not_back: Vec<_> = rows
        .values()
        .filter(|r| r.status != "pending" || r.attempts != 0 || r.locked_by.is_some())
        .map(|r| (r.id, r.status.clone(), r.attempts, r.locked_by.clone()))
        .collect();
    assert!(
        not_back.is_empty(),
        "rows not handed back at shutdown: {not_back:?}\n{}",
        relay.stderr()
    );
    assert!(
        took <= Duration::from_millis(5500),
        "shutdown took {took:?} with relay.shutdown_timeout = 4s\n{}",
        relay.stderr()
    );
    drop(proxy);
    drop_both(table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_errors_exit_2_with_one_line_naming_the_key() {
    let cases: [(&str, &str, &str, &str); 4] = [
        (
            "unknown key",
            "check",
            "[relay]\nbatch_sise = 3\n",
            "relay.batch_sise",
        ),
        (
            "hostile table name",
            "check",
            "[database]\ntable = \"x; drop table y\"\n",
            "database.table",
        ),
        (
            "unparsable duration",
            "run",
            "[relay]\npoll_interval = \"soon\"\n",
            "relay.poll_interval",
        ),
        (
            "bare number duration",
            "run",
            "[retry]\nbase_delay = 5\n",
            "retry.base_delay",
        ),
    ];
    for (what, command, toml, key) in cases {
        let dir = TempDir::new("config");
        let path = dir.write("bad.toml", toml);
        let out = RelayBuilder::bare("config")
            .output(
                &["--config", path.to_str().unwrap(), command],
                Duration::from_secs(20),
            )
            .await;
        assert_eq!(out.status.code(), Some(2), "{what}: {out:?}");
        let lines: Vec<&str> = out.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{what}: stderr should be one line: {out:?}");
        assert!(
            lines[0].contains(key),
            "{what}: {:?} should name {key}",
            lines[0]
        );
        assert!(out.stdout.is_empty(), "{what}: {out:?}");
    }

    let out = RelayBuilder::bare("config")
        .output(
            &["--config", "/nonexistent/outbox-relay/relay.toml", "check"],
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        out.stderr.contains("/nonexistent/outbox-relay/relay.toml"),
        "{out:?}"
    );
    assert_eq!(out.stderr.lines().count(), 1, "{out:?}");
}

/// The Python SDK decode (`cloudevents` 2.x, when installed): reads a JSON message description
/// on stdin, prints the decoded event's attributes and data as JSON.
const PY_DECODE: &str = r#"
import json, sys
from cloudevents.core.bindings import amqp, rabbitmq
m = json.load(sys.stdin)
if m["binding"] == "rabbitmq":
    ev = rabbitmq.from_rabbitmq_event(rabbitmq.RabbitMQMessage(
        headers=m["headers"], content_type=m["content_type"], body=m["body"].encode()))
else:
    ev = amqp.from_amqp_event(amqp.AMQPMessage(
        properties={"content-type": m["content_type"]},
        application_properties=m["headers"], application_data=m["body"].encode()))
a = ev.get_attributes()
out = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in a.items()}
out["data"] = ev.get_data()
print(json.dumps(out))
"#;

fn python_sdk_available() -> bool {
    std::process::Command::new("python3")
        .args([
            "-c",
            "import cloudevents.core.bindings.rabbitmq, cloudevents.core.bindings.amqp",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn python_decode(binding: &str, d: &Delivered) -> serde_json::Value {
    use std::io::Write;
    let input = json!({
        "binding": binding,
        "headers": d.headers(),
        "content_type": d.properties.content_type().as_ref().map(ToString::to_string),
        "body": String::from_utf8(d.body.clone()).unwrap(),
    });
    let mut child = std::process::Command::new("python3")
        .args(["-c", PY_DECODE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the CloudEvents Python SDK ({binding} binding) could not decode the message: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_prefix_names_the_headers_for_each_consumer_convention() {
    let (table, rabbit) = table_and_exchange("ce_prefix").await;
    let sdk = python_sdk_available();
    if !sdk {
        eprintln!("python3 -m pip install cloudevents to also decode through the Python SDK");
    }
    let prefixes = ["cloudEvents:", "cloudEvents_", "ce-"];
    for (n, prefix) in prefixes.into_iter().enumerate() {
        let relay = RelayBuilder::for_test(&table, &rabbit, &format!("ce-prefix-{n}"))
            .set("publisher.rabbitmq.cloudevents_prefix", prefix)
            .spawn();
        let row = table
            .insert(&[NewRow::new(
                "order",
                Some(&format!("o-{n}")),
                "order.created",
                json!({"total": n}),
            )])
            .await;
        let d = rabbit.wait_for_delivery(row[0].id, LONG).await;
        relay.stop().await;
        let headers = d.headers();
        let id = row[0].id.to_string();
        let subject = format!("o-{n}");
        let source = table.default_source();
        for (attr, want) in [
            ("id", id.as_str()),
            ("type", "order.created"),
            ("source", source.as_str()),
            ("subject", subject.as_str()),
            ("specversion", "1.0"),
            ("aggregatetype", "order"),
        ] {
            assert_eq!(
                headers.get(&format!("{prefix}{attr}")).map(String::as_str),
                Some(want),
                "{prefix}{attr} in {headers:?}"
            );
        }
        assert!(headers.contains_key(&format!("{prefix}time")));
        for other in prefixes.iter().filter(|p| **p != prefix) {
            assert!(
                !headers.keys().any(|k| k.starts_with(other)),
                "{other} header with prefix {prefix}: {headers:?}"
            );
        }
        if sdk {
            let binding = if prefix == "ce-" { "rabbitmq" } else { "amqp" };
            let ev = python_decode(binding, &d);
            assert_eq!(ev["id"], json!(id), "{ev}");
            assert_eq!(ev["type"], json!("order.created"), "{ev}");
            assert_eq!(ev["source"], json!(source), "{ev}");
            assert_eq!(ev["subject"], json!(subject), "{ev}");
            assert_eq!(ev["aggregatetype"], json!("order"), "{ev}");
            assert_eq!(ev["datacontenttype"], json!("application/json"), "{ev}");
            assert_eq!(ev["data"], json!({"total": n}), "{ev}");
        }
    }
    drop_both(table, rabbit).await;
}
