//! Least privilege (docs/security.md), against real PostgreSQL roles, the binary and
//! RabbitMQ: an application role with only `INSERT` on the outbox table and `USAGE` on its
//! sequence inserts (in bulk too), wakes the idle relay and has its rows relayed; a relay
//! running as a role that does not own the table, with the row-level grants of
//! docs/security.md and `auto_migrate = false`, relays, and skips the `VACUUM` and `ANALYZE`
//! it may not run with one warning naming the privilege, however many checks want them; on a
//! partitioned table it makes and drops no partitions (one warning) and deletes rows instead.
//!
//! Each test creates its own roles (`it_app_<hex>`, `it_relay_<hex>`) and drops them after.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{
    NewRow, RelayBuilder, finish, free_port, hex8, insert_rows, pg_connect, table_and_exchange,
    try_pg_connect, wait_for_count, wait_for_sample,
};
use outbox_relay::telemetry::names;
use serde_json::json;

/// Bound for anything that normally takes a few seconds (the table health check runs every 5 s).
const WAIT: Duration = Duration::from_secs(60);

/// A login role of its own, dropped (with its privileges) by [`Role::drop_role`].
struct Role {
    name: String,
}

impl Role {
    async fn create(prefix: &str) -> Self {
        let name = format!("it_{prefix}_{}", hex8());
        let db = pg_connect().await;
        db.batch_execute(&format!("CREATE ROLE {name} LOGIN"))
            .await
            .unwrap();
        Self { name }
    }

    /// The test database's URL as this role (the local server trusts loopback logins).
    fn url(&self) -> String {
        format!("postgres://{}@127.0.0.1:5432/test", self.name)
    }

    /// Runs `grants` (`{role}` stands for the role's name) as the superuser.
    async fn grant(&self, grants: &str) {
        let sql = grants.replace("{role}", &self.name);
        pg_connect().await.batch_execute(&sql).await.unwrap();
    }

    /// Drops what the role was granted, then the role (after its sessions ended).
    async fn drop_role(self) {
        let db = pg_connect().await;
        let sql = format!("DROP OWNED BY {0}; DROP ROLE {0}", self.name);
        db.batch_execute(&sql).await.unwrap();
    }
}

/// The application's grants of docs/security.md for `table`.
fn application_grants(table: &str) -> String {
    format!("GRANT INSERT ON {table} TO {{role}}; GRANT USAGE ON SEQUENCE {table}_seq TO {{role}};")
}

/// The relay's grants of docs/security.md for `table` (not its owner).
fn relay_grants(table: &str) -> String {
    format!(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON {table}, {table}_waiters TO {{role}}; \
         GRANT SELECT ON outbox_relay_schema_version TO {{role}}; \
         GRANT USAGE, SELECT ON SEQUENCE {table}_seq TO {{role}}; \
         GRANT EXECUTE ON FUNCTION {table}_next_seq(), {table}_wakeup() TO {{role}};"
    )
}

