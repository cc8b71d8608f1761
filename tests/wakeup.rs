//! The wake-up of schema version 3, against the real binary, PostgreSQL and RabbitMQ: an idle
//! relay is woken within milliseconds, a busy one costs the application no NOTIFY, nor does
//! one that keeps up with a steady writer (it lingers before it waits), a row that
//! commits while the relay goes idle is not left for the poll, a relay that dies while waiting
//! stops costing NOTIFYs, and a version-1 table is upgraded in place with rows pending and in
//! flight.

// Tests fail by panicking: unwrap/expect are the clearest way to say "this must work here".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{
    NewRow, PG_URL, RabbitFixture, RelayBuilder, TestTable, finish, insert_rows, pg_connect,
    table_and_exchange, wait_until,
};
use futures::StreamExt;
use outbox_relay::config::TableName;
use outbox_relay::store::schema;
use serde_json::json;
use tokio_postgres::{AsyncMessage, NoTls};
use uuid::Uuid;

fn row(i: usize) -> NewRow {
    NewRow::new(
        "wake",
        Some(&format!("a{}", i % 7)),
        "tick",
        json!({ "i": i }),
    )
}

/// A LISTEN session on `channel` counting the notifications it receives.
struct NotifyCounter {
    count: Arc<AtomicUsize>,
    _client: tokio_postgres::Client,
}

