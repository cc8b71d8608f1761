//! The relay loop: claim → publish → settle. It knows no SQL and no broker: rows come from
//! [`Store`], messages go through [`Publisher`].
//!
//! Invariants, enforced here:
//! - At least once: a row becomes `sent` only after the broker confirmed it; a row whose
//!   outcome could not be recorded stays `processing` and is reclaimed after the lease.
//! - A broker outage never spends an attempt: connection-level outcomes hand rows back.
//! - Per-aggregate order (`ordering = "aggregate"`): a claimed run of one aggregate goes to the
//!   publisher as one run ([`Publisher::publish_run`]): RabbitMQ sends one message at a time,
//!   each after the previous was confirmed; Kafka pipelines the run to its idempotent producer
//!   (see [`crate::publish::kafka`]); when one fails, the rest of its run is handed back
//!   without spending an attempt.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt as _, StreamExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backoff::{Backoff, sleep_or_cancel};
use crate::config::{Ordering, RelayConfig};
use crate::message::OutboxMessage;
use crate::publish::envelope::EnvelopeConfig;
use crate::publish::{Outcome, Publisher};
use crate::retry::RetryPolicy;
use crate::store::{ClaimRequest, Expired, ExpirySweep, Failure, OnConfirm, Store, StoreError};
use crate::tasks::instance::LockHeld;
use crate::tasks::lease::{Held, Holding};
use crate::telemetry::{self, DatabaseHealth, Health, OutboxMetrics};
use crate::wakeup::{Idle, Waiter};
use crate::watermark::Watermark;
use crate::window::{Lane, Permit};

/// How often to look for rows reclaimed from a dead relay when there were none last time: a
/// quarter of `relay.lease_timeout` (such a row waited that long already), between 1 and 15 s
/// (15 s with the default 60 s lease). An idle relay's polls are mostly these checks and empty
/// claims; with many outboxes they add up. Rows this relay's own lease task reclaims are
/// looked for at once ([`Held::take_reclaimed`]); the period is for those another relay
/// reclaimed and did not publish.
fn suspect_check_period(lease_timeout: Duration) -> Duration {
    (lease_timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(15))
}

/// After rows of a claim whose answer was lost were handed back, how often to look for more
/// (see `Dispatch::hand_back_lost_claims`).
const HAND_BACK_AGAIN_EVERY: Duration = Duration::from_secs(1);

/// How many statements claim at once while a backlog is waiting (the last claim filled its
/// share of the batch): one claim statement keeps one PostgreSQL server process busy, and
/// with a backlog that process is the limit. Split in two, on a 2-core machine: the database
/// path (no-op publisher) 26k → 31k rows/s, Kafka with 1,000 aggregates 20k → 23k msgs/s
/// (medians of 4 and 5 interleaved runs); three parts gained nothing more there.
const CLAIM_PARTS: usize = 2;

/// The fewest rows a part of a split claim is for: below that, splitting saves nothing.
const MIN_PART_ROWS: usize = 100;

/// How long claims stay whole after a split one came back uneven (a part filled its share,
/// another did not: the ready rows sit in few aggregates, say one hot aggregate's backlog).
/// The short part scanned the whole backlog for nothing; once a second is cheap.
const SPLIT_PAUSE: Duration = Duration::from_secs(1);

/// How often a claim also sweeps expired rows (`expires_at` passed) while rows flow. Claims
/// never take such rows, so the sweep only marks them (and, with ordering `aggregate`, lets
/// the rest of their aggregate go): a relay claiming every few milliseconds, or twenty idle
/// outboxes polling, need not run it every time.
const EXPIRY_SWEEP_EVERY: Duration = Duration::from_secs(2);
/// How often the sweep runs while the outbox is idle (its last claim found nothing and
/// nothing was in flight).
const EXPIRY_SWEEP_IDLE: Duration = Duration::from_secs(5);

/// With `ordering = "aggregate"`, how long a relay whose waiting record is armed may claim
/// on its poll with the watermark it last observed instead of reading the sequence and the
/// table's writers again (two statements per poll). A row committed since then by a READ
/// COMMITTED writer NOTIFYs and wakes the loop, which then observes; the rows an idle poll is
/// for (retries coming due, reclaimed rows) are older than that watermark. What is left, an
/// insert that missed the NOTIFY (see [`crate::wakeup`]), waits about this long plus one poll.
const OBSERVE_IDLE_EVERY: Duration = Duration::from_secs(5);

/// The longest poll while the ordering guard holds rows back.
const GUARD_POLL: Duration = Duration::from_millis(50);

/// How long the ordering guard may hold rows back before the loop warns about it.
const BLOCKING_WARN_AFTER: Duration = Duration::from_secs(5);
/// The least time between two of those warnings.
const BLOCKING_WARN_EVERY: Duration = Duration::from_secs(30);

/// What the loop needs besides the store and the publisher.
#[derive(Debug, Clone)]
pub struct LoopSettings {
    /// `[relay]`
    pub relay: RelayConfig,
    /// `[retry]`
    pub retry: RetryPolicy,
    /// What becomes of a confirmed row (deleted with `cleanup.retention = "0s"`).
    pub on_confirm: OnConfirm,
    /// The outbox table's oid (for the ordering guard's lock query).
    pub table_oid: u32,
}

/// Everything one outbox's loop works with: its own table, settings and identity, and what
/// it shares with the other outboxes of the relay (the publisher, the in-flight window, the
/// health flags).
pub struct RelayParts {
    /// The outbox's table.
    pub store: Store,
    /// The publisher every outbox shares.
    pub publisher: Arc<dyn Publisher>,
    /// How this outbox's messages look on the wire and where they go.
    pub envelope: EnvelopeConfig,
    /// Loop settings.
    pub settings: LoopSettings,
    /// The process's health (the broker flag).
    pub health: Arc<Health>,
    /// This outbox's database flag.
    pub database: DatabaseHealth,
    /// This outbox's metrics.
    pub metrics: OutboxMetrics,
    /// This outbox's share of the in-flight window.
    pub lane: Lane,
    /// Woken by NOTIFY, by finished batches (their aggregates' next rows are now claimable)
    /// and by connection-level failures (so the dispatcher reconnects at once).
    pub wake: Arc<Notify>,
    /// The ids this loop holds (renewed by the lease task).
    pub held: Held,
    /// Whether this relay holds its instance locks in the outbox's database (its table's among
    /// them): it claims only while it does ([`crate::tasks::instance`]).
    pub lock_held: LockHeld,
    /// This outbox's tracer when tracing is on: every publish attempt gets a span and its
    /// message that span's `traceparent` ([`crate::otel`]).
    pub tracer: Option<crate::otel::Outbox>,
}

/// The claim/publish/settle engine shared by the dispatcher and its batch tasks: one
/// outbox's [`RelayParts`], read through `Deref`.
pub struct Relay {
    parts: RelayParts,
    /// The broker confirmed one of this outbox's messages since the dispatcher last
    /// connected: the connection is proven, and losing it is an outage rather than a flap.
    confirmed_since_connect: AtomicBool,
}

impl std::ops::Deref for Relay {
    type Target = RelayParts;

    fn deref(&self) -> &RelayParts {
        &self.parts
    }
}

/// Per-row result of publishing a batch.
enum RowResult {
    Confirmed,
    Rejected(String),
    /// Connection-level failure, shutdown, or not attempted because an earlier row of its
    /// aggregate did not go through: hand back without spending the attempt.
    HandBack,
}

impl Relay {
    /// Wires the engine.
    pub fn new(parts: RelayParts) -> Arc<Self> {
        Arc::new(Self {
            parts,
            confirmed_since_connect: AtomicBool::new(false),
        })
    }

