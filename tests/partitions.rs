//! Partitioned outbox tables (docs/operations.md#partitioned-tables): partitions made ahead,
//! rows outside them caught by DEFAULT and relayed, retention dropping partitions whole (their
//! dead letters and rows in flight moved to DEFAULT, unchanged, under traffic) and keeping one
//! with too many dead letters whole until they are retried or discarded, the in-place
//! conversion of a plain table while a writer inserts and a relay runs, a conversion an
//! interrupted `migrate` left half done, a table `migrate` refuses to partition, what
//! `migrate --print` says of partitioning, schema
//! version 5's fillfactor on every partition (the relay's own, and those of a table
//! partitioned at version 4), and schema version 6's waiting index built partition by
//! partition on a table partitioned at version 5 (and finished when a run was cut short).
//!
//! The real binary against the local PostgreSQL and RabbitMQ, one-minute partitions, a table
//! and exchange per test.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::{
    NewRow, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, TestTable, finish, free_port,
    spawn_paced_writer, wait_for_sample, wait_until,
};
use outbox_relay::store::partitions::MOVE_AT_MOST;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(90);

fn relay(table: &TestTable, rabbit: &RabbitFixture, label: &str) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, label)
        .ordered()
        .set("database.partition_interval", "1m")
        .set("cleanup.interval", "1s")
}

/// `outbox-relay migrate` of `table` with `database.partition_interval = interval`.
async fn migrate_partitioned(table: &str, interval: &str) -> common::CmdOutput {
    RelayBuilder::operator(table)
        .set("database.partition_interval", interval)
        .output(&["migrate"], WAIT)
        .await
}

/// Inserts a row of aggregate `aggregate` whose `created_at` is `offset` from now (an SQL
/// interval), with `status` and, for a sent row, `sent_at` as long ago as its creation.
async fn insert_at(table: &TestTable, aggregate: &str, offset: &str, status: &str) -> Uuid {
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts, \
                         created_at, sent_at, last_error) \
         VALUES ('part', $1, 'placed', '{{}}', $2, CASE WHEN $2 = 'pending' THEN 0 ELSE 1 END, \
                 now() + $3::text::interval, CASE WHEN $2 = 'sent' THEN now() + $3::text::interval END, \
                 CASE WHEN $2 = 'failed' THEN 'refused by the test' END) RETURNING id",
        table.name
    );
    table
        .db
        .query_one(&sql, &[&aggregate, &status, &offset])
        .await
        .expect("insert a dated row")
        .get(0)
}

/// The partition (bare name) that holds row `id`.
async fn partition_of(table: &TestTable, id: Uuid) -> String {
    let sql = format!(
        "SELECT tableoid::regclass::text FROM {} WHERE id = $1",
        table.name
    );
    table.db.query_one(&sql, &[&id]).await.unwrap().get(0)
}

