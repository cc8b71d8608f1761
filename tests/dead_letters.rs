//! Retries and dead letters (contract §2, §3), end to end: a row that cannot be delivered
//! (unroutable on RabbitMQ; a missing topic, an oversize record, a record failing in the middle
//! of an aggregate's run on Kafka) backs off on the configured schedule, is dead-lettered after
//! `retry.max_attempts`, holds back the rest of its aggregate only, and never stops the rows of
//! other aggregates.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::kafka::{
    Collector, KAFKA, Record, assert_each_once, create_topic, finish_topics, kafka_relay,
    topic_name,
};
use common::{
    NewRow, RabbitFixture, RelayBuilder, RelayProcess, RowState, TempDir, TestTable, finish,
    spawn_paced_writer, wait_until,
};
use serde_json::json;
use tokio::task::JoinHandle;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

/// The 200 good rows of `writer` (written while the bad rows were retried): waits until they
/// are sent, and asserts that some had been sent while a bad row was in backoff
/// (`sent_while_retrying`, the `sent` count seen then). Returns their ids.
async fn good_rows_flowed(
    table: &TestTable,
    writer: JoinHandle<Vec<Uuid>>,
    sent_while_retrying: i64,
) -> Vec<Uuid> {
    let good = writer.await.unwrap();
    assert_eq!(good.len(), 200);
    table
        .wait_for_counts(LONG, "the 200 good rows are sent", |c| c["sent"] == 200)
        .await;
    assert!(
        sent_while_retrying > 0,
        "good rows must flow while the bad rows are in backoff"
    );
    good
}