    /// Claims and publishes until `shutdown`; then drains in-flight batches until
    /// `relay.shutdown_timeout`, handing back whatever is still unconfirmed. With a `waiter`,
    /// the relay publishes that it waits whenever it goes idle (see [`crate::wakeup`]).
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken, mut waiter: Option<Waiter>) {
        let hard_stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        Dispatch::new(&self, &shutdown, &hard_stop, &tasks, &mut waiter)
            .run()
            .await;
        if let Some(w) = waiter.as_mut() {
            w.busy().await;
        }

        tasks.close();
        let timeout = self.settings.relay.shutdown_timeout;
        // Leave time to hand rows back before the deadline.
        let publish_deadline = timeout.saturating_sub((timeout / 5).min(Duration::from_secs(2)));
        let in_flight = tasks.len();
        if in_flight > 0 {
            tracing::info!(batches = in_flight, "draining in-flight messages");
        }
        if tokio::time::timeout(publish_deadline, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                batches = tasks.len(),
                "shutdown_timeout is near: handing back messages still waiting for the broker"
            );
            hard_stop.cancel();
            if tokio::time::timeout(timeout - publish_deadline, tasks.wait())
                .await
                .is_err()
            {
                tracing::error!(
                    batches = tasks.len(),
                    "batches did not finish handing back rows before shutdown_timeout; their rows stay processing until lease_timeout"
                );
            }
        }
    }

    /// Tracks `rows` for lease renewal and publishes them in a task holding `permit`.
    fn launch(
        self: &Arc<Self>,
        rows: Vec<OutboxMessage>,
        permit: Permit,
        hard_stop: &CancellationToken,
        tasks: &TaskTracker,
    ) {
        let holding = self.held.holding(rows.iter().map(|r| r.id).collect());
        let relay = Arc::clone(self);
        let hard_stop = hard_stop.clone();
        let claimed_at = chrono::Utc::now();
        tasks.spawn(async move {
            let first = rows.first().map(|m| m.seq);
            let count = rows.len();
            let batch = relay.process_batch(rows, holding, permit, claimed_at, hard_stop);
            // A panic outside the publish (`publish_chain` catches those) unwinds the task:
            // its `Holding` stops renewing the rows' leases, so they come back after
            // `lease_timeout` like those of a relay that stopped, an attempt spent (a row that
            // panics every time ends a dead letter), and its permit returns to the window.
            if let Err(panic) = AssertUnwindSafe(batch).catch_unwind().await {
                let what = panic_message(panic.as_ref());
                tracing::error!(rows = count, first_seq = ?first, panic = %what, lease = ?relay.settings.relay.lease_timeout, "the relay panicked outside the publish (while sorting or settling a batch); its rows are no longer renewed and come back when their lease runs out");
                relay.wake.notify_one();
            }
        });
    }

    /// Publishes one claimed batch and records every row's outcome. `permit`, the batch's share
    /// of the in-flight window, is given back only once the batch is settled: a message counts
    /// against `relay.max_in_flight` from its claim until its outcome is in the database, so a
    /// crash at any moment publishes at most that many messages again. (Giving a chain's share
    /// back at its last answer would let the loop claim and publish more while the batch's
    /// answered rows still wait for their settle.)
    async fn process_batch(
        self: &Arc<Self>,
        rows: Vec<OutboxMessage>,
        holding: Holding,
        permit: Permit,
        claimed_at: chrono::DateTime<chrono::Utc>,
        hard_stop: CancellationToken,
    ) {
        let chains = chains(rows, self.settings.relay.ordering);
        let mut running: FuturesUnordered<_> = chains
            .into_iter()
            .map(|chain| self.publish_chain(chain, claimed_at, &hard_stop))
            .collect();
        let mut results: Vec<(OutboxMessage, RowResult)> = Vec::new();
        while let Some(chain) = running.next().await {
            results.extend(chain);
        }
        drop(running);
        self.settle(results, holding).await;
        drop(permit);
        // The next rows of these aggregates may be claimable now.
        self.wake.notify_one();
    }

    /// Publishes a chain in order ([`Publisher::publish_run`], or its traced form when tracing
    /// is on), stopping at the first row that does not go through: the rows after it are
    /// handed back without spending an attempt. A panic on the way is caught
    /// ([`Relay::after_panic`]).
    async fn publish_chain(
        &self,
        mut chain: Vec<OutboxMessage>,
        claimed_at: chrono::DateTime<chrono::Utc>,
        hard_stop: &CancellationToken,
    ) -> Vec<(OutboxMessage, RowResult)> {
        #[cfg(feature = "fault-injection")]
        for msg in &chain {
            crate::fault_injection::crash_switch(msg);
        }
        let started = Instant::now();
        // Outside the run, so that the spans a panic left open can still be ended.
        let mut spans = Vec::new();
        let run = async {
            let publishing = async {
                match &self.tracer {
                    None => self.publisher.publish_run(&chain, &self.envelope).await,
                    Some(tracer) => {
                        let publisher = &*self.publisher;
                        tracer
                            .publish_run(
                                publisher,
                                &mut chain,
                                &self.envelope,
                                claimed_at,
                                &mut spans,
                            )
                            .await
                    }
                }
            };
            let outcomes = tokio::select! {
                o = publishing => o,
                () = hard_stop.cancelled() => vec![Outcome::Unavailable("shutting down".into())],
            };
            // Spans still open: the run was cut short (shutdown) before their answer.
            for (i, span) in spans.iter_mut().enumerate() {
                span.finish(outcomes.get(i));
            }
            outcomes
        };
        let outcomes = match AssertUnwindSafe(run).catch_unwind().await {
            Ok(outcomes) => outcomes,
            Err(panic) => {
                let what = panic_message(panic.as_ref());
                for span in &mut spans {
                    span.finish_panicked(&what);
                }
                self.after_panic(&chain, &what, hard_stop).await
            }
        };
        self.results(chain, outcomes, started, hard_stop)
    }

    /// The outcomes of a chain whose run panicked with the message `panic` (a bug in the relay
    /// or in a client library). A transport that pipelines runs may have sent rows past the
    /// panic already: the run is handed back like one cut by a lost connection (no attempt
    /// spent, so no row of it fails behind a later one that went out). Otherwise the rows are
    /// published again one at a time, untraced, each under the same guard, up to the first
    /// that panics again, which counts as refused (it spends its attempt, so a row that panics
    /// every time ends a dead letter; the publisher is then closed, so that a client left in a
    /// bad state is replaced), while the rows after it are handed back. The rows before it go
    /// out twice: duplicates, never a gap in order. Letting the panic unwind the batch's task
    /// instead would charge every row of the batch an attempt and a wait of `lease_timeout`
    /// (see [`Relay::launch`]), and keep the client that panicked.
    async fn after_panic(
        &self,
        chain: &[OutboxMessage],
        panic: &str,
        hard_stop: &CancellationToken,
    ) -> Vec<Outcome> {
        let first = chain.first().map(|m| m.seq);
        if self.publisher.pipelines_runs() {
            tracing::error!(rows = chain.len(), first_seq = ?first, panic, "the relay panicked while publishing a run of rows; handing them back");
            return vec![Outcome::Unavailable(format!(
                "the relay panicked while publishing: {panic}"
            ))];
        }
        tracing::error!(rows = chain.len(), first_seq = ?first, panic, "the relay panicked while publishing a run of rows; publishing them again one at a time");
        let mut outcomes = Vec::with_capacity(chain.len());
        let mut panicked_alone = false;
        for msg in chain {
            let alone = AssertUnwindSafe(self.publisher.publish(msg, &self.envelope));
            let outcome = tokio::select! {
                answer = alone.catch_unwind() => answer.unwrap_or_else(|panic| {
                    let what = panic_message(panic.as_ref());
                    tracing::error!(id = %msg.id, seq = msg.seq, panic = %what, "the relay panicked while publishing this row alone; it counts as refused");
                    panicked_alone = true;
                    Outcome::Rejected(format!("the relay panicked while publishing this row: {what}"))
                }),
                () = hard_stop.cancelled() => Outcome::Unavailable("shutting down".into()),
            };
            let confirmed = matches!(outcome, Outcome::Confirmed);
            outcomes.push(outcome);
            if !confirmed {
                break;
            }
        }
        if panicked_alone {
            self.publisher.close().await;
        }
        outcomes
    }

    /// Each row of a chain with what became of it: confirmed (counted), rejected (the first
    /// rejection stops the chain), or handed back (unanswered, after the stop, or the broker
    /// unavailable, which never spends an attempt).
    fn results(
        &self,
        chain: Vec<OutboxMessage>,
        outcomes: Vec<Outcome>,
        started: Instant,
        hard_stop: &CancellationToken,
    ) -> Vec<(OutboxMessage, RowResult)> {
        let mut outcomes = outcomes.into_iter();
        let mut stopped = false;
        let mut out = Vec::with_capacity(chain.len());
        for msg in chain {
            let outcome = outcomes.next();
            let result = match outcome {
                Some(Outcome::Confirmed) => {
                    self.confirmed_since_connect
                        .store(true, AtomicOrdering::Relaxed);
                    if stopped {
                        // Sent although an earlier row of its aggregate was not: the transport
                        // broke its promise. It is out: record it rather than send it twice.
                        tracing::error!(id = %msg.id, seq = msg.seq, "a message was confirmed after an earlier message of its aggregate failed");
                    }
                    let e2e = (chrono::Utc::now() - msg.created_at)
                        .to_std()
                        .unwrap_or_default();
                    self.metrics
                        .published(&msg.aggregate_type, started.elapsed(), e2e);
                    RowResult::Confirmed
                }
                None => RowResult::HandBack,
                Some(_) if stopped => RowResult::HandBack,
                Some(Outcome::Rejected(reason)) => {
                    self.metrics.publish_failure(false);
                    stopped = true;
                    RowResult::Rejected(reason)
                }
                Some(Outcome::Unavailable(reason)) => {
                    self.metrics.publish_failure(true);
                    if !hard_stop.is_cancelled() {
                        tracing::warn!(id = %msg.id, seq = msg.seq, reason = %reason, "broker unavailable; handing the row back without spending an attempt");
                        self.health.set_broker(false);
                        self.wake.notify_one();
                    }
                    stopped = true;
                    RowResult::HandBack
                }
            };
            out.push((msg, result));
        }
        out
    }

    /// Records outcomes, retrying while the database is unreachable (up to the lease: after
    /// that another relay may have reclaimed the rows, and they will be published again).
    async fn settle(&self, results: Vec<(OutboxMessage, RowResult)>, holding: Holding) {
        #[cfg(feature = "fault-injection")]
        crate::fault_injection::settle_panic_switch(results.iter().map(|(m, _)| m));
        self.record_outcomes(results).await;
        // Recorded, or given up on: either way this relay no longer renews their leases.
        drop(holding);
    }

    /// `results` sorted into the ids sent, the failures (each with its retry delay; logged),
    /// and the ids handed back.
    fn sorted(
        &self,
        results: Vec<(OutboxMessage, RowResult)>,
    ) -> (Vec<uuid::Uuid>, Vec<Failure>, Vec<uuid::Uuid>) {
        let mut sent = Vec::new();
        let mut failures = Vec::new();
        let mut hand_back = Vec::new();
        for (msg, result) in results {
            match result {
                RowResult::Confirmed => sent.push(msg.id),
                RowResult::Rejected(error) => {
                    let attempts = u32::try_from(msg.attempts).unwrap_or(0);
                    let delay = self.settings.retry.next_delay(attempts);
                    if self.settings.retry.exhausted(attempts) {
                        tracing::error!(id = %msg.id, seq = msg.seq, attempts, error = %error, "message dead-lettered after its last attempt");
                    } else {
                        tracing::warn!(id = %msg.id, seq = msg.seq, attempts, error = %error, retry_in = ?delay, "message refused (the error says why: the broker's answer, or why it could not be sent); will retry");
                    }
                    failures.push(Failure {
                        id: msg.id,
                        error,
                        delay,
                    });
                }
                RowResult::HandBack => hand_back.push(msg.id),
            }
        }
        (sent, failures, hand_back)
    }

    async fn record_outcomes(&self, results: Vec<(OutboxMessage, RowResult)>) {
        let (mut sent, mut failures, mut hand_back) = self.sorted(results);
        let deadline = Instant::now() + self.settings.relay.lease_timeout;
        let mut backoff = Backoff::reconnect();
        let on_confirm = self.settings.on_confirm;
        let max_attempts = self.settings.retry.max_attempts;
        loop {
            let result = async {
                if !sent.is_empty() {
                    let store = &self.store;
                    store.bounded(store.mark_sent(&sent, on_confirm)).await?;
                    sent.clear();
                }
                if !failures.is_empty() {
                    let store = &self.store;
                    let outcome = store.bounded(store.fail(&failures, max_attempts)).await?;
                    self.metrics
                        .dead_lettered(outcome.dead_lettered.len() as u64);
                    failures.clear();
                }
                if !hand_back.is_empty() {
                    let store = &self.store;
                    store.bounded(store.hand_back(&hand_back)).await?;
                    hand_back.clear();
                }
                Ok::<(), StoreError>(())
            }
            .await;
            match result {
                Ok(()) => return,
                Err(e) if Instant::now() < deadline => {
                    let delay = backoff.next_delay();
                    self.database.set(false);
                    self.store.note_error(&e);
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot record publish outcomes yet; retrying");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => {
                    tracing::error!(
                        error = %e,
                        unrecorded = sent.len() + failures.len() + hand_back.len(),
                        "gave up recording publish outcomes; those rows stay processing and are published again after lease_timeout"
                    );
                    return;
                }
            }
        }
    }
}

