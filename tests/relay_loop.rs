//! The claim loop in process: `outbox_relay::run_with` against the real PostgreSQL and the
//! real MariaDB (a fresh table per test, created by `outbox-relay migrate`) with a scripted fake
//! [`Publisher`] instead of a broker, so each test decides what the "broker" answers, when, and
//! sees every publish the loop makes (order, attempts, overlap). What these pin down is the
//! loop's bookkeeping — which rows spend attempts, which wait, how many are in flight — that
//! the broker tests can only observe from outside — and, one level down, how an ordered claim
//! fills its batch and where a claimed row's new version lands (`Store::claim_and_expire` on
//! its own).
//!
//! The loop knows no SQL, so each scenario is written once as `async fn scenario(db: Db)` and
//! run on both databases by `on_both_databases!` (tests `<scenario>::postgres` and
//! `<scenario>::mysql`). What is the store's own choice runs on PostgreSQL alone, saying why:
//! the claims split into parts (a MySQL claim is never split) and which rows an ordered claim
//! picks to fill its batch.
//!
//! Time is real, not `tokio::time::pause`d. With paused time, whenever the runtime has no task
//! to run it polls I/O without blocking and, if nothing is ready, jumps the clock to the next
//! timer (tokio 1.54 `runtime/time/mod.rs`, `park_thread_timeout`): a query still on its way
//! to the database counts as "nothing to do", so the pool's 5 s create/connect timeouts and the
//! loop's own sleeps fire before the database answers. The loop also measures some periods with
//! `std::time::Instant` (suspect check, settle deadline), which pausing does not move, and
//! pausing needs tokio's `test-util` feature, which would rebuild the dependency tree for
//! tests. So the tests use short real durations (`poll_interval = "100ms"`, `retry.base_delay`
//! in tens to hundreds of ms) and wait for conditions, never for a fixed time.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::otlp::{OtlpReceiver, STATUS_ERROR};
use common::{Db, DbConn, Inserted, NewRow, TestOutbox, on_both_databases, wait_until};
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use outbox_relay::config::{Config, Ordering, RawConfig};
use outbox_relay::publish::{ConnectError, Outcome, Publisher, envelope::EnvelopeConfig};
use outbox_relay::store::{Claim, ClaimRequest, ExpirySweep, OnConfirm, Store};
use outbox_relay::{PublisherFactory, RunError, message::OutboxMessage, run_with};
use serde_json::json;
use tokio::{sync::Semaphore, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long any single wait may take before the test fails (the scenarios take well under 2 s).
const WAIT: Duration = Duration::from_secs(15);

/// How long the rows of `connection_failures_never_spend_attempts` may take to go out: up to
/// 18 lost connections, whose pauses before reconnecting double while no message is confirmed
/// (`Backoff::reconnect`, capped at 30 s).
const RECONNECTS: Duration = Duration::from_secs(120);

on_both_databases!(
    rejection_hands_back_the_rest_of_the_chain,
    a_publisher_that_panics_fails_only_its_row,
    reclaimed_rows_go_out_one_at_a_time,
    in_flight_window_bounds_concurrent_publishes,
    the_window_holds_published_rows_until_they_are_settled,
    shutdown_drains_then_hands_back,
    connection_failures_never_spend_attempts,
    an_ordered_claim_takes_a_prefix_of_each_aggregates_run,
    an_ordered_claim_stops_an_aggregates_run_at_a_row_not_ready,
);

on_both_databases!(
    rows_behind_a_head_that_cannot_go_out_do_not_fill_an_ordered_claims_window,
    an_aggregate_backing_off_holds_back_no_other_aggregate,
);

// The fake broker.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Confirm,
    Reject,
    /// Connection-level failure: answer `Unavailable` and drop the connection.
    Disconnect,
    /// A bug in the publisher: panic instead of answering.
    Panic,
}

/// What the fake answers for one publish, and after how long (a broker's latency).
type Step = (Answer, Duration);

/// `answer` at once if `cond`, else a confirm.
fn answer_if(cond: bool, answer: Answer) -> Step {
    (if cond { answer } else { Answer::Confirm }, Duration::ZERO)
}

/// Decides the step for a message, given how many times that row was published before.
type Script = Box<dyn Fn(&OutboxMessage, usize) -> Step + Send + Sync>;

/// One publish as the fake saw it.
#[derive(Debug, Clone)]
struct Publish {
    /// The message as claimed (`attempts` includes this one).
    msg: OutboxMessage,
    /// When the fake was asked.
    started: Instant,
    /// When it answered: `None` while in flight, and for good for a publish the loop dropped
    /// unanswered (shutdown's hard stop).
    ended: Option<Instant>,
    /// What it answered (`None` as `ended`).
    outcome: Option<Answer>,
}

/// A scripted [`Publisher`]: answers per the script, records every publish (in the order they
/// started), counts what is in flight, i.e. unanswered (and the most ever in flight), and has
/// a connection the script can break and a broker the test can take down (`connect` fails).
struct FakeBroker {
    script: Script,
    /// Each publish first takes a permit: none for a gated broker until the test adds them,
    /// else as good as unlimited.
    gate: Semaphore,
    log: Mutex<Vec<Publish>>,
    connected: AtomicBool,
    /// Whether `connect` succeeds.
    reachable: AtomicBool,
    connects: AtomicUsize,
    in_flight: AtomicUsize,
    high_water: AtomicUsize,
    /// With [`FakeBroker::audit`]: the table whose rows it looks up at each publish, and the
    /// most rows ever published and still `processing` (not settled) at once.
    audited: std::sync::OnceLock<(tokio::sync::Mutex<DbConn>, String)>,
    unsettled_high_water: AtomicUsize,
}

impl FakeBroker {
    /// A broker that answers each publish as soon as its script says.
    fn new(script: impl Fn(&OutboxMessage, usize) -> Step + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            script: Box::new(script),
            gate: Semaphore::new(Semaphore::MAX_PERMITS),
            log: Mutex::default(),
            connected: AtomicBool::new(false),
            reachable: AtomicBool::new(true),
            connects: AtomicUsize::default(),
            in_flight: AtomicUsize::default(),
            high_water: AtomicUsize::default(),
            audited: std::sync::OnceLock::new(),
            unsettled_high_water: AtomicUsize::default(),
        })
    }

    /// At each publish, counts the rows of `table` published so far (this one included) that
    /// are still `processing`: what a crash at that moment would have published and not
    /// settled, to be published again.
    async fn audit(&self, table: &TestOutbox) {
        let conn = tokio::sync::Mutex::new(table.conn().await);
        let set = self.audited.set((conn, table.name().to_owned()));
        assert!(set.is_ok(), "audited once");
    }

    async fn count_unsettled(&self) {
        let Some((db, table)) = self.audited.get() else {
            return;
        };
        let published: Vec<Uuid> = self.log.lock().unwrap().iter().map(|p| p.msg.id).collect();
        let ids = id_list(&published);
        let sql =
            format!("SELECT count(*) FROM {table} WHERE status = 'processing' AND id IN {ids}");
        let n = db.lock().await.query_i64(&sql).await;
        self.unsettled_high_water
            .fetch_max(usize::try_from(n).unwrap(), SeqCst);
    }

    /// A broker that confirms each publish once the test adds a permit to its gate.
    fn gated() -> Arc<Self> {
        let broker = Self::new(|_, _| (Answer::Confirm, Duration::ZERO));
        broker.gate.forget_permits(Semaphore::MAX_PERMITS);
        broker
    }

    fn publishes(&self) -> Vec<Publish> {
        self.log.lock().unwrap().clone()
    }

    fn confirmed(&self) -> Vec<Uuid> {
        let log = self.log.lock().unwrap();
        let confirmed = log.iter().filter(|p| p.outcome == Some(Answer::Confirm));
        confirmed.map(|p| p.msg.id).collect()
    }

    /// The publishes of one aggregate in the order they started.
    fn of_aggregate(&self, aggregate_id: &str) -> Vec<Publish> {
        let mut all = self.publishes();
        all.retain(|p| p.msg.aggregate_id.as_deref() == Some(aggregate_id));
        all
    }
}

