//! Signed messages (docs/wire-format.md, docs/configuration.md): real messages consumed from RabbitMQ and Kafka carry
//! `outbox-signature`, and two implementations independent of the relay's — a Python
//! standard-library script (`scripts/verify-signature.py`) and RustCrypto (`signing/verify.rs`),
//! both shown in docs/wire-format.md — accept them, while a tampered body, a changed routing key or
//! type, and an unknown key id fail. Key rotation, a retried message's unchanged signature, and
//! the key's absence from every output are checked on the way.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;
#[path = "signing/verify.rs"]
mod verify;

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use common::kafka::Record;
use common::transport::{Sink, Transport};
use common::{
    AMQP_URL, Delivered, NewRow, RabbitFixture, RelayBuilder, TestTable, drop_both, repo_file,
    repo_path, table_and_exchange, wait_for_count,
};
use lapin::Connection;
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::{Value, json};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);
/// A text key (40 bytes).
const KEY_A: &str = "relay-signing-key-A-0123456789abcdefghij";
/// A binary key, 32 random-looking bytes.
const KEY_B: [u8; 32] = [
    0x9c, 0x01, 0xfe, 0x42, 0x00, 0x7a, 0x13, 0xee, 0x5d, 0x88, 0x21, 0x0b, 0xc4, 0x6f, 0x99, 0x30,
    0x17, 0xa2, 0x4e, 0xd0, 0x3b, 0x66, 0xf1, 0x08, 0x2c, 0x95, 0x7e, 0xb3, 0x50, 0x0d, 0xca, 0x81,
];

/// Key id → key, as a consumer knows them.
type Keys<'a> = [(&'a str, &'a [u8])];

/// One received message, as a consumer reads it.
#[derive(Debug, Clone)]
struct Received {
    header: String,
    id: String,
    source: String,
    event_type: String,
    subject: Option<String>,
    route: String,
    time: String,
    content_type: String,
    body: Vec<u8>,
}

impl Received {
    /// A message whose header `k` is `get(k)`, the CloudEvents attributes named
    /// `<prefix><attribute>`. `content-type` is looked up without the prefix; on AMQP it is the
    /// message property, which `from_amqp`'s `get` returns for that key.
    fn new(get: impl Fn(&str) -> Option<String>, prefix: &str, route: &str, body: &[u8]) -> Self {
        let ce = |k: &str| get(&format!("{prefix}{k}"));
        Self {
            header: get("outbox-signature").unwrap_or_default(),
            id: ce("id").unwrap_or_default(),
            source: ce("source").unwrap_or_default(),
            event_type: ce("type").unwrap_or_default(),
            subject: ce("subject"),
            route: route.to_owned(),
            time: ce("time").unwrap_or_default(),
            content_type: get("content-type").unwrap_or_default(),
            body: body.to_vec(),
        }
    }

    /// On AMQP `content-type` is the message property, not a header.
    fn from_amqp(d: &Delivered) -> Self {
        let (h, content_type) = (d.headers(), d.properties.content_type());
        let get = |k: &str| match k {
            "content-type" => content_type.as_ref().map(ToString::to_string),
            _ => h.get(k).cloned(),
        };
        Self::new(get, "cloudEvents:", &d.routing_key, &d.body)
    }

    fn from_kafka(r: &Record) -> Self {
        let get = |k: &str| r.header(k).map(str::to_owned);
        Self::new(get, "ce_", &r.topic, &r.payload)
    }

    fn json(&self) -> Value {
        json!({
            "header": self.header, "id": self.id, "source": self.source, "type": self.event_type,
            "subject": self.subject, "route": self.route, "time": self.time,
            "datacontenttype": self.content_type, "body_base64": STANDARD.encode(&self.body),
        })
    }
}