/// The partitions of `table` whose storage settings lack schema version 5's fillfactor.
async fn partitions_without_room(table: &TestTable) -> Vec<String> {
    let sql = "SELECT relid::text FROM pg_partition_tree($1::text::regclass) t \
               JOIN pg_class c ON c.oid = t.relid \
               WHERE t.isleaf AND NOT coalesce('fillfactor=50' = ANY(c.reloptions), false) \
               ORDER BY 1";
    let rows = table.db.query(sql, &[&table.name]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_made_ahead_and_rows_outside_them_go_to_default_and_are_relayed() {
    let table = TestTable::partitioned("part_ahead", "1m").await;
    let rabbit = RabbitFixture::new("part_ahead", "#", "it.barrier").await;
    let first = table.partitions().await;
    let ranges: Vec<&String> = first.iter().filter(|p| !p.ends_with("_default")).collect();
    assert!(
        ranges.len() >= 2 && first.contains(&format!("{}_default", table.name)),
        "migrate makes partitions at least two intervals ahead and a DEFAULT one: {first:?}"
    );

    let mut rows = table
        .insert_ids(&NewRow::numbered(40, "part", Some(("a-", 4)), "placed"))
        .await;
    let ahead = insert_at(&table, "a-0", "1 day", "pending").await;
    let behind = insert_at(&table, "a-1", "-1 day", "pending").await;
    let default = format!("{}_default", table.name);
    assert_eq!(partition_of(&table, ahead).await, default);
    assert_eq!(partition_of(&table, behind).await, default);
    assert!(partition_of(&table, rows[0]).await.contains("_p20"));
    rows.extend([ahead, behind]);

    let port = free_port();
    let relay = relay(&table, &rabbit, "part-ahead")
        .set("cleanup.retention", "1h")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let expected = table.rows().await;
    rabbit
        .analyse(&expected)
        .assert_exactly_once("partitioned table");
    let outbox = [("outbox", table.name.as_str())];
    let in_default = wait_for_sample(port, WAIT, "outbox_default_partition_rows", &outbox, |n| {
        n == 2.0
    })
    .await;
    assert_eq!(in_default, 2.0, "the rows outside every range are counted");
    wait_for_sample(port, WAIT, "outbox_partitions", &outbox, |n| n >= 2.0).await;

    // As time passes the relay keeps partitions ahead: within a minute and a half a
    // partition that migrate did not make appears.
    let made = wait_until(WAIT, "a partition made ahead by the relay", async || {
        let now = table.partitions().await;
        match now.iter().find(|p| !first.contains(p)) {
            Some(p) => Ok(p.clone()),
            None => Err(format!("{now:?}")),
        }
    })
    .await;
    assert!(made.starts_with(&format!("{}_p20", table.name)), "{made}");
    // Every partition, the relay's own included, has room on its pages for the relay's updates.
    assert_eq!(partitions_without_room(&table).await, Vec::<String>::new());
    finish(relay, table, rabbit).await;
}

/// A session holding a lock on the table keeps the relay from making the partitions ahead:
/// the warning names that session (pid, lock, application) as `migrate` does, and the relay
/// makes them once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_that_keeps_partitions_from_being_made_ahead_is_named() {
    let table = TestTable::partitioned("part_locked", "1m").await;
    // The newest partition ahead dropped: the relay's first round must make it again.
    let mut ranges: Vec<String> = table
        .partitions()
        .await
        .into_iter()
        .filter(|p| !p.ends_with("_default"))
        .collect();
    ranges.sort();
    let newest = ranges.pop().unwrap();
    table
        .db
        .batch_execute(&format!("DROP TABLE {newest}"))
        .await
        .unwrap();
    let holder = common::pg_connect().await;
    holder
        .batch_execute(&format!(
            "SET application_name = 'part-lock-holder'; BEGIN; \
             LOCK TABLE {} IN SHARE UPDATE EXCLUSIVE MODE",
            table.name
        ))
        .await
        .unwrap();
    let relay = RelayBuilder::for_table(&table, "part-locked")
        .set("publisher.kind", "stdout")
        .set("database.partition_interval", "1m")
        .set("cleanup.interval", "1s")
        .quiet()
        .spawn();
    let warning = "could not create the partitions ahead";
    relay
        .wait_for_log(warning, 1, Duration::from_secs(150))
        .await;
    let line = relay
        .stderr()
        .lines()
        .find(|l| l.contains(warning))
        .unwrap()
        .to_owned();
    for want in [
        "held by pid",
        "ShareUpdateExclusiveLock",
        "application \"part-lock-holder\"",
    ] {
        assert!(line.contains(want), "{want:?} not in {line}");
    }
    holder.batch_execute("COMMIT").await.unwrap();
    wait_until(
        Duration::from_secs(150),
        "the partition made again",
        async || {
            let now = table.partitions().await;
            match now.contains(&newest) {
                true => Ok(()),
                false => Err(format!("{now:?}")),
            }
        },
    )
    .await;
    relay.stop().await;
    table.drop_table().await;
}

/// `migrate --print` with an interval prints the versions' DDL and says that `migrate`
/// partitions the table after them (the steps depend on the table as it stands), applying
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_print_says_that_migrate_partitions_the_table_and_applies_nothing() {
    let name = format!("part_print_{}", common::hex8());
    let print = async |interval: Option<&str>| {
        let mut op = RelayBuilder::operator(&name);
        if let Some(i) = interval {
            op = op.set("database.partition_interval", i);
        }
        let out = op.output(&["migrate", "--print"], WAIT).await;
        assert!(out.status.success(), "{}", out.stderr);
        out.stdout
    };
    let plain = print(None).await;
    let partitioned = print(Some("1h")).await;
    let note = format!("`outbox-relay migrate` then partitions {name}");
    assert!(!plain.contains(&note), "{plain}");
    assert!(
        partitioned.starts_with(&plain),
        "the versions' DDL comes first"
    );
    assert!(partitioned.contains(&note), "{partitioned}");
    assert!(
        partitioned.contains("partition_interval = \"1h\""),
        "{partitioned}"
    );
    let db = common::pg_connect().await;
    let found = db
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])
        .await
        .unwrap();
    assert!(!found.get::<_, bool>(0), "--print created the table");
}