#[async_trait]
impl Publisher for FakeBroker {
    fn kind(&self) -> &'static str {
        "fake"
    }

    fn describe(&self) -> String {
        "fake broker".into()
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        self.connects.fetch_add(1, SeqCst);
        let up = self.reachable.load(SeqCst);
        self.connected.store(up, SeqCst);
        up.then_some(())
            .ok_or_else(|| ConnectError("fake broker is down".into()))
    }

    fn is_connected(&self) -> bool {
        self.connected.load(SeqCst)
    }

    async fn publish(&self, msg: &OutboxMessage, _envelope: &EnvelopeConfig) -> Outcome {
        let (index, (answer, latency)) = {
            let mut log = self.log.lock().unwrap();
            let before = log.iter().filter(|p| p.msg.id == msg.id).count();
            log.push(Publish {
                msg: msg.clone(),
                started: Instant::now(),
                ended: None,
                outcome: None,
            });
            let now = self.in_flight.fetch_add(1, SeqCst) + 1;
            self.high_water.fetch_max(now, SeqCst);
            (log.len() - 1, (self.script)(msg, before))
        };
        self.count_unsettled().await;
        self.gate.acquire().await.unwrap().forget();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        if answer == Answer::Disconnect {
            self.connected.store(false, SeqCst);
        }
        {
            let p = &mut self.log.lock().unwrap()[index];
            (p.ended, p.outcome) = (Some(Instant::now()), Some(answer));
        }
        self.in_flight.fetch_sub(1, SeqCst);
        match answer {
            Answer::Confirm => Outcome::Confirmed,
            Answer::Reject => Outcome::Rejected("fake broker refused the message".into()),
            Answer::Disconnect => Outcome::Unavailable("fake broker connection lost".into()),
            Answer::Panic => panic!("fake publisher bug on seq {}", msg.seq),
        }
    }

    async fn close(&self) {
        self.connected.store(false, SeqCst);
    }
}

// The relay under test.

/// A fresh outbox table on `db`, holding `rows`, and the configuration the relay runs with,
/// built through `RawConfig::validate` like a user's. `overrides` is TOML merged over the
/// test's base settings.
async fn setup(
    db: Db,
    test: &str,
    overrides: &str,
    rows: &[NewRow],
) -> (TestOutbox, Config, Vec<Inserted>) {
    let table = TestOutbox::new(db, test).await;
    let (url, name) = (db.url(), table.name());
    let base = format!(
        // Four connections are plenty for a few dozen rows, and spare the shared server.
        "[database]\nurl = \"{url}\"\ntable = \"{name}\"\npool_size = 4\n\
         [relay]\ninstance_id = \"loop-{name}\"\npoll_interval = \"100ms\"\n\
         [metrics]\nlisten = \"\"\n"
    );
    let raw: RawConfig = Figment::from(Serialized::defaults(RawConfig::default()))
        .merge(Toml::string(&base))
        .merge(Toml::string(overrides))
        .extract()
        .expect("test configuration parses");
    let config = raw.validate().expect("test configuration is valid");
    assert_eq!(config.metrics_listen, None, "tests serve no metrics");
    let inserted = table.insert(rows).await;
    (table, config, inserted)
}

/// The running relay: its shutdown token and its task.
type Running = (CancellationToken, JoinHandle<Result<(), RunError>>);

fn start(config: Config, broker: &Arc<FakeBroker>) -> Running {
    let (shutdown, broker) = (CancellationToken::new(), Arc::clone(broker));
    let factory: PublisherFactory = Box::new(move || broker as Arc<dyn Publisher>);
    let run = run_with(config, Some(factory), shutdown.clone());
    (shutdown, tokio::spawn(run))
}

/// Cancels the token (if not yet) and waits for `run_with` to return.
async fn stop((shutdown, handle): Running) {
    shutdown.cancel();
    tokio::time::timeout(WAIT, handle)
        .await
        .expect("run_with returns after shutdown")
        .expect("run_with did not panic")
        .expect("run_with ends without error");
}

/// One row per key, in aggregate `key` ("": none).
fn rows(keys: &[&str]) -> Vec<NewRow> {
    let row = |k: &&str| NewRow::new("loop", Some(*k).filter(|k| !k.is_empty()), "e", json!({}));
    keys.iter().map(row).collect()
}

/// `n` rows of about the bench's size (a 300-byte payload) in `aggregate_type`, each in an
/// aggregate of its own.
fn bench_sized_rows(aggregate_type: &str, n: usize) -> Vec<NewRow> {
    let row = |i| {
        let payload = json!({ "i": i, "note": "x".repeat(300) });
        NewRow::new(
            aggregate_type,
            Some(&format!("order-{i}")),
            "placed",
            payload,
        )
    };
    (0..n).map(row).collect()
}

/// `ids` as an SQL list, `('…', '…')`, read the same on both databases.
fn id_list(ids: &[Uuid]) -> String {
    let quoted: Vec<String> = ids.iter().map(|id| format!("'{id}'")).collect();
    format!("({})", quoted.join(", "))
}

/// The database's now plus `seconds` (negative: in the past), as an SQL expression of `db`.
fn now_plus(db: Db, seconds: i64) -> String {
    match db {
        Db::Postgres => format!("now() + interval '{seconds} seconds'"),
        Db::Mysql => format!("NOW(6) + INTERVAL {seconds} SECOND"),
    }
}

/// One claim of up to `limit` rows in `parts` parts, made straight through the store (no
/// expiry sweep, no watermark).
async fn claim(config: &Config, ordering: Ordering, limit: usize, parts: usize) -> Claim {
    let store = Store::new(&config.database, &config.relay.instance_id).unwrap();
    let sweep = ExpirySweep::Skip;
    let claim = store.claim_and_expire(ClaimRequest {
        ordering,
        limit,
        watermark: i64::MAX,
        sweep,
        parts,
    });
    claim.await.unwrap()
}

/// The `seq`s of one ordered claim of up to `limit` rows (see [`claim`]), in the order the
/// claim hands them over.
async fn ordered_claim(config: &Config, limit: usize) -> Vec<i64> {
    let claim = claim(config, Ordering::Aggregate, limit, 1).await;
    claim.rows.iter().map(|m| m.seq).collect()
}

async fn wait_for(what: &str, check: impl Fn() -> bool) {
    let ready = async || {
        if check() {
            Ok(())
        } else {
            Err("not yet".to_owned())
        }
    };
    wait_until(WAIT, what, ready).await;
}

// Scenarios.

