//! What only MySQL and MariaDB outboxes have (docs/mysql.md), end to end against the local
//! MariaDB and RabbitMQ: the application's inserts never waiting on the relay's locks,
//! `migrate`, `check` and bad configuration (a table that is not an outbox table refused by
//! both), the console reading a MySQL outbox, and TLS
//! (`ssl-mode`) against a server without it. The relay's scenarios that are the same on both
//! databases are written once in `both_databases.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{AMQP_URL, MYSQL_URL, MysqlTable, NewRow, RabbitFixture, RelayBuilder, mysql_conn};
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
    // A name MySQL reserves fails at the server, with what to do.
    let reserved = op()
        .set("database.table", "order")
        .output(&["migrate"], WAIT)
        .await;
    assert_eq!(reserved.status.code(), Some(1), "{}", reserved.stderr);
    assert!(
        reserved.stderr.contains("pick another name"),
        "{}",
        reserved.stderr
    );
    // `check` makes start-up's decision: with auto_migrate, a table start-up could not
    // create (a reserved name, a database that does not exist) fails, naming why.
    for (name, says) in [
        ("order", "pick another name for database.table"),
        (
            "no_such_db.my_ops",
            "database no_such_db (of database.table no_such_db.my_ops) does not exist",
        ),
    ] {
        let out = op()
            .set("database.table", name)
            .set("database.auto_migrate", "true")
            .set("publisher.kind", "stdout")
            .output(&["check"], WAIT)
            .await;
        assert_eq!(out.status.code(), Some(1), "{name}: {out:?}");
        assert!(out.stdout.contains(says), "{name}: {}", out.stdout);
    }
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
    // `migrate` says so too, rather than that it applied a version (its CREATE TABLE IF NOT
    // EXISTS left the table as it was), and records none for it.
    let out = RelayBuilder::bare("my-ops")
        .set("database.url", MYSQL_URL)
        .set("database.table", &foreign)
        .output(&["migrate"], WAIT)
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stdout);
    assert!(
        out.stderr.contains("is not an outbox table"),
        "{}",
        out.stderr
    );
    let recorded: Option<i64> = conn
        .exec_first(
            "SELECT COUNT(*) FROM outbox_relay_schema_version WHERE table_name = ?",
            (&foreign,),
        )
        .await
        .unwrap();
    assert_eq!(recorded, Some(0), "a version was recorded for {foreign}");
    conn.query_drop(format!("DROP TABLE {foreign}"))
        .await
        .unwrap();
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

/// `ssl-mode=REQUIRED` asks for TLS. This MariaDB has none (`have_ssl` is `DISABLED`): the
/// relay must not fall back to plain text. `check` fails naming TLS, and `run` exits at start
/// naming it instead of relaying in the clear. (Were the server to offer TLS, both would
/// succeed over it.)
#[tokio::test]
async fn ssl_mode_required_against_a_server_without_tls_fails_naming_tls() {
    let mut conn = mysql_conn().await;
    let have_ssl: Option<(String, String)> = conn
        .query_first("SHOW VARIABLES LIKE 'have_ssl'")
        .await
        .unwrap();
    let tls_offered = have_ssl.is_some_and(|(_, v)| v.eq_ignore_ascii_case("YES"));
    let table = MysqlTable::new("my_tls").await;
    let url = format!("{MYSQL_URL}?ssl-mode=REQUIRED");
    let relay = || {
        RelayBuilder::bare("my-tls")
            .set("database.url", &url)
            .set("database.table", &table.name)
            .set("database.auto_migrate", "false")
            .set("publisher.kind", "stdout")
            .set("metrics.listen", "")
    };
    let check = relay().output(&["check"], WAIT).await;
    let check_out = format!("{}\n{}", check.stdout, check.stderr);
    // Without TLS on offer `run` must exit at start (a relay that waited the server out
    // would be killed after WAIT and reported).
    let run = if tls_offered {
        None
    } else {
        let mut run = relay().spawn();
        let status = run.wait_exit(WAIT).await;
        Some((status, run.stderr()))
    };
    table.drop_table().await;
    let names_tls = |text: &str| text.contains("TLS");
    match run {
        None => assert!(check.status.success(), "{check_out}"),
        Some((status, stderr)) => {
            assert!(
                !check.status.success(),
                "check passed without TLS:\n{check_out}"
            );
            let why = format!("check's failure does not name TLS:\n{check_out}");
            assert!(names_tls(&check_out), "{why}");
            assert!(!status.success(), "run went on without TLS:\n{stderr}");
            let why = format!("run's failure does not name TLS:\n{stderr}");
            assert!(names_tls(&stderr), "{why}");
        }
    }
}