/// Why a round of the claim loop ended early.
enum Exit {
    /// Start the next round (after a failure was waited out, or with nothing to wait for).
    Again,
    /// Shutdown: stop claiming.
    Stop,
}

/// A step of a round: its result, or why the round ends here.
type Step<T> = Result<T, Exit>;

/// The claim loop's state between rounds. One round: make sure the broker is connected, take
/// room in the in-flight window, observe the watermark, isolate a suspect or claim a batch,
/// then wait when nothing more is ready.
struct Dispatch<'a> {
    relay: &'a Arc<Relay>,
    shutdown: &'a CancellationToken,
    hard_stop: &'a CancellationToken,
    batches: &'a TaskTracker,
    waiter: &'a mut Option<Waiter>,
    watermark: Watermark,
    blocking_warning: BlockingWarning,
    broker_backoff: Backoff,
    db_backoff: Backoff,
    suspect_checks: SuspectChecks,
    // How much of the window a round waits for.
    refill: Refill,
    // Whether the next claim is split (see `CLAIM_PARTS`).
    split: SplitPolicy,
    // Whether a broker connection was lost (counted once).
    broker: BrokerLink,
    // When the next claim also sweeps expired rows (see `EXPIRY_SWEEP_EVERY`).
    sweeps: SweepSchedule,
    // Whether this round may claim with the watermark last observed.
    observations: ObserveSkip,
    // When to hand back the rows of claims whose answer was lost.
    lost_claims: LostClaims,
}

