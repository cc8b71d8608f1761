//! Fault injection: the real binary against the real PostgreSQL, RabbitMQ and tansu while things
//! go wrong.
//!
//! 1. SIGKILLs of one of three replicas under load (`ordering = "aggregate"`, 2 s lease, writers
//!    serialised per aggregate on a version counter), each followed by a restart: nothing lost,
//!    per-aggregate order of first arrival intact (and equal to the writers' version order), and
//!    every duplicate explained by a claim of a killed incarnation (a trigger audits claims).
//!    And SIGKILLs of a relay draining a backlog, over HTTP, on RabbitMQ and on Kafka: at
//!    every kill at most `relay.max_in_flight` rows claimed and not settled, every duplicate
//!    one of those published, nothing lost or reordered.
//! 2. Outages the relay must ride out in the same process without spending an attempt: its
//!    RabbitMQ (with publishes in flight; ordering none and aggregate) or PostgreSQL connections
//!    cut by a proxy (one scenario, the service a parameter), a RabbitMQ connection cut on
//!    every publish (reopened after growing pauses, not in a loop), RabbitMQ restarted for real
//!    (`rabbitmqctl stop_app`/`start_app`, a durable queue and a reconnecting consumer),
//!    PostgreSQL restarted for real (`pg_ctlcluster … restart`), PostgreSQL black-holed by a
//!    proxy (connections open, nothing answered), a database outage longer than the lease, a
//!    claim whose answer was lost (made by hand: back after the lease; made by a
//!    proxy that holds the answer back: handed back as soon as the database answers).
//! 3. Kafka broker restarts are covered by `tests/shutdown_and_outages.rs`
//!    (`broker_killed_and_restarted_mid_stream_spends_no_attempt`), not repeated here.
//! 4. Poison rows, each failing or passing on its own: header values of every JSON kind (numbers
//!    beyond i64/u64/f64 kept exact), headers that are not an object, names and routing keys
//!    over AMQP's 255 bytes, headers larger than one AMQP frame, a `bytea` payload of arbitrary bytes, a message over RabbitMQ's
//!    `max_message_size`, Kafka topics that cannot exist, a Kafka produce batch the broker
//!    rejects for one record in it, and a 10,000-row aggregate ahead of 50 small ones.
//! 5. A row that crashes the relay (the crash switch of the `fault-injection` feature, which the
//!    tests' dev-dependency turns on) under a supervisor that restarts it: dead-lettered after
//!    `retry.max_attempts` crash cycles, its batch-mates sent, each charged for one crash at most.
//!    And a row that makes the relay panic while settling its batch (the settle panic switch):
//!    the same end, in one relay process that never stops.
//! 6. Secrets on failure paths (`check`, `status`, `dead-letters list`, `run` logs in text and
//!    JSON), PostgreSQL TLS with `sslmode=require`, the metrics server on loopback by default.
//!
//! Two forms:
//! - short (the default, part of `cargo test`): a few faults of each kind, a few minutes in all;
//! - soak (`OUTBOX_SOAK=1`, run by `scripts/soak.sh`): 25 kills, 30 s outages, three restarts
//!   of each service, the huge aggregate run to its end.
//!
//! Every fault test prints one `FAULT-SUMMARY` line on stdout (`--nocapture` shows it): fault,
//! faults injected, rows, lost (asserted 0), reordered (asserted 0), duplicates.
//!
//! Isolation: tests that stop or restart a shared service take [`SERVICES`] for writing, every
//! other test takes it for reading, so a restart never overlaps another test of this file (cargo
//! runs test binaries one after another). A guard brings the service back up in its `Drop`, even
//! when the test fails.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use common::kafka::{KAFKA, Tansu, create_topic, finish_topics, kafka_relay, read_ids, topic_name};
use common::transport::{Sink, Transport};
use common::webhook::Reply;
use common::{
    AMQP_URL, Analysis, DurableQueue, Inserted, NewRow, PG_URL, Proxy, RABBIT_ADDR, RabbitFixture,
    RelayBuilder, RelayProcess, RowState, TempDir, TestTable, analyse, assert_none, drop_both,
    finish, free_port, hex8, http_get, insert_rows, listening_addrs, local, not_sent_once,
    pg_connect, scrape, sigkill_while_holding_rows, spawn_steady_writer, table_and_exchange,
    wait_for_count, wait_until,
};
use lapin::{Connection, ConnectionProperties};
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use tokio::sync::RwLock;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Read by every test, written by the tests that stop or restart a shared service.
static SERVICES: RwLock<()> = RwLock::const_new(());

