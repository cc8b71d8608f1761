//! Kafka over TLS, end to end: the real binary publishes through a TLS front to a private tansu,
//! configured only by `[publisher.kafka.properties]` as an operator would. Also the ways a
//! secured broker refuses a misconfigured relay (an untrusted certificate; SCRAM credentials the
//! broker does not know; no SASL where tansu's `--authentication` requires it): none of them
//! spends an attempt or dead-letters a row, and each is reported in words that name the setting
//! to fix.
//!
//! tansu 0.6 serves plaintext only (its `--cert/--key` are parsed but never used), so TLS is
//! terminated in front of it by the harness; its SASL server offers SCRAM only, and its memory
//! storage keeps no SCRAM credentials, so a successful SASL login cannot be shown against it:
//! the SCRAM case here is a real exchange with a real refusal.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::kafka::{
    Collector, Tansu, TlsFront, consumer_config, create_topic_with, free_port, kafka_relay,
    topic_name, write_unrelated_ca,
};
use common::{NewRow, RelayBuilder, TempDir, TestTable, wait_until};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);
/// Never printed by the relay: every test greps its output for it.
const PASSWORD: &str = "kafka-s3cret-Pa55word";

/// A private tansu reachable only through a TLS front; with `--authentication` if asked.
struct SecuredBroker {
    front: TlsFront,
    _tansu: Tansu,
    dir: TempDir,
}

impl SecuredBroker {
    async fn start(label: &str, authentication: bool) -> Self {
        let dir = TempDir::new(label);
        let port = free_port();
        let front = TlsFront::start(port, dir.path()).await;
        let tansu = Tansu::start_with(
            port,
            front.addr(),
            &dir.path().join("tansu.log"),
            if authentication {
                &["--authentication"]
            } else {
                &[]
            },
        )
        .await;
        Self {
            front,
            _tansu: tansu,
            dir,
        }
    }

    fn brokers(&self) -> String {
        self.front.addr().to_string()
    }

    /// What a client needs to get in: TLS, trusting the front's CA.
    fn client_props(&self) -> Vec<(&'static str, String)> {
        vec![
            ("security.protocol", "SSL".to_owned()),
            ("ssl.ca.location", path_str(&self.front.ca_pem)),
        ]
    }

    /// Writes a relay.toml holding `props` as `[publisher.kafka.properties]`.
    fn config_file(&self, name: &str, props: &[(&str, String)]) -> String {
        let mut toml = String::from("[publisher.kafka.properties]\n");
        for (k, v) in props {
            toml.push_str(&format!("{k:?} = {v:?}\n"));
        }
        path_str(&self.dir.write(name, &toml))
    }
}

fn path_str(p: &Path) -> String {
    p.to_str().expect("UTF-8 temp path").to_owned()
}