/// The 200 good rows sent, the `failed` bad rows dead-lettered (and logged so), nothing else
/// left.
async fn assert_settled(table: &TestTable, relay: &RelayProcess, failed: i64) {
    let c = table.status_counts().await;
    assert_eq!(
        (c["sent"], c["failed"], c["pending"], c["processing"]),
        (200, failed, 0, 0)
    );
    let logged = relay.log_count("dead-lettered");
    assert!(logged >= failed as usize, "{}", relay.stderr());
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
        .insert_one(
            NewRow::new("ok", Some("bad-1"), "x", json!({"bad": true})).destination("nowhere"),
        )
        .await;
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

    let good = good_rows_flowed(&table, writer, sent_while_retrying).await;
    rabbit.barrier().await;
    // Every routable row exactly once, and nothing else (the bad row would be foreign).
    let good_rows: Vec<RowState> = table.rows_by_id(&good).await.into_values().collect();
    rabbit
        .analyse(&good_rows)
        .ignoring_order()
        .assert_exactly_once("routable rows");
    assert_settled(&table, &relay, 1).await;

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_for_a_missing_topic_dead_letter_while_the_others_are_sent() {
    let table = TestTable::new("kafka_missing_topic").await;
    let topic = topic_name("good");
    let missing = topic_name("missing");
    create_topic(KAFKA, &topic).await;
    let consumer = Collector::start(KAFKA, &[&topic]);

    // librdkafka waits topic.metadata.propagation.max.ms (30 s by default) before failing
    // messages for a topic the cluster does not know: shorten it (a dotted key: config file).
    let dir = TempDir::new("kafka-missing-topic");
    let config = dir.write(
        "relay.toml",
        "[publisher.kafka.properties]\n\"topic.metadata.propagation.max.ms\" = \"1000\"\n",
    );
    let relay = kafka_relay(&table, KAFKA, "{aggregate_type}", "kafka-missing-topic")
        .set("relay.ordering", "none")
        .set("relay.poll_interval", "50ms")
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "1s")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "3")
        .spawn_with(&["--config", config.to_str().unwrap(), "run"]);

    let ghost_rows: Vec<NewRow> = ["ghost-1", "ghost-2"]
        .iter()
        .map(|a| Some(*a))
        .chain([None])
        .map(|a| NewRow::new("ghost", a, "lost", json!({"to": "nowhere"})).destination(&missing))
        .collect();
    let ghosts: Vec<Uuid> = table.insert_ids(&ghost_rows).await;

    // 200 rows for the real topic (template {aggregate_type}) over ~2 s, while the ghosts retry.
    let topic_for_writer = topic.clone();
    let writer = spawn_paced_writer(
        &table.name,
        20,
        10,
        Duration::from_millis(100),
        move |b, i| {
            NewRow::new(
                &topic_for_writer,
                Some(&format!("good-{}", i % 7)),
                "x",
                json!({"b": b, "i": i}),
            )
        },
    );

    let mut sent_while_retrying = 0;
    let mut attempts_seen = HashSet::new();
    let dead = wait_until(LONG, "the ghost rows are failed", async || {
        let rows = table.rows_by_id(&ghosts).await;
        for r in rows.values() {
            if r.status == "pending" && r.attempts > 0 {
                attempts_seen.insert(r.attempts);
                sent_while_retrying = table.count_where("status = 'sent'").await;
            }
        }
        if rows.values().all(|r| r.status == "failed") {
            Ok(rows)
        } else {
            Err(format!(
                "{:?}",
                rows.values()
                    .map(|r| (r.status.clone(), r.attempts, r.last_error.clone()))
                    .collect::<Vec<_>>()
            ))
        }
    })
    .await;
    for r in dead.values() {
        assert_eq!(r.attempts, 3, "dead-lettered after max_attempts: {r:?}");
        assert!(r.locked_by.is_none() && r.sent_at.is_none(), "{r:?}");
        let err = r.last_error.clone().unwrap_or_default();
        assert!(
            err.to_ascii_lowercase().contains("unknown topic"),
            "last_error should name the unknown topic: {err:?}"
        );
    }
    assert!(
        attempts_seen.contains(&1) || attempts_seen.contains(&2),
        "ghost rows should be seen waiting for a retry: {attempts_seen:?}"
    );

    let good = good_rows_flowed(&table, writer, sent_while_retrying).await;
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    let records = consumer.stop().await;
    assert_each_once(
        "the real topic holds exactly the good rows",
        &records,
        &good,
    );
    assert_settled(&table, &relay, 3).await;

    finish_topics(relay, table, &[&topic]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_payload_dead_letters_without_stopping_the_relay() {
    let table = TestTable::new("kafka_oversize").await;
    let topic = topic_name("oversize");
    create_topic(KAFKA, &topic).await;
    let consumer = Collector::start(KAFKA, &[&topic]);
    let mut relay = kafka_relay(&table, KAFKA, &topic, "kafka-oversize")
        .set("relay.poll_interval", "50ms")
        .set("retry.base_delay", "100ms")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "2")
        .spawn();

    let small = |tag: &str, i: usize| {
        NewRow::new(
            "blob",
            Some(&format!("s-{}", i % 5)),
            "small",
            json!({"tag": tag, "i": i}),
        )
    };
    let before: Vec<NewRow> = (0..50).map(|i| small("before", i)).collect();
    let mut ids: Vec<Uuid> = table.insert_ids(&before).await;
    // A 2 MB JSON string (librdkafka's message.max.bytes is 1 MB), then a later row of the
    // same aggregate, which the dead letter must hold back (contract §3).
    let big = table
        .insert_one(NewRow::new(
            "blob",
            Some("big-1"),
            "huge",
            json!({"blob": "x".repeat(2_000_000)}),
        ))
        .await;
    let held = table
        .insert_one(NewRow::new(
            "blob",
            Some("big-1"),
            "after-huge",
            json!({"held": true}),
        ))
        .await;
    let middle: Vec<NewRow> = (0..50).map(|i| small("middle", i)).collect();
    ids.extend(table.insert(&middle).await.into_iter().map(|r| r.id));

    let dead = table
        .wait_row(big, LONG, "the oversize row is failed", |r| {
            r.status == "failed"
        })
        .await;
    assert_eq!(dead.attempts, 2, "{dead:?}");
    let err = dead.last_error.clone().unwrap_or_default();
    assert!(err.contains("MessageSizeTooLarge"), "last_error: {err:?}");

    // The relay is still up and publishing rows inserted after the dead letter.
    let after: Vec<NewRow> = (0..100).map(|i| small("after", i)).collect();
    ids.extend(table.insert(&after).await.into_iter().map(|r| r.id));
    table.wait_count("status = 'sent'", 200, LONG).await;
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    assert!(relay.is_running(), "relay exited:\n{}", relay.stderr());
    assert_each_once("the topic", &consumer.stop().await, &ids);

    // The row behind the dead letter waits, untouched, for an operator.
    let h = table.row(held).await;
    assert_eq!((h.status.as_str(), h.attempts), ("pending", 0), "{h:?}");
    assert_eq!(
        table.status_counts().await,
        BTreeMap::from([
            ("failed".to_owned(), 1),
            ("pending".to_owned(), 1),
            ("processing".to_owned(), 0),
            ("sent".to_owned(), 200),
        ])
    );
    assert!(relay.log_count("dead-lettered") >= 1, "{}", relay.stderr());

    finish_topics(relay, table, &[&topic]).await;
}

