//! End-to-end tests of `outbox-relay run` against the local PostgreSQL and a Kafka-protocol
//! broker (tansu): the real binary as a child process, configured through `RELAY_*` variables
//! (and a TOML file for dotted librdkafka properties), each test on its own table and topics,
//! read back with an rdkafka consumer that assigns every partition from the beginning.
//!
//! The shared broker (127.0.0.1:9092, started by `scripts/services.sh`) does not auto-create
//! topics: every test creates its own with `tansu topic create`. The restart test runs a
//! private tansu behind the harness's TCP proxy.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::expected_row_headers;
use common::kafka::{
    Collector, KAFKA, Record, Tansu, create_topic, delete_topic, free_port, high_watermarks,
    id_counts, kafka_relay, topic_name,
};
use common::{
    NewRow, Proxy, RowState, TempDir, TestTable, analyse, assert_none, bulk_row,
    concurrent_writers, not_sent_cleanly, spawn_paced_writer, time_problem, wait_for_count,
    wait_until,
};
use serde_json::{Value, json};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

/// Checks one record against its row (contract §4); returns the problems found.
fn envelope_problems(r: &Record, row: &RowState, topic: &str, source: &str) -> Vec<String> {
    let mut p = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            p.push(what);
        }
    };
    check(
        r.topic == topic,
        format!("topic {:?} != {topic:?}", r.topic),
    );
    check(
        r.key == row.aggregate_id,
        format!("key {:?} != aggregate_id {:?}", r.key, row.aggregate_id),
    );
    match serde_json::from_slice::<Value>(&r.payload) {
        Ok(body) => check(
            body == row.payload,
            format!("payload {body} != row payload {}", row.payload),
        ),
        Err(e) => check(false, format!("payload is not JSON: {e}")),
    }

    let mut names: Vec<&str> = r.headers.iter().map(|(k, _)| k.as_str()).collect();
    names.sort_unstable();
    let before = names.len();
    names.dedup();
    check(
        names.len() == before,
        format!("repeated header names: {:?}", r.headers),
    );
    check(
        r.headers.iter().all(|(_, v)| v.is_some()),
        format!("a header without value: {:?}", r.headers),
    );

    let id = row.id.to_string();
    let expect = [
        ("ce_id", Some(id.as_str())),
        ("ce_type", Some(row.event_type.as_str())),
        ("ce_source", Some(source)),
        ("ce_specversion", Some("1.0")),
        ("ce_aggregatetype", Some(row.aggregate_type.as_str())),
        ("ce_subject", row.aggregate_id.as_deref()),
        ("content-type", Some("application/json")),
    ];
    for (name, want) in expect {
        check(
            r.header(name) == want,
            format!("{name} {:?} != {want:?}", r.header(name)),
        );
    }
    if let Some(problem) = time_problem("ce_time", r.header("ce_time"), row.created_at) {
        check(false, problem);
    }

    let own: BTreeMap<String, String> = r
        .headers
        .iter()
        .filter(|(k, _)| !k.starts_with("ce_") && k != "content-type")
        .map(|(k, v)| (k.clone(), v.clone().unwrap_or_default()))
        .collect();
    let expected = expected_row_headers(&row.headers);
    check(
        own == expected,
        format!("row headers {own:?} != expected {expected:?}"),
    );
    p
}

