//! One relay serving several outboxes (docs/configuration.md): each table is relayed with its own
//! settings on every broker (RabbitMQ, Kafka, NATS JetStream, Redis Streams), one outbox's
//! database being down or its table missing does not stall the others (`/readyz` naming the
//! missing table), and a burst in one does not starve another.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::{Duration, Instant};

use common::kafka::KAFKA;
use common::nats::{NATS_URL, NatsStream};
use common::rabbit::{Durability, declare_bound_queue};
use common::transport::{Sink, Transport};
use common::{
    AMQP_URL, NewRow, PG_URL, Proxy, REDIS_URL, RabbitFixture, RedisStreams, RelayBuilder,
    RelayProcess, TempDir, TestTable, analyse, finish,
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
    spawn_listening(label, publisher, outboxes, "")
}

/// [`spawn`] with the metrics and probes server on `listen` (`""`: none).
fn spawn_listening(
    label: &str,
    publisher: &str,
    outboxes: &[String],
    listen: &str,
) -> (RelayProcess, TempDir) {
    let dir = TempDir::new(label);
    let file = dir.write(
        "relay.toml",
        &format!(
            "[database]\nurl = \"{PG_URL}\"\nauto_migrate = false\n\
             [relay]\ninstance_id = \"{label}\"\npoll_interval = \"200ms\"\n\
             [metrics]\nlisten = \"{listen}\"\n{publisher}\n{}",
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
    each_outbox_with_its_own_route_and_source(Broker::Sink(Transport::RabbitMq)).await;
}

#[tokio::test]
async fn kafka_relays_each_outbox_to_its_own_topic() {
    each_outbox_with_its_own_route_and_source(Broker::Sink(Transport::Kafka)).await;
}

#[tokio::test]
async fn nats_relays_each_outbox_to_its_own_subject() {
    each_outbox_with_its_own_route_and_source(Broker::Nats).await;
}

#[tokio::test]
async fn redis_relays_each_outbox_to_its_own_stream() {
    each_outbox_with_its_own_route_and_source(Broker::Redis).await;
}

/// The broker a scenario of this file runs on: one of the shared [`Sink`]s, or NATS JetStream
/// or Redis Streams.
#[derive(Debug, Clone, Copy)]
enum Broker {
    Sink(Transport),
    Nats,
    Redis,
}

/// Where the scenario reads what the relay sent: the [`Sink`], the test's JetStream stream
/// (capturing `<prefix>.>`), or the test's Redis stream keys (`<prefix>.…`).
enum Dest {
    Sink(Sink),
    Nats(NatsStream),
    Redis(RedisStreams),
}

impl Dest {
    async fn new(broker: Broker, test: &str, types: &[&str]) -> Self {
        match broker {
            Broker::Sink(t) => Self::Sink(Sink::new(t, test, "#", types).await),
            Broker::Nats => Self::Nats(NatsStream::new(test).await),
            Broker::Redis => Self::Redis(RedisStreams::new(test).await),
        }
    }

    /// Each arrival as (id, route, source), in arrival order (on Redis, stream by stream).
    async fn arrivals(&self) -> Vec<(Uuid, String, Option<String>)> {
        match self {
            Self::Sink(Sink::RabbitMq(rabbit)) => {
                let deliveries = rabbit.deliveries().into_iter();
                deliveries
                    .map(|d| {
                        let source = d.headers().get("cloudEvents:source").cloned();
                        (d.message_id.parse().unwrap(), d.routing_key, source)
                    })
                    .collect()
            }
            Self::Sink(Sink::Kafka { consumer, .. }) => {
                let records = consumer.records().into_iter();
                records
                    .map(|r| {
                        let key = r.key.as_deref();
                        assert_eq!(key.map(|k| k.starts_with('k')), Some(true), "{r:?}");
                        let source = r.header("ce_source").map(str::to_owned);
                        (r.id().expect("ce_id"), r.topic, source)
                    })
                    .collect()
            }
            Self::Sink(Sink::Http(_)) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
            Self::Nats(stream) => {
                let messages = stream.messages().await.into_iter();
                messages
                    .map(|m| {
                        let source = m.header("ce-source").map(str::to_owned);
                        (m.id().parse().expect("Nats-Msg-Id"), m.subject, source)
                    })
                    .collect()
            }
            Self::Redis(streams) => {
                let all = streams.all_entries().await.into_iter();
                all.flat_map(|(key, entries)| {
                    entries.into_iter().map(move |e| {
                        let id = e.field("id").expect("id field").parse().unwrap();
                        (id, key.clone(), e.field("source"))
                    })
                })
                .collect()
            }
        }
    }

    /// Stops `relay`, deletes what the test created on the broker and drops `table`.
    async fn finish(self, relay: RelayProcess, table: TestTable) {
        match self {
            Self::Sink(sink) => sink.finish(relay, table).await,
            Self::Nats(stream) => common::finish_with(relay, table, stream.teardown()).await,
            Self::Redis(streams) => common::finish_with(relay, table, streams.teardown()).await,
        }
    }
}

/// Two outboxes on one relay: `orders` with the publisher's route (routing key, topic, subject
/// or stream template) and the default source; `billing` with a route, a source and an
/// ordering of its own. Every row
/// arrives once, on its outbox's route with its outbox's source, `orders` (ordering
/// `aggregate`) in order per aggregate, and nothing else arrives.
async fn each_outbox_with_its_own_route_and_source(broker: Broker) {
    let orders = TestTable::new("multi_orders").await;
    let billing = TestTable::new("multi_billing").await;
    let dest = Dest::new(broker, "multi", &["order", "billing"]).await;
    // The publisher's route (for `orders`), billing's own, and where each outbox's rows go.
    let (publisher, billing_route, routes) = match &dest {
        Dest::Sink(Sink::RabbitMq(rabbit)) => (
            rabbit_publisher(&rabbit.exchange),
            "routing_key = \"billing.{event_type}\"".to_owned(),
            ["order.created".to_owned(), "billing.created".to_owned()],
        ),
        Dest::Sink(Sink::Kafka { prefix, topics, .. }) => (
            format!(
                "[publisher]\nkind = \"kafka\"\n[publisher.kafka]\nbrokers = \"{KAFKA}\"\n\
                 topic = \"{prefix}-{{aggregate_type}}\"\n"
            ),
            format!("topic = \"{}\"", topics[1]),
            [topics[0].clone(), topics[1].clone()],
        ),
        Dest::Sink(Sink::Http(_)) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
        Dest::Nats(stream) => (
            format!(
                "[publisher]\nkind = \"nats\"\n[publisher.nats]\nurl = \"{NATS_URL}\"\n\
                 subject = \"{}\"\n",
                stream.subject_template()
            ),
            format!("subject = \"{}.billing.{{event_type}}\"", stream.prefix),
            ["order.created", "billing.created"].map(|s| format!("{}.{s}", stream.prefix)),
        ),
        Dest::Redis(streams) => (
            format!(
                "[publisher]\nkind = \"redis\"\n[publisher.redis]\nurl = \"{REDIS_URL}\"\n\
                 stream = \"{}\"\n",
                streams.template()
            ),
            format!("stream = \"{}\"", streams.key("billing.{event_type}")),
            [streams.key("order"), streams.key("billing.created")],
        ),
    };
    let billing_extra = format!("source = \"/billing\"\n{billing_route}\nordering = \"none\"");
    let (relay, dir) = spawn(
        &format!("multi-{broker:?}"),
        &publisher,
        &[
            entry("orders", &orders.name, ""),
            entry("billing", &billing.name, &billing_extra),
        ],
    );
    // `check` shows billing's own route (the broker line shows the publisher's).
    let config = dir.path().join("relay.toml");
    let check = RelayBuilder::bare("multi-check")
        .set("relay.instance_id", "multi-check")
        .output(&["--config", config.to_str().unwrap(), "check"], WAIT)
        .await;
    let own = billing_route.split_once(" = ").map(|(_, r)| r.to_owned());
    let own = format!("billing: route: {} (this outbox's own)", own.unwrap());
    assert!(check.stdout.contains(&own), "{own} in {check:?}");
    assert!(!check.stdout.contains("orders: route:"), "{check:?}");
    let a = orders.insert_ids(&rows(30, "order")).await;
    let b = billing.insert_ids(&rows(30, "invoice")).await;
    orders.wait_all_sent(WAIT).await;
    billing.wait_all_sent(WAIT).await;
    if let Dest::Sink(sink) = &dest {
        sink.wait_received(WAIT).await;
    }

    let mut arrived = dest.arrivals().await;
    // `orders` is relayed with ordering `aggregate`: its rows of each aggregate in seq order.
    let order_ids = arrived
        .iter()
        .filter(|(id, ..)| a.contains(id))
        .map(|(id, ..)| id.to_string())
        .collect::<Vec<_>>();
    analyse(&orders.rows().await, order_ids.iter().map(String::as_str))
        .assert_exactly_once("orders");
    // Each row with its outbox's (route, source).
    let with = |ids: &[Uuid], route: &str, source: &str| -> Vec<_> {
        let arrival = |id: &Uuid| (*id, route.to_owned(), Some(source.to_owned()));
        ids.iter().map(arrival).collect()
    };
    let orders_source = orders.default_source();
    let mut want = [
        with(&a, &routes[0], &orders_source),
        with(&b, &routes[1], "/billing"),
    ]
    .concat();
    arrived.sort();
    want.sort();
    assert_eq!(
        arrived, want,
        "every row once, on its outbox's route with its source, and no other"
    );
    dest.finish(relay, orders).await;
    billing.drop_table().await;
}

#[tokio::test]
async fn one_outboxs_database_down_or_table_missing_does_not_stall_the_others() {
    let up = TestTable::new("multi_db_up").await;
    let behind = TestTable::new("multi_db_down").await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let proxied = format!("postgres://postgres@{}/test", proxy.addr());
    let rabbit = RabbitFixture::new("multi_db", "#", "barrier").await;
    let missing = format!("{}_missing", up.name);
    let port = common::free_port();
    let (mut relay, _dir) = spawn_listening(
        "multi-db",
        &rabbit_publisher(&rabbit.exchange),
        &[
            entry("up", &up.name, ""),
            entry("behind", &behind.name, &format!("url = \"{proxied}\"")),
            entry("missing", &missing, ""),
        ],
        &format!("127.0.0.1:{port}"),
    );
    relay
        .wait_for_log(&format!("table {missing} does not exist"), 1, WAIT)
        .await;
    // Not ready, and /readyz says why rather than that the database is down.
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let why = format!("missing: table {missing} does not exist: run `outbox-relay migrate`");
    // Once the other outboxes' databases have answered, only the table holds it back.
    let not_ready = format!("database: up, not ready ({why}");
    let (code, body) = common::wait_until(
        WAIT,
        "/readyz names the missing table, every database answering",
        async || match common::http_get(addr, "/readyz").await {
            Ok((code, body)) if body.starts_with(&not_ready) => Ok((code, body)),
            Ok((_, body)) => Err(body),
            Err(e) => Err(e),
        },
    )
    .await;
    assert_eq!(code, 503, "{body}");
    // Each table holds only the rows this test inserts: "every row is sent" is about them.
    let first = [
        up.insert_ids(&rows(5, "up")).await,
        behind.insert_ids(&rows(5, "behind")).await,
    ];
    up.wait_all_sent(WAIT).await;
    behind.wait_all_sent(WAIT).await;

    proxy.cut();
    let stuck = behind.insert_ids(&rows(5, "behind")).await;
    let fresh = up.insert_ids(&rows(5, "up")).await;
    // `up` goes on while `behind`'s database is down.
    up.wait_all_sent(WAIT).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let states = behind.rows_by_id(&stuck).await;
    assert!(
        states.values().all(|r| r.status == "pending"),
        "nothing reaches `behind`'s table while its database is unreachable: {states:?}"
    );
    relay.wait_for_log("database unavailable", 1, WAIT).await;

    // `behind` catches up once its database is back.
    proxy.heal();
    behind.wait_all_sent(WAIT).await;
    rabbit
        .wait_for_ids(&[fresh, stuck, first.concat()].concat(), WAIT)
        .await;
    assert!(
        relay.is_running(),
        "the missing table does not stop the relay"
    );
    finish(relay, up, rabbit).await;
    behind.drop_table().await;
}

#[tokio::test]
async fn a_burst_in_one_outbox_does_not_starve_another() {
    let busy = TestTable::new("multi_burst_busy").await;
    let quiet = TestTable::new("multi_burst_quiet").await;
    // The quiet outbox's messages reach the fixture's queue; the busy one's a queue of their
    // own that nobody reads (100,000 deliveries would only slow the test's consumer).
    let rabbit = RabbitFixture::new("multi_burst", "quiet.#", "quiet.barrier").await;
    let conn = lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default())
        .await
        .expect("connect");
    let channel = conn.create_channel().await.expect("channel");
    let sink = format!("{}.busy", rabbit.queue);
    let exclusive = Durability::Exclusive;
    declare_bound_queue(&channel, &rabbit.exchange, &sink, exclusive, "busy.#")
        .await
        .expect("declare the busy queue");
    const BURST: i64 = 100_000;
    let burst = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bulk', 'a' || (i % 1000), 'created', jsonb_build_object('i', i) \
         FROM generate_series(1, {BURST}) AS i",
        busy.name
    );
    busy.db
        .batch_execute(&burst)
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
    busy.wait_for_counts(WAIT, "the busy outbox is draining", |c| c["sent"] >= 2_000)
        .await;

    // Each probe of the quiet outbox is delivered before the next is inserted; the burst
    // still having rows left after the last one shows none of them waited for it to drain.
    let mut latencies = Vec::new();
    for i in 0..21 {
        let inserted = Instant::now();
        let row = NewRow::new("q", Some("q"), "created", json!({ "i": i }));
        let id = quiet.insert_one(row).await;
        let d = rabbit.wait_for_delivery(id, WAIT).await;
        latencies.push(d.received_at.duration_since(inserted));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = busy.count_where("status <> 'sent'").await;
    eprintln!(
        "quiet outbox insert → delivery beside a burst: {latencies:?}; busy rows left {left}"
    );
    assert!(
        left > 0,
        "the burst of {BURST} was over before the quiet outbox's 21 probes were delivered: \
         they waited behind it"
    );
    finish(relay, busy, rabbit).await;
    let _ = conn.close(200, "done".into()).await;
    quiet.drop_table().await;
}
