//! The wake-up (schema versions 3 and 4), against the real binary, PostgreSQL and RabbitMQ: an idle
//! relay is woken within milliseconds, one that keeps up with a steady writer costs the
//! application no NOTIFY (it lingers before it waits), nor does a busy one; a relay that only
//! polls never makes a commit notify, a row that commits while the relay goes idle is not left
//! for the poll, a relay that dies while waiting stops costing NOTIFYs, and a bulk load (COPY,
//! INSERT … SELECT) runs the wake-up once per transaction, not once per row, and a table
//! configured with its schema (`public.t`) is woken on the channel it was migrated under (`t`). (A version-1 table
//! upgraded in place to the wake-up trigger: tests/ops.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{
    NewRow, PG_URL, RabbitFixture, RelayBuilder, TestTable, finish, insert_rows, pg_connect,
    table_and_exchange, wait_for_count, wait_until,
};
use futures::StreamExt;
use serde_json::json;
use tokio_postgres::{AsyncMessage, NoTls};

/// How long a waiting record, a delivery or the drain may take to appear.
const WAIT: Duration = Duration::from_secs(20);

/// The poll interval of the relays that must be woken: a row that arrives long before it was
/// not found by the poll. Not a latency target (that is `outbox-bench --only latency`'s).
const POLL: &str = "30s";

/// Well before [`POLL`], with room for a loaded machine.
const WELL_BEFORE_THE_POLL: Duration = Duration::from_secs(10);

fn row(i: usize) -> NewRow {
    let aggregate = format!("a{}", i % 7);
    NewRow::new("wake", Some(&aggregate), "tick", json!({ "i": i }))
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
        let listen = format!("LISTEN \"{channel}\"");
        client.batch_execute(&listen).await.unwrap();
        Self {
            count,
            _client: client,
        }
    }

    fn get(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// `run` for `table` and `rabbit` as `instance`, polling every `poll` when not woken.
fn relay(table: &TestTable, rabbit: &RabbitFixture, instance: &str, poll: &str) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, instance).set("relay.poll_interval", poll)
}

