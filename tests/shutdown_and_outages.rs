//! What happens to claimed rows when a relay or its broker goes away (docs/design.md): SIGTERM under
//! load and with a hung broker (drain, hand back, exit 0 within `shutdown_timeout`), a SIGKILLed
//! relay's rows reclaimed after the lease, unanswered publishes timed out and handed back
//! without spending an attempt (one scenario, run on RabbitMQ and on Kafka with ordered runs),
//! a Kafka broker killed and restarted mid-stream. The injected faults that need exclusive use
//! of a shared service are in `faults.rs`.
//!
//! The Kafka outage tests run a private tansu behind the harness's TCP proxy; the shared broker
//! (127.0.0.1:9092) does not auto-create topics, so every Kafka test creates its own.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::kafka::{
    Collector, Placed, Tansu, create_topic, free_port, id_counts, kafka_relay, topic_name,
};
use common::{
    Analysis, NewRow, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, RowState, TempDir,
    TestTable, analyse, assert_none, finish, not_sent_once, spawn_paced_writer, table_and_exchange,
    wait_for_count, wait_until,
};
use outbox_relay::publish::rabbitmq;
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_held_by_a_killed_relay_are_reclaimed_after_the_lease() {
    let table = TestTable::new("sigkill").await;
    let broker = Broker::rabbitmq("sigkill").await;
    let Broker::RabbitMq(rabbit, proxy) = &broker else {
        unreachable!("Broker::rabbitmq starts a RabbitMQ broker")
    };
    let mut a = broker
        .relay(&table, "a")
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.lease_timeout", "3s")
        .spawn();

    // Black-hole the broker once A publishes: its publishes are written but never confirmed.
    let held = hold_rows_behind_a_black_hole(&table, &broker, "a", 100).await;
    let before: HashMap<Uuid, RowState> = table.rows_by_id(&held).await;
    let arrived = rabbit.analyse(&before.values().cloned().collect::<Vec<_>>());
    let leaked: Vec<&Uuid> = arrived.counts.keys().collect();
    assert_none("held rows the stalled proxy let through", &leaked);

    a.sigkill();
    let status = a.wait_exit(Duration::from_secs(10)).await;
    let why = format!("relay a should die by SIGKILL: {status}");
    assert_eq!(status.signal(), Some(9), "{why}");
    proxy.cut(); // drop A's stale connection and whatever it had written
    proxy.heal();
    let still_held = table
        .count_where("status = 'processing' AND locked_by = 'a'")
        .await;
    let why = "a dead relay's rows stay processing until the lease expires";
    assert_eq!(still_held, 100, "{why}");

    // Debug logs of the relay loop show why a reclaim is skipped, should this fail.
    let b = RelayBuilder::for_test(&table, rabbit, "b")
        .set("relay.lease_timeout", "3s")
        .env("RUST_LOG", "info,lapin=error,outbox_relay::relay=debug")
        .spawn();
    table.wait_all_sent(Duration::from_secs(30)).await;
    rabbit.barrier().await;

    let after = table.rows_by_id(&held).await;
    // Every held row arrived; each aggregate's first arrivals are in seq order (ordering held
    // across the crash).
    let analysis = rabbit.analyse(&after.values().cloned().collect::<Vec<_>>());
    assert_none(
        "rows held by the killed relay never arrived",
        &analysis.lost,
    );
    assert_none("first arrivals out of seq order", &analysis.reordered);
    let dups = analysis.duplicated_ids();
    println!(
        "sigkill: {} ids delivered more than once: {dups:?}",
        dups.len()
    );
    for id in &held {
        let (was, now) = (&before[id], &after[id]);
        assert_eq!(now.status, "sent");
        assert!(now.locked_by.is_none());
        let why = format!("reclaimed row {id}: one attempt by a, one by b");
        assert_eq!(now.attempts, was.attempts + 1, "{why}");
        let lease_end = was.locked_at.unwrap() + chrono::Duration::seconds(3);
        let sent_at = now.sent_at.unwrap();
        let why = format!("row {id} sent at {sent_at}, before a's lease ended at {lease_end}");
        assert!(sent_at >= lease_end, "{why}");
    }
    let reclaimed = b.log_count("reclaimed rows whose relay stopped");
    assert!(reclaimed >= 1, "{}", b.stderr());

    b.stop().await;
    broker.teardown(table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_zero_and_leaves_nothing_processing() {
    let (table, rabbit) = table_and_exchange("sigterm").await;
    let rows = NewRow::numbered(500, "term", Some(("t-", 50)), "e");
    for _ in 0..10 {
        table.insert(&rows).await;
    }
    let instance = "sigterm-1";
    let mut relay = RelayBuilder::for_test(&table, &rabbit, instance)
        .set("relay.ordering", "none")
        .set("relay.shutdown_timeout", "10s")
        .spawn();
    let (what, delivered) = ("500 messages delivered", || rabbit.count());
    wait_for_count(Duration::from_secs(60), what, 500, delivered).await;

    let t0 = Instant::now();
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(15)).await;
    let took = t0.elapsed();
    let why = format!("exit status {status} after SIGTERM\n{}", relay.stderr());
    assert!(status.success(), "{why}");
    let why = format!("shutdown took {took:?} (shutdown_timeout 10s)");
    assert!(took <= Duration::from_secs(12), "{why}");

    let counts = table.status_counts().await;
    println!(
        "sigterm after {} deliveries; exited in {took:?}; rows: {counts:?}",
        rabbit.count()
    );
    assert_eq!(counts["failed"], 0);
    assert_eq!(counts["sent"] + counts["pending"], 5000);
    let none_left = [
        format!("status = 'processing' AND locked_by = '{instance}'"),
        "status = 'pending' AND (attempts <> 0 OR locked_by IS NOT NULL)".to_owned(),
        "status = 'sent' AND attempts <> 1".to_owned(),
    ];
    for rows_left in none_left {
        let n = table.count_where(&rows_left).await;
        assert_eq!(n, 0, "rows where {rows_left}: {counts:?}");
    }

    // Every row marked sent was really delivered.
    rabbit.barrier().await;
    let mut sent = table.rows().await;
    sent.retain(|r| r.status == "sent");
    let lost = rabbit.analyse(&sent).lost;
    assert_none("rows marked sent but never delivered", &lost);

    // What was handed back is published by the next relay.
    let next = RelayBuilder::for_test(&table, &rabbit, "sigterm-2")
        .set("relay.ordering", "none")
        .spawn();
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    let a = rabbit.analyse(&table.rows().await);
    a.ignoring_order().assert_complete("after the next relay");

    finish(next, table, rabbit).await;
}

/// A broker behind a TCP proxy that the test controls: a test exchange on the shared RabbitMQ,
/// or a private tansu (see [`ProxiedTansu`]).
enum Broker {
    RabbitMq(RabbitFixture, Proxy),
    Kafka(ProxiedTansu),
}

impl Broker {
    /// A test exchange on the shared RabbitMQ, its queue bound with `#`.
    async fn rabbitmq(label: &str) -> Self {
        let rabbit = RabbitFixture::new(label, "#", "it.barrier").await;
        Self::RabbitMq(rabbit, Proxy::start(RABBIT_ADDR).await)
    }

    /// A private tansu with a topic of its own.
    async fn kafka(label: &str) -> Self {
        Self::Kafka(ProxiedTansu::start(label).await)
    }

    fn proxy(&self) -> &Proxy {
        match self {
            Self::RabbitMq(_, proxy) => proxy,
            Self::Kafka(k) => &k.proxy,
        }
    }

    /// A relay for `table` publishing through the proxy.
    fn relay(&self, table: &TestTable, instance: &str) -> RelayBuilder {
        match self {
            Self::RabbitMq(rabbit, proxy) => RelayBuilder::for_test(table, rabbit, instance)
                .set("publisher.rabbitmq.url", proxy.amqp_url()),
            Self::Kafka(k) => kafka_relay(table, &k.brokers, &k.topic, instance),
        }
    }

    /// Everything the broker holds (once the relay is done), in arrival order, checked against
    /// `expected` (see [`analyse`]).
    async fn analyse(&self, expected: &[RowState]) -> Analysis {
        match self {
            Self::RabbitMq(rabbit, _) => {
                rabbit.barrier().await;
                rabbit.analyse(expected)
            }
            Self::Kafka(k) => {
                let consumer = Collector::start(&k.brokers, &[&k.topic]);
                consumer.wait_caught_up(&k.brokers, &k.topic, LONG).await;
                let records = consumer.stop().await;
                let ids = records
                    .iter()
                    .map(|r| r.header("ce_id").unwrap_or("<no ce_id>"));
                analyse(expected, ids)
            }
        }
    }

    /// Deletes the exchange or kills the private tansu, and drops `table`.
    async fn teardown(self, table: TestTable) {
        match self {
            Self::RabbitMq(rabbit, _) => rabbit.teardown().await,
            Self::Kafka(k) => k.tansu.kill().await,
        }
        table.drop_table().await;
    }
}

/// With a few warm-up rows, proves that the relay on `table` (its only one, started through
/// [`Broker::relay`]) publishes through the broker's proxy: on RabbitMQ the rows arrive at the
/// test's queue and are marked sent, on Kafka they are marked sent. Then black-holes the proxy
/// and inserts `n` rows, and returns their ids.
///
/// On RabbitMQ it returns once the relay `instance` holds them all in `processing`. The warm-up
/// publishes on every channel the RabbitMQ publisher opens (it opens them on first use,
/// round-robin), so that behind the black hole the rows wait for confirms, not for a channel to
/// open. On Kafka it returns at once: an ordered Kafka relay holds rows only until its
/// `message_timeout` hands them back, too short a moment to be sure of seeing.
async fn hold_rows_behind_a_black_hole(
    table: &TestTable,
    broker: &Broker,
    instance: &str,
    n: usize,
) -> Vec<Uuid> {
    let warm = NewRow::numbered(2 * rabbitmq::CHANNELS, "warm", None, "w");
    let warm_ids = table.insert_ids(&warm).await;
    let warm_sent = "status = 'sent' AND aggregate_type = 'warm'";
    let warm_n = warm_ids.len() as i64;
    match broker {
        Broker::RabbitMq(rabbit, _) => {
            let within = Duration::from_secs(30);
            rabbit.wait_for_ids(&warm_ids, within).await;
            table.wait_count(warm_sent, warm_n, within).await;
        }
        Broker::Kafka(_) => table.wait_count(warm_sent, warm_n, LONG).await,
    }
    broker.proxy().stall();
    let rows = NewRow::numbered(n, "hole", Some(("h-", 5)), "e");
    let ids = table.insert_ids(&rows).await;
    if let Broker::RabbitMq(..) = broker {
        let held = format!("status = 'processing' AND locked_by = '{instance}'");
        table
            .wait_count(&held, n as i64, Duration::from_secs(10))
            .await;
    }
    ids
}

/// What the black-hole scenario ([`black_hole`]) does on one broker.
struct BlackHole {
    /// Names the table, the exchange or topic, and (`_` as `-`) the relay instance.
    label: &'static str,
    /// Rows inserted behind the black hole.
    rows: usize,
    /// The publish timeout under test (shorter than the black hole) and the ordering.
    settings: &'static [(&'static str, &'static str)],
    /// What the relay logs when the publish timeout passes: waited for.
    timed_out: &'static str,
    /// How long the relay may take to log `timed_out` and hand every row back.
    hand_back_within: Duration,
    /// Whether per aggregate the first arrivals must be in `seq` order.
    ordered: bool,
    /// What else the relay must have logged by the end.
    also_logs: &'static [&'static str],
    /// Why ids may arrive twice (for the report; empty when not known).
    duplicates_from: &'static str,
}