/// What one claim brought back, for the adaptive wait.
struct Claimed {
    /// The batch filled its limit: more rows are ready, claim again at once.
    full: bool,
    /// The claim brought rows.
    found: bool,
    /// Nothing was claimed and nothing was held: the relay is idle.
    idle: bool,
}

impl<'a> Dispatch<'a> {
    fn new(
        relay: &'a Arc<Relay>,
        shutdown: &'a CancellationToken,
        hard_stop: &'a CancellationToken,
        batches: &'a TaskTracker,
        waiter: &'a mut Option<Waiter>,
    ) -> Self {
        let cfg = &relay.settings.relay;
        Self {
            relay,
            shutdown,
            hard_stop,
            batches,
            waiter,
            watermark: Watermark::new(),
            blocking_warning: BlockingWarning::default(),
            broker_backoff: Backoff::broker(),
            db_backoff: Backoff::reconnect(),
            suspect_checks: SuspectChecks::new(cfg.lease_timeout, Instant::now()),
            refill: Refill::new(cfg.batch_size, cfg.max_in_flight),
            split: SplitPolicy::default(),
            broker: BrokerLink::default(),
            sweeps: SweepSchedule::new(relay.settings.on_confirm, Instant::now()),
            observations: ObserveSkip::default(),
            lost_claims: LostClaims::default(),
        }
    }

    /// Rounds until shutdown.
    async fn run(mut self) {
        while !self.shutdown.is_cancelled() {
            if let Err(Exit::Stop) = self.round().await {
                break;
            }
        }
    }

    async fn round(&mut self) -> Step<()> {
        self.instance_lock().await?;
        self.reconnect().await?;
        self.hand_back_lost_claims().await?;
        let permit = self.take_window().await?;
        let (mark, permit) = self.observe_watermark(permit).await?;
        let Some(permit) = self.isolate_suspect(mark, permit).await? else {
            return Ok(());
        };
        let claimed = self.claim(mark, permit).await?;
        self.adaptive_wait(claimed).await
    }

    /// Claims nothing while this relay does not hold its instance locks (their session was
    /// lost; the keeper takes them again, or says which relay took one): the database counts
    /// as down meanwhile. Batches in flight still settle.
    async fn instance_lock(&mut self) -> Step<()> {
        if self.relay.lock_held.is_held() {
            return Ok(());
        }
        self.relay.database.set(false);
        sleep_or_cancel(crate::tasks::instance::CHECK_EVERY / 5, self.shutdown).await;
        Err(Exit::Again)
    }