/// `ordering = "aggregate"` sends an aggregate's claimed run to the producer without waiting
/// for each delivery report. A record in the middle of a run that fails for good (larger than
/// the producer's `message.max.bytes`) must still stop its aggregate: the records before it
/// are delivered, nothing after it is delivered ahead of it (through its backoff and its dead
/// letter), no attempt of the later rows is spent, and once an operator discards the dead
/// letter the rest goes out, in order, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_failing_mid_run_stops_its_aggregate_and_the_rest_follows_in_order() {
    const RUN: usize = 20;
    const BAD: usize = 9;
    let table = TestTable::new("kafka_mid_run").await;
    let topic = topic_name("midrun");
    create_topic(KAFKA, &topic).await;
    let consumer = Collector::start(KAFKA, &[&topic]);
    // One statement, before the relay starts: its first claim holds both runs whole.
    let mut rows = Vec::new();
    for i in 0..RUN {
        rows.push(if i == BAD {
            NewRow::new(
                "t",
                Some("a"),
                "huge",
                json!({"blob": "x".repeat(2_000_000)}),
            )
        } else {
            NewRow::new("t", Some("a"), "e", json!({"i": i}))
        });
        rows.push(NewRow::new("t", Some("b"), "e", json!({"i": i})));
    }
    let inserted = table.insert(&rows).await;
    let a: Vec<Uuid> = inserted.iter().step_by(2).map(|r| r.id).collect();
    let b: Vec<Uuid> = inserted.iter().skip(1).step_by(2).map(|r| r.id).collect();
    let bad = a[BAD];
    let after_bad: HashSet<String> = a[BAD + 1..].iter().map(ToString::to_string).collect();
    let mut relay = kafka_relay(&table, KAFKA, &topic, "kafka-mid-run")
        .set("relay.ordering", "aggregate")
        .set("relay.poll_interval", "50ms")
        .set("retry.base_delay", "300ms")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "2")
        .spawn();
    let delivered_ids = |records: &[Record]| -> Vec<String> {
        records
            .iter()
            .filter(|r| r.topic == topic)
            .filter_map(|r| r.id().map(|id| id.to_string()))
            .collect()
    };

    // The rows after the bad one delivered so far.
    let ahead = || -> Vec<String> {
        let delivered = delivered_ids(&consumer.records()).into_iter();
        delivered.filter(|id| after_bad.contains(id)).collect()
    };
    // Through both attempts of the bad record, nothing after it arrives.
    let dead = wait_until(LONG, "the mid-run record is dead-lettered", async || {
        let ahead = ahead();
        assert!(
            ahead.is_empty(),
            "delivered ahead of the failing record: {ahead:?}"
        );
        let r = table.row(bad).await;
        if r.status == "failed" {
            Ok(r)
        } else {
            Err(format!(
                "{} attempts {} {:?}",
                r.status, r.attempts, r.last_error
            ))
        }
    })
    .await;
    assert_eq!(dead.attempts, 2, "{dead:?}");
    assert!(
        dead.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("MessageSizeTooLarge"),
        "{dead:?}"
    );
    // The records before it and the other aggregate are sent.
    let before_and_b = i64::try_from(BAD + RUN).unwrap();
    table
        .wait_count("status = 'sent'", before_and_b, LONG)
        .await;
    // The later rows of `a` wait untouched: handed back, no attempt spent.
    let held = table.rows_by_id(&a[BAD + 1..]).await;
    for r in held.values() {
        assert_eq!((r.status.as_str(), r.attempts), ("pending", 0), "{r:?}");
    }
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    let ahead = ahead();
    assert!(
        ahead.is_empty(),
        "delivered ahead of the dead letter: {ahead:?}"
    );

    // The operator discards the dead letter: the rest of the run follows, in order.
    let out = kafka_relay(&table, KAFKA, &topic, "kafka-mid-run-cli")
        .output(&["dead-letters", "discard", "--id", &bad.to_string()], LONG)
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    table.wait_all_sent(LONG).await;
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    assert!(relay.is_running(), "relay exited:\n{}", relay.stderr());
    let records = consumer.stop().await;
    let got = delivered_ids(&records);
    let want_a: Vec<String> = a
        .iter()
        .filter(|id| **id != bad)
        .map(ToString::to_string)
        .collect();
    let want_b: Vec<String> = b.iter().map(ToString::to_string).collect();
    let of = |want: &[String]| -> Vec<String> {
        got.iter().filter(|id| want.contains(id)).cloned().collect()
    };
    assert_eq!(
        of(&want_a),
        want_a,
        "aggregate a: every row once, in seq order"
    );
    assert_eq!(
        of(&want_b),
        want_b,
        "aggregate b: every row once, in seq order"
    );
    let spent = table
        .count_where(&format!("id <> '{bad}' AND attempts <> 1"))
        .await;
    assert_eq!(spent, 0, "rows other than the failing one spent attempts");

    finish_topics(relay, table, &[&topic]).await;
}