/// Schema version 5 on a table partitioned at version 4 (whose partitions have the default
/// fillfactor): `migrate` sets the fillfactor of each partition, since a partitioned table
/// holds no storage settings of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_gives_each_partition_of_a_version_4_table_room_for_updates() {
    let table = TestTable::partitioned("part_room", "1m").await;
    let leaves = table.partitions().await;
    assert!(leaves.len() >= 3, "{leaves:?}");
    assert_eq!(partitions_without_room(&table).await, Vec::<String>::new());
    for leaf in &leaves {
        let reset = format!("ALTER TABLE {leaf} RESET (fillfactor)");
        table.db.batch_execute(&reset).await.unwrap();
    }
    let version_4 = "UPDATE outbox_relay_schema_version SET version = 4 WHERE table_name = $1";
    assert_eq!(
        table.db.execute(version_4, &[&table.name]).await.unwrap(),
        1
    );
    assert_eq!(partitions_without_room(&table).await.len(), leaves.len());

    let out = migrate_partitioned(&table.name, "1m").await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.contains("applied schema versions [5, 6, 7]"),
        "{}",
        out.stdout
    );
    assert_eq!(partitions_without_room(&table).await, Vec::<String>::new());
    table.drop_table().await;
}

/// The partitions of `table` with no index attached to the partitioned index `index`.
async fn partitions_without_index(table: &TestTable, index: &str) -> Vec<String> {
    let sql = "SELECT t.relid::text FROM pg_partition_tree($1::text::regclass) t \
               WHERE t.isleaf AND NOT EXISTS (SELECT 1 FROM pg_index x \
                 JOIN pg_inherits a ON a.inhrelid = x.indexrelid \
                 WHERE x.indrelid = t.relid AND a.inhparent = to_regclass($2)) \
               ORDER BY 1";
    let rows = table.db.query(sql, &[&table.name, &index]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// The SQL that takes partitioned `table` (made at the newest version) back to version 5: its
/// waiting and blocker indexes dropped, the open index on every partition, version 5
/// recorded.
fn back_to_version_5(table: &TestTable) -> String {
    let t = &table.name;
    format!(
        "DROP INDEX {t}_waiting_idx; DROP INDEX {t}_blocker_idx; \
         CREATE INDEX {t}_open_idx ON {t} (aggregate_type, aggregate_id, seq) \
           WHERE status NOT IN ('sent', 'expired'); \
         UPDATE outbox_relay_schema_version SET version = 5 WHERE table_name = '{t}';"
    )
}

/// Whether index `name` is valid (`None`: there is none).
async fn index_valid(table: &TestTable, name: &str) -> Option<bool> {
    let sql = "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)";
    let row = table.db.query_opt(sql, &[&name]).await.unwrap();
    row.map(|r| r.get(0))
}

/// `migrate` of partitioned `table` at version 5 applies versions 6 and 7, leaving the
/// waiting and blocker indexes valid and the open index gone.
async fn assert_migrates_from_version_5(table: &TestTable) {
    let out = migrate_partitioned(&table.name, "1m").await;
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.contains("applied schema versions [6, 7]"),
        "{}",
        out.stdout
    );
    let t = &table.name;
    for built in ["waiting_idx", "blocker_idx"] {
        let valid = index_valid(table, &format!("{t}_{built}")).await;
        assert_eq!(valid, Some(true), "{built}");
    }
    let open = index_valid(table, &format!("{t}_open_idx")).await;
    assert_eq!(open, None, "the open index is dropped");
}

/// Schema versions 6 and 7 on a table partitioned at version 5 (the open index on every
/// partition): PostgreSQL builds no index concurrently on a partitioned table, so `migrate`
/// builds the waiting and blocker indexes partition by partition and attaches each, then
/// drops the open index; a dead letter stays one and still holds back its aggregate, and the
/// relay (its ordered claim now reading the blocker index) drains the pending rows in order,
/// in the DEFAULT partition too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_builds_the_waiting_index_of_a_version_5_table_partition_by_partition() {
    let table = TestTable::partitioned("part_wait", "1m").await;
    let rabbit = RabbitFixture::new("part_wait", "#", "it.barrier").await;
    let (t, waiting) = (&table.name, format!("{}_waiting_idx", table.name));
    table
        .db
        .batch_execute(&back_to_version_5(&table))
        .await
        .unwrap();
    let leaves = table.partitions().await;
    assert!(leaves.len() >= 3, "{leaves:?}");
    assert_eq!(partitions_without_index(&table, &waiting).await, leaves);
    let mut pending = table
        .insert_ids(&NewRow::numbered(30, "part", Some(("w-", 3)), "placed"))
        .await;
    pending.push(insert_at(&table, "w-0", "-1 day", "pending").await);
    let dead = insert_at(&table, "d-0", "0 s", "failed").await;
    let blocked = insert_at(&table, "d-0", "0 s", "pending").await;

    assert_migrates_from_version_5(&table).await;
    assert_eq!(
        partitions_without_index(&table, &waiting).await,
        Vec::<String>::new()
    );
    let again = migrate_partitioned(t, "1m").await;
    assert!(again.stdout.contains("is up to date"), "{again:?}");

    let relay = relay(&table, &rabbit, "part-wait").spawn();
    let sent = i64::try_from(pending.len()).unwrap();
    table.wait_count("status = 'sent'", sent, WAIT).await;
    rabbit.barrier().await;
    let expected: Vec<_> = table.rows_by_id(&pending).await.into_values().collect();
    rabbit
        .analyse(&expected)
        .assert_exactly_once("version 6 on a partitioned table");
    assert_eq!(table.row(dead).await.status, "failed");
    assert_eq!(
        table.row(blocked).await.status,
        "pending",
        "a dead letter still holds back its aggregate"
    );
    finish(relay, table, rabbit).await;
}