/// An aggregate's run a, b, c is claimed together; the broker rejects b once. c must not go
/// out before b: it is handed back unpublished and keeps its attempt, b spends exactly one and
/// waits out its backoff, then b and c go out in `seq` order. Another aggregate is untouched.
async fn rejection_hands_back_the_rest_of_the_chain(db: Db) {
    let backoff = Duration::from_millis(300);
    let new = rows(&["A", "B", "A", "A", "B"]);
    let settings = "[retry]\nbase_delay = \"300ms\"\njitter = 0.0\n";
    let (table, config, inserted) = setup(db, "loop_chain_rejection", settings, &new).await;
    let [a, x, b, c, y]: [Inserted; 5] = inserted.try_into().unwrap();
    let broker = FakeBroker::new(move |m, n| answer_if(m.id == b.id && n == 0, Answer::Reject));
    let relay = start(config, &broker);
    table.wait_all_sent(WAIT).await;
    stop(relay).await;

    let seen = |aggregate| -> Vec<(Uuid, i32, Option<Answer>)> {
        let all = broker.of_aggregate(aggregate).into_iter();
        all.map(|p| (p.msg.id, p.msg.attempts, p.outcome)).collect()
    };
    let confirmed = Some(Answer::Confirm);
    assert_eq!(
        seen("A"),
        vec![
            (a.id, 1, confirmed),
            (b.id, 1, Some(Answer::Reject)),
            (b.id, 2, confirmed),
            (c.id, 1, confirmed),
        ],
        "aggregate A: a, b (rejected), then b again and c, each claimed attempt as shown \
         (c published with attempts 1: the rejection of b did not spend c's)"
    );
    let chain = broker.of_aggregate("A");
    let rejected_at = chain[1].ended.unwrap();
    assert!(
        chain[2].started >= rejected_at + backoff,
        "b retried {:?} after its rejection, before its {backoff:?} backoff",
        chain[2].started - rejected_at
    );
    assert!(
        chain[3].started >= chain[2].ended.unwrap(),
        "c started before b was confirmed"
    );
    let other = vec![(x.id, 1, confirmed), (y.id, 1, confirmed)];
    assert_eq!(seen("B"), other, "aggregate B: once each");

    let state = table.rows_by_id(&[b.id, c.id]).await;
    let (b_row, c_row) = (&state[&b.id], &state[&c.id]);
    assert_eq!(
        (b_row.attempts, c_row.attempts, b_row.last_error.as_deref()),
        (2, 1, None),
        "b spent one attempt on the rejection, c none on it; sent rows carry no error"
    );
    table.drop_table().await;
}

/// A publisher that panics takes down neither the relay nor the rows beside it. Aggregate A's
/// run a1, a2 panics once at a2: both go out again one at a time, in order (a1 twice, as
/// at-least-once allows), and neither spends an attempt on it. B's b1 panics every time: it
/// counts as refused, backs off and ends a dead letter whose `last_error` says the relay
/// panicked; the relay runs on and stops cleanly.
async fn a_publisher_that_panics_fails_only_its_row(db: Db) {
    let settings = "[retry]\nbase_delay = \"100ms\"\njitter = 0.0\nmax_attempts = 2\n";
    let (table, config, inserted) =
        setup(db, "loop_panic", settings, &rows(&["A", "A", "B"])).await;
    let [a1, a2, b1]: [Inserted; 3] = inserted.try_into().unwrap();
    let broker = FakeBroker::new(move |m, n| {
        let panics = (m.id == a2.id && n == 0) || m.id == b1.id;
        answer_if(panics, Answer::Panic)
    });
    let relay = start(config, &broker);
    wait_until(WAIT, "a1 and a2 sent, b1 a dead letter", async || {
        let sent = table.count_where("status = 'sent'").await;
        let failed = table.count_where("status = 'failed'").await;
        if (sent, failed) == (2, 1) {
            Ok(())
        } else {
            Err(format!("sent {sent}, failed {failed}"))
        }
    })
    .await;
    stop(relay).await;

    let seen: Vec<(Uuid, Option<Answer>)> = broker
        .of_aggregate("A")
        .into_iter()
        .map(|p| (p.msg.id, p.outcome))
        .collect();
    let confirmed = Some(Answer::Confirm);
    assert_eq!(
        seen,
        vec![
            (a1.id, confirmed),
            (a2.id, Some(Answer::Panic)),
            (a1.id, confirmed),
            (a2.id, confirmed),
        ],
        "A's run panics at a2, then goes out again one row at a time, in order"
    );
    let state = table.rows_by_id(&[a1.id, a2.id, b1.id]).await;
    assert_eq!(
        (state[&a1.id].attempts, state[&a2.id].attempts),
        (1, 1),
        "the panic spent no attempt of A's rows"
    );
    let b = &state[&b1.id];
    assert_eq!(b.attempts, 2, "b1 spent its two attempts");
    let error = b.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("panicked"), "b1's last_error: {error:?}");
    table.drop_table().await;
}

/// With tracing on, a panic while publishing ends the span of the publish it cut short with an
/// error of type `panic` (not a span dropped without a status); the row then goes out again
/// untraced. PostgreSQL only: the spans are the relay's, whatever the database.
#[tokio::test]
async fn a_panic_while_publishing_ends_its_span_with_an_error() {
    let receiver = OtlpReceiver::start().await;
    let settings = format!(
        "[tracing]\notlp_endpoint = \"{}\"\nprotocol = \"{}\"\n",
        receiver.endpoint(),
        receiver.protocol().config_value()
    );
    let (table, config, inserted) =
        setup(Db::Postgres, "loop_panic_span", &settings, &rows(&["A"])).await;
    let a1 = inserted[0].id;
    let broker = FakeBroker::new(move |m, n| answer_if(m.id == a1 && n == 0, Answer::Panic));
    let relay = start(config, &broker);
    wait_until(WAIT, "a1 sent", async || {
        match table.count_where("status = 'sent'").await {
            1 => Ok(()),
            n => Err(format!("{n} sent")),
        }
    })
    .await;
    // Stopping the relay exports the spans it holds.
    stop(relay).await;
    let spans = receiver
        .wait_for_spans_with("messaging.message.id", &a1.to_string(), 1, WAIT)
        .await;
    let [span] = spans.as_slice() else {
        panic!("one span (the republish is untraced): {spans:#?}");
    };
    assert_eq!(
        (span.status_code, span.attr("error.type")),
        (STATUS_ERROR, "panic"),
        "{span:#?}"
    );
    assert!(span.status_message.contains("panicked"), "{span:#?}");
    let published = broker.of_aggregate("A");
    let outcomes: Vec<Option<Answer>> = published.iter().map(|p| p.outcome).collect();
    assert_eq!(outcomes, vec![Some(Answer::Panic), Some(Answer::Confirm)]);
    // The untraced republish carries the context of the span that ended in error.
    let carried = published[1].msg.traceparent.as_deref();
    assert_eq!(carried, Some(span.traceparent().as_str()));
    table.drop_table().await;
}

/// An aggregate whose head the broker rejected waits out its backoff with its whole backlog
/// behind it (more rows than a claim scans); a row of another aggregate inserted after that
/// backlog goes out meanwhile, before the head's retry.
async fn an_aggregate_backing_off_holds_back_no_other_aggregate(db: Db) {
    let mut keys = ["H"].repeat(300);
    keys.push("Y");
    let settings = "[relay]\nbatch_size = 10\nmax_in_flight = 10\n\
                    [retry]\nbase_delay = \"2s\"\njitter = 0.0\n";
    let (table, config, inserted) = setup(db, "loop_backoff_hol", settings, &rows(&keys)).await;
    let (head, y) = (inserted[0].id, inserted[300].id);
    let broker = FakeBroker::new(move |m, n| answer_if(m.id == head && n == 0, Answer::Reject));
    let relay = start(config, &broker);
    let y_confirmed = || broker.confirmed().contains(&y);
    wait_for("the other aggregate's row is confirmed", y_confirmed).await;
    let head_retried = broker
        .publishes()
        .iter()
        .filter(|p| p.msg.id == head)
        .count()
        > 1;
    stop(relay).await;
    assert!(
        !head_retried,
        "Y went out only after H's head came back from its backoff"
    );
    table.drop_table().await;
}

