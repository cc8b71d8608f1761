//! Redis Streams: a test's own stream keys (a unique prefix), read back with `XRANGE`, and the
//! relay configured to publish there.

use std::collections::BTreeMap;
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncCommands, Value};

use crate::{Analysis, RelayBuilder, RowState, TestTable, analyse, hex8, slug, wait_until};

/// The test server.
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Its TCP address, for the proxy.
pub const REDIS_ADDR: &str = "127.0.0.1:6379";

/// One stream entry: its id and its fields in the order sent.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The entry id Redis gave it (`<ms>-<n>`).
    pub entry_id: String,
    /// Field names and values, in order.
    pub fields: Vec<(String, Vec<u8>)>,
}

impl Entry {
    /// The value of field `name` as text, if present.
    pub fn field(&self, name: &str) -> Option<String> {
        self.fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    /// The field names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.fields.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// A test's stream keys: every key it uses starts with `prefix`; [`RedisStreams::teardown`]
/// deletes them.
pub struct RedisStreams {
    /// `it.<test>.<hex>`.
    pub prefix: String,
    conn: MultiplexedConnection,
}

impl RedisStreams {
    /// A fresh prefix for `test` and a connection to the test server.
    pub async fn new(test: &str) -> Self {
        let client = ::redis::Client::open(REDIS_URL).expect("redis URL");
        // The client's default reply timeout (500 ms) is shorter than a loaded test machine
        // may take to page through a 20k-entry stream.
        let config = ::redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(30)));
        let conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {REDIS_URL}: {e}"));
        Self {
            prefix: format!("it.{}.{}", slug(test, 30), hex8()),
            conn,
        }
    }

    /// The stream key `<prefix>.<name>`.
    pub fn key(&self, name: &str) -> String {
        format!("{}.{name}", self.prefix)
    }

    /// The relay's stream template: `<prefix>.{aggregate_type}`.
    pub fn template(&self) -> String {
        format!("{}.{{aggregate_type}}", self.prefix)
    }

    /// A connection of its own (commands a test sends besides reading).
    pub fn conn(&self) -> MultiplexedConnection {
        self.conn.clone()
    }

    /// Every entry of `key`, oldest first (empty when the key does not exist).
    pub async fn entries(&self, key: &str) -> Vec<Entry> {
        let mut conn = self.conn.clone();
        let mut out = Vec::new();
        let mut start = "-".to_owned();
        loop {
            let page: Value = ::redis::cmd("XRANGE")
                .arg(key)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(5000)
                .query_async(&mut conn)
                .await
                .unwrap_or_else(|e| panic!("XRANGE {key}: {e}"));
            let Value::Array(items) = page else {
                panic!("XRANGE {key}: unexpected reply {page:?}")
            };
            if items.is_empty() {
                return out;
            }
            for item in items {
                let entry = parse_entry(item);
                start = format!("({}", entry.entry_id);
                out.push(entry);
            }
        }
    }

    /// `XLEN key`.
    pub async fn len(&self, key: &str) -> usize {
        let mut conn = self.conn.clone();
        ::redis::cmd("XLEN")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("XLEN {key}: {e}"))
    }

    /// Every key of this test (`SCAN MATCH <prefix>*`).
    pub async fn keys(&self) -> Vec<String> {
        let mut conn = self.conn.clone();
        let pattern = format!("{}*", self.prefix);
        let mut keys: Vec<String> = Vec::new();
        let mut iter: ::redis::AsyncIter<String> = conn
            .scan_match(&pattern)
            .await
            .unwrap_or_else(|e| panic!("SCAN {pattern}: {e}"));
        while let Some(key) = futures::StreamExt::next(&mut iter).await {
            keys.push(key.unwrap_or_else(|e| panic!("SCAN {pattern}: {e}")));
        }
        keys.sort();
        keys
    }

    /// The entries of every stream of this test, by key.
    pub async fn all_entries(&self) -> BTreeMap<String, Vec<Entry>> {
        let mut out = BTreeMap::new();
        for key in self.keys().await {
            let kind: String = ::redis::cmd("TYPE")
                .arg(&key)
                .query_async(&mut self.conn.clone())
                .await
                .unwrap_or_else(|e| panic!("TYPE {key}: {e}"));
            if kind == "stream" {
                let entries = self.entries(&key).await;
                out.insert(key, entries);
            }
        }
        out
    }

    /// Waits until the streams of this test hold at least `n` entries in all.
    pub async fn wait_for_entries(&self, n: usize, timeout: Duration) {
        let what = format!("{n} entries in the streams {}*", self.prefix);
        wait_until(timeout, &what, async || {
            let mut total = 0;
            for key in self.keys().await {
                total += self.len_if_stream(&key).await;
            }
            if total >= n {
                Ok(())
            } else {
                Err(format!("{total} so far"))
            }
        })
        .await;
    }

    async fn len_if_stream(&self, key: &str) -> usize {
        let mut conn = self.conn.clone();
        let kind: String = ::redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        if kind == "stream" {
            self.len(key).await
        } else {
            0
        }
    }

    /// What every stream of this test holds (the `id` fields, stream by stream, each in
    /// append order) checked against `expected` (see [`analyse`]): per-aggregate order holds
    /// when an aggregate's entries are all in one stream, as with a template of
    /// `{aggregate_type}`.
    pub async fn analyse(&self, expected: &[RowState]) -> Analysis {
        let all = self.all_entries().await;
        let ids: Vec<String> = all
            .values()
            .flatten()
            .map(|e| e.field("id").unwrap_or_else(|| "<no id>".to_owned()))
            .collect();
        analyse(expected, ids.iter().map(String::as_str))
    }

    /// Deletes every key of this test.
    pub async fn teardown(self) {
        let keys = self.keys().await;
        if !keys.is_empty() {
            let mut conn = self.conn.clone();
            let _: Result<(), _> = conn.del(keys).await;
        }
    }
}

/// An `XRANGE` item: `[id, [field, value, …]]`.
fn parse_entry(item: Value) -> Entry {
    let Value::Array(mut parts) = item else {
        panic!("stream entry is not an array: {item:?}")
    };
    let (Some(Value::Array(flat)), Some(id)) = (parts.pop(), parts.pop()) else {
        panic!("stream entry has no id and fields")
    };
    let entry_id = bytes(id);
    let mut fields = Vec::with_capacity(flat.len() / 2);
    let mut it = flat.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        fields.push((
            String::from_utf8_lossy(&bytes_raw(k)).into_owned(),
            bytes_raw(v),
        ));
    }
    Entry {
        entry_id: String::from_utf8_lossy(&entry_id).into_owned(),
        fields,
    }
}

fn bytes(v: Value) -> Vec<u8> {
    bytes_raw(v)
}

fn bytes_raw(v: Value) -> Vec<u8> {
    match v {
        Value::BulkString(b) => b,
        Value::SimpleString(s) => s.into_bytes(),
        other => panic!("expected a string, got {other:?}"),
    }
}

/// `outbox-relay run` for `table` (instance id `instance`) publishing to Redis at `url`, to the
/// streams `template`.
pub fn redis_relay(table: &TestTable, url: &str, template: &str, instance: &str) -> RelayBuilder {
    RelayBuilder::for_table(table, instance)
        .set("publisher.kind", "redis")
        .set("publisher.redis.url", url)
        .set("publisher.redis.stream", template)
}
