//! What happens to claimed rows when a relay or its broker goes away (contract §2): SIGTERM under
//! load and with a hung broker (drain, hand back, exit 0 within `shutdown_timeout`), a SIGKILLed
//! relay's rows reclaimed after the lease, unanswered publishes timed out and handed back
//! without spending an attempt, a Kafka broker killed and restarted mid-stream, and ordered
//! Kafka runs behind a broker that stops answering. The injected faults that need exclusive
//! use of a shared service are in `faults.rs`.
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
    NewRow, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, RowState, TempDir, TestTable, analyse,
    assert_none, drop_both, finish, spawn_paced_writer, table_and_exchange, wait_for_count,
    wait_until,
};
use serde_json::json;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_held_by_a_killed_relay_are_reclaimed_after_the_lease() {
    let (table, rabbit) = table_and_exchange("sigkill").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let mut a = RelayBuilder::for_test(&table, &rabbit, "a")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.lease_timeout", "3s")
        .spawn();

    // Warm-up: A is connected through the proxy and publishing.
    let warm = table
        .insert_ids(&NewRow::numbered(5, "warm", None, "w"))
        .await;
    rabbit.wait_for_ids(&warm, Duration::from_secs(30)).await;

    // Black-hole the broker: A's publishes are written but never confirmed.
    proxy.stall();
    let rows: Vec<NewRow> = NewRow::numbered(100, "held", Some(("h-", 10)), "e");
    let held: Vec<Uuid> = table.insert_ids(&rows).await;
    let before: HashMap<Uuid, RowState> = wait_until(
        Duration::from_secs(10),
        "A holds all 100 rows",
        async || {
            let by_id = table.rows_by_id(&held).await;
            let by_a = by_id
                .values()
                .filter(|r| r.status == "processing" && r.locked_by.as_deref() == Some("a"))
                .count();
            if by_a == held.len() {
                Ok(by_id)
            } else {
                Err(format!("{by_a} processing by a"))
            }
        },
    )
    .await;
    let leaked = held
        .iter()
        .filter(|id| rabbit.id_counts().contains_key(&id.to_string()))
        .count();
    assert_eq!(leaked, 0, "the stalled proxy let messages through");

    a.sigkill();
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(
        status.signal(),
        Some(9),
        "relay a should die by SIGKILL: {status}"
    );
    proxy.cut(); // drop A's stale connection and whatever it had written
    proxy.heal();
    assert_eq!(
        table
            .count_where("status = 'processing' AND locked_by = 'a'")
            .await,
        100,
        "a dead relay's rows stay processing until the lease expires"
    );

    // Debug logs of the relay loop show why a reclaim is skipped, should this fail.
    let b = RelayBuilder::for_test(&table, &rabbit, "b")
        .set("relay.lease_timeout", "3s")
        .env("RUST_LOG", "info,lapin=error,outbox_relay::relay=debug")
        .spawn();
    table.wait_all_sent(Duration::from_secs(30)).await;
    rabbit.barrier().await;

    let after = table.rows_by_id(&held).await;
    // Every held row arrived; each aggregate's first arrivals are in seq order (ordering held
    // across the crash).
    let held_rows: Vec<RowState> = after.values().cloned().collect();
    let a = rabbit.analyse(&held_rows);
    assert_none("rows held by the killed relay never arrived", &a.lost);
    assert_none("first arrivals out of seq order", &a.reordered);
    let dups = a.duplicated_ids();
    println!(
        "sigkill: {} ids delivered more than once: {dups:?}",
        dups.len()
    );
    for id in &held {
        let (was, now) = (&before[id], &after[id]);
        assert_eq!(now.status, "sent");
        assert!(now.locked_by.is_none());
        assert_eq!(
            now.attempts,
            was.attempts + 1,
            "reclaimed row {id}: one attempt by a, one by b"
        );
        let lease_end = was.locked_at.unwrap() + chrono::Duration::seconds(3);
        assert!(
            now.sent_at.unwrap() >= lease_end,
            "row {id} sent at {:?}, before a's lease ended at {lease_end}",
            now.sent_at
        );
    }
    assert!(
        b.log_count("reclaimed rows whose relay stopped") >= 1,
        "{}",
        b.stderr()
    );

    finish(b, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_exits_zero_and_leaves_nothing_processing() {
    let (table, rabbit) = table_and_exchange("sigterm").await;
    for chunk in 0..10 {
        let rows: Vec<NewRow> = (0..500)
            .map(|i| {
                NewRow::new(
                    "term",
                    Some(&format!("t-{}", i % 50)),
                    "e",
                    json!({"chunk": chunk, "i": i}),
                )
            })
            .collect();
        table.insert(&rows).await;
    }
    let instance = "sigterm-1";
    let mut relay = RelayBuilder::for_test(&table, &rabbit, instance)
        .set("relay.ordering", "none")
        .set("relay.shutdown_timeout", "10s")
        .spawn();
    wait_for_count(
        Duration::from_secs(60),
        "500 messages delivered",
        500,
        || rabbit.count(),
    )
    .await;

    let t0 = Instant::now();
    relay.sigterm();
    let status = relay.wait_exit(Duration::from_secs(15)).await;
    let took = t0.elapsed();
    assert!(
        status.success(),
        "exit status {status} after SIGTERM\n{}",
        relay.stderr()
    );
    assert!(
        took <= Duration::from_secs(12),
        "shutdown took {took:?} (shutdown_timeout 10s)"
    );

    let counts = table.status_counts().await;
    println!(
        "sigterm after {} deliveries; exited in {took:?}; rows: {counts:?}",
        rabbit.count()
    );
    assert_eq!(
        table
            .count_where(&format!(
                "status = 'processing' AND locked_by = '{instance}'"
            ))
            .await,
        0,
        "rows left processing by the stopped relay: {counts:?}"
    );
    assert_eq!(counts["failed"], 0);
    assert_eq!(counts["sent"] + counts["pending"], 5000);
    assert_eq!(
        table
            .count_where("status = 'pending' AND (attempts <> 0 OR locked_by IS NOT NULL)")
            .await,
        0
    );
    assert_eq!(
        table.count_where("status = 'sent' AND attempts <> 1").await,
        0
    );

    // Every row marked sent was really delivered.
    rabbit.barrier().await;
    let delivered = rabbit.id_counts();
    let sent_ids: Vec<Uuid> = table
        .rows()
        .await
        .into_iter()
        .filter(|r| r.status == "sent")
        .map(|r| r.id)
        .collect();
    let undelivered = sent_ids
        .iter()
        .filter(|id| !delivered.contains_key(&id.to_string()))
        .count();
    assert_eq!(undelivered, 0, "rows marked sent but never delivered");

    // What was handed back is published by the next relay.
    let next = RelayBuilder::for_test(&table, &rabbit, "sigterm-2")
        .set("relay.ordering", "none")
        .spawn();
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    let delivered = rabbit.id_counts();
    assert_eq!(
        table
            .rows()
            .await
            .iter()
            .filter(|r| !delivered.contains_key(&r.id.to_string()))
            .count(),
        0
    );

    finish(next, table, rabbit).await;
}

/// Starts a relay whose broker connection goes through `proxy`, proves it is publishing with a
/// few warm-up rows, then black-holes the proxy and inserts `n` rows; returns their ids once
/// the relay holds them all in `processing`. The warm-up publishes on every channel the
/// publisher opens (it opens them on first use, round-robin), so that behind the black hole
/// the rows wait for confirms, not for a channel to open.
async fn hold_rows_behind_a_black_hole(
    table: &TestTable,
    rabbit: &RabbitFixture,
    proxy: &Proxy,
    instance: &str,
    n: usize,
) -> Vec<Uuid> {
    let warm = table
        .insert_ids(&NewRow::numbered(
            2 * outbox_relay::publish::rabbitmq::CHANNELS,
            "warm",
            None,
            "w",
        ))
        .await;
    rabbit.wait_for_ids(&warm, Duration::from_secs(30)).await;
    proxy.stall();
    let rows: Vec<NewRow> = NewRow::numbered(n, "hole", Some(("h-", 5)), "e");
    let ids: Vec<Uuid> = table.insert_ids(&rows).await;
    let held = format!("status = 'processing' AND locked_by = '{instance}'");
    let n = i64::try_from(n).unwrap();
    table.wait_count(&held, n, Duration::from_secs(10)).await;
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_publishes_time_out_and_are_handed_back_without_spending_attempts() {
    let (table, rabbit) = table_and_exchange("black_hole").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    // max_attempts 2: were a timed-out publish counted as a message failure, the second
    // round would dead-letter the rows.
    let relay = RelayBuilder::for_test(&table, &rabbit, "black-hole")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "1s")
        .set("relay.ordering", "none")
        .set("relay.lease_timeout", "60s")
        .set("retry.max_attempts", "2")
        .spawn();
    let ids = hold_rows_behind_a_black_hole(&table, &rabbit, &proxy, "black-hole", 50).await;

    // confirm_timeout passes: every row is handed back, attempt refunded.
    let refunded = "status = 'pending' AND attempts = 0 AND locked_by IS NULL";
    table
        .wait_count(refunded, 50, Duration::from_secs(15))
        .await;
    assert!(
        relay.log_count("no confirm within") >= 1,
        "{}",
        relay.stderr()
    );
    assert_eq!(table.count_where("status = 'failed'").await, 0);

    // The network comes back (bytes held by the black hole are delivered late).
    proxy.heal();
    table.wait_all_sent(LONG).await;
    rabbit.barrier().await;
    let counts = rabbit.id_counts();
    let missing = ids
        .iter()
        .filter(|id| !counts.contains_key(&id.to_string()))
        .count();
    assert_eq!(missing, 0, "rows lost after the black hole");
    let dups = counts.values().filter(|n| **n > 1).count();
    println!(
        "black hole: {dups} ids delivered more than once (late bytes of the abandoned connection)"
    );
    assert_eq!(
        table.count_where("status <> 'sent' OR attempts <> 1").await,
        0,
        "every row sent on its first counted attempt"
    );

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_hung_broker_hands_rows_back_and_exits_within_shutdown_timeout() {
    let (table, rabbit) = table_and_exchange("term_hung").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let instance = "term-hung";
    let mut relay = RelayBuilder::for_test(&table, &rabbit, instance)
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "60s")
        .set("relay.shutdown_timeout", "4s")
        .set("relay.lease_timeout", "60s")
        .spawn();
    let ids = hold_rows_behind_a_black_hole(&table, &rabbit, &proxy, instance, 40).await;

    let t0 = Instant::now();
    relay.sigterm();
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
    assert!(
        not_back.is_empty(),
        "rows not handed back at shutdown: {not_back:?}\n{}",
        relay.stderr()
    );
    assert!(
        took <= Duration::from_millis(5500),
        "shutdown took {took:?} with relay.shutdown_timeout = 4s\n{}",
        relay.stderr()
    );
    drop(proxy);
    drop_both(table, rabbit).await;
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
    let ProxiedTansu {
        dir,
        port,
        proxy,
        brokers,
        tansu: first,
        topic,
    } = ProxiedTansu::start("restart").await;
    let (advertised, log) = (proxy.addr(), dir.path().join("tansu.log"));

    let relay = kafka_relay(&table, &brokers, &topic, "kafka-restart")
        .set("relay.lease_timeout", "60s")
        .set("retry.base_delay", "100ms")
        .spawn();
    let old_consumer = Collector::start(&brokers, &[&topic]);

    // 3000 rows over ~5 s, 13 aggregates.
    let writer = spawn_paced_writer(&table.name, 150, 20, Duration::from_millis(30), |t, i| {
        NewRow::new(
            "restart",
            Some(&format!("r-{}", (t * 20 + i) % 13)),
            "e",
            json!({"t": t, "i": i}),
        )
    });
    wait_for_count(
        Duration::from_secs(60),
        "300 records read before the kill",
        300,
        || old_consumer.count(),
    )
    .await;

    proxy.cut();
    // What the relay held at the cut: rows the old broker may have confirmed but that are not
    // marked sent yet (their batch waits for a batch-mate stuck in librdkafka).
    let snapshot = table
        .db
        .query_one(
            &format!(
                "SELECT now(), coalesce(array_agg(id) FILTER (WHERE status = 'processing'), '{{}}') FROM {}",
                table.name
            ),
            &[],
        )
        .await
        .unwrap();
    let (cut_at, in_flight_at_cut): (DateTime<Utc>, Vec<Uuid>) = (snapshot.get(0), snapshot.get(1));
    let in_flight_at_cut: HashSet<Uuid> = in_flight_at_cut.into_iter().collect();
    first.kill().await;
    let killed_at = table.db_now().await;
    let outage = Instant::now();
    let old_records = old_consumer.stop().await;

    // The outage spends nothing.
    let spent = table
        .count_where("status = 'failed' OR (status = 'pending' AND attempts > 0)")
        .await;
    assert_eq!(spent, 0, "the outage spent attempts:\n{}", relay.stderr());

    let second = Tansu::start(port, advertised, &log).await;
    create_topic(&second.direct(), &topic).await;
    let up_at = table.db_now().await;
    proxy.heal();
    let outage = outage.elapsed();
    let new_consumer = Collector::start(&brokers, &[&topic]);

    let ids = writer.await.unwrap();
    assert_eq!(ids.len(), 3000);
    // Not wait_all_sent: when the relay cannot recover, say how it is stuck.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let counts = table.status_counts().await;
        if counts["sent"] == 3000 {
            break;
        }
        if Instant::now() > deadline {
            panic!(
                "rows not all sent 60s after the broker came back: {counts:?}; the relay's publish \
                 outcomes since: {} librdkafka Fatal errors, {} UnknownProducerId, {} message \
                 timeouts. The restarted broker does not know the idempotent producer's id: \
                 librdkafka either raises a fatal error (the producer must be replaced) or \
                 retries an epoch bump the broker refuses (the producer is wedged until replaced).",
                relay.log_count("Fatal (Local: Fatal error)"),
                relay.log_count("UnknownProducerId"),
                relay.log_count("MessageTimedOut"),
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    new_consumer.wait_caught_up(&brokers, &topic, LONG).await;
    let new_records = new_consumer.stop().await;

    let rows: HashMap<Uuid, RowState> = table.rows().await.into_iter().map(|r| (r.id, r)).collect();
    let wrong: Vec<_> = rows
        .values()
        .filter(|r| r.status != "sent" || r.attempts != 1)
        .map(|r| (r.id, r.status.clone(), r.attempts, r.last_error.clone()))
        .collect();
    assert!(
        wrong.is_empty(),
        "rows not sent with attempts = 1: {} e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(10)]
    );

    let old = id_counts(&old_records);
    let new = id_counts(&new_records);
    let foreign = old
        .keys()
        .chain(new.keys())
        .filter(|id| !rows.contains_key(id))
        .count();
    assert_eq!(
        foreign, 0,
        "records with ids that are not rows of the table"
    );
    // Not received from either broker: the old broker confirmed them (it held them in memory
    // only) and the test had not read them before the kill. Confirmed means: marked sent
    // before the cut, or held by the relay at the cut (confirmed, batch not yet settled).
    let lost: Vec<&RowState> = rows
        .values()
        .filter(|r| !old.contains_key(&r.id) && !new.contains_key(&r.id))
        .collect();
    let sent_before_cut = lost.iter().filter(|r| r.sent_at.unwrap() <= cut_at).count();
    let held_at_cut = lost
        .iter()
        .filter(|r| r.sent_at.unwrap() > cut_at && in_flight_at_cut.contains(&r.id))
        .count();
    let unexplained: Vec<_> = lost
        .iter()
        .filter(|r| r.sent_at.unwrap() > cut_at && !in_flight_at_cut.contains(&r.id))
        .map(|r| (r.id, r.seq, r.sent_at))
        .collect();
    let lost_sent_after_restart = lost.iter().filter(|r| r.sent_at.unwrap() >= up_at).count();
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
    assert!(
        unexplained.is_empty(),
        "{} rows are on neither broker although the old broker cannot have confirmed them \
         (pending at the cut, marked sent after it), e.g. {:?}",
        unexplained.len(),
        &unexplained[..unexplained.len().min(10)]
    );

    // Per aggregate, in seq order: the rows read from the old broker, then the lost ones, then
    // the rows only the new broker has. Lost rows are the tail the old broker held but the test
    // had not read, published (in order) before anything the new broker got.
    let mut runs: HashMap<String, [Vec<i64>; 3]> = HashMap::new();
    for r in rows.values() {
        let which = if old.contains_key(&r.id) {
            0
        } else if new.contains_key(&r.id) {
            2
        } else {
            1
        };
        runs.entry(r.aggregate_id.clone().unwrap()).or_default()[which].push(r.seq);
    }
    for (agg, [read_old, lost_seqs, only_new]) in &runs {
        let max = |v: &Vec<i64>| v.iter().max().copied();
        let min = |v: &Vec<i64>| v.iter().min().copied();
        let in_order = |a: Option<i64>, b: Option<i64>| a.zip(b).is_none_or(|(a, b)| a < b);
        assert!(
            in_order(max(read_old), min(lost_seqs))
                && in_order(max(lost_seqs), min(only_new))
                && in_order(max(read_old), min(only_new)),
            "aggregate {agg}: lost rows {lost_seqs:?} are not between the rows read from the old \
             broker (up to {:?}) and those on the new one (from {:?})",
            max(read_old),
            min(only_new)
        );
    }

    // Per key on the new broker: one partition, first arrivals in seq order.
    let mut seen = HashSet::new();
    let mut by_key: HashMap<String, Vec<Placed>> = HashMap::new();
    for r in &new_records {
        let id = r.id().unwrap();
        if seen.insert(id) {
            by_key.entry(r.key.clone().unwrap()).or_default().push((
                r.partition,
                r.offset,
                rows[&id].seq,
            ));
        }
    }
    assert_eq!(by_key.len(), 13);
    for (key, mut recs) in by_key {
        let parts: HashSet<i32> = recs.iter().map(|(p, _, _)| *p).collect();
        assert_eq!(parts.len(), 1, "key {key} spread over partitions {parts:?}");
        recs.sort_unstable();
        assert!(
            recs.windows(2).all(|w| w[0].2 < w[1].2),
            "key {key} out of seq order on the new broker: {recs:?}"
        );
    }
    // The relay really lost the broker and came back to the new one.
    assert!(
        new_records.len() > 300,
        "most rows should go to the new broker: {}",
        new_records.len()
    );
    assert!(
        relay.log_count("connected to the broker") >= 2,
        "{}",
        relay.stderr()
    );

    relay.stop().await;
    second.kill().await;
    drop(proxy);
    table.drop_table().await;
}

/// With `ordering = "aggregate"` an aggregate's run goes to the producer without waiting for
/// each delivery report, and librdkafka has no message timeout: the relay enforces
/// `message_timeout` itself. A broker that stops answering (a black hole, longer than that)
/// in the middle of ordered runs: every held row is handed back unspent and the producer is
/// replaced; once the broker answers again every row arrives, and per aggregate the first
/// arrivals are in `seq` order (a record timed out in librdkafka would have let the records
/// queued behind it through ahead of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_kafka_runs_behind_a_black_hole_are_handed_back_and_arrive_in_order() {
    let table = TestTable::new("kafka_hole").await;
    let ProxiedTansu {
        dir: _dir,
        proxy,
        brokers,
        tansu,
        topic,
        ..
    } = ProxiedTansu::start("hole").await;
    let relay = kafka_relay(&table, &brokers, &topic, "kafka-hole")
        .set("relay.ordering", "aggregate")
        .set("publisher.kafka.message_timeout", "2s")
        .set("relay.lease_timeout", "60s")
        .set("retry.max_attempts", "2")
        .spawn();
    let warm = table
        .insert_ids(&NewRow::numbered(5, "warm", Some(("w-", 5)), "w"))
        .await;
    table
        .wait_count("status = 'sent'", warm.len() as i64, LONG)
        .await;

    proxy.stall();
    // Five aggregates, runs of 40: one claim holds them all.
    let ids = table
        .insert_ids(&NewRow::numbered(200, "hole", Some(("h-", 5)), "e"))
        .await;
    // message_timeout passes: handed back, attempts refunded, nothing dead-lettered.
    wait_until(
        Duration::from_secs(30),
        "the held runs are handed back",
        async || {
            let n = relay.log_count("no delivery report within");
            if n > 0 { Ok(n) } else { Err(relay.stderr()) }
        },
    )
    .await;
    let refunded = "status = 'pending' AND attempts = 0 AND locked_by IS NULL";
    table
        .wait_count(refunded, ids.len() as i64, Duration::from_secs(15))
        .await;
    assert_eq!(table.count_where("status = 'failed'").await, 0);

    proxy.heal();
    table.wait_all_sent(LONG).await;
    let consumer = Collector::start(&brokers, &[&topic]);
    consumer.wait_caught_up(&brokers, &topic, LONG).await;
    let records = consumer.stop().await;
    let rows = table.rows().await;
    let arrivals: Vec<String> = records
        .iter()
        .filter_map(|r| r.id().map(|id| id.to_string()))
        .collect();
    let analysis = analyse(&rows, arrivals.iter().map(String::as_str));
    analysis.assert_complete("ordered kafka behind a black hole");
    assert_eq!(
        table.count_where("status <> 'sent' OR attempts <> 1").await,
        0,
        "every row sent on its first counted attempt"
    );
    assert!(
        relay.log_count("replacing the Kafka producer") >= 1,
        "{}",
        relay.stderr()
    );
    println!(
        "ordered kafka black hole: {} records for {} rows ({} duplicates)",
        records.len(),
        rows.len(),
        analysis.duplicates
    );
    relay.stop().await;
    tansu.kill().await;
    drop(proxy);
    table.drop_table().await;
}
