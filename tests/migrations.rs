//! `migrate` beside a live application and the start-up's refusal of an old table, against the
//! binary and the local PostgreSQL: a transaction holding the table makes `migrate` give up
//! within its bounded tries (never queueing the application's inserts behind it for long),
//! naming the holder and telling the user to run it again, and it succeeds once that
//! transaction ends; `run` refuses a table without `expires_at` (hand-applied version-1 DDL)
//! and tells the user to run `migrate`, which fixes it; a `migrate` interrupted in a concurrent
//! index build left an INVALID index, which the next `migrate` drops and builds again; two
//! `migrate`s at once both finish; without `auto_migrate`, `check` and `run` name the schema
//! versions a migrated table lacks.
//!
//! Each test has its own `it_mig_…` table.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{
    CmdOutput, NewRow, PG_URL, RelayBuilder, TestTable, hex8, migrate_table, pg_connect,
    try_pg_connect,
};
use outbox_relay::config::TableName;
use outbox_relay::store::schema::{self, MIGRATIONS};
use outbox_relay::store::steps::StepKind;

/// Bound for one run of the binary (`migrate` gives up within a few tries of 3 s).
const WAIT: Duration = Duration::from_secs(60);

/// A table at schema version 1 (its DDL only), recorded at version 1 when `record`, holding
/// 10 pending rows.
async fn version_1_table(record: bool) -> TestTable {
    let (name, db) = (format!("it_mig_{}", hex8()), pg_connect().await);
    let table = TestTable { name, db };
    let t = TableName::parse(&table.name).unwrap();
    let db = &table.db;
    db.batch_execute(schema::VERSION_TABLE_DDL).await.unwrap();
    let ddl = MIGRATIONS[0].render(&t);
    db.batch_execute(&ddl).await.expect("version 1 DDL");
    if record {
        let sql = "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, 1)";
        db.execute(sql, &[&table.name]).await.unwrap();
    }
    table
        .insert(&NewRow::numbered(10, "order", Some(("o-", 3)), "created"))
        .await;
    table
}

/// The version recorded for `table`.
async fn recorded_version(table: &TestTable) -> Option<i32> {
    let sql = "SELECT version FROM outbox_relay_schema_version WHERE table_name = $1";
    let row = table.db.query_opt(sql, &[&table.name]).await.unwrap();
    row.map(|r| r.get(0))
}

