//! Delivery (docs/design.md, docs/wire-format.md), end to end on both brokers: 10,000 rows from concurrent writers
//! arrive exactly once with the contract's envelope (AMQP properties and `cloudEvents:` headers
//! on RabbitMQ; key, `ce_` headers, one partition per key on Kafka), each aggregate in `seq`
//! order, the CloudEvents header prefix for each consumer convention, and RabbitMQ returns
//! charged to the row they belong to. The real binary as a child process, configured through
//! `RELAY_*` variables, each test on its own table, exchange or topics.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::envelope::{JSON, Message, amqp_problems, envelope_problems, expect};
use common::kafka::{Placed, Record};
use common::transport::{Sink, Transport};
use common::{
    Delivered, NewRow, RabbitFixture, RelayBuilder, RowState, TestTable, assert_none, bulk_row,
    concurrent_writers, drop_both, finish, not_sent_cleanly, table_and_exchange,
};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(120);

/// [`envelope_problems`] of a Kafka record (`ce_` attribute headers, `content-type`), and of
/// its topic and key.
fn kafka_problems(r: &Record, row: &RowState, topic: &str, source: &str) -> Vec<String> {
    let message = Message {
        prefix: "ce_",
        headers: r.headers.clone(),
        fixed: &[("content-type", JSON)],
        body: &r.payload,
    };
    let mut problems = envelope_problems(message, row, source);
    expect(&mut problems, "topic", r.topic.as_str(), topic);
    expect(&mut problems, "key", &r.key, &row.aggregate_id);
    problems
}

/// The bulk scenario on `transport` with `relay.ordering = ordering`: `writers` × `per_writer`
/// rows from concurrent writers (`per_tx` to a transaction, `pause` inside each, `make` builds
/// them), then every row exactly once, each sent on its first attempt and released, each
/// delivery with the contract envelope; on RabbitMQ each aggregate in `seq` order unless the
/// ordering is `none`. On Kafka (topics `<prefix>-order` and `<prefix>-customer`: the two
/// aggregate types of [`bulk_row`]) the order is per key, for the caller to judge with
/// [`assert_ordered_per_key`]. Returns the rows and the sink (the caller tears it down).
async fn bulk(
    transport: Transport,
    ordering: &str,
    (writers, per_writer, per_tx): (usize, usize, usize),
    pause: Duration,
    make: fn(usize, usize) -> NewRow,
) -> (Vec<RowState>, Sink) {
    let name = format!("bulk-{transport:?}-{ordering}");
    let table = TestTable::new(&name).await;
    let sink = Sink::new(transport, &name, "#", &["order", "customer"]).await;
    let relay = sink.relay(&table, &name).set("relay.ordering", ordering);
    let mut relay = relay.spawn();
    let started = Instant::now();
    let total = writers * per_writer;
    let inserted = concurrent_writers(&table.name, writers, per_writer, per_tx, pause, make);
    assert_eq!(inserted.await.len(), total);
    let inserted_in = started.elapsed();

    table.wait_all_sent(LONG).await;
    let sent_in = started.elapsed();
    sink.wait_received(LONG).await;
    println!(
        "{name}: {total} rows inserted by {writers} writers in {inserted_in:?}; all sent after \
         {sent_in:?}, all received after {:?} (drain ≈ {:.0} rows/s)",
        started.elapsed(),
        total as f64 / sent_in.as_secs_f64()
    );
    assert!(
        relay.is_running(),
        "relay exited early:\n{}",
        relay.stderr()
    );
    relay.stop().await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), total);
    // Exactly once (no outage; on Kafka an idempotent producer) and nothing foreign.
    let analysis = sink.analyse(&rows);
    if transport == Transport::RabbitMq && ordering != "none" {
        analysis.assert_exactly_once(&name);
    } else {
        analysis.ignoring_order().assert_exactly_once(&name);
    }
    let by_id: HashMap<String, &RowState> = rows.iter().map(|r| (r.id.to_string(), r)).collect();
    let source = table.default_source();
    let mut problems = not_sent_cleanly(&rows);
    let of_row = |row: &RowState, p: String| format!("{} (seq {}): {p}", row.id, row.seq);
    match &sink {
        Sink::RabbitMq(rabbit) => {
            for d in rabbit.deliveries() {
                if let Some(row) = by_id.get(&d.message_id) {
                    let found = amqp_problems(&d, row, &source, "cloudEvents:");
                    problems.extend(found.into_iter().map(|p| of_row(row, p)));
                }
            }
        }
        Sink::Kafka {
            prefix, consumer, ..
        } => {
            for r in consumer.records() {
                if let Some(row) = r.header("ce_id").and_then(|id| by_id.get(id)) {
                    let topic = format!("{prefix}-{}", row.aggregate_type);
                    let found = kafka_problems(&r, row, &topic, &source);
                    problems.extend(found.into_iter().map(|p| of_row(row, p)));
                }
            }
        }
        Sink::Http(_) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    }
    assert_none("envelope or row problems", &problems);
    table.drop_table().await;
    (rows, sink)
}

