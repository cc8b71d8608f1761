//! Messages that expire (docs/operations.md, docs/design.md): a row past its `expires_at` when it would be claimed
//! is `expired`, never published, counted and shown, and does not hold back its aggregate;
//! a row handed back by a broker outage expires when it is claimed anew; NATS and Redis
//! messages of rows with a deadline carry nothing for it (no per-message time to live);
//! retention removes expired rows. The RabbitMQ case (the AMQP `expiration` property) runs on
//! both databases in `both_databases.rs`.
//! (Schema version 2 applied in place to a version-1 table: tests/ops.rs.)
//!
//! The real binary against the local PostgreSQL, RabbitMQ, NATS JetStream and Redis, a table and
//! an exchange and queue, a stream or stream keys per test.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::nats::{NATS_URL, NatsStream, nats_relay};
use common::{
    NewRow, Proxy, RABBIT_ADDR, REDIS_URL, RabbitFixture, RedisStreams, RelayBuilder, RelayProcess,
    TestTable, drop_both, finish, free_port, redis_relay, table_and_exchange, wait_for_sample,
};
use serde_json::Value;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

fn relay(table: &TestTable, rabbit: &RabbitFixture, label: &str) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, label).set("relay.poll_interval", "200ms")
}

/// The broker an expiry scenario runs on.
#[derive(Debug, Clone, Copy)]
enum Broker {
    Nats,
    Redis,
}

/// What the relay publishes to: the test's JetStream stream (capturing `<prefix>.>`) or Redis
/// stream keys (`<prefix>.{aggregate_type}`).
enum Dest {
    Nats(NatsStream),
    Redis(RedisStreams),
}

impl Dest {
    async fn new(broker: Broker, test: &str) -> Self {
        match broker {
            Broker::Nats => Self::Nats(NatsStream::new(test).await),
            Broker::Redis => Self::Redis(RedisStreams::new(test).await),
        }
    }

    fn relay(&self, table: &TestTable, label: &str) -> RelayBuilder {
        match self {
            Self::Nats(stream) => nats_relay(table, stream, NATS_URL, label),
            Self::Redis(streams) => redis_relay(table, REDIS_URL, &streams.template(), label),
        }
        .set("relay.poll_interval", "200ms")
    }

    /// The ids of every message the stream holds, in arrival order (called when the rows are
    /// `sent`: the stream holds what it acknowledged).
    async fn received(&self) -> Vec<String> {
        match self {
            Self::Nats(stream) => {
                let messages = stream.messages().await;
                messages.iter().map(|m| m.id().to_owned()).collect()
            }
            Self::Redis(streams) => {
                let entries = streams.all_entries().await.into_values().flatten();
                entries.map(|e| e.field("id").unwrap_or_default()).collect()
            }
        }
    }

    /// What each broker does with a deadline (`with`, an hour away; `without`, none): NATS and
    /// Redis have no per-message time to live (docs/nats.md, docs/redis.md), so the message of a row with a
    /// deadline carries the same headers (fields) as one without, and stays in the stream.
    async fn assert_deadline_carried(&self, without: Uuid, with: Uuid) {
        match self {
            Self::Nats(stream) => {
                let messages = stream.messages().await;
                let names = |id: Uuid| -> Vec<String> {
                    let m = messages.iter().find(|m| m.id() == id.to_string());
                    m.expect("in the stream").headers.keys().cloned().collect()
                };
                assert_eq!(names(with), names(without), "no header for the deadline");
                assert!(
                    !names(with)
                        .iter()
                        .any(|n| n.eq_ignore_ascii_case("Nats-TTL"))
                );
            }
            Self::Redis(streams) => {
                let entries = streams.all_entries().await.into_values().flatten();
                let entries: Vec<_> = entries.collect();
                let names = |id: Uuid| -> Vec<String> {
                    let e = entries
                        .iter()
                        .find(|e| e.field("id") == Some(id.to_string()));
                    e.expect("in the stream")
                        .names()
                        .into_iter()
                        .map(str::to_owned)
                        .collect()
                };
                assert_eq!(names(with), names(without), "no field for the deadline");
            }
        }
    }