/// Where a record landed and which row it carries: (partition, offset, seq).
type Placed = (i32, i64, i64);

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_arrive_keyed_ordered_per_key_with_the_contract_envelope() {
    let table = TestTable::new("kafka_bulk").await;
    // Template `<prefix>-{aggregate_type}`: two aggregate types, two topics.
    let prefix = topic_name("bulk");
    let topics = [format!("{prefix}-order"), format!("{prefix}-customer")];
    for t in &topics {
        create_topic(KAFKA, t).await;
    }
    let consumer = Collector::start(KAFKA, &[&topics[0], &topics[1]]);
    let mut relay = kafka_relay(
        &table,
        KAFKA,
        &format!("{prefix}-{{aggregate_type}}"),
        "kafka-bulk",
    )
    .set("relay.ordering", "aggregate")
    .spawn();

    let started = Instant::now();
    let inserted = concurrent_writers(
        &table.name,
        4,
        2500,
        25,
        Duration::from_millis(1),
        |_, n| bulk_row(n),
    )
    .await;
    let inserted_in = started.elapsed();
    assert_eq!(inserted.len(), 10_000);

    table.wait_all_sent(LONG).await;
    let sent_in = started.elapsed();
    for t in &topics {
        let high = high_watermarks(KAFKA, t).await;
        consumer.wait_caught_up(t, &high, LONG).await;
    }
    let received_in = started.elapsed();
    assert!(
        relay.is_running(),
        "relay exited early:\n{}",
        relay.stderr()
    );
    let records = consumer.stop().await;
    println!(
        "kafka bulk: 10000 rows inserted by 4 writers in {inserted_in:?}; all sent after {sent_in:?}, \
         all received after {received_in:?} (drain ≈ {:.0} rows/s)",
        10_000.0 / sent_in.as_secs_f64()
    );

    // Exactly once (no outage, idempotent producer) and nothing foreign.
    let all = table.rows().await;
    assert_eq!(all.len(), 10_000);
    let ids = records
        .iter()
        .map(|r| r.header("ce_id").unwrap_or("<no ce_id>"));
    analyse(&all, ids)
        .ignoring_order()
        .assert_exactly_once("kafka bulk");
    let mut problems = not_sent_cleanly(&all);
    let rows: HashMap<Uuid, RowState> = all.into_iter().map(|r| (r.id, r)).collect();
    let source = table.default_source();
    for r in &records {
        let row = &rows[&r.id().unwrap()];
        let topic = format!("{prefix}-{}", row.aggregate_type);
        for p in envelope_problems(r, row, &topic, &source) {
            problems.push(format!("{} (seq {}): {p}", row.id, row.seq));
        }
    }
    assert_none("envelope or row problems", &problems);

    // Per key: one partition, offsets increasing with seq (contract §3, Kafka).
    let mut by_key: HashMap<(String, String), Vec<Placed>> = HashMap::new();
    for r in &records {
        if let Some(key) = &r.key {
            let seq = rows[&r.id().unwrap()].seq;
            by_key
                .entry((r.topic.clone(), key.clone()))
                .or_default()
                .push((r.partition, r.offset, seq));
        }
    }
    assert_eq!(by_key.len(), 100, "100 aggregates expected");
    let mut partitions_used = HashSet::new();
    for ((topic, key), mut recs) in by_key {
        let parts: HashSet<i32> = recs.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(
            parts.len(),
            1,
            "key {key} of {topic} spread over partitions {parts:?}"
        );
        partitions_used.extend(parts.into_iter().map(|p| (topic.clone(), p)));
        recs.sort_by_key(|(_, offset, _)| *offset);
        let seqs: Vec<i64> = recs.iter().map(|(_, _, s)| *s).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {key} of {topic}: offsets do not increase with seq: {seqs:?}"
        );
    }
    // The fixture covers what it claims to.
    assert!(
        partitions_used.len() > 2,
        "keys should spread over partitions: {partitions_used:?}"
    );
    assert!(records.iter().any(|r| r.key.is_none()));
    assert!(records.iter().all(|r| r.header("gone").is_none()));
    assert!(records.iter().any(|r| r.header("ratio") == Some("0.5")));
    assert!(
        records
            .iter()
            .any(|r| r.header("trace").is_none() && r.key.is_some())
    );

    relay.stop().await;
    for t in &topics {
        delete_topic(t).await;
    }
    table.drop_table().await;
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

    let good = writer.await.unwrap();
    assert_eq!(good.len(), 200);
    table
        .wait_for_counts(LONG, "the 200 good rows are sent", |c| c["sent"] == 200)
        .await;
    assert!(
        sent_while_retrying > 0,
        "good rows must flow while the ghost rows are in backoff"
    );
    let high = high_watermarks(KAFKA, &topic).await;
    consumer.wait_caught_up(&topic, &high, LONG).await;
    let counts = id_counts(&consumer.stop().await);
    let good_set: HashSet<Uuid> = good.iter().copied().collect();
    assert_eq!(
        counts.keys().copied().collect::<HashSet<_>>(),
        good_set,
        "the real topic holds exactly the good rows"
    );
    assert!(counts.values().all(|n| *n == 1), "duplicates: {counts:?}");
    let c = table.status_counts().await;
    assert_eq!(
        (c["sent"], c["failed"], c["pending"], c["processing"]),
        (200, 3, 0, 0)
    );
    assert!(relay.log_count("dead-lettered") >= 3, "{}", relay.stderr());

    relay.stop().await;
    delete_topic(&topic).await;
    table.drop_table().await;
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
        .insert(&[NewRow::new(
            "blob",
            Some("big-1"),
            "huge",
            json!({"blob": "x".repeat(2_000_000)}),
        )])
        .await[0]
        .id;
    let held = table
        .insert(&[NewRow::new(
            "blob",
            Some("big-1"),
            "after-huge",
            json!({"held": true}),
        )])
        .await[0]
        .id;
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
    let high = high_watermarks(KAFKA, &topic).await;
    consumer.wait_caught_up(&topic, &high, LONG).await;
    assert!(relay.is_running(), "relay exited:\n{}", relay.stderr());
    let counts = id_counts(&consumer.stop().await);
    let want: HashSet<Uuid> = ids.iter().copied().collect();
    assert_eq!(counts.keys().copied().collect::<HashSet<_>>(), want);
    assert!(counts.values().all(|n| *n == 1), "duplicates: {counts:?}");

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

    relay.stop().await;
    delete_topic(&topic).await;
    table.drop_table().await;
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

    // Through both attempts of the bad record, nothing after it arrives.
    let dead = wait_until(LONG, "the mid-run record is dead-lettered", async || {
        let ahead: Vec<String> = delivered_ids(&consumer.records())
            .into_iter()
            .filter(|id| after_bad.contains(id))
            .collect();
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
    let high = high_watermarks(KAFKA, &topic).await;
    consumer.wait_caught_up(&topic, &high, LONG).await;
    let ahead: Vec<String> = delivered_ids(&consumer.records())
        .into_iter()
        .filter(|id| after_bad.contains(id))
        .collect();
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
    let high = high_watermarks(KAFKA, &topic).await;
    consumer.wait_caught_up(&topic, &high, LONG).await;
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

    relay.stop().await;
    delete_topic(&topic).await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_and_restarted_mid_stream_spends_no_attempt() {
    let table = TestTable::new("kafka_restart").await;
    let dir = TempDir::new("kafka-restart");
    // Every connection (bootstrap and the advertised leader address) goes through the proxy.
    let port = free_port();
    let proxy = Proxy::start(&format!("127.0.0.1:{port}")).await;
    let advertised = proxy.addr();
    let brokers = advertised.to_string();
    let log = dir.path().join("tansu.log");
    let first = Tansu::start(port, advertised, &log).await;
    let topic = topic_name("restart");
    create_topic(&first.direct(), &topic).await;

    let relay = kafka_relay(&table, &brokers, &topic, "kafka-restart")
        .set("relay.lease_timeout", "60s")
        .set("retry.base_delay", "100ms")
        .spawn();
    let old_consumer = Collector::start(&brokers, &[&topic]);

    // 3000 rows over ~5 s, 13 aggregates.
    let writer = spawn_paced_writer(&table.name, 150, 20, Duration::from_millis(30), |t, i| {
        NewRow::new(
            "restart",
            Some(&format!("r-{}", (t * 20 + i) % 13)),
            "e",
            json!({"t": t, "i": i}),
        )
    });
    wait_for_count(
        Duration::from_secs(60),
        "300 records read before the kill",
        300,
        || old_consumer.count(),
    )
    .await;

    proxy.cut();
    // What the relay held at the cut: rows the old broker may have confirmed but that are not
    // marked sent yet (their batch waits for a batch-mate stuck in librdkafka).
    let snapshot = table
        .db
        .query_one(
            &format!(
                "SELECT now(), coalesce(array_agg(id) FILTER (WHERE status = 'processing'), '{{}}') FROM {}",
                table.name
            ),
            &[],
        )
        .await
        .unwrap();
    let (cut_at, in_flight_at_cut): (DateTime<Utc>, Vec<Uuid>) = (snapshot.get(0), snapshot.get(1));
    let in_flight_at_cut: HashSet<Uuid> = in_flight_at_cut.into_iter().collect();
    first.kill().await;
    let killed_at = table.db_now().await;
    let outage = Instant::now();
    let old_records = old_consumer.stop().await;

    // The outage spends nothing.
    let spent = table
        .count_where("status = 'failed' OR (status = 'pending' AND attempts > 0)")
        .await;
    assert_eq!(spent, 0, "the outage spent attempts:\n{}", relay.stderr());

    let second = Tansu::start(port, advertised, &log).await;
    create_topic(&second.direct(), &topic).await;
    let up_at = table.db_now().await;
    proxy.heal();
    let outage = outage.elapsed();
    let new_consumer = Collector::start(&brokers, &[&topic]);

    let ids = writer.await.unwrap();
    assert_eq!(ids.len(), 3000);
    // Not wait_all_sent: when the relay cannot recover, say how it is stuck.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = table.status_counts().await;
        if counts["sent"] == 3000 {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "rows not all sent 60s after the broker came back: {counts:?}; the relay's publish \
                 outcomes since: {} librdkafka Fatal errors, {} UnknownProducerId, {} message \
                 timeouts. The restarted broker does not know the idempotent producer's id: \
                 librdkafka either raises a fatal error (the producer must be replaced) or \
                 retries an epoch bump the broker refuses (the producer is wedged until replaced).",
                relay.log_count("Fatal (Local: Fatal error)"),
                relay.log_count("UnknownProducerId"),
                relay.log_count("MessageTimedOut"),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let high = high_watermarks(&brokers, &topic).await;
    new_consumer.wait_caught_up(&topic, &high, LONG).await;
    let new_records = new_consumer.stop().await;

    let rows: HashMap<Uuid, RowState> = table.rows().await.into_iter().map(|r| (r.id, r)).collect();
    let wrong: Vec<_> = rows
        .values()
        .filter(|r| r.status != "sent" || r.attempts != 1)
        .map(|r| (r.id, r.status.clone(), r.attempts, r.last_error.clone()))
        .collect();
    assert!(
        wrong.is_empty(),
        "rows not sent with attempts = 1: {} e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );

    let old = id_counts(&old_records);
    let new = id_counts(&new_records);
    let foreign = old
        .keys()
        .chain(new.keys())
        .filter(|id| !rows.contains_key(id))
        .count();
    assert_eq!(
        foreign, 0,
        "records with ids that are not rows of the table"
    );
    // Not received from either broker: the old broker confirmed them (it held them in memory
    // only) and the test had not read them before the kill. Confirmed means: marked sent
    // before the cut, or held by the relay at the cut (confirmed, batch not yet settled).
    let lost: Vec<&RowState> = rows
        .values()
        .filter(|r| !old.contains_key(&r.id) && !new.contains_key(&r.id))
        .collect();
    let sent_before_cut = lost.iter().filter(|r| r.sent_at.unwrap() <= cut_at).count();
    let held_at_cut = lost
        .iter()
        .filter(|r| r.sent_at.unwrap() > cut_at && in_flight_at_cut.contains(&r.id))
        .count();
    let unexplained: Vec<_> = lost
        .iter()
        .filter(|r| r.sent_at.unwrap() > cut_at && !in_flight_at_cut.contains(&r.id))
        .map(|r| (r.id, r.seq, r.sent_at))
        .collect();
    let lost_sent_after_restart = lost.iter().filter(|r| r.sent_at.unwrap() >= up_at).count();
    let both = old.keys().filter(|id| new.contains_key(id)).count();
    let repeated = old.values().chain(new.values()).filter(|n| **n > 1).count();
    println!(
        "kafka restart: outage {outage:?} (cut {cut_at}, killed {killed_at}, back {up_at}); \
         {} records from the old broker, {} from the new one; {} rows lost with the old broker's \
         memory ({sent_before_cut} marked sent before the cut, {held_at_cut} held by the relay at \
         the cut and marked sent later, {lost_sent_after_restart} of them marked sent after the \
         new broker came up); duplicates: {both} ids on both brokers, {repeated} ids twice on one",
        old_records.len(),
        new_records.len(),
        lost.len(),
    );
    assert!(
        unexplained.is_empty(),
        "{} rows are on neither broker although the old broker cannot have confirmed them \
         (pending at the cut, marked sent after it), e.g. {:?}",
        unexplained.len(),
        &unexplained[..unexplained.len().min(10)]
    );

    // Per aggregate, in seq order: the rows read from the old broker, then the lost ones, then
    // the rows only the new broker has. Lost rows are the tail the old broker held but the test
    // had not read, published (in order) before anything the new broker got.
    let mut runs: HashMap<String, [Vec<i64>; 3]> = HashMap::new();
    for r in rows.values() {
        let which = if old.contains_key(&r.id) {
            0
        } else if new.contains_key(&r.id) {
            2
        } else {
            1
        };
        runs.entry(r.aggregate_id.clone().unwrap()).or_default()[which].push(r.seq);
    }
    for (agg, [read_old, lost_seqs, only_new]) in &runs {
        let max = |v: &Vec<i64>| v.iter().max().copied();
        let min = |v: &Vec<i64>| v.iter().min().copied();
        let in_order = |a: Option<i64>, b: Option<i64>| a.zip(b).is_none_or(|(a, b)| a < b);
        assert!(
            in_order(max(read_old), min(lost_seqs))
                && in_order(max(lost_seqs), min(only_new))
                && in_order(max(read_old), min(only_new)),
            "aggregate {agg}: lost rows {lost_seqs:?} are not between the rows read from the old \
             broker (up to {:?}) and those on the new one (from {:?})",
            max(read_old),
            min(only_new)
        );
    }

    // Per key on the new broker: one partition, first arrivals in seq order.
    let mut seen = HashSet::new();
    let mut by_key: HashMap<String, Vec<Placed>> = HashMap::new();
    for r in &new_records {
        let id = r.id().unwrap();
        if seen.insert(id) {
            by_key.entry(r.key.clone().unwrap()).or_default().push((
                r.partition,
                r.offset,
                rows[&id].seq,
            ));
        }
    }
    assert_eq!(by_key.len(), 13);
    for (key, mut recs) in by_key {
        let parts: HashSet<i32> = recs.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(parts.len(), 1, "key {key} spread over partitions {parts:?}");
        recs.sort_unstable();
        assert!(
            recs.windows(2).all(|w| w[0].2 < w[1].2),
            "key {key} out of seq order on the new broker: {recs:?}"
        );
    }
    // The relay really lost the broker and came back to the new one.
    assert!(
        new_records.len() > 300,
        "most rows should go to the new broker: {}",
        new_records.len()
    );
    assert!(
        relay.log_count("connected to the broker") >= 2,
        "{}",
        relay.stderr()
    );

    relay.stop().await;
    second.kill().await;
    drop(proxy);
    table.drop_table().await;
}