    /// Connects the publisher when it is not: no row is claimed while the broker is away.
    async fn reconnect(&mut self) -> Step<()> {
        let (relay, publisher) = (self.relay, &self.relay.publisher);
        if publisher.is_connected() {
            // A handed-back row marks the broker down for /readyz; the connection says
            // whether it really is.
            relay.health.set_broker(true);
            return Ok(());
        }
        if let Some(up_for) = self.broker.lost() {
            relay.metrics.broker_down();
            let confirmed = relay
                .confirmed_since_connect
                .swap(false, AtomicOrdering::Relaxed);
            if confirmed || up_for >= PROVEN_AFTER {
                tracing::warn!(publisher = %publisher.describe(), "lost the broker connection; reconnecting");
                self.broker_backoff = Backoff::broker();
            } else {
                // A connection that broke soon, before the broker confirmed anything on it
                // (the broker closes it on what the relay sends, say): reconnecting at once
                // would loop as fast as the broker accepts connections.
                let delay = self.broker_backoff.next_delay();
                tracing::warn!(publisher = %publisher.describe(), retry_in = ?delay, "lost the broker connection before it confirmed any message; reconnecting after a pause of retry_in (or longer, when the sink asks for it: an HTTP Retry-After)");
                if !sleep_or_cancel(delay, self.shutdown).await {
                    return Err(Exit::Stop);
                }
            }
        }
        relay.health.set_broker(false);
        let connected = tokio::select! {
            r = publisher.connect() => r,
            () = self.shutdown.cancelled() => return Err(Exit::Stop),
        };
        match connected {
            Ok(()) => {
                tracing::info!(publisher = %publisher.describe(), "connected to the broker");
                self.broker.connected();
                relay
                    .confirmed_since_connect
                    .store(false, AtomicOrdering::Relaxed);
                telemetry::record_broker_connected();
                relay.health.set_broker(true);
                Ok(())
            }
            Err(e) => {
                relay.metrics.broker_down();
                let delay = self.broker_backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?delay, "broker unavailable; not claiming rows until it is back");
                sleep_or_cancel(delay, self.shutdown).await;
                Err(Exit::Again)
            }
        }
    }

    /// After a claim whose answer was lost (the connection dropped while it ran, or no answer
    /// came within `database.query_timeout`), hands back the rows it may have committed to
    /// this relay: every `processing` row in this relay's name that no batch holds and whose
    /// lease has not run out (those are the lease task's to reclaim). Runs before the next
    /// claim of this loop, then again every `HAND_BACK_AGAIN_EVERY` for `database.query_timeout`:
    /// a claim the database had not read yet (a stalled connection) commits its rows when it
    /// answers again, at about the time of that first hand-back. A lost claim that commits
    /// later still leaves its rows to wait out the lease.
    async fn hand_back_lost_claims(&mut self) -> Step<()> {
        let now = Instant::now();
        if !self.lost_claims.due(now) {
            return Ok(());
        }
        let relay = self.relay;
        let lease = relay.settings.relay.lease_timeout;
        let store = &relay.store;
        match store
            .bounded(store.hand_back_unheld(&relay.held.ids(), lease))
            .await
        {
            Ok(handed_back) => {
                self.lost_claims.handed_back(now, store.query_timeout());
                if handed_back > 0 {
                    tracing::warn!(released = handed_back, table = %relay.store.table(), "handed back rows of a claim whose answer the database connection lost (never published, no attempt spent)");
                }
                Ok(())
            }
            Err(e) => Err(self.database_down(&e).await),
        }
    }

    /// Waits for room in this outbox's share of the in-flight window, then takes as much of
    /// it as one batch may.
    async fn take_window(&mut self) -> Step<Permit> {
        let want = self.refill.want();
        let batch_size = self.relay.settings.relay.batch_size;
        tokio::select! {
            p = self.relay.lane.acquire(want, batch_size) => p.ok_or(Exit::Stop),
            () = self.shutdown.cancelled() => Err(Exit::Stop),
        }
    }

    /// The whole window (of every outbox), once nothing is in flight.
    async fn acquire_all(&self) -> Step<Permit> {
        tokio::select! {
            p = self.relay.lane.acquire_all() => p.ok_or(Exit::Stop),
            () = self.shutdown.cancelled() => Err(Exit::Stop),
        }
    }

    /// The highest `seq` that may be claimed: with `ordering = "aggregate"`, the ordering
    /// guard's watermark (the sequence, then the table's writers); otherwise any.
    async fn observe_watermark(&mut self, permit: Permit) -> Step<(i64, Permit)> {
        if self.relay.settings.relay.ordering != Ordering::Aggregate {
            return Ok((i64::MAX, permit));
        }
        let now = Instant::now();
        let armed = self.waiter.as_ref().is_some_and(Waiter::armed);
        if self
            .observations
            .skip(!self.watermark.holding() && armed, now)
        {
            return Ok((self.watermark.released(), permit));
        }
        let relay = self.relay;
        let store = &relay.store;
        let (last, writers) = match store
            .bounded(store.observe(self.relay.settings.table_oid))
            .await
        {
            Ok(observed) => observed,
            Err(e) => {
                drop(permit);
                return Err(self.database_down(&e).await);
            }
        };
        self.observations.observed(now);
        let mark = self.watermark.observe(last, &writers.writers, now);
        let lag = self.watermark.lag(now);
        self.relay.metrics.watermark_lag(lag);
        if self.blocking_warning.due(lag, now) {
            tracing::warn!(
                held_for = ?lag,
                oldest_writer_age_seconds = writers.oldest_writer_age.unwrap_or_default(),
                writers = writers.writers.len(),
                "ordered publishing is held back by a long-running transaction that writes to the outbox table; rows after it wait until it commits or rolls back"
            );
        }
        Ok((mark, permit))
    }

    /// A row reclaimed from a relay that died goes out alone: if it is what killed that relay,
    /// only its own attempts are spent. Waits until nothing else is in flight (takes the whole
    /// window), claims it, and keeps the window until it is settled, so no other row shares
    /// its fate. Looked for on every round while there are some, otherwise every
    /// `suspect_check_period`.
    /// Gives `permit` back for the ordinary claim when there is no suspect; `None` when the
    /// round is over.
    async fn isolate_suspect(&mut self, mark: i64, permit: Permit) -> Step<Option<Permit>> {
        // The lease task just reclaimed rows: look now, not at the next periodic check.
        let reclaimed = self.relay.held.take_reclaimed();
        if !self.suspect_checks.due(reclaimed, Instant::now()) {
            return Ok(Some(permit));
        }
        let relay = self.relay;
        let store = &relay.store;
        match store.bounded(store.suspects_waiting(mark)).await {
            Ok(false) => {
                self.suspect_checks.none_left(Instant::now());
                return Ok(Some(permit));
            }
            Ok(true) => {
                self.suspect_checks.found(Instant::now());
                drop(permit);
            }
            Err(e) => {
                drop(permit);
                return Err(self.database_down(&e).await);
            }
        }
        let window = self.acquire_all().await?;
        match store.bounded(store.claim_suspect(mark)).await {
            Ok(Some(row)) => {
                tracing::debug!(id = %row.id, seq = row.seq, attempts = row.attempts, "publishing a row reclaimed from a relay that stopped while holding it, on its own");
                self.relay
                    .launch(vec![row], window, self.hard_stop, self.batches);
            }
            Ok(None) => {
                // Another relay took it meanwhile.
                drop(window);
                self.suspect_checks.none_left(Instant::now());
            }
            Err(e) => {
                drop(window);
                self.lost_claims.answer_lost(e.answer_may_be_lost());
                self.database_down(&e).await;
            }
        }
        Ok(None)
    }

    /// Publishes the claimed `rows` in a task of their own, with the part of the window
    /// (`limit` permits) they use; the rest goes back.
    fn launch(&mut self, rows: Vec<OutboxMessage>, mut permit: Permit, limit: usize) {
        let relay = self.relay;
        // Idle polls are not claims: recording them would bury the batch sizes in zeros.
        relay.metrics.claimed(rows.len());
        relay.lane.found_work();
        if rows.len() < limit {
            // Give back the part of the window the claim did not use.
            if let Some(rest) = permit.split(limit - rows.len()) {
                drop(rest);
            }
        }
        relay.launch(rows, permit, self.hard_stop, self.batches);
    }

    /// Expires overdue rows (every `EXPIRY_SWEEP_EVERY`, or `EXPIRY_SWEEP_IDLE`) and claims up
    /// to the window taken, then publishes the batch in a task of its own, giving back the part
    /// of the window it did not use.
    async fn claim(&mut self, mark: i64, permit: Permit) -> Step<Claimed> {
        let relay = self.relay;
        let settings = &relay.settings;
        if let Some(w) = self.waiter.as_mut() {
            w.before_claim().await;
        }
        let limit = permit.num_permits();
        let held_nothing = relay.held.is_empty();
        let now = Instant::now();
        let sweep = self.sweeps.due(now);
        let parts = self.split.parts(self.refill.backlog(), limit, now);
        let store = &relay.store;
        let claimed = store
            .bounded(store.claim_and_expire(ClaimRequest {
                ordering: settings.relay.ordering,
                limit,
                watermark: mark,
                sweep,
                parts,
            }))
            .await;
        let (rows, expired, more, contended) = match claimed {
            Ok(claim) => {
                self.lost_claims.answer_lost(claim.answer_lost);
                relay.metrics.dead_lettered(claim.unreadable as u64);
                record_expired(&relay.metrics, &claim.expired);
                if claim.uneven {
                    self.split.uneven(now);
                }
                (claim.rows, claim.expired.len(), claim.more, claim.contended)
            }
            Err(e) => {
                drop(permit);
                self.lost_claims.answer_lost(e.answer_may_be_lost());
                return Err(self.database_down(&e).await);
            }
        };
        if !relay.database.set(true) {
            tracing::info!(table = %relay.store.table(), "database connection restored");
        }
        self.db_backoff = Backoff::reconnect();
        // Full: some part filled its share, so more rows are likely ready (with ordering
        // `aggregate` the aggregates of one part may run out before the other's). A claim
        // that found the claim lock taken (MySQL) counts as full: another relay is claiming,
        // so this one tries again at once rather than after a poll interval, and its sweep,
        // which did not run, stays due.
        let full = more || contended;
        self.refill.claimed(full);
        // Nothing claimed, and nothing held when the claim began (a batch settled while the
        // claim ran may not be in its snapshot, and its settle wakes the loop anyway): the
        // relay is idle.
        let idle = rows.is_empty() && held_nothing && !contended;
        if !contended {
            self.sweeps.ran(sweep, expired, limit, idle, now);
        }
        let claimed_rows = rows.len();
        let found = claimed_rows > 0;
        if found {
            self.launch(rows, permit, limit);
        }
        if let Some(w) = self.waiter.as_mut().filter(|_| found) {
            w.found_rows(claimed_rows).await;
        }
        Ok(Claimed { full, found, idle })
    }

    /// When nothing more is ready, waits for a NOTIFY, a finished batch, or the poll
    /// (jittered; short while the ordering guard holds rows back). An idle relay with a
    /// waiter first lingers, then publishes that it waits (see [`Waiter::idle`]); while rows
    /// flow it claims again on a fixed short step even with batches in flight
    /// ([`Waiter::flowing`]).
    async fn adaptive_wait(&mut self, claimed: Claimed) -> Step<()> {
        self.observations.woke_by_poll(false);
        if claimed.full {
            return Ok(());
        }
        let poll_interval = self.relay.settings.relay.poll_interval;
        let holding = self.watermark.holding();
        let poll = poll_wait(poll_interval, holding, rand::random::<f64>());
        let poll = match self.waiter.as_mut() {
            // Also while the ordering guard holds rows back: the commit of the writer it
            // waits for must wake the relay.
            Some(w) if claimed.idle => match w.idle(poll).await {
                Idle::Recheck => return Ok(()),
                Idle::Sleep(d) => d,
            },
            // Rows flow: claim again on a fixed short step rather than after this batch's
            // confirms. After a claim that found rows, settles do not cut the step short (that
            // would multiply the claims); after one that found none (every ready aggregate in
            // flight, say) a settle may free the next rows, so it does.
            Some(w) => match w.flowing() {
                Some(step) if claimed.found => {
                    sleep_or_cancel(step.min(poll), self.shutdown).await;
                    return Ok(());
                }
                Some(step) => step.min(poll),
                None => poll,
            },
            None => poll,
        };
        tokio::select! {
            () = self.relay.wake.notified() => {}
            () = tokio::time::sleep(poll) => self.observations.woke_by_poll(true),
            () = self.shutdown.cancelled() => {}
        }
        Ok(())
    }

    /// Marks the database down and waits out the next reconnect delay; the round ends. A
    /// server that refused a write as read-only is left for the one that takes writes.
    async fn database_down(&mut self, e: &StoreError) -> Exit {
        let delay = self.db_backoff.next_delay();
        self.relay.database.set(false);
        self.relay.store.note_error(e);
        if e.is_permission_denied() {
            tracing::error!(error = %e, retry_in = ?delay, table = %self.relay.store.table(), "the database refused the relay's statement: its user lacks a privilege on the table; grant what {} lists for the relay; retrying", e.grants_doc());
        } else {
            tracing::warn!(error = %e, retry_in = ?delay, "database unavailable; retrying");
        }
        sleep_or_cancel(delay, self.shutdown).await;
        Exit::Again
    }
}

