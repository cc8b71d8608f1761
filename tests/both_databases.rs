//! The relay's scenarios on both databases (docs/mysql.md: "everything above the table is the
//! same"): each written once as `async fn scenario(db: Db)` and run on the local PostgreSQL
//! and on the local MariaDB by `on_both_databases!` (tests `<scenario>::postgres` and
//! `<scenario>::mysql`). The wire format; per-aggregate order with 1,000 aggregates and three
//! replicas killed with SIGKILL mid-drain; a transaction committing after a later one of its
//! aggregate; a long transaction on another table holding nothing back; the broker's and the
//! database's connections cut by a proxy without an attempt spent; dead letters, `status`,
//! the gauges and `dead-letters retry`; the backlog gauges while the broker is unreachable;
//! the ready age as a claim sees it; expiry; the documented roles (and `check` naming the
//! grants a role lacks); one relay per instance id
//! (a second refused, a lost lock waited out); and one relay serving a PostgreSQL and a
//! MySQL outbox.
//!
//! The real binary against the real services, each test on its own table and exchange (and
//! roles, proxies, metrics port).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::envelope::amqp_problems;
use common::{
    AMQP_URL, Db, DbConn, MYSQL_URL, NewRow, PG_URL, Proxy, RABBIT_ADDR, RabbitFixture,
    RelayBuilder, RelayProcess, RowState, TempDir, TestOutbox, assert_none, bulk_row, free_port,
    hex8, http_get, local, not_sent_cleanly, not_sent_once, on_both_databases, sample, scrape,
    sigkill_while_holding_rows, wait_for_count, wait_for_sample, wait_until,
};
use outbox_relay::config::Ordering;
use outbox_relay::telemetry::names;
use rand::seq::SliceRandom;
use serde_json::{Value, json};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long rows may take to be sent or delivered, and a command to finish.
const WAIT: Duration = Duration::from_secs(120);

on_both_databases!(
    the_wire_format_is_the_contracts,
    sigkilled_replicas_lose_nothing_and_keep_the_order_of_1000_aggregates,
    a_late_commit_never_lets_a_later_row_of_its_aggregate_out_first,
    a_long_transaction_on_another_table_holds_nothing_back,
    a_broker_cut_spends_no_attempt_and_loses_nothing,
    a_database_cut_spends_no_attempt_and_loses_nothing,
    dead_letters_are_counted_shown_and_retried_in_order,
    rows_waiting_for_an_unreachable_broker_show_in_the_backlog_gauges,
    the_ready_age_counts_only_rows_a_claim_would_take_now,
    a_row_past_its_deadline_is_expired_unpublished_and_frees_its_aggregate,
    a_row_left_processing_without_a_lock_time_is_reclaimed_in_order,
    the_documented_roles_are_enough_for_the_application_and_the_relay,
    a_second_relay_with_the_same_instance_id_refuses_to_start,
    a_relay_that_lost_its_instance_lock_stops_claiming_until_it_takes_it_again,
);

// ---- fixtures ---------------------------------------------------------------------------------

/// The test's outbox on `db` and an exchange whose queue is bound with `binding` (`#`, or
/// `ok.#` to leave other routing keys unroutable).
async fn outbox_and_exchange(db: Db, test: &str, binding: &str) -> (TestOutbox, RabbitFixture) {
    let outbox = TestOutbox::new(db, test).await;
    let barrier = binding.replace('#', "barrier");
    (outbox, RabbitFixture::new(test, binding, &barrier).await)
}

/// An ordered relay (`relay.ordering = "aggregate"`, 200 ms poll) for `outbox` publishing to
/// `rabbit`'s exchange, instance id `instance`.
fn relay(outbox: &TestOutbox, rabbit: &RabbitFixture, instance: &str) -> RelayBuilder {
    outbox
        .relay(instance)
        .set("publisher.rabbitmq.url", AMQP_URL)
        .set("publisher.rabbitmq.exchange", &rabbit.exchange)
        .ordered()
}

/// Stops `relay` (a clean exit), deletes the exchange and drops the table.
async fn finish(relay: RelayProcess, outbox: TestOutbox, rabbit: RabbitFixture) {
    relay.stop().await;
    rabbit.teardown().await;
    outbox.drop_table().await;
}

/// How many times `id` arrived so far.
fn delivered(rabbit: &RabbitFixture, id: Uuid) -> usize {
    let counts = rabbit.id_counts();
    counts.get(&id.to_string()).copied().unwrap_or(0)
}

/// Runs `builder` with `args` to completion; asserts success and parses stdout as JSON.
async fn json_of(builder: RelayBuilder, args: &[&str]) -> Value {
    let out = builder.output(args, WAIT).await;
    assert!(
        out.status.success(),
        "{args:?}: {}\n{}",
        out.stdout,
        out.stderr
    );
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{args:?}: {e}\n{}", out.stdout))
}

/// A writer's stop token and the task that returns how many rows it inserted.
type Writer = (CancellationToken, JoinHandle<usize>);

/// Lets `writer` run one more second, stops it and returns how many rows it inserted.
async fn stop_writer((stop, task): Writer) -> usize {
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.cancel();
    task.await.unwrap()
}

/// Inserts 10 rows over 13 aggregates (`<tag>-<n>`) every 30 ms on its own connection (never
/// through a test's proxy) until stopped.
fn spawn_steady_writer(outbox: &TestOutbox, tag: &str) -> Writer {
    let (db, table, tag) = (outbox.db(), outbox.name().to_owned(), tag.to_owned());
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let mut conn = db.connect().await;
        let mut n = 0;
        while !stop.is_cancelled() {
            let rows: Vec<NewRow> = (n..n + 10)
                .map(|i| {
                    let aggregate = format!("{tag}-{}", i % 13);
                    NewRow::new(&tag, Some(&aggregate), "tick", json!({ "n": i }))
                })
                .collect();
            conn.insert(&table, &rows).await;
            n += rows.len();
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(30)) => {}
                () = stop.cancelled() => {}
            }
        }
        n
    });
    (token, task)
}

// ---- the wire format ----------------------------------------------------------------------------