/// Rows a dead relay left `processing` (old lease, another `locked_by`) are reclaimed and each
/// published alone: no other publish overlaps one of them, so the one the broker "crashes" on
/// (a connection lost mid-publish) takes nothing else down; it goes out alone again, and no
/// other row spends an attempt on its account.
async fn reclaimed_rows_go_out_one_at_a_time(db: Db) {
    // Four rows a dead relay left (the poison row first), then four fresh ones.
    let new = rows(&["P", "S1", "S2", "", "N1", "N2", "", ""]);
    let settings = "[relay]\nbatch_size = 8\nmax_in_flight = 8\n";
    let (table, config, inserted) = setup(db, "loop_suspects", settings, &new).await;
    let dead_ids: Vec<Uuid> = inserted[..4].iter().map(|r| r.id).collect();
    let (t, hour_ago, ids) = (table.name(), now_plus(db, -3600), id_list(&dead_ids));
    let sql = format!(
        "UPDATE {t} SET status = 'processing', attempts = 1, locked_by = 'dead-relay', \
         locked_at = {hour_ago} WHERE id IN {ids}"
    );
    table.exec(&sql).await;
    let poison = inserted[0].id;
    let broker = FakeBroker::new(move |m, before| {
        if m.id == poison && before == 0 {
            // Long enough for anything the loop would run beside it to start meanwhile.
            (Answer::Disconnect, Duration::from_millis(300))
        } else {
            (Answer::Confirm, Duration::from_millis(20))
        }
    });
    let relay = start(config, &broker);
    table.wait_all_sent(WAIT).await;
    stop(relay).await;

    // Publishes are logged in the order they started, so a later one overlaps an earlier one
    // if it started before that one ended (both stamped under the log's lock).
    let publishes = broker.publishes();
    for (i, p) in publishes.iter().enumerate() {
        for q in &publishes[i + 1..] {
            let reclaimed = dead_ids.contains(&p.msg.id) || dead_ids.contains(&q.msg.id);
            assert!(
                !reclaimed || p.ended.is_some_and(|ended| q.started >= ended),
                "seq {} started while seq {} was in flight: a reclaimed row shared the window",
                q.msg.seq,
                p.msg.seq
            );
        }
    }

    // Per row, by seq: the attempts it was published with, and the attempts stored.
    let mut seen: BTreeMap<i64, (Vec<i32>, i32)> = BTreeMap::new();
    for p in &publishes {
        seen.entry(p.msg.seq).or_default().0.push(p.msg.attempts);
    }
    for r in table.rows().await {
        seen.entry(r.seq).or_default().1 = r.attempts;
    }
    let want: [&[i32]; 8] = [&[2, 2], &[2], &[2], &[2], &[1], &[1], &[1], &[1]];
    // Stored: the attempts of the row's first publish (a row handed back keeps no attempt).
    let want = want.map(|w| (w.to_vec(), w[0]));
    let expected: BTreeMap<_, _> = inserted.iter().map(|r| r.seq).zip(want).collect();
    assert_eq!(
        seen, expected,
        "the poison row published twice with the dead relay's attempt plus one (the lost \
         connection handed it back without spending it), the other reclaimed rows once with 2, fresh rows once with 1"
    );
    table.drop_table().await;
}

/// With `max_in_flight = 4` the broker never has more than 4 publishes outstanding; while they
/// hang the loop claims nothing more, and once the batch is answered and settled it claims again.
async fn in_flight_window_bounds_concurrent_publishes(db: Db) {
    let settings = "[relay]\nordering = \"none\"\nbatch_size = 4\nmax_in_flight = 4\n";
    let rows = NewRow::numbered(24, "loop", None, "e");
    let (table, config, _) = setup(db, "loop_window", settings, &rows).await;
    let broker = FakeBroker::gated();
    let relay = start(config, &broker);

    let window_full = || {
        let most = broker.high_water.load(SeqCst);
        assert!(
            most <= 4,
            "{most} publishes outstanding at once, beyond max_in_flight 4"
        );
        broker.in_flight.load(SeqCst) == 4
    };
    wait_for("4 publishes are waiting for the broker", window_full).await;
    // The window is full: nothing beyond it is claimed (a claim marks rows processing first).
    assert_eq!(table.count_where("status = 'processing'").await, 4);
    assert_eq!(broker.publishes().len(), 4);

    // The batch answered and settled frees the window: the next four go out.
    broker.gate.add_permits(4);
    wait_for("the loop refills the returned window", || {
        window_full() && broker.publishes().len() == 8
    })
    .await;

    broker.gate.add_permits(1000);
    table.wait_all_sent(WAIT).await;
    stop(relay).await;
    assert_eq!(broker.publishes().len(), 24, "each row published once");
    let most = broker.high_water.load(SeqCst);
    assert_eq!(most, 4, "most publishes outstanding at once");
    table.drop_table().await;
}

/// The window bounds what a crash would publish twice: messages published and not yet settled,
/// not only those awaiting their answer. One slow answer in each batch of 4 (`max_in_flight =
/// 4`) keeps the batch's other three answered but unsettled meanwhile; their permits come back
/// only with the batch's settle, so at no publish are more than 4 published rows `processing`.
async fn the_window_holds_published_rows_until_they_are_settled(db: Db) {
    let settings = "[relay]\nordering = \"none\"\nbatch_size = 4\nmax_in_flight = 4\n";
    let rows = NewRow::numbered(24, "loop", None, "e");
    let (table, config, inserted) = setup(db, "loop_unsettled", settings, &rows).await;
    let slow: HashSet<Uuid> = inserted.iter().step_by(4).map(|r| r.id).collect();
    let broker = FakeBroker::new(move |msg, _| {
        let latency = if slow.contains(&msg.id) { 300 } else { 0 };
        (Answer::Confirm, Duration::from_millis(latency))
    });
    broker.audit(&table).await;
    let relay = start(config, &broker);
    table.wait_all_sent(WAIT).await;
    stop(relay).await;
    assert_eq!(broker.publishes().len(), 24, "each row published once");
    let most = broker.unsettled_high_water.load(SeqCst);
    assert!(
        (1..=4).contains(&most),
        "{most} rows published and not yet settled at once; max_in_flight is 4"
    );
    table.drop_table().await;
}