/// Waits until `instance` has a waiting record on `table`.
async fn wait_for_waiter(table: &TestTable, instance: &str) {
    let what = format!("{instance} records that it waits");
    let waiting = |w: &[String]| w.iter().any(|r| r == instance);
    table.wait_waiters(WAIT, &what, waiting).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_is_woken_by_each_commit_and_a_lingering_or_busy_one_costs_no_notify() {
    let (table, rabbit) = table_and_exchange("wake_idle").await;
    // A long poll: a row that waited for it would take seconds.
    let relay = relay(&table, &rabbit, "wake-idle", POLL)
        .serving_metrics()
        .spawn();
    relay.wait_broker_connected(Duration::from_secs(30)).await;
    wait_for_waiter(&table, "wake-idle").await;
    let counter = NotifyCounter::start(&table.name).await;

    // One row at a time into the idle relay: each commit notifies once and wakes it (its
    // latency is the benchmark's to measure: `outbox-bench --only latency`).
    let mut slowest = Duration::ZERO;
    for i in 0..15 {
        // Let the relay settle the previous row, linger (200 ms after its last rows) and
        // record that it waits again.
        tokio::time::sleep(Duration::from_millis(300)).await;
        wait_for_waiter(&table, "wake-idle").await;
        let id = table.insert_one(row(i)).await;
        let committed = Instant::now();
        let got = rabbit.wait_for_delivery(id, Duration::from_secs(30)).await;
        slowest = slowest.max(got.received_at.saturating_duration_since(committed));
    }
    let idle_notifies = counter.get();
    eprintln!(
        "15 one-row transactions into an idle relay: {idle_notifies} NOTIFYs, slowest received {slowest:?} after commit"
    );
    assert!(
        slowest < WELL_BEFORE_THE_POLL,
        "a row waited {slowest:?}: the relay was not woken (its poll is {POLL})"
    );
    assert!(idle_notifies >= 14, "only {idle_notifies} NOTIFYs");

    // A writer committing a row every 20 ms, well under the relay's rate: after the first row
    // wakes it, the relay catches up after every row and goes idle, but lingers (polling on a
    // short delay) instead of recording that it waits, so the later commits do not notify.
    wait_for_waiter(&table, "wake-idle").await;
    let before = counter.get();
    let mut sent = Vec::new();
    for i in 0..100 {
        let id = table.insert_one(row(i)).await;
        sent.push((id, Instant::now()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let notifies = counter.get() - before;
    // Without a NOTIFY the rows were found by the lingering polls, not the 30 s poll.
    let mut slowest = Duration::ZERO;
    for (id, committed) in sent {
        let got = rabbit.wait_for_delivery(id, WAIT).await;
        slowest = slowest.max(got.received_at.saturating_duration_since(committed));
    }
    eprintln!(
        "100 rows 20 ms apart beside a relay with a 30 s poll: {notifies} NOTIFYs, slowest received {slowest:?} after commit"
    );
    assert!(
        notifies <= 5,
        "{notifies} NOTIFYs for 100 commits: the relay kept marking itself waiting"
    );
    assert!(
        slowest < WELL_BEFORE_THE_POLL,
        "a row waited {slowest:?}: the relay neither lingered nor was woken (its poll is {POLL})"
    );

    // Busy: a backlog keeps the relay claiming full batches while the application commits
    // one row per transaction; the relay has no waiting record, so they do not notify.
    let backlog: Vec<NewRow> = (0..30_000).map(row).collect();
    for chunk in backlog.chunks(5_000) {
        table.insert(chunk).await;
    }
    let what = "the relay is busy (no waiting record)";
    table
        .wait_waiters(Duration::from_secs(10), what, <[String]>::is_empty)
        .await;
    let before = counter.get();
    let mut busy_commits = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while table.count_where("status = 'pending'").await > 3_000 && Instant::now() < deadline {
        table.insert_one(row(busy_commits)).await;
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

/// A table migrated as `t` and configured as `public.t`: its trigger notifies the channel `t`;
/// the relay says so once and listens there, and is woken as promptly as with the name as
/// migrated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_configured_with_its_schema_is_woken_on_the_channel_it_was_migrated_under() {
    let (table, rabbit) = table_and_exchange("wake_qualified").await;
    let relay = relay(&table, &rabbit, "wake-qualified", POLL)
        .set("database.table", format!("public.{}", table.name))
        .spawn();
    wait_for_waiter(&table, "wake-qualified").await;
    let said = "listening on the trigger's channel";
    relay.wait_for_log(said, 1, WAIT).await;
    let id = table.insert_one(row(1)).await;
    let inserted = Instant::now();
    let got = rabbit.wait_for_delivery(id, WAIT).await;
    let waited = got.received_at.saturating_duration_since(inserted);
    assert!(
        waited < WELL_BEFORE_THE_POLL,
        "the row waited {waited:?} (the poll is {POLL}): the relay was not woken"
    );
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_only_never_notifies() {
    let (table, rabbit) = table_and_exchange("wake_poll_only").await;
    let relay = relay(&table, &rabbit, "wake-poll", "200ms")
        .set("relay.notify", "false")
        .spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
    let counter = NotifyCounter::start(&table.name).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(table.insert_one(row(i)).await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    rabbit.wait_for_ids(&ids, WAIT).await;
    assert!(table.waiters().await.is_empty());
    assert_eq!(counter.get(), 0, "a polling relay made inserts notify");
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committing_while_the_relay_goes_idle_is_not_left_for_the_poll() {
    let (table, rabbit) = table_and_exchange("wake_race").await;
    // Widen the window between a transaction's wake-up check and its commit: a second deferred
    // trigger, fired after the wake-up one (triggers fire in name order), sleeps 2 s.
    let slow = format!(
        "CREATE FUNCTION {t}_slow() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER zz_slow AFTER INSERT ON {t} \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {t}_slow();",
        t = table.name
    );
    table.db.batch_execute(&slow).await.unwrap();
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
    let relay = relay(&table, &rabbit, "wake-race", POLL)
        .set("relay.ordering", "none")
        .spawn();
    wait_for_waiter(&table, "wake-race").await;
    let (id, committed) = writer.await.unwrap();
    let got = rabbit.wait_for_delivery(id, WAIT).await;
    let waited = got.received_at.saturating_duration_since(committed);
    eprintln!("row committed while the relay went idle: received {waited:?} after its commit");
    assert!(
        waited < WELL_BEFORE_THE_POLL,
        "the row waited {waited:?} (the poll is {POLL})"
    );
    let drop_slow = format!("DROP FUNCTION {}_slow() CASCADE", table.name);
    table.db.batch_execute(&drop_slow).await.unwrap();
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_dies_waiting_stops_costing_notifies() {
    let (table, rabbit) = table_and_exchange("wake_dead").await;
    // poll 200 ms: a waiting record lives 3 polls + 2 s = 2.6 s without renewal.
    let mut dead = relay(&table, &rabbit, "wake-dead", "200ms").spawn();
    wait_for_waiter(&table, "wake-dead").await;
    dead.sigkill();
    dead.wait_exit(Duration::from_secs(10)).await;
    let counter = NotifyCounter::start(&table.name).await;
    // Its record outlives it for a moment (the trigger does not look at the pid: too costly
    // per commit); then the trigger ignores it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(table.waiters().await.len(), 1, "the dead relay's record");
    let before = counter.get();
    for i in 0..20 {
        table.insert(&[row(i)]).await;
    }
    // NOTIFYs are delivered at commit; give the LISTEN session a moment.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let notified = counter.get() - before;
    assert_eq!(notified, 0, "commits still notify for a relay that died");

    // A live relay deletes the dead one's record (its LISTEN session is gone) and drains.
    let other = relay(&table, &rabbit, "wake-alive", "200ms").spawn();
    let what = "the dead relay's record is deleted";
    let gone = |w: &[String]| w.iter().all(|r| r != "wake-dead");
    table.wait_waiters(WAIT, what, gone).await;
    table.wait_all_sent(WAIT).await;
    // And an insert into the idle live relay notifies again.
    wait_for_waiter(&table, "wake-alive").await;
    let before = counter.get();
    let id = table.insert_one(row(99)).await;
    rabbit.wait_for_ids(&[id], WAIT).await;
    assert!(counter.get() > before, "no NOTIFY for a live waiting relay");
    finish(other, table, rabbit).await;
}

/// Times the wake-up function `<table>_wakeup` has run, as PostgreSQL's function statistics
/// count them (sessions that set `track_functions`; flushed within about a second).
async fn wakeup_calls(table: &TestTable) -> i64 {
    let sql = "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_user_functions \
               WHERE funcid = to_regproc($1)::oid";
    let function = format!("{}_wakeup", table.name);
    table.db.query_one(sql, &[&function]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_load_fires_the_wake_up_once_per_transaction() {
    let (table, rabbit) = table_and_exchange("wake_bulk").await;
    // A long poll: only the wake-up brings the rows out well before it.
    let relay = relay(&table, &rabbit, "wake-bulk", "60s").spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
    wait_for_waiter(&table, "wake-bulk").await;
    let counter = NotifyCounter::start(&table.name).await;

    // One transaction: a COPY of 2,000 rows, then an INSERT … SELECT of 2,000 more.
    let mut app = pg_connect().await;
    app.batch_execute("SET track_functions = 'pl'")
        .await
        .unwrap();
    let tx = app.transaction().await.unwrap();
    let copy = format!(
        "COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN",
        table.name
    );
    let lines: String = (0..2_000)
        .map(|i| format!("bulk\ta{}\tcopied\t{{\"i\": {i}}}\n", i % 7))
        .collect();
    let sink = tx.copy_in::<_, &'static [u8]>(&copy).await.unwrap();
    futures::pin_mut!(sink);
    futures::SinkExt::send(&mut sink, Box::leak(lines.into_boxed_str()).as_bytes())
        .await
        .unwrap();
    assert_eq!(sink.finish().await.unwrap(), 2_000);
    let select = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) \
         SELECT 'bulk', 'b' || (i % 7), 'selected', jsonb_build_object('i', i) \
         FROM generate_series(1, 2000) i",
        table.name
    );
    assert_eq!(tx.execute(&select, &[]).await.unwrap(), 2_000);
    tx.commit().await.unwrap();

    // The relay is woken (well within its 60 s poll) and relays every row.
    let received = || rabbit.count();
    let woken = Duration::from_secs(30);
    wait_for_count(woken, "the first rows arrive", 1, received).await;
    table.wait_all_sent(Duration::from_secs(60)).await;
    // Sent means confirmed by the broker, not yet received by the test's consumer.
    rabbit.barrier().await;
    assert_eq!(rabbit.count(), 4_000);
    // The trigger's WHEN queued one event for the whole transaction: its function ran once.
    let calls = wait_until(
        WAIT,
        "the wake-up's call is counted",
        async || match wakeup_calls(&table).await {
            0 => Err("no call counted yet".to_owned()),
            n => Ok(n),
        },
    )
    .await;
    assert_eq!(
        calls, 1,
        "wake-up function calls for one 4,000-row transaction"
    );
    assert_eq!(counter.get(), 1, "NOTIFYs for one transaction");

    // A savepoint rolled back after the first row takes its event along: the next row of the
    // transaction queues one again.
    let tx = app.transaction().await.unwrap();
    let one = format!(
        "INSERT INTO {} (event_type, payload) VALUES ('undone', '{{}}')",
        table.name
    );
    tx.batch_execute(&format!("SAVEPOINT s; {one}; ROLLBACK TO SAVEPOINT s"))
        .await
        .unwrap();
    let kept = one.replace("undone", "kept");
    tx.batch_execute(&format!("{kept}; {kept}")).await.unwrap();
    tx.commit().await.unwrap();
    let calls = wait_until(
        WAIT,
        "the second transaction's call is counted",
        async || match wakeup_calls(&table).await {
            1 => Err("still one call".to_owned()),
            n => Ok(n),
        },
    )
    .await;
    assert_eq!(calls, 2, "one more call for the second transaction");
    table.wait_all_sent(WAIT).await;
    finish(relay, table, rabbit).await;
}
