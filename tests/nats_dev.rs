//! The NATS development aids (docs/nats.md) against the real `nats-server -js` on
//! 127.0.0.1:4222, each test with its own stream name and subject prefix:
//! - `publisher.nats.declare_stream`: the relay creates the stream (file storage, capturing
//!   `<prefix>.>`) and relays into it; a second relay leaves it as it is; a stream lost while
//!   the relay runs is created again after the reconnect; a bad name is exit 2 naming the key.
//! - `outbox-relay tail` with `publisher.kind = "nats"`: `--count N` prints the N messages the
//!   relay published with their ids, `--subject` narrows, nothing is taken from the stream,
//!   Ctrl-C (SIGTERM) stops it; usage errors are exit 2.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::stream::StorageType;
use common::nats::{NATS_ADDR, NATS_URL, NatsStream, nats_relay};
use common::{NewRow, Proxy, RelayBuilder, RelayProcess, TestTable};
use serde_json::json;

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
    for (name, command) in [("OUT.BOX", "run"), ("out box", "check"), ("a/b", "tail")] {
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

/// `tail` with `args` for `stream`'s subjects, once it said it is subscribed.
async fn tail(table: &TestTable, stream: &NatsStream, args: &[&str]) -> RelayProcess {
    let mut all = vec!["tail"];
    all.extend_from_slice(args);
    let tail = RelayBuilder::operator(&table.name)
        .set("publisher.kind", "nats")
        .set("publisher.nats.url", NATS_URL)
        .set("publisher.nats.subject", stream.subject_template())
        .spawn_with(&all);
    tail.wait_for_log("tail: waiting for messages on NATS subjects", 1, WAIT)
        .await;
    tail
}

/// The `id:` lines of `tail`'s output, in order.
fn printed_ids(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.strip_prefix("  id: "))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn tail_prints_what_the_relay_publishes_and_takes_nothing_from_the_stream() {
    let table = TestTable::new("nats_tail").await;
    let stream = NatsStream::new("nats_tail").await;
    let mut counted = tail(&table, &stream, &["--count", "3"]).await;
    let shipped = format!("{}.*.shipped", stream.prefix);
    let mut narrowed = tail(&table, &stream, &["--subject", &shipped, "--count", "1"]).await;
    let endless = tail(&table, &stream, &[]).await;
    let rows = [
        NewRow::new("order", Some("t-1"), "created", json!({"n": 1})),
        NewRow::new("order", Some("t-1"), "shipped", json!({"n": 2})),
        NewRow::new("order", Some("t-2"), "created", json!({"n": 3})),
    ];
    let inserted = table.insert_ids(&rows).await;
    let relay = nats_relay(&table, &stream, NATS_URL, "nats-tail").spawn();
    table.wait_all_sent(WAIT).await;

    let status = counted.wait_exit(WAIT).await;
    assert!(status.success(), "{status:?} {}", counted.stderr());
    let out = counted.stdout();
    let mut got = printed_ids(&out);
    got.sort();
    let mut want: Vec<String> = inserted.iter().map(ToString::to_string).collect();
    want.sort();
    assert_eq!(got, want, "{out}");
    let first = &inserted[0].to_string();
    let block = format!(
        "subject \"{}.order.created\"\n  id: {first}\n  type: created\n  content_type: application/json\n",
        stream.prefix
    );
    assert!(out.contains(&block), "{out}");
    assert!(out.contains(&format!("  header ce-id: {first}\n")), "{out}");
    assert!(
        out.contains(&format!("  header Nats-Msg-Id: {first}\n")),
        "{out}"
    );
    assert!(out.contains("  body: {\"n\": 1}"), "{out}");
    assert_eq!(out.matches("message ").count(), 3, "{out}");

    let status = narrowed.wait_exit(WAIT).await;
    assert!(status.success(), "{status:?} {}", narrowed.stderr());
    assert_eq!(printed_ids(&narrowed.stdout()), [inserted[1].to_string()]);

    // Without --count it runs until Ctrl-C (SIGTERM here), then exits 0.
    common::wait_until(WAIT, "the endless tail printed 3", async || {
        let n = printed_ids(&endless.stdout()).len();
        if n == 3 {
            Ok(())
        } else {
            Err(format!("{n} so far"))
        }
    })
    .await;
    endless.stop().await;

    // The subscription took nothing: the stream holds every message.
    assert_eq!(stream.count().await, 3);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn tail_usage_errors_are_exit_2() {
    let table = TestTable::new("nats_tail_usage").await;
    let run = |kind: &str, args: &[&str]| {
        let mut all = vec!["tail"];
        all.extend_from_slice(args);
        let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
        let mut builder = RelayBuilder::operator(&table.name).set("publisher.kind", kind);
        if kind == "http" {
            builder = builder.set("publisher.http.url", "http://127.0.0.1:9/hook");
        }
        async move {
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            builder.output(&refs, Duration::from_secs(60)).await
        }
    };
    for (kind, args, says) in [
        (
            "nats",
            &["--queue", "q"][..],
            "--queue names a RabbitMQ queue",
        ),
        (
            "nats",
            &["--subject", "a b"][..],
            "not a NATS subject pattern",
        ),
        ("nats", &["--subject", "a.>.b"][..], "last token"),
        (
            "rabbitmq",
            &["--subject", "a.>"][..],
            "--subject goes with publisher.kind = \"nats\"",
        ),
        ("redis", &[][..], "redis-cli"),
        ("http", &[][..], "watch the requests at the endpoint"),
        (
            "kafka",
            &[][..],
            "watch the topic with a Kafka consumer, e.g. `kcat -C",
        ),
        (
            "stdout",
            &[][..],
            "tail reads a RabbitMQ queue or NATS subjects",
        ),
    ] {
        let out = run(kind, args).await;
        assert_eq!(out.status.code(), Some(2), "{kind} {args:?}: {out:?}");
        assert!(out.stderr.contains(says), "{kind} {args:?}: {out:?}");
    }
    table.drop_table().await;
}