/// A relay stopped in the middle of a claim (SIGSTOP, as a paused VM or a host cut off) holds
/// the row locks of its open transaction, which holds every other relay back. The server drops
/// its silent session after the relay's idle limit (a minute), rolling the claim back, and
/// another relay drains the table; with the server's default limit that took 8 hours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_frozen_in_a_claim_holds_the_others_back_for_a_minute_at_most() {
    let table = MysqlTable::new("my_frozen").await;
    let rows = NewRow::numbered(10_000, "order", Some(("k", 100)), "order.changed");
    table.insert(&rows).await;
    let relay = |label: &str| {
        RelayBuilder::for_mysql(&table, label)
            .set("publisher.kind", "stdout")
            .set("relay.ordering", "aggregate")
            .set("relay.batch_size", "50")
            .set("relay.max_in_flight", "100")
            .set("relay.lease_timeout", "10s")
            .set("relay.poll_interval", "100ms")
            .quiet()
    };
    let mut frozen = relay("my-frozen-a").spawn();
    // Stop it until it is caught holding a claim's locks: a locking read of the first pending
    // row that does not wait is refused then.
    let mut probe = mysql_conn().await;
    let first_pending = format!(
        "SELECT seq FROM {} WHERE status = 'pending' ORDER BY seq LIMIT 1 FOR UPDATE NOWAIT",
        table.name
    );
    common::wait_until(WAIT, "the relay is stopped inside a claim", async || {
        frozen.signal("STOP");
        let locked = probe
            .query_first::<i64, _>(first_pending.as_str())
            .await
            .is_err();
        if locked {
            return Ok(());
        }
        frozen.signal("CONT");
        tokio::time::sleep(Duration::from_millis(15)).await;
        Err("between claims".to_owned())
    })
    .await;
    assert!(table.count_where("status = 'pending'").await > 0);

    let other = relay("my-frozen-b").spawn();
    common::wait_until(
        Duration::from_secs(300),
        "the other relay sends every row",
        async || match table.count_where("status <> 'sent'").await {
            0 => Ok(()),
            n => Err(format!("{n} rows not sent")),
        },
    )
    .await;
    frozen.signal("CONT");
    frozen.sigkill();
    other.stop().await;
    table.drop_table().await;
}