/// docs/design.md: on Kafka, for the records of [`bulk_row`] rows: each key's records on one
/// partition, their offsets increasing with `seq`; and the fixture covers what it claims to
/// (100 keys over more than 2 partitions, records without key, keyed ones without headers).
fn assert_ordered_per_key(rows: &[RowState], records: &[Record]) {
    let seqs: HashMap<String, i64> = rows.iter().map(|r| (r.id.to_string(), r.seq)).collect();
    let mut by_key: HashMap<(&str, &str), Vec<Placed>> = HashMap::new();
    for r in records {
        if let Some(key) = &r.key {
            let placed = (r.partition, r.offset, seqs[r.header("ce_id").unwrap()]);
            by_key.entry((&r.topic, key)).or_default().push(placed);
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
        partitions_used.extend(parts.into_iter().map(|p| (topic, p)));
        recs.sort_by_key(|(_, offset, _)| *offset);
        let seqs: Vec<i64> = recs.iter().map(|(_, _, s)| *s).collect();
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "key {key} of {topic}: offsets do not increase with seq: {seqs:?}"
        );
    }
    assert!(
        partitions_used.len() > 2,
        "keys should spread over partitions: {partitions_used:?}"
    );
    assert!(records.iter().any(|r| r.key.is_none()));
    assert!(records.iter().any(|r| r.header("ratio") == Some("0.5")));
    assert!(
        records
            .iter()
            .any(|r| r.header("trace").is_none() && r.key.is_some())
    );
}

