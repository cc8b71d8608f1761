//! The claim loop in process: `outbox_relay::run_with` against the real PostgreSQL (a fresh
//! table per test, created by the library's own `Store::migrate`) with a scripted fake
//! [`Publisher`] instead of a broker, so each test decides what the "broker" answers, when, and
//! sees every publish the loop makes (order, attempts, overlap). What these pin down is the
//! loop's bookkeeping — which rows spend attempts, which wait, how many are in flight — that
//! the broker tests can only observe from outside.
//!
//! Time is real, not `tokio::time::pause`d. With paused time, whenever the runtime has no task
//! to run it polls I/O without blocking and, if nothing is ready, jumps the clock to the next
//! timer (tokio 1.54 `runtime/time/mod.rs`, `park_thread_timeout`): a query still on its way
//! to PostgreSQL counts as "nothing to do", so the pool's 5 s create/connect timeouts and the
//! loop's own sleeps fire before the database answers. The loop also measures some periods with
//! `std::time::Instant` (suspect check, settle deadline), which pausing does not move, and
//! pausing needs tokio's `test-util` feature, which would rebuild the dependency tree for
//! tests. So the tests use short real durations (`poll_interval = "100ms"`, `retry.base_delay`
//! in tens to hundreds of ms) and wait for conditions, never for a fixed time.

// Tests fail by panicking: unwrap/expect are the clearest way to say "this must work here".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::{NewRow, PG_URL, TestTable, hex8, pg_connect, slug, wait_until};
use figment::Figment;
use figment::providers::{Format, Serialized, Toml};
use outbox_relay::config::{Config, RawConfig};
use outbox_relay::message::OutboxMessage;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::publish::{ConnectError, Outcome, Publisher};
use outbox_relay::store::Store;
use outbox_relay::{PublisherFactory, RunError, run_with};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long any single wait may take before the test fails (the scenarios take well under 2 s).
const WAIT: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------------------------
// The fake broker.

/// What the fake answers for one publish, and when.
#[derive(Debug, Clone)]
struct Step {
    /// Wait for a permit of the fake's gate (the test opens it) before answering.
    gated: bool,
    /// Then wait this long (a broker's latency).
    latency: Duration,
    answer: Answer,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Confirm,
    Reject,
    /// Connection-level failure: answer `Unavailable` and drop the connection.
    Disconnect,
}

impl Step {
    fn confirm() -> Self {
        Self {
            gated: false,
            latency: Duration::ZERO,
            answer: Answer::Confirm,
        }
    }
    fn answer(answer: Answer) -> Self {
        Self {
            answer,
            ..Self::confirm()
        }
    }
    fn gated(mut self) -> Self {
        self.gated = true;
        self
    }
    fn after(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }
}

/// Decides the step for a message, given how many times that row was published before.
type Script = Box<dyn Fn(&OutboxMessage, usize) -> Step + Send + Sync>;

/// One publish as the fake saw it.
#[derive(Debug, Clone)]
struct Publish {
    id: Uuid,
    seq: i64,
    aggregate_id: Option<String>,
    /// `attempts` as claimed (including this one).
    attempts: i32,
    /// `None` while in flight, or when the loop gave up waiting (shutdown).
    outcome: Option<Answer>,
    started: Instant,
    ended: Option<Instant>,
}

/// Start and end of publishes, in the order they happened (`usize` indexes `publishes`).
#[derive(Debug, Clone, Copy)]
enum Event {
    Start(usize),
    End(usize),
}

#[derive(Default)]
struct Log {
    publishes: Vec<Publish>,
    events: Vec<Event>,
}

/// A scripted [`Publisher`]: answers per the script, records every publish, counts what is in
/// flight (and the most ever in flight), and has a connection the script can break and a
/// broker the test can take down (`connect` then fails).
struct FakeBroker {
    script: Script,
    /// Gated publishes wait here for a permit; it starts closed.
    gate: Semaphore,
    log: Mutex<Log>,
    connected: AtomicBool,
    /// Whether `connect` succeeds.
    reachable: AtomicBool,
    connects: AtomicUsize,
    in_flight: AtomicUsize,
    high_water: AtomicUsize,
}

