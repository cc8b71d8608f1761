//! MySQL and MariaDB outboxes (docs/mysql.md), end to end against the local MariaDB and
//! RabbitMQ: the real binary, each test on its own table and exchange. Delivery with the
//! envelope and per-aggregate order from concurrent writers, out-of-order commits holding back
//! only their own aggregate, a long transaction on another table holding back nothing, the
//! application's inserts never waiting on the relay's locks, dead letters listed, counted and
//! retried, replicas killed with SIGKILL mid-drain, and a PostgreSQL and a MySQL outbox served
//! by one relay.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    AMQP_URL, MYSQL_URL, MysqlTable, NewRow, PG_URL, RabbitFixture, RelayBuilder, TempDir,
    TestTable, assert_none, mysql_conn,
};
use mysql_async::TxOpts;
use mysql_async::prelude::Queryable;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(120);

async fn table_and_exchange(test: &str) -> (MysqlTable, RabbitFixture) {
    let table = MysqlTable::new(test).await;
    let rabbit = RabbitFixture::new(test, "#", "barrier").await;
    (table, rabbit)
}

fn relay(table: &MysqlTable, rabbit: &RabbitFixture, instance: &str) -> RelayBuilder {
    RelayBuilder::for_mysql(table, instance)
        .set("publisher.rabbitmq.url", AMQP_URL)
        .set("publisher.rabbitmq.exchange", &rabbit.exchange)
        .set("relay.ordering", "aggregate")
        .set("relay.poll_interval", "100ms")
}

/// Inserts `rows_each` rows per writer from `writers` connections, one row per transaction,
/// aggregates `k0`..`k<aggregates>`.
async fn concurrent_inserts(
    table: &MysqlTable,
    writers: usize,
    rows_each: usize,
    aggregates: usize,
) {
    let mut set = JoinSet::new();
    for w in 0..writers {
        let name = table.name.clone();
        set.spawn(async move {
            let mut conn = mysql_conn().await;
            for i in 0..rows_each {
                let k = format!("k{}", (w * rows_each + i) % aggregates);
                let row = NewRow::new(
                    "order",
                    Some(&k),
                    "order.changed",
                    json!({ "w": w, "i": i }),
                )
                .headers(json!({ "tenant": "t1" }));
                common::mysql::insert_in(&mut conn, &name, &[row]).await;
            }
        });
    }
    set.join_all().await;
}

#[tokio::test]
async fn rows_from_concurrent_writers_arrive_once_in_order_with_the_envelope() {
    let (table, rabbit) = table_and_exchange("my_delivery").await;
    let relay = relay(&table, &rabbit, "my-delivery").spawn();
    concurrent_inserts(&table, 4, 250, 40).await;
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), 1000);
    let analysis = rabbit.analyse(&rows);
    analysis.assert_complete("MySQL outbox");
    analysis.assert_exactly_once("MySQL outbox");
    let attempts: Vec<_> = rows
        .iter()
        .filter(|r| r.attempts != 1)
        .map(|r| r.id)
        .collect();
    assert_none("rows sent with other than one attempt", &attempts);

    // The envelope: CloudEvents attributes from the row, the default source naming the
    // database and the table, the row's headers, the JSON body as inserted.
    let first = &rows[0];
    let d = rabbit.wait_for_delivery(first.id, WAIT).await;
    let h = d.headers();
    assert_eq!(h["cloudEvents:id"], first.id.to_string());
    assert_eq!(h["cloudEvents:type"], "order.changed");
    assert_eq!(
        h["cloudEvents:subject"],
        first.aggregate_id.clone().unwrap()
    );
    assert_eq!(h["cloudEvents:aggregatetype"], "order");
    assert_eq!(
        h["cloudEvents:source"],
        format!("/outbox/test/{}", table.name)
    );
    assert_eq!(h["tenant"], "t1");
    assert_eq!(d.routing_key, "order.order.changed");
    let body: Value = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(body, first.payload);
    assert_eq!(
        d.properties.content_type().as_ref().map(|c| c.as_str()),
        Some("application/json")
    );

    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