const LONG: Duration = Duration::from_secs(180);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// `OUTBOX_SOAK=1` selects the long form.
fn soak() -> bool {
    std::env::var("OUTBOX_SOAK").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// `short` normally, `long` in the soak.
fn pick<T>(short: T, long: T) -> T {
    if soak() { long } else { short }
}

/// Prints the test's one summary line, then asserts nothing was lost, reordered or foreign (a
/// test that delivers nothing passes `Analysis::default()`).
fn summary(fault: &str, injected: usize, rows: usize, analysis: &Analysis, note: &str) {
    let (lost, reordered) = (analysis.lost.len(), analysis.reordered.len());
    let line = format!(
        "FAULT-SUMMARY fault={fault} injected={injected} rows={rows} lost={lost} \
         reordered={reordered} duplicates={} {note}",
        analysis.duplicates
    );
    println!("{}", line.trim_end());
    analysis.assert_complete(fault);
}

/// Waits until the consumer has every message the broker holds, then prints and asserts the
/// [`summary`] of the deliveries checked against every row of `table`; returns the rows.
async fn summarise_all(
    table: &TestTable,
    rabbit: &RabbitFixture,
    fault: &str,
    injected: usize,
    note: &str,
) -> Vec<RowState> {
    rabbit.barrier().await;
    let rows = table.rows().await;
    summary(fault, injected, rows.len(), &rabbit.analyse(&rows), note);
    rows
}

/// How many times each item occurs.
fn tally<T: Ord>(items: impl IntoIterator<Item = T>) -> BTreeMap<T, usize> {
    let mut counts = BTreeMap::new();
    for item in items {
        *counts.entry(item).or_insert(0) += 1;
    }
    counts
}

/// The SQL condition "`id` is one of `ids`".
fn id_in(ids: &[Uuid]) -> String {
    let list: Vec<String> = ids.iter().map(Uuid::to_string).collect();
    format!("id = ANY('{{{}}}'::uuid[])", list.join(","))
}

/// A row's (status, attempts).
fn status_attempts(row: &RowState) -> (&str, i32) {
    (row.status.as_str(), row.attempts)
}

/// Row counts by status ([`TestTable::status_counts`]).
type Counts = BTreeMap<String, i64>;

// ---------------------------------------------------------------------------------------------
// An audit of claims: a trigger records every transition into `processing`

/// Every claim of a row (`pending` → `processing`), with the claiming instance and the claiming
/// transaction, recorded by a trigger in the claim's own transaction — so a claim is in the audit
/// exactly when it happened, whatever the relay did afterwards.
struct ClaimAudit(String);

#[derive(Debug, Clone)]
struct Claim {
    id: Uuid,
    by: String,
    xid: i64,
}

impl ClaimAudit {
    async fn install(table: &TestTable) -> Self {
        let t = &table.name;
        let sql = format!(
            "CREATE TABLE {t}_claims (id uuid NOT NULL, locked_by text NOT NULL, \
               attempts int NOT NULL, xid bigint NOT NULL DEFAULT txid_current(), \
               at timestamptz NOT NULL DEFAULT clock_timestamp()); \
             CREATE FUNCTION {t}_audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
               INSERT INTO {t}_claims (id, locked_by, attempts) VALUES (NEW.id, NEW.locked_by, NEW.attempts); \
               RETURN NULL; END $$; \
             CREATE TRIGGER {t}_audit AFTER UPDATE ON {t} FOR EACH ROW \
               WHEN (NEW.status = 'processing' AND OLD.status IS DISTINCT FROM 'processing') \
               EXECUTE FUNCTION {t}_audit();"
        );
        let installed = table.db.batch_execute(&sql).await;
        installed.expect("install the claim audit");
        Self(format!("{t}_claims"))
    }

    /// Every claim so far, in the order they happened.
    async fn claims(&self, table: &TestTable) -> Vec<Claim> {
        let sql = format!("SELECT id, locked_by, xid FROM {} ORDER BY at", self.0);
        let query = table.db.query(&sql, &[]);
        let rows = query.await.expect("read the claim audit");
        rows.iter()
            .map(|r| Claim {
                id: r.get(0),
                by: r.get(1),
                xid: r.get(2),
            })
            .collect()
    }

    /// Drops the audit (its table, and its function with the trigger), then the outbox table and
    /// the exchange.
    async fn drop_all(self, table: TestTable, rabbit: RabbitFixture) {
        let (audit, t) = (self.0, &table.name);
        let sql = format!("DROP TABLE {audit}; DROP FUNCTION {t}_audit() CASCADE;");
        let dropped = table.db.batch_execute(&sql).await;
        dropped.expect("drop the claim audit");
        drop_both(table, rabbit).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Writers

/// A fault test's writers ([`spawn_steady_writer`], [`spawn_versioned_writers`]): their stop
/// token and the task that returns how many rows they inserted.
type Writer = (CancellationToken, JoinHandle<usize>);

/// Lets `writer` run one more second, stops it and waits until every row of `table` is sent;
/// returns how many rows the writer knows it inserted.
async fn stop_and_drain(table: &TestTable, (stop, writer): Writer) -> usize {
    tokio::time::sleep(secs(1)).await;
    stop.cancel();
    let written = writer.await.unwrap();
    table.wait_all_sent(LONG).await;
    written
}

// ---------------------------------------------------------------------------------------------
// 1. SIGKILL of replicas under load

/// Events every aggregate gets from the versioned writers at the least: the depth of ordering
/// the SIGKILL test proves.
const EVENTS_PER_AGGREGATE: usize = 30;

/// Starts `writers` connections that each insert one row per transaction, about one per
/// millisecond each: first a shuffled deck of [`EVENTS_PER_AGGREGATE`] events for each of
/// `aggregates` aggregates (`a1`, `a2`, …), then rows of random aggregates until the token is
/// cancelled (the deck is always written out). They serialise per aggregate on the row lock of
/// its version counter, as applications do, and the payload carries the aggregate's new
/// version: an aggregate's `seq` order is its version order. The task returns the rows
/// inserted.
async fn spawn_versioned_writers(table: &TestTable, aggregates: usize, writers: usize) -> Writer {
    let versions = format!("{}_versions", table.name);
    let create = format!(
        "CREATE TABLE {versions} (id text PRIMARY KEY, version int NOT NULL); \
         INSERT INTO {versions} SELECT 'a' || i, 0 FROM generate_series(1, {aggregates}) i;"
    );
    table.db.batch_execute(&create).await.unwrap();
    let bump =
        format!("UPDATE {versions} SET version = version + 1 WHERE id = $1 RETURNING version");
    let stop = CancellationToken::new();
    let mut deck: Vec<usize> = (1..=aggregates)
        .flat_map(|a| std::iter::repeat_n(a, EVENTS_PER_AGGREGATE))
        .collect();
    deck.shuffle(&mut rand::rng());
    let deck = Arc::new(Mutex::new(deck));
    let mut tasks = JoinSet::new();
    for _ in 0..writers {
        let (outbox, bump, stop) = (table.name.clone(), bump.clone(), stop.clone());
        let deck = Arc::clone(&deck);
        tasks.spawn(async move {
            let mut db = pg_connect().await;
            let mut inserted = 0;
            loop {
                let dealt = deck.lock().unwrap().pop();
                if dealt.is_none() && stop.is_cancelled() {
                    break;
                }
                let aggregate = dealt.unwrap_or_else(|| rand::random_range(1..=aggregates));
                let id = format!("a{aggregate}");
                let tx = db.transaction().await.unwrap();
                let version: i32 = tx.query_one(&bump, &[&id]).await.unwrap().get(0);
                let payload = json!({ "version": version });
                let row = NewRow::new("account", Some(&id), "changed", payload);
                insert_rows(&tx, &outbox, &[row]).await;
                tx.commit().await.unwrap();
                inserted += 1;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            inserted
        });
    }
    let total = async move { tasks.join_all().await.into_iter().sum() };
    (stop, tokio::spawn(total))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkilled_replicas_under_load_lose_nothing_and_keep_aggregate_order() {
    // Alone: its writers and three relays load the machine, and the other tests keep time.
    let _exclusive = SERVICES.write().await;
    let kills = pick(5, 25);
    let (table, rabbit) = table_and_exchange("f_sigkill").await;
    let audit = ClaimAudit::install(&table).await;
    let spawn = |instance: &str| {
        RelayBuilder::for_test(&table, &rabbit, instance)
            .ordered()
            .set("relay.lease_timeout", "3s")
            // Each kill spends an attempt of every row the victim held; dead letters are not
            // what this test is about (lost rows are).
            .set("retry.max_attempts", "100")
            .spawn()
    };
    // Three replicas. Incarnations have their own instance ids, so `locked_by` names exactly
    // one process.
    let mut slots = ["k0a", "k0b", "k0c"].map(spawn);

    let writer = spawn_versioned_writers(&table, 300, 4).await;
    let mut killed: Vec<String> = Vec::new();
    let mut held_at_death = Vec::new();
    for k in 0..kills {
        let slot = k % 3;
        let label = slots[slot].label.clone();
        let count_where = async |condition: &str| table.count_where(condition).await;
        let held =
            sigkill_while_holding_rows(&mut slots[slot], secs(60), count_where, || rabbit.count());
        held_at_death.push(held.await);
        killed.push(label);
        slots[slot] = spawn(&format!("k{}{}", k + 1, ["a", "b", "c"][slot]));
    }
    let written = stop_and_drain(&table, writer).await;
    rabbit.barrier().await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), written, "the writers' rows are in the table");
    let analysis = rabbit.analyse(&rows);

    // Duplicates, honestly: every delivery is a publish, and a relay publishes a row only after
    // claiming it, once per claim. The audit trigger records every claim in the claiming
    // transaction, so it cannot miss one. A survivor claims a row once and settles it; a second
    // claim happens only after a lease expired, i.e. after the holder was killed (or, if the
    // relay were broken, while it still ran). So an id delivered n times must have at least
    // n − 1 claims by killed incarnations — the copies that went out before a crash — and a
    // duplicate that a live relay caused fails here.
    let claims = audit.claims(&table).await;
    let claims_of = tally(claims.iter().map(|c| c.id));
    let by_killed_relays = claims.iter().filter(|c| killed.contains(&c.by));
    let killed_claims_of = tally(by_killed_relays.map(|c| c.id));
    let by_killed = |id: &Uuid| killed_claims_of.get(id).copied().unwrap_or(0);
    let unexplained: Vec<(Uuid, usize, usize)> = analysis
        .counts
        .iter()
        .filter(|(id, n)| by_killed(id) < **n - 1)
        .map(|(id, n)| (*id, *n, by_killed(id)))
        .collect();
    let why = "ids delivered more often than claims by killed relays explain (id, deliveries, \
               claims by killed)";
    assert_none(why, &unexplained);
    // The audit agrees with the table: attempts count claims (no hand-backs in this test).
    let claimed = |id: &Uuid| claims_of.get(id).copied().unwrap_or(0);
    let disagree: Vec<(Uuid, i32, usize)> = rows
        .iter()
        .filter(|r| usize::try_from(r.attempts) != Ok(claimed(&r.id)))
        .map(|r| (r.id, r.attempts, claimed(&r.id)))
        .collect();
    let why = "attempts ≠ audited claims (id, attempts, claims)";
    assert_none(why, &disagree);
    let not_sent = table.count_where("status <> 'sent'").await;
    assert_eq!(not_sent, 0, "rows not sent");
    // The kills hit work in flight (rows the victim held when it died), not only idle relays.
    let why = format!("no kill caught a relay holding rows: {held_at_death:?}");
    assert!(held_at_death.iter().sum::<i64>() > 0, "{why}");
    let note = format!(
        "duplicated_ids={} (all claimed by a killed relay) rows_held_at_each_kill={held_at_death:?}",
        analysis.duplicated_ids().len()
    );
    // Nothing lost or reordered (the summary asserts it) before the versions below say how.
    summary("sigkill-replicas", kills, rows.len(), &analysis, &note);
    // seq order is the writers' version order: per aggregate, the first arrivals carry versions
    // 1, 2, 3, … up to the aggregate's last version.
    let mut versions = HashMap::<String, Vec<i64>>::new();
    let mut seen = HashSet::new();
    for d in rabbit.deliveries() {
        if seen.insert(d.message_id.clone()) {
            let body: Value = serde_json::from_slice(&d.body).unwrap();
            let subject = versions.entry(d.headers()["cloudEvents:subject"].clone());
            subject.or_default().push(body["version"].as_i64().unwrap());
        }
    }
    let versions_sql = format!("SELECT id, version::int8 FROM {}_versions", table.name);
    for row in table.db.query(&versions_sql, &[]).await.unwrap() {
        let aggregate: String = row.get(0);
        let arrived = versions.remove(&aggregate).unwrap_or_default();
        let expected: Vec<i64> = (1..=row.get(1)).collect();
        let why = format!("aggregate {aggregate}: versions in arrival order");
        assert_eq!(arrived, expected, "{why}");
    }
    let strays: Vec<&String> = versions.keys().collect();
    assert_none("subjects of no aggregate", &strays);

    for relay in slots {
        relay.stop().await;
    }
    let drop_versions = format!("DROP TABLE {}_versions", table.name);
    table.db.batch_execute(&drop_versions).await.unwrap();
    audit.drop_all(table, rabbit).await;
}

/// The window of [`kills_republish_at_most_the_window`]: `relay.max_in_flight`.
const KILL_WINDOW: usize = 200;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_republish_at_most_the_window_over_http() {
    kills_republish_at_most_the_window(Transport::Http).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_republish_at_most_the_window_on_rabbitmq() {
    kills_republish_at_most_the_window(Transport::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_republish_at_most_the_window_on_kafka() {
    kills_republish_at_most_the_window(Transport::Kafka).await;
}

/// A relay draining a backlog (10,000 rows of 500 aggregates, `batch_size = 100`,
/// `max_in_flight = 200`) killed (SIGKILL) and restarted at once, a few times: every row arrives,
/// first arrivals in `seq` order per aggregate, and what a crash sends twice stays within the
/// window. At each kill the rows still `processing` in the victim's name (claimed, not yet
/// settled) number at most `max_in_flight`, whatever the moment of the kill; those of them the
/// sink had received are what the next relay publishes again, and every duplicate is one of
/// them. Over HTTP one request in a hundred is answered late, so most of a batch is answered
/// long before the batch can be settled (what let the relay claim beyond its window when a
/// chain's share came back at its last answer).
async fn kills_republish_at_most_the_window(transport: Transport) {
    let _shared = SERVICES.read().await;
    let kills = pick(3, 10);
    let test = format!("f_window_{transport:?}").to_lowercase();
    let table = TestTable::new(&test).await;
    let sink = Sink::new(transport, &test, "#", &["account"]).await;
    let rows: Vec<NewRow> = (0..10_000)
        .map(|n| {
            let aggregate = format!("a{}", n % 500);
            NewRow::new("account", Some(&aggregate), "changed", json!({ "n": n }))
        })
        .collect();
    if let Sink::Http(endpoint) = &sink {
        // One request in a hundred is answered late: the rest of its batch is answered long
        // before the batch can be settled.
        endpoint.script(|r| {
            let body: Value = serde_json::from_slice(&r.body).unwrap_or_default();
            let late = body["n"].as_u64().is_some_and(|n| n % 100 == 1);
            let reply = Reply::status(204);
            if late {
                reply.after(Duration::from_millis(500))
            } else {
                reply
            }
        });
    }
    table.insert(&rows).await;
    let spawn = |instance: &str| {
        sink.relay(&table, instance)
            .ordered()
            .set("relay.batch_size", "100")
            .set("relay.max_in_flight", KILL_WINDOW.to_string())
            .set("relay.lease_timeout", "2s")
            // Each kill spends an attempt of every row the victim held.
            .set("retry.max_attempts", "100")
            .spawn()
    };
    let mut relay = spawn("w0");
    let mut unsettled_at_kill = Vec::new();
    for k in 0..kills {
        let label = relay.label.clone();
        let held_now = format!("status = 'processing' AND locked_by = '{label}'");
        let since = table.count_where("status = 'sent'").await;
        // Strike while the victim holds rows and drains the backlog at full speed.
        let what = format!("{label} holds rows and sends 500 more");
        wait_until(LONG, &what, async || {
            let held = table.count_where(&held_now).await;
            let sent = table.count_where("status = 'sent'").await - since;
            if held > 0 && sent >= 500 {
                Ok(())
            } else {
                Err(format!("{held} held by {label}, {sent} sent since"))
            }
        })
        .await;
        relay.sigkill();
        let status = relay.wait_exit(secs(10)).await;
        assert_eq!(status.signal(), Some(9), "{label} should die by SIGKILL");
        sink.wait_received(LONG).await;
        // Published (the sink has it) and not settled (still `processing` in the victim's
        // name): the next relay publishes these again.
        let held: HashSet<String> = table
            .rows()
            .await
            .into_iter()
            .filter(|r| r.status == "processing" && r.locked_by.as_deref() == Some(&label))
            .map(|r| r.id.to_string())
            .collect();
        let received: HashSet<String> = sink.received_ids().into_iter().collect();
        unsettled_at_kill.push((held.len(), held.intersection(&received).count()));
        relay = spawn(&format!("w{}", k + 1));
    }
    table.wait_all_sent(LONG).await;
    sink.wait_received(LONG).await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), 10_000);
    let analysis = sink.analyse(&rows);
    let note = format!("held_and_published_unsettled_at_each_kill={unsettled_at_kill:?}");
    summary(
        &format!("{test}-sigkill"),
        kills,
        rows.len(),
        &analysis,
        &note,
    );
    let beyond: Vec<&(usize, usize)> = unsettled_at_kill
        .iter()
        .filter(|(held, _)| *held > KILL_WINDOW)
        .collect();
    let why = format!(
        "kills that left more than max_in_flight {KILL_WINDOW} rows claimed and not settled \
         (held, of which published)"
    );
    assert_none(&why, &beyond);
    let explained: usize = unsettled_at_kill
        .iter()
        .map(|(_, published)| published)
        .sum();
    assert!(
        analysis.duplicates <= explained,
        "{} duplicate deliveries, but only {explained} rows were published and unsettled at the kills",
        analysis.duplicates
    );
    sink.finish(relay, table).await;
}

// ---------------------------------------------------------------------------------------------
// 2. Broker and database outages

/// Rows dead-lettered or left with a spent attempt (`pending` with attempts > 0).
const SPENT: &str = "status = 'failed' OR (status = 'pending' AND attempts > 0)";

/// The lines the relay logs on losing its broker and on having it back; the same for its database.
const BROKER_LOGS: (&str, &str) = ("broker unavailable", "connected to the broker");
const DATABASE_LOGS: (&str, &str) = ("database unavailable", "database connection restored");

/// A service outage as the relay logs it: the line it logs on losing the service (`down`) and
/// the one on having it back (`up`), each with its count before the fault.
struct Outage<'a> {
    relay: &'a RelayProcess,
    down: (&'static str, usize),
    up: (&'static str, usize),
}

impl<'a> Outage<'a> {
    /// Counts the relay's `(down, up)` lines in its log so far: call before the fault.
    fn before(relay: &'a RelayProcess, (down, up): (&'static str, &'static str)) -> Self {
        let (down, up) = ((down, relay.log_count(down)), (up, relay.log_count(up)));
        Self { relay, down, up }
    }

    /// The fault is in: the relay logs `down` once more within `notice`, then (asserted every
    /// 100 ms for `outage`) leaves no row of `table` [`SPENT`].
    async fn ride_out(&self, table: &TestTable, notice: Duration, outage: Duration) {
        let (down, before) = self.down;
        self.relay.wait_for_log(down, before + 1, notice).await;
        let start = Instant::now();
        while start.elapsed() < outage {
            let spent = table.count_where(SPENT).await;
            let logs = || self.relay.stderr();
            assert_eq!(spent, 0, "the outage spent attempts:\n{}", logs());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The fault is healed: the relay logs `up` once more.
    async fn back(&self) {
        let (up, before) = self.up;
        self.relay.wait_for_log(up, before + 1, LONG).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_connection_cut_spends_no_attempt_and_loses_nothing() {
    connection_cut(Service::RabbitMq, "aggregate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_connection_cut_with_ordering_none_spends_no_attempt_and_loses_nothing() {
    connection_cut(Service::RabbitMq, "none").await;
}

/// A broker that drops the connection on what the relay sends, every time (the proxy cuts each
/// connection once the relay sends more than its set-up): the relay pauses longer and longer
/// between reconnects instead of looping as fast as the broker accepts them, and once the
/// connection holds, the row goes out without having spent an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_dropped_on_every_publish_is_reopened_with_backoff() {
    let _shared = SERVICES.read().await;
    let test = "f_flap";
    let (table, rabbit) = table_and_exchange(test).await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let relay = RelayBuilder::for_test(&table, &rabbit, test)
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .spawn();
    relay
        .wait_for_log("connected to the broker", 1, secs(30))
        .await;
    // Idle and connected: what it has sent is its set-up; anything more is cut.
    tokio::time::sleep(secs(1)).await;
    let setup = proxy.upstream_bytes_of_last_connection();
    assert!(setup > 0, "the relay's connection sent nothing");
    proxy.cut_connections_sending_more_than(setup);
    let sessions_before = proxy.accepted();
    let row = NewRow::new("flap", Some("a"), "e", json!({}));
    let id = table.insert_one(row).await;
    let watched = secs(6);
    tokio::time::sleep(watched).await;
    let sessions = proxy.accepted() - sessions_before;
    assert!(
        sessions >= 2,
        "the publish was not cut and retried ({sessions} sessions)"
    );
    // Pauses of 100 ms doubling: about 6 sessions in 6 s; without them, hundreds. (A loaded
    // machine only makes fewer.)
    let why = format!("{sessions} sessions in {watched:?}: reconnects without a pause");
    assert!(sessions <= 15, "{why}\n{}", relay.stderr());
    proxy.heal();
    rabbit.wait_for_ids(&[id], secs(60)).await;
    let sent = format!("status = 'sent' AND id = '{id}'");
    table.wait_count(&sent, 1, secs(10)).await;
    let row = table.row(id).await;
    assert_eq!(
        status_attempts(&row),
        ("sent", 1),
        "no attempt spent by the cuts"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connection_cut_spends_no_attempt_and_loses_nothing() {
    connection_cut(Service::Postgres, "aggregate").await;
}

/// The service whose connections [`connection_cut`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Service {
    RabbitMq,
    Postgres,
}

/// The relay's RabbitMQ or PostgreSQL connections cut by a proxy, rows inserted before, during
/// and after: nothing dead-lettered or charged an attempt during the outage, nothing confirmed
/// through the cut proxy, the relay back through the proxy afterwards, every row sent once with
/// one attempt and delivered (in order per aggregate with `ordering = "aggregate"`). RabbitMQ's
/// connection is cut with publishes in flight, which must be handed back; with PostgreSQL cut
/// the relay marks nothing sent meanwhile.
async fn connection_cut(service: Service, ordering: &str) {
    let _shared = SERVICES.read().await;
    let outage = pick(secs(3), secs(30));
    let rabbitmq = service == Service::RabbitMq;
    let name = if rabbitmq { "rabbitmq" } else { "postgres" };
    let test = format!("f_{name}_cut_{ordering}");
    let (table, rabbit) = table_and_exchange(&test).await;
    let audit = ClaimAudit::install(&table).await;
    // Every relay session to the service (for PostgreSQL the pool and LISTEN) goes through the
    // proxy; the test's own do not.
    let (proxy, url_key, url, logs) = if rabbitmq {
        let proxy = Proxy::start(RABBIT_ADDR).await;
        let url = proxy.amqp_url();
        (proxy, "publisher.rabbitmq.url", url, BROKER_LOGS)
    } else {
        let proxy = Proxy::start("127.0.0.1:5432").await;
        let url = format!("postgres://postgres@{}/test", proxy.addr());
        (proxy, "database.url", url, DATABASE_LOGS)
    };
    // A lease far longer than the test, so only the outage can touch attempts.
    let lease = if rabbitmq { "120s" } else { "60s" };
    let relay = RelayBuilder::for_test(&table, &rabbit, &test)
        .ordered()
        .set("relay.ordering", ordering)
        .set(url_key, url)
        .set("relay.lease_timeout", lease)
        .set("retry.base_delay", "100ms")
        .spawn();
    let writer = spawn_steady_writer(&table.name, "cut", 13, 20);
    wait_for_count(LONG, "300 messages before the cut", 300, || rabbit.count()).await;
    let outage_log = Outage::before(&relay, logs);
    let mut in_flight = 0;
    if rabbitmq {
        // Cut with publishes in flight: hold the broker's answers back for a moment so that
        // some rows are claimed and unconfirmed when the connection drops.
        proxy.stall();
        // Rows claimed a while ago and still not settled: their confirms are held by the stall
        // (a row merely claimed, or confirmed and awaiting its settle UPDATE, would not prove
        // it).
        let unsettled =
            "status = 'processing' AND locked_at < clock_timestamp() - interval '300 milliseconds'";
        let what = "rows are in flight when the connection is cut";
        in_flight = wait_until(secs(10), what, async || {
            match table.count_where(unsettled).await {
                0 => Err("none processing".to_owned()),
                n => Ok(n),
            }
        })
        .await;
    }
    let sessions_before_cut = proxy.accepted();
    proxy.cut();
    let cut_at = table.db_now().await;
    let notice = secs(if rabbitmq { 10 } else { 15 });
    outage_log.ride_out(&table, notice, outage).await;
    // The outage was real: nothing inserted after the cut (plus slack for statements in
    // flight) was confirmed through the cut proxy.
    let after = |slack: i64| (cut_at + chrono::Duration::milliseconds(slack)).to_rfc3339();
    let after_cut = format!("created_at > '{}'::timestamptz", after(300));
    let inserted = table.count_where(&after_cut).await;
    assert!(inserted > 0, "writer is inserting");
    let sent_after_cut = format!("{after_cut} AND status = 'sent'");
    let confirmed = table.count_where(&sent_after_cut).await;
    assert_eq!(confirmed, 0, "rows were confirmed through a cut proxy");
    if !rabbitmq {
        // Nor did the relay write to its database meanwhile (1 s of slack for statements in
        // flight at the cut).
        let sent_meanwhile = format!("sent_at > '{}'::timestamptz", after(1000));
        let marked = table.count_where(&sent_meanwhile).await;
        assert_eq!(marked, 0, "rows marked sent through a cut proxy");
    }
    let pending_at_heal = table.count_where("status <> 'sent'").await;
    let why = "rows should have piled up during the outage";
    assert!(pending_at_heal > 0, "{why}");
    proxy.heal();
    outage_log.back().await;
    let written = stop_and_drain(&table, writer).await;
    assert!(written > 0, "the writer inserted nothing");
    rabbit.barrier().await;

    let rows = table.rows().await;
    let wrong: Vec<&RowState> = rows
        .iter()
        .filter(|r| r.not_sent_once().is_some())
        .collect();
    let ids: HashSet<Uuid> = wrong.iter().map(|r| r.id).collect();
    let claims = audit.claims(&table).await;
    let of_wrong_rows = claims.iter().filter(|c| ids.contains(&c.id));
    let theirs: Vec<&Claim> = of_wrong_rows.take(20).collect();
    let why = format!("rows not sent with attempts = 1 (claims of those rows: {theirs:?})");
    assert_none(&why, &wrong);
    // The relay came back through the proxy.
    let sessions = proxy.accepted();
    let why = format!("no new session through the proxy after the cut ({sessions_before_cut})");
    assert!(sessions > sessions_before_cut, "{why}");
    if rabbitmq {
        // The rows in flight at the cut were handed back (no attempt spent: see above).
        let why = "rows were in flight at the cut but none was handed back";
        let handed_back = relay.log_count("handing the row back");
        assert!(handed_back >= 1, "{in_flight} {why}\n{}", relay.stderr());
    }
    let mut analysis = rabbit.analyse(&rows);
    if ordering == "none" {
        analysis = analysis.ignoring_order(); // `ordering = "none"` promises no order
    }
    let note = format!("outage={outage:?} attempts_spent=0 unsent_at_heal={pending_at_heal}");
    let fault = format!("{name}-proxy-cut-{ordering}");
    summary(&fault, 1, rows.len(), &analysis, &note);
    relay.stop().await;
    audit.drop_all(table, rabbit).await;
}

/// `/readyz`'s status on `port` (an error text when it does not answer).
async fn readyz(port: u16) -> Result<u16, String> {
    http_get(local(port), "/readyz")
        .await
        .map(|(status, _)| status)
}

/// PostgreSQL black-holed mid-drain: a proxy keeps every connection of the relay open (its
/// pool, its LISTEN session, its background tasks: all go through it) and forwards nothing
/// either way, as a hung server or a dead path behind a live load balancer would. Within
/// `database.query_timeout` (2 s here) that is an outage, not a hang: the claim loop logs it,
/// `/readyz` fails, the LISTEN session gives up its connection, and no attempt is spent while
/// it lasts. Un-black-holed, the relay comes back by itself and every row is sent with one
/// attempt, delivered in order per aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_black_holed_is_an_outage_and_spends_no_attempt() {
    let _shared = SERVICES.read().await;
    let outage = pick(secs(6), secs(30));
    let test = "f_pg_black_hole";
    let (table, rabbit) = table_and_exchange(test).await;
    let proxy = Proxy::start("127.0.0.1:5432").await;
    let port = free_port();
    let relay = RelayBuilder::for_test(&table, &rabbit, test)
        .ordered()
        .set(
            "database.url",
            format!("postgres://postgres@{}/test", proxy.addr()),
        )
        .set("database.query_timeout", "2s")
        // Far longer than the outage: only the outage could touch attempts.
        .set("relay.lease_timeout", "120s")
        .set("metrics.listen", local(port).to_string())
        .spawn();
    let writer = spawn_steady_writer(&table.name, "bh", 13, 20);
    wait_for_count(LONG, "300 messages before the black hole", 300, || {
        rabbit.count()
    })
    .await;
    let ready = readyz(port).await;
    assert_eq!(ready, Ok(200), "/readyz before the black hole");
    let listen_lost = "LISTEN connection lost";
    let listen_before = relay.log_count(listen_lost);
    let outage_log = Outage::before(&relay, DATABASE_LOGS);

    proxy.stall();
    outage_log.ride_out(&table, secs(30), outage).await;
    let what = "/readyz fails while the database does not answer";
    let not_ready = wait_until(secs(30), what, async || match readyz(port).await {
        Ok(200) => Err("200".to_owned()),
        other => Ok(other),
    })
    .await;
    relay
        .wait_for_log(listen_lost, listen_before + 1, secs(30))
        .await;
    let pending_at_heal = table.count_where("status <> 'sent'").await;
    assert!(
        pending_at_heal > 0,
        "rows should have piled up during the outage"
    );

    proxy.heal();
    outage_log.back().await;
    let written = stop_and_drain(&table, writer).await;
    assert!(written > 0, "the writer inserted nothing");
    wait_until(
        secs(30),
        "/readyz answers 200 again",
        async || match readyz(port).await {
            Ok(200) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    rabbit.barrier().await;
    let rows = table.rows().await;
    assert_none("rows not sent with attempts = 1", &not_sent_once(&rows));
    let note = format!(
        "outage={outage:?} attempts_spent=0 unsent_at_heal={pending_at_heal} readyz_during={not_ready:?}"
    );
    summary(
        "postgres-black-hole",
        1,
        rows.len(),
        &rabbit.analyse(&rows),
        &note,
    );
    finish(relay, table, rabbit).await;
}

/// Runs a service-control command to completion; panics with its output when it fails, and
/// logs and returns how long it took.
async fn control(program: &str, args: &[&str]) -> Duration {
    let started = Instant::now();
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let why = format!("{program} {args:?}: {}\n{stdout}{stderr}", out.status);
    assert!(out.status.success(), "{why}");
    let took = started.elapsed();
    eprintln!("{program} {args:?} took {took:?}");
    took
}

/// RabbitMQ's application stopped (`rabbitmqctl stop_app`) until [`RabbitDown::start`], or
/// until dropped: `Drop` starts it again synchronously, so a failing test leaves it running.
struct RabbitDown {
    up: bool,
}

impl RabbitDown {
    async fn stop() -> Self {
        control("rabbitmqctl", &["stop_app"]).await;
        Self { up: false }
    }

    async fn start(mut self) {
        control("rabbitmqctl", &["start_app"]).await;
        self.up = true;
        wait_until(secs(60), "RabbitMQ accepts AMQP again", async || {
            let connect = Connection::connect(AMQP_URL, ConnectionProperties::default());
            connect.await.map(drop).map_err(|e| e.to_string())
        })
        .await;
    }
}

impl Drop for RabbitDown {
    fn drop(&mut self) {
        if !self.up {
            eprintln!("bringing RabbitMQ back up after a failure");
            let _ = std::process::Command::new("rabbitmqctl")
                .arg("start_app")
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restarted_for_real_spends_no_attempt_and_loses_nothing() {
    let _exclusive = SERVICES.write().await;
    let restarts = pick(1, 3);
    let down_for = secs(4);
    let table = TestTable::new("f_rmq_restart").await;
    let queue = DurableQueue::new("f_rmq_restart").await;
    let relay = RelayBuilder::to_exchange(&table, &queue.exchange, "rmq-restart")
        .ordered()
        .set("relay.lease_timeout", "120s")
        .set("retry.base_delay", "100ms")
        .spawn();
    let writer = spawn_steady_writer(&table.name, "rr", 13, 20);
    let consumer_connects = || queue.connects.load(std::sync::atomic::Ordering::SeqCst);
    for r in 0..restarts {
        let since = queue.ids().len();
        let what = "300 more messages before the restart";
        wait_for_count(LONG, what, since + 300, || queue.ids().len()).await;
        let outage_log = Outage::before(&relay, BROKER_LOGS);
        let connected = consumer_connects();
        let down = RabbitDown::stop().await;
        outage_log.ride_out(&table, secs(10), down_for).await;
        down.start().await;
        outage_log.back().await;
        let what = "the test consumer reconnects";
        wait_for_count(secs(60), what, connected + 1, consumer_connects).await;
        eprintln!("restart {} of {restarts} done", r + 1);
    }
    stop_and_drain(&table, writer).await;
    let rows = table.rows().await;
    let ids: Vec<Uuid> = rows.iter().map(|f| f.id).collect();
    queue.wait_for(&ids, LONG).await;
    queue.barrier().await;

    assert_none("rows not sent once", &not_sent_once(&rows));
    let arrivals = queue.ids();
    let analysis = analyse(&rows, arrivals.iter().map(String::as_str));
    let (redelivered, republished) = queue.duplicate_causes();
    let note = format!(
        "(broker_redeliveries={redelivered} republished_by_relay={republished}) \
         down_for={down_for:?} attempts_spent=0"
    );
    summary("rabbitmq-restart", restarts, rows.len(), &analysis, &note);
    relay.stop().await;
    queue.teardown().await;
    table.drop_table().await;
}

/// A database outage longer than `relay.lease_timeout` while a batch waits for its confirms: the
/// relay gives up recording the outcomes ("those rows stay processing and are published again
/// after lease_timeout"). They must come back — nothing may stay `processing` for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_longer_than_the_lease_leaves_no_row_stuck() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_pg_lease").await;
    let broker = Proxy::start(RABBIT_ADDR).await;
    let database = Proxy::start("127.0.0.1:5432").await;
    let database_url = format!("postgres://postgres@{}/test", database.addr());
    let relay = RelayBuilder::for_test(&table, &rabbit, "pg-lease")
        .ordered()
        .set("database.url", database_url)
        .set("publisher.rabbitmq.url", broker.amqp_url())
        .set("relay.lease_timeout", "2s")
        .spawn();
    let warm = NewRow::new("lease", None, "warm", json!({}));
    let warm = table.insert_one(warm).await;
    rabbit.wait_for_ids(&[warm], secs(30)).await;

    // A batch in flight: the broker answers nothing until healed.
    broker.stall();
    let rows = NewRow::numbered(50, "lease", Some(("l-", 10)), "e");
    table.insert(&rows).await;
    let what = "the relay holds the rows";
    let held = |c: &Counts| c["processing"] >= 10;
    table.wait_for_counts(secs(30), what, held).await;
    // The database goes away, then the confirms arrive: the outcomes cannot be recorded.
    database.cut();
    broker.heal();
    let gave_up = "gave up recording publish outcomes";
    relay.wait_for_log(gave_up, 1, secs(30)).await;
    let stuck_at_heal = table.count_where("status = 'processing'").await;
    database.heal();
    let what = "every row is sent after the database came back";
    let all_sent = |c: &Counts| c["sent"] == 51;
    table.wait_for_counts(secs(60), what, all_sent).await;
    let note = format!("processing_when_healed={stuck_at_heal}");
    summarise_all(&table, &rabbit, "postgres-outage-beyond-lease", 1, &note).await;
    finish(relay, table, rabbit).await;
}

/// The database connection dies after the server committed a claim but before the relay read
/// the claimed rows: the rows are `processing` under this relay's own name, and the relay does
/// not know it holds them. Which statement a cut connection loses is a matter of timing, so the
/// test makes that state directly, in one transaction with the inserts: the relay must not
/// renew a lease it does not know it holds, and the rows come back once the lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_claimed_in_our_name_whose_answer_was_lost_come_back_after_the_lease() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_pg_orphan").await;
    let lease = secs(2);
    // RabbitMQ behind a proxy, so that a row can be kept in flight: the lease loop renews
    // only while the relay holds something, and the renewal must skip the orphans.
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "pg-orphan")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "20s")
        .set("relay.lease_timeout", "2s")
        .spawn();
    let warm = NewRow::new("orphan", Some("warm"), "warm", json!({}));
    let warm = table.insert_one(warm).await;
    rabbit.wait_for_ids(&[warm], secs(30)).await;
    proxy.stall();
    let busy = NewRow::new("busy", Some("busy"), "busy", json!({}));
    let busy = table.insert_one(busy).await;
    let busy_claimed_at = wait_until(secs(30), "the relay holds the busy row", async || {
        let at = table.row(busy).await.locked_at;
        at.ok_or_else(|| "not claimed yet".to_owned())
    })
    .await;

    let rows = NewRow::numbered(50, "orphan", Some(("o-", 10)), "e");
    let mut db = pg_connect().await;
    let tx = db.transaction().await.unwrap();
    let orphans = insert_rows(&tx, &table.name, &rows).await;
    let claim = format!(
        "UPDATE {} SET status = 'processing', locked_by = 'pg-orphan', \
         locked_at = now(), attempts = 1 \
         WHERE aggregate_type = 'orphan' AND aggregate_id <> 'warm'",
        table.name
    );
    assert_eq!(tx.execute(&claim, &[]).await.unwrap(), 50);
    let claimed_at: DateTime<Utc> = tx.query_one("SELECT now()", &[]).await.unwrap().get(0);
    tx.commit().await.unwrap();
    let committed = Instant::now();

    // The lease loop runs every lease/3: give it two rounds, then check it left them alone.
    tokio::time::sleep(lease * 3 / 4).await;
    let since = claimed_at.to_rfc3339();
    let renewed = format!("aggregate_type = 'orphan' AND locked_at > '{since}'::timestamptz");
    let renewed = table.count_where(&renewed).await;
    let processing = "aggregate_type = 'orphan' AND status = 'processing'";
    let processing = table.count_where(processing).await;
    let why = "the relay renewed (or took) rows it does not know it holds (renewed, processing)";
    assert_eq!((renewed, processing), (0, 50), "{why}");
    // The control: in the same time the lease loop did renew the row it holds.
    let busy_renewed_at = table.row(busy).await.locked_at;
    assert!(
        busy_renewed_at.is_some_and(|at| at > busy_claimed_at),
        "the lease loop did not renew the row in flight ({busy_claimed_at} -> \
         {busy_renewed_at:?}): the check above proves nothing"
    );
    proxy.heal();
    let what = "every orphaned row is sent after its lease expired";
    let all_sent = |c: &Counts| c["sent"] == 52;
    table.wait_for_counts(secs(60), what, all_sent).await;
    let took = committed.elapsed();
    let why =
        format!("orphaned rows came back after {took:?}, before their {lease:?} lease expired");
    assert!(took >= lease - Duration::from_millis(200), "{why}");
    let note = format!(
        "orphaned_claims={} back_after_ms={}",
        orphans.len(),
        took.as_millis()
    );
    summarise_all(&table, &rabbit, "postgres-lost-claim-answer", 1, &note).await;
    finish(relay, table, rabbit).await;
}

/// The same state made by a real claim: the proxy forwards the relay's claim to the server and
/// holds its answer back, then cuts the connection. The relay cannot know whether the claim
/// committed; once the database answers again it hands back every row in its name that no
/// batch holds (no attempt spent), so the rows go out on their first attempt long before their
/// 120 s lease would have let them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_was_lost_is_handed_back_when_the_database_answers_again() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_pg_lost_claim").await;
    let database = Proxy::start("127.0.0.1:5432").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "pg-lost-claim")
        .set(
            "database.url",
            format!("postgres://postgres@{}/test", database.addr()),
        )
        // The claim is the loop's one statement: ordering `none` reads no watermark before
        // it, and without NOTIFY no wake-up record is published around it. Few connections,
        // so that the claim is soon prepared on each (a claim whose prepare is held back
        // never runs).
        .set("relay.ordering", "none")
        .set("relay.notify", "false")
        .set("database.pool_size", "2")
        .set("relay.poll_interval", "200ms")
        .set("relay.lease_timeout", "120s")
        .spawn();
    let warm = NewRow::new("lost", None, "warm", json!({}));
    let warm = table.insert_one(warm).await;
    rabbit.wait_for_ids(&[warm], secs(30)).await;

    // The statement held back may be the claim's prepare on a connection new to it, or a
    // background task's (the backlog gauges, the vacuum check: every 5 s) keeping the
    // connections from the claim: then heal and try again.
    let rows = NewRow::numbered(20, "lost", Some(("l-", 5)), "e");
    for round in 1.. {
        database.hold_answers();
        table.insert(&rows).await;
        let deadline = Instant::now() + secs(5);
        let mut claimed = 0;
        while claimed < 20 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            claimed = table.count_where("status = 'processing'").await;
        }
        if claimed == 20 {
            break;
        }
        assert!(
            round < 8,
            "the relay's claim never reached the server in {round} tries"
        );
        database.heal();
        table.wait_all_sent(secs(60)).await;
    }
    let down = relay.log_count(DATABASE_LOGS.0);
    database.cut();
    relay
        .wait_for_log(DATABASE_LOGS.0, down + 1, secs(30))
        .await;
    let what = "the claimed rows are still processing while the database is away";
    assert_eq!(
        table.count_where("status = 'processing'").await,
        20,
        "{what}"
    );
    database.heal();
    // Well within the 120 s lease.
    table.wait_all_sent(secs(60)).await;
    let handed_back = "handed back rows of a claim whose answer the database connection lost";
    assert_eq!(relay.log_count(handed_back), 1, "{}", relay.stderr());
    rabbit.barrier().await;
    let rows = table.rows().await;
    assert_none(
        "rows not sent on their first attempt",
        &not_sent_once(&rows),
    );
    // Ordering `none` promises no order.
    let analysis = rabbit.analyse(&rows).ignoring_order();
    let fault = "postgres-lost-claim-answer-released";
    summary(fault, 1, rows.len(), &analysis, "");
    finish(relay, table, rabbit).await;
}

/// The PostgreSQL cluster's major version (`ls /etc/postgresql`).
fn pg_version() -> String {
    std::fs::read_dir("/etc/postgresql")
        .expect("/etc/postgresql")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .min()
        .expect("a PostgreSQL cluster")
}

/// Restarts PostgreSQL for real; `Drop` starts it if the restart left it down.
struct PgRestart;

impl PgRestart {
    async fn restart(&self) -> Duration {
        let version = pg_version();
        let args = ["--skip-systemctl-redirect", &version, "main", "restart"];
        control("pg_ctlcluster", &args).await
    }
}

impl Drop for PgRestart {
    fn drop(&mut self) {
        if std::net::TcpStream::connect_timeout(&local(5432), Duration::from_millis(500)).is_err() {
            eprintln!("bringing PostgreSQL back up after a failure");
            let _ = std::process::Command::new("pg_ctlcluster")
                .args(["--skip-systemctl-redirect", &pg_version(), "main", "start"])
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_for_real_spends_no_attempt_and_loses_nothing() {
    let _exclusive = SERVICES.write().await;
    let restarts = pick(1, 3);
    let (mut table, rabbit) = table_and_exchange("f_pg_restart").await;
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "pg-restart")
        .ordered()
        .set("relay.lease_timeout", "60s")
        .spawn();
    let writer = spawn_steady_writer(&table.name, "pr", 13, 20);
    let pg = PgRestart;
    let mut took = Vec::new();
    for _ in 0..restarts {
        let since = rabbit.count();
        let what = "300 more messages before the restart";
        wait_for_count(LONG, what, since + 300, || rabbit.count()).await;
        let listen_lost = relay.log_count("LISTEN connection lost");
        took.push(pg.restart().await);
        // The test's own connection died with the server.
        table.db = wait_until(LONG, "PostgreSQL accepts connections", async || {
            let db = common::try_pg_connect(PG_URL, "faults").await;
            db.map_err(|e| e.to_string())
        })
        .await;
        // The relay saw the restart (its LISTEN session is always among the dead; which other
        // statement fails first depends on what it was doing) and recovers by itself: a row
        // inserted after the restart goes out.
        let lost = "LISTEN connection lost";
        relay.wait_for_log(lost, listen_lost + 1, LONG).await;
        let marker = NewRow::new("pr", None, "after-restart", json!({}));
        let marker = table.insert_one(marker).await;
        rabbit.wait_for_ids(&[marker], LONG).await;
        let spent = table.count_where(SPENT).await;
        assert_eq!(spent, 0, "the restart spent attempts");
    }
    stop_and_drain(&table, writer).await;
    assert!(relay.is_running(), "the relay process died");
    let note = format!("restart_took={took:?} attempts_spent=0");
    let rows = summarise_all(&table, &rabbit, "postgres-restart", restarts, &note).await;
    assert_none("rows not sent once", &not_sent_once(&rows));
    finish(relay, table, rabbit).await;
}

// ---------------------------------------------------------------------------------------------
// 4. Poison rows

/// A poison row, the follower behind it in its aggregate, and how the poison row must end: sent
/// on its first attempt (`error` `None`), or dead-lettered after 3 attempts with `error` in its
/// `last_error`.
struct Poison {
    case: String,
    id: Uuid,
    follower: Uuid,
    error: Option<&'static str>,
}

/// Inserts each of `cases` (a row, named after its aggregate id, and its expected error)
/// followed by a follower row in its aggregate, then `others`, in one statement.
async fn insert_poisons(
    table: &TestTable,
    cases: Vec<(NewRow, Option<&'static str>)>,
    others: Vec<NewRow>,
) -> Vec<Poison> {
    let follower = |row: &NewRow| {
        let aggregate = row.aggregate_id.as_deref();
        let payload = json!({ "after": aggregate });
        NewRow::new(&row.aggregate_type, aggregate, "follower", payload)
    };
    let mut rows: Vec<NewRow> = cases
        .iter()
        .flat_map(|(row, _)| [row.clone(), follower(row)])
        .collect();
    rows.extend(others);
    let inserted = table.insert(&rows).await;
    let poison = |((row, error), pair): ((NewRow, _), &[Inserted])| Poison {
        case: row.aggregate_id.expect("a poison row has an aggregate id"),
        id: pair[0].id,
        follower: pair[1].id,
        error,
    };
    let pairs = inserted.chunks(2);
    cases.into_iter().zip(pairs).map(poison).collect()
}

/// Once every failing poison row is dead-lettered: waits until the followers behind them are
/// released, checks that the relay is alive, and asserts how each of `poisons` ended. A dead
/// letter holds the rest of its aggregate (docs/design.md): its follower stays untouched.
async fn assert_poisons(table: &TestTable, relay: &mut RelayProcess, poisons: &[Poison]) {
    // A batch settles its failures, then hands back the rows behind them: let that finish.
    let blocked: Vec<Uuid> = poisons
        .iter()
        .filter(|p| p.error.is_some())
        .map(|p| p.follower)
        .collect();
    let held = format!("status = 'processing' AND {}", id_in(&blocked));
    table.wait_count(&held, 0, secs(10)).await;
    assert!(relay.is_running(), "the relay died:\n{}", relay.stderr());
    for poison in poisons {
        let case = &poison.case;
        let row = table.row(poison.id).await;
        let follower = table.row(poison.follower).await;
        match poison.error {
            None => {
                assert_eq!(status_attempts(&row), ("sent", 1), "{case}");
                assert_eq!(follower.status, "sent", "{case} follower");
            }
            Some(error) => {
                assert_eq!(status_attempts(&row), ("failed", 3), "{case}");
                let last = row.last_error.unwrap_or_default();
                assert!(last.contains(error), "{case}: last_error {last:?}");
                let why = "follower waits behind its dead letter";
                assert_eq!(status_attempts(&follower), ("pending", 0), "{case} {why}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_fail_or_pass_alone_without_stalling_other_aggregates() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_poison").await;
    let long = "k".repeat(300);
    let mixed = json!({
        "int": 42, "neg": -1.5e3, "float": 0.1, "huge": 123_456_789_012_345_678_u64, "bool": true,
        "obj": {"a": [1, {"b": null}], "c": "d"}, "arr": [1, "two", null, false], "nul": null,
        "str": "plain", "empty": "", "unicode": "é✓",
    });
    let case = |name: &str| NewRow::new("poison", Some(name), "e", json!({ "poison": name }));
    let long_key = case("long-routing-key").destination(&long);
    let long_name = case("long-header-name").headers(json!({ long.clone(): "v" }));
    let long_event = NewRow::new("poison", Some("long-event-type"), &long, json!({}));
    let long_event = long_event.destination("poison.short");
    // Rows that must pass (`None`) or fail on their own (`failed` after `retry.max_attempts`,
    // `last_error` containing the text), each in an aggregate of its own named after the case.
    let cases = vec![
        (case("headers-mixed").headers(mixed), None),
        (case("headers-array").headers(json!([1, 2, 3])), None),
        (case("headers-string").headers(json!("not an object")), None),
        (case("headers-null").headers(Value::Null), None),
        (case("unicode-destination").destination("ünï.cödé.✓"), None),
        (case("empty-destination").destination(""), None),
        (long_key, Some("routing key is longer than 255 bytes")),
        (long_name, Some("longer than 255 bytes")),
        (long_event, Some("event_type is longer than 255 bytes")),
        // Headers AMQP cannot fit in one frame (RabbitMQ's frame_max is 128 KiB): sent, the
        // broker would close the whole connection; refused, it fails alone.
        (
            case("huge-headers").headers(json!({ "big": "x".repeat(200_000) })),
            Some("frame_max"),
        ),
    ];
    let others = NewRow::numbered(200, "normal", Some(("n-", 20)), "e");
    let poisons = insert_poisons(&table, cases, others).await;
    let poison = |case: &str| poisons.iter().find(|p| p.case == case).unwrap().id;
    let failing: Vec<&Poison> = poisons.iter().filter(|p| p.error.is_some()).collect();
    let stuck: Vec<Uuid> = failing.iter().flat_map(|p| [p.id, p.follower]).collect();
    // Contract §4: numbers that do not fit an i64/u64/f64 keep their exact JSON text too. Written
    // as SQL text: a serde_json::Value would round them before they reach the table.
    let exact = r#"{"bignum": 123456789012345678901234567890,
                    "precise": 0.1000000000000000055511151231257827}"#;
    let t = &table.name;
    let sql = format!("UPDATE {t} SET headers = headers || $1::text::jsonb WHERE id = $2");
    let mixed_id = poison("headers-mixed");
    let updated = table.db.execute(&sql, &[&exact, &mixed_id]).await.unwrap();
    assert_eq!(updated, 1, "the exact numbers are in the headers-mixed row");

    // Backoff of 2 s: a failing row needs ≥ 6 s (attempts at 0, 2, 6 s) to be dead-lettered.
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "poison")
        .ordered()
        .set("retry.base_delay", "2s")
        .set("retry.max_delay", "10s")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", "3")
        .spawn();
    let started = Instant::now();
    let others_undelivered = format!("NOT {} AND status <> 'sent'", id_in(&stuck));
    table.wait_count(&others_undelivered, 0, secs(60)).await;
    let others_done = started.elapsed();
    // Not stalled: every other row went out while the failing rows were still being retried.
    let failed = "status = 'failed'";
    let already_failed = table.count_where(failed).await;
    let why = format!("the other rows took {others_done:?}, longer than the poison rows' retries");
    assert_eq!(already_failed, 0, "{why}");
    let n_failing = i64::try_from(failing.len()).unwrap();
    table.wait_count(failed, n_failing, secs(60)).await;
    let dead_after = started.elapsed();
    assert_poisons(&table, &mut relay, &poisons).await;
    // Still publishing.
    let late = NewRow::new("normal", Some("n-0"), "late", json!({}));
    let late = table.insert_one(late).await;
    rabbit.wait_for_ids(&[late], secs(30)).await;
    rabbit.barrier().await;
    let all = table.rows().await;
    let mut normal = all.clone();
    normal.retain(|f| f.aggregate().is_some_and(|a| a.starts_with("normal/")));
    assert_none("normal rows not sent once", &not_sent_once(&normal));

    // Header values that are not strings arrive as their JSON text, nulls omitted; headers that
    // are not an object are ignored. Numbers are compared with PostgreSQL's own text of them.
    let delivered = async |case: &str| rabbit.wait_for_delivery(poison(case), secs(5)).await;
    let got = delivered("headers-mixed").await.headers();
    let sql = format!(
        "SELECT h.key, h.value, o.headers->>h.key FROM {t} o, jsonb_each(o.headers) h \
         WHERE o.id = $1"
    );
    let mut problems = Vec::new();
    for stored in table.db.query(&sql, &[&mixed_id]).await.unwrap() {
        let key: String = stored.get(0);
        let value: Value = stored.get(1);
        let text: Option<String> = stored.get(2);
        match (&value, got.get(&key)) {
            (Value::Null, None) => {}
            (Value::Null, Some(v)) => problems.push(format!("{key}: null sent as {v:?}")),
            (_, None) => problems.push(format!("{key}: missing")),
            (Value::String(s), Some(v)) if s == v => {}
            (Value::Number(_), Some(v)) if Some(v) == text.as_ref() => {}
            (Value::Object(_) | Value::Array(_) | Value::Bool(_), Some(v))
                if serde_json::from_str::<Value>(v).ok() == Some(value.clone()) => {}
            (_, Some(v)) => problems.push(format!(
                "{key}: sent {v:?}, stored {value} (PostgreSQL's text {text:?})"
            )),
        }
    }
    assert!(problems.is_empty(), "row headers: {problems:?}");
    for case in ["headers-array", "headers-string", "headers-null"] {
        let headers = delivered(case).await.headers().into_keys();
        let extra: Vec<String> = headers.filter(|k| !k.starts_with("cloudEvents:")).collect();
        assert!(extra.is_empty(), "{case}: row headers sent: {extra:?}");
    }
    let routed = async |case| delivered(case).await.routing_key;
    assert_eq!(routed("unicode-destination").await, "ünï.cödé.✓");
    let why = "an empty destination falls back to the template";
    assert_eq!(routed("empty-destination").await, "poison.e", "{why}");

    let mut expected = all.clone();
    expected.retain(|f| !stuck.contains(&f.id));
    let note = format!(
        "dead_lettered={} others_done_after={others_done:?} dead_letters_after={dead_after:?}",
        failing.len()
    );
    let analysis = rabbit.analyse(&expected);
    summary("poison-rows", poisons.len(), all.len(), &analysis, &note);
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_rows_for_invalid_topics_dead_letter_alone() {
    let _shared = SERVICES.read().await;
    let table = TestTable::new("f_kafka_poison").await;
    let topic = topic_name("fpoison");
    create_topic(KAFKA, &topic).await;
    let invalid = |name: &str, destination: &str| {
        let row = NewRow::new("kp", Some(name), "bad", json!({}));
        (
            row.destination(destination),
            Some("not a valid Kafka topic"),
        )
    };
    let cases = vec![
        invalid("slash", "bad/topic"),
        invalid("space", "bad topic"),
        invalid("too-long", &"x".repeat(250)),
    ];
    let good = NewRow::numbered(100, "kp", Some(("k-", 10)), "e");
    let poisons = insert_poisons(&table, cases, good).await;
    let mut relay = kafka_relay(&table, KAFKA, &topic, "kafka-poison")
        .ordered()
        .set("retry.base_delay", "200ms")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", "3")
        .spawn();
    let n_invalid = i64::try_from(poisons.len()).unwrap();
    let what = "invalid-topic rows dead-lettered, the others sent";
    let done = |c: &Counts| c["failed"] == n_invalid && c["sent"] == 100;
    table.wait_for_counts(secs(60), what, done).await;
    assert_poisons(&table, &mut relay, &poisons).await;
    let all = table.rows().await;
    let mut good = all.clone();
    good.retain(|f| f.aggregate().is_some_and(|a| a.starts_with("kp/k-")));
    assert_none("good rows not sent once", &not_sent_once(&good));
    // The good rows reached the topic, in order per key, and nothing else did.
    let ids = read_ids(KAFKA, &topic, good.len(), secs(30)).await;
    let analysis = analyse(&good, ids.iter().map(String::as_str));
    let note = format!("dead_lettered={n_invalid}");
    let fault = "kafka-invalid-topics";
    summary(fault, poisons.len(), all.len(), &analysis, &note);
    finish_topics(relay, table, &[&topic]).await;
}

/// A broker rejects a whole produce batch for one record in it: a private tansu that validates
/// every record of a batch against the topic's JSON schema and answers INVALID_RECORD for the
/// batch when one does not conform. The rows of other aggregates batched with it (a 100 ms
/// linger puts them together) are sent on their first attempt; only the offending row spends
/// one (and, with one attempt allowed, is dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_batch_rejected_for_one_record_charges_only_that_record() {
    let _shared = SERVICES.read().await;
    let dir = TempDir::new("kafka-schema");
    let topic = topic_name("fbatch");
    let schema =
        r#"{"type": "object", "properties": {"value": {"type": "object", "required": ["ok"]}}}"#;
    dir.write(&format!("{topic}.json"), schema);
    let port = free_port();
    let registry = format!("file://{}", dir.path().display());
    let log = dir.path().join("tansu.log");
    let extra = ["--schema-registry", registry.as_str()];
    let tansu = Tansu::start_with(port, local(port), &log, &extra).await;
    let broker = tansu.direct();
    create_topic(&broker, &topic).await;
    let table = TestTable::new("f_kafka_batch").await;
    let mut rows: Vec<NewRow> = (0..20)
        .map(|i| {
            let aggregate = format!("a{i}");
            NewRow::new("kb", Some(&aggregate), "e", json!({"ok": true, "i": i}))
        })
        .collect();
    rows.insert(10, NewRow::new("kb", Some("bad"), "e", json!({"i": "bad"})));
    let ids = table.insert_ids(&rows).await;
    let bad = ids[10];
    let config = dir.write(
        "linger.toml",
        "[publisher.kafka.properties]\n\"linger.ms\" = \"100\"\n",
    );
    let config = config.to_str().unwrap().to_owned();
    let relay = kafka_relay(&table, &broker, &topic, "kafka-batch")
        .set("retry.max_attempts", "1")
        .spawn_with(&["--config", &config, "run"]);
    let what = "the offending row dead-lettered, the others sent";
    let done = |c: &Counts| c["failed"] == 1 && c["sent"] == 20;
    table.wait_for_counts(secs(60), what, done).await;
    let all = table.rows().await;
    let (failed, good): (Vec<RowState>, Vec<RowState>) = all.into_iter().partition(|r| r.id == bad);
    assert_eq!(failed[0].status, "failed", "{failed:?}");
    assert_none("good rows not sent once", &not_sent_once(&good));
    // The scenario happened: some good row shared the offending row's batch.
    let alone = relay.log_count("published alone, it was accepted");
    assert!(
        alone > 0,
        "no batch-mate was rejected with it:\n{}",
        relay.stderr()
    );
    let note = format!("batch_mates_published_alone={alone}");
    summary(
        "kafka-batch-rejected",
        1,
        good.len() + 1,
        &Analysis::default(),
        &note,
    );
    relay.stop().await;
    table.drop_table().await;
    drop(tansu);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_arrive_byte_for_byte_as_octet_stream() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_bytea").await;
    table.make_payload_bytea().await;
    let noise = (0..65_536u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8);
    let payloads: Vec<Vec<u8>> = vec![
        (0..=255u8).collect(),
        Vec::new(),
        vec![0xff, 0xfe, 0x00, 0x80, 0xc3, 0x28],
        br#"{"looks": "like json"}"#.to_vec(),
        vec![0u8; 1000],
        noise.collect(),
    ];
    let mut ids = Vec::new();
    for (i, payload) in payloads.iter().enumerate() {
        ids.push(table.insert_bytes(&format!("b-{}", i % 2), payload).await);
    }
    let relay = RelayBuilder::for_test(&table, &rabbit, "bytea")
        .ordered()
        .spawn();
    table.wait_all_sent(secs(60)).await;
    let logs = relay.stderr();
    let why = format!("the relay should detect the bytea column:\n{logs}");
    assert!(logs.contains("payload=Binary"), "{why}");
    rabbit.barrier().await;
    for (id, bytes) in ids.iter().zip(&payloads) {
        let d = rabbit.wait_for_delivery(*id, secs(5)).await;
        let (sent, stored) = (d.body.len(), bytes.len());
        let why = format!("{id}: body differs ({sent} bytes sent, {stored} stored)");
        assert!(d.body == *bytes, "{why}");
        let content_type = d.properties.content_type().as_ref().map(|c| c.as_str());
        assert_eq!(content_type, Some("application/octet-stream"), "{id}");
    }
    summarise_all(&table, &rabbit, "bytea-payloads", payloads.len(), "").await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_aggregate_does_not_starve_the_others() {
    let _shared = SERVICES.read().await;
    const BIG: usize = 10_000;
    const OTHERS: usize = 50;
    const EACH: usize = 10;
    let (table, rabbit) = table_and_exchange("f_big_agg").await;
    for _ in 0..BIG / 1000 {
        let whale = NewRow::numbered(1000, "big", Some(("whale", 1)), "e");
        table.insert(&whale).await;
    }
    let rows = NewRow::numbered(OTHERS * EACH, "small", Some(("s-", OTHERS)), "e");
    table.insert(&rows).await;

    let audit = ClaimAudit::install(&table).await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "big-agg")
        .ordered()
        .spawn();
    let started = Instant::now();
    let left = async |kind: &str| {
        let unsent = format!("aggregate_type = '{kind}' AND status <> 'sent'");
        table.count_where(&unsent).await
    };
    let what = "every small aggregate is delivered";
    let whale_left = wait_until(LONG, what, async || match left("small").await {
        0 => Ok(left("big").await),
        small => Err(format!("{small} small rows not sent")),
    })
    .await;
    let small_done = started.elapsed();
    // "Long before": at least a fifth of the huge aggregate was still waiting.
    let why = format!(
        "the small aggregates finished only when {whale_left} of the huge one's {BIG} rows were left"
    );
    assert!(whale_left >= i64::try_from(BIG / 5).unwrap(), "{why}");
    // Its rows go out one confirm after another (n+1 only after n is confirmed): 10,000 take
    // 30–90 s in a debug build on a busy machine. The short form stops here and checks what was
    // sent so far; the soak waits for the end.
    let whale_done = if soak() {
        table.wait_all_sent(secs(600)).await;
        Some(started.elapsed())
    } else {
        None
    };
    relay.stop().await;
    rabbit.barrier().await;
    let sql = format!(
        "SELECT min(c.at), bool_or(o.aggregate_type = 'small') FROM {} c JOIN {} o USING (id) \
         GROUP BY c.xid ORDER BY 1",
        audit.0, table.name
    );
    let claims = table.db.query(&sql, &[]).await.unwrap();
    let claims: Vec<(DateTime<Utc>, bool)> = claims.iter().map(|r| (r.get(0), r.get(1))).collect();
    let first_small = claims.iter().position(|c| c.1).unwrap();
    let small_after = (claims[first_small].0 - claims[0].0).to_std().unwrap();

    let all = table.rows().await;
    // Every row the relay marked sent must have arrived, in order; in the short form the rest of
    // the huge aggregate is still pending (handed back at SIGTERM), which is not a loss.
    let sent: Vec<RowState> = all.iter().filter(|f| f.status == "sent").cloned().collect();
    let whale_pending =
        |f: &RowState| f.status == "pending" && f.aggregate().as_deref() == Some("big/whale");
    let unfinished: Vec<_> = all
        .iter()
        .filter(|f| f.status != "sent" && !whale_pending(f))
        .collect();
    assert_none("only the huge aggregate may be unfinished", &unfinished);
    let note = format!(
        "sent={} first_small_claim_after={small_after:?} (claim #{}) \
         small_aggregates_done_after={small_done:?} (huge aggregate had {whale_left} of {BIG} \
         left) huge_done_after={whale_done:?}",
        sent.len(),
        first_small + 1
    );
    let analysis = rabbit.analyse(&sent);
    summary("huge-aggregate", 1, all.len(), &analysis, &note);
    audit.drop_all(table, rabbit).await;
}

/// Inserts a row whose payload is a JSON string of `bytes` characters, generated by the server.
async fn insert_huge(table: &TestTable, aggregate: &str, bytes: usize) -> Uuid {
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('o', $1, 'huge', to_jsonb(repeat('x', $2))) RETURNING id",
        table.name
    );
    let bytes = i32::try_from(bytes).unwrap();
    let row = table.db.query_one(&sql, &[&aggregate, &bytes]).await;
    row.unwrap().get(0)
}

/// RabbitMQ's `max_message_size` (128 MiB by default since 3.8), and a little more.
const OVER_MAX_MESSAGE_SIZE: usize = 128 * 1024 * 1024 + 1024;

/// A message above RabbitMQ's `max_message_size` makes the broker close the channel it was
/// published on (406 PRECONDITION_FAILED), not the connection: the row must fail on its own
/// (message-level: attempts spent, dead-lettered) and every other aggregate be delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_rabbitmq_message_fails_alone_while_the_others_are_delivered() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_oversize").await;
    let huge = insert_huge(&table, "huge", OVER_MAX_MESSAGE_SIZE).await;
    let follower = NewRow::new("o", Some("huge"), "follower", json!({}));
    let follower = table.insert_one(follower).await;
    let others: Vec<NewRow> = NewRow::numbered(100, "o", Some(("a-", 10)), "e");
    table.insert(&others).await;
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "oversize")
        .ordered()
        .set("retry.base_delay", "200ms")
        .set("retry.max_attempts", "3")
        .spawn();
    let what = "the oversize row is dead-lettered";
    let failed = |r: &RowState| r.status == "failed";
    table.wait_row(huge, secs(90), what, failed).await;
    let others_sent = format!("id NOT IN ('{huge}', '{follower}') AND status = 'sent'");
    table.wait_count(&others_sent, 100, secs(90)).await;
    let error = Some("larger than configured max size");
    let oversize = Poison {
        case: "oversize".to_owned(),
        id: huge,
        follower,
        error,
    };
    assert_poisons(&table, &mut relay, &[oversize]).await;
    rabbit.barrier().await;
    let all = table.rows().await;
    let mut expected = all.clone();
    expected.retain(|f| f.id != huge && f.id != follower);
    assert_none("other rows not sent once", &not_sent_once(&expected));
    let why = "the oversize row was delivered";
    assert!(!rabbit.id_counts().contains_key(&huge.to_string()), "{why}");
    let note = format!(
        "payload_bytes={OVER_MAX_MESSAGE_SIZE} channel_closures={} oversize_row=failed/3",
        relay.log_count("larger than configured max size")
    );
    let analysis = rabbit.analyse(&expected);
    summary("oversize-rabbitmq-message", 1, all.len(), &analysis, &note);
    finish(relay, table, rabbit).await;
}

// ---------------------------------------------------------------------------------------------
// 5. A row that crashes the relay

const CRASH_MAX_ATTEMPTS: usize = 3;

/// A row that aborts the relay every time it is about to be published (the crash switch
/// `OUTBOX_RELAY_TEST_CRASH_HEADER`, behind the cargo feature `fault-injection`, on in every test
/// build through the dev-dependency), 41 other rows claimed in the same first batch, and a
/// supervisor that restarts the relay (lease 1 s) each time it dies, until the crasher is
/// dead-lettered and nothing else is left to publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_crashes_the_relay_is_dead_lettered_after_max_attempts_crash_cycles() {
    const HEADER: &str = "x-fault-crash";
    let _shared = SERVICES.read().await;
    let label = "f_crash";
    let (table, rabbit) = table_and_exchange(label).await;
    let audit = ClaimAudit::install(&table).await;

    // One statement, before any relay runs: the first claim takes them all in one batch, so
    // the crasher's batch-mates are every other row.
    let mut rows = NewRow::numbered(40, "crash", Some(("c-", 8)), "e");
    for without_aggregate in rows.iter_mut().skip(7).step_by(8) {
        without_aggregate.aggregate_id = None;
    }
    let crasher = |event| NewRow::new("crash", Some("crasher"), event, json!({}));
    let crashers = [
        crasher("boom").headers(json!({ HEADER: "1" })),
        crasher("after"),
    ];
    rows.splice(21..21, crashers);
    let inserted = table.insert(&rows).await;
    let crasher = inserted[21].id;
    let follower = inserted[22].id;

    let spawn = |n: usize| {
        let instance = format!("{label}-{n}");
        RelayBuilder::for_test(&table, &rabbit, &instance)
            .ordered()
            .env("OUTBOX_RELAY_TEST_CRASH_HEADER", HEADER)
            .set("relay.lease_timeout", "1s")
            .set("relay.poll_interval", "100ms")
            .set("retry.max_attempts", CRASH_MAX_ATTEMPTS.to_string())
            .set("retry.base_delay", "100ms")
            .spawn()
    };
    // The supervisor: restart the relay every time it dies, as systemd or Kubernetes would.
    let mut relay = spawn(0);
    let mut crashes = 0;
    let started = Instant::now();
    let others_open =
        format!("id NOT IN ('{crasher}', '{follower}') AND status IN ('pending', 'processing')");
    loop {
        if !relay.is_running() {
            let status = relay.wait_exit(secs(10)).await;
            let (who, logs) = (&relay.label, relay.stderr());
            let why = format!("{who} should die by the crash switch's abort: {status}\n{logs}");
            assert_eq!(status.signal(), Some(6), "{why}");
            let aborted = format!("aborting before publishing row {crasher}");
            let why = format!("{who} aborted on another row:\n{logs}");
            assert!(logs.contains(&aborted), "{why}");
            crashes += 1;
            let why = "more crash cycles than retry.max_attempts";
            assert!(crashes <= CRASH_MAX_ATTEMPTS, "{why}");
            relay = spawn(crashes);
            continue;
        }
        let state = table.row(crasher).await.status;
        if state == "failed" && table.count_where(&others_open).await == 0 {
            break;
        }
        assert!(
            started.elapsed() < secs(120),
            "no end to the crash loop after {crashes} crashes: crasher {state}, {:?}",
            table.status_counts().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(crashes, CRASH_MAX_ATTEMPTS, "one crash per attempt");
    // No more crashes: the relay keeps running and publishes new rows.
    let late = |aggregate| NewRow::new("crash", aggregate, "late", json!({}));
    let late = table.insert_ids(&[late(Some("c-0")), late(None)]).await;
    rabbit.wait_for_ids(&late, secs(30)).await;
    tokio::time::sleep(secs(2)).await;
    let logs = relay.stderr();
    assert!(relay.is_running(), "the relay died again:\n{logs}");
    rabbit.barrier().await;

    let crashed = table.row(crasher).await;
    let max_attempts = i32::try_from(CRASH_MAX_ATTEMPTS).unwrap();
    assert_eq!(status_attempts(&crashed), ("failed", max_attempts));
    let last = crashed.last_error.unwrap_or_default();
    let last_holder = format!("{label}-{}", CRASH_MAX_ATTEMPTS - 1);
    for blame in ["lease expired", &last_holder] {
        let why = format!("crasher last_error {last:?} lacks {blame:?}");
        assert!(last.contains(blame), "{why}");
    }
    // The follower was in the crasher's first batch (the first crash spent that attempt); it
    // then waits behind the dead letter (docs/design.md) and is never published.
    let waiting = table.row(follower).await;
    let why = "the crasher's follower waits behind the dead letter";
    assert_eq!(status_attempts(&waiting), ("pending", 1), "{why}");
    let published = rabbit.id_counts();
    for (row, id) in [("the crasher", crasher), ("its follower", follower)] {
        let why = format!("{row} was published");
        assert!(!published.contains_key(&id.to_string()), "{why}");
    }
    // The crasher's batch-mates: rows claimed in the same claim (transaction) as its first claim.
    let claims = audit.claims(&table).await;
    let first = claims.iter().find(|c| c.id == crasher).unwrap();
    let mates: HashSet<Uuid> = claims
        .iter()
        .filter(|c| c.xid == first.xid && c.id != crasher)
        .map(|c| c.id)
        .collect();
    let n = mates.len();
    let why = format!("the crasher shared its first batch with only {n} rows");
    assert!(n >= 30, "{why}");
    let mut others = table.rows().await;
    others.retain(|f| f.id != crasher && f.id != follower);
    // Never an innocent dead letter: every other row ends sent.
    let not_sent: Vec<_> = others
        .iter()
        .filter(|f| f.status != "sent")
        .map(|f| (f.id, f.status.clone(), f.attempts, f.last_error.clone()))
        .collect();
    assert_none("rows dead-lettered or stuck with the crasher", &not_sent);
    // The README: "a row that kills the relay every time spends only its own attempts … the
    // rows that happened to share its batch go out normally". Each crash may cost its
    // batch-mates the one attempt of the batch they shared: at most 2 attempts.
    let over: Vec<(Uuid, i32, bool)> = others
        .iter()
        .filter(|f| f.attempts > 2)
        .map(|f| (f.id, f.attempts, mates.contains(&f.id)))
        .collect();
    let why = "rows charged for more than one of the crasher's crashes (id, attempts, batch-mate)";
    assert_none(why, &over);
    let note = format!(
        "batch_mates={} other_rows_by_attempts={:?} crasher=failed/{CRASH_MAX_ATTEMPTS}",
        mates.len(),
        tally(others.iter().map(|f| f.attempts))
    );
    let analysis = rabbit.analyse(&others);
    summary("crash-loop", crashes, others.len() + 2, &analysis, &note);
    relay.stop().await;
    audit.drop_all(table, rabbit).await;
}

/// A bug outside the publish: the relay panics while recording the outcomes of every batch
/// that holds one row (the settle panic switch `OUTBOX_RELAY_TEST_SETTLE_PANIC_HEADER`, behind
/// the `fault-injection` feature). The batch's task unwinds, its rows stop being renewed and
/// come back when their lease runs out (an attempt spent), each then claimed alone as a
/// suspect: the panicker ends a dead letter after `retry.max_attempts`, every other row is
/// sent, and the one relay process keeps running throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_while_settling_gives_the_batch_back_after_its_lease() {
    const HEADER: &str = "x-fault-settle-panic";
    const MAX_ATTEMPTS: i32 = 3;
    let _shared = SERVICES.read().await;
    let label = "f_settle_panic";
    let (table, rabbit) = table_and_exchange(label).await;
    let mut rows = NewRow::numbered(30, "settle", None, "e");
    let panicker = NewRow::new("settle", None, "boom", json!({}));
    rows.insert(10, panicker.headers(json!({ HEADER: "1" })));
    let inserted = table.insert(&rows).await;
    let panicker = inserted[10].id;

    let mut relay = RelayBuilder::for_test(&table, &rabbit, label)
        .env("OUTBOX_RELAY_TEST_SETTLE_PANIC_HEADER", HEADER)
        .set("relay.lease_timeout", "1s")
        .set("relay.poll_interval", "100ms")
        .set("retry.max_attempts", MAX_ATTEMPTS.to_string())
        .set("retry.base_delay", "100ms")
        .spawn();
    let others_open =
        format!("id <> '{panicker}' AND status IN ('pending', 'processing', 'failed')");
    wait_until(
        secs(120),
        "the panicker dead-lettered and every other row sent",
        async || {
            let logs = relay.stderr();
            assert!(relay.is_running(), "the relay stopped:\n{logs}");
            let state = table.row(panicker).await;
            let open = table.count_where(&others_open).await;
            if state.status == "failed" && open == 0 {
                Ok(state)
            } else {
                Err(format!("panicker {state:?}, {open} other rows not sent"))
            }
        },
    )
    .await;
    let logs = relay.stderr();
    let caught = "the relay panicked outside the publish";
    assert!(logs.contains(caught), "no {caught:?} in the logs:\n{logs}");
    let panicked = table.row(panicker).await;
    assert_eq!(status_attempts(&panicked), ("failed", MAX_ATTEMPTS));
    let last = panicked.last_error.unwrap_or_default();
    assert!(
        last.contains("lease expired"),
        "panicker last_error {last:?}"
    );

    // The relay goes on: a new row is published and settled.
    let late = table
        .insert_ids(&[NewRow::new("settle", None, "late", json!({}))])
        .await;
    rabbit.wait_for_ids(&late, secs(30)).await;
    // The 30 other rows and the late one.
    let every_other_row_sent = |c: &Counts| c.get("sent") == Some(&31);
    table
        .wait_for_counts(secs(30), "every other row sent", every_other_row_sent)
        .await;
    assert!(relay.is_running(), "the relay died:\n{}", relay.stderr());

    let mut others = table.rows().await;
    others.retain(|f| f.id != panicker);
    // Each row shared at most the panicker's first batch: one attempt spent by its lease, one
    // by the claim that sent it.
    let over: Vec<(Uuid, i32)> = others
        .iter()
        .filter(|f| f.attempts > 2)
        .map(|f| (f.id, f.attempts))
        .collect();
    assert_none(
        "rows charged for more than one of the panicker's batches",
        &over,
    );
    rabbit.barrier().await;
    let analysis = rabbit.analyse(&table.rows().await);
    // The panic comes after the publish: the panicker went out once per attempt.
    let delivered = analysis.counts.get(&panicker).copied();
    let attempts = usize::try_from(MAX_ATTEMPTS).unwrap();
    assert_eq!(delivered, Some(attempts), "deliveries of the panicker");
    // A batch-mate went out with the panicker's first batch and once more on its own.
    let over: Vec<(&Uuid, &usize)> = analysis
        .counts
        .iter()
        .filter(|(id, n)| **id != panicker && **n > 2)
        .collect();
    assert_none("rows delivered more than twice", &over);
    let note = format!(
        "other_rows_by_attempts={:?}",
        tally(others.iter().map(|f| f.attempts))
    );
    let panics = logs.matches(caught).count();
    summary("settle-panic", panics, others.len() + 1, &analysis, &note);
    relay.stop().await;
    drop_both(table, rabbit).await;
}

// ---------------------------------------------------------------------------------------------
// 6. Secrets, TLS, the metrics address

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_stay_out_of_every_output_on_failure_paths() {
    let _shared = SERVICES.read().await;
    // Distinctive, and with a character that must be percent-encoded in a URL: neither the
    // encoded nor the decoded form may appear.
    let plain = format!("Pw-{}!", hex8());
    let encoded = plain.replace('!', "%21");
    let table = TestTable::new("f_secrets").await;
    let unknown_role = format!("nosuchrole_{}", hex8());
    // (case, database role, database port, broker port, whether the database works); every URL
    // carries the password.
    let cases = [
        // Trust authentication ignores the password: the database works, the broker refuses.
        ("wrong-amqp-password", "postgres", 5432, 5672, true),
        // A role that does not exist: the server refuses the login.
        ("unknown-db-role", unknown_role.as_str(), 5432, 5672, false),
        // Nothing listens on port 1: the broker's connection refused, the database working.
        ("unreachable-broker", "postgres", 5432, 1, true),
        // Nothing listens on port 1 (no proxy): connection refused on both.
        ("unreachable", "postgres", 1, 1, false),
    ];
    let mut checked = 0;
    for (case, role, db_port, amqp_port, db_ok) in cases {
        let db = format!("postgres://{role}:{encoded}@127.0.0.1:{db_port}/test");
        let amqp = format!("amqp://guest:{encoded}@127.0.0.1:{amqp_port}/%2f");
        let builder = || {
            RelayBuilder::bare(case)
                .set("database.url", &db)
                .set("database.table", &table.name)
                .set("publisher.rabbitmq.url", &amqp)
                .set("metrics.listen", "")
        };
        let leaks = |what: &str, text: &str| {
            let leaked = text.contains(&plain) || text.contains(&encoded);
            assert!(!leaked, "{case}: {what} shows the password:\n{text}");
        };
        // What `check` reports of the database, and what `run` logs while it retries.
        let (database, unavailable) = if db_ok {
            ("database: ok", "broker unavailable")
        } else {
            ("database: FAILED", "database unavailable")
        };
        let out = builder().output(&["check"], secs(60)).await;
        assert_eq!(out.status.code(), Some(1), "{case}: check {out:?}");
        for line in ["broker: FAILED", ":***@", database] {
            let why = format!("{case}: check should print {line:?}: {out:?}");
            assert!(out.stdout.contains(line), "{why}");
        }
        leaks("check", &format!("{}\n{}", out.stdout, out.stderr));
        if case == "wrong-amqp-password" {
            let refused = out.stdout.to_ascii_uppercase().contains("ACCESS_REFUSED")
                || out.stdout.contains("refused");
            let why = format!("{case}: the broker's refusal should be reported: {out:?}");
            assert!(refused, "{why}");
        }
        checked += 1;
        for args in [
            &["status"][..],
            &["status", "--json"],
            &["dead-letters", "list"],
        ] {
            let out = builder().output(args, secs(60)).await;
            assert_eq!(out.status.success(), db_ok, "{case}: {args:?} {out:?}");
            let output = format!("{}\n{}", out.stdout, out.stderr);
            leaks(&format!("{args:?}"), &output);
            checked += 1;
        }
        for format in ["text", "json"] {
            let args = ["--log-format", format, "run"];
            let mut relay = builder().env("RUST_LOG", "debug").spawn_with(&args);
            relay.wait_for_log(unavailable, 2, secs(30)).await;
            relay.sigterm();
            let status = relay.wait_exit(secs(30)).await;
            assert!(status.success(), "{case}: run {status}\n{}", relay.stderr());
            let logs = format!("{}\n{}", relay.stdout(), relay.stderr());
            leaks(&format!("run ({format} logs)"), &logs);
            // The start-up line and the reconnect warnings show both URLs, masked.
            if db_ok {
                let why = format!("{case}: run ({format} logs) should show the masked URLs");
                let masked = logs.contains("postgres:***@") && logs.contains("guest:***@");
                assert!(masked, "{why}:\n{logs}");
            }
            checked += 1;
        }
    }
    let note = format!("outputs_checked={checked}");
    summary("secrets", cases.len(), 0, &Analysis::default(), &note);
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_tls_is_used_for_every_relay_session_with_sslmode_require() {
    let _shared = SERVICES.read().await;
    let (table, rabbit) = table_and_exchange("f_tls").await;
    // A session name of our own (still `outbox-relay…`, which the ordering guard ignores): other
    // relays, in this file and elsewhere, also call their sessions `outbox-relay`.
    let app = format!("outbox-relay-tls-{}", hex8());
    let url =
        format!("postgres://postgres@localhost:5432/test?sslmode=require&application_name={app}");
    let relay = RelayBuilder::for_test(&table, &rabbit, "tls")
        .ordered()
        .set("database.url", &url)
        .spawn();
    let ids = NewRow::numbered(50, "tls", Some(("t-", 5)), "e");
    let ids = table.insert_ids(&ids).await;
    rabbit.wait_for_ids(&ids, secs(60)).await;
    table.wait_all_sent(secs(30)).await;
    let sql = "SELECT ssl, version FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
               WHERE application_name = $1";
    let what = "the relay's pool and LISTEN sessions are visible";
    let sessions: Vec<(bool, Option<String>)> = wait_until(secs(10), what, async || {
        let rows = table.db.query(sql, &[&app]).await.unwrap();
        match rows.len() {
            n @ 0..2 => Err(format!("{n} sessions")),
            _ => Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect()),
        }
    })
    .await;
    let plain: Vec<_> = sessions.iter().filter(|(ssl, _)| !ssl).collect();
    assert_none("relay sessions without TLS", &plain);
    let logs = relay.stderr();
    let listening = logs.contains("listening for NOTIFY") || relay.log_count("LISTEN") == 0;
    assert!(listening, "{logs}");
    relay.stop().await;

    // The server is verified, not merely encrypted: its certificate names `localhost`, so the
    // same server reached as 127.0.0.1 is refused.
    let by_ip = "postgres://postgres@127.0.0.1:5432/test?sslmode=require";
    let out = RelayBuilder::for_test(&table, &rabbit, "tls-ip")
        .set("database.url", by_ip)
        .output(&["check"], secs(60))
        .await;
    let why = format!("a certificate for localhost accepted for 127.0.0.1: {out:?}");
    assert!(out.stdout.contains("database: FAILED"), "{why}");
    assert!(out.stdout.contains("certificate is not trusted"), "{why}");
    // A certificate that is not trusted stays so until the configuration changes: `run`
    // stops at start saying so, rather than waiting for the database as for an outage.
    RelayBuilder::for_test(&table, &rabbit, "tls-ip-run")
        .set("database.url", by_ip)
        .spawn()
        .expect_start_error(secs(60), "certificate is not trusted")
        .await;
    let versions: HashSet<_> = sessions.iter().map(|s| s.1.clone()).collect();
    let note = format!("tls_sessions={} versions={versions:?}", sessions.len());
    summary("postgres-tls", 0, ids.len(), &Analysis::default(), &note);
    drop_both(table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_server_binds_loopback_by_default() {
    let _shared = SERVICES.read().await;
    let defaults = outbox_relay::config::RawConfig::default().validate();
    let default = defaults.expect("defaults are valid").metrics_listen;
    let default = default.expect("metrics are on by default");
    let why = format!("default metrics.listen {default}");
    assert!(default.ip().is_loopback(), "{why}");
    assert_eq!(default, local(9187));

    // A relay with metrics.listen unset. Another relay on this machine may hold 9187, in which
    // case this one refuses to start — naming the default address all the same.
    let table = TestTable::new("f_metrics").await;
    let mut relay = RelayBuilder::bare("metrics-default")
        .set("database.url", PG_URL)
        .set("database.table", &table.name)
        .set("publisher.rabbitmq.url", AMQP_URL)
        .spawn();
    let what = "the relay serves metrics or says why not";
    let outcome = wait_until(secs(30), what, async || {
        let logs = relay.stderr();
        if let Some(line) = logs.lines().find(|l| l.contains("serving /metrics")) {
            return Ok(Some(line.to_owned()));
        }
        match relay.is_running() {
            true => Err("no metrics line yet".to_owned()),
            false => Ok(None),
        }
    })
    .await;
    let note = match outcome {
        Some(line) => {
            assert!(line.contains("addr=127.0.0.1:9187"), "{line}");
            // Reachable on loopback; bound there only: the relay's listening sockets, read
            // from /proc (no packet leaves loopback to prove it).
            let text = scrape(9187).await.unwrap();
            assert!(text.contains("outbox_relay_info"), "{text}");
            let bound = listening_addrs(relay.pid());
            assert!(bound.contains(&local(9187)), "listening on {bound:?}");
            let exposed: Vec<_> = bound.iter().filter(|a| !a.ip().is_loopback()).collect();
            assert!(exposed.is_empty(), "listening beyond loopback: {exposed:?}");
            relay.stop().await;
            format!("bound={bound:?}")
        }
        None => {
            let status = relay.wait_exit(secs(5)).await;
            let logs = relay.stderr();
            assert_eq!(status.code(), Some(1), "{logs}");
            let why = "cannot listen on metrics.listen 127.0.0.1:9187";
            assert!(logs.contains(why), "{logs}");
            "port_9187_taken_by_another_process".to_owned()
        }
    };
    summary("metrics-default-bind", 0, 0, &Analysis::default(), &note);
    table.drop_table().await;
}
