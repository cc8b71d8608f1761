//! The wake-up of schema version 3, against the real binary, PostgreSQL and RabbitMQ: an idle
//! relay is woken within milliseconds, one that keeps up with a steady writer costs the
//! application no NOTIFY (it lingers before it waits), nor does a busy one; a relay that only
//! polls never makes a commit notify, a row that commits while the relay goes idle is not left
//! for the poll, and a relay that dies while waiting stops costing NOTIFYs. (A version-1 table
//! upgraded in place to the wake-up trigger: tests/ops.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{
    NewRow, PG_URL, RabbitFixture, RelayBuilder, TestTable, finish, insert_rows, pg_connect,
    table_and_exchange,
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
    let relay = relay(&table, &rabbit, "wake-idle", POLL).spawn();
    relay
        .wait_for_log("connected to the broker", 1, Duration::from_secs(30))
        .await;
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