/// Deliveries of `id`s so far.
fn delivered(rabbit: &RabbitFixture, id: Uuid) -> usize {
    rabbit
        .id_counts()
        .get(&id.to_string())
        .copied()
        .unwrap_or(0)
}

#[tokio::test]
async fn an_uncommitted_earlier_row_holds_back_only_its_own_aggregate() {
    let (table, rabbit) = table_and_exchange("my_out_of_order").await;
    let relay = relay(&table, &rabbit, "my-ooo").spawn();

    // T1 writes a1 (aggregate a) and stays open; a long transaction on another table stays
    // open beside it, holding a row lock.
    let mut t1_conn = mysql_conn().await;
    let mut t1 = t1_conn.start_transaction(TxOpts::default()).await.unwrap();
    let a1 = common::mysql::insert_in(
        &mut t1,
        &table.name,
        &[NewRow::new("acct", Some("a"), "first", json!({ "n": 1 }))],
    )
    .await[0];
    let other = format!("{}_other", table.name);
    let mut setup = mysql_conn().await;
    setup
        .query_drop(format!(
            "CREATE TABLE {other} (id INT PRIMARY KEY, v INT) ENGINE = InnoDB"
        ))
        .await
        .unwrap();
    setup
        .query_drop(format!("INSERT INTO {other} VALUES (1, 0)"))
        .await
        .unwrap();
    let mut long_conn = mysql_conn().await;
    let mut long = long_conn
        .start_transaction(TxOpts::default())
        .await
        .unwrap();
    long.query_drop(format!("UPDATE {other} SET v = v + 1 WHERE id = 1"))
        .await
        .unwrap();

    // T2 writes a2 (after a1) and b1, and commits first.
    let later = table
        .insert(&[
            NewRow::new("acct", Some("a"), "second", json!({ "n": 2 })),
            NewRow::new("acct", Some("b"), "first", json!({ "n": 1 })),
        ])
        .await;
    let (a2, b1) = (later[0], later[1]);
    assert!(a1.seq < a2.seq);
    rabbit.wait_for_ids(&[b1.id], WAIT).await;
    // More rows of other aggregates go out meanwhile: the relay is claiming, not stalled.
    let c = table
        .insert(&[NewRow::new("acct", Some("c"), "first", json!({}))])
        .await[0];
    rabbit.wait_for_ids(&[c.id], WAIT).await;
    let c2 = table
        .insert(&[NewRow::new("acct", Some("c"), "second", json!({}))])
        .await[0];
    rabbit.wait_for_ids(&[c2.id], WAIT).await;
    assert_eq!(
        delivered(&rabbit, a2.id),
        0,
        "a2 went out while a1, earlier in its aggregate, was uncommitted"
    );
    assert_eq!(table.row(a2.id).await.status, "pending");

    // T1 commits: a1, then a2. The long transaction is still open and holds nothing back.
    t1.commit().await.unwrap();
    rabbit.wait_for_ids(&[a1.id, a2.id], WAIT).await;
    rabbit.barrier().await;
    let order: Vec<String> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| d.message_id)
        .filter(|id| *id == a1.id.to_string() || *id == a2.id.to_string())
        .collect();
    assert_eq!(order, vec![a1.id.to_string(), a2.id.to_string()]);
    long.rollback().await.unwrap();

    relay.stop().await;
    setup
        .query_drop(format!("DROP TABLE {other}"))
        .await
        .unwrap();
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn application_inserts_never_wait_for_the_relays_locks() {
    let (table, rabbit) = table_and_exchange("my_no_wait").await;
    // A backlog to drain with ordering aggregate while the application keeps inserting.
    concurrent_inserts(&table, 2, 1000, 200).await;
    let relay = relay(&table, &rabbit, "my-no-wait").spawn();

    // 2,000 single-row commits from 4 connections into the aggregates being drained. Each
    // session gives up on a lock after 1 s: an insert that waited that long for the relay
    // would fail here.
    let took = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut set = JoinSet::new();
    for w in 0..4 {
        let (name, took) = (table.name.clone(), Arc::clone(&took));
        set.spawn(async move {
            let mut conn = mysql_conn().await;
            conn.query_drop("SET SESSION innodb_lock_wait_timeout = 1")
                .await
                .unwrap();
            for i in 0..500 {
                let k = format!("k{}", (w * 500 + i) % 200);
                let row = NewRow::new("order", Some(&k), "app.insert", json!({ "w": w, "i": i }));
                let started = Instant::now();
                let mut tx = conn.start_transaction(TxOpts::default()).await.unwrap();
                common::mysql::insert_in(&mut tx, &name, &[row]).await;
                tx.commit().await.unwrap();
                took.lock().unwrap().push(started.elapsed());
            }
        });
    }
    set.join_all().await;
    let mut took = took.lock().unwrap().clone();
    took.sort();
    let pct = |p: usize| took[(took.len() * p / 100).min(took.len() - 1)];
    eprintln!(
        "application commits beside an ordered drain: n={} p50={:?} p99={:?} max={:?}",
        took.len(),
        pct(50),
        pct(99),
        took.last().unwrap()
    );
    assert_eq!(took.len(), 2000, "every application insert committed");
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let rows = table.rows().await;
    rabbit
        .analyse(&rows)
        .assert_complete("drain beside the application");

    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn dead_letters_are_listed_counted_and_retried() {
    let table = MysqlTable::new("my_dead").await;
    // Only `ok.#` is bound: a row routed elsewhere is returned (unroutable) and rejected.
    let rabbit = RabbitFixture::new("my_dead", "ok.#", "ok.barrier").await;
    let relay = relay(&table, &rabbit, "my-dead")
        .set("retry.max_attempts", "2")
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .spawn();
    let rows = table
        .insert(&[
            NewRow::new("acct", Some("x"), "e", json!({ "poison": true })).destination("nowhere.x"),
            NewRow::new("acct", Some("x"), "e", json!({ "after": 1 })).destination("ok.x"),
            NewRow::new("acct", Some("y"), "e", json!({ "other": 1 })).destination("ok.y"),
        ])
        .await;
    let (dead, behind, other) = (rows[0], rows[1], rows[2]);
    rabbit.wait_for_ids(&[other.id], WAIT).await;
    table.wait_count("status = 'failed'", 1, WAIT).await;
    let row = table.row(dead.id).await;
    assert_eq!(row.attempts, 2);
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("unroutable")
            || row
                .last_error
                .as_deref()
                .unwrap_or_default()
                .contains("NO_ROUTE"),
        "{:?}",
        row.last_error
    );
    // The row behind it in its aggregate waits; the other aggregate went out.
    assert_eq!(table.row(behind.id).await.status, "pending");
    assert_eq!(delivered(&rabbit, behind.id), 0);

    let operator = || {
        RelayBuilder::bare("my-dead-op")
            .set("database.url", MYSQL_URL)
            .set("database.table", &table.name)
    };
    let list = operator()
        .output(&["dead-letters", "list", "--json"], WAIT)
        .await;
    assert!(list.status.success(), "{}", list.stderr);
    let listed: Value = serde_json::from_str(&list.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed[0]["id"], dead.id.to_string());
    assert_eq!(listed[0]["attempts"], 2);
    let status = operator().output(&["status", "--json"], WAIT).await;
    assert!(status.status.success(), "{}", status.stderr);
    let counts: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(counts["failed"], 1, "{counts}");
    assert_eq!(counts["blocked_aggregates"], 1, "{counts}");
    assert_eq!(counts["pending"], 1, "{counts}");
    assert_eq!(counts["sent"], 1, "{counts}");

    // Make the route deliverable, retry: the dead letter goes out, then the row behind it.
    rabbit.bind("nowhere.#").await;
    let retry = operator()
        .output(&["dead-letters", "retry", "--all"], WAIT)
        .await;
    assert!(retry.status.success(), "{}", retry.stderr);
    rabbit.wait_for_ids(&[dead.id, behind.id], WAIT).await;
    table.wait_all_sent(WAIT).await;
    let arrived: Vec<String> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| d.message_id)
        .filter(|id| *id == dead.id.to_string() || *id == behind.id.to_string())
        .collect();
    assert_eq!(arrived, vec![dead.id.to_string(), behind.id.to_string()]);

    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn sigkilled_replicas_lose_nothing_and_keep_aggregate_order() {
    let (table, rabbit) = table_and_exchange("my_sigkill").await;
    let spawn = |instance: &str| {
        relay(&table, &rabbit, instance)
            .set("relay.lease_timeout", "2s")
            .set("retry.max_attempts", "100")
            .spawn()
    };
    let mut slots = vec![spawn("my-k0a"), spawn("my-k0b")];
    let writers = {
        let t = MysqlTable {
            name: table.name.clone(),
        };
        tokio::spawn(async move { concurrent_inserts(&t, 4, 750, 300).await })
    };
    for k in 0..4 {
        tokio::time::sleep(Duration::from_millis(400 + 300 * k)).await;
        let slot = k as usize % 2;
        slots[slot].sigkill();
        let status = slots[slot].wait_exit(Duration::from_secs(10)).await;
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        slots[slot] = spawn(&format!("my-k{}{}", k + 1, ["a", "b"][slot]));
    }
    writers.await.unwrap();
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let rows = table.rows().await;
    assert_eq!(rows.len(), 3000);
    let analysis = rabbit.analyse(&rows);
    analysis.assert_complete("MySQL outbox under SIGKILL");
    eprintln!("duplicates after 4 kills: {}", analysis.duplicates);
    for relay in slots {
        relay.stop().await;
    }
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn one_relay_serves_a_postgresql_and_a_mysql_outbox() {
    let pg = TestTable::new("my_mixed_pg").await;
    let my = MysqlTable::new("my_mixed_my").await;
    let rabbit = RabbitFixture::new("my_mixed", "#", "barrier").await;
    let dir = TempDir::new("my-mixed");
    let file = dir.write(
        "relay.toml",
        &format!(
            "[database]\nurl = \"{PG_URL}\"\nauto_migrate = false\n\
             [relay]\ninstance_id = \"my-mixed\"\npoll_interval = \"100ms\"\n\
             [metrics]\nlisten = \"\"\n\
             [publisher]\nkind = \"rabbitmq\"\n[publisher.rabbitmq]\nurl = \"{AMQP_URL}\"\nexchange = \"{}\"\n\
             [[outboxes]]\nname = \"billing\"\ntable = \"{}\"\n\
             [[outboxes]]\nname = \"orders\"\ntable = \"{}\"\nurl = \"{MYSQL_URL}\"\n",
            rabbit.exchange, pg.name, my.name
        ),
    );
    let file = file.to_string_lossy().into_owned();
    let relay = RelayBuilder::bare("my-mixed").spawn_with(&["--config", &file, "run"]);
    let pg_ids = pg
        .insert_ids(&NewRow::numbered(50, "invoice", Some(("i", 5)), "created"))
        .await;
    let my_rows = my
        .insert(&NewRow::numbered(50, "order", Some(("o", 5)), "created"))
        .await;
    let my_ids: Vec<Uuid> = my_rows.iter().map(|r| r.id).collect();
    rabbit.wait_for_ids(&pg_ids, WAIT).await;
    rabbit.wait_for_ids(&my_ids, WAIT).await;
    pg.wait_all_sent(WAIT).await;
    my.wait_all_sent(WAIT).await;
    // Each outbox's messages carry its own database's source.
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
    assert_eq!(
        sources[&my_ids[0].to_string()],
        format!("/outbox/test/{}", my.name)
    );
    assert_eq!(
        sources[&pg_ids[0].to_string()],
        format!("/outbox/test/{}", pg.name)
    );
    let status = RelayBuilder::bare("my-mixed-op")
        .output(&["--config", &file, "status", "--json"], WAIT)
        .await;
    assert!(status.status.success(), "{}", status.stderr);
    let counts: Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(counts["sent"], 100, "{counts}");
    assert_eq!(counts["by_outbox"]["orders"]["sent"], 50, "{counts}");

    relay.stop().await;
    rabbit.teardown().await;
    pg.drop_table().await;
    my.drop_table().await;
}

#[tokio::test]
async fn migrate_check_and_bad_configuration_on_mysql() {
    let table = MysqlTable::new("my_ops").await;
    let op = || {
        RelayBuilder::bare("my-ops")
            .set("database.url", MYSQL_URL)
            .set("database.table", &table.name)
    };
    // migrate is idempotent and --print shows the MySQL DDL for the table.
    let again = op().output(&["migrate"], WAIT).await;
    assert!(again.status.success(), "{}", again.stderr);
    assert!(again.stdout.contains("is up to date"), "{}", again.stdout);
    let print = op().output(&["migrate", "--print"], WAIT).await;
    assert!(
        print
            .stdout
            .contains(&format!("CREATE TABLE IF NOT EXISTS {} (", table.name))
            && print.stdout.contains("AUTO_INCREMENT"),
        "{}",
        print.stdout
    );
    // partition_interval is PostgreSQL's: a configuration error naming the key.
    let partitioned = op()
        .set("database.partition_interval", "1h")
        .output(&["check"], WAIT)
        .await;
    assert_eq!(partitioned.status.code(), Some(2), "{}", partitioned.stderr);
    assert!(
        partitioned.stderr.contains("database.partition_interval"),
        "{}",
        partitioned.stderr
    );
    // A table that is not an outbox is named column by column.
    let mut conn = mysql_conn().await;
    let foreign = format!("{}_foreign", table.name);
    conn.query_drop(format!(
        "CREATE TABLE {foreign} (seq BIGINT PRIMARY KEY, payload JSON)"
    ))
    .await
    .unwrap();
    let out = RelayBuilder::bare("my-ops")
        .set("database.url", MYSQL_URL)
        .set("database.table", &foreign)
        .set("publisher.kind", "stdout")
        .output(&["check"], WAIT)
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stdout.contains("no column id") && out.stdout.contains("no column status"),
        "{}",
        out.stdout
    );
    conn.query_drop(format!("DROP TABLE {foreign}"))
        .await
        .unwrap();
    table.drop_table().await;
}

