//! Messages that expire (contract §1, §2): schema version 2 applied in place to a version-1
//! table with rows pending and in flight; a row past its `expires_at` when it would be claimed
//! is `expired`, never published, counted and shown, and does not hold back its aggregate;
//! a row handed back by a broker outage expires when it is claimed anew; RabbitMQ messages of
//! rows with a deadline carry the AMQP `expiration` property; retention removes expired rows.
//!
//! The real binary against the local PostgreSQL and RabbitMQ, a table, exchange and queue per
//! test.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{
    PG_URL, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, TestTable, drop_both, finish, hex8,
    pg_connect, table_and_exchange, wait_until,
};
use outbox_relay::config::TableName;
use outbox_relay::store::schema::{self, MIGRATIONS};
use serde_json::Value;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// A port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// Inserts one row `(aggregate_type, aggregate_id, event_type)` whose `expires_at` is
/// `expires_in` seconds from the database's now (none when `None`); returns its id.
async fn insert_expiring(
    table: &TestTable,
    aggregate_id: Option<&str>,
    event_type: &str,
    expires_in: Option<f64>,
) -> Uuid {
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, expires_at) \
         VALUES ('order', $1, $2, '{{\"x\": 1}}'::jsonb, now() + $3::float8 * interval '1 second') \
         RETURNING id",
        table.name
    );
    table
        .db
        .query_one(&sql, &[&aggregate_id, &event_type, &expires_in])
        .await
        .unwrap_or_else(|e| panic!("insert into {}: {e}", table.name))
        .get(0)
}

/// `(status, last_error)` of every row, by id.
async fn states(table: &TestTable) -> HashMap<Uuid, (String, Option<String>)> {
    table
        .rows()
        .await
        .into_iter()
        .map(|r| (r.id, (r.status, r.last_error)))
        .collect()
}

fn relay(table: &TestTable, rabbit: &RabbitFixture, label: &str) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, label).set("relay.poll_interval", "200ms")
}