    /// Stops `relay`, deletes what the test created on the broker and drops `table`.
    async fn finish(self, relay: RelayProcess, table: TestTable) {
        match self {
            Self::Nats(stream) => common::finish_with(relay, table, stream.teardown()).await,
            Self::Redis(streams) => common::finish_with(relay, table, streams.teardown()).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_row_past_its_deadline_is_expired_unpublished_and_frees_its_aggregate() {
    past_deadline_is_expired_unpublished_and_frees_its_aggregate(Broker::Nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_row_past_its_deadline_is_expired_unpublished_and_frees_its_aggregate() {
    past_deadline_is_expired_unpublished_and_frees_its_aggregate(Broker::Redis).await;
}

async fn past_deadline_is_expired_unpublished_and_frees_its_aggregate(broker: Broker) {
    let test = format!("expiry_before_claim_{broker:?}").to_lowercase();
    let table = TestTable::new(&test).await;
    let dest = Dest::new(broker, &test).await;
    // Aggregate a-1 in order: an expired head, then a row without a deadline, then one with a
    // deadline an hour away. A row without aggregate id that expired. Inserted before the
    // relay starts, so the first claim meets them all.
    let head = table
        .insert_one(NewRow::order(Some("a-1"), "first").expires_in(-1.0))
        .await;
    let second = table.insert_one(NewRow::order(Some("a-1"), "second")).await;
    let third = table
        .insert_one(NewRow::order(Some("a-1"), "third").expires_in(3600.0))
        .await;
    let loose = table
        .insert_one(NewRow::order(None, "loose").expires_in(-0.001))
        .await;
    let port = free_port();
    let relay = dest
        .relay(&table, &test.replace('_', "-"))
        .set("relay.ordering", "aggregate")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();

    // Settled: the two live rows are sent (acknowledged by the broker).
    table.wait_count("status = 'sent'", 2, WAIT).await;
    let ids = dest.received().await;
    assert_eq!(
        ids,
        [second.to_string(), third.to_string()],
        "only the rows before their deadline go out, in seq order"
    );
    for id in [head, loose] {
        let row = table.row(id).await;
        assert_eq!(row.status, "expired", "{id}");
        let error = row.last_error.unwrap_or_default();
        assert!(
            error.starts_with("expired: its deadline 20") && error.contains("passed before"),
            "last_error says when it expired: {error:?}"
        );
    }
    assert_eq!(table.row(second).await.status, "sent");
    assert_eq!(table.row(third).await.status, "sent");
    dest.assert_deadline_carried(second, third).await;

    // Counted and shown.
    let outbox = [("outbox", table.name.as_str())];
    let expired = wait_for_sample(port, WAIT, "outbox_expired_total", &outbox, |n| n >= 2.0).await;
    assert_eq!(expired, 2.0);
    let out = RelayBuilder::operator(&table.name)
        .output(&["status", "--json"], WAIT)
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["expired"], 2, "{v}");
    assert_eq!(v["sent"], 2, "{v}");
    assert_eq!(v["by_aggregate_type"]["order"]["expired"], 2, "{v}");
    relay.wait_for_log("passed their expires_at", 1, WAIT).await;

    dest.finish(relay, table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_whose_deadline_passes_during_a_broker_outage_expires_instead_of_going_out_late() {
    let (table, rabbit) = table_and_exchange("expiry_outage").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let relay = relay(&table, &rabbit, "expiry-outage")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("relay.ordering", "aggregate")
        .set("publisher.rabbitmq.confirm_timeout", "30s")
        .serving_metrics()
        .spawn();
    relay.wait_broker_connected(WAIT).await;

    // Publishes go into a black hole: the rows are claimed before their deadline and wait.
    proxy.stall();
    let deadline_secs = 3.0;
    let expiring = table
        .insert_one(NewRow::order(Some("b-1"), "expiring").expires_in(deadline_secs))
        .await;
    let after = table.insert_one(NewRow::order(Some("b-1"), "after")).await;
    let plain = table.insert_one(NewRow::order(Some("b-2"), "plain")).await;
    let what = "the expiring row is in flight";
    table
        .wait_row(expiring, WAIT, what, |r| r.status == "processing")
        .await;
    // The connection drops: the row is handed back, and stays back until after its deadline.
    proxy.cut();
    let what = "the expiring row is handed back";
    table
        .wait_row(expiring, WAIT, what, |r| r.status == "pending")
        .await;
    let deadline_passed = format!("id = '{expiring}' AND expires_at < now() - interval '500 ms'");
    // The deadline passes during the outage.
    table.wait_count(&deadline_passed, 1, WAIT).await;
    assert_eq!(table.count_where("status = 'sent'").await, 0);
    proxy.heal();

    // Back: the other rows go out (the later row of its aggregate too), the expiring one never.
    rabbit.wait_for_ids(&[after, plain], WAIT).await;
    rabbit.barrier().await;
    let row = table.row(expiring).await;
    assert_eq!(row.status, "expired", "{row:?}");
    assert_eq!(
        row.attempts, 0,
        "the outage spent no attempt on the handed-back row"
    );
    assert!(
        !rabbit.id_counts().contains_key(&expiring.to_string()),
        "an expired row reached the broker"
    );
    assert_eq!(table.row(after).await.status, "sent");

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_expired_rows_like_sent_ones() {
    let (table, rabbit) = table_and_exchange("expiry_retention").await;
    // Expired an hour ago (removed at once with a 30 min retention), expired just now (kept
    // for the retention), and a row that is sent (kept: fresh).
    let old = table
        .insert_one(NewRow::order(Some("r-1"), "old").expires_in(-3600.0))
        .await;
    let recent = table
        .insert_one(NewRow::order(Some("r-2"), "recent").expires_in(-1.0))
        .await;
    let sent = table.insert_one(NewRow::order(Some("r-3"), "sent")).await;
    let first = relay(&table, &rabbit, "expiry-retention")
        .set("cleanup.retention", "30m")
        .set("cleanup.interval", "300ms")
        .spawn();
    rabbit.wait_for_ids(&[sent], WAIT).await;
    // The long-expired row is removed.
    table.wait_count(&format!("id = '{old}'"), 0, WAIT).await;
    first
        .wait_for_log("deleted sent rows past retention", 1, WAIT)
        .await;
    assert_eq!(table.row(recent).await.status, "expired");
    assert_eq!(table.row(sent).await.status, "sent");
    first.stop().await;

    // Retention 0 deletes rows on confirm; rows that expire are deleted at once as well.
    let gone = table
        .insert_one(NewRow::order(Some("r-4"), "gone").expires_in(-1.0))
        .await;
    let relay = relay(&table, &rabbit, "expiry-retention-zero")
        .set("cleanup.retention", "0s")
        .spawn();
    table.wait_count(&format!("id = '{gone}'"), 0, WAIT).await;
    relay.wait_for_log("passed their expires_at", 1, WAIT).await;
    relay.stop().await;
    rabbit.barrier().await;
    assert!(!rabbit.id_counts().contains_key(&gone.to_string()));
    drop_both(table, rabbit).await;
}
