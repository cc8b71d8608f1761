//! NATS JetStream transport (async-nats): each message is published to the subject rendered
//! from `publisher.nats.subject` (or the row's `destination`) and confirmed by the stream's
//! publish acknowledgement. Many publishes await their acks at once (one per aggregate run,
//! up to `relay.max_in_flight` in all); `Nats-Msg-Id` = row id, so the stream's duplicate
//! window drops a republish after a crash.
//!
//! Order within an aggregate: [`Publisher::publish_run`] keeps the default, one message at a
//! time, each after the previous was acknowledged. JetStream acknowledges each message on its
//! own: a message that fails (no stream captures its subject, the stream refuses it) does not
//! stop the next one of the same run from being stored, so sending a run without waiting
//! could land n+1 ahead of a failed n. Throughput comes from the many aggregates in flight.
//!
//! Connection: async-nats reconnects by itself with backoff. A lost connection fails every
//! publish still waiting for its ack at once (connection-level, handed back): the ack of a
//! message sent on the old connection can never arrive. Handing such a message back is safe:
//! if it was stored, its republish is dropped by the duplicate window. Messages go through the
//! client's single command queue in order, so one sent before the loss is stored, if at all,
//! before anything sent after it.
//!
//! The server URL is taken apart once, with the configuration (`crate::config::nats`).
//!
//! Files: `wire` (headers),
//! `classify` (errors to outcomes), `window` (the streams' duplicate windows against the
//! lease, checked at the first connect), `declare` (the development stream of
//! `publisher.nats.declare_stream`, created at every connect unless it exists).

mod classify;
mod declare;
mod window;
mod wire;

pub use classify::classify;
pub use declare::{Declared, StreamDeclaration, subject_filters};
pub use window::{WindowAudit, required_window};
pub use wire::is_own;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::ContextBuilder;
use async_nats::jetstream::message::PublishMessage;
use async_nats::{Client, ConnectOptions, Event};
use async_trait::async_trait;
use tokio::sync::watch;

use super::envelope::{self, EnvelopeConfig};
use super::slot::{Connection, Slot};
use super::{ConnectError, Outcome, Publisher};
use crate::backoff::doubled;
use crate::config::NatsConfig;
use crate::config::nats::{Credentials, ServerUrl, check_subject, redact};
use crate::message::OutboxMessage;

/// How long `connect` waits for a client that is reconnecting on its own before it reports
/// the broker still away (the relay then backs off and asks again).
const RECONNECT_WAIT: Duration = Duration::from_secs(2);

/// The JetStream API subject answering with the account's information.
const JS_INFO: &str = "$JS.API.INFO";

/// The longest wait to open a TCP connection and finish the NATS handshake.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected client and its JetStream context. The client reconnects by itself, so the
/// first one is never replaced.
struct Live {
    generation: u64,
    client: Client,
    js: async_nats::jetstream::Context,
}

impl Connection for Live {
    fn generation(&self) -> u64 {
        self.generation
    }
}

/// Publishes to NATS JetStream streams.
pub struct NatsPublisher {
    cfg: NatsConfig,
    /// Publish acks the context lets wait at once: above the relay's window, so that acks
    /// abandoned on a lost connection (the client keeps them until `ack_timeout`) never make a
    /// new publish wait.
    max_acks: usize,
    slot: Slot<Live>,
    /// Whether the relay may publish: cleared when the connection drops or a publish finds no
    /// answer, set again by `connect` once JetStream answers.
    up: Arc<AtomicBool>,
    /// Counts lost connections: a publish waiting for its ack gives up when it changes.
    lost: Arc<watch::Sender<u64>>,
    /// The duplicate-window check run at the first successful connect, if any.
    audit: Option<WindowAudit>,
    /// What that check found (see [`Publisher::advisories`]); `None` until it ran.
    advisories: Mutex<Option<Vec<String>>>,
    /// The development stream to create at every connect, if any.
    declaration: Option<StreamDeclaration>,
    /// Whether the declaration was logged (once; a stream created anew is logged again).
    declared_logged: AtomicBool,
}