/// The `outbox_expired_total` sample of outbox `table` in a Prometheus text exposition.
fn expired_total(metrics: &str, table: &str) -> Option<f64> {
    let series = format!("outbox_expired_total{{outbox=\"{table}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

async fn scrape(port: u16) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut body = String::new();
    s.read_to_string(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    Ok(body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_past_its_deadline_is_expired_unpublished_and_frees_its_aggregate() {
    let (table, rabbit) = table_and_exchange("expiry_before_claim").await;
    // Aggregate a-1 in order: an expired head, then a row without a deadline, then one with a
    // deadline an hour away. A row without aggregate id that expired. Inserted before the
    // relay starts, so the first claim meets them all.
    let head = insert_expiring(&table, Some("a-1"), "first", Some(-1.0)).await;
    let second = insert_expiring(&table, Some("a-1"), "second", None).await;
    let third = insert_expiring(&table, Some("a-1"), "third", Some(3600.0)).await;
    let loose = insert_expiring(&table, None, "loose", Some(-0.001)).await;
    let port = free_port();
    let relay = relay(&table, &rabbit, "expiry-before-claim")
        .set("relay.ordering", "aggregate")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();

    rabbit.wait_for_ids(&[second, third], WAIT).await;
    // Delivered, then settled: wait for the settle too.
    // The two live rows are sent.
    table.wait_count("status = 'sent'", 2, WAIT).await;
    rabbit.barrier().await;
    let delivered: Vec<String> = rabbit
        .deliveries()
        .iter()
        .map(|d| d.message_id.clone())
        .collect();
    assert_eq!(
        delivered,
        [second.to_string(), third.to_string()],
        "only the rows before their deadline go out, in seq order"
    );
    let s = states(&table).await;
    for id in [head, loose] {
        let (status, error) = &s[&id];
        assert_eq!(status, "expired", "{id}");
        let error = error.as_deref().unwrap_or_default();
        assert!(
            error.starts_with("expired: its deadline 20") && error.contains("passed before"),
            "last_error says when it expired: {error:?}"
        );
    }
    assert_eq!(s[&second].0, "sent");
    assert_eq!(s[&third].0, "sent");

    // The AMQP expiration: the milliseconds left (about an hour) on the row with a deadline,
    // none on the row without.
    let by_id: HashMap<String, lapin::BasicProperties> = rabbit
        .deliveries()
        .into_iter()
        .map(|d| (d.message_id, d.properties))
        .collect();
    assert_eq!(by_id[&second.to_string()].expiration(), &None);
    let ms: u64 = by_id[&third.to_string()]
        .expiration()
        .as_ref()
        .expect("an expiration on the row with expires_at")
        .as_str()
        .parse()
        .expect("expiration is milliseconds as a string");
    assert!(
        (3_500_000..=3_600_000).contains(&ms),
        "expiration {ms} ms for a deadline an hour away"
    );

    // Counted and shown.
    let text = wait_until(WAIT, "outbox_expired_total reaches 2", async || {
        let text = scrape(port).await?;
        match expired_total(&text, &table.name) {
            Some(n) if n >= 2.0 => Ok(text),
            other => Err(format!("outbox_expired_total = {other:?}")),
        }
    })
    .await;
    assert_eq!(expired_total(&text, &table.name), Some(2.0));
    let out = RelayBuilder::bare("expiry-status")
        .set("database.url", PG_URL)
        .set("database.table", &table.name)
        .output(&["status", "--json"], WAIT)
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["expired"], 2, "{v}");
    assert_eq!(v["sent"], 2, "{v}");
    assert_eq!(v["by_aggregate_type"]["order"]["expired"], 2, "{v}");
    relay.wait_for_log("passed their expires_at", 1, WAIT).await;

    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_whose_deadline_passes_during_a_broker_outage_expires_instead_of_going_out_late() {
    let (table, rabbit) = table_and_exchange("expiry_outage").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let relay = relay(&table, &rabbit, "expiry-outage")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("relay.ordering", "aggregate")
        .set("publisher.rabbitmq.confirm_timeout", "30s")
        .spawn();
    relay.wait_for_log("connected to the broker", 1, WAIT).await;

    // Publishes go into a black hole: the rows are claimed before their deadline and wait.
    proxy.stall();
    let deadline_in = 3.0;
    let expiring = insert_expiring(&table, Some("b-1"), "expiring", Some(deadline_in)).await;
    let after = insert_expiring(&table, Some("b-1"), "after", None).await;
    let plain = insert_expiring(&table, Some("b-2"), "plain", None).await;
    wait_until(WAIT, "the expiring row is in flight", async || match table
        .row(expiring)
        .await
        .status
        .as_str()
    {
        "processing" => Ok(()),
        other => Err(other.to_owned()),
    })
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
    let old = insert_expiring(&table, Some("r-1"), "old", Some(-3600.0)).await;
    let recent = insert_expiring(&table, Some("r-2"), "recent", Some(-1.0)).await;
    let sent = insert_expiring(&table, Some("r-3"), "sent", None).await;
    let relay = relay(&table, &rabbit, "expiry-retention")
        .set("cleanup.retention", "30m")
        .set("cleanup.interval", "300ms")
        .spawn();
    rabbit.wait_for_ids(&[sent], WAIT).await;
    wait_until(WAIT, "the long-expired row is removed", async || {
        let s = states(&table).await;
        if s.contains_key(&old) {
            Err(format!("{:?}", s[&old]))
        } else {
            Ok(())
        }
    })
    .await;
    relay
        .wait_for_log("deleted sent rows past retention", 1, WAIT)
        .await;
    let s = states(&table).await;
    assert_eq!(s[&recent].0, "expired");
    assert_eq!(s[&sent].0, "sent");
    relay.stop().await;

    // Retention 0 deletes rows on confirm; rows that expire are deleted at once as well.
    let gone = insert_expiring(&table, Some("r-4"), "gone", Some(-1.0)).await;
    let relay = relay_zero(&table, &rabbit);
    wait_until(WAIT, "the expired row is deleted", async || {
        if states(&table).await.contains_key(&gone) {
            Err("still there".to_owned())
        } else {
            Ok(())
        }
    })
    .await;
    relay.wait_for_log("passed their expires_at", 1, WAIT).await;
    relay.stop().await;
    rabbit.barrier().await;
    assert!(!rabbit.id_counts().contains_key(&gone.to_string()));
    drop_both(table, rabbit).await;
}

fn relay_zero(table: &TestTable, rabbit: &RabbitFixture) -> common::RelayProcess {
    relay(table, rabbit, "expiry-retention-zero")
        .set("cleanup.retention", "0s")
        .spawn()
}

/// A version-1 table as `migrate` of an earlier release left it: only `0001`, recorded as 1.
async fn version_1_table(test: &str) -> TestTable {
    let name = format!("it_{test}_{}", hex8());
    let db = pg_connect().await;
    let t = TableName::parse(&name).unwrap();
    db.batch_execute(&schema::render(MIGRATIONS[0].sql, &t))
        .await
        .expect("version 1 DDL");
    db.batch_execute(schema::VERSION_TABLE_DDL).await.unwrap();
    db.execute(
        "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, 1)",
        &[&name],
    )
    .await
    .unwrap();
    TestTable { name, db }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_table_without_auto_migrate_is_refused_with_the_fix() {
    let table = version_1_table("expiry_refused").await;
    let out = RelayBuilder::bare("expiry-refused")
        .set("database.url", PG_URL)
        .set("database.table", &table.name)
        .set("database.auto_migrate", "false")
        .set("metrics.listen", "")
        .output(&["run"], WAIT)
        .await;
    // Not a "database down" loop that never publishes: a clear refusal naming the fix.
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("predates schema version 2")
            && out.stderr.contains("run `outbox-relay migrate`"),
        "{}",
        out.stderr
    );
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_version_1_table_in_place_with_rows_pending_and_in_flight() {
    let table = version_1_table("expiry_upgrade").await;
    let rabbit = RabbitFixture::new("expiry_upgrade", "#", "it.barrier").await;
    // Under version 1: 40 rows pending, then 10 of them claimed by a relay of the earlier
    // release (processing, locked by it) that is gone by the time this release starts.
    let rows: Vec<common::NewRow> = (0..40)
        .map(|i| {
            common::NewRow::new(
                "order",
                Some(&format!("u-{}", i % 7)),
                "e",
                serde_json::json!({"i": i}),
            )
        })
        .collect();
    let ids: Vec<Uuid> = table.insert(&rows).await.iter().map(|r| r.id).collect();
    table
        .db
        .execute(
            &format!(
                "UPDATE {} SET status = 'processing', attempts = 1, locked_by = 'old-release', \
                 locked_at = now() WHERE seq IN (SELECT seq FROM {0} ORDER BY seq LIMIT 10)",
                table.name
            ),
            &[],
        )
        .await
        .unwrap();
    let cli = || {
        RelayBuilder::bare("expiry-upgrade-migrate")
            .set("database.url", PG_URL)
            .set("database.table", &table.name)
    };
    let out = cli().output(&["migrate"], WAIT).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    out.assert_stdout_has("applied schema versions [2");
    let out = cli().output(&["migrate"], WAIT).await;
    assert!(out.stdout.contains("is up to date"), "{}", out.stdout);
    // The file itself is idempotent, as users may apply it from their own migrations.
    let t = TableName::parse(&table.name).unwrap();
    table
        .db
        .batch_execute(&schema::render(MIGRATIONS[1].sql, &t))
        .await
        .expect("0002 applied twice");

    // The rows are untouched; the schema is version 2.
    let s = table.status_counts().await;
    assert_eq!((s["pending"], s["processing"]), (30, 10), "{s:?}");
    let check: String = table
        .db
        .query_one(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE conrelid = to_regclass($1) AND conname = $2",
            &[&table.name, &format!("{}_status_check", table.name)],
        )
        .await
        .unwrap()
        .get(0);
    assert!(check.contains("'expired'"), "{check}");
    let indexes: Vec<String> = table
        .db
        .query(
            "SELECT indexname FROM pg_indexes WHERE tablename = $1",
            &[&table.name],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for want in ["open_idx", "expiry_idx", "expired_idx"] {
        assert!(
            indexes.iter().any(|i| i.ends_with(want)),
            "{want} in {indexes:?}"
        );
    }
    assert!(
        !indexes.iter().any(|i| i.ends_with("_aggregate_idx")),
        "{indexes:?}"
    );

    // A relay of this release drains everything, the rows the old relay held included once
    // their lease runs out, and expires a row inserted with a past deadline.
    let late = insert_expiring(&table, Some("u-1"), "late", Some(-1.0)).await;
    let relay = relay(&table, &rabbit, "expiry-upgrade")
        .set("relay.lease_timeout", "2s")
        .spawn();
    rabbit.wait_for_ids(&ids, WAIT).await;
    wait_until(WAIT, "every row settles", async || {
        let s = table.status_counts().await;
        if s["sent"] == 40 && s.get("expired") == Some(&1) {
            Ok(())
        } else {
            Err(format!("{s:?}"))
        }
    })
    .await;
    assert_eq!(table.row(late).await.status, "expired");
    finish(relay, table, rabbit).await;
}