/// RabbitMQ with `ordering = "none"`: the held rows time out waiting for confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_rabbitmq_publishes_time_out_and_are_handed_back_without_spending_attempts() {
    let case = BlackHole {
        label: "black_hole",
        rows: 50,
        settings: &[
            ("publisher.rabbitmq.confirm_timeout", "1s"),
            ("relay.ordering", "none"),
        ],
        timed_out: "no confirm within",
        hand_back_within: Duration::from_secs(15),
        ordered: false,
        also_logs: &[],
        duplicates_from: " (late bytes of the abandoned connection)",
    };
    black_hole(&case, Broker::rabbitmq(case.label).await).await;
}

/// Kafka with ordered runs: five aggregates, runs of 40 (one claim holds them all). With
/// `ordering = "aggregate"` an aggregate's run goes to the producer without waiting for each
/// delivery report, and librdkafka has no message timeout: the relay enforces `message_timeout`
/// itself, and replaces the producer. Per aggregate the first arrivals must be in `seq` order (a
/// record timed out in librdkafka would have let the records queued behind it through ahead of
/// it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_kafka_runs_behind_a_black_hole_are_handed_back_and_arrive_in_order() {
    let case = BlackHole {
        label: "kafka_hole",
        rows: 200,
        settings: &[
            ("relay.ordering", "aggregate"),
            ("publisher.kafka.message_timeout", "2s"),
        ],
        timed_out: "no delivery report within",
        // 30 s to log the timeout, then 15 s to hand every row back.
        hand_back_within: Duration::from_secs(45),
        ordered: true,
        also_logs: &["replacing the Kafka producer"],
        duplicates_from: "",
    };
    black_hole(&case, Broker::kafka(case.label).await).await;
}