impl FakeBroker {
    fn new(script: impl Fn(&OutboxMessage, usize) -> Step + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            script: Box::new(script),
            gate: Semaphore::new(0),
            log: Mutex::new(Log::default()),
            connected: AtomicBool::new(false),
            reachable: AtomicBool::new(true),
            connects: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            high_water: AtomicUsize::new(0),
        })
    }

    /// The factory `run_with` takes.
    fn factory(self: &Arc<Self>) -> PublisherFactory {
        let me = Arc::clone(self);
        Box::new(move || me as Arc<dyn Publisher>)
    }

    fn publishes(&self) -> Vec<Publish> {
        self.log.lock().unwrap().publishes.clone()
    }

    fn events(&self) -> (Vec<Publish>, Vec<Event>) {
        let log = self.log.lock().unwrap();
        (log.publishes.clone(), log.events.clone())
    }

    fn started(&self) -> usize {
        self.log.lock().unwrap().publishes.len()
    }

    fn confirmed(&self) -> Vec<Uuid> {
        self.publishes()
            .iter()
            .filter(|p| p.outcome == Some(Answer::Confirm))
            .map(|p| p.id)
            .collect()
    }

    /// The publishes of one aggregate in the order they started.
    fn of_aggregate(&self, aggregate_id: &str) -> Vec<Publish> {
        self.publishes()
            .into_iter()
            .filter(|p| p.aggregate_id.as_deref() == Some(aggregate_id))
            .collect()
    }

    fn record_end(&self, index: usize, outcome: Option<Answer>) {
        let mut log = self.log.lock().unwrap();
        let p = &mut log.publishes[index];
        if p.ended.is_some() {
            return;
        }
        p.ended = Some(Instant::now());
        p.outcome = outcome;
        log.events.push(Event::End(index));
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Ends a publish that the loop dropped before it was answered (shutdown's hard stop).
struct InFlight<'a> {
    broker: &'a FakeBroker,
    index: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.broker.record_end(self.index, None);
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
        self.connects.fetch_add(1, Ordering::SeqCst);
        if self.reachable.load(Ordering::SeqCst) {
            self.connected.store(true, Ordering::SeqCst);
            Ok(())
        } else {
            Err(ConnectError("fake broker is down".into()))
        }
    }

    fn is_connected(&self) -> bool {
        self.connected.load(Ordering::SeqCst)
    }

    async fn publish(&self, msg: &OutboxMessage, _envelope: &EnvelopeConfig) -> Outcome {
        let (index, step) = {
            let mut log = self.log.lock().unwrap();
            let before = log.publishes.iter().filter(|p| p.id == msg.id).count();
            let index = log.publishes.len();
            log.publishes.push(Publish {
                id: msg.id,
                seq: msg.seq,
                aggregate_id: msg.aggregate_id.clone(),
                attempts: msg.attempts,
                outcome: None,
                started: Instant::now(),
                ended: None,
            });
            log.events.push(Event::Start(index));
            let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.high_water.fetch_max(now, Ordering::SeqCst);
            (index, (self.script)(msg, before))
        };
        let guard = InFlight {
            broker: self,
            index,
        };
        if step.gated {
            self.gate.acquire().await.unwrap().forget();
        }
        if !step.latency.is_zero() {
            tokio::time::sleep(step.latency).await;
        }
        let outcome = match step.answer {
            Answer::Confirm => Outcome::Confirmed,
            Answer::Reject => Outcome::Rejected("fake broker refused the message".into()),
            Answer::Disconnect => {
                self.connected.store(false, Ordering::SeqCst);
                Outcome::Unavailable("fake broker connection lost".into())
            }
        };
        self.record_end(index, Some(step.answer));
        drop(guard); // a no-op now: the publish has ended
        outcome
    }

    async fn close(&self) {
        self.connected.store(false, Ordering::SeqCst);
    }
}

// ---------------------------------------------------------------------------------------------
// The relay under test.

/// A fresh outbox table created by the library's own migration, and the configuration the
/// relay runs with, built through `RawConfig::validate` like a user's. `overrides` is TOML
/// merged over the test's base settings.
async fn setup(test: &str, overrides: &str) -> (TestTable, Config) {
    let name = format!("it_{}_{}", slug(test, 24), hex8());
    let base = format!(
        // Four connections are plenty for a few dozen rows, and spare the shared server.
        "[database]\nurl = \"{PG_URL}\"\ntable = \"{name}\"\npool_size = 4\n\
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
    let store = Store::new(&config.database, &config.relay.instance_id).unwrap();
    assert!(!store.migrate().await.unwrap().is_empty());
    let table = TestTable {
        name,
        db: pg_connect().await,
    };
    (table, config)
}

struct Running {
    shutdown: CancellationToken,
    handle: JoinHandle<Result<(), RunError>>,
}

fn start(config: Config, broker: &Arc<FakeBroker>) -> Running {
    let shutdown = CancellationToken::new();
    let handle = tokio::spawn(run_with(config, Some(broker.factory()), shutdown.clone()));
    Running { shutdown, handle }
}

impl Running {
    /// Cancels the token and waits for `run_with` to return.
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("run_with returns after shutdown")
            .expect("run_with did not panic")
            .expect("run_with ends without error");
    }
}

