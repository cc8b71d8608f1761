//! The NATS development aids (docs/nats.md) against the real `nats-server -js` on
//! 127.0.0.1:4222, each test with its own stream name and subject prefix:
//! - `publisher.nats.declare_stream`: the relay creates the stream (file storage, capturing
//!   `<prefix>.>`) and relays into it; a second relay leaves it as it is; a stream lost while
//!   the relay runs is created again after the reconnect; a bad name is exit 2 naming the key.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::stream::StorageType;
use common::nats::{NATS_ADDR, NATS_URL, NatsStream, nats_relay};
use common::{NewRow, Proxy, RelayBuilder, TestTable};

const WAIT: Duration = Duration::from_secs(120);

/// A relay for `table` publishing under `stream`'s prefix and declaring `stream` itself.
fn declaring_relay(
    table: &TestTable,
    stream: &NatsStream,
    url: &str,
    instance: &str,
) -> RelayBuilder {
    nats_relay(table, stream, url, instance)
        .set("publisher.nats.declare_stream", stream.name.clone())
}

/// The ids of the messages the stream holds.
async fn stored_ids(stream: &NatsStream) -> BTreeSet<String> {
    stream
        .messages()
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect()
}

fn ids(ids: &[uuid::Uuid]) -> BTreeSet<String> {
    ids.iter().map(ToString::to_string).collect()
}

#[tokio::test]
async fn declare_stream_creates_a_file_stream_over_the_subjects_and_relays_into_it() {
    let table = TestTable::new("nats_declare").await;
    let stream = NatsStream::reserve("nats_declare").await;
    assert!(stream.config().await.is_none(), "a fresh stream name");
    let first = table
        .insert_ids(&NewRow::numbered(20, "order", Some(("d-", 4)), "created"))
        .await;
    let relay = declaring_relay(&table, &stream, NATS_URL, "nats-declare").spawn();
    table.wait_all_sent(WAIT).await;
    let config = stream.config().await.expect("the relay created the stream");
    assert_eq!(config.subjects, [format!("{}.>", stream.prefix)]);
    assert_eq!(config.storage, StorageType::File);
    assert_eq!(config.duplicate_window, Duration::from_secs(120));
    assert_eq!(stored_ids(&stream).await, ids(&first));
    let created = format!("created JetStream stream {:?}", stream.name);
    relay.wait_for_log(&created, 1, WAIT).await;
    relay.stop().await;

    // A second relay finds it and leaves it as it is.
    let second = table
        .insert_ids(&NewRow::numbered(5, "order", Some(("e-", 1)), "shipped"))
        .await;
    let relay = declaring_relay(&table, &stream, NATS_URL, "nats-declare-2").spawn();
    table.wait_all_sent(WAIT).await;
    relay.wait_for_log("exists, capturing", 1, WAIT).await;
    assert_eq!(relay.log_count(&created), 0, "{}", relay.stderr());
    let mut all = ids(&first);
    all.extend(ids(&second));
    assert_eq!(stored_ids(&stream).await, all);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn a_stream_lost_while_the_relay_runs_is_created_again_after_the_reconnect() {
    let table = TestTable::new("nats_redeclare").await;
    let stream = NatsStream::reserve("nats_redeclare").await;
    let proxy = Proxy::start(NATS_ADDR).await;
    let url = format!("nats://{}", proxy.addr());
    let relay = declaring_relay(&table, &stream, &url, "nats-redeclare").spawn();
    let before = table
        .insert_ids(&NewRow::numbered(5, "order", Some(("r-", 1)), "created"))
        .await;
    table.wait_all_sent(WAIT).await;
    assert_eq!(stored_ids(&stream).await, ids(&before));

    // The server loses the stream (an operator, a wiped store) and the connection drops.
    stream.delete().await;
    proxy.cut();
    relay.wait_for_log("NATS connection lost", 1, WAIT).await;
    proxy.heal();
    let after = table
        .insert_ids(&NewRow::numbered(5, "order", Some(("s-", 1)), "created"))
        .await;
    table.wait_all_sent(WAIT).await;
    assert_eq!(stored_ids(&stream).await, ids(&after));
    let created = format!("created JetStream stream {:?}", stream.name);
    assert_eq!(relay.log_count(&created), 2, "{}", relay.stderr());
    let rows = table.rows_by_id(&after).await;
    assert!(
        rows.values().all(|r| r.attempts == 1),
        "no attempt spent on the missing stream: {rows:?}"
    );
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn a_bad_stream_name_is_a_config_error_naming_the_key() {
    let table = TestTable::new("nats_declare_bad").await;
    for (name, command) in [("OUT.BOX", "run"), ("out box", "check"), ("a/b", "migrate")] {
        let out = RelayBuilder::operator(&table.name)
            .set("publisher.kind", "nats")
            .set("publisher.nats.declare_stream", name)
            .output(&[command], Duration::from_secs(60))
            .await;
        assert_eq!(out.status.code(), Some(2), "{name} {command}: {out:?}");
        assert!(
            out.stderr.contains("publisher.nats.declare_stream")
                && out.stderr.contains("not a JetStream stream name"),
            "{out:?}"
        );
    }
    let placeholder_first = RelayBuilder::operator(&table.name)
        .set("publisher.kind", "nats")
        .set("publisher.nats.declare_stream", "OUTBOX")
        .set("publisher.nats.subject", "{aggregate_type}.{event_type}")
        .output(&["run"], Duration::from_secs(60))
        .await;
    assert_eq!(
        placeholder_first.status.code(),
        Some(2),
        "{placeholder_first:?}"
    );
    assert!(
        placeholder_first
            .stderr
            .contains("publisher.nats.declare_stream"),
        "{placeholder_first:?}"
    );
    table.drop_table().await;
}
