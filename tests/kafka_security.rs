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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use common::kafka::{
    Collector, Tansu, TlsFront, consumer_config, create_topic_with, free_port, kafka_relay,
    topic_name, write_unrelated_ca,
};
use common::{NewRow, RelayBuilder, TempDir, TestTable, wait_for_count};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);
/// How long `check` may take.
const CHECK: Duration = Duration::from_secs(60);
/// Never printed by the relay: every test greps its output for it.
const PASSWORD: &str = "kafka-s3cret-Pa55word";

/// Client properties (`[publisher.kafka.properties]`, a consumer's or admin's configuration).
type Props = BTreeMap<&'static str, String>;

/// A private tansu reachable only through a TLS front.
struct SecuredBroker {
    front: TlsFront,
    _tansu: Tansu,
    dir: TempDir,
}

impl SecuredBroker {
    /// With `extra` broker arguments (`--authentication`).
    async fn start(label: &str, extra: &[&str]) -> Self {
        let dir = TempDir::new(label);
        let port = free_port();
        let front = TlsFront::start(port, dir.path()).await;
        let log = dir.path().join("tansu.log");
        let _tansu = Tansu::start_with(port, front.addr(), &log, extra).await;
        Self { front, _tansu, dir }
    }

    fn brokers(&self) -> String {
        self.front.addr().to_string()
    }

    /// What a client needs to get in: TLS, trusting the front's CA.
    fn client_props(&self) -> Props {
        Props::from([
            ("security.protocol", "SSL".to_owned()),
            ("ssl.ca.location", path_str(&self.front.ca_pem)),
        ])
    }

    /// Creates `topic` through the front, as a client with [`SecuredBroker::client_props`].
    async fn create_topic(&self, topic: &str) {
        let props = self.client_props();
        let props: Vec<(&str, &str)> = props.iter().map(|(k, v)| (*k, v.as_str())).collect();
        create_topic_with(&self.brokers(), &props, topic).await;
    }