impl NatsPublisher {
    /// A publisher that connects on the first [`Publisher::connect`]; `max_in_flight` is the
    /// relay's window.
    pub fn new(cfg: NatsConfig, max_in_flight: usize) -> Self {
        Self {
            cfg,
            max_acks: max_in_flight.saturating_mul(4).max(5_000),
            slot: Slot::new(),
            up: Arc::new(AtomicBool::new(false)),
            lost: Arc::new(watch::channel(0).0),
            audit: None,
            advisories: Mutex::new(None),
            declaration: None,
            declared_logged: AtomicBool::new(false),
        }
    }

    /// Creates `declaration`'s stream, unless it exists, at every connect.
    pub fn with_declared_stream(mut self, declaration: StreamDeclaration) -> Self {
        self.declaration = Some(declaration);
        self
    }

    /// Creates the development stream unless it exists; logs the first outcome, and every
    /// creation after it (a server that lost the stream).
    async fn declare_stream(&self, live: &Live) -> Result<(), ConnectError> {
        let Some(declaration) = &self.declaration else {
            return Ok(());
        };
        let wait = CONNECTION_TIMEOUT.min(self.cfg.ack_timeout);
        let declared = tokio::time::timeout(wait, declaration.declare(&live.js))
            .await
            .map_err(|_| {
                ConnectError(format!(
                    "JetStream at {} did not answer within {} when asked for stream {:?} (publisher.nats.declare_stream)",
                    self.shown(),
                    humantime::format_duration(wait),
                    declaration.name
                ))
            })?
            .map_err(ConnectError)?;
        let first = !self.declared_logged.swap(true, Ordering::Relaxed);
        if first || declared == Declared::Created {
            tracing::info!("{}", declaration.describe(&declared));
        }
        Ok(())
    }

    /// Checks, at the first successful connect, that the streams capturing the subjects keep
    /// duplicates out for long enough (see [`WindowAudit`]).
    pub fn with_window_audit(mut self, audit: WindowAudit) -> Self {
        self.audit = Some(audit);
        self
    }

    /// Runs the duplicate-window check once, logging each finding as a warning.
    async fn audit_once(&self, live: &Live) {
        let Some(audit) = &self.audit else {
            return;
        };
        if self
            .advisories
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
        {
            return;
        }
        let wait = CONNECTION_TIMEOUT.min(self.cfg.ack_timeout);
        let found = tokio::time::timeout(wait, audit.warnings(&live.js))
            .await
            .unwrap_or_default();
        for warning in &found {
            tracing::warn!("{warning}");
        }
        *self.advisories.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
    }

    fn shown(&self) -> String {
        redact(&self.cfg.url)
    }