/// Shutdown while 6 publishes wait on the broker: the 3 answered during the drain are `sent`,
/// the 3 the broker never answers are handed back `pending` without spending an attempt, rows
/// never claimed are untouched, no new claim starts, and `run_with` returns on its own, without
/// an error, though those 3 are never answered (it gives up on them at its publish deadline
/// within `shutdown_timeout`).
async fn shutdown_drains_then_hands_back(db: Db) {
    let settings = "[relay]\nordering = \"none\"\nbatch_size = 6\nmax_in_flight = 6\n\
                    shutdown_timeout = \"1500ms\"\n";
    let rows = NewRow::numbered(8, "loop", None, "e");
    let (table, config, inserted) = setup(db, "loop_shutdown", settings, &rows).await;
    let broker = FakeBroker::gated();
    let relay = start(config, &broker);
    wait_for("6 publishes are waiting for the broker", || {
        broker.in_flight.load(SeqCst) == 6
    })
    .await;

    let (shutdown, _) = &relay;
    shutdown.cancel();
    broker.gate.add_permits(3);
    let drained = || broker.confirmed().len() == 3;
    wait_for("3 publishes are confirmed during the drain", drained).await;
    // The other 3 are never answered: `run_with` returns because it gives up on them.
    stop(relay).await;

    let publishes = broker.publishes();
    assert_eq!(publishes.len(), 6, "no publish started after shutdown");
    let confirmed: HashSet<Uuid> = broker.confirmed().into_iter().collect();
    let published: HashSet<Uuid> = publishes.iter().map(|p| p.msg.id).collect();
    for r in table.rows().await {
        let (state, seq) = ((r.status.as_str(), r.attempts), r.seq);
        if confirmed.contains(&r.id) {
            assert_eq!(state, ("sent", 1), "seq {seq}");
        } else {
            assert_eq!(
                (state, r.locked_by.as_deref()),
                (("pending", 0), None),
                "seq {seq} (published: {})",
                published.contains(&r.id)
            );
        }
    }
    let never = inserted.iter().filter(|r| !published.contains(&r.id));
    let never: Vec<i64> = never.map(|r| r.seq).collect();
    assert_eq!(
        never.len(),
        2,
        "rows beyond the window were never published: {never:?}"
    );
    table.drop_table().await;
}

/// While the broker is unreachable nothing is claimed; once it accepts connections but drops
/// each one mid-publish, every row goes out and comes back three times — more than
/// `retry.max_attempts` (2) — without spending an attempt or being dead-lettered, and all are
/// sent, in order per aggregate, once the connection holds.
async fn connection_failures_never_spend_attempts(db: Db) {
    const DROPS: usize = 3;
    let new = rows(&["A", "A", "A", "B", "B", ""]);
    let settings = "[retry]\nmax_attempts = 2\nbase_delay = \"50ms\"\n";
    let (table, config, inserted) = setup(db, "loop_connection_drops", settings, &new).await;
    let broker = FakeBroker::new(|_, n| answer_if(n < DROPS, Answer::Disconnect));
    broker.reachable.store(false, SeqCst);
    let relay = start(config, &broker);

    let connects = || broker.connects.load(SeqCst);
    wait_for("the loop tried to connect twice", || connects() >= 2).await;
    let counts = table.status_counts().await;
    assert_eq!(
        counts["pending"], 6,
        "nothing claimed without a broker: {counts:?}"
    );
    assert_eq!(table.count_where("attempts > 0").await, 0);
    assert_eq!(broker.publishes().len(), 0);

    broker.reachable.store(true, SeqCst);
    // Each connection lost before the broker confirmed anything on it doubles the pause before
    // the next connect (100 ms, 200 ms, …): when the rows' lost connections come one after
    // another with no confirm between them, the pauses add up to tens of seconds.
    table.wait_all_sent(RECONNECTS).await;
    stop(relay).await;

    // (attempts as claimed, answer) of each publish, by seq.
    let mut seen: BTreeMap<i64, Vec<(i32, Option<Answer>)>> = BTreeMap::new();
    for p in broker.publishes() {
        seen.entry(p.msg.seq)
            .or_default()
            .push((p.msg.attempts, p.outcome));
    }
    let mut each = vec![(1, Some(Answer::Disconnect)); DROPS];
    each.push((1, Some(Answer::Confirm)));
    let expected = inserted.iter().map(|r| (r.seq, each.clone())).collect();
    assert_eq!(
        seen, expected,
        "each row: {DROPS} lost connections, then confirmed, all with attempts 1 (more would \
         mean a lost connection spent an attempt)"
    );
    for aggregate in ["A", "B"] {
        let mut confirmed = broker.of_aggregate(aggregate);
        confirmed.retain(|p| p.outcome == Some(Answer::Confirm));
        let seqs: Vec<i64> = confirmed.iter().map(|p| p.msg.seq).collect();
        assert!(
            seqs.is_sorted_by(|x, y| x < y),
            "aggregate {aggregate} confirmed out of seq order: {seqs:?}"
        );
    }
    let counts = table.status_counts().await;
    assert_eq!(counts["failed"], 0, "{counts:?}");
    assert_eq!(table.count_where("attempts <> 1").await, 0);
    table.drop_table().await;
}

/// Interleaved aggregates, and neither by name nor with the rows without aggregate first.
const INTERLEAVED: [&str; 11] = ["C", "", "B", "A", "C", "", "B", "A", "C", "B", "A"];

/// Whatever rows an ordered claim picks to fill its batch, it hands them over in `seq` order,
/// fills the batch when enough rows are ready, and takes of each aggregate a prefix of its
/// rows: never a row while an older one of its aggregate stays behind.
async fn an_ordered_claim_takes_a_prefix_of_each_aggregates_run(db: Db) {
    let (table, config, inserted) = setup(db, "loop_claim_prefix", "", &rows(&INTERLEAVED)).await;
    let got = ordered_claim(&config, 6).await;
    assert!(
        got.is_sorted(),
        "a claim hands its rows over in seq order: {got:?}"
    );
    assert_eq!(got.len(), 6, "6 of 11 ready rows claimed: {got:?}");
    for key in ["A", "B", "C"] {
        let of_key = INTERLEAVED
            .iter()
            .zip(&inserted)
            .filter(|(k, _)| **k == key);
        let all: Vec<i64> = of_key.map(|(_, r)| r.seq).collect();
        let claimed: Vec<i64> = all.iter().copied().filter(|s| got.contains(s)).collect();
        assert_eq!(
            claimed,
            all[..claimed.len()],
            "aggregate {key}: claimed {claimed:?}, not the oldest of {all:?}"
        );
    }
    assert_eq!(table.count_where("status = 'processing'").await, 6);
    table.drop_table().await;
}

/// Schema version 5 leaves room on each page for the next version of its rows: a claim's update
/// of a row stays on the row's page, which PostgreSQL logs as the bytes that changed instead of
/// the whole row (docs/performance.md, "Database cost per message"). At the default fillfactor
/// the inserts fill every page and the claimed rows move to other pages.
///
/// PostgreSQL only: pages and fillfactor are PostgreSQL's storage (InnoDB updates in place).
#[tokio::test]
async fn a_claimed_row_stays_on_its_page() {
    // A page holds a few rows of the bench's size.
    let rows = bench_sized_rows("page", 200);
    let (table, config, _) = setup(Db::Postgres, "loop_page", "", &rows).await;
    let name = table.name();
    let room = format!(
        "SELECT count(*) FROM pg_class \
          WHERE oid = '{name}'::regclass AND 'fillfactor=50' = ANY(reloptions)"
    );
    assert_eq!(
        table.conn().await.query_i64(&room).await,
        1,
        "migrate sets fillfactor 50"
    );
    let page = "(ctid::text::point)[0]";
    table
        .exec(&format!(
            "CREATE TABLE {name}_pages AS SELECT id, {page} AS page FROM {name}"
        ))
        .await;
    let pages = format!("SELECT count(DISTINCT page) FROM {name}_pages");
    let pages = table.conn().await.query_i64(&pages).await;
    assert!(pages >= 3, "the rows fill several pages, not one: {pages}");

    let claimed = claim(&config, Ordering::None, rows.len(), 1).await;
    assert_eq!(claimed.rows.len(), rows.len());
    let stayed = table
        .count_where(&format!(
            "status = 'processing' \
             AND {page} = (SELECT p.page FROM {name}_pages p WHERE p.id = {name}.id)"
        ))
        .await;
    // A page's last row may not fit beside the others' new versions (each is a little larger:
    // locked_by, locked_at; the smaller the rows, the more of them a page holds and the more
    // such growth adds up). At fillfactor 100 none stays but on the table's last page.
    assert!(
        stayed * 10 >= claimed.rows.len() as i64 * 9,
        "{stayed} of {} claimed rows stayed on their page",
        claimed.rows.len()
    );
    table.exec(&format!("DROP TABLE {name}_pages")).await;
    table.drop_table().await;
}