/// A version-6 swap cut short on a partitioned table: the table's waiting index made `ON
/// ONLY` and every partition's attached but one, which is then dropped (retention, an
/// operator). The table's index stays INVALID with no partition left to attach; `migrate`
/// has PostgreSQL check it again and finishes the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_finishes_a_partitioned_swap_whose_last_partition_without_the_index_is_gone() {
    let table = TestTable::partitioned("part_swap", "1m").await;
    let (t, waiting) = (&table.name, format!("{}_waiting_idx", table.name));
    let def = "(aggregate_type, aggregate_id, seq) WHERE status IN ('pending', 'failed')";
    let mut cut_short = back_to_version_5(&table);
    cut_short.push_str(&format!("CREATE INDEX {waiting} ON ONLY {t} {def};"));
    let leaves = table.partitions().await;
    let gone = leaves.iter().rfind(|p| !p.ends_with("_default")).unwrap();
    for leaf in leaves.iter().filter(|p| *p != gone) {
        cut_short.push_str(&format!(
            "CREATE INDEX {leaf}_w ON {leaf} {def}; \
             ALTER INDEX {waiting} ATTACH PARTITION {leaf}_w;"
        ));
    }
    cut_short.push_str(&format!("DROP TABLE {gone};"));
    table.db.batch_execute(&cut_short).await.unwrap();
    assert_eq!(
        index_valid(&table, &waiting).await,
        Some(false),
        "cut short"
    );
    assert_eq!(
        partitions_without_index(&table, &waiting).await,
        Vec::<String>::new()
    );

    assert_migrates_from_version_5(&table).await;
    table.drop_table().await;
}