/// 10,000 rows of every shape ([`bulk_row`]): RabbitMQ with `ordering = "none"` (its order per
/// aggregate is the subject of the next scenario), Kafka with `ordering = "aggregate"`, judged
/// per key.
async fn ten_thousand_rows(transport: Transport) {
    let ordering = match transport {
        Transport::RabbitMq => "none",
        Transport::Kafka => "aggregate",
        Transport::Http => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    };
    let pause = Duration::from_millis(1);
    let (rows, sink) = bulk(transport, ordering, (4, 2500, 25), pause, |_, n| {
        bulk_row(n)
    })
    .await;
    // The fixture covers what it claims to: rows without aggregate id, headers with nulls
    // (which no message carries).
    assert!(rows.iter().any(|r| r.aggregate_id.is_none()));
    match &sink {
        Sink::RabbitMq(rabbit) => {
            let deliveries = rabbit.deliveries();
            assert!(deliveries.iter().all(|d| !d.headers().contains_key("gone")));
        }
        Sink::Kafka { consumer, .. } => {
            let records = consumer.records();
            assert!(records.iter().all(|r| r.header("gone").is_none()));
            assert_ordered_per_key(&rows, &records);
        }
        Sink::Http(_) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    }
    sink.teardown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_arrive_exactly_once_with_the_contract_envelope() {
    ten_thousand_rows(Transport::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_rows_arrive_keyed_ordered_per_key_with_the_contract_envelope() {
    ten_thousand_rows(Transport::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_ordering_delivers_each_aggregate_in_seq_order() {
    // 20 aggregates shared by all writers, so one aggregate's rows come from overlapping
    // transactions that may commit out of seq order.
    let (rows, sink) = bulk(
        Transport::RabbitMq,
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
    sink.teardown().await;
}

/// `n` rows `ok`/`x` (payload `{"i": i}`), row `i` with the `destination` routing key
/// `nowhere` (nothing is bound to it) when `i % every == at`.
fn some_unroutable(n: usize, every: usize, at: usize, nowhere: &str) -> Vec<NewRow> {
    let mut rows = NewRow::numbered(n, "ok", None, "x");
    for row in rows.iter_mut().skip(at).step_by(every) {
        row.destination = Some(nowhere.to_owned());
    }
    rows
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
        let (id, unroutable) = (r.id.to_string(), r.destination.is_some());
        let error = r.last_error.as_deref().unwrap_or_default();
        let ok = if unroutable {
            r.status == "failed" && error.contains("NO_ROUTE")
        } else {
            r.status == "sent" && delivered.contains_key(&id)
        };
        if !ok {
            let kind = if unroutable { "unroutable" } else { "routable" };
            let times = delivered.get(&id).copied().unwrap_or(0);
            let (status, last_error) = (&r.status, &r.last_error);
            wrong.push(format!(
                "{id} ({kind}): status {status}, delivered {times} time(s), last_error {last_error:?}"
            ));
        }
    }
    let what = "rows classified wrongly (an unroutable row marked sent was dropped by the broker; \
                a routable row failed with NO_ROUTE was charged with another row's return)";
    assert_none(what, &wrong);

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
    let what = "unroutable rows marked sent (the broker dropped them)";
    assert_none(what, &unroutable_sent);
    let what = "routable rows charged with another row's return";
    assert_none(what, &routable_blamed);
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(table.count_where("status = 'sent'").await, expected_sent);

    finish(relay, table, rabbit).await;
}

/// The Python SDK decode (`cloudevents` 2.x): reads a JSON message description (argument 1),
/// prints the decoded event's attributes and data as JSON; exits with 3 when the SDK is not
/// installed.
const PY_DECODE: &str = r#"
import json, sys
try:
    from cloudevents.core.bindings import amqp, rabbitmq
except ImportError:
    sys.exit(3)
m = json.loads(sys.argv[1])
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

/// The event the CloudEvents Python SDK decodes from `d` with `binding`; `None` when the SDK
/// (or python3) is not installed.
fn python_decode(binding: &str, d: &Delivered) -> Option<Value> {
    let input = json!({
        "binding": binding,
        "headers": d.headers(),
        "content_type": d.properties.content_type().as_ref().map(ToString::to_string),
        "body": String::from_utf8(d.body.clone()).unwrap(),
    });
    let decode = ["-c", PY_DECODE, &input.to_string()];
    let out = std::process::Command::new("python3")
        .args(decode)
        .output()
        .ok()?;
    if out.status.code() == Some(3) {
        return None;
    }
    assert!(
        out.status.success(),
        "the CloudEvents Python SDK ({binding} binding) could not decode the message: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_prefix_names_the_headers_for_each_consumer_convention() {
    let (table, rabbit) = table_and_exchange("ce_prefix").await;
    let source = table.default_source();
    let prefixes = ["cloudEvents:", "cloudEvents_", "ce-"];
    for (n, prefix) in prefixes.into_iter().enumerate() {
        let relay = RelayBuilder::for_test(&table, &rabbit, &format!("ce-prefix-{n}"))
            .set("publisher.rabbitmq.cloudevents_prefix", prefix)
            .spawn();
        let (subject, data) = (format!("o-{n}"), json!({ "total": n }));
        let row = NewRow::new("order", Some(&subject), "order.created", data.clone());
        let id = table.insert_one(row).await;
        let d = rabbit.wait_for_delivery(id, LONG).await;
        relay.stop().await;
        // Every attribute under this prefix (and the whole envelope as the contract has it).
        let problems = amqp_problems(&d, &table.row(id).await, &source, prefix);
        assert_none(&format!("envelope with prefix {prefix}"), &problems);
        let headers = d.headers();
        for other in prefixes.iter().filter(|p| **p != prefix) {
            assert!(
                !headers.keys().any(|k| k.starts_with(other)),
                "{other} header with prefix {prefix}: {headers:?}"
            );
        }
        let binding = if prefix == "ce-" { "rabbitmq" } else { "amqp" };
        let Some(ev) = python_decode(binding, &d) else {
            eprintln!("python3 -m pip install cloudevents to also decode through the Python SDK");
            continue;
        };
        for (attr, want) in [
            ("id", json!(id.to_string())),
            ("type", json!("order.created")),
            ("source", json!(source)),
            ("subject", json!(subject)),
            ("aggregatetype", json!("order")),
            ("datacontenttype", json!(JSON)),
            ("data", json!({"total": n})),
        ] {
            assert_eq!(ev[attr], want, "{attr} in {ev}");
        }
    }
    drop_both(table, rabbit).await;
}

/// Row headers named like headers the relay sets itself (CloudEvents attribute headers in any
/// letter case, Kafka's `content-type`) on rows with and without an aggregate: every message
/// carries the relay's header once with the relay's value, the row's other headers (a
/// CloudEvents extension the relay does not set among them) as they are, and the relay warns
/// once per colliding name, however many rows carry it (docs/wire-format.md).
async fn colliding_row_headers(transport: Transport) {
    let (prefix, test) = match transport {
        Transport::RabbitMq => ("cloudEvents:", "hdr_collide_amqp"),
        Transport::Kafka => ("ce_", "hdr_collide_kafka"),
        Transport::Http => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    };
    let mut headers = serde_json::Map::new();
    headers.insert(format!("{prefix}id"), json!("spoofed-id"));
    headers.insert(format!("{prefix}SUBJECT"), json!("spoofed-subject"));
    headers.insert(format!("{prefix}extension"), json!("kept"));
    headers.insert("custom".to_owned(), json!("kept"));
    let mut colliding = 2;
    if transport == Transport::Kafka {
        headers.insert("Content-Type".to_owned(), json!("text/plain"));
        colliding += 1;
    }
    let rows: Vec<NewRow> = [Some("o-1"), Some("o-2"), None, Some("o-1")]
        .into_iter()
        .map(|a| NewRow::new("order", a, "order.created", json!({"n": 1})))
        .map(|r| r.headers(Value::Object(headers.clone())))
        .collect();
    let table = TestTable::new(test).await;
    let sink = Sink::new(transport, test, "#", &["order"]).await;
    let relay = sink.relay(&table, test).spawn();
    let ids = table.insert_ids(&rows).await;
    table.wait_all_sent(LONG).await;
    sink.wait_received(LONG).await;
    // (message id or key, headers in wire order) of each message.
    type Received = Vec<(String, Vec<(String, Option<String>)>)>;
    let received: Received = match &sink {
        Sink::RabbitMq(rabbit) => rabbit
            .deliveries()
            .into_iter()
            .map(|d| {
                let headers = d.headers().into_iter().map(|(k, v)| (k, Some(v)));
                (d.message_id.clone(), headers.collect())
            })
            .collect(),
        Sink::Kafka { consumer, .. } => consumer
            .records()
            .into_iter()
            .map(|r| (r.key.clone().unwrap_or_default(), r.headers))
            .collect(),
        Sink::Http(_) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    };
    assert_eq!(received.len(), ids.len(), "{received:?}");
    let mut problems = Vec::new();
    for (row, id) in rows.iter().zip(&ids) {
        let want_id = id.to_string();
        // The message of this row: by message id on RabbitMQ; on Kafka by the one `ce_id`
        // that carries the row's id (the key is the aggregate).
        let Some((_, got)) = received.iter().find(|(mid, h)| {
            *mid == want_id
                || h.iter()
                    .any(|(k, v)| k == "ce_id" && *v == Some(want_id.clone()))
        }) else {
            problems.push(format!("row {id} not received"));
            continue;
        };
        let named = |name: &str| -> Vec<Option<String>> {
            let hits = got.iter().filter(|(k, _)| k.eq_ignore_ascii_case(name));
            hits.map(|(_, v)| v.clone()).collect()
        };
        let subject = row.aggregate_id.clone();
        for (name, want) in [
            (format!("{prefix}id"), vec![Some(want_id.clone())]),
            (
                format!("{prefix}subject"),
                subject.into_iter().map(Some).collect(),
            ),
            (format!("{prefix}extension"), vec![Some("kept".to_owned())]),
            ("custom".to_owned(), vec![Some("kept".to_owned())]),
        ] {
            expect(&mut problems, &format!("{id} {name}"), named(&name), want);
        }
        if transport == Transport::Kafka {
            let want = vec![Some(JSON.to_owned())];
            expect(
                &mut problems,
                &format!("{id} content-type"),
                named("content-type"),
                want,
            );
        }
    }
    assert_none("messages with colliding row headers", &problems);
    let warned = relay.log_count("named like one the relay sets itself");
    assert_eq!(
        warned,
        colliding,
        "one warning per colliding name:\n{}",
        relay.stderr()
    );
    sink.finish(relay, table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_row_headers_named_like_ours_are_dropped_with_one_warning_per_name() {
    colliding_row_headers(Transport::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_row_headers_named_like_ours_are_dropped_with_one_warning_per_name() {
    colliding_row_headers(Transport::Kafka).await;
}