#[tokio::test]
async fn expired_rows_are_never_published_and_hold_nothing_back() {
    let (table, rabbit) = table_and_exchange("my_expiry").await;
    let rows = table
        .insert(&[
            NewRow::new("acct", Some("e"), "stale", json!({ "late": true })),
            NewRow::new("acct", Some("e"), "fresh", json!({ "n": 2 })),
        ])
        .await;
    let (stale, fresh) = (rows[0], rows[1]);
    let mut conn = mysql_conn().await;
    conn.query_drop(format!(
        "UPDATE {} SET expires_at = NOW(6) - INTERVAL 1 SECOND WHERE seq = {}",
        table.name, stale.seq
    ))
    .await
    .unwrap();
    let relay = relay(&table, &rabbit, "my-expiry").spawn();
    rabbit.wait_for_ids(&[fresh.id], WAIT).await;
    table.wait_count("status = 'expired'", 1, WAIT).await;
    rabbit.barrier().await;
    assert_eq!(delivered(&rabbit, stale.id), 0, "an expired row went out");
    let row = table.row(stale.id).await;
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .starts_with("expired: its deadline"),
        "{:?}",
        row.last_error
    );
    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn the_documented_grants_are_enough_for_the_relay_and_the_application() {
    let (table, rabbit) = table_and_exchange("my_grants").await;
    let suffix = &table.name[table.name.len() - 8..];
    let (app, relay_user) = (format!("app_{suffix}"), format!("relay_{suffix}"));
    let mut root = mysql_conn().await;
    // The GRANTs of docs/mysql.md, for this test's table.
    for sql in [
        format!("CREATE USER '{app}'@'127.0.0.1' IDENTIFIED BY 'app-secret'"),
        format!("GRANT INSERT ON test.{} TO '{app}'@'127.0.0.1'", table.name),
        format!("CREATE USER '{relay_user}'@'127.0.0.1' IDENTIFIED BY 'relay-secret'"),
        format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON test.{} TO '{relay_user}'@'127.0.0.1'",
            table.name
        ),
        format!("GRANT SELECT ON test.outbox_relay_schema_version TO '{relay_user}'@'127.0.0.1'"),
    ] {
        root.query_drop(sql).await.unwrap();
    }
    let relay_url = format!("mysql://{relay_user}:relay-secret@127.0.0.1:3306/test");
    let relay = relay(&table, &rabbit, "my-grants")
        .set("database.url", &relay_url)
        .spawn();
    // The application inserts with INSERT alone.
    let app_url = format!("mysql://{app}:app-secret@127.0.0.1:3306/test");
    let mut app_conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&app_url).unwrap())
        .await
        .unwrap();
    app_conn
        .query_drop(format!(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('acct', 'g', 'created', '{{\"ok\": true}}')",
            table.name
        ))
        .await
        .unwrap();
    drop(app_conn);
    table.wait_all_sent(WAIT).await;
    assert_eq!(rabbit.count(), 1);
    relay.stop().await;
    for user in [&app, &relay_user] {
        root.query_drop(format!("DROP USER '{user}'@'127.0.0.1'"))
            .await
            .unwrap();
    }
    rabbit.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn the_console_reads_a_mysql_outbox() {
    let table = MysqlTable::new("my_console").await;
    let rabbit = RabbitFixture::new("my_console", "ok.#", "ok.barrier").await;
    let port = common::free_port();
    let relay = relay(&table, &rabbit, "my-console")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .set("retry.max_attempts", "1")
        .spawn();
    let rows = table
        .insert(&[
            NewRow::new("acct", Some("s"), "e", json!({ "fine": 1 })).destination("ok.s"),
            NewRow::new("acct", Some("d"), "e", json!({ "poison": 1 })).destination("nowhere.d"),
        ])
        .await;
    let (sent, dead) = (rows[0], rows[1]);
    table.wait_count("status = 'sent'", 1, WAIT).await;
    table.wait_count("status = 'failed'", 1, WAIT).await;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let get = |path: String| async move { common::http_get(addr, &path).await.unwrap() };
    let (status, overview) = get("/api/overview".into()).await;
    assert_eq!(status, 200, "{overview}");
    let overview: Value = serde_json::from_str(&overview).unwrap();
    assert_eq!(
        overview["outboxes"][0]["name"],
        table.name.as_str(),
        "{overview}"
    );
    let (status, page) = get(format!("/api/outboxes/{}/dead-letters", table.name)).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(&dead.id.to_string()), "{page}");
    assert!(page.contains("poison"), "the dead letter's payload: {page}");
    let (status, message) = get(format!("/api/messages/{}", sent.id)).await;
    assert_eq!(status, 200, "{message}");
    assert!(message.contains("sent"), "{message}");
    let (status, _) = get(format!("/api/messages/{}", Uuid::new_v4())).await;
    assert_eq!(status, 404);
    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

