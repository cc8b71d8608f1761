//! Failover (docs/operations.md#failover): the relay on a primary and its synchronous streaming
//! standby (the test kit's [`PgPair`]: its own two servers on loopback) through the multi-host
//! URL `postgres://…@primary,standby/test?target_session_attrs=read-write`, with writers
//! inserting through the same URL and `ordering = "aggregate"`, to RabbitMQ.
//!
//! 1. The primary crashes (`pg_ctl stop -m immediate`) mid-drain and the standby is promoted;
//!    again with a writer's transaction open on the primary at the crash, holding the ordered
//!    rows after it back: once the primary is gone, that writer must hold nothing back.
//! 2. The primary is turned read-only (every write fails with SQLSTATE 25006) mid-drain, then
//!    the standby is promoted while the old primary keeps running, read-only: the relay must
//!    leave the sessions it has there (pool and LISTEN) for the new primary.
//!
//! In both: `/readyz` fails during the outage and recovers, `run` does not exit, nothing is
//! dead-lettered or charged an attempt for the outage, every row is delivered with its
//! aggregate's order kept. A crash can undo the relay's last commits (its sessions commit with
//! `synchronous_commit = off`), so the first scenario allows duplicates (at most
//! `relay.max_in_flight` here, each row's extra attempt paid by an extra delivery); the
//! planned switchover of the second loses nothing, so every row arrives exactly once on its
//! first attempt. The leases are shorter than the default, so rows whose settle the crash
//! undid come back soon, and longer than the outage, so no settle in flight is given up.
//!
//! Both print one `FAULT-SUMMARY` line (as `tests/faults.rs` does); `OUTBOX_SOAK=1`
//! (`scripts/soak.sh`) makes each outage longer and repeats the crash on a fresh pair.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{
    Analysis, NewRow, PgPair, RabbitFixture, RelayBuilder, RelayProcess, RowState, TestTable,
    assert_none, free_port, http_get, insert_rows, local, not_sent_once, spawn_steady_writer_at,
    wait_for_count, wait_for_sample, wait_until,
};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Generous: the pair, the writers and the relay share a 2-core machine with other tests.
const LONG: Duration = Duration::from_secs(180);

/// The relay's in-flight window in these tests: the bound on duplicates a crash may cause.
const MAX_IN_FLIGHT: usize = 200;

/// Rows dead-lettered or left with a spent attempt (`pending` with attempts > 0).
const SPENT: &str = "status = 'failed' OR (status = 'pending' AND attempts > 0)";

/// `OUTBOX_SOAK=1` selects the long form.
fn soak() -> bool {
    std::env::var("OUTBOX_SOAK").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// How long an outage is held before the standby is promoted.
fn outage() -> Duration {
    Duration::from_secs(if soak() { 15 } else { 3 })
}

/// A pair, an outbox table on it, an exchange, writers inserting through the pair's URL and
/// a relay with its metrics server on `port`.
struct Failover {
    pair: PgPair,
    table: TestTable,
    rabbit: RabbitFixture,
    relay: RelayProcess,
    port: u16,
    writer: (CancellationToken, JoinHandle<usize>),
}

impl Failover {
    /// Starts everything, then waits until rows flow (300 delivered) and `/readyz` answers 200.
    async fn start(test: &str, lease: &str) -> Self {
        let pair = PgPair::start(test).await;
        let url = pair.url();
        let table = TestTable::at(&url, test).await;
        let rabbit = RabbitFixture::new(test, "#", "it.barrier").await;
        let port = free_port();
        let relay = RelayBuilder::for_test(&table, &rabbit, test)
            .ordered()
            .set("database.url", &url)
            .set("metrics.listen", format!("127.0.0.1:{port}"))
            .set("relay.lease_timeout", lease)
            .set("relay.max_in_flight", MAX_IN_FLIGHT.to_string())
            .set("relay.batch_size", "50")
            .env("RUST_LOG", "info,lapin=warn,outbox_relay::relay=debug")
            .spawn();
        let writer = spawn_steady_writer_at(&url, &table.name, "fo", 40, 10);
        let what = "300 messages before the fault";
        wait_for_count(LONG, what, 300, || rabbit.count()).await;
        wait_ready(port, 200).await;
        Self {
            pair,
            table,
            rabbit,
            relay,
            port,
            writer,
        }
    }

    /// After the promotion: the test's own session moves to the new primary, `/readyz`
    /// answers 200 again and a row inserted now is delivered. Returns how long after the
    /// promotion that row was delivered.
    async fn recovers(&mut self, promoted: Instant) -> Duration {
        self.table.db = self.pair.wait_for_writable(LONG).await;
        wait_ready(self.port, 200).await;
        let marker = NewRow::new("fo", None, "after-failover", json!({}));
        let marker = self.table.insert_one(marker).await;
        self.rabbit.wait_for_ids(&[marker], LONG).await;
        let took = promoted.elapsed();
        let running = self.relay.is_running();
        assert!(running, "the relay exited:\n{}", self.relay.stderr());
        took
    }

    /// Lets the writers run one more second, stops them, waits until every row is sent and
    /// the consumer has every message; returns the rows and the deliveries checked against
    /// them.
    async fn drain(&mut self) -> (Vec<RowState>, Analysis) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (stop, writer) = &mut self.writer;
        stop.cancel();
        let written = writer.await.unwrap();
        assert!(written > 0, "the writers inserted nothing");
        self.table.wait_all_sent(LONG).await;
        self.rabbit.barrier().await;
        let rows = self.table.rows().await;
        let analysis = self.rabbit.analyse(&rows);
        (rows, analysis)
    }

    /// Stops the relay (a clean exit) and deletes the exchange; dropping the pair stops its
    /// servers and removes the table with them.
    async fn finish(self) {
        self.relay.stop().await;
        self.rabbit.teardown().await;
        drop(self.pair);
    }
}

