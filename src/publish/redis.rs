//! Redis Streams transport (the `redis` crate): each message is one
//! `XADD <stream> [MAXLEN ~ n] * field value …` on one multiplexed connection, confirmed by its
//! reply (the entry id). Many `XADD`s are in flight at once on that connection (the relay
//! publishes many aggregates concurrently); Redis answers them in the order it executed them.
//!
//! Per-aggregate order (`relay.ordering = "aggregate"`): a run of one aggregate is published
//! one message at a time, each `XADD` sent only after the previous one's reply said it was
//! appended (the default [`Publisher::publish_run`]). Sending the run without waiting would
//! not be safe: Redis runs each command on its own, so after a failed `XADD` n (an `OOM`
//! reply, say, or `WRONGTYPE` for a row whose `destination` names another key) the `XADD` n+1
//! already queued behind it would still be appended, ahead of n's retry. Waiting costs one
//! round trip per message of a run, while the other aggregates' runs keep the connection busy.
//!
//! Failures: a reply error that concerns the message or its key (`WRONGTYPE`, an ACL
//! `NOPERM`, `ERR …`) is message-level. A lost or refused connection, no reply within
//! `publisher.redis.timeout`, or a reply that says the server cannot take writes now
//! (`LOADING`, `OOM`, `MISCONF`, `READONLY`, `BUSY`, …) is connection-level: the row is handed
//! back without spending an attempt and the connection is replaced. After a server-state
//! reply the next [`Publisher::connect`] fails once, so the relay waits its reconnect backoff
//! instead of claiming again at once.
//!
//! A message with a field longer than the server's `proto-max-bulk-len` (read with `CONFIG
//! GET` at connect) is refused before it is sent, message-level ([`too_large`]): Redis would
//! drop the connection over it, and the row would come back for ever.
//!
//! The connection speaks RESP3 so that the client reports a lost connection at once (a
//! `Disconnection` push): [`Publisher::is_connected`] turns false, `/readyz` fails and the
//! relay stops claiming without waiting for a publish to fail.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{
    AsyncConnectionConfig, Client, Cmd, ProtocolVersion, PushInfo, PushKind, RedisError,
};
use async_trait::async_trait;

use super::envelope::{self, EnvelopeConfig};
use super::slot::{Connection, Slot};
use super::{ConnectError, Outcome, Publisher};
use crate::config::RedisConfig;
use crate::message::OutboxMessage;
use crate::redact::redact_url;

/// How long opening a connection (TCP, `HELLO`, `AUTH`, `SELECT`) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Commands queued for the connection's writer: enough for a full in-flight window of
/// `XADD`s to be handed over without waiting for the writer task.
const PIPELINE_BUFFER: usize = 1024;

/// Reply error codes that say the server cannot take writes now, whatever the message: a
/// server condition, like an outage, so no attempt is spent.
const SERVER_STATE_CODES: &[&str] = &[
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "READONLY",
    "MISCONF",
    "OOM",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "NOAUTH",
];

/// What a failed command means for the row and the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// This message (or its key) was refused: spend the attempt, back off.
    Message(String),
    /// The server cannot take writes now: hand back, replace the connection, wait.
    ServerState(String),
    /// The connection was lost, refused or did not answer in time: hand back, reconnect.
    Connection(String),
}

impl Failure {
    /// The relay's outcome for this failure.
    pub fn outcome(self) -> Outcome {
        match self {
            Self::Message(why) => Outcome::Rejected(why),
            Self::ServerState(why) | Self::Connection(why) => Outcome::Unavailable(why),
        }
    }
}

/// Classifies the error of one `XADD` (see the module docs).
pub fn classify(err: &RedisError) -> Failure {
    let text = err.to_string();
    let Some(code) = err.code() else {
        // I/O, timeout, a closed connection, a reply that could not be parsed: the
        // connection, not the message.
        return Failure::Connection(text);
    };
    if SERVER_STATE_CODES.contains(&code) {
        Failure::ServerState(text)
    } else {
        Failure::Message(text)
    }
}