/// Runs the binary for `table` with `args` (no metrics server, `auto_migrate` off).
async fn run_cli(table: &TestTable, args: &[&str]) -> CmdOutput {
    RelayBuilder::operator(&table.name)
        .set("database.auto_migrate", "false")
        .set("metrics.listen", "")
        .output(args, WAIT)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_gives_up_on_a_held_table_naming_the_holder_and_succeeds_once_it_ends() {
    let table = version_1_table(true).await;
    // An application transaction that inserted a row and stays open: its ROW EXCLUSIVE lock
    // conflicts with the ACCESS EXCLUSIVE lock version 2 needs.
    let mut app = try_pg_connect(PG_URL, "held-by-test").await.unwrap();
    let tx = app.transaction().await.unwrap();
    let pid: i32 = tx
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let insert = format!(
        "INSERT INTO {} (event_type, payload) VALUES ('held', '{{}}')",
        table.name
    );
    tx.batch_execute(&insert).await.unwrap();

    let out = run_cli(&table, &["migrate"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    for words in [
        "could not apply schema version 2 to",
        &format!("held by pid {pid} (RowExclusiveLock"),
        "application \"held-by-test\"",
        "run `outbox-relay migrate` again",
    ] {
        assert!(out.stderr.contains(words), "{words:?} in {}", out.stderr);
    }
    // It tried a bounded number of times, saying so between tries.
    let retries = out.stderr.matches("retrying").count();
    assert_eq!(retries, 2, "{}", out.stderr);
    // Nothing of version 2 was applied, and the application's transaction is intact.
    assert_eq!(recorded_version(&table).await, Some(1));
    tx.commit().await.unwrap();
    assert_eq!(table.count_where("event_type = 'held'").await, 1);

    let applied = migrate_table(&table.name).await;
    let want: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).skip(1).collect();
    assert_eq!(applied, want);
    assert_eq!(recorded_version(&table).await, want.last().copied());
    table.drop_table().await;
}

/// Whether `index` of `table` is valid (`None` when it does not exist).
async fn index_valid(table: &TestTable, suffix: &str) -> Option<bool> {
    let sql = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1 || $2)";
    let row = table
        .db
        .query_opt(sql, &[&table.name, &suffix])
        .await
        .unwrap();
    row.map(|r| r.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_interrupted_in_a_concurrent_index_build_drops_the_invalid_index_and_finishes() {
    let table = version_1_table(true).await;
    let t = TableName::parse(&table.name).unwrap();
    let v2 = MIGRATIONS[1].steps(&t, false);
    // Version 2 as a `migrate` killed in its first index build leaves it: the steps before
    // it applied, the build's INVALID index behind (a build that cannot wait for a writer's
    // transaction fails after creating it), nothing recorded.
    let (first_build, _) = v2
        .iter()
        .enumerate()
        .find(|(_, s)| s.kind == StepKind::Concurrent)
        .unwrap();
    assert_eq!(
        v2[first_build].builds_index.as_deref(),
        Some(&*format!("{}_open_idx", table.name))
    );
    for step in &v2[..first_build] {
        table.db.batch_execute(&step.sql).await.unwrap();
    }
    let mut app = try_pg_connect(PG_URL, "writer").await.unwrap();
    let tx = app.transaction().await.unwrap();
    let insert = format!(
        "INSERT INTO {} (event_type, payload) VALUES ('w', '{{}}')",
        table.name
    );
    tx.batch_execute(&insert).await.unwrap();
    table
        .db
        .batch_execute("SET lock_timeout = '200ms'")
        .await
        .unwrap();
    let failed = table.db.batch_execute(&v2[first_build].sql).await;
    table.db.batch_execute("RESET lock_timeout").await.unwrap();
    assert!(failed.is_err(), "the build waits for the writer");
    tx.commit().await.unwrap();
    assert_eq!(index_valid(&table, "_open_idx").await, Some(false));
    assert_eq!(recorded_version(&table).await, Some(1));

    let out = run_cli(&table, &["migrate"]).await;
    assert!(out.status.success(), "{out:?}");
    let dropped = format!("dropping the INVALID index public.{}_open_idx", table.name);
    assert!(
        out.stderr.contains(&dropped),
        "{dropped:?} in {}",
        out.stderr
    );
    assert!(
        out.stdout
            .contains("applied schema versions [2, 3, 4, 5, 6, 7]"),
        "{}",
        out.stdout
    );
    for suffix in [
        "_waiting_idx",
        "_expiry_idx",
        "_expired_idx",
        "_blocker_idx",
    ] {
        assert_eq!(index_valid(&table, suffix).await, Some(true), "{suffix}");
    }
    for gone in ["_aggregate_idx", "_open_idx"] {
        assert_eq!(index_valid(&table, gone).await, None, "{gone}");
    }
    assert_eq!(
        recorded_version(&table).await,
        MIGRATIONS.last().map(|m| m.version)
    );
    assert_eq!(table.count_where("event_type = 'w'").await, 1);
    table.drop_table().await;
}

/// Without `auto_migrate`, `check` names the schema versions a table lacks by the version
/// `migrate` recorded (here version 7, on a table an earlier release migrated) and says to
/// run `migrate`, and `run` warns the same; once the record is gone (as for DDL applied by
/// hand) the table's catalog shows it at the newest version, and neither says anything of
/// versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_run_name_the_schema_versions_a_migrated_table_lacks() {
    let (name, db) = (format!("it_mig_{}", hex8()), pg_connect().await);
    let table = TestTable { name, db };
    migrate_table(&table.name).await;
    let at_6 = "UPDATE outbox_relay_schema_version SET version = 6 WHERE table_name = $1";
    assert_eq!(table.db.execute(at_6, &[&table.name]).await.unwrap(), 1);
    let check = async || {
        let out = RelayBuilder::operator(&table.name)
            .set("database.auto_migrate", "false")
            .set("publisher.kind", "stdout")
            .set("metrics.listen", "")
            .output(&["check"], WAIT)
            .await;
        assert!(out.status.success(), "{out:?}");
        out.stdout
    };
    let behind = "schema versions [7] not applied: run `outbox-relay migrate`";
    let said = check().await;
    assert!(said.contains(behind), "{said}");
    let relay = RelayBuilder::operator(&table.name)
        .set("database.auto_migrate", "false")
        .set("publisher.kind", "stdout")
        .set("metrics.listen", "")
        .spawn();
    // The warning is what this tests: wait for it.
    relay
        .wait_for_log("schema versions not applied to the table", 1, WAIT)
        .await;
    assert!(
        relay.stderr().contains("versions=[7]"),
        "{}",
        relay.stderr()
    );
    relay.stop().await;

    let forget = "DELETE FROM outbox_relay_schema_version WHERE table_name = $1";
    assert_eq!(table.db.execute(forget, &[&table.name]).await.unwrap(), 1);
    let said = check().await;
    assert!(
        said.contains(&format!("table {} found", table.name)),
        "{said}"
    );
    assert!(!said.contains("not applied"), "{said}");
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_migrates_at_once_both_finish() {
    // The second waits for the first; its wait must not hold a snapshot, which the first's
    // concurrent index builds would wait for in turn (PostgreSQL reports a deadlock).
    let (a, b) = (version_1_table(true).await, version_1_table(true).await);
    let (out_a, out_b) = tokio::join!(run_cli(&a, &["migrate"]), run_cli(&b, &["migrate"]));
    for (table, out) in [(&a, &out_a), (&b, &out_b)] {
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            recorded_version(table).await,
            MIGRATIONS.last().map(|m| m.version)
        );
        assert_eq!(index_valid(table, "_waiting_idx").await, Some(true));
        assert_eq!(index_valid(table, "_open_idx").await, None);
    }
    a.drop_table().await;
    b.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_a_table_without_expires_at_and_migrate_fixes_it() {
    // Applied by hand from the version-1 file, nothing recorded: no expires_at column.
    let table = version_1_table(false).await;
    let out = run_cli(&table, &["run"]).await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let fix = format!(
        "table {} predates schema version 2 (no expires_at column): run `outbox-relay migrate`",
        table.name
    );
    assert!(out.stderr.contains(&fix), "{fix:?} in {}", out.stderr);
    // Refused at once, not retried as if the database were down.
    assert!(!out.stderr.contains("retrying"), "{}", out.stderr);

    // Doing as told: `migrate` applies what the table lacks (its catalog shows version 1),
    // and `run` starts.
    let applied = migrate_table(&table.name).await;
    assert_eq!(applied.first(), Some(&2), "{applied:?}");
    let relay = RelayBuilder::operator(&table.name)
        .set("metrics.listen", "")
        .set("publisher.kind", "stdout")
        .spawn();
    relay.wait_for_log("relaying outbox", 1, WAIT).await;
    table.wait_all_sent(WAIT).await;
    relay.stop().await;
    table.drop_table().await;
}

/// What exists decides, not the record: a table re-created from the version-1 file while the
/// version table still says 7 gets versions 2 to 7 again (`check` says to run `migrate`
/// first, which then does); a table at the newest version with no record under the spelling in use
/// (`public.<name>`) gets nothing, so version 1's plain index build never runs on a table
/// full of rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_goes_by_what_the_table_has_not_by_the_record() {
    let newest = MIGRATIONS.last().map(|m| m.version).unwrap();
    let table = version_1_table(false).await;
    let stale = "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, $2)";
    table
        .db
        .execute(stale, &[&table.name, &newest])
        .await
        .unwrap();
    let out = run_cli(&table, &["check"]).await;
    assert!(
        out.stdout.contains(
            "predates schema version 2 (no expires_at column): run `outbox-relay migrate`"
        ),
        "{out:?}"
    );
    assert_eq!(migrate_table(&table.name).await, [2, 3, 4, 5, 6, 7]);
    assert_eq!(index_valid(&table, "_waiting_idx").await, Some(true));
    assert_eq!(index_valid(&table, "_open_idx").await, None);
    assert_eq!(index_valid(&table, "_aggregate_idx").await, None);

    let qualified = format!("public.{}", table.name);
    let out = RelayBuilder::operator(&qualified)
        .output(&["migrate"], WAIT)
        .await;
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.contains("is up to date"), "{out:?}");
    assert_eq!(
        index_valid(&table, "_aggregate_idx").await,
        None,
        "version 1 was not applied again"
    );

    // A fillfactor an operator chose stands for version 5's: nothing is applied over it.
    let tune = format!("ALTER TABLE {} SET (fillfactor = 70)", table.name);
    table.db.batch_execute(&tune).await.unwrap();
    let forget = "DELETE FROM outbox_relay_schema_version WHERE table_name = $1";
    table.db.execute(forget, &[&table.name]).await.unwrap();
    let applied = migrate_table(&table.name).await;
    assert!(applied.is_empty(), "{applied:?}");
    let sql = "SELECT reloptions::text FROM pg_class WHERE oid = to_regclass($1)";
    let options: String = table
        .db
        .query_one(sql, &[&table.name])
        .await
        .unwrap()
        .get(0);
    assert!(options.contains("fillfactor=70"), "{options}");
    table.drop_table().await;
}

/// A version 2 cut short on a table with no record (hand-made from the version-1 file, or
/// recorded under another spelling) is finished by the next `migrate`: version 2's mark is
/// the last index it builds, not its first change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_version_2_is_finished_without_a_record() {
    let table = version_1_table(false).await;
    let t = TableName::parse(&table.name).unwrap();
    // Version 2's first step only: the column and the constraint, no index.
    let first = &MIGRATIONS[1].steps(&t, false)[0];
    table.db.batch_execute(&first.sql).await.unwrap();
    assert_eq!(index_valid(&table, "_open_idx").await, None);
    let applied = migrate_table(&table.name).await;
    assert_eq!(applied.first(), Some(&2), "{applied:?}");
    assert_eq!(
        index_valid(&table, "_open_idx").await,
        None,
        "version 6 dropped it"
    );
    assert_eq!(index_valid(&table, "_waiting_idx").await, Some(true));
    assert_eq!(index_valid(&table, "_expired_idx").await, Some(true));
    assert_eq!(index_valid(&table, "_aggregate_idx").await, None);
    table.drop_table().await;
}