/// When a claim also sweeps expired rows: every [`EXPIRY_SWEEP_EVERY`] while rows flow,
/// every [`EXPIRY_SWEEP_IDLE`] while the outbox is idle, and again at once after a sweep that
/// filled its batch (it may have left more).
#[derive(Debug)]
struct SweepSchedule {
    next: Instant,
    /// The sweep that runs when one is due (deleting with retention 0).
    kind: ExpirySweep,
}

impl SweepSchedule {
    /// The first claim sweeps.
    fn new(on_confirm: OnConfirm, now: Instant) -> Self {
        let kind = match on_confirm {
            OnConfirm::Delete => ExpirySweep::Delete,
            OnConfirm::MarkSent => ExpirySweep::Mark,
        };
        Self { next: now, kind }
    }

    /// The sweep a claim at `now` runs with.
    fn due(&self, now: Instant) -> ExpirySweep {
        if now < self.next {
            ExpirySweep::Skip
        } else {
            self.kind
        }
    }

    /// A claim at `now` ran `sweep`, which expired `expired` rows of at most `limit`.
    fn ran(&mut self, sweep: ExpirySweep, expired: usize, limit: usize, idle: bool, now: Instant) {
        if sweep == ExpirySweep::Skip || expired >= limit {
            return;
        }
        self.next = now
            + if idle {
                EXPIRY_SWEEP_IDLE
            } else {
                EXPIRY_SWEEP_EVERY
            };
    }
}

/// When to look for rows reclaimed from a dead relay (suspects): at the first round, on every
/// round while some are left, at once when this relay's lease task just reclaimed rows, and
/// otherwise every [`suspect_check_period`].
#[derive(Debug)]
struct SuspectChecks {
    /// When the next periodic check is due.
    next: Instant,
    /// [`suspect_check_period`] of the lease.
    period: Duration,
}

impl SuspectChecks {
    /// The first round at `now` checks.
    fn new(lease_timeout: Duration, now: Instant) -> Self {
        Self {
            next: now,
            period: suspect_check_period(lease_timeout),
        }
    }

    /// Whether a round at `now` looks for suspects; `reclaimed`: the lease task reclaimed rows
    /// since the last round.
    fn due(&self, reclaimed: bool, now: Instant) -> bool {
        reclaimed || now >= self.next
    }

    /// A check at `now` found suspects waiting: look on every round until none is left (the
    /// check may have been made early, on the lease task's note).
    fn found(&mut self, now: Instant) {
        self.next = now;
    }

    /// A check at `now` found none (or another relay took the one found): look again after
    /// the period.
    fn none_left(&mut self, now: Instant) {
        self.next = now + self.period;
    }
}

/// Whether a round with `ordering = "aggregate"` may claim with the watermark it last observed
/// instead of observing again: only a round the poll timer started (not a NOTIFY, a settle or
/// a recheck), while the ordering guard holds nothing back and the relay's waiting record is
/// armed (a new commit NOTIFYs), and within [`OBSERVE_IDLE_EVERY`] of the last observation.
#[derive(Debug, Default)]
struct ObserveSkip {
    /// Whether the next round was started by the poll timer.
    polled: bool,
    /// When the watermark was last observed.
    observed: Option<Instant>,
}

impl ObserveSkip {
    /// The wait before the next round ended by the poll timer (`true`) or otherwise.
    fn woke_by_poll(&mut self, polled: bool) {
        self.polled = polled;
    }

    /// Whether the round at `now` skips observing; `quiet`: the guard holds nothing back and
    /// the waiting record is armed. Only the round right after a poll may: this uses it up.
    fn skip(&mut self, quiet: bool, now: Instant) -> bool {
        let polled = std::mem::take(&mut self.polled);
        polled
            && quiet
            && self
                .observed
                .is_some_and(|t| now.duration_since(t) < OBSERVE_IDLE_EVERY)
    }

    /// The watermark was observed at `now`.
    fn observed(&mut self, now: Instant) {
        self.observed = Some(now);
    }
}

/// When to hand back the rows a claim may have committed to this relay though its answer was
/// lost ([`Store::hand_back_unheld`]): before the next claim after such a claim, then every
/// [`HAND_BACK_AGAIN_EVERY`] for `database.query_timeout` after that first hand-back (a claim
/// the database had not read yet, in a stalled connection, commits when it answers again).
/// Another lost answer meanwhile starts that period afresh.
#[derive(Debug, Default)]
struct LostClaims {
    /// A claim failed after it may have reached the database (or a part of it did) and its
    /// rows are not handed back yet.
    lost: bool,
    /// After a hand-back: when to hand back again, and until when.
    again: Option<(Instant, Instant)>,
}

impl LostClaims {
    /// A claim ended; `lost`: its answer (or a part's) may have been lost.
    fn answer_lost(&mut self, lost: bool) {
        self.lost |= lost;
    }

    /// Whether to hand back at `now`.
    fn due(&self, now: Instant) -> bool {
        self.lost || self.again.is_some_and(|(next, _)| now >= next)
    }

    /// Rows were handed back at `now` (the database answers within `query_timeout`).
    fn handed_back(&mut self, now: Instant, query_timeout: Duration) {
        let until = match self.again {
            Some((_, until)) if !self.lost => until,
            _ => now + query_timeout,
        };
        self.lost = false;
        self.again = (now < until).then_some((now + HAND_BACK_AGAIN_EVERY, until));
    }
}

/// How much of the in-flight window a round waits for before it claims: one permit, or while
/// a backlog waits (the last claim filled its batch) half the window, at most a batch. Permits
/// come back batch by batch as batches are settled, some of them small; with a backlog,
/// claiming on the first free permit would make many tiny claims.
#[derive(Debug)]
struct Refill {
    /// Whether the last claim filled its batch (so more rows are waiting).
    backlog: bool,
    /// What a round waits for while a backlog waits.
    refill: usize,
}

impl Refill {
    /// For `relay.batch_size` and `relay.max_in_flight`; no backlog yet.
    fn new(batch_size: usize, max_in_flight: usize) -> Self {
        Self {
            backlog: false,
            refill: batch_size.min(max_in_flight / 2).max(1),
        }
    }

    /// The permits the next round waits for.
    fn want(&self) -> usize {
        if self.backlog { self.refill } else { 1 }
    }

    /// Whether a backlog waits.
    fn backlog(&self) -> bool {
        self.backlog
    }

    /// A claim came back; `full`: it filled its batch (some part filled its share).
    fn claimed(&mut self, full: bool) {
        self.backlog = full;
    }
}

/// How long a broker connection must have lasted for its loss to count as an outage (the
/// next connect at once, the reconnect backoff starting over) when the broker confirmed
/// nothing on it.
const PROVEN_AFTER: Duration = Duration::from_secs(10);