    /// Opens a client (no retry: a server that is down at start is the relay's to wait for).
    async fn open(&self, generation: u64) -> Result<Live, ConnectError> {
        let server = &self.cfg.server;
        let (up, lost) = (Arc::clone(&self.up), Arc::clone(&self.lost));
        let options = authenticate(server, ConnectOptions::new())
            .name(crate::message::APPLICATION_NAME)
            .connection_timeout(CONNECTION_TIMEOUT.min(self.cfg.ack_timeout))
            .max_reconnects(None)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |event| {
                let (up, lost) = (Arc::clone(&up), Arc::clone(&lost));
                async move { on_event(&event, &up, &lost) }
            });
        let client = options
            .connect(server.address.as_str())
            .await
            .map_err(|e| {
                ConnectError(format!("cannot connect to NATS at {}: {e}", self.shown()))
            })?;
        let js = ContextBuilder::new()
            .timeout(self.cfg.ack_timeout)
            .ack_timeout(self.cfg.ack_timeout)
            .max_ack_inflight(self.max_acks)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Ok(Live {
            generation,
            client,
            js,
        })
    }

    /// Asks JetStream for the account's information (`$JS.API.INFO`): proof that it runs and
    /// answers. Read as plain JSON: only whether it is an error matters here.
    async fn probe(&self, live: &Live) -> Result<(), ConnectError> {
        let wait = CONNECTION_TIMEOUT.min(self.cfg.ack_timeout);
        let asked = live.client.request(JS_INFO, "".into());
        let reply = match tokio::time::timeout(wait, asked).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => {
                return Err(ConnectError(format!(
                    "NATS at {} is reachable but JetStream does not answer ({e}); is nats-server running with JetStream (-js)?",
                    self.shown()
                )));
            }
            Err(_) => {
                // A connection that carries nothing (a black hole): start over.
                let _ = live.client.force_reconnect().await;
                return Err(ConnectError(format!(
                    "JetStream at {} did not answer within {}",
                    self.shown(),
                    humantime::format_duration(wait)
                )));
            }
        };
        match serde_json::from_slice::<serde_json::Value>(&reply.payload) {
            Ok(v) if v.get("error").is_none() => Ok(()),
            Ok(v) => Err(ConnectError(format!(
                "JetStream at {} refused the account information request: {}",
                self.shown(),
                v["error"]
            ))),
            Err(e) => Err(ConnectError(format!(
                "JetStream at {} answered the account information request with something that is not JSON: {e}",
                self.shown()
            ))),
        }
    }

    /// A connection-level outcome: the relay stops claiming until `connect` succeeds again.
    fn unavailable(&self, reason: String) -> Outcome {
        self.up.store(false, Ordering::Relaxed);
        Outcome::Unavailable(reason)
    }
}

/// `options` with the credentials `server`'s URL carried.
pub fn authenticate(server: &ServerUrl, options: ConnectOptions) -> ConnectOptions {
    match &server.credentials {
        Credentials::None => options,
        Credentials::UserPassword(user, pass) => {
            options.user_and_password(user.clone(), pass.clone())
        }
        Credentials::Token(token) => options.token(token.clone()),
    }
}

/// Delay before the client's reconnect attempt number `attempts`: 0, then doubling from
/// 100 ms up to 5 s.
fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let n = u32::try_from(attempts - 2).unwrap_or(u32::MAX);
    doubled(Duration::from_millis(100), n, Duration::from_secs(5))
}

