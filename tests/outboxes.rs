//! One relay serving several outboxes (contract §5, §9): each table is relayed with its own
//! settings on both brokers, one outbox's database being down or its table missing does not
//! stall the others, and a burst in one does not starve another.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::{Duration, Instant};

use common::kafka::{Collector, KAFKA, create_topic, delete_topic, topic_name};
use common::rabbit::{Durability, declare_bound_queue};
use common::{
    AMQP_URL, NewRow, PG_URL, Proxy, RabbitFixture, RelayBuilder, RelayProcess, TempDir, TestTable,
    wait_until,
};
use serde_json::json;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// One `[[outboxes]]` entry: `extra` is more `key = value` lines.
fn entry(name: &str, table: &str, extra: &str) -> String {
    format!("[[outboxes]]\nname = \"{name}\"\ntable = \"{table}\"\n{extra}\n")
}

/// Starts `outbox-relay run` on a config file holding `publisher` and `outboxes`.
fn spawn(label: &str, publisher: &str, outboxes: &[String]) -> (RelayProcess, TempDir) {
    let dir = TempDir::new(label);
    let file = dir.write(
        "relay.toml",
        &format!(
            "[database]\nurl = \"{PG_URL}\"\nauto_migrate = false\n\
             [relay]\ninstance_id = \"{label}\"\npoll_interval = \"200ms\"\n\
             [metrics]\nlisten = \"\"\n{publisher}\n{}",
            outboxes.concat()
        ),
    );
    let file = file.to_string_lossy().into_owned();
    let relay = RelayBuilder::bare(label).spawn_with(&["--config", &file, "run"]);
    (relay, dir)
}

fn rabbit_publisher(exchange: &str) -> String {
    format!(
        "[publisher]\nkind = \"rabbitmq\"\n[publisher.rabbitmq]\nurl = \"{AMQP_URL}\"\nexchange = \"{exchange}\"\n"
    )
}

fn rows(n: usize, aggregate_type: &str) -> Vec<NewRow> {
    NewRow::numbered(n, aggregate_type, Some(("k", 3)), "created")
}

#[tokio::test]
async fn rabbitmq_relays_each_outbox_with_its_own_route_and_source() {
    let (orders, billing) = (
        TestTable::new("multi_rmq_orders").await,
        TestTable::new("multi_rmq_billing").await,
    );
    let rabbit = RabbitFixture::new("multi_rmq", "#", "barrier").await;
    let (relay, _dir) = spawn(
        "multi-rmq",
        &rabbit_publisher(&rabbit.exchange),
        &[
            entry("orders", &orders.name, ""),
            entry(
                "billing",
                &billing.name,
                "source = \"/billing\"\nrouting_key = \"billing.{event_type}\"\nordering = \"none\"",
            ),
        ],
    );
    let a = orders.insert_ids(&rows(30, "order")).await;
    let b = billing.insert_ids(&rows(30, "invoice")).await;
    rabbit
        .wait_for_ids(&[a.clone(), b.clone()].concat(), WAIT)
        .await;
    orders.wait_all_sent(WAIT).await;
    billing.wait_all_sent(WAIT).await;

    let by_id: std::collections::HashMap<String, _> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| (d.message_id.clone(), d))
        .collect();
    for id in &a {
        let d = &by_id[&id.to_string()];
        assert_eq!(d.routing_key, "order.created", "the publisher's template");
        assert_eq!(
            d.headers().get("cloudEvents:source").map(String::as_str),
            Some(orders.default_source().as_str())
        );
    }
    for id in &b {
        let d = &by_id[&id.to_string()];
        assert_eq!(
            d.routing_key, "billing.created",
            "the outbox's own template"
        );
        assert_eq!(
            d.headers().get("cloudEvents:source").map(String::as_str),
            Some("/billing")
        );
    }
    relay.stop().await;
    rabbit.teardown().await;
    orders.drop_table().await;
    billing.drop_table().await;
}

#[tokio::test]
async fn kafka_relays_each_outbox_to_its_own_topic() {
    let (orders, billing) = (
        TestTable::new("multi_kafka_orders").await,
        TestTable::new("multi_kafka_billing").await,
    );
    let (t_orders, t_billing) = (topic_name("multi_orders"), topic_name("multi_billing"));
    create_topic(KAFKA, &t_orders).await;
    create_topic(KAFKA, &t_billing).await;
    let collector = Collector::start(KAFKA, &[&t_orders, &t_billing]);
    let publisher = format!(
        "[publisher]\nkind = \"kafka\"\n[publisher.kafka]\nbrokers = \"{KAFKA}\"\ntopic = \"{t_orders}\"\n"
    );
    let (relay, _dir) = spawn(
        "multi-kafka",
        &publisher,
        &[
            entry("orders", &orders.name, ""),
            entry(
                "billing",
                &billing.name,
                &format!("topic = \"{t_billing}\""),
            ),
        ],
    );
    let a = orders.insert_ids(&rows(20, "order")).await;
    let b = billing.insert_ids(&rows(20, "invoice")).await;
    orders.wait_all_sent(WAIT).await;
    billing.wait_all_sent(WAIT).await;
    wait_until(WAIT, "every record is read back", async || {
        let n = collector.count();
        if n >= 40 {
            Ok(())
        } else {
            Err(format!("{n} of 40"))
        }
    })
    .await;
    let records = collector.stop().await;
    for r in &records {
        let id = r.id().expect("ce_id");
        let want = if a.contains(&id) {
            &t_orders
        } else {
            assert!(b.contains(&id), "unknown id {id}");
            &t_billing
        };
        assert_eq!(&r.topic, want, "record {id}");
        assert_eq!(r.key.as_deref().map(|k| k.starts_with('k')), Some(true));
    }
    relay.stop().await;
    delete_topic(&t_orders).await;
    delete_topic(&t_billing).await;
    orders.drop_table().await;
    billing.drop_table().await;
}