/// `n_tup_del` of `relation` as the statistics have it (`None` once it is gone).
async fn rows_deleted_from(table: &TestTable, relation: &str) -> Option<i64> {
    table
        .db
        .query_opt(
            "SELECT n_tup_del FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
            &[&relation],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_past_retention_holding_a_dead_letter_and_a_row_in_flight_is_dropped_whole_its_unfinished_rows_moved()
 {
    let table = TestTable::partitioned("part_leftovers", "1m").await;
    let rabbit = RabbitFixture::new("part_leftovers", "#", "it.barrier").await;
    let t = &table.name;
    let (old, default) = (format!("{t}_old"), format!("{t}_default"));
    // A partition of ten minutes ago (made by hand: the relay treats any range partition
    // alike) holding 900 sent rows, a dead letter, and a row of its aggregate waiting behind
    // it, which a row inserted now must wait for in turn.
    table
        .db
        .batch_execute(&format!(
            "CREATE TABLE {old} PARTITION OF {t} FOR VALUES \
               FROM (date_trunc('minute', now()) - interval '20 minutes') \
               TO (date_trunc('minute', now()) - interval '8 minutes'); \
             INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, created_at, sent_at) \
             SELECT 'part', 's-' || (n % 30), 'placed', '{{}}', 'sent', 1, \
                    now() - interval '10 minutes', now() - interval '10 minutes' \
               FROM generate_series(1, 900) n;"
        ))
        .await
        .unwrap();
    let dead = insert_at(&table, "d-0", "-10 minutes", "failed").await;
    let waiting = insert_at(&table, "d-0", "-10 minutes", "pending").await;
    let after = insert_at(&table, "d-0", "0 minutes", "pending").await;

    // A relay whose broker stops answering holds a row of the old partition in flight
    // (`processing`, its lease renewed) while another relay drops the partition. Its
    // retention is long: the partition work is the other relay's.
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let holder = relay(&table, &rabbit, "part-leftovers-holder")
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("publisher.rabbitmq.confirm_timeout", "120s")
        .set("cleanup.retention", "1h")
        .serving_metrics()
        .spawn();
    holder.wait_broker_connected(WAIT).await;
    proxy.stall();
    let in_flight = insert_at(&table, "h-0", "-10 minutes", "pending").await;
    let held = table
        .wait_row(in_flight, WAIT, "the row in flight", |r| {
            r.status == "processing"
        })
        .await;
    assert_eq!(partition_of(&table, in_flight).await, old);
    let before = table.rows_by_id(&[dead, waiting, in_flight]).await;
    assert_eq!(rows_deleted_from(&table, &old).await, Some(0));

    // Rows keep coming while the partition goes.
    let writer = spawn_paced_writer(t, 100, 5, Duration::from_millis(100), |round, i| {
        NewRow::new(
            "part",
            Some(&format!("w-{}", i % 4)),
            "written",
            serde_json::json!({ "r": round, "i": i }),
        )
    });
    let port = free_port();
    let relay = relay(&table, &rabbit, "part-leftovers")
        .set("cleanup.retention", "5m")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    // Dropped, not emptied row by row: its statistics never count a deleted row.
    let mut deleted = 0;
    wait_until(
        WAIT,
        "the old partition dropped",
        async || match rows_deleted_from(&table, &old).await {
            Some(n) => {
                deleted = deleted.max(n);
                Err(format!("{n} rows deleted from it so far"))
            }
            None => Ok(()),
        },
    )
    .await;
    assert_eq!(deleted, 0, "rows deleted one by one from {old}");
    assert!(!table.partitions().await.contains(&old));
    let outbox = [("outbox", t.as_str())];
    wait_for_sample(
        port,
        WAIT,
        "outbox_partitions_dropped_total",
        &outbox,
        |n| n >= 1.0,
    )
    .await;
    assert_eq!(
        table
            .count_where("created_at < now() - interval '8 minutes' AND status = 'sent'")
            .await,
        0,
        "the sent rows went with the partition"
    );

    // The unfinished rows are the same rows, in DEFAULT: id, seq, created_at, status, lease.
    let moved = table.rows_by_id(&[dead, waiting, in_flight]).await;
    for id in [dead, waiting, in_flight] {
        let (was, now) = (&before[&id], &moved[&id]);
        assert_eq!(partition_of(&table, id).await, default);
        assert_eq!(
            (
                now.seq,
                now.created_at,
                &now.status,
                now.attempts,
                &now.locked_by,
                now.locked_at
            ),
            (
                was.seq,
                was.created_at,
                &was.status,
                was.attempts,
                &was.locked_by,
                was.locked_at
            ),
            "{id} moved unchanged"
        );
    }
    assert_eq!(moved[&in_flight].locked_by, held.locked_by);
    assert_eq!(moved[&in_flight].status, "processing");

    // The dead letter is listed, counted and blocks its aggregate as before.
    let listed = RelayBuilder::operator(t)
        .output(&["dead-letters", "list", "--json"], WAIT)
        .await;
    assert!(listed.status.success(), "{}", listed.stderr);
    assert!(
        listed.stdout.contains(&dead.to_string()),
        "{}",
        listed.stdout
    );
    let status = RelayBuilder::operator(t)
        .output(&["status", "--json"], WAIT)
        .await;
    assert!(status.status.success(), "{}", status.stderr);
    let v: serde_json::Value = serde_json::from_str(&status.stdout).unwrap();
    assert_eq!(v["failed"], 1, "{v}");
    wait_for_sample(port, WAIT, "outbox_failed_messages", &outbox, |n| n == 1.0).await;
    wait_for_sample(port, WAIT, "outbox_blocked_aggregates", &outbox, |n| {
        n == 1.0
    })
    .await;

    // The relay that held the row in flight settles it where it now is.
    proxy.heal();
    table
        .wait_row(in_flight, WAIT, "the row in flight settled", |r| {
            r.status == "sent"
        })
        .await;
    // Retried, the dead letter goes out, then the rows of its aggregate behind it, in order.
    let out = RelayBuilder::operator(t)
        .output(&["dead-letters", "retry", "--id", &dead.to_string()], WAIT)
        .await;
    assert!(out.status.success(), "retry: {}", out.stderr);
    rabbit
        .wait_for_ids(&[dead, waiting, after, in_flight], WAIT)
        .await;

    writer.await.unwrap();
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let expected = table.rows().await;
    assert_eq!(expected.len(), 500 + 4, "nothing lost");
    rabbit
        .analyse(&expected)
        .assert_complete("a partition dropped under traffic");
    holder.stop().await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_drops_finished_partitions_and_keeps_one_with_too_many_dead_letters_whole_until_they_are_dealt_with()
 {
    let table = TestTable::partitioned("part_retention", "1m").await;
    let rabbit = RabbitFixture::new("part_retention", "#", "it.barrier").await;
    let t = &table.name;
    // Three partitions of half an hour ago, made by hand: one of sent and expired rows, one
    // holding more dead letters than retention moves, one holding a single dead letter.
    table
        .db
        .batch_execute(&format!(
            "CREATE TABLE {t}_old_a PARTITION OF {t} FOR VALUES \
               FROM (date_trunc('minute', now()) - interval '33 minutes') \
               TO (date_trunc('minute', now()) - interval '32 minutes'); \
             CREATE TABLE {t}_old_b PARTITION OF {t} FOR VALUES \
               FROM (date_trunc('minute', now()) - interval '32 minutes') \
               TO (date_trunc('minute', now()) - interval '31 minutes'); \
             CREATE TABLE {t}_old_c PARTITION OF {t} FOR VALUES \
               FROM (date_trunc('minute', now()) - interval '31 minutes') \
               TO (date_trunc('minute', now()) - interval '30 minutes');"
        ))
        .await
        .unwrap();
    for i in 0..5 {
        insert_at(&table, &format!("s-{i}"), "-33 minutes", "sent").await;
    }
    let expired = insert_at(&table, "x-0", "-33 minutes", "pending").await;
    table
        .db
        .execute(
            &format!("UPDATE {t} SET status = 'expired', expires_at = created_at WHERE id = $1"),
            &[&expired],
        )
        .await
        .unwrap();
    let kept_sent = insert_at(&table, "k-0", "-32 minutes", "sent").await;
    let many = MOVE_AT_MOST + 1;
    table
        .db
        .batch_execute(&format!(
            "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, created_at, last_error) \
             SELECT 'part', 'k-' || n, 'placed', '{{}}', 'failed', 1, \
                    date_trunc('minute', now()) - interval '32 minutes' + interval '1 second', 'refused by the test' \
               FROM generate_series(1, {many}) n"
        ))
        .await
        .unwrap();
    let retried = insert_at(&table, "r-0", "-31 minutes", "failed").await;
    assert_eq!(partition_of(&table, kept_sent).await, format!("{t}_old_b"));
    assert_eq!(partition_of(&table, retried).await, format!("{t}_old_c"));

    let port = free_port();
    let relay = relay(&table, &rabbit, "part-retention")
        .set("cleanup.retention", "5m")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .spawn();
    let outbox = [("outbox", t.as_str())];
    let kept = [("outbox", t.as_str()), ("reason", "failed")];
    wait_for_sample(port, WAIT, "outbox_partitions_kept", &kept, |n| n == 1.0).await;
    let parts = table.partitions().await;
    assert!(parts.contains(&format!("{t}_old_b")), "{parts:?}");
    for gone in ["a", "c"] {
        assert!(!parts.contains(&format!("{t}_old_{gone}")), "{parts:?}");
    }
    assert_eq!(table.count_where(&format!("id = '{expired}'")).await, 0);
    // The single dead letter moved to DEFAULT; the partition with too many stays whole: its
    // sent row is not deleted one by one (the gauge is set after the round's deletes).
    assert_eq!(partition_of(&table, retried).await, format!("{t}_default"));
    assert_eq!(table.count_where(&format!("id = '{kept_sent}'")).await, 1);
    assert_eq!(
        rows_deleted_from(&table, &format!("{t}_old_b")).await,
        Some(0)
    );
    let listed = RelayBuilder::operator(t)
        .output(&["dead-letters", "list", "--json", "--limit", "5000"], WAIT)
        .await;
    assert!(listed.status.success(), "{}", listed.stderr);
    assert!(listed.stdout.contains(&retried.to_string()));
    assert_eq!(
        listed.stdout.matches("refused by the test").count(),
        usize::try_from(many).unwrap() + 1
    );

    // Retried: relayed from DEFAULT. The rest discarded: their partition goes.
    let out = RelayBuilder::operator(t)
        .output(
            &["dead-letters", "retry", "--id", &retried.to_string()],
            WAIT,
        )
        .await;
    assert!(out.status.success(), "retry: {}", out.stderr);
    rabbit.wait_for_ids(&[retried], WAIT).await;
    let out = RelayBuilder::operator(t)
        .output(&["dead-letters", "discard", "--all"], WAIT)
        .await;
    assert!(out.status.success(), "discard: {}", out.stderr);
    wait_until(WAIT, "every old partition dropped", async || {
        let parts = table.partitions().await;
        let left: Vec<&String> = parts.iter().filter(|p| p.contains("_old_")).collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    })
    .await;
    let dropped = wait_for_sample(
        port,
        WAIT,
        "outbox_partitions_dropped_total",
        &outbox,
        |n| n >= 3.0,
    )
    .await;
    assert_eq!(dropped, 3.0);
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_table_is_partitioned_in_place_while_a_writer_inserts_and_a_relay_runs() {
    let table = TestTable::new("part_convert").await;
    let rabbit = RabbitFixture::new("part_convert", "#", "it.barrier").await;
    table
        .insert(&NewRow::numbered(3000, "conv", Some(("c-", 60)), "placed"))
        .await;
    let dead = insert_at(&table, "d-0", "-1 minute", "failed").await;
    // A relay of the plain table, started before the conversion and kept running through it.
    let running = RelayBuilder::for_test(&table, &rabbit, "part-convert")
        .ordered()
        .set("relay.batch_size", "50")
        .spawn();
    let writer = spawn_paced_writer(
        &table.name,
        60,
        10,
        Duration::from_millis(50),
        |round, i| {
            NewRow::new(
                "conv",
                Some(&format!("w-{}", i % 7)),
                "written",
                serde_json::json!({ "r": round, "i": i }),
            )
        },
    );
    // Migrate once the relay is well into the backlog (rows sent, pending and in flight).
    wait_until(WAIT, "500 rows sent", async || {
        match table.count_where("status = 'sent'").await {
            n if n >= 500 => Ok(()),
            n => Err(n.to_string()),
        }
    })
    .await;
    let out = migrate_partitioned(&table.name, "1m").await;
    assert!(
        out.status.success() && out.stdout.contains("partitioned by created_at every 1m"),
        "migrate: {}\n{}\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    writer.await.unwrap();
    table
        .wait_for_counts(WAIT, "every row but the dead letter sent", |c| {
            c.iter()
                .all(|(s, n)| s == "sent" || (s == "failed" && *n == 1) || *n == 0)
        })
        .await;
    rabbit.barrier().await;
    let expected: Vec<_> = table
        .rows()
        .await
        .into_iter()
        .filter(|r| r.id != dead)
        .collect();
    assert_eq!(expected.len(), 3600);
    let analysis = rabbit.analyse(&expected);
    analysis.assert_complete("conversion under traffic");
    assert!(
        analysis.duplicates <= 1000,
        "duplicates only for rows in flight: {}",
        analysis.duplicates
    );
    let parts = table.partitions().await;
    let t = &table.name;
    assert!(
        parts.contains(&format!("{t}_plain")) && parts.contains(&format!("{t}_default")),
        "{parts:?}"
    );
    assert_eq!(
        table.row(dead).await.status,
        "failed",
        "the dead letter is kept, visible"
    );
    // Rows inserted after the swap went into the partitioned table; the old rows stayed where
    // they were (nothing was copied).
    assert_eq!(partition_of(&table, dead).await, format!("{t}_plain"));
    finish(running, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_finishes_a_conversion_an_interrupted_run_left_half_done() {
    let table = TestTable::new("part_resume").await;
    let t = &table.name;
    table
        .insert(&NewRow::numbered(200, "resume", Some(("r-", 5)), "placed"))
        .await;
    // What a migrate killed after its first steps leaves: the key index INVALID (an
    // interrupted concurrent build) and a bound check NOT VALID whose bound is about to pass.
    let soon: String = table
        .db
        .query_one("SELECT (now() + interval '2 minutes')::text", &[])
        .await
        .unwrap()
        .get(0);
    table
        .db
        .batch_execute(&format!(
            "CREATE UNIQUE INDEX {t}_id_created_idx ON {t} (id, created_at); \
             UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{t}_id_created_idx'::regclass; \
             ALTER TABLE {t} ADD CONSTRAINT {t}_partition_bound CHECK (created_at < '{soon}') NOT VALID;"
        ))
        .await
        .unwrap();
    let out = migrate_partitioned(t, "1m").await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("dropping the INVALID index"),
        "{}",
        out.stderr
    );
    let bound: f64 = table
        .db
        .query_one(
            "SELECT extract(epoch FROM (regexp_match(pg_get_expr(c.relpartbound, c.oid), \
                    'TO \\(''([^'']+)''\\)'))[1]::timestamptz - now())::float8 \
               FROM pg_class c WHERE c.oid = to_regclass($1)",
            &[&format!("{t}_plain")],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        bound > 10.0 * 60.0,
        "a bound about to pass is made again, at least the margin ahead: {bound} s"
    );
    assert_eq!(table.count_where("true").await, 200, "nothing lost");
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_a_table_it_cannot_partition_and_says_what_to_do() {
    let table = TestTable::new("part_refuse").await;
    let t = &table.name;
    table
        .db
        .batch_execute(&format!(
            "CREATE UNIQUE INDEX {t}_event_key ON {t} (event_type, aggregate_id)"
        ))
        .await
        .unwrap();
    let out = migrate_partitioned(t, "1m").await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    for needle in [
        "database.partition_interval",
        t.as_str(),
        "cannot be partitioned",
        &format!("{t}_event_key"),
        "unset database.partition_interval",
    ] {
        assert!(out.stderr.contains(needle), "{needle:?} in {}", out.stderr);
    }
    let kind: String = table
        .db
        .query_one(
            "SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)",
            &[t],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kind, "r", "the table is left as it was");
    let bad = migrate_partitioned(t, "30s").await;
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        bad.stderr.contains("database.partition_interval"),
        "{}",
        bad.stderr
    );
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_while_it_creates_or_drops_a_partition_leaves_the_work_to_the_next_run() {
    let table = TestTable::partitioned("part_kill", "1m").await;
    let rabbit = RabbitFixture::new("part_kill", "#", "it.barrier").await;
    let t = &table.name;
    // Work for the relay: an old partition to drop, and the newest partition ahead missing.
    let newest = table
        .partitions()
        .await
        .into_iter()
        .filter(|p| p.contains("_p20"))
        .max()
        .unwrap();
    table
        .db
        .batch_execute(&format!(
            "DROP TABLE {newest}; \
             CREATE TABLE {t}_old_k PARTITION OF {t} FOR VALUES \
               FROM (date_trunc('minute', now()) - interval '20 minutes') \
               TO (date_trunc('minute', now()) - interval '19 minutes');"
        ))
        .await
        .unwrap();
    let rows = table
        .insert_ids(&NewRow::numbered(200, "kill", Some(("k-", 10)), "placed"))
        .await;
    // A transaction that read the table holds it: the relay's ATTACH and DETACH wait for it.
    let mut holder = common::pg_connect().await;
    let hold = holder.transaction().await.unwrap();
    hold.query(&format!("SELECT count(*) FROM {t}"), &[])
        .await
        .unwrap();
    let mut first = relay(&table, &rabbit, "part-kill-1")
        .set("cleanup.retention", "5m")
        .spawn();
    wait_until(WAIT, "the relay waiting for a lock on the table", async || {
        let waiting: i64 = table
            .db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                   AND application_name LIKE 'outbox-relay%' AND query ~* '(ATTACH|DETACH) PARTITION'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 { Ok(()) } else { Err("not yet".to_owned()) }
    })
    .await;
    first.sigkill();
    first.wait_exit(WAIT).await;
    hold.rollback().await.unwrap();
    drop(holder);
    // Nothing half made: the partition being created does not exist, the old one is attached.
    let leftover: bool = table
        .db
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&newest])
        .await
        .unwrap()
        .get(0);
    assert!(!leftover, "{newest} left behind by a killed creation");
    assert!(table.partitions().await.contains(&format!("{t}_old_k")));

    let second = relay(&table, &rabbit, "part-kill-2")
        .set("cleanup.retention", "5m")
        .spawn();
    wait_until(
        WAIT,
        "the next run made the partition and dropped the old one",
        async || {
            let parts = table.partitions().await;
            if parts.contains(&newest) && !parts.iter().any(|p| p.ends_with("_old_k")) {
                Ok(())
            } else {
                Err(format!("{parts:?}"))
            }
        },
    )
    .await;
    table.wait_all_sent(WAIT).await;
    rabbit.barrier().await;
    let expected = table.rows().await;
    assert_eq!(expected.len(), rows.len());
    rabbit
        .analyse(&expected)
        .assert_complete("across a kill -9");
    finish(second, table, rabbit).await;
}