fn borrowed<'a>(props: &'a [(&'static str, String)]) -> Vec<(&'a str, &'a str)> {
    props.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// `props` with `key` set to `value` (replaced or added).
fn with(
    props: &[(&'static str, String)],
    key: &'static str,
    value: &str,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<_> = props.iter().filter(|(k, _)| *k != key).cloned().collect();
    out.push((key, value.to_owned()));
    out
}

fn rows(n: usize) -> Vec<NewRow> {
    NewRow::numbered(n, "sec", Some(("k-", 7)), "sec.event")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_every_row_arrives_in_order_per_key() {
    let broker = SecuredBroker::start("kafka-tls", false).await;
    let props = broker.client_props();
    let topic = topic_name("tls");
    create_topic_with(&broker.brokers(), &borrowed(&props), &topic).await;
    let table = TestTable::new("k_tls").await;
    let inserted = table.insert(&rows(300)).await;
    let config = broker.config_file("relay.toml", &props);

    let check = kafka_relay(&table, &broker.brokers(), &topic, "kafka-sec-check")
        .output(&["--config", &config, "check"], Duration::from_secs(60))
        .await;
    assert!(check.status.success(), "check failed: {check:?}");
    assert!(
        check.stdout.contains("broker: ok") && check.stdout.contains("security.protocol=SSL"),
        "check should report the broker and its TLS setting: {}",
        check.stdout
    );

    let relay = kafka_relay(&table, &broker.brokers(), &topic, "kafka-tls")
        .set("relay.ordering", "aggregate")
        .spawn_with(&["--config", &config, "run"]);
    table.wait_all_sent(LONG).await;
    assert!(
        broker.front.handshakes_ok() > 0,
        "the relay's connections did not go through the TLS front"
    );

    // Read everything back through the same TLS + SASL path.
    let mut consumer_cfg = consumer_config(&broker.brokers());
    for (k, v) in &props {
        consumer_cfg.set(*k, v);
    }
    let consumer = Collector::start_with(&consumer_cfg, &[topic.as_str()]);
    let want: HashSet<Uuid> = inserted.iter().map(|r| r.id).collect();
    wait_until(LONG, "every row read back over TLS", async || {
        let got: HashSet<Uuid> = consumer.records().iter().filter_map(|r| r.id()).collect();
        if want.is_subset(&got) {
            Ok(())
        } else {
            Err(format!("{} of {} ids read", got.len(), want.len()))
        }
    })
    .await;
    let records = consumer.stop().await;
    // Per key, the records sit in one partition in the rows' insertion order.
    let seq: HashMap<Uuid, usize> = inserted
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id, i))
        .collect();
    let mut by_key: HashMap<(String, i32), Vec<(i64, usize)>> = HashMap::new();
    for r in &records {
        let id = r.id().expect("ce_id");
        by_key
            .entry((r.key.clone().expect("keyed record"), r.partition))
            .or_default()
            .push((r.offset, seq[&id]));
    }
    assert_eq!(
        by_key.len(),
        7,
        "7 aggregates, each in one partition: {:?}",
        by_key.keys()
    );
    for (key, mut v) in by_key {
        v.sort_unstable();
        let order: Vec<usize> = v.iter().map(|(_, s)| *s).collect();
        assert!(
            order.windows(2).all(|w| w[0] <= w[1]),
            "{key:?} out of order: {order:?}"
        );
    }
    let counts = table.status_counts().await;
    assert_eq!(counts.get("sent"), Some(&300), "{counts:?}");

    relay.stop().await;
    table.drop_table().await;
}

/// Starts `run` with `config`, lets it try for a while, and returns its output once it is
/// stopped; asserts the relay stayed up and left every row untouched.
async fn refused_run(table: &TestTable, relay: RelayBuilder, config: &str) -> String {
    let watch = Duration::from_secs(6);
    let mut relay = relay.spawn_with(&["--config", config, "run"]);
    let started = Instant::now();
    while started.elapsed() < watch {
        assert!(relay.is_running(), "the relay exited:\n{}", relay.stderr());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let untouched = table
        .count_where("status = 'pending' AND attempts = 0 AND last_error IS NULL")
        .await;
    let total = table.count_where("true").await;
    let output = format!("{}\n{}", relay.stdout(), relay.stderr());
    relay.stop().await;
    assert_eq!(
        untouched,
        total,
        "a refused relay must not claim, spend attempts or fail rows: {:?}",
        table.status_counts().await
    );
    output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secured_broker_refusing_the_relay_spends_no_attempt_and_says_what_to_fix() {
    let tls = SecuredBroker::start("kafka-refused-tls", false).await;
    let auth = SecuredBroker::start("kafka-refused-auth", true).await;
    let good = tls.client_props();
    let topic = topic_name("refused");
    create_topic_with(&tls.brokers(), &borrowed(&good), &topic).await;
    let table = TestTable::new("k_refused").await;
    let inserted = table.insert(&rows(50)).await;
    let relay = |broker: &SecuredBroker, label: &str| {
        kafka_relay(&table, &broker.brokers(), &topic, label).set("retry.max_attempts", "1")
    };
    let check = async |broker: &SecuredBroker, label: &str, config: &str| {
        let out = relay(broker, label)
            .output(&["--config", config, "check"], Duration::from_secs(60))
            .await;
        assert_eq!(out.status.code(), Some(1), "{label}: {out:?}");
        assert!(
            out.stdout.contains("broker: FAILED"),
            "{label}: {}",
            out.stdout
        );
        out.stdout
    };

    // 1. The broker's certificate is not signed by the CA the relay trusts.
    let untrusted = write_unrelated_ca(tls.dir.path());
    let wrong_ca = tls.config_file(
        "wrong-ca.toml",
        &with(&good, "ssl.ca.location", &path_str(&untrusted)),
    );
    let failed_before = tls.front.handshakes_failed();
    let said = check(&tls, "kafka-wrong-ca-check", &wrong_ca).await;
    assert!(
        said.contains("TLS failed") && said.contains("ssl.ca.location"),
        "check should blame TLS and name ssl.ca.location: {said}"
    );
    let output = refused_run(&table, relay(&tls, "kafka-wrong-ca"), &wrong_ca).await;
    assert!(
        tls.front.handshakes_failed() > failed_before,
        "the relay never attempted TLS"
    );
    assert!(
        output.contains("ssl.ca.location"),
        "the log should name ssl.ca.location:\n{output}"
    );

    // 2. TLS is right, but the broker requires SASL and the relay does not authenticate.
    let no_sasl = auth.config_file("no-sasl.toml", &auth.client_props());
    check(&auth, "kafka-no-sasl-check", &no_sasl).await;
    refused_run(&table, relay(&auth, "kafka-no-sasl"), &no_sasl).await;

    // 3. SCRAM for a user the broker does not know: a real SCRAM exchange, refused (and proof
    //    that SCRAM is compiled in: without OpenSSL librdkafka rejects the setting outright).
    let scram_props = [
        auth.client_props(),
        vec![
            ("security.protocol", "SASL_SSL".to_owned()),
            ("sasl.mechanism", "SCRAM-SHA-512".to_owned()),
            ("sasl.username", "nobody".to_owned()),
            ("sasl.password", PASSWORD.to_owned()),
        ],
    ]
    .concat();
    let scram_props = with(&scram_props, "security.protocol", "SASL_SSL");
    let scram = auth.config_file("scram.toml", &scram_props);
    let said = check(&auth, "kafka-scram-check", &scram).await;
    assert!(
        said.contains("SASL failed") && said.contains("sasl.password"),
        "check should blame SASL and name the sasl.* settings: {said}"
    );
    let output = refused_run(
        &table,
        relay(&auth, "kafka-scram").env("RUST_LOG", "debug"),
        &scram,
    )
    .await;
    assert!(
        !output.contains(PASSWORD) && !said.contains(PASSWORD),
        "the SASL password appeared in the relay's output"
    );

    // 4. Fixed configuration: everything goes, each row on its first attempt.
    let fixed = tls.config_file("fixed.toml", &good);
    let relay = relay(&tls, "kafka-fixed").spawn_with(&["--config", &fixed, "run"]);
    table.wait_all_sent(LONG).await;
    let states = table
        .rows_by_id(&inserted.iter().map(|r| r.id).collect::<Vec<_>>())
        .await;
    assert!(
        states.values().all(|r| r.attempts == 1),
        "refusals must not have spent attempts: {:?}",
        states.values().map(|r| r.attempts).collect::<Vec<_>>()
    );
    relay.stop().await;
    table.drop_table().await;
}