    /// Writes a relay.toml holding `props` as `[publisher.kafka.properties]`.
    fn config_file(&self, name: &str, props: &Props) -> String {
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

fn rows(n: usize) -> Vec<NewRow> {
    NewRow::numbered(n, "sec", Some(("k-", 7)), "sec.event")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_every_row_arrives_in_order_per_key() {
    let broker = SecuredBroker::start("kafka-tls", &[]).await;
    let (brokers, props) = (broker.brokers(), broker.client_props());
    let topic = topic_name("tls");
    broker.create_topic(&topic).await;
    let table = TestTable::new("k_tls").await;
    let inserted = table.insert(&rows(300)).await;
    let config = broker.config_file("relay.toml", &props);

    let check = kafka_relay(&table, &brokers, &topic, "kafka-sec-check")
        .output(&["--config", &config, "check"], CHECK)
        .await;
    assert!(check.status.success(), "check failed: {check:?}");
    let said = &check.stdout;
    assert!(
        said.contains("broker: ok") && said.contains("security.protocol=SSL"),
        "check should report the broker and its TLS setting: {said}"
    );

    let relay = kafka_relay(&table, &brokers, &topic, "kafka-tls")
        .set("relay.ordering", "aggregate")
        .spawn_with(&["--config", &config, "run"]);
    table.wait_all_sent(LONG).await;
    assert!(
        broker.front.handshakes_ok() > 0,
        "the relay's connections did not go through the TLS front"
    );

    // Read everything back through the same TLS path.
    let mut consumer_cfg = consumer_config(&brokers);
    for (k, v) in &props {
        consumer_cfg.set(*k, v);
    }
    let consumer = Collector::start_with(&consumer_cfg, &[topic.as_str()]);
    let want: HashSet<Uuid> = inserted.iter().map(|r| r.id).collect();
    let read = || {
        let got: HashSet<Uuid> = consumer.records().iter().filter_map(|r| r.id()).collect();
        want.intersection(&got).count()
    };
    wait_for_count(LONG, "every row read back over TLS", want.len(), read).await;
    let records = consumer.stop().await;
    // Per key, the records sit in one partition in the rows' insertion (`seq`) order.
    let seq: HashMap<Uuid, i64> = inserted.iter().map(|r| (r.id, r.seq)).collect();
    let mut by_key: HashMap<(String, i32), Vec<(i64, i64)>> = HashMap::new();
    for r in &records {
        let key = (r.key.clone().expect("keyed record"), r.partition);
        let row = seq[&r.id().expect("ce_id")];
        by_key.entry(key).or_default().push((r.offset, row));
    }
    let keys: Vec<_> = by_key.keys().collect();
    assert_eq!(keys.len(), 7, "7 aggregates, one partition each: {keys:?}");
    for (key, mut v) in by_key {
        v.sort_unstable();
        let order: Vec<i64> = v.iter().map(|(_, s)| *s).collect();
        assert!(order.is_sorted(), "{key:?} out of order: {order:?}");
    }
    let counts = table.status_counts().await;
    assert_eq!(counts.get("sent"), Some(&300), "{counts:?}");

    relay.stop().await;
    table.drop_table().await;
}

/// Starts `run` with `config`, lets it try for a while, and returns its output once it is
/// stopped; asserts the relay stayed up and left every row untouched.
async fn refused_run(table: &TestTable, relay: RelayBuilder, config: &str) -> String {
    let mut relay = relay.spawn_with(&["--config", config, "run"]);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(6) {
        assert!(relay.is_running(), "the relay exited:\n{}", relay.stderr());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let pending = "status = 'pending' AND attempts = 0 AND last_error IS NULL";
    let untouched = table.count_where(pending).await;
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
    let tls = SecuredBroker::start("kafka-refused-tls", &[]).await;
    let auth = SecuredBroker::start("kafka-refused-auth", &["--authentication"]).await;
    let good = tls.client_props();
    let topic = topic_name("refused");
    tls.create_topic(&topic).await;
    let table = TestTable::new("k_refused").await;
    table.insert(&rows(50)).await;
    let relay = |broker: &SecuredBroker, label: &str| {
        kafka_relay(&table, &broker.brokers(), &topic, label).set("retry.max_attempts", "1")
    };
    let check = async |broker: &SecuredBroker, label: &str, config: &str| {
        let args = ["--config", config, "check"];
        let out = relay(broker, label).output(&args, CHECK).await;
        assert_eq!(out.status.code(), Some(1), "{label}: {out:?}");
        let said = out.stdout;
        assert!(said.contains("broker: FAILED"), "{label}: {said}");
        said
    };

    // 1. The broker's certificate is not signed by the CA the relay trusts.
    let untrusted = path_str(&write_unrelated_ca(tls.dir.path()));
    let mut wrong_ca = good.clone();
    wrong_ca.insert("ssl.ca.location", untrusted);
    let wrong_ca = tls.config_file("wrong-ca.toml", &wrong_ca);
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
    let mut scram = auth.client_props();
    scram.extend([
        ("security.protocol", "SASL_SSL".to_owned()),
        ("sasl.mechanism", "SCRAM-SHA-512".to_owned()),
        ("sasl.username", "nobody".to_owned()),
        ("sasl.password", PASSWORD.to_owned()),
    ]);
    let scram = auth.config_file("scram.toml", &scram);
    let said = check(&auth, "kafka-scram-check", &scram).await;
    assert!(
        said.contains("SASL failed") && said.contains("sasl.password"),
        "check should blame SASL and name the sasl.* settings: {said}"
    );
    let relay_scram = relay(&auth, "kafka-scram").env("RUST_LOG", "debug");
    let output = refused_run(&table, relay_scram, &scram).await;
    assert!(
        !output.contains(PASSWORD) && !said.contains(PASSWORD),
        "the SASL password appeared in the relay's output"
    );

    // 4. Fixed configuration: everything goes, each row on its first attempt.
    let fixed = tls.config_file("fixed.toml", &good);
    let relay = relay(&tls, "kafka-fixed").spawn_with(&["--config", &fixed, "run"]);
    table.wait_all_sent(LONG).await;
    let attempts: Vec<i32> = table.rows().await.iter().map(|r| r.attempts).collect();
    assert!(
        attempts.iter().all(|a| *a == 1),
        "refusals must not have spent attempts: {attempts:?}"
    );
    relay.stop().await;
    table.drop_table().await;
}

/// Properties librdkafka refuses (a name it does not know, a secret-bearing one this build
/// does not support, a combination it rejects) are configuration errors: `check` and `run`
/// exit 2 naming `publisher.kafka.properties` before connecting (no reconnect could fix
/// them), and a secret value quoted in librdkafka's complaint is shown as `***`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_librdkafka_refuses_exit_2_and_never_show_a_secret() {
    let table = TestTable::new("k_bad_props").await;
    let dir = TempDir::new("k-bad-props");
    let cases: [(&str, Props, &str); 4] = [
        (
            "unknown",
            [("no.such.prop", "1".to_owned())].into(),
            "No such configuration property",
        ),
        (
            "jaas",
            [("sasl.jaas.config", PASSWORD.to_owned())].into(),
            "Java JAAS configuration is not supported",
        ),
        (
            // A secret under a misspelled name: refused by name, its value never shown.
            "misspelled",
            [("sasl.pasword", PASSWORD.to_owned())].into(),
            "(property \"sasl.pasword\"; its value is not shown)",
        ),
        (
            "not-idempotent",
            [("enable.idempotence", "false".to_owned())].into(),
            "requires `enable.idempotence`",
        ),
    ];
    for (case, props, said) in cases {
        let mut toml = String::from("[publisher.kafka.properties]\n");
        for (k, v) in &props {
            toml.push_str(&format!("{k:?} = {v:?}\n"));
        }
        let config = path_str(&dir.write(&format!("{case}.toml"), &toml));
        for command in ["check", "run"] {
            let out = kafka_relay(&table, "127.0.0.1:9092", "k-bad-props", case)
                .output(&["--config", &config, command], CHECK)
                .await;
            let text = format!("{}\n{}", out.stdout, out.stderr);
            assert_eq!(out.status.code(), Some(2), "{case} {command}: {text}");
            assert!(
                text.contains("invalid value for publisher.kafka.properties")
                    && text.contains(said),
                "{case} {command}: {text}"
            );
            assert!(
                !text.contains(PASSWORD),
                "{case} {command} shows the secret: {text}"
            );
        }
    }
    table.drop_table().await;
}