fn row(i: usize) -> NewRow {
    NewRow::new(
        "priv",
        Some(&format!("a{}", i % 5)),
        "made",
        json!({ "i": i }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_insert_only_application_role_inserts_wakes_the_relay_and_its_rows_are_relayed() {
    let (table, rabbit) = table_and_exchange("priv_app").await;
    let app = Role::create("app").await;
    app.grant(&application_grants(&table.name)).await;
    // A long poll: rows out well before it prove the wake-up ran for the application's role.
    let relay = RelayBuilder::for_test(&table, &rabbit, "priv-app-relay")
        .set("relay.poll_interval", "60s")
        .serving_metrics()
        .spawn();
    relay.wait_broker_connected(Duration::from_secs(30)).await;
    let what = "the relay records that it waits";
    let waiting = |w: &[String]| w.len() == 1;
    table
        .wait_waiters(Duration::from_secs(20), what, waiting)
        .await;

    let mut db = try_pg_connect(&app.url(), "priv-app").await.unwrap();
    // The role really is that narrow: it cannot read the table.
    let read = format!("SELECT count(*) FROM {}", table.name);
    let denied = db.query_one(&read, &[]).await.unwrap_err();
    assert!(
        denied.to_string().contains("permission denied") || format!("{denied:?}").contains("42501"),
        "{denied:?}"
    );
    // The contract's integration: a plain INSERT (no RETURNING, which would need SELECT) in
    // the application's transaction, here several rows in two statements.
    let tx = db.transaction().await.unwrap();
    let insert = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4)",
        table.name
    );
    for i in 0..3 {
        let r = row(i);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [
            &r.aggregate_type,
            &r.aggregate_id,
            &r.event_type,
            &r.payload,
        ];
        tx.execute(&insert, &params).await.unwrap();
    }
    let bulk = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'priv', 'b' || i % 5, 'bulk', jsonb_build_object('i', i) FROM generate_series(1, 500) i",
        table.name
    );
    tx.batch_execute(&bulk).await.unwrap();
    tx.commit().await.unwrap();

    let received = || rabbit.count();
    // Half the poll interval: only the wake-up can have started this claim.
    wait_for_count(
        Duration::from_secs(30),
        "the woken relay publishes",
        1,
        received,
    )
    .await;
    table.wait_all_sent(WAIT).await;
    // Sent means confirmed by the broker, not yet received by the test's consumer.
    rabbit.barrier().await;
    assert_eq!(rabbit.count(), 503);
    drop(db);
    finish(relay, table, rabbit).await;
    app.drop_role().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_does_not_own_the_table_relays_and_skips_vacuum_with_one_warning() {
    let (table, rabbit) = table_and_exchange("priv_relay").await;
    let role = Role::create("relay").await;
    role.grant(&relay_grants(&table.name)).await;
    // Autovacuum off for the table: the relay would vacuum it itself once 10,000 dead tuples
    // pile up, if it were allowed to.
    let off = format!("ALTER TABLE {} SET (autovacuum_enabled = off)", table.name);
    table.db.batch_execute(&off).await.unwrap();
    let port = free_port();
    let relay = RelayBuilder::for_test(&table, &rabbit, "priv-relay")
        .set("database.url", role.url())
        .set("relay.poll_interval", "200ms")
        .set("cleanup.retention", "0s")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();

    // Each row sent and deleted leaves about two dead tuples (claimed, then deleted on
    // confirm): 8,000 rows, about 16,000, past the 10,000 at which an owner would vacuum.
    let mut dead_seen = 0.0;
    for round in 0..2 {
        let rows: Vec<NewRow> = (round * 8_000..(round + 1) * 8_000).map(row).collect();
        for chunk in rows.chunks(2_000) {
            insert_rows(&table.db, &table.name, chunk).await;
        }
        table.wait_count("true", 0, WAIT).await;
        // A table health check saw them: a vacuum was due at this one and the last.
        let labels = [("outbox", table.name.as_str())];
        let seen = dead_seen;
        dead_seen = wait_for_sample(port, WAIT, names::DEAD_TUPLES, &labels, |d| {
            d >= 10_000.0 && d > seen
        })
        .await;
    }

    let warning = "VACUUM and ANALYZE of the outbox table need its ownership";
    let stderr = relay.stderr();
    assert_eq!(relay.log_count(warning), 1, "{stderr}");
    let never = [
        "vacuumed the outbox table",
        "analyzed the outbox table",
        "vacuum of the outbox table failed",
        "analyze of the outbox table failed",
    ];
    for never in never {
        assert!(!stderr.contains(never), "{never:?} in {stderr}");
    }
    let sql = "SELECT vacuum_count + analyze_count FROM pg_stat_user_tables \
               WHERE relid = $1::text::regclass";
    let runs: i64 = table
        .db
        .query_one(sql, &[&table.name])
        .await
        .unwrap()
        .get(0);
    assert_eq!(runs, 0, "the table was vacuumed or analyzed");
    wait_for_count(WAIT, "every message arrives", 16_000, || rabbit.count()).await;
    finish(relay, table, rabbit).await;
    role.drop_role().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_does_not_own_a_partitioned_table_relays_and_deletes_rows_instead_of_partitions()
 {
    let table = common::TestTable::partitioned("priv_parts", "1m").await;
    let rabbit = common::RabbitFixture::new("priv_parts", "#", "it.barrier").await;
    let role = Role::create("relay").await;
    role.grant(&relay_grants(&table.name)).await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "priv-parts")
        .set("database.url", role.url())
        .set("database.partition_interval", "1m")
        .set("relay.poll_interval", "200ms")
        .set("cleanup.retention", "1s")
        .set("cleanup.interval", "1s")
        .spawn();
    for round in 0..3 {
        let rows: Vec<NewRow> = (round * 100..(round + 1) * 100).map(row).collect();
        insert_rows(&table.db, &table.name, &rows).await;
        // Row retention through the table: every sent row is deleted once a second old.
        table.wait_count("true", 0, WAIT).await;
    }
    let warning = "cannot create or drop partitions";
    let stderr = relay.stderr();
    assert_eq!(relay.log_count(warning), 1, "{stderr}");
    assert!(stderr.contains("needs ownership of the table"), "{stderr}");
    wait_for_count(WAIT, "every message arrives", 300, || rabbit.count()).await;
    finish(relay, table, rabbit).await;
    role.drop_role().await;
}