/// The `XADD` fields of `msg` routed to `stream`, in the contract's order: the CloudEvents
/// attributes (`subject` only with an aggregate id), `headers` (the row's headers as a JSON
/// object, values as strings, nulls dropped; `{}` when none), `data` (the payload bytes) and,
/// with signing on, `outbox-signature`. A row header named `outbox-signature` is dropped when
/// the relay signs (the relay's value wins).
pub fn fields(
    msg: &OutboxMessage,
    env: &EnvelopeConfig,
    stream: &str,
) -> Vec<(&'static str, Vec<u8>)> {
    let mut out: Vec<(&'static str, Vec<u8>)> = Vec::with_capacity(11);
    out.push(("id", msg.id.to_string().into_bytes()));
    out.push(("source", env.source.clone().into_bytes()));
    out.push(("specversion", b"1.0".to_vec()));
    out.push(("type", msg.event_type.clone().into_bytes()));
    if let Some(subject) = envelope::subject(msg) {
        out.push(("subject", subject.as_bytes().to_vec()));
    }
    out.push(("time", envelope::time(msg).into_bytes()));
    out.push((
        "datacontenttype",
        env.payload_kind.content_type().as_bytes().to_vec(),
    ));
    out.push(("aggregatetype", msg.aggregate_type.clone().into_bytes()));
    let signature = envelope::signature(msg, env, stream);
    let row_headers =
        envelope::row_headers_beside(msg, |name| envelope::is_signature_header(name, env));
    let mut headers = serde_json::Map::with_capacity(row_headers.len());
    for (name, value) in row_headers {
        headers.insert(name, serde_json::Value::String(value));
    }
    out.push((
        "headers",
        serde_json::Value::Object(headers).to_string().into_bytes(),
    ));
    out.push(("data", msg.payload.clone()));
    if let Some(sig) = signature {
        out.push((crate::signing::HEADER, sig.into_bytes()));
    }
    out
}

/// The `XADD` of `msg`: to the stream key its row's `destination` or the template names,
/// trimmed with `MAXLEN ~ max_len` when set.
pub fn xadd(msg: &OutboxMessage, env: &EnvelopeConfig, max_len: Option<u64>) -> Cmd {
    let stream = envelope::destination(msg, &env.route);
    let mut cmd = ::redis::cmd("XADD");
    cmd.arg(stream.as_bytes());
    if let Some(n) = max_len {
        cmd.arg("MAXLEN").arg("~").arg(n);
    }
    cmd.arg("*");
    for (name, value) in fields(msg, env, &stream) {
        cmd.arg(name).arg(value);
    }
    cmd
}

/// A live connection.
struct Live {
    /// Distinguishes this connection from its successors, so that a failure seen on an old
    /// one never drops a newer one.
    generation: u64,
    connection: MultiplexedConnection,
    /// Cleared by the client's `Disconnection` push and by a connection-level failure.
    up: Arc<AtomicBool>,
    /// The server's `proto-max-bulk-len`: a longer field makes Redis drop the connection
    /// (see [`too_large`]).
    max_bulk: u64,
}

impl Connection for Live {
    fn generation(&self) -> u64 {
        self.generation
    }

    /// Dropping the last handle closes it.
    fn retire(self: Arc<Self>) {
        self.up.store(false, Ordering::Relaxed);
    }
}

/// Redis's default `proto-max-bulk-len` (512 MB), assumed when `CONFIG GET` is not allowed.
const DEFAULT_MAX_BULK: u64 = 512 * 1024 * 1024;

/// Why `cmd` cannot be sent to a server whose `proto-max-bulk-len` is `max_bulk`, if it
/// cannot. Redis answers an argument longer than that with a protocol error and closes the
/// connection, which the client may see as a lost connection before it reads the error: the
/// row would be handed back and sent again for ever. Refused here, it is one failed row.
pub fn too_large(cmd: &Cmd, max_bulk: u64) -> Option<String> {
    let longest = cmd
        .args_iter()
        .map(|a| match a {
            ::redis::Arg::Simple(b) => b.len(),
            _ => 0,
        })
        .max()
        .unwrap_or(0);
    (u64::try_from(longest).unwrap_or(u64::MAX) > max_bulk).then(|| {
        format!(
            "the message has a {longest}-byte field, over the server's proto-max-bulk-len ({max_bulk} bytes)"
        )
    })
}

/// The `proto-max-bulk-len` of `CONFIG GET proto-max-bulk-len`'s reply (a RESP3 map or a
/// RESP2 pair), if it holds one.
fn max_bulk_of(reply: &::redis::Value) -> Option<u64> {
    use ::redis::Value as V;
    let value = match reply {
        V::Map(pairs) => pairs.first().map(|(_, v)| v),
        V::Array(items) => items.get(1),
        _ => None,
    }?;
    match value {
        V::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        V::SimpleString(s) => s.parse().ok(),
        V::Int(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

/// Publishes to Redis Streams with `XADD`.
pub struct RedisPublisher {
    cfg: RedisConfig,
    slot: Slot<Live>,
    /// A server-state reply seen since the last connect: the next connect fails with it once
    /// (see the module docs).
    hold_off: Mutex<Option<String>>,
}

impl RedisPublisher {
    /// A publisher that connects on the first [`Publisher::connect`].
    pub fn new(cfg: RedisConfig) -> Self {
        Self {
            cfg,
            slot: Slot::new(),
            hold_off: Mutex::new(None),
        }
    }

    fn fail(&self, what: &str, e: &RedisError) -> ConnectError {
        ConnectError(format!("{what} {}: {e}", redact_url(&self.cfg.url)))
    }

    /// Opens a RESP3 connection whose loss clears `up`, checks it with `PING` and reads the
    /// server's `proto-max-bulk-len`.
    async fn open(
        &self,
        up: &Arc<AtomicBool>,
    ) -> Result<(MultiplexedConnection, u64), ConnectError> {
        let client =
            Client::open(self.cfg.url.as_str()).map_err(|e| self.fail("invalid Redis URL", &e))?;
        let info = client.get_connection_info().clone();
        let redis = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = Client::open(info.set_redis_settings(redis))
            .map_err(|e| self.fail("invalid Redis URL", &e))?;
        let flag = Arc::clone(up);
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(self.cfg.timeout))
            .set_pipeline_buffer_size(PIPELINE_BUFFER)
            .set_push_sender(move |push: PushInfo| {
                if push.kind == PushKind::Disconnection {
                    flag.store(false, Ordering::Relaxed);
                }
                Ok::<(), std::convert::Infallible>(())
            });
        let mut connection = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| self.fail("cannot connect to", &e))?;
        ::redis::cmd("PING")
            .query_async::<::redis::Value>(&mut connection)
            .await
            .map_err(|e| self.fail("no answer to PING from", &e))?;
        // Managed services often forbid CONFIG: then Redis's default is assumed.
        let max_bulk = ::redis::cmd("CONFIG")
            .arg("GET")
            .arg("proto-max-bulk-len")
            .query_async::<::redis::Value>(&mut connection)
            .await
            .ok()
            .as_ref()
            .and_then(max_bulk_of)
            .unwrap_or(DEFAULT_MAX_BULK);
        Ok((connection, max_bulk))
    }
}

#[async_trait]
impl Publisher for RedisPublisher {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn describe(&self) -> String {
        let trim = self
            .cfg
            .max_len
            .map(|n| format!(" MAXLEN ~ {n}"))
            .unwrap_or_default();
        format!(
            "redis {} stream {:?}{trim}",
            redact_url(&self.cfg.url),
            self.cfg.stream.as_str()
        )
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        let open = |generation| async move {
            let held = self
                .hold_off
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            if let Some(why) = held {
                return Err(ConnectError(format!(
                    "Redis at {} refused a write: {why}",
                    redact_url(&self.cfg.url)
                )));
            }
            let up = Arc::new(AtomicBool::new(true));
            let (connection, max_bulk) = self.open(&up).await?;
            Ok(Live {
                generation,
                connection,
                up,
                max_bulk,
            })
        };
        self.slot
            .connecting()
            .await
            .get_or_connect(|live| live.up.load(Ordering::Relaxed), open)
            .await
            .map(drop)
    }

    fn is_connected(&self) -> bool {
        self.slot
            .get()
            .is_some_and(|l| l.up.load(Ordering::Relaxed))
    }

    async fn publish(&self, msg: &OutboxMessage, env: &EnvelopeConfig) -> Outcome {
        let Some(live) = self.slot.get().filter(|l| l.up.load(Ordering::Relaxed)) else {
            return Outcome::Unavailable("not connected to Redis".to_owned());
        };
        let cmd = xadd(msg, env, self.cfg.max_len);
        if let Some(why) = too_large(&cmd, live.max_bulk) {
            return Outcome::Rejected(why);
        }
        let mut connection = live.connection.clone();
        match cmd.query_async::<::redis::Value>(&mut connection).await {
            Ok(_) => Outcome::Confirmed,
            Err(e) => {
                let failure = classify(&e);
                match &failure {
                    Failure::Message(_) => {}
                    Failure::ServerState(why) => {
                        *self.hold_off.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(why.clone());
                        self.slot.mark_down(live.generation);
                    }
                    Failure::Connection(_) => {
                        self.slot.mark_down(live.generation);
                    }
                }
                failure.outcome()
            }
        }
    }

    async fn close(&self) {
        drop(self.slot.take());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::PayloadKind;
    use crate::publish::envelope::tests::message;
    use crate::template::Template;

    fn env(signer: bool) -> EnvelopeConfig {
        EnvelopeConfig {
            route: Template::parse("outbox.{aggregate_type}").unwrap(),
            source: "/outbox/test/outbox_messages".into(),
            payload_kind: PayloadKind::Json,
            signer: signer.then(|| Arc::new(crate::signing::Signer::new("k1", &[7u8; 32]))),
        }
    }

    fn text(fields: &[(&'static str, Vec<u8>)]) -> Vec<(&'static str, String)> {
        fields
            .iter()
            .map(|(k, v)| (*k, String::from_utf8_lossy(v).into_owned()))
            .collect()
    }

    #[test]
    fn fields_follow_the_contract_in_order() {
        let m = message(r#"{"a":"x","n":1,"gone":null}"#);
        let got = text(&fields(&m, &env(false), "outbox.order"));
        let want = vec![
            ("id", "00000000-0000-0000-0000-000000000000".to_owned()),
            ("source", "/outbox/test/outbox_messages".to_owned()),
            ("specversion", "1.0".to_owned()),
            ("type", "created".to_owned()),
            ("subject", "42".to_owned()),
            ("time", "2026-01-02T03:04:05.000000Z".to_owned()),
            ("datacontenttype", "application/json".to_owned()),
            ("aggregatetype", "order".to_owned()),
            ("headers", r#"{"a":"x","n":"1"}"#.to_owned()),
            ("data", "{}".to_owned()),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn absent_attributes_are_omitted_and_headers_default_to_an_empty_object() {
        let mut m = message("");
        m.aggregate_id = None;
        let got = text(&fields(&m, &env(false), "outbox.order"));
        assert!(got.iter().all(|(k, _)| *k != "subject"), "{got:?}");
        assert!(got.contains(&("headers", "{}".to_owned())), "{got:?}");
        let not_object = text(&fields(&message("[1]"), &env(false), "s"));
        assert!(not_object.contains(&("headers", "{}".to_owned())));
    }

    #[test]
    fn signing_adds_the_signature_over_the_stream_key_and_replaces_the_rows() {
        let m = message(r#"{"outbox-signature":"forged","k":"v"}"#);
        let e = env(true);
        let got = text(&fields(&m, &e, "outbox.order"));
        let sig = envelope::signature(&m, &e, "outbox.order").unwrap();
        assert_eq!(got.last(), Some(&("outbox-signature", sig.clone())));
        assert!(
            got.contains(&("headers", r#"{"k":"v"}"#.to_owned())),
            "{got:?}"
        );
        let elsewhere = envelope::signature(&m, &e, "other").unwrap();
        assert_ne!(sig, elsewhere, "the stream key is signed");
        let unsigned = text(&fields(&m, &env(false), "outbox.order"));
        let headers = r#"{"k":"v","outbox-signature":"forged"}"#.to_owned();
        assert!(unsigned.contains(&("headers", headers)), "{unsigned:?}");
    }

    #[test]
    fn xadd_goes_to_the_rendered_or_overridden_stream_with_optional_trimming() {
        let args = |cmd: &Cmd| -> Vec<String> {
            cmd.args_iter()
                .map(|a| match a {
                    ::redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                    _ => "<other>".to_owned(),
                })
                .collect()
        };
        let mut m = message("{}");
        let plain = args(&xadd(&m, &env(false), None));
        assert_eq!(plain[..4], ["XADD", "outbox.order", "*", "id"]);
        m.destination = Some("special".into());
        let trimmed = args(&xadd(&m, &env(false), Some(500)));
        assert_eq!(
            trimmed[..7],
            ["XADD", "special", "MAXLEN", "~", "500", "*", "id"]
        );
    }

    #[test]
    fn a_field_over_the_servers_bulk_limit_is_refused_before_sending() {
        let mut m = message("{}");
        m.payload = vec![b'x'; 2000];
        let cmd = xadd(&m, &env(false), None);
        let why = too_large(&cmd, 1999).unwrap();
        assert!(why.contains("2000-byte") && why.contains("1999"), "{why}");
        assert_eq!(too_large(&cmd, 2000), None);
        use ::redis::Value as V;
        let name = || V::BulkString(b"proto-max-bulk-len".to_vec());
        let value = || V::BulkString(b"1048576".to_vec());
        assert_eq!(
            max_bulk_of(&V::Map(vec![(name(), value())])),
            Some(1_048_576)
        );
        assert_eq!(
            max_bulk_of(&V::Array(vec![name(), value()])),
            Some(1_048_576)
        );
        assert_eq!(max_bulk_of(&V::Array(vec![])), None);
    }

    #[test]
    fn classifies_message_server_and_connection_failures() {
        let reply = |code: &str| {
            classify(&::redis::make_extension_error(
                code.to_owned(),
                Some("detail".to_owned()),
            ))
        };
        let kind = |f: Failure| match f {
            Failure::Message(_) => "message",
            Failure::ServerState(_) => "server",
            Failure::Connection(_) => "connection",
        };
        for (code, want) in [
            ("WRONGTYPE", "message"),
            ("ERR", "message"),
            ("NOPERM", "message"),
            ("MOVED", "message"),
            ("OOM", "server"),
            ("LOADING", "server"),
            ("MISCONF", "server"),
            ("READONLY", "server"),
            ("BUSY", "server"),
            ("NOAUTH", "server"),
        ] {
            assert_eq!(kind(reply(code)), want, "{code}");
        }
        for io in [
            std::io::ErrorKind::ConnectionReset,
            std::io::ErrorKind::ConnectionRefused,
            std::io::ErrorKind::TimedOut,
            std::io::ErrorKind::BrokenPipe,
            std::io::ErrorKind::UnexpectedEof,
        ] {
            let e = RedisError::from(std::io::Error::from(io));
            assert_eq!(kind(classify(&e)), "connection", "{io:?}");
        }
        assert!(matches!(
            reply("WRONGTYPE").outcome(),
            Outcome::Rejected(why) if why.contains("WRONGTYPE")
        ));
        assert!(matches!(reply("OOM").outcome(), Outcome::Unavailable(_)));
    }
}