/// docs/wire-format.md, whatever database the row comes from: 400 rows of every shape
/// ([`bulk_row`]: with and without aggregate id, headers of every JSON kind, a null among
/// them, none at all) each arrive exactly once, in `seq` order per aggregate, sent on their
/// first attempt, with the contract's AMQP properties, routing key, `cloudEvents:` headers,
/// row headers and body.
async fn the_wire_format_is_the_contracts(db: Db) {
    let test = format!("{}_wire", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-")).spawn();
    let rows: Vec<NewRow> = (0..400).map(bulk_row).collect();
    for chunk in rows.chunks(50) {
        outbox.insert(chunk).await;
    }
    outbox.wait_all_sent(WAIT).await;
    rabbit.barrier().await;

    let rows = outbox.rows().await;
    assert_eq!(rows.len(), 400);
    rabbit.analyse(&rows).assert_exactly_once(&test);
    assert_none("rows not sent cleanly", &not_sent_cleanly(&rows));
    let by_id: HashMap<String, &RowState> = rows.iter().map(|r| (r.id.to_string(), r)).collect();
    let source = outbox.default_source();
    let deliveries = rabbit.deliveries();
    let mut problems = Vec::new();
    for d in &deliveries {
        let row = by_id[&d.message_id];
        let found = amqp_problems(d, row, &source, "cloudEvents:");
        problems.extend(
            found
                .into_iter()
                .map(|p| format!("{} (seq {}): {p}", row.id, row.seq)),
        );
    }
    assert_none("envelope problems", &problems);
    // The rows cover what they claim to: no aggregate id, a null header (never sent), no
    // headers.
    assert!(rows.iter().any(|r| r.aggregate_id.is_none()));
    assert!(deliveries.iter().all(|d| !d.headers().contains_key("gone")));
    assert!(rows.iter().any(|r| r.headers == json!({})));
    finish(relay, outbox, rabbit).await;
}

// ---- ordering ---------------------------------------------------------------------------------

/// Aggregates of [`spawn_versioned_writers`].
const AGGREGATES: usize = 1000;
/// Events each aggregate gets from [`spawn_versioned_writers`] at the least.
const EVENTS_PER_AGGREGATE: usize = 3;

/// Starts `writers` connections that insert one row per transaction: first a shuffled deck of
/// [`EVENTS_PER_AGGREGATE`] events for each of [`AGGREGATES`] aggregates (`a1`, `a2`, …),
/// then, every 20 ms each, rows of random aggregates until stopped (the deck is always written
/// out). They serialise per aggregate on the row lock of its version counter, as applications
/// do, and the payload carries the aggregate's new version: an aggregate's `seq` order is its
/// version order.
async fn spawn_versioned_writers(outbox: &TestOutbox, writers: usize) -> Writer {
    let versions = format!("{}_versions", outbox.name());
    let create =
        format!("CREATE TABLE {versions} (id VARCHAR(16) PRIMARY KEY, version BIGINT NOT NULL)");
    outbox.exec(&create).await;
    let values: Vec<String> = (1..=AGGREGATES).map(|a| format!("('a{a}', 0)")).collect();
    let fill = format!("INSERT INTO {versions} VALUES {}", values.join(", "));
    outbox.exec(&fill).await;
    let mut deck: Vec<usize> = (1..=AGGREGATES)
        .flat_map(|a| std::iter::repeat_n(a, EVENTS_PER_AGGREGATE))
        .collect();
    deck.shuffle(&mut rand::rng());
    let deck = Arc::new(Mutex::new(deck));
    let stop = CancellationToken::new();
    let mut tasks = JoinSet::new();
    for _ in 0..writers {
        let (db, table) = (outbox.db(), outbox.name().to_owned());
        let (versions, stop, deck) = (versions.clone(), stop.clone(), Arc::clone(&deck));
        tasks.spawn(async move {
            let mut conn = db.connect().await;
            let mut inserted = 0;
            loop {
                let dealt = deck.lock().unwrap().pop();
                if dealt.is_none() && stop.is_cancelled() {
                    break;
                }
                let a = dealt.unwrap_or_else(|| rand::random_range(1..=AGGREGATES));
                conn.begin().await;
                let bump = format!("UPDATE {versions} SET version = version + 1 WHERE id = 'a{a}'");
                conn.exec(&bump).await;
                let read = format!("SELECT version FROM {versions} WHERE id = 'a{a}'");
                let version = conn.query_i64(&read).await;
                let aggregate = format!("a{a}");
                let payload = json!({ "version": version });
                let row = NewRow::new("account", Some(&aggregate), "changed", payload);
                conn.insert(&table, &[row]).await;
                conn.commit().await;
                inserted += 1;
                if dealt.is_none() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            inserted
        });
    }
    let total = async move { tasks.join_all().await.into_iter().sum() };
    (stop, tokio::spawn(total))
}

/// Three ordered replicas drain what four writers insert over 1,000 aggregates; four times a
/// replica holding rows is killed with SIGKILL (and a new one started). Nothing is lost, every
/// row ends `sent`, and each aggregate's first arrivals carry versions 1, 2, 3, … in order.
/// (On PostgreSQL, `faults.rs` also audits every claim of this scenario under a trigger.)
async fn sigkilled_replicas_lose_nothing_and_keep_the_order_of_1000_aggregates(db: Db) {
    let test = format!("{}_sigkill", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let spawn = |instance: String| {
        relay(&outbox, &rabbit, &instance)
            .set("relay.lease_timeout", "3s")
            // Each kill spends an attempt of every row the victim held; lost rows, not dead
            // letters, are what this test is about.
            .set("retry.max_attempts", "100")
            .spawn()
    };
    let tag = db.tag();
    let mut slots = ["a", "b", "c"].map(|s| spawn(format!("{tag}-k0{s}")));
    let writer = spawn_versioned_writers(&outbox, 4).await;
    let mut held_at_death = Vec::new();
    for k in 0..4 {
        let slot = k % 3;
        let count_where = async |condition: &str| outbox.count_where(condition).await;
        let held =
            sigkill_while_holding_rows(&mut slots[slot], WAIT, count_where, || rabbit.count());
        held_at_death.push(held.await);
        slots[slot] = spawn(format!("{tag}-k{}{}", k + 1, ["a", "b", "c"][slot]));
    }
    let written = stop_writer(writer).await;
    outbox.wait_all_sent(WAIT).await;
    rabbit.barrier().await;

    let rows = outbox.rows().await;
    assert_eq!(rows.len(), written, "the writers' rows are in the table");
    let analysis = rabbit.analyse(&rows);
    analysis.assert_complete(&test);
    let why = format!("no kill caught a relay holding rows: {held_at_death:?}");
    assert!(held_at_death.iter().sum::<i64>() > 0, "{why}");
    // seq order is version order, and each aggregate's first arrivals carry its versions
    // 1, 2, 3, … to the last.
    let version = |r: &RowState| r.payload["version"].as_i64().unwrap();
    let mut by_aggregate: HashMap<String, Vec<i64>> = HashMap::new();
    for r in &rows {
        let aggregate = r.aggregate_id.clone().unwrap();
        by_aggregate.entry(aggregate).or_default().push(version(r));
    }
    assert_eq!(by_aggregate.len(), AGGREGATES);
    let by_id: HashMap<String, &RowState> = rows.iter().map(|r| (r.id.to_string(), r)).collect();
    let mut arrived: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen = HashSet::new();
    for d in rabbit.deliveries() {
        if seen.insert(d.message_id.clone()) {
            let body: Value = serde_json::from_slice(&d.body).unwrap();
            let row = by_id[&d.message_id];
            let aggregate = arrived.entry(row.aggregate_id.clone().unwrap());
            aggregate
                .or_default()
                .push(body["version"].as_i64().unwrap());
        }
    }
    for (aggregate, in_seq_order) in &by_aggregate {
        let expected: Vec<i64> = (1..=in_seq_order.len() as i64).collect();
        assert_eq!(
            in_seq_order, &expected,
            "{aggregate}: versions in seq order"
        );
        assert_eq!(
            arrived[aggregate], expected,
            "{aggregate}: versions in arrival order"
        );
    }
    println!(
        "{test}: {} rows, {} ids delivered more than once, rows held at each kill \
         {held_at_death:?}",
        rows.len(),
        analysis.duplicated_ids().len()
    );
    for relay in slots {
        relay.stop().await;
    }
    outbox
        .exec(&format!("DROP TABLE {}_versions", outbox.name()))
        .await;
    rabbit.teardown().await;
    outbox.drop_table().await;
}

/// Transaction A writes row n of aggregate X and stays open; B writes n + 1 of X (and a row
/// of Y) and commits first. X's n + 1 never goes out while A is open (rows without aggregate
/// id, inserted meanwhile, show the relay claiming); once A commits, n arrives, then n + 1.
/// On MySQL only X waits: Y's row goes out while A is open. (PostgreSQL holds back every
/// aggregated row after n while A is open: docs/design.md, late commits.)
async fn a_late_commit_never_lets_a_later_row_of_its_aggregate_out_first(db: Db) {
    let test = format!("{}_late_commit", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-")).spawn();
    let x = |event, n| NewRow::new("order", Some("X"), event, json!({ "n": n }));

    let mut a = outbox.conn().await;
    a.begin().await;
    let first = a.insert(outbox.name(), &[x("first", 1)]).await[0];
    let later = outbox
        .insert(&[
            x("second", 2),
            NewRow::new("order", Some("Y"), "first", json!({})),
        ])
        .await;
    let (second, y) = (later[0], later[1]);
    assert!(first.seq < second.seq);
    if db == Db::Mysql {
        rabbit.wait_for_ids(&[y.id], WAIT).await;
    }
    // Two rows without aggregate id, each inserted after the previous one arrived: claims run
    // while A is open.
    for n in 0..2 {
        let free = NewRow::new("order", None, "free", json!({ "n": n }));
        let free = outbox.insert_ids(&[free]).await;
        rabbit.wait_for_ids(&free, WAIT).await;
    }
    let why = "X's n + 1 went out while the transaction holding n was open";
    assert_eq!(delivered(&rabbit, second.id), 0, "{why}");
    assert_eq!(outbox.row(second.id).await.status, "pending");

    a.commit().await;
    let both = [first.id, second.id];
    rabbit
        .wait_for_ids(&[first.id, second.id, y.id], WAIT)
        .await;
    assert_eq!(rabbit.arrival_order(&both), both, "n arrives before n + 1");
    outbox.wait_all_sent(WAIT).await;
    finish(relay, outbox, rabbit).await;
}

/// A transaction that wrote to another table and stays open holds back no outbox row: rows of
/// several aggregates inserted after it began are all delivered, in order, while it is open.
async fn a_long_transaction_on_another_table_holds_nothing_back(db: Db) {
    let test = format!("{}_long_tx", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let other = format!("{}_other", outbox.name());
    outbox
        .exec(&format!(
            "CREATE TABLE {other} (id INT PRIMARY KEY, v INT NOT NULL)"
        ))
        .await;
    outbox
        .exec(&format!("INSERT INTO {other} VALUES (1, 0)"))
        .await;
    let mut long = outbox.conn().await;
    long.begin().await;
    long.exec(&format!("UPDATE {other} SET v = v + 1 WHERE id = 1"))
        .await;

    let relay = relay(&outbox, &rabbit, &test.replace('_', "-")).spawn();
    let ids = outbox
        .insert_ids(&NewRow::numbered(40, "order", Some(("o-", 4)), "created"))
        .await;
    let more = outbox
        .insert_ids(&NewRow::numbered(10, "order", Some(("o-", 4)), "updated"))
        .await;
    rabbit.wait_for_ids(&[ids, more].concat(), WAIT).await;
    outbox.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    rabbit
        .analyse(&outbox.rows().await)
        .assert_exactly_once(&test);
    // Still open all along: it commits now.
    long.commit().await;
    outbox.exec(&format!("DROP TABLE {other}")).await;
    finish(relay, outbox, rabbit).await;
}

// ---- outages ----------------------------------------------------------------------------------

/// Rows dead-lettered or left with a spent attempt (`pending` with attempts > 0).
const SPENT: &str = "status = 'failed' OR (status = 'pending' AND attempts > 0)";

/// The service whose connections [`connection_cut`] cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    Broker,
    Database,
}

async fn a_broker_cut_spends_no_attempt_and_loses_nothing(db: Db) {
    connection_cut(db, Cut::Broker).await;
}

async fn a_database_cut_spends_no_attempt_and_loses_nothing(db: Db) {
    connection_cut(db, Cut::Database).await;
}

/// Every relay connection to RabbitMQ (with publishes unconfirmed: the proxy stalls first), or
/// to the outbox's database, goes through a proxy that cuts it while a writer keeps
/// inserting: the relay says it lost the service, spends no attempt and dead-letters nothing
/// for the outage (3 s, checked every 100 ms), comes back through the proxy once it heals,
/// and every row is sent on its one attempt and delivered, in order per aggregate.
async fn connection_cut(db: Db, cut: Cut) {
    let test = format!("{}_{cut:?}_cut", db.tag()).to_lowercase();
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let (proxy, key, url, (down, up)) = match cut {
        Cut::Broker => {
            let proxy = Proxy::start(RABBIT_ADDR).await;
            let url = proxy.amqp_url();
            let logs = ("broker unavailable", "connected to the broker");
            (proxy, "publisher.rabbitmq.url", url, logs)
        }
        Cut::Database => {
            let proxy = Proxy::start(db.addr()).await;
            let url = db.url_via(proxy.addr());
            let logs = ("database unavailable", "database connection restored");
            (proxy, "database.url", url, logs)
        }
    };
    // A lease longer than the test: rows in flight at the cut come back only by being handed
    // back. max_attempts 2: an outage counted as a failure would dead-letter rows.
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-"))
        .set(key, url)
        .set("relay.lease_timeout", "600s")
        .set("retry.base_delay", "100ms")
        .set("retry.max_attempts", "2")
        .spawn();
    let writer = spawn_steady_writer(&outbox, "cut");
    wait_for_count(WAIT, "200 messages before the cut", 200, || rabbit.count()).await;
    let (downs, ups) = (relay.log_count(down), relay.log_count(up));
    if cut == Cut::Broker {
        // Publishes written, confirms held: rows are in flight when the connection drops.
        proxy.stall();
        let what = "rows are in flight when the connection is cut";
        wait_until(WAIT, what, async || {
            match outbox.count_where("status = 'processing'").await {
                0 => Err("none processing".to_owned()),
                n => Ok(n),
            }
        })
        .await;
    }
    let sessions = proxy.accepted();
    proxy.cut();
    relay
        .wait_for_log(down, downs + 1, Duration::from_secs(30))
        .await;
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(3) {
        let spent = outbox.count_where(SPENT).await;
        assert_eq!(spent, 0, "the outage spent attempts:\n{}", relay.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let piled_up = outbox.count_where("status <> 'sent'").await;
    assert!(piled_up > 0, "rows should pile up during the outage");
    proxy.heal();
    relay.wait_for_log(up, ups + 1, WAIT).await;
    let written = stop_writer(writer).await;
    outbox.wait_all_sent(WAIT).await;
    rabbit.barrier().await;

    let rows = outbox.rows().await;
    assert_eq!(rows.len(), written);
    assert_none("rows not sent with attempts = 1", &not_sent_once(&rows));
    let analysis = rabbit.analyse(&rows);
    analysis.assert_complete(&test);
    let why = format!("no new session through the proxy after the cut ({sessions})");
    assert!(proxy.accepted() > sessions, "{why}");
    println!(
        "{test}: {} rows, {piled_up} unsent at the heal, {} ids delivered more than once",
        rows.len(),
        analysis.duplicated_ids().len()
    );
    finish(relay, outbox, rabbit).await;
}

// ---- dead letters, status, gauges -------------------------------------------------------------

/// Polls `/metrics` until `name{outbox=<table>, extra…}` is `want`.
async fn wait_gauge(port: u16, outbox: &TestOutbox, name: &str, extra: &[(&str, &str)], want: f64) {
    let mut labels = vec![("outbox", outbox.name())];
    labels.extend_from_slice(extra);
    wait_for_sample(port, WAIT, name, &labels, |v| v == want).await;
}

/// Only `ok.#` is bound: a row routed to `nowhere.x` is returned and, after two attempts,
/// dead-lettered. It holds back the row behind it in its aggregate (pending, no attempt
/// spent) and nothing else. `dead-letters list`, `status` (JSON and the human table) and the
/// gauges (`outbox_failed_messages`, `outbox_blocked_aggregates`,
/// `outbox_dead_lettered_total`, `outbox_pending_messages` as `status` counts it) show it;
/// once the route exists, `dead-letters retry` sends it, then the row behind it, and the
/// counts and gauges go back to zero.
async fn dead_letters_are_counted_shown_and_retried_in_order(db: Db) {
    let test = format!("{}_dead", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "ok.#").await;
    let port = free_port();
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-"))
        .set("retry.max_attempts", "2")
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    let rows = outbox
        .insert(&[
            NewRow::new("acct", Some("x"), "e", json!({ "poison": true })).destination("nowhere.x"),
            NewRow::new("acct", Some("x"), "e", json!({ "after": 1 })).destination("ok.x"),
            NewRow::new("acct", Some("y"), "e", json!({ "other": 1 })).destination("ok.y"),
        ])
        .await;
    let (dead, behind, other) = (rows[0].id, rows[1].id, rows[2].id);
    rabbit.wait_for_ids(&[other], WAIT).await;
    let what = "the unroutable row is dead-lettered";
    let row = outbox
        .wait_row(dead, WAIT, what, |r| r.status == "failed")
        .await;
    assert_eq!(row.attempts, 2, "{row:?}");
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains("NO_ROUTE"), "{error:?}");
    // The row behind may have been claimed with the head's last attempt and handed back
    // when the head failed: it ends pending, handed back (no attempt spent).
    let what = "the row behind the dead letter is pending with no attempt spent";
    let handed_back = |r: &RowState| r.status == "pending" && r.attempts == 0;
    outbox.wait_row(behind, WAIT, what, handed_back).await;
    assert_eq!(
        delivered(&rabbit, behind),
        0,
        "a row behind a dead letter went out"
    );

    let listed = json_of(outbox.operator(), &["dead-letters", "list", "--json"]).await;
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["id"], dead.to_string());
    assert_eq!(listed[0]["attempts"], 2);
    let status = json_of(outbox.operator(), &["status", "--json"]).await;
    for (key, want) in [
        ("sent", 1),
        ("failed", 1),
        ("pending", 1),
        ("blocked_aggregates", 1),
    ] {
        assert_eq!(status[key], want, "{key} in {status}");
    }
    assert_eq!(
        status["by_aggregate_type"]["acct"]["blocked_aggregates"], 1,
        "{status}"
    );
    let human = outbox.operator().output(&["status"], WAIT).await;
    assert!(human.status.success(), "{}", human.stderr);
    let total: Vec<&str> = human
        .stdout
        .lines()
        .find(|l| l.starts_with("TOTAL"))
        .unwrap_or_else(|| panic!("no TOTAL line:\n{}", human.stdout))
        .split_whitespace()
        .collect();
    // TOTAL pending ready waiting processing sent failed expired blocked oldest
    assert_eq!(
        total[1..9],
        ["1", "1", "0", "0", "1", "1", "0", "1"],
        "{}",
        human.stdout
    );

    // The gauges agree.
    wait_gauge(port, &outbox, names::FAILED, &[], 1.0).await;
    wait_gauge(port, &outbox, names::BLOCKED_AGGREGATES, &[], 1.0).await;
    wait_gauge(port, &outbox, names::DEAD_LETTERED, &[], 1.0).await;
    let ready = status["ready"].as_f64().unwrap();
    let waiting = status["waiting"].as_f64().unwrap();
    wait_gauge(port, &outbox, names::PENDING, &[("state", "ready")], ready).await;
    wait_gauge(
        port,
        &outbox,
        names::PENDING,
        &[("state", "waiting")],
        waiting,
    )
    .await;

    // All or nothing: with an id that is no dead letter (unknown, or the pending row behind
    // it) beside it, neither command changes anything and both name that id.
    for verb in ["retry", "discard"] {
        for other in [Uuid::new_v4(), behind] {
            let (dead, other) = (dead.to_string(), other.to_string());
            let args = ["dead-letters", verb, "--id", &dead, "--id", &other];
            let out = outbox.operator().output(&args, WAIT).await;
            assert_eq!(out.status.code(), Some(1), "{verb}: {out:?}");
            assert!(
                out.stderr.contains("nothing was changed") && out.stderr.contains(&other),
                "{verb}: {}",
                out.stderr
            );
        }
    }
    assert_eq!(outbox.row(dead).await.status, "failed");

    // Routable now: the dead letter is retried, then the row behind it goes out.
    rabbit.bind("nowhere.#").await;
    let retry = outbox
        .operator()
        .output(&["dead-letters", "retry", "--id", &dead.to_string()], WAIT)
        .await;
    assert!(retry.status.success(), "{}", retry.stderr);
    rabbit.wait_for_ids(&[dead, behind], WAIT).await;
    assert_eq!(rabbit.arrival_order(&[dead, behind]), [dead, behind]);
    outbox.wait_all_sent(WAIT).await;
    let status = json_of(outbox.operator(), &["status", "--json"]).await;
    for (key, want) in [
        ("sent", 3),
        ("failed", 0),
        ("pending", 0),
        ("blocked_aggregates", 0),
    ] {
        assert_eq!(status[key], want, "{key} in {status}");
    }
    wait_gauge(port, &outbox, names::FAILED, &[], 0.0).await;
    wait_gauge(port, &outbox, names::BLOCKED_AGGREGATES, &[], 0.0).await;
    let listed = json_of(outbox.operator(), &["dead-letters", "list", "--json"]).await;
    assert_eq!(listed, json!([]));
    finish(relay, outbox, rabbit).await;
}

/// A relay whose broker refuses connections claims nothing; rows inserted meanwhile show in
/// `outbox_pending_messages{state="ready"}` and `outbox_oldest_ready_age_seconds`, with no
/// attempt spent.
async fn rows_waiting_for_an_unreachable_broker_show_in_the_backlog_gauges(db: Db) {
    let outbox = TestOutbox::new(db, &format!("{}_backlog", db.tag())).await;
    let (port, closed) = (free_port(), free_port());
    // Nothing listens on `closed`: the relay never connects, so it never claims.
    let relay = outbox
        .relay(&format!("{}-backlog", db.tag()))
        .set(
            "publisher.rabbitmq.url",
            format!("amqp://guest:guest@127.0.0.1:{closed}/%2f"),
        )
        .set("publisher.rabbitmq.exchange", "it.backlog.unreachable")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    wait_gauge(port, &outbox, names::PENDING, &[("state", "ready")], 0.0).await;
    relay
        .wait_for_log("broker unavailable; not claiming rows", 1, WAIT)
        .await;
    outbox
        .insert(&NewRow::numbered(5, "order", Some(("o", 5)), "created"))
        .await;
    wait_gauge(port, &outbox, names::PENDING, &[("state", "ready")], 5.0).await;
    let labels = [("outbox", outbox.name())];
    wait_for_sample(port, WAIT, names::OLDEST_READY_AGE, &labels, |v| v > 0.0).await;
    let text = scrape(port).await.unwrap();
    let waiting = [("outbox", outbox.name()), ("state", "waiting")];
    assert_eq!(sample(&text, names::PENDING, &waiting), Some(0.0), "{text}");
    assert_eq!(
        outbox.count_where("attempts = 0").await,
        5,
        "nothing was claimed"
    );
    relay.stop().await;
    outbox.drop_table().await;
}

/// `secs` from now (negative: ago) as an SQL timestamp expression of `db`.
fn from_now(db: Db, secs: f64) -> String {
    match db {
        Db::Postgres => format!("now() + make_interval(secs => {secs})"),
        Db::Mysql => format!("TIMESTAMPADD(MICROSECOND, {}, NOW(6))", (secs * 1e6) as i64),
    }
}

/// Inserts a row of aggregate `order`/`id` in `status`, created `age` seconds ago and ready
/// `ready_in` seconds from now (negative: since then); a `failed` row has 5 attempts.
async fn insert_state(outbox: &TestOutbox, id: &str, status: &str, age: f64, ready_in: f64) {
    let (attempts, error) = match status {
        "failed" => (5, "'rejected'"),
        _ => (0, "NULL"),
    };
    outbox
        .exec(&format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, \
               attempts, last_error, created_at, available_at) \
             VALUES ('order', '{id}', 'gauge.event', '{{\"gauge\": true}}', '{status}', \
               {attempts}, {error}, {}, {})",
            outbox.name(),
            from_now(outbox.db(), -age),
            from_now(outbox.db(), ready_in),
        ))
        .await;
}

/// The ready age (the lag alerts use) counts only rows a claim would take now: with ordering
/// `aggregate` no row behind a dead letter, behind a row in flight or behind its own head
/// backing off; a row's age counts from the end of its backoff. The store's own figures.
async fn the_ready_age_counts_only_rows_a_claim_would_take_now(db: Db) {
    let outbox = TestOutbox::new(db, &format!("{}_ready_age", db.tag())).await;
    // A dead letter with two followers ready for 600 s: its aggregate is blocked.
    insert_state(&outbox, "dead", "failed", 900.0, -900.0).await;
    insert_state(&outbox, "dead", "pending", 600.0, -600.0).await;
    insert_state(&outbox, "dead", "pending", 600.0, -600.0).await;
    // Behind a row in flight (another relay's) for 400 s.
    insert_state(&outbox, "busy", "processing", 450.0, -450.0).await;
    insert_state(&outbox, "busy", "pending", 400.0, -400.0).await;
    // Behind its own head backing off for another 300 s.
    insert_state(&outbox, "slow", "pending", 350.0, 300.0).await;
    insert_state(&outbox, "slow", "pending", 300.0, -300.0).await;
    let mut raw = outbox_relay::config::RawConfig::default();
    raw.database.url = db.url().to_owned();
    raw.database.table = Some(outbox.name().to_owned());
    raw.metrics.listen = String::new();
    let config = raw.validate().unwrap();
    let store = outbox_relay::store::Store::new(&config.database, "gauges").unwrap();
    let backlog = |ordering| {
        let store = &store;
        async move { store.backlog(ordering).await.unwrap() }
    };
    let ordered = backlog(Ordering::Aggregate).await;
    assert_eq!(
        ordered.oldest_ready_age, 0.0,
        "nothing is claimable: {ordered:?}"
    );
    assert_eq!(
        (ordered.failed, ordered.blocked_aggregates),
        (1, 1),
        "{ordered:?}"
    );
    assert_eq!((ordered.ready, ordered.waiting), (4, 1), "{ordered:?}");
    assert!(
        (ordered.oldest_waiting_age - 350.0).abs() < 5.0,
        "{ordered:?}"
    );
    assert!(
        (ordered.oldest_pending_age - 600.0).abs() < 5.0,
        "{ordered:?}"
    );
    // Without ordering every ready row is claimable: the oldest has waited 600 s.
    let none = backlog(Ordering::None).await;
    assert!((none.oldest_ready_age - 600.0).abs() < 5.0, "{none:?}");
    // A claimable row, ready for 20 s since its backoff ended: the ready age is its own.
    insert_state(&outbox, "free", "pending", 100.0, -20.0).await;
    let ordered = backlog(Ordering::Aggregate).await;
    assert!((ordered.oldest_ready_age - 20.0).abs() < 5.0, "{ordered:?}");
    outbox.drop_table().await;
}

/// A row written `processing` by hand, without `locked_at` (no relay leaves one so), counts
/// as a lease run out: it is reclaimed, published, and the row of its aggregate behind it
/// follows in order instead of waiting for ever.
async fn a_row_left_processing_without_a_lock_time_is_reclaimed_in_order(db: Db) {
    let test = format!("{}_no_lock_time", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    insert_state(&outbox, "orphan", "processing", 60.0, -60.0).await;
    let behind = outbox
        .insert_one(NewRow::order(Some("orphan"), "behind"))
        .await;
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-"))
        .set("relay.lease_timeout", "1s")
        .spawn();
    outbox.wait_all_sent(WAIT).await;
    let rows = outbox.rows().await;
    let orphan = rows
        .iter()
        .find(|r| r.id != behind)
        .expect("the orphan row");
    assert_eq!(
        (orphan.status.as_str(), orphan.attempts),
        ("sent", 1),
        "{orphan:?}"
    );
    rabbit.wait_for_ids(&[orphan.id, behind], WAIT).await;
    assert_eq!(
        rabbit.arrival_order(&[orphan.id, behind]),
        [orphan.id, behind]
    );
    finish(relay, outbox, rabbit).await;
}

// ---- expiry -----------------------------------------------------------------------------------

/// Aggregate a-1 in order: a head whose deadline passed, a row without a deadline, one with a
/// deadline an hour away; a row without aggregate id that expired. The live rows go out in
/// order (the one with a deadline carrying the AMQP `expiration` left), the others end
/// `expired` with a `last_error` saying when, never published, counted by
/// `outbox_expired_total` and `status`.
async fn a_row_past_its_deadline_is_expired_unpublished_and_frees_its_aggregate(db: Db) {
    let test = format!("{}_expiry", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let head = outbox
        .insert_one(NewRow::order(Some("a-1"), "first").expires_in(-1.0))
        .await;
    let second = outbox
        .insert_one(NewRow::order(Some("a-1"), "second"))
        .await;
    let third = outbox
        .insert_one(NewRow::order(Some("a-1"), "third").expires_in(3600.0))
        .await;
    let loose = outbox
        .insert_one(NewRow::order(None, "loose").expires_in(-0.001))
        .await;
    let port = free_port();
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-"))
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();

    outbox.wait_count("status = 'sent'", 2, WAIT).await;
    rabbit.wait_for_ids(&[second, third], WAIT).await;
    rabbit.barrier().await;
    let ids: Vec<String> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| d.message_id)
        .collect();
    let why = "only the rows before their deadline go out, in seq order";
    assert_eq!(ids, [second.to_string(), third.to_string()], "{why}");
    for id in [head, loose] {
        let row = outbox.row(id).await;
        assert_eq!(row.status, "expired", "{row:?}");
        let error = row.last_error.unwrap_or_default();
        assert!(
            error.starts_with("expired: its deadline 20") && error.contains("passed before"),
            "last_error says when it expired: {error:?}"
        );
    }
    let expiration = |id: Uuid| {
        let deliveries = rabbit.deliveries();
        let d = deliveries.iter().find(|d| d.message_id == id.to_string());
        d.unwrap().properties.expiration().clone()
    };
    assert_eq!(expiration(second), None);
    let ms: u64 = expiration(third).unwrap().as_str().parse().unwrap();
    let why = format!("expiration {ms} ms for a deadline an hour away");
    assert!((3_500_000..=3_600_000).contains(&ms), "{why}");

    let labels = [("outbox", outbox.name())];
    let expired = wait_for_sample(port, WAIT, names::EXPIRED, &labels, |n| n >= 2.0).await;
    assert_eq!(expired, 2.0);
    let v = json_of(outbox.operator(), &["status", "--json"]).await;
    assert_eq!(v["expired"], 2, "{v}");
    assert_eq!(v["sent"], 2, "{v}");
    assert_eq!(v["by_aggregate_type"]["order"]["expired"], 2, "{v}");
    relay.wait_for_log("passed their expires_at", 1, WAIT).await;
    finish(relay, outbox, rabbit).await;
}

// ---- roles ------------------------------------------------------------------------------------

/// The MySQL users' passwords (PostgreSQL trusts loopback logins).
const APP_PASSWORD: &str = "app-secret";
const RELAY_PASSWORD: &str = "relay-secret";

/// An application role and a relay role on `db` with the grants the docs give them
/// (docs/security.md for PostgreSQL, docs/mysql.md for MySQL) on one outbox table.
struct Roles {
    db: Db,
    app: String,
    relay: String,
}

impl Roles {
    async fn create(outbox: &TestOutbox) -> Self {
        let (db, t) = (outbox.db(), outbox.name());
        let suffix = hex8();
        let (app, relay) = (format!("it_app_{suffix}"), format!("it_relay_{suffix}"));
        let statements = match db {
            Db::Postgres => vec![
                format!("CREATE ROLE {app} LOGIN"),
                format!("GRANT INSERT ON {t} TO {app}"),
                format!("GRANT USAGE ON SEQUENCE {t}_seq TO {app}"),
                format!("CREATE ROLE {relay} LOGIN"),
                format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {t}, {t}_waiters TO {relay}"),
                format!("GRANT SELECT ON outbox_relay_schema_version TO {relay}"),
                format!("GRANT USAGE, SELECT ON SEQUENCE {t}_seq TO {relay}"),
                format!("GRANT EXECUTE ON FUNCTION {t}_next_seq(), {t}_wakeup() TO {relay}"),
            ],
            Db::Mysql => vec![
                format!(
                    "CREATE USER '{app}'@'127.0.0.1' IDENTIFIED BY '{}'",
                    APP_PASSWORD
                ),
                format!("GRANT INSERT ON test.{t} TO '{app}'@'127.0.0.1'"),
                format!(
                    "CREATE USER '{relay}'@'127.0.0.1' IDENTIFIED BY '{}'",
                    RELAY_PASSWORD
                ),
                format!(
                    "GRANT SELECT, INSERT, UPDATE, DELETE ON test.{t} TO '{relay}'@'127.0.0.1'"
                ),
                format!(
                    "GRANT SELECT ON test.outbox_relay_schema_version TO '{relay}'@'127.0.0.1'"
                ),
            ],
        };
        for sql in statements {
            outbox.exec(&sql).await;
        }
        Self { db, app, relay }
    }

    fn app_url(&self) -> String {
        self.db.url_as(&self.app, APP_PASSWORD)
    }

    fn relay_url(&self) -> String {
        self.db.url_as(&self.relay, RELAY_PASSWORD)
    }

    /// Drops both roles and what they were granted (after their sessions ended).
    async fn drop_roles(self, outbox: &TestOutbox) {
        for role in [&self.app, &self.relay] {
            let sql = match self.db {
                Db::Postgres => format!("DROP OWNED BY {role}; DROP ROLE {role}"),
                Db::Mysql => format!("DROP USER '{role}'@'127.0.0.1'"),
            };
            outbox.exec(&sql).await;
        }
    }
}

/// With the documented grants only: the application, which may only insert (not even read
/// the table), writes rows with the contract's plain `INSERT`, the same text on both
/// databases, in its own transaction; a relay running as the relay role (not the table's
/// owner, `auto_migrate = false`) sends them, `status` and `check` work as that role, and
/// `check` refuses it once `UPDATE` and `DELETE` are revoked (and `run`'s claims say why).
async fn the_documented_roles_are_enough_for_the_application_and_the_relay(db: Db) {
    let test = format!("{}_roles", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let roles = Roles::create(&outbox).await;
    let relay = relay(&outbox, &rabbit, &test.replace('_', "-"))
        .set("database.url", roles.relay_url())
        .spawn();

    let mut app: DbConn = db.connect_to(&roles.app_url()).await.unwrap();
    let read = format!("SELECT count(*) FROM {}", outbox.name());
    let denied = app.try_query_i64(&read).await.unwrap_err();
    assert!(denied.to_lowercase().contains("denied"), "{denied}");
    app.begin().await;
    for i in 0..3 {
        let insert = format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('priv', 'p-{}', 'made', '{{\"i\": {i}}}')",
            outbox.name(),
            i % 2
        );
        app.exec(&insert).await;
    }
    app.commit().await;
    drop(app);

    outbox.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    assert_eq!(outbox.count_where("status = 'sent'").await, 3);
    rabbit
        .analyse(&outbox.rows().await)
        .assert_exactly_once(&test);
    let as_relay = outbox.operator().set("database.url", roles.relay_url());
    let status = json_of(as_relay, &["status", "--json"]).await;
    assert_eq!(status["sent"], 3, "{status}");
    relay.stop().await;

    // `check` as the relay role passes; without UPDATE and DELETE it fails and names them,
    // where `run` could only retry its claims.
    let check = async |url: String| {
        let builder = outbox.operator().set("database.url", url);
        builder.output(&["check"], WAIT).await
    };
    let out = check(roles.relay_url()).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    let t = outbox.name();
    let revoke = match db {
        Db::Postgres => format!("REVOKE UPDATE, DELETE ON {t} FROM {}", roles.relay),
        Db::Mysql => format!(
            "REVOKE UPDATE, DELETE ON test.{t} FROM '{}'@'127.0.0.1'",
            roles.relay
        ),
    };
    outbox.exec(&revoke).await;
    let out = check(roles.relay_url()).await;
    assert!(!out.status.success(), "{}", out.stdout);
    out.assert_stdout_has(&format!(
        "the relay's user may not update or delete rows of {t}"
    ));
    // Each database's grants are listed in its own document.
    let grants_doc = match db {
        Db::Postgres => "grant what docs/security.md lists for the relay",
        Db::Mysql => "grant what docs/mysql.md lists for the relay",
    };
    out.assert_stdout_has(grants_doc);
    // `run` as that role says the same of its claims, not that the database is down.
    let insert = format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('priv', 'p-9', 'made', '{{}}')"
    );
    outbox.exec(&insert).await;
    let denied = self::relay(
        &outbox,
        &rabbit,
        &format!("{}-denied", test.replace('_', "-")),
    )
    .set("database.url", roles.relay_url())
    .spawn();
    let said = "its user lacks a privilege on the table";
    denied.wait_for_log(said, 1, WAIT).await;
    assert!(denied.stderr().contains(grants_doc), "{}", denied.stderr());
    assert!(
        !denied.stderr().contains("database unavailable"),
        "{}",
        denied.stderr()
    );
    denied.stop().await;
    roles.drop_roles(&outbox).await;
    rabbit.teardown().await;
    outbox.drop_table().await;
}

// ---- one relay per instance id -----------------------------------------------------------------

/// How relay `instance`'s lock on `table` is named in SQL, as docs/operations.md gives it:
/// PostgreSQL's advisory-lock key, MySQL's lock name.
fn instance_lock(db: Db, instance: &str, table: &str) -> String {
    match db {
        Db::Postgres => format!("hashtextextended('outbox-relay:{instance}:public.{table}', 0)"),
        Db::Mysql => {
            format!("CONCAT('outbox-relay:', LEFT(SHA2('{instance}:test.{table}', 256), 48))")
        }
    }
}

/// The session holding relay `instance`'s lock on `outbox`, if any: PostgreSQL's backend pid
/// (`pg_locks` shows a `bigint` key's high half in `classid`, its low half in `objid`),
/// MySQL's connection id.
async fn instance_lock_holder(outbox: &TestOutbox, instance: &str) -> Option<i64> {
    let lock = instance_lock(outbox.db(), instance, outbox.name());
    let sql = match outbox.db() {
        Db::Postgres => format!(
            "SELECT COALESCE((SELECT l.pid FROM pg_locks l, (SELECT {lock} AS key) k \
               WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                 AND l.classid = ((k.key >> 32) & 4294967295)::oid \
                 AND l.objid = (k.key & 4294967295)::oid), 0)::bigint"
        ),
        Db::Mysql => format!("SELECT COALESCE(IS_USED_LOCK({lock}), 0)"),
    };
    let holder = outbox.conn().await.query_i64(&sql).await;
    (holder != 0).then_some(holder)
}

/// How the relay's refusal names session `holder`.
fn lock_session(db: Db, holder: i64) -> String {
    match db {
        Db::Postgres => format!("backend pid {holder}"),
        Db::Mysql => format!("connection id {holder}"),
    }
}

/// Ends the relay's lock session `holder` from `conn` and takes relay `instance`'s lock on
/// `table` in its place (waiting for that session to go).
async fn take_instance_lock(conn: &mut DbConn, db: Db, instance: &str, table: &str, holder: i64) {
    let lock = instance_lock(db, instance, table);
    match db {
        Db::Postgres => {
            let end = format!("SELECT pg_terminate_backend({holder})::int::bigint");
            assert_eq!(
                conn.query_i64(&end).await,
                1,
                "the relay's lock session ends"
            );
            conn.exec(&format!("SELECT pg_advisory_lock({lock})")).await;
        }
        Db::Mysql => {
            conn.exec(&format!("KILL {holder}")).await;
            let taken = conn
                .query_i64(&format!("SELECT GET_LOCK({lock}, 60)"))
                .await;
            assert_eq!(taken, 1, "the test's session takes the lock");
        }
    }
}

/// A second relay with the `relay.instance_id` of a running one, for the same table, refuses
/// to start: exit 1, its last line one sentence naming the id, the table, the database, the
/// session that holds the lock and what to do; `check` with that id says so too. The first
/// keeps relaying; once it stops, the id is free.
async fn a_second_relay_with_the_same_instance_id_refuses_to_start(db: Db) {
    let test = format!("{}_same_id", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let instance = format!("{}-same-id-{}", db.tag(), hex8());
    let spawn = || relay(&outbox, &rabbit, &instance).spawn();
    let first = spawn();
    let row = NewRow::new("order", Some("o-1"), "created", json!({}));
    let id = outbox.insert_ids(std::slice::from_ref(&row)).await;
    rabbit.wait_for_ids(&id, WAIT).await;
    let holder = instance_lock_holder(&outbox, &instance).await;
    let holder = holder.expect("the running relay holds its instance lock");

    let mut second = spawn();
    let status = second.wait_exit(WAIT).await;
    let stderr = second.stderr();
    assert_eq!(status.code(), Some(1), "the second relay runs: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let sentence = format!(
        "outbox-relay: another relay with relay.instance_id \"{instance}\" serves {} in {} (its session: {}",
        outbox.name(),
        db.url(),
        lock_session(db, holder)
    );
    assert!(last.starts_with(&sentence), "{last}");
    let what_to_do = "give every relay its own relay.instance_id (left unset it is the host \
                      name and pid), or stop the other relay first";
    assert!(last.ends_with(what_to_do), "{last}");
    // `check` with that id makes the same decision, and leaves the lock to the first relay.
    let check = relay(&outbox, &rabbit, &instance)
        .output(&["check"], WAIT)
        .await;
    assert_eq!(check.status.code(), Some(1), "{}", check.stdout);
    check.assert_stdout_has("`run` would refuse to start");
    check.assert_stdout_has(what_to_do);
    let still = instance_lock_holder(&outbox, &instance).await;
    assert_eq!(still, Some(holder), "check took the running relay's lock");

    let id = outbox.insert_ids(std::slice::from_ref(&row)).await;
    rabbit.wait_for_ids(&id, WAIT).await;
    first.stop().await;
    // Stopped, the first relay's session is gone: the id is free again.
    let third = spawn();
    let id = outbox.insert_ids(&[row]).await;
    rabbit.wait_for_ids(&id, WAIT).await;
    finish(third, outbox, rabbit).await;
}

/// The relay's instance lock session is ended by the database (`pg_terminate_backend`,
/// `KILL`), and another session takes the lock before the relay can: the relay stops claiming
/// and says so (rows wait, `/readyz` fails); once that session lets go, it takes the lock
/// again and carries on.
async fn a_relay_that_lost_its_instance_lock_stops_claiming_until_it_takes_it_again(db: Db) {
    let test = format!("{}_lock_lost", db.tag());
    let (outbox, rabbit) = outbox_and_exchange(db, &test, "#").await;
    let instance = format!("{}-lock-lost-{}", db.tag(), hex8());
    let port = free_port();
    let relay = relay(&outbox, &rabbit, &instance)
        .set("metrics.listen", local(port).to_string())
        .spawn();
    let row = NewRow::new("order", Some("o-1"), "created", json!({}));
    let id = outbox.insert_ids(std::slice::from_ref(&row)).await;
    rabbit.wait_for_ids(&id, WAIT).await;
    let holder = instance_lock_holder(&outbox, &instance).await.unwrap();

    let mut other = db.connect().await;
    take_instance_lock(&mut other, db, &instance, outbox.name(), holder).await;
    let said = "another relay took this relay's instance lock";
    relay.wait_for_log(said, 1, WAIT).await;
    let ready = async || match http_get(local(port), "/readyz").await {
        Ok((200, _)) => Ok(()),
        other => Err(format!("{other:?}")),
    };
    let not_ready = async || match ready().await {
        Ok(()) => Err("200".to_owned()),
        Err(e) => Ok(e),
    };
    wait_until(WAIT, "/readyz fails while the lock is elsewhere", not_ready).await;
    let waiting = outbox.insert_ids(&[row]).await[0];
    // Ten polls: a relay that claimed would have sent it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = outbox.row(waiting).await.status;
    assert_eq!(status, "pending", "claimed without the instance lock");

    other.close().await; // its session ends, and the lock with it
    relay
        .wait_for_log("took the instance locks again", 1, WAIT)
        .await;
    rabbit.wait_for_ids(&[waiting], WAIT).await;
    wait_until(WAIT, "/readyz answers 200 again", ready).await;
    finish(relay, outbox, rabbit).await;
}

// ---- both at once -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_serves_a_postgresql_and_a_mysql_outbox() {
    let pg = TestOutbox::new(Db::Postgres, "mixed_pg").await;
    let my = TestOutbox::new(Db::Mysql, "mixed_my").await;
    let rabbit = RabbitFixture::new("mixed", "#", "barrier").await;
    let port = free_port();
    let dir = TempDir::new("mixed");
    let file = dir.write(
        "relay.toml",
        &format!(
            "[database]\nurl = \"{PG_URL}\"\nauto_migrate = false\n\
             [relay]\ninstance_id = \"mixed\"\npoll_interval = \"100ms\"\n\
             [metrics]\nlisten = \"127.0.0.1:{port}\"\n\
             [publisher]\nkind = \"rabbitmq\"\n[publisher.rabbitmq]\nurl = \"{AMQP_URL}\"\nexchange = \"{}\"\n\
             [[outboxes]]\nname = \"billing\"\ntable = \"{}\"\n\
             [[outboxes]]\nname = \"orders\"\ntable = \"{}\"\nurl = \"{MYSQL_URL}\"\n",
            rabbit.exchange,
            pg.name(),
            my.name()
        ),
    );
    let file = file.to_string_lossy().into_owned();
    let relay = RelayBuilder::bare("mixed").spawn_with(&["--config", &file, "run"]);
    let pg_ids = pg
        .insert_ids(&NewRow::numbered(50, "invoice", Some(("i", 5)), "created"))
        .await;
    let my_ids = my
        .insert_ids(&NewRow::numbered(50, "order", Some(("o", 5)), "created"))
        .await;
    rabbit.wait_for_ids(&pg_ids, WAIT).await;
    rabbit.wait_for_ids(&my_ids, WAIT).await;
    pg.wait_all_sent(WAIT).await;
    my.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let rows = [pg.rows().await, my.rows().await].concat();
    rabbit.analyse(&rows).assert_exactly_once("both outboxes");
    // Each outbox's messages carry its own table's source.
    let sources: HashMap<String, String> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| {
            (
                d.message_id.clone(),
                d.headers()["cloudEvents:source"].clone(),
            )
        })
        .collect();
    for (outbox, ids) in [(&pg, &pg_ids), (&my, &my_ids)] {
        for id in ids {
            assert_eq!(sources[&id.to_string()], outbox.default_source());
        }
    }
    let status = RelayBuilder::bare("mixed-op")
        .output(&["--config", &file, "status", "--json"], WAIT)
        .await;
    assert!(status.status.success(), "{}", status.stderr);
    let counts: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(counts["sent"], 100, "{counts}");
    assert_eq!(counts["by_outbox"]["orders"]["sent"], 50, "{counts}");
    assert_eq!(counts["by_outbox"]["billing"]["sent"], 50, "{counts}");
    // One /metrics, each outbox under its own name.
    for outbox in ["orders", "billing"] {
        let labels = [("outbox", outbox)];
        wait_for_sample(port, WAIT, names::PUBLISHED, &labels, |n| n == 50.0).await;
    }

    relay.stop().await;
    rabbit.teardown().await;
    pg.drop_table().await;
    my.drop_table().await;
}
