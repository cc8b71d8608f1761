//! The broker-less sink (`publisher.kind = "stdout"`), end to end: the real binary against a
//! real table, its standard output parsed line by line.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{NewRow, PG_URL, RelayBuilder, TestTable};
use serde_json::{Value, json};
use uuid::Uuid;

fn stdout_relay(table: &TestTable, instance: &str) -> RelayBuilder {
    RelayBuilder::bare(instance)
        .set("database.url", PG_URL)
        .set("database.table", &table.name)
        .set("publisher.kind", "stdout")
        .set("metrics.listen", "")
        .set("relay.instance_id", instance)
}

/// Every stdout line parsed as a JSON object; panics on anything else.
fn json_lines(stdout: &str) -> Vec<Value> {
    stdout
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("stdout line is not JSON ({e}): {line:?}"));
            assert!(v.is_object(), "stdout line is not an object: {line}");
            v
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_sink_writes_one_cloudevent_per_line_in_aggregate_order() {
    let table = TestTable::new("stdout_json").await;
    // 3 aggregates × 40 events, interleaved, plus 10 rows without an aggregate id.
    let mut rows = Vec::new();
    for n in 0..40 {
        for agg in ["a", "b", "c"] {
            rows.push(NewRow::new(
                "order",
                Some(agg),
                "updated",
                json!({"agg": agg, "n": n, "text": "line\nbreak"}),
            ));
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

    let relay = stdout_relay(&table, "stdout-json").spawn();
    table.wait_all_sent(Duration::from_secs(60)).await;
    let logs_before_stop = relay.stderr();
    let stdout = {
        let mut relay = relay;
        relay.sigterm();
        let status = relay.wait_exit(Duration::from_secs(20)).await;
        assert!(status.success(), "exit {status}\n{}", relay.stderr());
        relay.stdout()
    };
    assert!(
        logs_before_stop.contains("outbox-relay starting"),
        "logs go to stderr:\n{logs_before_stop}"
    );

    let events = json_lines(&stdout);
    assert_eq!(events.len(), rows.len(), "one line per row:\n{stdout}");
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for e in &events {
        let id: Uuid = e["id"].as_str().unwrap().parse().unwrap();
        assert!(seen.insert(id), "duplicate line for {id}");
        let (seq, row) = by_id[&id];
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["type"], row.event_type.as_str());
        assert_eq!(e["source"], table.default_source().as_str());
        assert_eq!(e["aggregatetype"], row.aggregate_type.as_str());
        assert_eq!(e["datacontenttype"], "application/json");
        assert_eq!(e["data"], row.payload, "data is the payload");
        assert!(e.get("data_base64").is_none());
        assert!(
            chrono::DateTime::parse_from_rfc3339(e["time"].as_str().unwrap()).is_ok(),
            "{e}"
        );
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
    let payload: Vec<u8> = vec![0, 1, 0xff, b'\n', b'{'];
    table.insert_bytes("x", &payload).await;
    let mut relay = stdout_relay(&table, "stdout-bytea").spawn();
    table.wait_all_sent(Duration::from_secs(60)).await;
    relay.sigterm();
    assert!(relay.wait_exit(Duration::from_secs(20)).await.success());
    let events = json_lines(&relay.stdout());
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["data_base64"], "AAH/Cns=");
    assert_eq!(events[0]["datacontenttype"], "application/octet-stream");
    assert!(events[0].get("data").is_none());
    table.drop_table().await;
}