/// Replacing a stuck ordered producer purges what it still holds; its records still awaited
/// come back as purged and are handed back. Those outcomes are the old producer's: they must not
/// mark its successor for replacement. (Seen in CI after a broker restart: one stuck producer
/// was followed by three replacements within 50 ms, each purging its successor's records in
/// flight.) Rows go behind a black hole in two bursts 1.5 s apart, so that when the first burst
/// times out the second is still awaited. The network stays black-holed until the new
/// producer's first connection check has failed (the relay retries it), then comes back: the
/// producer that was checked is kept, so the producer is replaced exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_kafka_producer_does_not_take_its_successor_down() {
    let (label, instance) = ("kafka_successor", "kafka-successor");
    let broker = Broker::kafka(label).await;
    let table = TestTable::new(label).await;
    let relay = broker
        .relay(&table, instance)
        .set("relay.ordering", "aggregate")
        .set("publisher.kafka.message_timeout", "3s")
        .set("relay.lease_timeout", "60s")
        .spawn();
    hold_rows_behind_a_black_hole(&table, &broker, instance, 50).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let late = NewRow::numbered(50, "late", Some(("l-", 5)), "e");
    table.insert_ids(&late).await;

    let replacing = "replacing the Kafka producer";
    let retrying = "not claiming rows until it is back";
    wait_until(
        LONG,
        "the relay fails to connect its new producer",
        async || match (relay.log_count(replacing), relay.log_count(retrying)) {
            (r, f) if r >= 1 && f >= 1 => Ok(()),
            (r, f) => Err(format!(
                "{r} replacement(s), {f} failed connection check(s)"
            )),
        },
    )
    .await;
    broker.proxy().heal();
    table.wait_all_sent(LONG).await;
    let replaced = relay.log_count(replacing);
    assert_eq!(replaced, 1, "producers replaced:\n{}", relay.stderr());

    let rows = table.rows().await;
    broker.analyse(&rows).await.assert_complete(label);
    assert_none("rows not sent with attempts = 1", &not_sent_once(&rows));
    relay.stop().await;
    broker.teardown(table).await;
}