fn row(aggregate: Option<&str>, event: &str) -> NewRow {
    NewRow::new("loop", aggregate, event, json!({ "event": event }))
}

async fn wait_for(what: &str, mut check: impl FnMut() -> bool) {
    wait_until(WAIT, what, async || {
        if check() {
            Ok(())
        } else {
            Err("not yet".into())
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Scenarios.

/// An aggregate's run a, b, c is claimed together; the broker rejects b once. c must not go
/// out before b: it is handed back unpublished and keeps its attempt, b spends exactly one and
/// waits out its backoff, then b and c go out in `seq` order. Another aggregate is untouched.
#[tokio::test]
async fn rejection_hands_back_the_rest_of_the_chain() {
    let backoff = Duration::from_millis(300);
    let (table, config) = setup(
        "loop_chain_rejection",
        "[retry]\nbase_delay = \"300ms\"\njitter = 0.0\n",
    )
    .await;
    let rows = table
        .insert(&[
            row(Some("A"), "a"),
            row(Some("B"), "x"),
            row(Some("A"), "b"),
            row(Some("A"), "c"),
            row(Some("B"), "y"),
        ])
        .await;
    let (a, x, b, c, y) = (rows[0], rows[1], rows[2], rows[3], rows[4]);
    let broker = FakeBroker::new(move |m, before| {
        if m.id == b.id && before == 0 {
            Step::answer(Answer::Reject)
        } else {
            Step::confirm()
        }
    });
    let relay = start(config, &broker);
    table.wait_all_sent(WAIT).await;
    relay.stop().await;

    let chain = broker.of_aggregate("A");
    let seen: Vec<(Uuid, i32, Option<Answer>)> = chain
        .iter()
        .map(|p| (p.id, p.attempts, p.outcome.clone()))
        .collect();
    assert_eq!(
        seen,
        vec![
            (a.id, 1, Some(Answer::Confirm)),
            (b.id, 1, Some(Answer::Reject)),
            (b.id, 2, Some(Answer::Confirm)),
            (c.id, 1, Some(Answer::Confirm)),
        ],
        "aggregate A: a, b (rejected), then b again and c, each claimed attempt as shown \
         (c published with attempts 1: the rejection of b did not spend c's)"
    );
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
    let other: Vec<(Uuid, i32)> = broker
        .of_aggregate("B")
        .iter()
        .map(|p| (p.id, p.attempts))
        .collect();
    assert_eq!(other, vec![(x.id, 1), (y.id, 1)], "aggregate B: once each");

    let state = table.rows_by_id(&[a.id, b.id, c.id]).await;
    assert_eq!(
        state[&b.id].attempts, 2,
        "b spent one attempt on the rejection"
    );
    assert_eq!(state[&c.id].attempts, 1, "c spent none on b's rejection");
    assert_eq!(state[&b.id].last_error, None, "sent rows carry no error");
    table.drop_table().await;
}

/// Rows a dead relay left `processing` (old lease, another `locked_by`) are reclaimed and each
/// published alone: no other publish overlaps one of them, so the one the broker "crashes" on
/// (a connection lost mid-publish) takes nothing else down; it goes out alone again, and no
/// other row spends an attempt on its account.
#[tokio::test]
async fn reclaimed_rows_go_out_one_at_a_time() {
    let (table, config) = setup(
        "loop_suspects",
        "[relay]\nbatch_size = 8\nmax_in_flight = 8\n",
    )
    .await;
    let dead: Vec<_> = table
        .insert(&[
            row(Some("P"), "poison"),
            row(Some("S1"), "s"),
            row(Some("S2"), "s"),
            row(None, "s"),
        ])
        .await;
    let fresh: Vec<_> = table
        .insert(&[
            row(Some("N1"), "n"),
            row(Some("N2"), "n"),
            row(None, "n"),
            row(None, "n"),
        ])
        .await;
    let dead_ids: Vec<Uuid> = dead.iter().map(|r| r.id).collect();
    table
        .db
        .execute(
            &format!(
                "UPDATE {} SET status = 'processing', attempts = 1, locked_by = 'dead-relay', \
                 locked_at = now() - interval '1 hour' WHERE id = ANY($1)",
                table.name
            ),
            &[&dead_ids],
        )
        .await
        .unwrap();
    let poison = dead[0].id;
    let broker = FakeBroker::new(move |m, before| {
        if m.id == poison && before == 0 {
            // Long enough for anything the loop would run beside it to start meanwhile.
            Step::answer(Answer::Disconnect).after(Duration::from_millis(300))
        } else {
            Step::confirm().after(Duration::from_millis(20))
        }
    });
    let relay = start(config, &broker);
    table.wait_all_sent(WAIT).await;
    relay.stop().await;

    let (publishes, events) = broker.events();
    let reclaimed: HashSet<Uuid> = dead_ids.iter().copied().collect();
    let mut in_flight: Vec<usize> = Vec::new();
    for e in &events {
        match *e {
            Event::Start(i) => {
                let shared = in_flight
                    .iter()
                    .any(|&j| reclaimed.contains(&publishes[j].id))
                    || (reclaimed.contains(&publishes[i].id) && !in_flight.is_empty());
                assert!(
                    !shared,
                    "seq {} started while seq {:?} were in flight: a reclaimed row shared the window",
                    publishes[i].seq,
                    in_flight
                        .iter()
                        .map(|&j| publishes[j].seq)
                        .collect::<Vec<_>>()
                );
                in_flight.push(i);
            }
            Event::End(i) => in_flight.retain(|&j| j != i),
        }
    }

    let attempts_seen = |id: Uuid| -> Vec<i32> {
        publishes
            .iter()
            .filter(|p| p.id == id)
            .map(|p| p.attempts)
            .collect()
    };
    assert_eq!(
        attempts_seen(poison),
        vec![2, 2],
        "the poison row: reclaimed with the dead relay's attempt, refunded after the lost connection"
    );
    for r in &dead[1..] {
        assert_eq!(attempts_seen(r.id), vec![2], "reclaimed row seq {}", r.seq);
    }
    for r in &fresh {
        assert_eq!(attempts_seen(r.id), vec![1], "fresh row seq {}", r.seq);
    }
    let state = table.rows().await;
    let attempts: BTreeMap<i64, i32> = state.iter().map(|r| (r.seq, r.attempts)).collect();
    let expected: BTreeMap<i64, i32> = dead
        .iter()
        .map(|r| (r.seq, 2))
        .chain(fresh.iter().map(|r| (r.seq, 1)))
        .collect();
    assert_eq!(attempts, expected, "attempts by seq");
    table.drop_table().await;
}

/// With `max_in_flight = 4` the broker never has more than 4 publishes outstanding; while they
/// hang the loop claims nothing more, and as answers return it claims again.
#[tokio::test]
async fn in_flight_window_bounds_concurrent_publishes() {
    let (table, config) = setup(
        "loop_window",
        "[relay]\nordering = \"none\"\nbatch_size = 4\nmax_in_flight = 4\n",
    )
    .await;
    let rows: Vec<NewRow> = (0..24).map(|i| row(None, &format!("e{i}"))).collect();
    table.insert(&rows).await;
    let broker = FakeBroker::new(|_, _| Step::confirm().gated());
    let relay = start(config, &broker);

    let window_full = || {
        let most = broker.high_water.load(Ordering::SeqCst);
        assert!(
            most <= 4,
            "{most} publishes outstanding at once, beyond max_in_flight 4"
        );
        broker.in_flight.load(Ordering::SeqCst) == 4
    };
    wait_for("4 publishes are waiting for the broker", window_full).await;
    // The window is full: nothing beyond it is claimed (a claim marks rows processing first).
    assert_eq!(table.count_where("status = 'processing'").await, 4);
    assert_eq!(broker.started(), 4);

    // Two answers free half the window (the refill a backlog waits for): two more go out.
    broker.gate.add_permits(2);
    wait_for("the loop refills the two returned permits", || {
        window_full() && broker.started() == 6
    })
    .await;

    broker.gate.add_permits(1000);
    table.wait_all_sent(WAIT).await;
    relay.stop().await;
    assert_eq!(broker.started(), 24, "each row published once");
    assert_eq!(
        broker.high_water.load(Ordering::SeqCst),
        4,
        "most publishes outstanding at once"
    );
    table.drop_table().await;
}

/// Shutdown while 6 publishes wait on the broker: the 3 answered before the deadline are
/// `sent`, the 3 still waiting are handed back `pending` with their attempt refunded, rows never
/// claimed are untouched, no new claim starts, and `run_with` returns within
/// `shutdown_timeout`.
#[tokio::test]
async fn shutdown_drains_then_hands_back() {
    let timeout = Duration::from_millis(1500);
    let (table, config) = setup(
        "loop_shutdown",
        "[relay]\nordering = \"none\"\nbatch_size = 6\nmax_in_flight = 6\n\
         shutdown_timeout = \"1500ms\"\n",
    )
    .await;
    let rows: Vec<NewRow> = (0..8).map(|i| row(None, &format!("e{i}"))).collect();
    let inserted = table.insert(&rows).await;
    let broker = FakeBroker::new(|_, _| Step::confirm().gated());
    let relay = start(config, &broker);
    wait_for("6 publishes are waiting for the broker", || {
        broker.in_flight.load(Ordering::SeqCst) == 6
    })
    .await;

    let asked = Instant::now();
    relay.shutdown.cancel();
    broker.gate.add_permits(3);
    wait_for("3 publishes are confirmed during the drain", || {
        broker.confirmed().len() == 3
    })
    .await;
    tokio::time::timeout(WAIT, relay.handle)
        .await
        .expect("run_with returns")
        .unwrap()
        .unwrap();
    let took = asked.elapsed();
    assert!(
        took < timeout,
        "run_with returned {took:?} after shutdown, beyond shutdown_timeout {timeout:?}"
    );
    // It waited for the broker until the publish deadline (timeout - timeout/5) before giving up.
    assert!(took >= timeout - timeout / 5, "gave up after {took:?}");

    let publishes = broker.publishes();
    assert_eq!(publishes.len(), 6, "no publish started after shutdown");
    let confirmed: HashSet<Uuid> = broker.confirmed().into_iter().collect();
    let published: HashSet<Uuid> = publishes.iter().map(|p| p.id).collect();
    for r in table.rows().await {
        if confirmed.contains(&r.id) {
            assert_eq!(
                (r.status.as_str(), r.attempts),
                ("sent", 1),
                "seq {}",
                r.seq
            );
        } else {
            assert_eq!(
                (r.status.as_str(), r.attempts, r.locked_by.as_deref()),
                ("pending", 0, None),
                "seq {} (published: {})",
                r.seq,
                published.contains(&r.id)
            );
        }
    }
    let never: Vec<i64> = inserted
        .iter()
        .filter(|r| !published.contains(&r.id))
        .map(|r| r.seq)
        .collect();
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
#[tokio::test]
async fn connection_failures_never_spend_attempts() {
    let (table, config) = setup(
        "loop_connection_refunds",
        "[retry]\nmax_attempts = 2\nbase_delay = \"50ms\"\n",
    )
    .await;
    let inserted = table
        .insert(&[
            row(Some("A"), "a1"),
            row(Some("A"), "a2"),
            row(Some("A"), "a3"),
            row(Some("B"), "b1"),
            row(Some("B"), "b2"),
            row(None, "n1"),
        ])
        .await;
    const DROPS: usize = 3;
    let broker = FakeBroker::new(|_, before| {
        if before < DROPS {
            Step::answer(Answer::Disconnect)
        } else {
            Step::confirm()
        }
    });
    broker.reachable.store(false, Ordering::SeqCst);
    let relay = start(config, &broker);

    wait_for("the loop tried to connect twice", || {
        broker.connects.load(Ordering::SeqCst) >= 2
    })
    .await;
    let counts = table.status_counts().await;
    assert_eq!(
        counts["pending"], 6,
        "nothing claimed without a broker: {counts:?}"
    );
    assert_eq!(table.count_where("attempts > 0").await, 0);
    assert_eq!(broker.started(), 0);

    broker.reachable.store(true, Ordering::SeqCst);
    table.wait_all_sent(WAIT).await;
    relay.stop().await;

    let publishes = broker.publishes();
    let mut per_row: HashMap<Uuid, Vec<Option<Answer>>> = HashMap::new();
    for p in &publishes {
        assert_eq!(
            p.attempts, 1,
            "seq {} was published with attempts {}: a lost connection spent an attempt",
            p.seq, p.attempts
        );
        per_row.entry(p.id).or_default().push(p.outcome.clone());
    }
    let mut expected = vec![Some(Answer::Disconnect); DROPS];
    expected.push(Some(Answer::Confirm));
    for r in &inserted {
        assert_eq!(per_row[&r.id], expected, "seq {}", r.seq);
    }
    for aggregate in ["A", "B"] {
        let firsts: Vec<i64> = broker
            .of_aggregate(aggregate)
            .iter()
            .filter(|p| p.outcome == Some(Answer::Confirm))
            .map(|p| p.seq)
            .collect();
        assert!(
            firsts.windows(2).all(|w| w[0] < w[1]),
            "aggregate {aggregate} confirmed out of seq order: {firsts:?}"
        );
    }
    let counts = table.status_counts().await;
    assert_eq!(counts["failed"], 0, "{counts:?}");
    assert_eq!(table.count_where("attempts <> 1").await, 0);
    table.drop_table().await;
}
