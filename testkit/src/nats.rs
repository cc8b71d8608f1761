//! NATS JetStream side of the kit: a stream per test capturing the test's own subjects
//! ([`NatsStream`]), every message it holds read back in stream order, and a relay configured
//! for it.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use async_nats::jetstream::stream::{Config, StorageType};
use async_nats::jetstream::{self, Context};
use futures::StreamExt;

use crate::{RelayBuilder, TestTable, hex8, slug, wait_until};

/// The test server (`nats-server -js`, see scripts/services.sh).
pub const NATS_URL: &str = "nats://127.0.0.1:4222";
/// Its TCP address, for the proxy.
pub const NATS_ADDR: &str = "127.0.0.1:4222";

/// One message as the stream holds it.
#[derive(Debug, Clone)]
pub struct StreamMessage {
    /// Stream sequence (arrival order).
    pub seq: u64,
    /// The subject it was published to.
    pub subject: String,
    /// Its headers (the last value of each name).
    pub headers: BTreeMap<String, String>,
    /// Its body.
    pub payload: Vec<u8>,
}

impl StreamMessage {
    /// The header `name`, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// `Nats-Msg-Id` (the row id), or "" without one.
    pub fn id(&self) -> &str {
        self.header("Nats-Msg-Id").unwrap_or("")
    }
}

/// A memory stream of the test's own, `IT_<test>_<hex>`, capturing `it.<test>.<hex>.>` with a
/// two-minute duplicate window (the default, and above every test's lease).
pub struct NatsStream {
    /// Stream name.
    pub name: String,
    /// The subject prefix it captures (`<prefix>.>`).
    pub prefix: String,
    /// A JetStream context on the test server.
    pub js: Context,
}

/// Connects to the test server.
pub async fn nats_connect() -> Context {
    let client = async_nats::connect(NATS_URL).await.unwrap_or_else(|e| {
        panic!("cannot connect to {NATS_URL} (scripts/services.sh starts it): {e}")
    });
    jetstream::new(client)
}

impl NatsStream {
    /// Creates the stream for `test`.
    pub async fn new(test: &str) -> Self {
        let stream = Self::reserve(test).await;
        stream.create(&[format!("{}.>", stream.prefix)]).await;
        stream
    }

    /// A fresh name and prefix for `test`, without creating the stream (for a test in which
    /// the relay creates it; [`NatsStream::teardown`] deletes it all the same).
    pub async fn reserve(test: &str) -> Self {
        let hex = hex8();
        let s = slug(test, 40);
        let stream = Self {
            name: format!("IT_{s}_{hex}"),
            prefix: format!("it.{s}.{hex}"),
            js: nats_connect().await,
        };
        if !GC_DONE.swap(true, std::sync::atomic::Ordering::SeqCst) {
            collect_old_streams(&stream.js).await;
        }
        stream
    }

    /// The stream's configuration as the server has it, or `None` when it does not exist.
    pub async fn config(&self) -> Option<Config> {
        let mut stream = self.js.get_stream(&self.name).await.ok()?;
        Some(stream.info().await.ok()?.config.clone())
    }

    /// Deletes the stream, leaving this handle usable (for a test that has it created anew).
    pub async fn delete(&self) {
        self.js
            .delete_stream(&self.name)
            .await
            .unwrap_or_else(|e| panic!("cannot delete stream {}: {e}", self.name));
    }

    async fn create(&self, subjects: &[String]) {
        self.js
            .create_stream(Config {
                name: self.name.clone(),
                subjects: subjects.to_vec(),
                storage: StorageType::Memory,
                duplicate_window: Duration::from_secs(120),
                ..Config::default()
            })
            .await
            .unwrap_or_else(|e| panic!("cannot create stream {}: {e}", self.name));
    }

    /// Makes the stream capture exactly `subjects` from now on.
    pub async fn set_subjects(&self, subjects: &[String]) {
        let mut stream = self.js.get_stream(&self.name).await.expect("get stream");
        let mut config = stream.info().await.expect("stream info").config.clone();
        config.subjects = subjects.to_vec();
        self.js
            .update_stream(config)
            .await
            .unwrap_or_else(|e| panic!("cannot update stream {}: {e}", self.name));
    }

    /// Gives the stream a duplicate window of `window` from now on.
    pub async fn set_duplicate_window(&self, window: Duration) {
        let mut stream = self.js.get_stream(&self.name).await.expect("get stream");
        let mut config = stream.info().await.expect("stream info").config.clone();
        config.duplicate_window = window;
        self.js
            .update_stream(config)
            .await
            .unwrap_or_else(|e| panic!("cannot update stream {}: {e}", self.name));
    }

    /// `<prefix>.{aggregate_type}.{event_type}`: the relay's default subject under the prefix.
    pub fn subject_template(&self) -> String {
        format!("{}.{{aggregate_type}}.{{event_type}}", self.prefix)
    }

    /// Messages stored so far.
    pub async fn count(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.name).await.expect("get stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Waits until the stream holds at least `n` messages.
    pub async fn wait_count(&self, n: u64, timeout: Duration) {
        let what = format!("stream {} holds {n} messages", self.name);
        wait_until(timeout, &what, async || {
            let have = self.count().await;
            if have >= n {
                Ok(())
            } else {
                Err(format!("{have} so far"))
            }
        })
        .await;
    }

    /// Every message the stream holds now, in stream order.
    pub async fn messages(&self) -> Vec<StreamMessage> {
        let total = self.count().await;
        let stream = self.js.get_stream(&self.name).await.expect("get stream");
        let consumer = stream
            .create_consumer(pull::OrderedConfig {
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .expect("ordered consumer");
        let mut messages = consumer.messages().await.expect("consume");
        let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
        while (out.len() as u64) < total {
            let next = tokio::time::timeout(Duration::from_secs(30), messages.next()).await;
            let m = match next {
                Ok(Some(Ok(m))) => m,
                other => panic!(
                    "stream {}: read {} of {total} messages, then {:?}",
                    self.name,
                    out.len(),
                    other.map(|o| o.map(|r| r.map(|_| ())))
                ),
            };
            let seq = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            let headers = m
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .filter_map(|(k, v)| Some((k.to_string(), v.last()?.as_str().to_owned())))
                .collect();
            out.push(StreamMessage {
                seq,
                subject: m.subject.to_string(),
                headers,
                payload: m.payload.to_vec(),
            });
        }
        out
    }

    /// Deletes the stream.
    pub async fn teardown(self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// Whether this process has removed the streams earlier runs left behind.
static GC_DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Deletes test streams (`IT_…`) created more than an hour ago: a test that panicked before
/// its teardown leaves its memory stream on the shared server.
async fn collect_old_streams(js: &Context) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let mut streams = js.streams();
    let mut old = Vec::new();
    while let Some(Ok(info)) = streams.next().await {
        if info.config.name.starts_with("IT_") && now - info.created.unix_timestamp() > 3600 {
            old.push(info.config.name);
        }
    }
    for name in old {
        let _ = js.delete_stream(&name).await;
    }
}

/// A relay for `table` publishing to `stream` (default subject under its prefix), through
/// `url` (the server, or a proxy in front of it).
pub fn nats_relay(
    table: &TestTable,
    stream: &NatsStream,
    url: &str,
    instance: &str,
) -> RelayBuilder {
    RelayBuilder::for_table(table, instance)
        .set("publisher.kind", "nats")
        .set("publisher.nats.url", url)
        .set("publisher.nats.subject", stream.subject_template())
}