/// Relays sharing a MySQL table take turns at ordered claims under the table's claim lock
/// (`GET_LOCK`, the statement checked in as `sql/statements/mysql/claim.lock.sql`): while
/// another session holds it, the relay waits for it, gives up the round and claims nothing;
/// once it is free, the relay drains the table and gives the lock back after each claim (an
/// idle relay leaves it free, so it is not kept on a pooled connection). A round that found
/// the lock taken is followed by another at once, not after a poll interval (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_claims_wait_for_the_tables_claim_lock_and_give_it_back() {
    let table = MysqlTable::new("my_claim_lock").await;
    table
        .insert(&NewRow::numbered(
            200,
            "order",
            Some(("k", 20)),
            "order.changed",
        ))
        .await;
    let take = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/sql/statements/mysql/claim.lock.sql"
    ))
    .unwrap();
    let key = take
        .trim()
        .strip_prefix("SELECT GET_LOCK(")
        .and_then(|k| k.strip_suffix(", ?)"))
        .expect("claim.lock.sql is SELECT GET_LOCK(<key>, ?)")
        .to_owned();
    let mut holder = mysql_conn().await;
    let taken: Option<i64> = holder
        .exec_first(take.trim(), (None::<String>, table.name.as_str(), 0))
        .await
        .unwrap();
    assert_eq!(taken, Some(1), "the test takes the claim lock first");

    let relay = RelayBuilder::for_mysql(&table, "my-claim-lock")
        .env("RUST_LOG", "outbox_relay=debug")
        .set("publisher.kind", "stdout")
        .set("relay.ordering", "aggregate")
        .set("relay.poll_interval", "1h")
        .quiet()
        .spawn();
    relay
        .wait_for_log(
            "held the table's claim lock; nothing claimed this round",
            1,
            WAIT,
        )
        .await;
    assert_eq!(
        table.count_where("status = 'pending'").await,
        200,
        "nothing is claimed while another session holds the claim lock"
    );

    holder
        .exec_drop(
            format!("DO RELEASE_LOCK({key})"),
            (None::<String>, table.name.as_str()),
        )
        .await
        .unwrap();
    table.wait_all_sent(WAIT).await;
    let mut watch = mysql_conn().await;
    let free = format!("SELECT IS_FREE_LOCK({key})");
    common::wait_until(
        WAIT,
        "the idle relay leaves the claim lock free",
        async || {
            let free: Option<i64> = watch
                .exec_first(free.as_str(), (None::<String>, table.name.as_str()))
                .await
                .map_err(|e| e.to_string())?;
            match free {
                Some(1) => Ok(()),
                other => Err(format!("IS_FREE_LOCK answered {other:?}")),
            }
        },
    )
    .await;
    relay.stop().await;
    table.drop_table().await;
}

/// Rows an application wrote that the relay cannot take as they are never stop the others:
/// a zero `created_at` (a server without `NO_ZERO_DATE` stores it) reads as the epoch and goes
/// out; NULL `headers` (a table that lets them be) are no headers; a NULL `event_type` (a
/// table that lets it be) is no message any transport could carry: it becomes a dead letter at
/// once, naming the column, while the rows around it go out and the database never counts as
/// down. `dead-letters list` shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_relay_cannot_take_as_they_are_never_stop_the_others() {
    let (table, rabbit) = table_and_exchange("my_odd_rows").await;
    let t = &table.name;
    table
        .execute(&format!(
            "ALTER TABLE {t} MODIFY headers JSON NULL, MODIFY event_type VARCHAR(255) NULL"
        ))
        .await;
    let mut conn = table.conn().await;
    conn.query_drop("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'")
        .await
        .unwrap();
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    // (aggregate, event_type, extra column, its value)
    let rows = [
        ("Z", "'zero.date'", "created_at", "'0000-00-00 00:00:00'"),
        ("N", "'null.headers'", "headers", "NULL"),
        ("E", "NULL", "headers", "'{}'"),
        ("F", "'fine'", "headers", "'{}'"),
    ];
    for (id, (agg, event, column, value)) in ids.iter().zip(rows) {
        let sql = format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, {column}) \
             VALUES ('{id}', 'order', '{agg}', {event}, '{{}}', {value})"
        );
        conn.query_drop(sql.as_str())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let port = common::free_port();
    let relay = relay(&table, &rabbit, "my-odd-rows")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    rabbit.wait_for_ids(&[ids[0], ids[1], ids[3]], WAIT).await;
    let dead = ids[2];
    let state = format!("SELECT status, attempts, last_error FROM {t} WHERE id = '{dead}'");
    let mut probe = table.conn().await;
    let (attempts, error) =
        common::wait_until(WAIT, "the unreadable row is a dead letter", async || {
            let (status, attempts, error): (String, i32, Option<String>) =
                probe.query_first(state.as_str()).await.unwrap().unwrap();
            match status.as_str() {
                "failed" => Ok((attempts, error.unwrap_or_default())),
                other => Err(other.to_owned()),
            }
        })
        .await;
    assert!(
        error.starts_with("the relay cannot read this row: column event_type"),
        "{error}"
    );
    assert_eq!(attempts, 0, "no attempt was spent on it");
    assert_eq!(relay.log_count("database unavailable"), 0);
    let addr = format!("127.0.0.1:{port}").parse().unwrap();
    let ready = common::http_get(addr, "/readyz").await.unwrap();
    assert_eq!(ready.0, 200, "{ready:?}");
    let listed = RelayBuilder::for_mysql(&table, "my-odd-rows-op")
        .output(&["dead-letters", "list", "--json"], WAIT)
        .await;
    assert!(listed.status.success(), "{}", listed.stderr);
    assert!(
        listed.stdout.contains(&dead.to_string()),
        "{}",
        listed.stdout
    );
    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}