/// Settling a batch reads its rows by primary key, not every row in flight: on a table
/// analyzed while nothing was in flight (a bulk load's backlog), the processing index looks
/// empty to the planner, and a settle that let it match would scan all rows in flight and
/// compare each with every id given (docs/performance.md, "Database cost per message").
/// Whether it did is read from the statistics of the sessions that ran it, flushed when they
/// close.
///
/// PostgreSQL only: partial indexes and their plans are PostgreSQL's.
#[tokio::test]
async fn a_settle_reads_its_rows_by_primary_key_not_every_row_in_flight() {
    // Enough rows of the bench's size that reading a batch by primary key costs the planner
    // less than reading the whole table.
    let new = bench_sized_rows("settle", 1000);
    let (table, config, _) = setup(Db::Postgres, "loop_settle_plan", "", &new).await;
    table.exec(&format!("ANALYZE {}", table.name())).await;
    let TestOutbox::Postgres(pg) = &table else {
        panic!("PostgreSQL only");
    };
    let counters = format!(
        "SELECT t.n_tup_upd, t.seq_scan, i.idx_scan, k.idx_scan \
           FROM pg_stat_user_tables t, pg_stat_user_indexes i, pg_stat_user_indexes k \
          WHERE t.relid = to_regclass('{0}') \
            AND i.indexrelid = to_regclass('{0}_processing_idx') \
            AND k.indexrelid = to_regclass('{0}_pkey')",
        table.name()
    );
    // The statistics once `updated` rows' updates have been counted: (updates, sequential
    // scans of the table, scans of the processing index, scans of the primary key).
    let flushed = async |updated: i64| {
        let mut seen: (i64, i64, i64, i64) = (0, 0, 0, 0);
        wait_until(WAIT, "the closed sessions' statistics", async || {
            let row = pg.db.query_one(&counters, &[]).await.unwrap();
            seen = (row.get(0), row.get(1), row.get(2), row.get(3));
            if seen.0 >= updated {
                Ok(())
            } else {
                Err(format!("{seen:?}"))
            }
        })
        .await;
        seen
    };

    let claimed = claim(&config, Ordering::None, new.len(), 1).await;
    assert_eq!(claimed.rows.len(), new.len());
    let (_, seq_before, processing_before, pkey_before) = flushed(1000).await;
    let ids: Vec<Uuid> = claimed.rows.iter().map(|m| m.id).collect();
    let store = Store::new(&config.database, &config.relay.instance_id).unwrap();
    let sent = store
        .mark_sent(&ids[..500], OnConfirm::MarkSent)
        .await
        .unwrap();
    assert_eq!(sent, 500);
    let handed_back = store.hand_back(&ids[500..]).await.unwrap();
    assert_eq!(handed_back, 500);
    drop(store);
    let (_, seq_after, processing_after, pkey_after) = flushed(2000).await;
    assert_eq!(
        processing_after, processing_before,
        "the settles scanned the processing index"
    );
    assert_eq!(seq_after, seq_before, "the settles scanned the whole table");
    assert!(
        pkey_after >= pkey_before + 2,
        "the two settles read their rows by primary key: {pkey_before} -> {pkey_after} scans"
    );
    assert_eq!(table.count_where("status = 'sent'").await, 500);
    assert_eq!(table.count_where("status = 'pending'").await, 500);
    table.drop_table().await;
}

/// The relay's PostgreSQL sessions, as its pool makes them: commits that do not wait for the
/// WAL flush, generic plans, no JIT and no parallel workers (docs/design.md: the relay's reads
/// of many rows do not take the application's cores).
#[tokio::test]
async fn the_relays_sessions_are_set_for_short_statements_on_one_core() {
    let (table, config, _) = setup(Db::Postgres, "loop_session_settings", "", &[]).await;
    let store = Store::new(&config.database, &config.relay.instance_id).unwrap();
    let client = store.as_postgres().unwrap().client().await.unwrap();
    let mut seen = Vec::new();
    for name in [
        "synchronous_commit",
        "plan_cache_mode",
        "jit",
        "max_parallel_workers_per_gather",
    ] {
        let row = client
            .query_one(&format!("SHOW {name}"), &[])
            .await
            .unwrap();
        seen.push((name, row.get::<_, String>(0)));
    }
    let want = [
        ("synchronous_commit", "off"),
        ("plan_cache_mode", "force_generic_plan"),
        ("jit", "off"),
        ("max_parallel_workers_per_gather", "0"),
    ];
    let seen: Vec<(&str, &str)> = seen.iter().map(|(n, v)| (*n, v.as_str())).collect();
    assert_eq!(seen, want);
    drop(client);
    table.drop_table().await;
}

/// An ordered claim fills its batch run by run: the aggregates whose oldest claimable row is
/// oldest come first, each with its whole run in `seq` order, rather than one row of every
/// aggregate in `seq` order. A row without aggregate is its own run.
///
/// PostgreSQL only: how the batch is filled is the store's choice, and the MySQL claim takes
/// the oldest ready rows in `seq` order instead (docs/mysql.md, "Ordering without
/// snapshots"); what both promise is
/// [`an_ordered_claim_takes_a_prefix_of_each_aggregates_run`].
#[tokio::test]
async fn an_ordered_claim_takes_whole_runs_oldest_aggregate_first() {
    let db = Db::Postgres;
    let (table, config, inserted) = setup(db, "loop_claim_runs", "", &rows(&INTERLEAVED)).await;
    let got = ordered_claim(&config, 6).await;
    // C's run of three (its oldest row is the oldest), the first row without aggregate, then
    // the first two rows of B's run; A's run and the second row without aggregate wait.
    let mut want = [0, 4, 8, 1, 2, 6].map(|i| inserted[i].seq);
    want.sort_unstable();
    assert!(
        got.is_sorted(),
        "a claim hands its rows over in seq order: {got:?}"
    );
    assert_eq!(got, want, "claimed {got:?}, expected the rows {want:?}");
    assert_eq!(table.count_where("status = 'processing'").await, 6);
    table.drop_table().await;
}

/// Rows behind an aggregate's head that cannot go out in this claim — a row reclaimed from a
/// relay that died (it goes out on its own), one past its deadline (until the sweep) or one
/// backing off after a rejection (until its `available_at`) — are skipped before they take up
/// the scan window, so another aggregate's row further on is still claimed by a claim of one
/// row.
async fn rows_behind_a_head_that_cannot_go_out_do_not_fill_an_ordered_claims_window(db: Db) {
    // Heads S, D and B, 100 rows behind each, then Y.
    let mut keys = ["S", "D", "B"].repeat(101);
    keys.push("Y");
    let (table, config, inserted) = setup(db, "loop_claim_window", "", &rows(&keys)).await;
    let t = table.name();
    let reclaimed = format!(
        "UPDATE {t} SET last_error = 'lease expired: relay gone stopped while holding the row', \
           attempts = 1 WHERE seq = {}",
        inserted[0].seq
    );
    table.exec(&reclaimed).await;
    let past = now_plus(db, -1);
    let expired = format!(
        "UPDATE {t} SET expires_at = {past} WHERE seq = {}",
        inserted[1].seq
    );
    table.exec(&expired).await;
    let later = now_plus(db, 3600);
    let backing_off = format!(
        "UPDATE {t} SET available_at = {later}, attempts = 1 WHERE seq = {}",
        inserted[2].seq
    );
    table.exec(&backing_off).await;
    let got = ordered_claim(&config, 1).await;
    let y = inserted.last().unwrap().seq;
    assert_eq!(
        got,
        [y],
        "the claim of one row takes Y's, past 300 blocked ones"
    );
    table.drop_table().await;
}