/// The name of relay `instance`'s instance lock on table `test.<table>`, as docs/operations.md
/// gives it.
fn lock_name_sql(instance: &str, table: &str) -> String {
    format!("CONCAT('outbox-relay:', LEFT(SHA2('{instance}:test.{table}', 256), 48))")
}

/// The connection holding relay `instance`'s lock on `table`, if any.
async fn lock_holder(conn: &mut mysql_async::Conn, instance: &str, table: &str) -> Option<i64> {
    let sql = format!("SELECT IS_USED_LOCK({})", lock_name_sql(instance, table));
    conn.query_first::<Option<i64>, _>(sql)
        .await
        .unwrap()
        .flatten()
}

/// A second relay with the `relay.instance_id` of a running one, for the same MySQL table,
/// refuses to start with the sentence naming the id, the table and the connection that holds
/// the lock; once the first stops, the id is free.
#[tokio::test]
async fn a_second_relay_with_the_same_instance_id_refuses_to_start() {
    let (table, rabbit) = table_and_exchange("my_same_id").await;
    let instance = format!("my-same-id-{}", common::hex8());
    let spawn = || relay(&table, &rabbit, &instance).spawn();
    let first = spawn();
    let row = NewRow::new("order", Some("o-1"), "created", json!({}));
    let id = table.insert(std::slice::from_ref(&row)).await[0].id;
    rabbit.wait_for_ids(&[id], WAIT).await;
    let mut conn = mysql_conn().await;
    let holder = lock_holder(&mut conn, &instance, &table.name).await;
    assert!(
        holder.is_some(),
        "the running relay holds its instance lock"
    );

    let mut second = spawn();
    let status = second.wait_exit(WAIT).await;
    let stderr = second.stderr();
    assert_eq!(status.code(), Some(1), "the second relay runs: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let sentence = format!(
        "outbox-relay: another relay with relay.instance_id \"{instance}\" serves {} in {MYSQL_URL} (its session: connection id {}",
        table.name,
        holder.unwrap()
    );
    assert!(last.starts_with(&sentence), "{last}");
    assert!(last.ends_with("or stop the other relay first"), "{last}");

    first.stop().await;
    // Stopped, the first relay's connection is gone: the id is free again.
    let third = spawn();
    let id = table.insert(&[row]).await[0].id;
    rabbit.wait_for_ids(&[id], WAIT).await;
    third.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

/// The relay's lock connection is killed and another session takes the lock before the relay
/// can: the relay stops claiming and says so; once that session lets go, it takes the lock
/// again and carries on.
#[tokio::test]
async fn a_relay_that_lost_its_instance_lock_stops_claiming_until_it_takes_it_again() {
    let (table, rabbit) = table_and_exchange("my_lock_lost").await;
    let instance = format!("my-lock-lost-{}", common::hex8());
    let relay = relay(&table, &rabbit, &instance).spawn();
    let row = NewRow::new("order", Some("o-1"), "created", json!({}));
    let id = table.insert(std::slice::from_ref(&row)).await[0].id;
    rabbit.wait_for_ids(&[id], WAIT).await;
    let mut other = mysql_conn().await;
    let holder = lock_holder(&mut other, &instance, &table.name)
        .await
        .unwrap();

    other.query_drop(format!("KILL {holder}")).await.unwrap();
    let take = format!(
        "SELECT GET_LOCK({}, 60)",
        lock_name_sql(&instance, &table.name)
    );
    let taken: Option<i64> = other.query_first(take).await.unwrap().flatten();
    assert_eq!(taken, Some(1), "the test's session takes the lock");
    relay
        .wait_for_log("another relay took this relay's instance lock", 1, WAIT)
        .await;
    let waiting = table.insert(&[row]).await[0].id;
    // Twenty polls: a relay that claimed would have sent it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        table.row(waiting).await.status,
        "pending",
        "claimed without the instance lock"
    );

    other.disconnect().await.unwrap(); // the lock goes with the connection
    relay
        .wait_for_log("took the instance locks again", 1, WAIT)
        .await;
    rabbit.wait_for_ids(&[waiting], WAIT).await;
    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}