/// Verdicts of `scripts/verify-signature.py` for `messages` under `keys`.
fn python_verify(keys: &Keys, messages: &[Received]) -> Vec<bool> {
    let encoded = |(k, v): &(&str, &[u8])| ((*k).to_owned(), STANDARD.encode(v).into());
    let keys: serde_json::Map<_, _> = keys.iter().map(encoded).collect();
    let messages: Vec<Value> = messages.iter().map(Received::json).collect();
    let mut child = Command::new("python3")
        .arg(repo_path("scripts/verify-signature.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let request = json!({"keys": keys, "messages": messages}).to_string();
    let stdin = child.stdin.as_mut().unwrap();
    stdin.write_all(request.as_bytes()).unwrap();
    // wait_with_output closes stdin first: the script reads its request to end of input.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "verify-signature.py failed: {stderr}");
    serde_json::from_slice(&out.stdout).expect("a JSON list of verdicts")
}

/// Verdicts of the RustCrypto verifier.
fn rust_verify(keys: &Keys, messages: &[Received]) -> Vec<bool> {
    let keys: HashMap<&str, &[u8]> = keys.iter().copied().collect();
    let verdict = |m: &Received| {
        let attrs = [
            m.id.as_str(),
            m.source.as_str(),
            m.event_type.as_str(),
            m.subject.as_deref().unwrap_or(""),
            m.route.as_str(),
            m.time.as_str(),
            m.content_type.as_str(),
        ];
        verify::verify(&m.header, &keys, attrs, &m.body)
    };
    messages.iter().map(verdict).collect()
}

/// Both verifiers agree, and say `want` for every message.
fn assert_verdicts(what: &str, keys: &Keys, messages: &[Received], want: bool) {
    assert!(!messages.is_empty(), "{what}: no messages");
    let py = python_verify(keys, messages);
    let rs = rust_verify(keys, messages);
    assert_eq!(py, rs, "{what}: the two verifiers disagree");
    for (m, ok) in messages.iter().zip(&py) {
        assert_eq!(*ok, want, "{what}: verdict {ok} for {m:?}");
    }
}

/// A change to a message a forger (or a broken consumer) would make.
type Tampering = (&'static str, fn(&mut Received));

const TAMPERINGS: [Tampering; 6] = [
    ("a body with one more byte", |m| m.body.push(b' ')),
    ("a body with one byte changed", |m| m.body[0] ^= 0x01),
    ("another routing key / topic", |m| m.route.push_str(".x")),
    ("another type", |m| m.event_type.push('X')),
    ("another subject", |m| m.subject = Some("someone".into())),
    ("a signature moved to another id", |m| {
        m.id = Uuid::new_v4().to_string()
    }),
];

/// Five rows tagged `tag`: two of one aggregate, one of another, one without aggregate id,
/// one with a `destination` (`route`).
fn rows(tag: &str, route: &str) -> Vec<NewRow> {
    let o1 = Some("o-1");
    vec![
        NewRow::new("order", o1, "created", json!({"tag": tag, "text": "é✓"})),
        NewRow::new("order", o1, "paid", json!({"tag": tag, "n": 2})),
        NewRow::new("customer", Some("c-9"), "created", json!({"tag": tag})),
        NewRow::new("order", None, "audit", json!({"tag": tag, "no": "subject"})),
        NewRow::new("order", Some("o-2"), "special", json!({"tag": tag})).destination(route),
    ]
}

/// `relay` signing with `key` under the id `kid`, polling every 200 ms.
fn signing(relay: RelayBuilder, kid: &str, key: &str) -> RelayBuilder {
    let relay = relay.set("relay.poll_interval", "200ms");
    relay.set("signing.key_id", kid).set("signing.key", key)
}

/// The relay for `table` and `rabbit`, signing with `key` under the id `kid`.
fn signed(t: &TestTable, r: &RabbitFixture, label: &str, kid: &str, key: &str) -> RelayBuilder {
    signing(RelayBuilder::for_test(t, r, label), kid, key)
}

/// Every message `sink` received, as a consumer reads it.
fn received(sink: &Sink) -> Vec<Received> {
    match sink {
        Sink::RabbitMq(rabbit) => rabbit
            .deliveries()
            .iter()
            .map(Received::from_amqp)
            .collect(),
        Sink::Kafka { consumer, .. } => consumer
            .records()
            .iter()
            .map(Received::from_kafka)
            .collect(),
        Sink::Http(_) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    }
}

/// Messages signed with key A (text), then with key B (binary) after a rotation, verify
/// independently with the keys consumers know; a swapped key, an unknown key id and every
/// tampering fail; the keys appear in no log line.
async fn verify_across_a_key_rotation(test: &str, transport: Transport) {
    let table = TestTable::new(test).await;
    // Topics `<prefix>-order` and `<prefix>-customer` on Kafka (the row types of [`rows`]).
    let sink = Sink::new(transport, test, "#", &["order", "customer"]).await;
    let key_b = format!("base64:{}", STANDARD.encode(KEY_B));
    // The `destination` of the row of [`rows`] that has one: a routing key, or the second topic.
    let route = match &sink {
        Sink::RabbitMq(_) => "custom.route".to_owned(),
        Sink::Kafka { topics, .. } => topics[1].clone(),
        Sink::Http(_) => unreachable!("this scenario runs on RabbitMQ and Kafka"),
    };

    // Key A (text, from the environment), then the rotation: consumers already know key B; the
    // relay switches to it.
    let mut logs = String::new();
    let mut batches = Vec::new();
    for (tag, kid, key) in [("a", "k-2026a", KEY_A), ("b", "k-2026b", key_b.as_str())] {
        let label = format!("{test}-{tag}");
        let relay = signing(sink.relay(&table, &label), kid, key).spawn();
        let ids = table.insert_ids(&rows(tag, &route)).await;
        table.wait_all_sent(WAIT).await;
        sink.wait_received(WAIT).await;
        logs = format!("{logs}\n{}", relay.stderr());
        relay.stop().await;
        batches.push(ids);
    }
    let (first, second) = (&batches[0], &batches[1]);

    let all = received(&sink);
    let of = |ids: &[Uuid], m: &Received| ids.iter().any(|id| id.to_string() == m.id);
    let (old, new): (Vec<Received>, Vec<Received>) =
        all.iter().cloned().partition(|m| of(first, m));
    assert_eq!((old.len(), new.len()), (5, 5), "{all:?}");
    assert!(new.iter().all(|m| of(second, m)));
    for m in &old {
        assert!(m.header.starts_with("v1;kid=k-2026a;sig="), "{m:?}");
    }
    for m in &new {
        assert!(m.header.starts_with("v1;kid=k-2026b;sig="), "{m:?}");
    }
    assert!(all.iter().any(|m| m.subject.is_none()));
    assert!(all.iter().any(|m| m.route == route));

    let both: &Keys = &[("k-2026a", KEY_A.as_bytes()), ("k-2026b", &KEY_B)];
    assert_verdicts("every message, both keys known", both, &all, true);
    // A consumer that was not given key B yet rejects the new messages: unknown key id.
    let only_a: &Keys = &[("k-2026a", KEY_A.as_bytes())];
    assert_verdicts("old messages, key A only", only_a, &old, true);
    assert_verdicts("new messages, key A only", only_a, &new, false);
    // The right key id with the wrong key.
    let wrong: &Keys = &[("k-2026a", &KEY_B), ("k-2026b", KEY_A.as_bytes())];
    assert_verdicts("swapped keys", wrong, &all, false);
    for (what, change) in TAMPERINGS {
        let mut changed = all.clone();
        changed.iter_mut().for_each(change);
        assert_verdicts(what, both, &changed, false);
    }

    for secret in [KEY_A, key_b.as_str(), &key_b["base64:".len()..]] {
        assert!(!logs.contains(secret), "the key leaked into the logs");
    }
    sink.teardown().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_messages_verify_independently_across_a_key_rotation_and_tampering_fails() {
    verify_across_a_key_rotation("signing_rabbit", Transport::RabbitMq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_records_verify_independently_across_a_key_rotation_and_tampering_fails() {
    verify_across_a_key_rotation("signing_kafka", Transport::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_message_carries_the_same_signature() {
    let (table, rabbit) = table_and_exchange("signing_retry").await;
    // A second queue on the exchange that refuses every message (max length 0,
    // reject-publish): the broker nacks each publish although the first queue got a copy, so
    // the relay retries and the test consumer sees every attempt.
    let conn = Connection::connect(AMQP_URL, Default::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let refusing = format!("{}.refusing", rabbit.queue);
    let (queue, exchange) = (refusing.as_str(), rabbit.exchange.as_str());
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    let reject = AMQPValue::LongString("reject-publish".into());
    args.insert("x-overflow".into(), reject);
    let options = QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    ch.queue_declare(queue.into(), options, args).await.unwrap();
    let bind = QueueBindOptions::default();
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "order.#".into(),
        bind,
        Default::default(),
    )
    .await
    .unwrap();

    let relay = signed(&table, &rabbit, "signing-retry", "k-retry", KEY_A)
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .spawn();
    let row = NewRow::new("order", Some("r-1"), "created", json!({"r": 1}));
    let id = table.insert_one(row).await;
    let id_text = id.to_string();
    let copies = || rabbit.id_counts().get(&id_text).copied().unwrap_or(0);
    wait_for_count(WAIT, "three attempts reach the consumer", 3, copies).await;
    ch.queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let what = "the row is sent once nothing refuses it";
    let sent = table.wait_row(id, WAIT, what, |r| r.status == "sent").await;
    rabbit.barrier().await;
    assert!(sent.attempts >= 3, "{sent:?}");
    let copies: Vec<Received> = rabbit
        .deliveries()
        .iter()
        .filter(|d| d.message_id == id_text)
        .map(Received::from_amqp)
        .collect();
    assert!(copies.len() >= 3);
    let headers: Vec<&String> = copies.iter().map(|c| &c.header).collect();
    assert!(
        headers.iter().all(|h| *h == headers[0]),
        "signatures differ between attempts: {headers:?}"
    );
    let keys: &Keys = &[("k-retry", KEY_A.as_bytes())];
    assert_verdicts("every attempt", keys, &copies, true);
    relay.stop().await;
    let _ = conn.close(200, "done".into()).await;
    drop_both(table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_stays_out_of_check_and_bad_keys_are_refused_at_start() {
    let (table, rabbit) = table_and_exchange("signing_check").await;
    let out = signed(&table, &rabbit, "signing-check", "k-check", KEY_A)
        .output(&["check"], WAIT)
        .await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    out.assert_stdout_has("signing: on (key id k-check");
    assert!(!out.stdout.contains(KEY_A) && !out.stderr.contains(KEY_A));

    for (key, needle) in [
        ("too-short-secret-value", "at least 32"),
        ("base64:@@not-base64-secret-value@@@@@@@@@@@@", "base64"),
    ] {
        let relay = signed(&table, &rabbit, "signing-bad", "k", key);
        let out = relay.output(&["run"], WAIT).await;
        let err = &out.stderr;
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("signing.key") && err.contains(needle), "{err}");
        assert!(
            !err.contains("secret-value") && !out.stdout.contains("secret-value"),
            "{err}"
        );
    }
    drop_both(table, rabbit).await;
}

#[test]
fn the_docs_show_the_verifiers_the_tests_use() {
    let doc = repo_file("docs/wire-format.md");
    // The part of `text` between its `docs: begin <lang>` and `docs: end <lang>` lines.
    let between = |text: &str, lang: &str| -> String {
        let begin = format!("docs: begin {lang}\n");
        let start = text.find(&begin).expect("begin marker") + begin.len();
        let end = text[start..]
            .find(&format!("docs: end {lang}"))
            .expect("end marker");
        // Up to the end marker's own line.
        let block = &text[start..start + end];
        block[..block.rfind('\n').unwrap_or(0)].to_owned()
    };
    for (lang, path) in [
        ("python", "scripts/verify-signature.py"),
        ("rust", "tests/signing/verify.rs"),
    ] {
        let code = between(&repo_file(path), lang);
        assert!(
            doc.contains(&code),
            "docs/wire-format.md does not show the {lang} verifier exactly as tested:\n{code}"
        );
    }
}