/// A broker that stops answering (a black hole, longer than the publish timeout: RabbitMQ's
/// `confirm_timeout` with `ordering = "none"`, Kafka's `message_timeout` in the middle of
/// ordered runs): every held row is handed back (no attempt spent); once the broker answers again every
/// row arrives and is sent on its first counted attempt. `broker` was started for `case.label`.
async fn black_hole(case: &BlackHole, broker: Broker) {
    let (label, n) = (case.label, case.rows);
    let table = TestTable::new(label).await;
    let instance = label.replace('_', "-");
    let mut relay = broker.relay(&table, &instance);
    for (key, value) in case.settings {
        relay = relay.set(key, *value);
    }
    // max_attempts 2: were a timed-out publish counted as a message failure, the second round
    // would dead-letter the rows.
    let relay = relay
        .set("relay.lease_timeout", "60s")
        .set("retry.max_attempts", "2")
        .spawn();
    hold_rows_behind_a_black_hole(&table, &broker, &instance, n).await;

    // The publish timeout passes: the relay says so, and hands every row back, no attempt
    // spent. (On Kafka the rows may not have been claimed yet: the log line says they were.)
    let handed_back = "status = 'pending' AND attempts = 0 AND locked_by IS NULL";
    let what = format!(
        "the relay logs {:?} and hands all {n} rows back",
        case.timed_out
    );
    wait_until(case.hand_back_within, &what, async || {
        let noticed = relay.log_count(case.timed_out);
        match table.count_where(handed_back).await {
            back if noticed >= 1 && back == n as i64 => Ok(()),
            back => Err(format!("logged {noticed} time(s), {back} rows handed back")),
        }
    })
    .await;
    assert_eq!(table.count_where("status = 'failed'").await, 0);

    // The network comes back (bytes held by the black hole are delivered late).
    broker.proxy().heal();
    table.wait_all_sent(LONG).await;
    let rows = table.rows().await;
    let analysis = broker.analyse(&rows).await;
    let duplicated = analysis.duplicated_ids().len();
    if case.ordered {
        analysis.assert_complete(label);
    } else {
        // `ordering = "none"` promises no order.
        analysis.ignoring_order().assert_complete(label);
    }
    for line in case.also_logs {
        let logged = relay.log_count(line);
        assert!(logged >= 1, "never logged {line:?}:\n{}", relay.stderr());
    }
    assert_none("rows not sent with attempts = 1", &not_sent_once(&rows));
    println!(
        "{label}: {duplicated} ids of {} rows delivered more than once{}",
        rows.len(),
        case.duplicates_from
    );
    relay.stop().await;
    broker.teardown(table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_hung_broker_hands_rows_back_and_exits_within_shutdown_timeout() {
    let table = TestTable::new("term_hung").await;
    let broker = Broker::rabbitmq("term_hung").await;
    let instance = "term-hung";
    let mut relay = broker
        .relay(&table, instance)
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.shutdown_timeout", "4s")
        .set("relay.lease_timeout", "60s")
        .spawn();
    let ids = hold_rows_behind_a_black_hole(&table, &broker, instance, 40).await;

    let t0 = Instant::now();
    relay.sigterm();
    // The exit is bounded by the 4 s deadline, not by the hung broker (confirm timeout 60 s)
    // or the 60 s lease: otherwise these 30 s run out first.
    let status = relay.wait_exit(Duration::from_secs(30)).await;
    let took = t0.elapsed();
    println!("sigterm with a hung broker: exited with {status} after {took:?}");
    assert!(status.success(), "exit status {status}\n{}", relay.stderr());
    // The rows were handed back, not left to the lease.
    let rows = table.rows_by_id(&ids).await;
    let not_back: Vec<_> = rows
        .values()
        .filter(|r| r.status != "pending" || r.attempts != 0 || r.locked_by.is_some())
        .map(|r| (r.id, r.status.clone(), r.attempts, r.locked_by.clone()))
        .collect();
    let logs = relay.stderr();
    let why = format!("rows not handed back at shutdown: {not_back:?}\n{logs}");
    assert!(not_back.is_empty(), "{why}");

    broker.teardown(table).await;
}

/// A private tansu whose every connection (bootstrap and the advertised leader address) goes
/// through a proxy the test controls, with a topic created on it.
struct ProxiedTansu {
    /// Holds the broker's log.
    dir: TempDir,
    port: u16,
    proxy: Proxy,
    /// The proxy's address, as the relay and consumers are given it.
    brokers: String,
    tansu: Tansu,
    topic: String,
}

impl ProxiedTansu {
    async fn start(label: &str) -> Self {
        let dir = TempDir::new(&format!("kafka-{label}"));
        let port = free_port();
        let proxy = Proxy::start(&format!("127.0.0.1:{port}")).await;
        let brokers = proxy.addr().to_string();
        let tansu = Tansu::start(port, proxy.addr(), &dir.path().join("tansu.log")).await;
        let topic = topic_name(label);
        create_topic(&tansu.direct(), &topic).await;
        Self {
            dir,
            port,
            proxy,
            brokers,
            tansu,
            topic,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_and_restarted_mid_stream_spends_no_attempt() {
    let table = TestTable::new("kafka_restart").await;
    let kafka = ProxiedTansu::start("restart").await;

    let relay = kafka_relay(&table, &kafka.brokers, &kafka.topic, "kafka-restart")
        .set("relay.lease_timeout", "60s")
        .set("retry.base_delay", "100ms")
        .spawn();
    let old_consumer = Collector::start(&kafka.brokers, &[&kafka.topic]);

    // 3000 rows over ~5 s, 13 aggregates.
    let row = |t, i| {
        let aggregate = format!("r-{}", (t * 20 + i) % 13);
        NewRow::new("restart", Some(&aggregate), "e", json!({"t": t, "i": i}))
    };
    let writer = spawn_paced_writer(&table.name, 150, 20, Duration::from_millis(30), row);
    let what = "300 records read before the kill";
    wait_for_count(Duration::from_secs(60), what, 300, || old_consumer.count()).await;

    kafka.proxy.cut();
    // What the relay held at the cut: rows the old broker may have confirmed but that are not
    // marked sent yet (their batch waits for a batch-mate stuck in librdkafka).
    let sql = format!(
        "SELECT now(), coalesce(array_agg(id) FILTER (WHERE status = 'processing'), '{{}}') FROM {}",
        table.name
    );
    let snapshot = table.db.query_one(&sql, &[]).await.unwrap();
    let cut_at: DateTime<Utc> = snapshot.get(0);
    let in_flight_at_cut: HashSet<Uuid> = snapshot.get::<_, Vec<Uuid>>(1).into_iter().collect();
    kafka.tansu.kill().await;
    let killed_at = table.db_now().await;
    let outage = Instant::now();
    let old_records = old_consumer.stop().await;

    // The outage spends nothing.
    let spent = table
        .count_where("status = 'failed' OR (status = 'pending' AND attempts > 0)")
        .await;
    assert_eq!(spent, 0, "the outage spent attempts:\n{}", relay.stderr());

    let log = kafka.dir.path().join("tansu.log");
    let second = Tansu::start(kafka.port, kafka.proxy.addr(), &log).await;
    create_topic(&second.direct(), &kafka.topic).await;
    let up_at = table.db_now().await;
    kafka.proxy.heal();
    let outage = outage.elapsed();
    let new_consumer = Collector::start(&kafka.brokers, &[&kafka.topic]);

    let ids = writer.await.unwrap();
    assert_eq!(ids.len(), 3000);
    // Not wait_all_sent: when the relay cannot recover, say how it is stuck (the relay's log is
    // searched only then).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = table.status_counts().await;
        if counts["sent"] == 3000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rows not all sent 60s after the broker came back: {counts:?}; the relay's publish \
             outcomes: {} librdkafka Fatal errors, {} UnknownProducerId, {} message timeouts. The \
             restarted broker does not know the idempotent producer's id: librdkafka either \
             raises a fatal error (the producer must be replaced) or retries an epoch bump the \
             broker refuses (the producer is wedged until replaced).",
            relay.log_count("Fatal (Local: Fatal error)"),
            relay.log_count("UnknownProducerId"),
            relay.log_count("MessageTimedOut"),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    new_consumer
        .wait_caught_up(&kafka.brokers, &kafka.topic, LONG)
        .await;
    let new_records = new_consumer.stop().await;

    let all = table.rows().await;
    assert_none("rows not sent with attempts = 1", &not_sent_once(&all));
    let rows: HashMap<Uuid, RowState> = all.into_iter().map(|r| (r.id, r)).collect();

    let (old, new) = (id_counts(&old_records), id_counts(&new_records));
    let mut foreign: Vec<_> = old.keys().chain(new.keys()).collect();
    foreign.retain(|id| !rows.contains_key(id));
    assert_none("records with ids that are not rows of the table", &foreign);
    // Not received from either broker: the old broker confirmed them (it held them in memory
    // only) and the test had not read them before the kill. Confirmed means: marked sent
    // before the cut, or held by the relay at the cut (confirmed, batch not yet settled).
    let mut lost: Vec<&RowState> = rows.values().collect();
    lost.retain(|r| !old.contains_key(&r.id) && !new.contains_key(&r.id));
    let count = |keep: &dyn Fn(&RowState) -> bool| lost.iter().filter(|r| keep(r)).count();
    let sent_after_cut = |r: &RowState| r.sent_at.unwrap() > cut_at;
    let sent_before_cut = count(&|r| !sent_after_cut(r));
    let held_at_cut = count(&|r| sent_after_cut(r) && in_flight_at_cut.contains(&r.id));
    let lost_sent_after_restart = count(&|r| r.sent_at.unwrap() >= up_at);
    let unexplained: Vec<_> = lost
        .iter()
        .filter(|r| sent_after_cut(r) && !in_flight_at_cut.contains(&r.id))
        .map(|r| (r.id, r.seq, r.sent_at))
        .collect();
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
    let why = "rows on neither broker although the old broker cannot have confirmed them \
               (pending at the cut, marked sent after it)";
    assert_none(why, &unexplained);

    // Per aggregate, in seq order: the rows read from the old broker, then the lost ones, then
    // the rows only the new broker has. Lost rows are the tail the old broker held but the test
    // had not read, published (in order) before anything the new broker got.
    let mut runs: HashMap<String, [Vec<i64>; 3]> = HashMap::new();
    for r in rows.values() {
        let which = match (old.contains_key(&r.id), new.contains_key(&r.id)) {
            (true, _) => 0,
            (false, false) => 1,
            (false, true) => 2,
        };
        runs.entry(r.aggregate_id.clone().unwrap()).or_default()[which].push(r.seq);
    }
    for (agg, [read_old, lost_seqs, only_new]) in &runs {
        let max = |v: &Vec<i64>| v.iter().max().copied();
        let min = |v: &Vec<i64>| v.iter().min().copied();
        let in_order = |a: Option<i64>, b: Option<i64>| a.zip(b).is_none_or(|(a, b)| a < b);
        let (old_end, new_start) = (max(read_old), min(only_new));
        let between = in_order(old_end, min(lost_seqs))
            && in_order(max(lost_seqs), new_start)
            && in_order(old_end, new_start);
        assert!(
            between,
            "aggregate {agg}: lost rows {lost_seqs:?} are not between the rows read from the old \
             broker (up to {old_end:?}) and those on the new one (from {new_start:?})"
        );
    }

    // Per key on the new broker: one partition, first arrivals in seq order.
    let mut seen = HashSet::new();
    let mut by_key: HashMap<String, Vec<Placed>> = HashMap::new();
    for r in &new_records {
        let id = r.id().unwrap();
        if seen.insert(id) {
            let placed = (r.partition, r.offset, rows[&id].seq);
            by_key
                .entry(r.key.clone().unwrap())
                .or_default()
                .push(placed);
        }
    }
    assert_eq!(by_key.len(), 13);
    for (key, mut recs) in by_key {
        let parts: HashSet<i32> = recs.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(parts.len(), 1, "key {key} spread over partitions {parts:?}");
        recs.sort_unstable();
        let in_order = recs.windows(2).all(|w| w[0].2 < w[1].2);
        let why = format!("key {key} out of seq order on the new broker: {recs:?}");
        assert!(in_order, "{why}");
    }
    // The relay really lost the broker and came back to the new one.
    let on_new = new_records.len();
    let why = format!("most rows should go to the new broker: {on_new}");
    assert!(on_new > 300, "{why}");
    let connected = relay.log_count("connected to the broker");
    assert!(connected >= 2, "{}", relay.stderr());

    relay.stop().await;
    second.kill().await;
    table.drop_table().await;
}

/// A missing exchange is the broker's state, not any row's fault: with `declare_exchange =
/// false`, `check` names it and `run` does not claim; an exchange deleted under a running
/// relay makes it hand the row back unspent and report the broker down (never a dead letter)
/// until the exchange is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_dead_letters_nothing() {
    let (table, rabbit) = table_and_exchange("missing_exchange").await;
    let metrics = common::free_port();
    let relay = || {
        RelayBuilder::for_test(&table, &rabbit, "missing-exchange")
            .set("publisher.rabbitmq.declare_exchange", "false")
            .set("retry.base_delay", "100ms")
            .set("retry.max_attempts", "2")
    };
    let running = relay()
        .set("metrics.listen", format!("127.0.0.1:{metrics}"))
        .spawn();
    let first = table
        .insert_one(NewRow::new("order", Some("x-1"), "created", json!({})))
        .await;
    rabbit.wait_for_delivery(first, LONG).await;

    rabbit.delete_exchange().await;
    let second = table
        .insert_one(NewRow::new("order", Some("x-2"), "created", json!({})))
        .await;
    running
        .wait_for_log("does not exist (the broker closed the channel", 1, LONG)
        .await;
    let ready = async || {
        common::http_get(format!("127.0.0.1:{metrics}").parse().unwrap(), "/readyz")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    wait_until(LONG, "readyz says the broker is down", async || {
        let body = ready().await;
        body.contains("broker: down").then_some(()).ok_or(body)
    })
    .await;
    let out = relay().output(&["check"], LONG).await;
    assert!(!out.status.success(), "{}", out.stdout);
    out.assert_stdout_has(&format!("exchange {:?} cannot be used", rabbit.exchange));
    out.assert_stdout_has("set publisher.rabbitmq.declare_exchange = true");
    let row = table.row(second).await;
    assert_eq!(
        (row.status.as_str(), row.attempts),
        ("pending", 0),
        "handed back unspent: {row:?}"
    );

    rabbit.restore_exchange("#").await;
    rabbit.wait_for_delivery(second, LONG).await;
    table.wait_all_sent(LONG).await;
    assert_eq!(table.count_where("status = 'failed'").await, 0);
    finish(running, table, rabbit).await;
}
