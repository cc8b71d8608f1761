//! Retries and dead letters (docs/design.md), end to end: a row that cannot be delivered
//! (unroutable on RabbitMQ; for a missing topic, or an oversize record, on Kafka) backs off on
//! the configured schedule, is dead-lettered after `retry.max_attempts`, holds back the rest of
//! its aggregate only (also when it fails in the middle of an aggregate's run), and never
//! stops the relay or the rows of other aggregates.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::kafka::{
    Collector, KAFKA, Record, assert_each_once, create_topic, finish_topics, kafka_relay,
    topic_name,
};
use common::transport::{Sink, Transport};
use common::{NewRow, RelayProcess, RowState, TempDir, TestTable, spawn_paced_writer};
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unroutable_row_backs_off_and_dead_letters_without_blocking_others() {
    undeliverable_rows_back_off_and_dead_letter(Transport::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_for_a_missing_topic_dead_letter_while_the_others_are_sent() {
    undeliverable_rows_back_off_and_dead_letter(Transport::Kafka).await;
}

/// How the undeliverable rows fail on one broker, and the relay retrying them.
struct Case {
    relay: RelayProcess,
    /// The directory of the relay's configuration file, if it has one.
    _config: Option<TempDir>,
    /// `retry.max_attempts`.
    max_attempts: i32,
    /// The bad rows' `destination`: a routing key nothing is bound to, or a topic the cluster
    /// does not know.
    nowhere: String,
    /// How long the writer of the good rows waits between its transactions.
    pace: Duration,
    /// Whether a `last_error` names the cause.
    names_cause: fn(&str) -> bool,
    /// How long the bad rows may take to be dead-lettered.
    within: Duration,
}

/// One observation of the watched row: its state when it first showed, with the test-clock
/// times that bound when the change happened (same host clock as the database).
struct Seen {
    row: RowState,
    /// When the query that first showed this state returned.
    first_seen: DateTime<Utc>,
    /// When the previous query (which still showed the earlier state) was sent.
    prev_asked: DateTime<Utc>,
}

/// Three rows (two aggregates, one without) that cannot be delivered: unroutable on RabbitMQ
/// (only `ok.#` reaches a queue: a row routed to `nowhere` is returned, mandatory), for a topic
/// the cluster does not know on Kafka. They back off (base delay 100ms, jitter 0; on RabbitMQ
/// checked against the schedule), are dead-lettered after `retry.max_attempts` naming the
/// cause, and 200 good rows written meanwhile are sent while they wait, each exactly once.
async fn undeliverable_rows_back_off_and_dead_letter(transport: Transport) {
    let table = TestTable::new(&format!("undeliverable_{transport:?}")).await;
    let instance = format!("undeliverable-{transport:?}");
    // The good rows' aggregate type `ok`: routing key `ok.x`, or topic `<prefix>-ok`.
    let sink = Sink::new(transport, &instance, "ok.#", &["ok"]).await;
    let retrying = |max_attempts: i32, max_delay: &str| {
        sink.relay(&table, &instance)
            .set("relay.poll_interval", "50ms")
            .set("retry.base_delay", "100ms")
            .set("retry.max_delay", max_delay)
            .set("retry.jitter", "0.0")
            .set("retry.max_attempts", max_attempts.to_string())
            .serving_metrics()
    };
    let case = match transport {
        Transport::RabbitMq => {
            let max_attempts = 4;
            // One message in flight at a time: this test is about backoff and dead-lettering;
            // returns under concurrent publishes are the subject of
            // returned_messages_are_charged_to_the_right_row_under_concurrency.
            let relay = retrying(max_attempts, "2s")
                .set("relay.batch_size", "1")
                .set("relay.max_in_flight", "1");
            Case {
                relay: relay.spawn(),
                _config: None,
                max_attempts,
                nowhere: "nowhere".to_owned(),
                pace: Duration::from_millis(25),
                names_cause: |e| e.contains("NO_ROUTE"),
                within: Duration::from_secs(30),
            }
        }
        Transport::Kafka => {
            let max_attempts = 3;
            // librdkafka waits topic.metadata.propagation.max.ms (30 s by default) before
            // failing messages for a topic the cluster does not know: shortened to 1 s (a
            // dotted key: config file), which each attempt still waits.
            let dir = TempDir::new(&instance);
            let config = dir.write(
                "relay.toml",
                "[publisher.kafka.properties]\n\"topic.metadata.propagation.max.ms\" = \"1000\"\n",
            );
            let relay = retrying(max_attempts, "1s").set("relay.ordering", "none");
            Case {
                relay: relay.spawn_with(&["--config", config.to_str().unwrap(), "run"]),
                _config: Some(dir),
                max_attempts,
                nowhere: topic_name("missing"),
                pace: Duration::from_millis(100),
                names_cause: |e| e.to_ascii_lowercase().contains("unknown topic"),
                // Each attempt waits topic.metadata.propagation.max.ms for the topic's metadata.
                within: LONG,
            }
        }
        Transport::Http => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    };
    // Start the clock only once the relay is up (its start-up is not part of any delay).
    let relay = &case.relay;
    relay.wait_broker_connected(Duration::from_secs(30)).await;

    let bad_rows: Vec<NewRow> = [Some("bad-1"), Some("bad-2"), None]
        .into_iter()
        .map(|a| NewRow::new("ghost", a, "lost", json!({"to": "nowhere"})))
        .map(|row| row.destination(&case.nowhere))
        .collect();
    let bad = table.insert_ids(&bad_rows).await;
    // 200 good rows inserted while the bad ones are being retried.
    let writer = spawn_paced_writer(&table.name, 20, 10, case.pace, |b, i| {
        let aggregate = format!("good-{}", i % 7);
        NewRow::new("ok", Some(&aggregate), "x", json!({"b": b, "i": i}))
    });

    // Watch the first bad row closely: one observation per distinct (attempts, status).
    let mut seen: Vec<Seen> = Vec::new();
    // Whether a row waits for a retry: pending after a failed attempt.
    let in_backoff = |r: &RowState| r.status == "pending" && r.attempts > 0;
    // Attempts seen while a bad row was in backoff, of any of them.
    let mut backoff_attempts = BTreeSet::new();
    let mut sent_while_retrying = 0;
    let started = Instant::now();
    let mut prev_asked = Utc::now();
    let dead = loop {
        let asked = Utc::now();
        let rows = table.rows_by_id(&bad).await;
        let answered = Utc::now();
        let retrying = rows.values().filter(|r| in_backoff(r));
        backoff_attempts.extend(retrying.map(|r| r.attempts));
        let r = &rows[&bad[0]];
        if in_backoff(r) {
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
        if rows.values().all(|r| r.status == "failed") {
            break rows;
        }
        prev_asked = asked;
        let states: Vec<_> = rows
            .values()
            .map(|r| (&r.status, r.attempts, &r.last_error))
            .collect();
        assert!(
            started.elapsed() < case.within,
            "the bad rows were not dead-lettered within {:?}; the first went through {:?}; \
             now {states:?}\n{}",
            case.within,
            seen.iter()
                .map(|s| (s.row.attempts, &s.row.status))
                .collect::<Vec<_>>(),
            relay.stderr()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    for r in dead.values() {
        assert_eq!(r.attempts, case.max_attempts, "after max_attempts: {r:?}");
        assert!(r.locked_by.is_none() && r.sent_at.is_none(), "{r:?}");
        let err = r.last_error.as_deref().unwrap_or_default();
        assert!(
            (case.names_cause)(err),
            "last_error names the cause: {err:?}"
        );
    }
    let pending: Vec<&Seen> = seen.iter().filter(|s| in_backoff(&s.row)).collect();
    for s in &pending {
        let err = s.row.last_error.as_deref().unwrap_or_default();
        assert!((case.names_cause)(err), "{:?}", s.row);
    }
    match transport {
        Transport::RabbitMq => assert_backoff_schedule(&pending, case.max_attempts),
        // Each attempt takes a second or more (the missing topic's metadata): no bounds as
        // tight as RabbitMQ's, but the rows are seen waiting for a retry.
        Transport::Kafka => assert!(
            backoff_attempts.contains(&1) || backoff_attempts.contains(&2),
            "the bad rows should be seen waiting for a retry: {backoff_attempts:?}"
        ),
        Transport::Http => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    }

    // The good rows: sent (some while the first bad row was in backoff), each exactly once,
    // nothing else delivered.
    let good = writer.await.unwrap();
    assert_eq!(good.len(), 200);
    table
        .wait_for_counts(LONG, "the 200 good rows are sent", |c| c["sent"] == 200)
        .await;
    assert!(
        sent_while_retrying > 0,
        "good rows must flow while the bad rows are in backoff"
    );
    sink.wait_received(LONG).await;
    let good_rows: Vec<RowState> = table.rows_by_id(&good).await.into_values().collect();
    let analysis = sink.analyse(&good_rows).ignoring_order();
    analysis.assert_exactly_once("the good rows, and nothing else");
    // The bad rows dead-lettered (and logged so), nothing else left.
    let counts = table.status_counts().await;
    let counts = ["sent", "failed", "pending", "processing"].map(|status| counts[status]);
    assert_eq!(counts, [200, 3, 0, 0], "sent, failed, pending, processing");
    assert!(relay.log_count("dead-lettered") >= 3, "{}", relay.stderr());
    sink.finish(case.relay, table).await;
}

/// The watched row's backoff on RabbitMQ from its `pending` observations: seen after each
/// attempt but the last (attempts rising), each delay on the schedule 100ms, 200ms, 400ms.
fn assert_backoff_schedule(pending: &[&Seen], max_attempts: i32) {
    let attempts: Vec<i32> = pending.iter().map(|s| s.row.attempts).collect();
    assert_eq!(
        attempts,
        (1..max_attempts).collect::<Vec<_>>(),
        "attempts seen while pending (backoff states)"
    );
    // available_at gaps: attempt k+1 is claimed only after available_at_k, then waits
    // delay_{k+1}, so gap_k >= delay_{k+1} = 200ms, 400ms.
    let ms = chrono::Duration::milliseconds;
    let av: Vec<DateTime<Utc>> = pending.iter().map(|s| s.row.available_at).collect();
    for (k, gap) in av.windows(2).map(|w| w[1] - w[0]).enumerate() {
        println!("available_at gap {gap} after attempt {}", k + 2);
        assert!(gap >= ms(200 << k), "gap after attempt {}: {gap}", k + 2);
    }
    // Each delay (available_at minus the failure's time) is bounded from both sides by the
    // observations; the schedule (jitter 0) must fit inside the bounds. Lower bound: the
    // failure committed before the state was first seen. Upper bound: it happened after the
    // previous query was sent (less 100ms for the statement's own run time), and after the
    // previous available_at (no claim before it).
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
}

/// `ordering = "aggregate"` (the default) sends an aggregate's claimed run to the producer
/// without waiting for each delivery report. A record in the middle of a run that fails for
/// good (a 2 MB JSON payload: larger than librdkafka's `message.max.bytes`, 1 MB) must still stop
/// its aggregate: the records before it are delivered, nothing after it is delivered ahead of
/// it (through its backoff and its dead letter), no attempt of the later rows is spent. The
/// relay keeps publishing the rows of other aggregates inserted after the dead letter, and
/// dead-letters another oversize record claimed among them, the first of its aggregate, holding
/// back the row behind it. Once an operator discards both dead letters the rest goes out, in
/// order, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_failing_mid_run_stops_its_aggregate_and_the_rest_follows_in_order() {
    const RUN: usize = 20;
    const BAD: usize = 9;
    let table = TestTable::new("kafka_mid_run").await;
    let topic = topic_name("midrun");
    create_topic(KAFKA, &topic).await;
    let consumer = Collector::start(KAFKA, &[&topic]);
    // One statement, before the relay starts: its first claim holds both runs whole.
    let row = |agg, i| NewRow::new("t", Some(agg), "e", json!({ "i": i }));
    let blob = json!({"blob": "x".repeat(2_000_000)});
    let huge = |agg| NewRow::new("t", Some(agg), "huge", blob.clone());
    let rows: Vec<NewRow> = (0..RUN)
        .flat_map(|i| [if i == BAD { huge("a") } else { row("a", i) }, row("b", i)])
        .collect();
    let inserted = table.insert(&rows).await;
    let a: Vec<Uuid> = inserted.iter().step_by(2).map(|r| r.id).collect();
    let b: Vec<Uuid> = inserted.iter().skip(1).step_by(2).map(|r| r.id).collect();
    let bad = a[BAD];
    let mut relay = kafka_relay(&table, KAFKA, &topic, "kafka-mid-run")
        .set("relay.ordering", "aggregate")
        .set("relay.poll_interval", "50ms")
        .set("retry.base_delay", "300ms")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "2")
        .spawn();
    let too_large = |dead: RowState| {
        assert_eq!(dead.attempts, 2, "{dead:?}");
        let err = dead.last_error.as_deref().unwrap_or_default();
        assert!(err.contains("MessageSizeTooLarge"), "{dead:?}");
        // The broker's words name neither the topic nor the size: the relay adds both.
        let record = format!("(topic {topic:?}, value of 20000");
        assert!(err.contains(&record), "{record} in {err}");
    };

    // No row after the bad one has been delivered so far (ahead of `it`).
    let assert_none_ahead_of = |blocker: &str| {
        let after_bad = &a[BAD + 1..];
        let delivered = consumer.records().into_iter().filter_map(|r| r.id());
        let ahead: Vec<Uuid> = delivered.filter(|id| after_bad.contains(id)).collect();
        assert!(ahead.is_empty(), "delivered ahead of {blocker}: {ahead:?}");
    };
    // Through both attempts of the bad record, nothing after it arrives.
    let what = "the mid-run record is dead-lettered";
    let dead = table
        .wait_row(bad, LONG, what, |r| {
            assert_none_ahead_of("the failing record");
            r.status == "failed"
        })
        .await;
    too_large(dead);
    // The records before it and the other aggregate are sent.
    let before_and_b = i64::try_from(BAD + RUN).unwrap();
    let wait_sent = async |n| table.wait_count("status = 'sent'", n, LONG).await;
    wait_sent(before_and_b).await;

    // The relay is still up and publishing rows of other aggregates inserted after the dead
    // letter, before and after an oversize record that is the first of its aggregate: that one
    // is dead-lettered too, holding back the row behind it.
    let small = |n| NewRow::numbered(n, "t", Some(("s-", 5)), "small");
    let mut later = table.insert_ids(&small(50)).await;
    let oversize = table.insert_one(huge("big")).await;
    let behind = table.insert_one(row("big", 1)).await;
    later.extend(table.insert_ids(&small(50)).await);
    let what = "the oversize record is dead-lettered";
    let failed = |r: &RowState| r.status == "failed";
    too_large(table.wait_row(oversize, LONG, what, failed).await);
    wait_sent(before_and_b + 100).await;
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    assert!(relay.is_running(), "relay exited:\n{}", relay.stderr());
    assert_none_ahead_of("the dead letter");
    // The rows behind the dead letters wait untouched for an operator: no attempt spent.
    let held = table.rows_by_id(&[&a[BAD + 1..], &[behind]].concat()).await;
    for r in held.values() {
        assert_eq!((r.status.as_str(), r.attempts), ("pending", 0), "{r:?}");
    }
    let held = i64::try_from(held.len()).unwrap();
    assert_eq!(
        table.status_counts().await,
        BTreeMap::from([
            ("failed".to_owned(), 2),
            ("pending".to_owned(), held),
            ("processing".to_owned(), 0),
            ("sent".to_owned(), before_and_b + 100),
        ])
    );
    assert!(relay.log_count("dead-lettered") >= 2, "{}", relay.stderr());

    // The operator discards the dead letters: the rest follows, in order.
    let ids = [bad, oversize].map(|id| id.to_string());
    let discard = ["dead-letters", "discard", "--id", &ids[0], "--id", &ids[1]];
    let out = kafka_relay(&table, KAFKA, &topic, "kafka-mid-run-cli")
        .output(&discard, LONG)
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    table.wait_all_sent(LONG).await;
    consumer.wait_caught_up(KAFKA, &topic, LONG).await;
    assert!(relay.is_running(), "relay exited:\n{}", relay.stderr());
    let records = consumer.stop().await;
    let got: Vec<Uuid> = records.iter().filter_map(Record::id).collect();
    for (name, rows) in [("a", &a), ("b", &b)] {
        let want: Vec<&Uuid> = rows.iter().filter(|id| **id != bad).collect();
        let of: Vec<&Uuid> = got.iter().filter(|id| want.contains(id)).collect();
        assert_eq!(of, want, "aggregate {name}: every row once, in seq order");
    }
    let mut all = [a, b, later, vec![behind]].concat();
    all.retain(|id| *id != bad);
    assert_each_once("the topic", &records, &all);
    let spent = format!("id NOT IN ('{bad}', '{oversize}') AND attempts <> 1");
    let spent = table.count_where(&spent).await;
    assert_eq!(spent, 0, "rows other than the failing ones spent attempts");

    finish_topics(relay, table, &[&topic]).await;
}
