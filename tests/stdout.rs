//! The broker-less sink (`publisher.kind = "stdout"`), end to end: the real binary against a
//! real table, its standard output parsed line by line; and `/readyz`, whose broker is up from
//! the start while the database is unreachable.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::{NewRow, RelayBuilder, TestTable};
use serde_json::{Value, json};
use uuid::Uuid;

/// Relays `table` to stdout until every row is sent, then stops the relay (asserting a clean
/// exit); returns its stdout parsed line by line (each line must be a JSON object) and the
/// logs it had written by then.
async fn relay_to_stdout(table: &TestTable, instance: &str) -> (Vec<Value>, String) {
    let mut relay = RelayBuilder::for_table(table, instance)
        .set("publisher.kind", "stdout")
        .spawn();
    table.wait_all_sent(Duration::from_secs(60)).await;
    let logs = relay.stderr();
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit {status}\n{}", relay.stderr());
    let stdout = relay.stdout();
    let lines = stdout.lines().map(|line| {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line:?}"));
        assert!(v.is_object(), "stdout line is not an object: {line}");
        v
    });
    (lines.collect(), logs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_sink_writes_one_cloudevent_per_line_in_aggregate_order() {
    let table = TestTable::new("stdout_json").await;
    // 3 aggregates × 40 events, interleaved, plus 10 rows without an aggregate id.
    let mut rows = Vec::new();
    for n in 0..40 {
        for agg in ["a", "b", "c"] {
            let payload = json!({"agg": agg, "n": n, "text": "line\nbreak"});
            rows.push(NewRow::new("order", Some(agg), "updated", payload));
        }
        if n % 4 == 0 {
            rows.push(NewRow::new("ping", None, "pinged", json!([n, null, 1.5])));
        }
    }
    let inserted = table.insert(&rows).await;
    let by_id: HashMap<Uuid, (i64, &NewRow)> = inserted
        .iter()
        .zip(&rows)
        .map(|(i, r)| (i.id, (i.seq, r)))
        .collect();

    let (events, logs) = relay_to_stdout(&table, "stdout-json").await;
    assert!(
        logs.contains("outbox-relay starting"),
        "logs go to stderr:\n{logs}"
    );
    assert_eq!(events.len(), rows.len(), "one line per row:\n{events:#?}");
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut seen = HashSet::new();
    let source = table.default_source();
    for e in &events {
        let id: Uuid = e["id"].as_str().unwrap().parse().unwrap();
        assert!(seen.insert(id), "duplicate line for {id}");
        let (seq, row) = by_id[&id];
        for (attr, want) in [
            ("specversion", "1.0"),
            ("type", row.event_type.as_str()),
            ("source", source.as_str()),
            ("aggregatetype", row.aggregate_type.as_str()),
            ("datacontenttype", "application/json"),
        ] {
            assert_eq!(e[attr], want, "{attr} in {e}");
        }
        assert_eq!(e["data"], row.payload, "data is the payload");
        assert!(e.get("data_base64").is_none());
        let time = e["time"].as_str().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(time).is_ok(), "{e}");
        match &row.aggregate_id {
            Some(agg) => {
                assert_eq!(e["subject"], agg.as_str());
                let prev = last_seq.insert(agg.clone(), seq);
                assert!(
                    prev.is_none_or(|p| p < seq),
                    "aggregate {agg}: seq {seq} after {prev:?}"
                );
            }
            None => assert!(
                e.get("subject").is_none(),
                "no subject without aggregate: {e}"
            ),
        }
    }
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_sink_sends_bytea_payloads_as_data_base64() {
    let table = TestTable::new("stdout_bytea").await;
    table.make_payload_bytea().await;
    table.insert_bytes("x", &[0, 1, 0xff, b'\n', b'{']).await;
    let (events, _) = relay_to_stdout(&table, "stdout-bytea").await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["data_base64"], "AAH/Cns=");
    assert_eq!(events[0]["datacontenttype"], "application/octet-stream");
    assert!(events[0].get("data").is_none());
    table.drop_table().await;
}

/// With no broker to reach, `/readyz` reports the broker up from the start, even while the
/// database is unreachable (only the database is down), and so does `outbox_broker_connected`
/// (which `OutboxBrokerDown` watches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_sink_is_ready_as_a_broker_while_the_database_is_down() {
    let port = common::free_port();
    let mut relay = RelayBuilder::bare("stdout-db-down")
        .set("publisher.kind", "stdout")
        // Nothing listens on port 1: the database stays unreachable.
        .set("database.url", "postgres://postgres@127.0.0.1:1/test")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // The server may answer a moment before the publisher exists; then only the broker line
    // can change (without a database, nothing else would make it up).
    let (code, body) = common::wait_until(
        Duration::from_secs(30),
        "/readyz reports the broker up",
        async || match common::http_get(addr, "/readyz").await? {
            (code, body) if body.contains("broker: up") => Ok((code, body)),
            (_, body) => Err(body),
        },
    )
    .await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("database: down"), "{body}");
    assert!(body.contains("broker: up"), "{body}");
    let connected = common::wait_for_sample(
        port,
        Duration::from_secs(30),
        "outbox_broker_connected",
        &[],
        |v| v == 1.0,
    )
    .await;
    assert_eq!(connected, 1.0);
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit {status}\n{}", relay.stderr());
}