/// A claim split in two parts run at once (as the loop claims while a backlog waits), with
/// ordering `aggregate`: together the parts fill the batch, each aggregate's claimed rows are
/// the oldest of its rows (a prefix of its run, never a row behind one left out), and the next
/// claim takes only aggregates with no rows in flight.
/// PostgreSQL only: a MySQL claim is never split into parts.
#[tokio::test]
async fn a_split_ordered_claim_keeps_each_aggregates_rows_a_prefix() {
    // 60 aggregates, 5 rows each, round robin.
    let names: Vec<String> = (0..60).map(|i| format!("a{i}")).collect();
    let keys: Vec<&str> = (0..5)
        .flat_map(|_| names.iter().map(String::as_str))
        .collect();
    let (table, config, inserted) = setup(Db::Postgres, "loop_claim_split", "", &rows(&keys)).await;
    let mut of_aggregate: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (key, row) in keys.iter().zip(&inserted) {
        of_aggregate.entry(key).or_default().push(row.seq);
    }
    let mut taken: HashSet<String> = HashSet::new();
    for round in 0..2 {
        let got = claim(&config, Ordering::Aggregate, 150, 2).await;
        let seqs: Vec<i64> = got.rows.iter().map(|m| m.seq).collect();
        assert!(
            !seqs.is_empty(),
            "round {round}: aggregates without rows in flight remain"
        );
        assert!(
            seqs.is_sorted(),
            "round {round}: rows in seq order: {seqs:?}"
        );
        let mut claimed: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for m in &got.rows {
            let key = m.aggregate_id.clone().unwrap();
            claimed.entry(key).or_default().push(m.seq);
        }
        for (key, got_seqs) in &claimed {
            let all = &of_aggregate[key.as_str()];
            assert_eq!(
                got_seqs.as_slice(),
                &all[..got_seqs.len()],
                "round {round}: aggregate {key} claimed {got_seqs:?}, not the oldest of {all:?}"
            );
            assert!(
                taken.insert(key.clone()),
                "round {round}: aggregate {key} claimed again while its rows are in flight"
            );
        }
        if round == 0 {
            // Each part takes the aggregates that `hashtext` maps to it: for "a0".."a59" (fixed
            // names, a fixed hash) each part has at least 15 of them, 75 rows for its share.
            assert_eq!(seqs.len(), 150, "the two parts fill the batch");
            assert!(
                got.more,
                "a part that filled its share says more rows are ready"
            );
        }
    }
    table.drop_table().await;
}

/// A claim split in two parts with ordering `none`: the parts skip each other's locked rows,
/// so together they claim the oldest rows of the table, each once.
/// PostgreSQL only: a MySQL claim is never split into parts.
#[tokio::test]
async fn a_split_claim_without_ordering_takes_the_oldest_rows_once() {
    let settings = "[relay]\nordering = \"none\"\n";
    let new = NewRow::numbered(300, "loop", None, "e");
    let (table, config, inserted) =
        setup(Db::Postgres, "loop_claim_split_none", settings, &new).await;
    let got = claim(&config, Ordering::None, 200, 2).await;
    let seqs: Vec<i64> = got.rows.iter().map(|m| m.seq).collect();
    let oldest: Vec<i64> = inserted[..200].iter().map(|r| r.seq).collect();
    assert_eq!(seqs, oldest, "the 200 oldest rows, each once, in seq order");
    assert!(
        got.more,
        "a part that filled its share says more rows are ready"
    );
    assert_eq!(table.count_where("status = 'processing'").await, 200);
    table.drop_table().await;
}

/// An open row between two candidates of one aggregate (here backing off: not ready yet)
/// stops the run there: the claim takes the head and another aggregate's row, never the row
/// behind the gap.
async fn an_ordered_claim_stops_an_aggregates_run_at_a_row_not_ready(db: Db) {
    let later = now_plus(db, 3600);
    a_run_stops_at_its_second_row(db, "loop_claim_gap", &format!("available_at = {later}")).await;
}

/// Rows A, A, A, B; A's second row then updated with `set` (making it not ready): an ordered
/// claim takes A's head and B's row, never A's third.
async fn a_run_stops_at_its_second_row(db: Db, test: &str, set: &str) {
    let (table, config, inserted) = setup(db, test, "", &rows(&["A", "A", "A", "B"])).await;
    let not_ready = format!(
        "UPDATE {} SET {set} WHERE seq = {}",
        table.name(),
        inserted[1].seq
    );
    table.exec(&not_ready).await;
    let got = ordered_claim(&config, 10).await;
    assert_eq!(
        got,
        [inserted[0].seq, inserted[3].seq],
        "{set}: A's head and B's row; A's third row waits behind the second"
    );
    table.drop_table().await;
}

/// One aggregate's backlog split in two parts: all its rows hash to one part, which takes its
/// share (the oldest rows, a prefix of the run); the other finds nothing. The claim says so
/// (`uneven`), and the loop then claims whole for a while.
/// PostgreSQL only: a MySQL claim is never split into parts.
#[tokio::test]
async fn a_split_claim_of_one_aggregate_takes_one_share_and_says_it_is_uneven() {
    let new = NewRow::numbered(300, "loop", Some(("hot", 1)), "e");
    let (table, config, inserted) = setup(Db::Postgres, "loop_claim_split_one", "", &new).await;
    let got = claim(&config, Ordering::Aggregate, 200, 2).await;
    let seqs: Vec<i64> = got.rows.iter().map(|m| m.seq).collect();
    let oldest: Vec<i64> = inserted[..100].iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs, oldest,
        "the part the aggregate hashes to takes its 100, in seq order"
    );
    assert!(
        got.more && got.uneven,
        "one part filled its share, the other came back empty"
    );
    table.drop_table().await;
}

/// The table as schema version 6 left it: no `<table>_blocker_idx`, so the store's ordered
/// claim probes each candidate's head instead (PostgreSQL).
async fn before_version_7(table: &TestOutbox) {
    table
        .exec(&format!("DROP INDEX {}_blocker_idx", table.name()))
        .await;
}

/// Both ordered claims, the one reading the blocker index (schema version 7) and the one that
/// probes each candidate's head (before it), skip the rows behind heads that cannot go out
/// (a suspect, one past its deadline, one backing off) and stop a run at a row not ready.
/// PostgreSQL only: the blocker index is PostgreSQL's.
#[tokio::test]
async fn an_ordered_claim_skips_blocked_aggregates_on_either_schema() {
    let db = Db::Postgres;
    for version_6 in [false, true] {
        let mut keys = ["S", "D", "B"].repeat(21);
        keys.extend(["A", "A", "A", "Y"]);
        let (table, config, inserted) = setup(db, "loop_claim_v6", "", &rows(&keys)).await;
        if version_6 {
            before_version_7(&table).await;
        }
        let (t, later) = (table.name(), now_plus(db, 3600));
        let seq = |i: usize| inserted[i].seq;
        table
            .exec(&format!(
                "UPDATE {t} SET last_error = 'lease expired: relay gone stopped while holding the row', \
                   attempts = 1 WHERE seq = {}; \
                 UPDATE {t} SET expires_at = now() - interval '1 second' WHERE seq = {}; \
                 UPDATE {t} SET available_at = {later}, attempts = 1 WHERE seq IN ({}, {})",
                seq(0),
                seq(1),
                seq(2),
                seq(64)
            ))
            .await;
        let got = ordered_claim(&config, 10).await;
        assert_eq!(
            got,
            [seq(63), seq(66)],
            "version 6: {version_6}: A's head and Y's row: A's third row waits behind the second, \
             S, D and B behind their heads"
        );
        table.drop_table().await;
    }
}