/// The client's connection events: a lost connection fails the publishes waiting for acks
/// and stops claiming (see the module docs).
fn on_event(event: &Event, up: &AtomicBool, lost: &watch::Sender<u64>) {
    match event {
        Event::Disconnected => {
            up.store(false, Ordering::Relaxed);
            lost.send_modify(|n| *n += 1);
            tracing::warn!("NATS connection lost; the client reconnects with backoff");
        }
        Event::Connected => tracing::info!("NATS connection (re)established"),
        Event::Closed => {
            up.store(false, Ordering::Relaxed);
            lost.send_modify(|n| *n += 1);
        }
        Event::LameDuckMode => {
            tracing::warn!("the NATS server is entering lame duck mode (shutting down)")
        }
        Event::ServerError(e) => tracing::warn!(error = %e, "NATS server error"),
        Event::ClientError(e) => tracing::warn!(error = %e, "NATS client error"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

#[async_trait]
impl Publisher for NatsPublisher {
    fn kind(&self) -> &'static str {
        "nats"
    }

    fn describe(&self) -> String {
        format!(
            "nats {} subject {:?}",
            self.shown(),
            self.cfg.subject.as_str()
        )
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        let connecting = self.slot.connecting().await;
        if self.is_connected() {
            return Ok(());
        }
        let live = connecting
            .get_or_connect(|_| true, |generation| self.open(generation))
            .await?;
        // The client reconnects on its own: wait for it a little.
        let deadline = tokio::time::Instant::now() + RECONNECT_WAIT;
        while live.client.connection_state() != State::Connected {
            if tokio::time::Instant::now() >= deadline {
                return Err(ConnectError(format!(
                    "NATS at {} is not reachable yet; the client keeps reconnecting",
                    self.shown()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.probe(&live).await?;
        self.declare_stream(&live).await?;
        self.audit_once(&live).await;
        self.up.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn advisories(&self) -> Vec<String> {
        let found = self.advisories.lock().unwrap_or_else(|p| p.into_inner());
        found.clone().unwrap_or_default()
    }

    fn is_connected(&self) -> bool {
        self.up.load(Ordering::Relaxed)
            && self
                .slot
                .get()
                .is_some_and(|l| l.client.connection_state() == State::Connected)
    }

    async fn publish(&self, msg: &OutboxMessage, env: &EnvelopeConfig) -> Outcome {
        let subject = envelope::destination(msg, &env.route);
        if let Err(why) = check_subject(&subject) {
            return Outcome::Rejected(format!(
                "subject {subject:.200?} cannot be published to: {why}"
            ));
        }
        let headers = match wire::headers(msg, env, &subject) {
            Ok(h) => h,
            Err(why) => return Outcome::Rejected(why),
        };
        let Some(live) = self.slot.get() else {
            return self.unavailable("not connected to NATS yet".to_owned());
        };
        // Subscribed before the state check: a loss after it is seen below.
        let mut lost = self.lost.subscribe();
        let epoch = *lost.borrow_and_update();
        if live.client.connection_state() != State::Connected {
            return self.unavailable("the NATS connection is down; reconnecting".to_owned());
        }
        let message = PublishMessage::build()
            .payload(msg.payload.clone().into())
            .headers(headers);
        let publishing = async {
            let ack = live.js.send_publish(subject.clone(), message).await?;
            ack.await
        };
        let answer = tokio::select! {
            a = publishing => a,
            _ = lost.wait_for(|n| *n != epoch) => {
                return self.unavailable("the NATS connection was lost before the publish was acknowledged".to_owned());
            }
        };
        match answer {
            Ok(ack) => {
                if ack.duplicate {
                    tracing::debug!(id = %msg.id, stream = %ack.stream, "already in the stream (duplicate window); confirmed");
                }
                Outcome::Confirmed
            }
            Err(e) => match classify(&e, &subject, self.cfg.ack_timeout) {
                Outcome::Unavailable(why) => self.unavailable(why),
                other => other,
            },
        }
    }

    async fn close(&self) {
        let live = self.slot.take();
        self.up.store(false, Ordering::Relaxed);
        if let Some(live) = live {
            // Short: the drain is over by now and shutdown_timeout is the operator's budget.
            let _ = tokio::time::timeout(Duration::from_secs(2), live.client.drain()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnects_back_off_to_five_seconds() {
        let delays: Vec<u128> = (0..12).map(|a| reconnect_delay(a).as_millis()).collect();
        assert_eq!(
            delays,
            [0, 0, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]
        );
    }

    #[test]
    fn a_lost_connection_stops_claiming_and_wakes_the_waiting_publishes() {
        let up = AtomicBool::new(true);
        let lost = watch::channel(0).0;
        let waiting = lost.subscribe();
        on_event(&Event::Connected, &up, &lost);
        assert!(up.load(Ordering::Relaxed));
        on_event(&Event::Disconnected, &up, &lost);
        assert!(!up.load(Ordering::Relaxed));
        assert!(waiting.has_changed().unwrap());
    }

    #[test]
    fn describe_hides_the_password() {
        let cfg = NatsConfig {
            url: "nats://app:hunter2@127.0.0.1:4222".into(),
            server: ServerUrl::parse("nats://app:hunter2@127.0.0.1:4222").unwrap(),
            subject: crate::template::Template::parse("outbox.{aggregate_type}").unwrap(),
            ack_timeout: Duration::from_secs(30),
            declare_stream: None,
        };
        let p = NatsPublisher::new(cfg, 1000);
        let d = p.describe();
        assert!(
            d.contains("app:***@127.0.0.1:4222") && !d.contains("hunter2"),
            "{d}"
        );
        assert!(!p.is_connected());
    }
}