impl NotifyCounter {
    async fn start(channel: &str) -> Self {
        let (client, mut conn) = tokio_postgres::connect(PG_URL, NoTls).await.unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&count);
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
            while let Some(Ok(m)) = messages.next().await {
                if let AsyncMessage::Notification(_) = m {
                    seen.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
        client
            .batch_execute(&format!("LISTEN \"{channel}\""))
            .await
            .unwrap();
        Self {
            count,
            _client: client,
        }
    }

    fn get(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// The relay instances with a waiting record on `table`.
async fn waiters(table: &TestTable) -> Vec<(String, i32)> {
    table
        .db
        .query(
            &format!(
                "SELECT relay, pid FROM {}_waiters ORDER BY relay",
                table.name
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

async fn wait_for_waiter(table: &TestTable, instance: &str) {
    wait_until(
        Duration::from_secs(20),
        &format!("{instance} records that it waits"),
        async || {
            let w = waiters(table).await;
            if w.iter().any(|(r, _)| r == instance) {
                Ok(())
            } else {
                Err(format!("{w:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_is_woken_by_each_commit_and_a_busy_one_costs_no_notify() {
    let (table, rabbit) = table_and_exchange("wake_idle").await;
    // A long poll: a row that waited for it would take seconds.
    let relay = RelayBuilder::for_test(&table, &rabbit, "wake-idle")
        .set("relay.poll_interval", "10s")
        .spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
    wait_for_waiter(&table, "wake-idle").await;
    let counter = NotifyCounter::start(&table.name).await;
    let db = pg_connect().await;

    // One row at a time into the idle relay: each commit notifies once and wakes it (the
    // latency target itself is measured alone in tests/latency.rs).
    let mut slowest = Duration::ZERO;
    for i in 0..15 {
        // Let the relay settle the previous row, linger (200 ms after its last rows) and
        // record that it waits again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        wait_for_waiter(&table, "wake-idle").await;
        let id = insert_rows(&db, &table.name, &[row(i)]).await[0].id;
        let committed = Instant::now();
        let got = rabbit.wait_for_delivery(id, Duration::from_secs(30)).await;
        slowest = slowest.max(got.received_at.saturating_duration_since(committed));
    }
    let idle_notifies = counter.get();
    eprintln!(
        "15 one-row transactions into an idle relay: {idle_notifies} NOTIFYs, slowest received {slowest:?} after commit"
    );
    assert!(
        slowest < Duration::from_secs(2),
        "a row waited {slowest:?}: the relay was not woken"
    );
    assert!(idle_notifies >= 14, "only {idle_notifies} NOTIFYs");

    // Busy: a backlog keeps the relay claiming full batches while the application commits
    // one row per transaction; the relay has no waiting record, so they do not notify.
    let backlog: Vec<NewRow> = (0..30_000).map(row).collect();
    for chunk in backlog.chunks(5_000) {
        insert_rows(&db, &table.name, chunk).await;
    }
    wait_until(
        Duration::from_secs(10),
        "the relay is busy (no waiting record)",
        async || {
            if waiters(&table).await.is_empty() {
                Ok(())
            } else {
                Err("still waiting".into())
            }
        },
    )
    .await;
    let before = counter.get();
    let mut busy_commits = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while table.count_where("status = 'pending'").await > 3_000 && Instant::now() < deadline {
        insert_rows(&db, &table.name, &[row(busy_commits)]).await;
        busy_commits += 1;
    }
    let busy_notifies = counter.get() - before;
    eprintln!(
        "NOTIFYs for {busy_commits} one-row transactions beside a busy relay: {busy_notifies}"
    );
    assert!(busy_commits >= 50, "only {busy_commits} commits while busy");
    assert!(
        busy_notifies * 20 <= busy_commits,
        "{busy_notifies} NOTIFYs for {busy_commits} commits beside a busy relay"
    );
    table.wait_all_sent(Duration::from_secs(60)).await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_keeping_up_with_a_steady_writer_lingers_and_costs_no_notify() {
    let (table, rabbit) = table_and_exchange("wake_linger").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "wake-linger")
        .set("relay.poll_interval", "10s")
        .spawn();
    wait_for_waiter(&table, "wake-linger").await;
    let counter = NotifyCounter::start(&table.name).await;
    let db = pg_connect().await;
    // A writer committing a row every 20 ms, well under the relay's rate: after the first row
    // wakes it, the relay catches up after every row and goes idle, but lingers (polling on a
    // short delay) instead of recording that it waits, so the later commits do not notify.
    let mut sent = Vec::new();
    for i in 0..100 {
        let id = insert_rows(&db, &table.name, &[row(i)]).await[0].id;
        sent.push((id, Instant::now()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let notifies = counter.get();
    // Without a NOTIFY the rows were found by the lingering polls, not the 10 s poll.
    let mut slowest = Duration::ZERO;
    for (id, committed) in sent {
        let got = rabbit.wait_for_delivery(id, Duration::from_secs(20)).await;
        slowest = slowest.max(got.received_at.saturating_duration_since(committed));
    }
    eprintln!(
        "100 rows 20 ms apart beside a relay with a 10 s poll: {notifies} NOTIFYs, slowest received {slowest:?} after commit"
    );
    assert!(
        notifies <= 5,
        "{notifies} NOTIFYs for 100 commits: the relay kept marking itself waiting"
    );
    assert!(
        slowest < Duration::from_secs(2),
        "a row waited {slowest:?}: the relay neither lingered nor was woken"
    );
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_only_never_notifies() {
    let (table, rabbit) = table_and_exchange("wake_poll_only").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "wake-poll")
        .set("relay.notify", "false")
        .set("relay.poll_interval", "200ms")
        .spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
    let counter = NotifyCounter::start(&table.name).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(table.insert(&[row(i)]).await[0].id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rabbit.wait_for_ids(&ids, Duration::from_secs(20)).await;
    assert!(waiters(&table).await.is_empty());
    assert_eq!(counter.get(), 0, "a polling relay made inserts notify");
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committing_while_the_relay_goes_idle_is_not_left_for_the_poll() {
    let (table, rabbit) = table_and_exchange("wake_race").await;
    // Widen the window between a transaction's wake-up check and its commit: a second deferred
    // trigger, fired after the wake-up one (triggers fire in name order), sleeps 2 s.
    table
        .db
        .batch_execute(&format!(
            "CREATE FUNCTION {t}_slow() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER zz_slow AFTER INSERT ON {t} \
               DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {t}_slow();",
            t = table.name
        ))
        .await
        .unwrap();
    // The transaction passes its check while no relay waits (none runs yet), so it will not
    // notify; then it sleeps before its commit becomes visible.
    let name = table.name.clone();
    let writer = tokio::spawn(async move {
        let db = pg_connect().await;
        let id = insert_rows(&db, &name, &[row(1)]).await[0].id;
        (id, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The relay starts meanwhile: its claims find nothing, it records that it waits and would
    // sleep its 30 s poll, were it not for the transaction still running.
    let relay = RelayBuilder::for_test(&table, &rabbit, "wake-race")
        .set("relay.ordering", "none")
        .set("relay.poll_interval", "30s")
        .spawn();
    wait_for_waiter(&table, "wake-race").await;
    let (id, committed) = writer.await.unwrap();
    let got = rabbit.wait_for_delivery(id, Duration::from_secs(20)).await;
    let waited = got.received_at.saturating_duration_since(committed);
    eprintln!("row committed while the relay went idle: received {waited:?} after its commit");
    assert!(
        waited < Duration::from_secs(1),
        "the row waited {waited:?} (the poll is 30 s)"
    );
    relay.stop().await;
    rabbit.teardown().await;
    table
        .db
        .batch_execute(&format!("DROP FUNCTION {}_slow() CASCADE", table.name))
        .await
        .unwrap();
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_waiting_stops_costing_notifies() {
    let (table, rabbit) = table_and_exchange("wake_dead").await;
    // poll 200 ms: a waiting record lives 3 polls + 2 s = 2.6 s without renewal.
    let mut relay = RelayBuilder::for_test(&table, &rabbit, "wake-dead")
        .set("relay.poll_interval", "200ms")
        .spawn();
    wait_for_waiter(&table, "wake-dead").await;
    relay.sigkill();
    relay.wait_exit(Duration::from_secs(10)).await;
    let counter = NotifyCounter::start(&table.name).await;
    // Its record outlives it for a moment (the trigger does not look at the pid: too costly
    // per commit); then the trigger ignores it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(waiters(&table).await.len(), 1, "the dead relay's record");
    let before = counter.get();
    for i in 0..20 {
        table.insert(&[row(i)]).await;
    }
    // NOTIFYs are delivered at commit; give the LISTEN session a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        counter.get() - before,
        0,
        "commits still notify for a relay that died"
    );

    // A live relay deletes the dead one's record (its LISTEN session is gone) and drains.
    let other = RelayBuilder::for_test(&table, &rabbit, "wake-alive")
        .set("relay.poll_interval", "200ms")
        .spawn();
    wait_until(
        Duration::from_secs(20),
        "the dead relay's record is deleted",
        async || {
            let w = waiters(&table).await;
            if w.iter().all(|(r, _)| r != "wake-dead") {
                Ok(())
            } else {
                Err(format!("{w:?}"))
            }
        },
    )
    .await;
    table.wait_all_sent(Duration::from_secs(20)).await;
    // And an insert into the idle live relay notifies again.
    wait_for_waiter(&table, "wake-alive").await;
    let before = counter.get();
    let id = table.insert(&[row(99)]).await[0].id;
    rabbit.wait_for_ids(&[id], Duration::from_secs(2)).await;
    assert!(counter.get() > before, "no NOTIFY for a live waiting relay");
    finish(other, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_table_is_upgraded_in_place_with_rows_pending_and_in_flight() {
    // A table as version 1 made it: its DDL only, recorded at version 1, with the statement
    // trigger that notified on every insert.
    let name = format!("it_wake_upgrade_{}", common::hex8());
    let db = pg_connect().await;
    let t = TableName::parse(&name).unwrap();
    db.batch_execute(schema::VERSION_TABLE_DDL).await.unwrap();
    db.batch_execute(&schema::render(schema::MIGRATIONS[0].sql, &t))
        .await
        .unwrap();
    db.execute(
        "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, 1)",
        &[&name],
    )
    .await
    .unwrap();
    let rows: Vec<NewRow> = (0..300).map(row).collect();
    let inserted: Vec<Uuid> = insert_rows(&db, &name, &rows)
        .await
        .iter()
        .map(|r| r.id)
        .collect();
    // 100 of them in flight: claimed by a version-1 relay that is gone, its lease running.
    db.execute(
        &format!(
            "UPDATE {name} SET status = 'processing', attempts = 1, locked_by = 'v1-relay', \
               locked_at = now() WHERE id IN (SELECT id FROM {name} ORDER BY seq LIMIT 100)"
        ),
        &[],
    )
    .await
    .unwrap();

    let rabbit = RabbitFixture::new("wake_upgrade", "#", "barrier.x").await;
    let relay = RelayBuilder::bare("wake-upgrade")
        .set("database.url", PG_URL)
        .set("database.table", &name)
        .set("database.auto_migrate", "true")
        .set("publisher.rabbitmq.url", common::AMQP_URL)
        .set("publisher.rabbitmq.exchange", &rabbit.exchange)
        .set("metrics.listen", "")
        .set("relay.instance_id", "wake-upgrade")
        .set("relay.lease_timeout", "2s")
        .set("relay.poll_interval", "10s")
        .spawn();
    relay
        .wait_for_log("applied schema migrations", 1, Duration::from_secs(30))
        .await;
    rabbit
        .wait_for_ids(&inserted, Duration::from_secs(30))
        .await;

    let version: i32 = db
        .query_one(
            "SELECT version FROM outbox_relay_schema_version WHERE table_name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 3);
    let triggers: Vec<(String, bool)> = db
        .query(
            "SELECT tgname, tgdeferrable FROM pg_trigger WHERE tgrelid = $1::text::regclass AND NOT tgisinternal",
            &[&name],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(triggers, vec![(format!("{name}_wakeup"), true)]);

    // The upgraded table wakes the idle relay at once (the poll is 10 s).
    wait_until(
        Duration::from_secs(20),
        "the relay records that it waits",
        async || {
            let n: i64 = db
                .query_one(&format!("SELECT count(*) FROM {name}_waiters"), &[])
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            if n == 1 { Ok(()) } else { Err(format!("{n}")) }
        },
    )
    .await;
    let id = insert_rows(&db, &name, &[row(1)]).await[0].id;
    rabbit.wait_for_ids(&[id], Duration::from_secs(2)).await;
    let unsent: i64 = db
        .query_one(
            &format!("SELECT count(*) FROM {name} WHERE status <> 'sent'"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unsent, 0);
    relay.stop().await;
    rabbit.teardown().await;
    db.batch_execute(&format!(
        "DROP TABLE {name} CASCADE; DROP TABLE {name}_waiters; \
         DROP FUNCTION IF EXISTS {name}_next_seq(); DROP FUNCTION IF EXISTS {name}_wakeup(); \
         DELETE FROM outbox_relay_schema_version WHERE table_name = '{name}';"
    ))
    .await
    .unwrap();
}