/// How many scans of `table`'s blocker index the statistics have counted (`None`: there is
/// no such index).
async fn blocker_index_scans(table: &TestOutbox) -> Option<i64> {
    let TestOutbox::Postgres(pg) = table else {
        panic!("PostgreSQL only");
    };
    let sql = "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelid = to_regclass($1)";
    let index = format!("{}_blocker_idx", table.name());
    let row = pg.db.query_opt(sql, &[&index]).await.unwrap();
    row.map(|r| r.get(0))
}

/// More aggregates whose head backs off than an ordered claim's scan window holds, all older
/// than a healthy aggregate's row: the claim of one row (a window of 101) still takes that
/// row, on either schema; on version 7 it got there through the blocker index.
/// PostgreSQL only: which rows an ordered claim picks is the store's own.
#[tokio::test]
async fn heads_backing_off_take_no_room_in_an_ordered_claims_window() {
    let db = Db::Postgres;
    for version_6 in [false, true] {
        let names: Vec<String> = (0..150).map(|i| format!("b{i}")).collect();
        let mut keys: Vec<&str> = names.iter().map(String::as_str).collect();
        keys.extend(names.iter().map(String::as_str));
        keys.push("Y");
        let (table, config, inserted) = setup(db, "loop_claim_backoff", "", &rows(&keys)).await;
        if version_6 {
            before_version_7(&table).await;
        }
        let heads = inserted[..150].iter().map(|r| r.seq.to_string());
        let backing_off = format!(
            "UPDATE {} SET available_at = {}, attempts = 1, last_error = 'rejected' \
             WHERE seq IN ({})",
            table.name(),
            now_plus(db, 3600),
            heads.collect::<Vec<_>>().join(", ")
        );
        table.exec(&backing_off).await;
        let got = ordered_claim(&config, 1).await;
        let y = inserted.last().unwrap().seq;
        assert_eq!(
            got,
            [y],
            "version 6: {version_6}: Y's row, past 150 heads backing off and 150 rows behind them"
        );
        if !version_6 {
            let what = "the statistics count a scan of the blocker index";
            wait_until(WAIT, what, async || {
                match blocker_index_scans(&table).await {
                    Some(n) if n > 0 => Ok(()),
                    other => Err(format!("idx_scan {other:?}")),
                }
            })
            .await;
        }
        table.drop_table().await;
    }
}

/// A row not ready that the blocker index cannot see (the application set its
/// `created_at` as far ahead as its `available_at`) still stops its aggregate's run: the
/// claim checks each candidate itself.
/// PostgreSQL only: the blocker index is PostgreSQL's.
#[tokio::test]
async fn an_ordered_claim_stops_at_a_row_not_ready_that_the_blocker_index_misses() {
    let later = now_plus(Db::Postgres, 3600);
    let ahead = format!("available_at = {later}, created_at = {later}");
    a_run_stops_at_its_second_row(Db::Postgres, "loop_claim_ahead", &ahead).await;
}

/// A second session that holds the rows `seqs` of `table` locked (`FOR UPDATE`, as another
/// relay's claim does) until it runs `ROLLBACK`.
async fn hold(table: &TestOutbox, seqs: &[i64]) -> tokio_postgres::Client {
    let other = outbox_testkit::pg_connect().await;
    let seqs: Vec<String> = seqs.iter().map(i64::to_string).collect();
    let hold = format!(
        "BEGIN; SELECT id FROM {} WHERE seq IN ({}) FOR UPDATE",
        table.name(),
        seqs.join(", ")
    );
    other.batch_execute(&hold).await.unwrap();
    other
}

/// A head that another claim holds locked (another relay claiming it right now) is invisible
/// to a claim that skips locked rows; the rows behind it must wait all the same, and go out
/// once the other claim is over. On the current schema and on one before version 7.
/// PostgreSQL only: which rows an ordered claim picks is the store's own.
#[tokio::test]
async fn an_ordered_claim_leaves_an_aggregate_whose_head_another_claim_holds() {
    for version_6 in [false, true] {
        let (table, config, inserted) =
            setup(Db::Postgres, "loop_claim_held", "", &rows(&["A", "A", "B"])).await;
        if version_6 {
            before_version_7(&table).await;
        }
        let other = hold(&table, &[inserted[0].seq]).await;
        let got = ordered_claim(&config, 10).await;
        assert_eq!(
            got,
            [inserted[2].seq],
            "version 6: {version_6}: only B's row; A's second row waits behind its held head"
        );
        other.batch_execute("ROLLBACK").await.unwrap();
        let got = ordered_claim(&config, 10).await;
        assert_eq!(
            got,
            [inserted[0].seq, inserted[1].seq],
            "version 6: {version_6}: A's run once its head is free"
        );
        table.drop_table().await;
    }
}

/// A dead letter holds back the rows behind it, among a thousand other aggregates' dead
/// letters, on the current schema (the blocker index) and on one before version 7.
/// PostgreSQL only: which rows an ordered claim picks is the store's own.
#[tokio::test]
async fn an_ordered_claim_leaves_the_rows_behind_a_dead_letter() {
    for version_6 in [false, true] {
        let (table, config, _) = setup(Db::Postgres, "loop_claim_dead", "", &[]).await;
        let t = table.name();
        table
            .exec(&format!(
                "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status) \
                 SELECT 'loop', 'dead-' || g, 'e', '{{}}', 'failed' FROM generate_series(1, 1000) g"
            ))
            .await;
        if version_6 {
            before_version_7(&table).await;
        }
        let inserted = table.insert(&rows(&["X", "X", "Y"])).await;
        let dead = format!(
            "UPDATE {t} SET status = 'failed', attempts = 10 WHERE seq = {}",
            inserted[0].seq
        );
        table.exec(&dead).await;
        let got = ordered_claim(&config, 10).await;
        assert_eq!(
            got,
            [inserted[2].seq],
            "version 6: {version_6}: Y's row; X's second row waits behind its dead letter"
        );
        table.drop_table().await;
    }
}

/// Two relays claiming at the same moment read the same window and pick the same runs: the
/// one whose picked heads the other holds claims the rest of its share further on (here the
/// other holds the two oldest aggregates' heads; a claim of two rows takes C's).
/// PostgreSQL only: which rows an ordered claim picks is the store's own.
#[tokio::test]
async fn an_ordered_claim_that_loses_its_picked_runs_to_another_claims_the_next_ones() {
    let (table, config, inserted) =
        setup(Db::Postgres, "loop_claim_lost", "", &rows(&["A", "B", "C"])).await;
    let other = hold(&table, &[inserted[0].seq, inserted[1].seq]).await;
    let got = ordered_claim(&config, 2).await;
    assert_eq!(got, [inserted[2].seq], "C's row, past the two held heads");
    other.batch_execute("ROLLBACK").await.unwrap();
    table.drop_table().await;
}