/// Waits until `/readyz` on `port` answers `want`.
async fn wait_ready(port: u16, want: u16) {
    let what = format!("/readyz answers {want}");
    wait_until(LONG, &what, async || {
        match http_get(local(port), "/readyz").await? {
            (code, _) if code == want => Ok(()),
            (code, body) => Err(format!("{code} {body}")),
        }
    })
    .await;
}

/// For `outage`, every 100 ms: `/readyz` still fails and the relay still runs.
async fn hold_outage(f: &mut Failover, outage: Duration) {
    let start = Instant::now();
    while start.elapsed() < outage {
        let (code, body) = http_get(local(f.port), "/readyz").await.unwrap();
        assert_eq!(code, 503, "/readyz during the outage: {body}");
        let running = f.relay.is_running();
        assert!(running, "the relay exited:\n{}", f.relay.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many times each id was delivered, for rows delivered more than once.
fn attempts_beyond_deliveries(rows: &[RowState], analysis: &Analysis) -> Vec<String> {
    rows.iter()
        .filter_map(|r| {
            let delivered = analysis.counts.get(&r.id).copied().unwrap_or(0);
            let paid = usize::try_from(r.attempts).unwrap_or(usize::MAX);
            (paid > delivered.max(1)).then(|| {
                format!(
                    "{} (seq {}): attempts {} but delivered {delivered} time(s)",
                    r.id, r.seq, r.attempts
                )
            })
        })
        .collect()
}

/// Row counts by status.
fn statuses(rows: &[RowState]) -> BTreeMap<&str, usize> {
    let mut out = BTreeMap::new();
    for r in rows {
        *out.entry(r.status.as_str()).or_insert(0) += 1;
    }
    out
}

/// Prints the test's summary line.
fn summary(fault: &str, rows: &[RowState], analysis: &Analysis, note: &str) {
    println!(
        "FAULT-SUMMARY fault={fault} injected=1 rows={} lost={} reordered={} duplicates={} {note}",
        rows.len(),
        analysis.lost.len(),
        analysis.reordered.len(),
        analysis.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_crashed_and_standby_promoted_mid_drain_loses_nothing_and_spends_no_attempt() {
    let rounds = if soak() { 3 } else { 1 };
    for round in 0..rounds {
        eprintln!("crash round {} of {rounds}", round + 1);
        crash_and_promote(Crash::MidDrain).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_open_on_the_crashed_primary_holds_nothing_back_after_the_promotion() {
    crash_and_promote(Crash::WriterOpen).await;
}

/// When [`crash_and_promote`] crashes the primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    /// While rows flow: claims, publishes and settles in progress.
    MidDrain,
    /// While a writer's transaction, open on the primary, holds the ordered rows after it
    /// back: with the server gone, nothing may go on holding them.
    WriterOpen,
}

/// One crash of the primary and promotion of the standby, on a fresh pair.
async fn crash_and_promote(when: Crash) {
    // A lease short enough that rows whose settle the crash undid come back soon after the
    // promotion, longer than the outage: a settle retried through it is not given up.
    let lease = if soak() { "45s" } else { "15s" };
    let test = match when {
        Crash::MidDrain => "fo_crash",
        Crash::WriterOpen => "fo_crash_open",
    };
    let mut f = Failover::start(test, lease).await;
    let mut holder = f.pair.connect().await.unwrap();
    let mut open = None;
    if when == Crash::WriterOpen {
        let tx = holder.transaction().await.unwrap();
        let held = NewRow::new("fo", Some("fo-open"), "never-committed", json!({}));
        insert_rows(&tx, &f.table.name, &[held]).await;
        open = Some(tx);
        let lag = "outbox_watermark_lag_seconds";
        wait_for_sample(f.port, LONG, lag, &[], |v| v >= 1.0).await;
    }
    let in_flight = f.table.count_where("status = 'processing'").await;
    let down = f.relay.log_count("database unavailable");
    f.pair.crash_primary().await;
    drop(open);
    wait_ready(f.port, 503).await;
    f.relay
        .wait_for_log("database unavailable", down + 1, LONG)
        .await;
    hold_outage(&mut f, outage()).await;
    f.pair.promote_standby().await;
    let promoted = Instant::now();
    let first_after = f.recovers(promoted).await;
    let (rows, analysis) = f.drain().await;

    // Every row in the new primary arrived, each aggregate's first arrivals in seq order, no
    // delivery of a row the new primary does not have.
    analysis.assert_complete("primary crashed, standby promoted");
    let why = format!(
        "{} duplicates, more than relay.max_in_flight ({MAX_IN_FLIGHT})",
        analysis.duplicates
    );
    assert!(analysis.duplicates <= MAX_IN_FLIGHT, "{why}");
    // Nothing was charged for the outage: every row is sent, and an attempt beyond the first
    // is only ever the republish of a row whose settle the crash undid (it was delivered as
    // many times).
    let counts = statuses(&rows);
    let unsent: Vec<&RowState> = rows.iter().filter(|r| r.status != "sent").collect();
    assert_none("rows not sent", &unsent);
    let why = "rows charged an attempt that no delivery explains";
    assert_none(why, &attempts_beyond_deliveries(&rows, &analysis));
    let lost_commit = "never-committed";
    let ghost = rows.iter().filter(|r| r.event_type == lost_commit).count();
    assert_eq!(
        ghost, 0,
        "a row of a transaction the crash rolled back exists"
    );
    let reclaimed = f.relay.log_count("reclaimed rows whose relay stopped");
    let attempts_2 = rows.iter().filter(|r| r.attempts > 1).count();
    let note = format!(
        "statuses={counts:?} duplicated_ids={} rows_with_2_attempts={attempts_2} \
         processing_at_crash={in_flight} first_row_after_promotion_ms={} reclaim_logs={reclaimed}",
        analysis.duplicated_ids().len(),
        first_after.as_millis()
    );
    let fault = match when {
        Crash::MidDrain => "postgres-failover-crash",
        Crash::WriterOpen => "postgres-failover-crash-writer-open",
    };
    summary(fault, &rows, &analysis, &note);
    f.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_turned_read_only_then_failed_over_spends_no_attempt_and_delivers_once() {
    // A lease longer than the outage: settles retried through it must not be given up.
    let mut f = Failover::start("fo_read_only", "60s").await;
    let down = f.relay.log_count("database unavailable");
    f.pair.make_read_only(&f.pair.primary).await;
    wait_ready(f.port, 503).await;
    f.relay
        .wait_for_log("database unavailable", down + 1, LONG)
        .await;
    let read_only = f.relay.log_count("read-only");
    assert!(
        read_only >= 1,
        "no log names the read-only server:\n{}",
        f.relay.stderr()
    );
    // The old primary still answers reads: nothing is charged an attempt meanwhile.
    let old = f.pair.primary.connect().await.unwrap();
    let spent_sql = format!("SELECT count(*) FROM {} WHERE {SPENT}", f.table.name);
    let start = Instant::now();
    while start.elapsed() < outage() {
        hold_outage(&mut f, Duration::from_millis(200)).await;
        let spent: i64 = old.query_one(&spent_sql, &[]).await.unwrap().get(0);
        assert_eq!(spent, 0, "the read-only primary spent attempts");
    }
    // A planned switchover: the standby has everything, the old primary stays up read-only.
    f.pair.wait_for_standby_caught_up().await;
    f.pair.promote_standby().await;
    let promoted = Instant::now();
    let first_after = f.recovers(promoted).await;
    let (rows, analysis) = f.drain().await;

    analysis.assert_exactly_once("primary read-only, then failed over");
    assert_none("rows not sent once", &not_sent_once(&rows));
    // The relay left the old primary: none of its sessions is still there.
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'outbox-relay%'";
    let what = "the relay has no session left on the read-only old primary";
    wait_until(LONG, what, async || {
        let n: i64 = old.query_one(sql, &[]).await.unwrap().get(0);
        if n == 0 {
            Ok(())
        } else {
            Err(format!("{n} sessions"))
        }
    })
    .await;
    let note = format!(
        "statuses={:?} first_row_after_promotion_ms={} attempts_spent=0",
        statuses(&rows),
        first_after.as_millis()
    );
    summary("postgres-failover-read-only", &rows, &analysis, &note);
    f.finish().await;
}