/// A server that accepts connections but never answers: `check`, `status` and `dead-letters
/// list` each give up after `database.query_timeout`, saying so (exit 1), instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_against_a_server_that_never_answers_give_up_after_the_query_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let table = MysqlTable::new("my_silent").await;
    for args in [
        &["check"][..],
        &["status"][..],
        &["dead-letters", "list"][..],
    ] {
        let out = RelayBuilder::for_mysql(&table, "my-silent")
            .set(
                "database.url",
                format!("mysql://root@127.0.0.1:{port}/test"),
            )
            .set("database.query_timeout", "2s")
            .output(args, WAIT)
            .await;
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}{}",
            out.stdout,
            out.stderr
        );
        let said = format!("{}{}", out.stdout, out.stderr);
        assert!(
            said.contains("did not answer within 2s"),
            "{args:?}: {said}"
        );
    }
    silent.abort();
    table.drop_table().await;
}

/// Zero dates read the same whichever way the claim reads them: a row in an ordered claim's
/// second window (read by a statement sent as text, not prepared) and a row reclaimed from a
/// dead relay (claimed alone, also as text) go out, as one in the first window does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_dates_read_alike_in_every_claim() {
    let (table, rabbit) = table_and_exchange("my_zero_dates").await;
    let t = &table.name;
    // A first window (101 candidates at batch size 1) all behind a dead letter.
    table
        .insert(&NewRow::numbered(102, "order", Some(("A", 1)), "held"))
        .await;
    table
        .execute(&format!(
            "UPDATE {t} SET status = 'failed', last_error = 'x' ORDER BY seq LIMIT 1"
        ))
        .await;
    let mut conn = table.conn().await;
    conn.query_drop("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'")
        .await
        .unwrap();
    let (late, suspect) = (Uuid::new_v4(), Uuid::new_v4());
    for (id, agg, error) in [
        (late, "Z", "NULL"),
        (
            suspect,
            "S",
            "'lease expired: relay gone stopped while holding the row'",
        ),
    ] {
        let sql = format!(
            "INSERT INTO {t} (id, aggregate_type, aggregate_id, event_type, payload, created_at, \
             last_error) VALUES ('{id}', 'order', '{agg}', 'e', '{{}}', '0000-00-00 00:00:00', {error})"
        );
        conn.query_drop(sql.as_str())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let relay = relay(&table, &rabbit, "my-zero-dates")
        .set("relay.batch_size", "1")
        .spawn();
    rabbit.wait_for_ids(&[late, suspect], WAIT).await;
    assert_eq!(relay.log_count("database unavailable"), 0);
    assert_eq!(relay.log_count("cannot read"), 0);
    relay.stop().await;
    rabbit.teardown().await;
    table.drop_table().await;
}
