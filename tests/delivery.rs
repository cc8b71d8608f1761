//! Delivery (contract §3, §4), end to end on both brokers: 10,000 rows from concurrent writers
//! arrive exactly once with the contract's envelope (AMQP properties and `cloudEvents:` headers
//! on RabbitMQ; key, `ce_` headers, one partition per key on Kafka), each aggregate in `seq`
//! order, the CloudEvents header prefix for each consumer convention, and RabbitMQ returns
//! charged to the row they belong to. The real binary as a child process, configured through
//! `RELAY_*` variables, each test on its own table, exchange or topics.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use common::kafka::{
    Collector, KAFKA, Placed, Record, create_topic, finish_topics, kafka_relay, topic_name,
};
use common::{
    Delivered, NewRow, RabbitFixture, RelayBuilder, RowState, TestTable, analyse, assert_none,
    bulk_row, concurrent_writers, drop_both, expected_row_headers, finish, not_sent_cleanly,
    table_and_exchange, time_problem,
};
use serde_json::{Value, json};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

/// Checks one delivery against its row (contract §4); returns the problems found.
fn amqp_envelope_problems(d: &Delivered, row: &RowState, source: &str) -> Vec<String> {
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

/// Checks one record against its row (contract §4); returns the problems found.
fn kafka_envelope_problems(r: &Record, row: &RowState, topic: &str, source: &str) -> Vec<String> {
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

/// The RabbitMQ bulk scenario, for either `relay.ordering`: `writers` × `per_writer` rows from
/// concurrent writers (`per_tx` to a transaction, `pause` inside each, `make` builds them), then
/// every row exactly once (in `seq` order per aggregate unless the ordering is `none`), each
/// sent on its first attempt and released, each delivery with the contract envelope. Returns
/// the rows and their deliveries by message id for the scenario's own checks.
async fn rabbit_bulk(
    ordering: &str,
    (writers, per_writer, per_tx): (usize, usize, usize),
    pause: Duration,
    make: fn(usize, usize) -> NewRow,
) -> (Vec<RowState>, HashMap<String, Delivered>) {
    let (table, rabbit) = table_and_exchange(&format!("bulk_{ordering}")).await;
    let mut relay = RelayBuilder::for_test(&table, &rabbit, &format!("bulk-{ordering}"))
        .set("relay.ordering", ordering)
        .spawn();
    let total = writers * per_writer;
    let inserted = concurrent_writers(&table.name, writers, per_writer, per_tx, pause, make);
    assert_eq!(inserted.await.len(), total);

    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    assert!(
        relay.is_running(),
        "relay exited early:\n{}",
        relay.stderr()
    );
    let rows = table.rows().await;
    assert_eq!(rows.len(), total);
    let analysis = rabbit.analyse(&rows);
    let what = format!("bulk, ordering = {ordering}");
    match ordering {
        "none" => analysis.ignoring_order().assert_exactly_once(&what),
        _ => analysis.assert_exactly_once(&what),
    }
    let by_id: HashMap<String, Delivered> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| (d.message_id.clone(), d))
        .collect();
    let source = table.default_source();
    let mut problems = not_sent_cleanly(&rows);
    for row in &rows {
        for p in amqp_envelope_problems(&by_id[&row.id.to_string()], row, &source) {
            problems.push(format!("{} (seq {}): {p}", row.id, row.seq));
        }
    }
    assert_none("envelope or row problems", &problems);
    finish(relay, table, rabbit).await;
    (rows, by_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_arrive_exactly_once_with_the_contract_envelope() {
    let shape = (4, 2500, 25);
    let (rows, by_id) =
        rabbit_bulk("none", shape, Duration::from_millis(1), |_, n| bulk_row(n)).await;
    // The fixture covers what it claims to: rows without aggregate id, headers with nulls.
    assert!(rows.iter().any(|r| r.aggregate_id.is_none()));
    assert!(by_id.values().all(|d| !d.headers().contains_key("gone")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_ordering_delivers_each_aggregate_in_seq_order() {
    // 20 aggregates shared by all writers, so one aggregate's rows come from overlapping
    // transactions that may commit out of seq order.
    let (rows, _) = rabbit_bulk(
        "aggregate",
        (4, 500, 10),
        Duration::from_millis(5),
        |w, n| {
            let agg = format!("a-{}", (w * 7 + n * 3) % 20);
            NewRow::new(
                "account",
                Some(&agg),
                "changed",
                json!({"n": n, "writer": w}),
            )
        },
    )
    .await;
    let aggregates: HashSet<String> = rows.iter().filter_map(RowState::aggregate).collect();
    assert_eq!(aggregates.len(), 20);
}

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
        consumer.wait_caught_up(KAFKA, t, LONG).await;
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
        for p in kafka_envelope_problems(r, row, &topic, &source) {
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

    finish_topics(relay, table, &[&topics[0], &topics[1]]).await;
}

/// `n` rows `ok`/`x` (payload `{"i": i}`), row `i` with the `destination` routing key
/// `nowhere` (nothing is bound to it) when `i % every == at`.
fn some_unroutable(n: usize, every: usize, at: usize, nowhere: &str) -> Vec<NewRow> {
    (0..n)
        .map(|i| {
            let row = NewRow::new("ok", None, "x", json!({"i": i}));
            if i % every == at {
                row.destination(nowhere)
            } else {
                row
            }
        })
        .collect()
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
    let ids = table
        .insert_ids(&some_unroutable(2000, 10, 3, "nowhere"))
        .await;
    table
        .wait_for_counts(LONG, "every row is settled", |c| {
            c["pending"] + c["processing"] == 0
        })
        .await;
    rabbit.barrier().await;

    let states = table.rows_by_id(&ids).await;
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
    // 1% unroutable.
    let rows = some_unroutable(ROWS, 100, 37, "nowhere.at.all");
    let mut ids = Vec::with_capacity(ROWS);
    for chunk in rows.chunks(2000) {
        ids.extend(table.insert_ids(chunk).await);
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

    let states = table.rows_by_id(&ids).await;
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