/// Since when the broker has been connected, if it was when last looked at: a drop from
/// connected is a lost connection, logged and counted once however many rows (none, when
/// idle) were in flight (a failed reconnect is counted on its own); a broker not reached yet
/// has nothing to lose.
#[derive(Debug, Default)]
struct BrokerLink {
    up_since: Option<Instant>,
}

impl BrokerLink {
    /// The publisher reports no connection: how long the lost one lasted, when it is a loss
    /// not yet counted.
    fn lost(&mut self) -> Option<Duration> {
        self.up_since.take().map(|since| since.elapsed())
    }

    /// The publisher connected.
    fn connected(&mut self) {
        self.up_since = Some(Instant::now());
    }
}

/// How long to wait for the poll when nothing more is ready: `relay.poll_interval` jittered
/// by ±10% (`jitter` drawn from [0, 1)), so that relays started together do not poll in step;
/// at most [`GUARD_POLL`] while the ordering guard holds rows back (the writer it waits for
/// may commit any moment).
fn poll_wait(poll_interval: Duration, holding: bool, jitter: f64) -> Duration {
    if holding {
        poll_interval.min(GUARD_POLL)
    } else {
        poll_interval.mul_f64(0.9 + 0.2 * jitter)
    }
}

/// When to warn that a long transaction holds ordered publishing back: once the ordering guard
/// has held rows back for more than [`BLOCKING_WARN_AFTER`], then at most every
/// [`BLOCKING_WARN_EVERY`] while it goes on (a log line per poll would bury everything else).
#[derive(Debug, Default)]
struct BlockingWarning {
    /// When the last warning was given.
    last: Option<Instant>,
}

impl BlockingWarning {
    /// Whether to warn at `now`, the guard holding rows back for `lag`; a yes counts as the
    /// warning given.
    fn due(&mut self, lag: Duration, now: Instant) -> bool {
        let due = lag > BLOCKING_WARN_AFTER
            && self
                .last
                .is_none_or(|t| now.duration_since(t) > BLOCKING_WARN_EVERY);
        if due {
            self.last = Some(now);
        }
        due
    }
}

/// What a caught panic said: its message when it was a string, a placeholder otherwise.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// Whether a claim is split into parts run at once (see [`CLAIM_PARTS`]): only with a
/// backlog, only when each part gets [`MIN_PART_ROWS`], and not for [`SPLIT_PAUSE`] after a
/// split claim came back uneven.
#[derive(Debug, Default)]
struct SplitPolicy {
    whole_until: Option<Instant>,
}

impl SplitPolicy {
    /// How many parts a claim of `limit` rows at `now` runs in.
    fn parts(&self, backlog: bool, limit: usize, now: Instant) -> usize {
        if backlog && self.whole_until.is_none_or(|t| now >= t) {
            CLAIM_PARTS.min(limit / MIN_PART_ROWS).max(1)
        } else {
            1
        }
    }

    /// A split claim at `now` came back uneven: claims stay whole for a while.
    fn uneven(&mut self, now: Instant) {
        self.whole_until = Some(now + SPLIT_PAUSE);
    }
}

/// Splits a claimed batch into chains published concurrently: one per aggregate (in `seq`
/// order) with `ordering = "aggregate"`, one per row otherwise or when the row has no
/// aggregate id.
fn chains(rows: Vec<OutboxMessage>, ordering: Ordering) -> Vec<Vec<OutboxMessage>> {
    if ordering == Ordering::None {
        return rows.into_iter().map(|r| vec![r]).collect();
    }
    let mut index: HashMap<(String, String), usize> = HashMap::new();
    let mut out: Vec<Vec<OutboxMessage>> = Vec::new();
    for row in rows {
        match &row.aggregate_id {
            None => out.push(vec![row]),
            Some(id) => {
                let key = (row.aggregate_type.clone(), id.clone());
                match index.get(&key) {
                    Some(&i) => out[i].push(row),
                    None => {
                        index.insert(key, out.len());
                        out.push(vec![row]);
                    }
                }
            }
        }
    }
    for chain in &mut out {
        chain.sort_by_key(|m| m.seq);
    }
    out
}