/// Waits until every row of `ids` in `table` is `sent`.
async fn wait_sent(table: &TestTable, ids: &[Uuid], within: Duration, what: &str) {
    wait_until(within, what, async || {
        let states = table.rows_by_id(ids).await;
        let pending = states.values().filter(|r| r.status != "sent").count();
        if pending == 0 && states.len() == ids.len() {
            Ok(())
        } else {
            Err(format!("{pending} of {} not sent", ids.len()))
        }
    })
    .await;
}

#[tokio::test]
async fn one_outboxs_database_down_or_table_missing_does_not_stall_the_others() {
    let (up, behind) = (
        TestTable::new("multi_db_up").await,
        TestTable::new("multi_db_down").await,
    );
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = format!("postgres://postgres@{}/test", proxy.addr());
    let rabbit = RabbitFixture::new("multi_db", "#", "barrier").await;
    let missing = format!("{}_missing", up.name);
    let (mut relay, _dir) = spawn(
        "multi-db",
        &rabbit_publisher(&rabbit.exchange),
        &[
            entry("up", &up.name, ""),
            entry("behind", &behind.name, &format!("url = \"{proxied}\"")),
            entry("missing", &missing, ""),
        ],
    );
    relay
        .wait_for_log(&format!("table {missing} does not exist"), 1, WAIT)
        .await;
    let first = [
        up.insert_ids(&rows(5, "up")).await,
        behind.insert_ids(&rows(5, "behind")).await,
    ];
    wait_sent(&up, &first[0], WAIT, "the first rows of `up` are sent").await;
    wait_sent(
        &behind,
        &first[1],
        WAIT,
        "the first rows of `behind` are sent",
    )
    .await;

    proxy.cut();
    let stuck = behind.insert_ids(&rows(5, "behind")).await;
    let started = Instant::now();
    let fresh = up.insert_ids(&rows(5, "up")).await;
    wait_sent(
        &up,
        &fresh,
        Duration::from_secs(10),
        "`up` goes on while `behind`'s database is down",
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let states = behind.rows_by_id(&stuck).await;
    assert!(
        states.values().all(|r| r.status == "pending"),
        "nothing reaches `behind`'s table while its database is unreachable: {states:?}"
    );
    relay.wait_for_log("database unavailable", 1, WAIT).await;

    proxy.heal();
    wait_sent(
        &behind,
        &stuck,
        WAIT,
        "`behind` catches up once its database is back",
    )
    .await;
    rabbit
        .wait_for_ids(&[fresh, stuck, first.concat()].concat(), WAIT)
        .await;
    assert!(
        relay.is_running(),
        "the missing table does not stop the relay"
    );
    relay.stop().await;
    rabbit.teardown().await;
    up.drop_table().await;
    behind.drop_table().await;
}

#[tokio::test]
async fn a_burst_in_one_outbox_does_not_starve_another() {
    let (busy, quiet) = (
        TestTable::new("multi_burst_busy").await,
        TestTable::new("multi_burst_quiet").await,
    );
    // The quiet outbox's messages reach the fixture's queue; the busy one's a queue of their
    // own that nobody reads (100,000 deliveries would only slow the test's consumer).
    let rabbit = RabbitFixture::new("multi_burst", "quiet.#", "quiet.barrier").await;
    let conn = lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let sink = format!("{}.busy", rabbit.queue);
    declare_bound_queue(
        &channel,
        &rabbit.exchange,
        &sink,
        Durability::Exclusive,
        "busy.#",
    )
    .await
    .expect("declare the busy queue");
    const BURST: i64 = 100_000;
    busy.db
        .execute(
            &format!(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'bulk', 'a' || (i % 1000), 'created', jsonb_build_object('i', i) \
                 FROM generate_series(1, {BURST}) AS i",
                busy.name
            ),
            &[],
        )
        .await
        .expect("insert the burst");

    let (relay, _dir) = spawn(
        "multi-burst",
        &rabbit_publisher(&rabbit.exchange),
        &[
            entry("busy", &busy.name, "routing_key = \"busy.{event_type}\""),
            entry("quiet", &quiet.name, "routing_key = \"quiet.{event_type}\""),
        ],
    );
    wait_until(WAIT, "the busy outbox is draining", async || {
        let sent = busy.count_where("status = 'sent'").await;
        if sent >= 2_000 {
            Ok(())
        } else {
            Err(format!("{sent} sent"))
        }
    })
    .await;

    let mut latencies = Vec::new();
    for i in 0..21 {
        let inserted = Instant::now();
        let id = quiet
            .insert_ids(&[NewRow::new("q", Some("q"), "created", json!({ "i": i }))])
            .await[0];
        let d = rabbit.wait_for_delivery(id, WAIT).await;
        latencies.push(d.received_at.duration_since(inserted));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = busy.count_where("status <> 'sent'").await;
    latencies.sort();
    let p50 = latencies[latencies.len() / 2];
    eprintln!(
        "quiet outbox insert → delivery beside a burst: p50 {p50:?}, all {latencies:?}; busy rows left {left}"
    );
    assert!(
        left > 0,
        "the burst was over before the probes ended: the test measured nothing"
    );
    assert!(
        p50 < Duration::from_millis(100),
        "a row in the quiet outbox took {p50:?} (p50) to arrive beside a burst of {BURST} in another"
    );
    relay.stop().await;
    let _ = conn.close(200, "done".into()).await;
    rabbit.teardown().await;
    busy.drop_table().await;
    quiet.drop_table().await;
}