/// Counts and logs rows that passed their deadline before they could be published.
fn record_expired(metrics: &OutboxMetrics, expired: &[Expired]) {
    if expired.is_empty() {
        return;
    }
    metrics.expired(expired.len() as u64);
    let sample: Vec<String> = expired
        .iter()
        .take(10)
        .map(|e| format!("{} ({})", e.id, e.aggregate_type))
        .collect();
    tracing::info!(
        expired = expired.len(),
        ids = %sample.join(", "),
        "rows passed their expires_at before they could be published; they will not be sent"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    #[test]
    fn sweeps_run_on_the_first_claim_then_on_their_schedule() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut sweeps = SweepSchedule::new(OnConfirm::MarkSent, t0);
        assert_eq!(sweeps.due(t0), ExpirySweep::Mark);
        // A sweep that did not fill its batch: the next one in 2 s while rows flow.
        sweeps.ran(ExpirySweep::Mark, 3, 500, false, t0);
        assert_eq!(sweeps.due(ms(1_999)), ExpirySweep::Skip);
        assert_eq!(sweeps.due(ms(2_000)), ExpirySweep::Mark);
        // A skipped sweep does not move the schedule.
        sweeps.ran(ExpirySweep::Skip, 0, 500, true, ms(1_000));
        assert_eq!(sweeps.due(ms(2_000)), ExpirySweep::Mark);
        // A full sweep may have left more: sweep again at once.
        sweeps.ran(ExpirySweep::Mark, 500, 500, false, ms(2_000));
        assert_eq!(sweeps.due(ms(2_001)), ExpirySweep::Mark);
        // Idle: every 5 s.
        sweeps.ran(ExpirySweep::Mark, 0, 500, true, ms(2_001));
        assert_eq!(sweeps.due(ms(7_000)), ExpirySweep::Skip);
        assert_eq!(sweeps.due(ms(7_001)), ExpirySweep::Mark);
        // With retention 0 the sweep deletes.
        let deleting = SweepSchedule::new(OnConfirm::Delete, t0);
        assert_eq!(deleting.due(t0), ExpirySweep::Delete);
    }

    #[test]
    fn claims_split_only_with_a_backlog_and_not_just_after_an_uneven_one() {
        let t0 = Instant::now();
        let mut split = SplitPolicy::default();
        assert_eq!(split.parts(false, 500, t0), 1, "no backlog");
        assert_eq!(split.parts(true, 500, t0), CLAIM_PARTS);
        assert_eq!(
            split.parts(true, MIN_PART_ROWS - 1, t0),
            1,
            "too few rows to split"
        );
        split.uneven(t0);
        assert_eq!(split.parts(true, 500, t0 + SPLIT_PAUSE / 2), 1, "paused");
        assert_eq!(split.parts(true, 500, t0 + SPLIT_PAUSE), CLAIM_PARTS);
    }

    #[test]
    fn suspects_are_looked_for_first_then_while_left_then_every_period_or_on_a_reclaim() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        // A 60 s lease: every 15 s.
        let mut checks = SuspectChecks::new(Duration::from_secs(60), t0);
        assert!(checks.due(false, t0), "the first round looks");
        checks.found(t0);
        assert!(
            checks.due(false, t0),
            "suspects left: the next round looks again"
        );
        checks.none_left(s(1));
        assert!(!checks.due(false, s(15)));
        assert!(
            checks.due(true, s(2)),
            "the lease task reclaimed rows: look at once"
        );
        assert!(checks.due(false, s(16)), "a period after the last check");
        // The period is a quarter of the lease, between 1 and 15 s.
        let short = SuspectChecks::new(Duration::from_secs(2), t0);
        assert_eq!(short.period, Duration::from_secs(1));
        let long = SuspectChecks::new(Duration::from_secs(600), t0);
        assert_eq!(long.period, Duration::from_secs(15));
        assert_eq!(checks.period, Duration::from_secs(15));
    }

    #[test]
    fn only_a_quiet_poll_soon_after_an_observation_skips_observing() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut skip = ObserveSkip::default();
        skip.woke_by_poll(true);
        assert!(!skip.skip(true, t0), "never observed yet");
        skip.observed(t0);
        assert!(!skip.skip(true, s(1)), "not woken by the poll");
        skip.woke_by_poll(true);
        assert!(
            skip.skip(true, s(1)),
            "a quiet poll 1 s after the observation"
        );
        assert!(!skip.skip(true, s(1)), "the poll is used up by one round");
        skip.woke_by_poll(true);
        assert!(
            !skip.skip(false, s(1)),
            "the guard holds rows back, or nothing armed"
        );
        assert!(
            !skip.skip(true, s(1)),
            "a round that observed uses up the poll as well"
        );
        skip.woke_by_poll(true);
        assert!(
            !skip.skip(true, s(5)),
            "5 s since the observation: observe again"
        );
        skip.woke_by_poll(true);
        skip.woke_by_poll(false);
        assert!(
            !skip.skip(true, s(1)),
            "a NOTIFY or a settle after the poll"
        );
    }

    #[test]
    fn a_lost_claim_is_handed_back_at_once_then_every_second_for_the_query_timeout() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let timeout = Duration::from_secs(3);
        let mut lost = LostClaims::default();
        assert!(!lost.due(t0), "nothing lost");
        lost.answer_lost(false);
        assert!(!lost.due(t0), "a claim that answered");
        lost.answer_lost(true);
        assert!(lost.due(t0), "before the next claim");
        lost.handed_back(t0, timeout);
        assert!(!lost.due(t0));
        assert!(lost.due(s(1)), "again a second later");
        lost.handed_back(s(1), timeout);
        lost.handed_back(s(2), timeout);
        assert!(lost.due(s(3)));
        lost.handed_back(s(3), timeout);
        assert!(
            !lost.due(s(60)),
            "the query timeout after the first hand-back: done"
        );
        // Another lost answer during the repeats: the period starts afresh.
        lost.answer_lost(true);
        lost.handed_back(s(60), timeout);
        lost.handed_back(s(61), timeout);
        lost.answer_lost(true);
        lost.handed_back(s(62), timeout);
        lost.handed_back(s(64), timeout);
        assert!(lost.due(s(65)), "until 3 s after the second loss");
        lost.handed_back(s(65), timeout);
        assert!(!lost.due(s(66)));
    }

    #[test]
    fn with_a_backlog_a_round_waits_for_half_the_window_at_most_a_batch() {
        let mut refill = Refill::new(500, 2_000);
        assert_eq!(
            refill.want(),
            1,
            "no backlog: claim on the first free permit"
        );
        refill.claimed(true);
        assert!(refill.backlog());
        assert_eq!(refill.want(), 500, "a batch");
        refill.claimed(false);
        assert_eq!(refill.want(), 1, "the backlog drained");
        let mut narrow = Refill::new(500, 300);
        narrow.claimed(true);
        assert_eq!(narrow.want(), 150, "half the window");
        let mut one = Refill::new(500, 1);
        one.claimed(true);
        assert_eq!(one.want(), 1, "at least one permit");
    }

    #[test]
    fn the_poll_is_jittered_by_a_tenth_and_short_while_the_guard_holds_rows_back() {
        let interval = Duration::from_millis(1_000);
        let ms = Duration::from_millis;
        assert_eq!(poll_wait(interval, false, 0.0), ms(900));
        assert_eq!(poll_wait(interval, false, 0.5), ms(1_000));
        assert!(poll_wait(interval, false, 0.999_999) < ms(1_100));
        assert_eq!(
            poll_wait(interval, true, 0.7),
            GUARD_POLL,
            "held back: 50 ms"
        );
        assert_eq!(
            poll_wait(ms(20), true, 0.7),
            ms(20),
            "never longer than the interval"
        );
    }

    #[test]
    fn a_lost_broker_connection_counts_once() {
        let mut broker = BrokerLink::default();
        assert!(broker.lost().is_none(), "never connected: nothing lost");
        broker.connected();
        let up_for = broker.lost().expect("the connection dropped");
        assert!(up_for < PROVEN_AFTER, "it lasted {up_for:?}");
        assert!(
            broker.lost().is_none(),
            "reconnects failing after it are the same loss"
        );
        broker.connected();
        assert!(broker.lost().is_some(), "a new connection lost again");
    }

    #[test]
    fn a_blocked_guard_is_warned_about_after_5_s_then_every_30_s() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let lag = Duration::from_secs;
        let mut warning = BlockingWarning::default();
        assert!(!warning.due(lag(5), t0), "held back 5 s: not yet");
        assert!(warning.due(lag(6), s(1)), "held back over 5 s: warn");
        assert!(!warning.due(lag(20), s(31)), "30 s since the last warning");
        assert!(
            warning.due(lag(36), s(32)),
            "over 30 s since the last warning"
        );
        // Another long transaction soon after: still at most one warning per 30 s.
        assert!(!warning.due(lag(0), s(40)));
        assert!(!warning.due(lag(6), s(46)));
        assert!(warning.due(lag(6), s(63)));
    }

    fn row(seq: i64, agg: Option<&str>) -> OutboxMessage {
        OutboxMessage {
            id: Uuid::new_v4(),
            seq,
            aggregate_type: "t".into(),
            aggregate_id: agg.map(str::to_owned),
            event_type: "e".into(),
            payload: vec![],
            headers: vec![],
            destination: None,
            attempts: 1,
            created_at: chrono::Utc::now(),
            expires_at: None,
            traceparent: None,
        }
    }

    #[test]
    fn aggregate_chains_keep_seq_order_and_split_null_ids() {
        let rows = vec![
            row(3, Some("a")),
            row(1, Some("a")),
            row(2, Some("b")),
            row(4, None),
            row(5, None),
        ];
        let c = chains(rows, Ordering::Aggregate);
        let seqs: Vec<Vec<i64>> = c
            .iter()
            .map(|ch| ch.iter().map(|m| m.seq).collect())
            .collect();
        assert_eq!(seqs, vec![vec![1, 3], vec![2], vec![4], vec![5]]);
    }

    #[test]
    fn unordered_chains_are_single_rows_in_claim_order() {
        let rows = vec![row(2, Some("a")), row(1, Some("a")), row(3, None)];
        let seqs: Vec<Vec<i64>> = chains(rows, Ordering::None)
            .iter()
            .map(|ch| ch.iter().map(|m| m.seq).collect())
            .collect();
        assert_eq!(seqs, vec![vec![2], vec![1], vec![3]]);
    }

    #[test]
    fn aggregates_of_one_id_but_different_types_are_different_chains() {
        let mut other = row(2, Some("a"));
        other.aggregate_type = "u".into();
        let rows = vec![row(1, Some("a")), other, row(3, Some("a"))];
        let keys: Vec<Vec<(String, i64)>> = chains(rows, Ordering::Aggregate)
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|m| (m.aggregate_type.clone(), m.seq))
                    .collect()
            })
            .collect();
        let key = |t: &str, seq| (t.to_owned(), seq);
        assert_eq!(
            keys,
            vec![vec![key("t", 1), key("t", 3)], vec![key("u", 2)]]
        );
    }
}
