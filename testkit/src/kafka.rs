//! Kafka side of the harness: the tansu binary, topics, a private tansu per test, a collecting
//! consumer, and a TLS-terminating front for Kafka SSL tests (tansu 0.6 parses `--cert/--key`
//! but serves plaintext only, so TLS is added in front of it, as a load balancer would).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use uuid::Uuid;

pub use crate::free_port;
use crate::process::append_to;
use crate::{RelayBuilder, RelayProcess, TestTable, hex8, wait_until};

/// The shared broker.
pub const KAFKA: &str = "127.0.0.1:9092";
/// Partitions of every test topic.
pub const PARTITIONS: i32 = 3;

// ---------------------------------------------------------------------------------------------
// Broker side: topics, a private tansu, a collecting consumer

/// The tansu binary (`scripts/tansu.sh path`).
pub fn tansu_bin() -> PathBuf {
    let cache = std::env::var("OUTBOX_RELAY_CACHE")
        .unwrap_or_else(|_| "/var/cache/outbox-relay".to_owned());
    let bin = Path::new(&cache).join("tansu/bin/tansu");
    assert!(
        bin.exists(),
        "tansu is not installed at {} (run scripts/services.sh)",
        bin.display()
    );
    bin
}

/// A topic name unique to this run: `it-<test>-<hex>`.
pub fn topic_name(test: &str) -> String {
    format!("it-{test}-{}", hex8())
}

/// The URL the tansu CLI wants for the first of `brokers` (`host:port[,…]`, scheme optional).
fn tansu_broker_url(brokers: &str) -> String {
    let first = brokers.split(',').next().unwrap_or(brokers).trim();
    if first.contains("://") {
        first.to_owned()
    } else {
        format!("tcp://{first}")
    }
}

/// `tansu topic <args…> --broker <brokers>` with the `tansu` binary; the error carries its
/// stderr.
async fn tansu_topic(tansu: &Path, brokers: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(tansu)
        .arg("topic")
        .args(args)
        .arg("--broker")
        .arg(tansu_broker_url(brokers))
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| format!("cannot run {}: {e}", tansu.display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "tansu topic {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Creates `topic` with `partitions` partitions through the CLI of `tansu` (tansu does not
/// auto-create topics).
pub async fn try_create_topic(
    tansu: &Path,
    brokers: &str,
    topic: &str,
    partitions: u32,
) -> Result<(), String> {
    let partitions = partitions.to_string();
    tansu_topic(
        tansu,
        brokers,
        &["create", topic, "--partitions", &partitions],
    )
    .await
}

/// Deletes `topic` through the CLI of `tansu`.
pub async fn try_delete_topic(tansu: &Path, brokers: &str, topic: &str) -> Result<(), String> {
    tansu_topic(tansu, brokers, &["delete", topic]).await
}

/// Creates `topic` with [`PARTITIONS`] partitions on the broker at `broker` (host:port), then
/// waits until its metadata shows every partition.
pub async fn create_topic(broker: &str, topic: &str) {
    let partitions = u32::try_from(PARTITIONS).unwrap();
    if let Err(e) = try_create_topic(&tansu_bin(), broker, topic, partitions).await {
        panic!("{topic} on {broker}: {e}");
    }
    let what = format!("{broker} lists the partitions of {topic}");
    let partitions = wait_until(Duration::from_secs(20), &what, async || {
        // A fresh client each time: the request goes to `broker` itself, not to the
        // advertised address (the restart test re-creates topics while the proxy is cut).
        let topic = topic.to_owned();
        let found = with_client(broker, move |client| {
            let metadata = client
                .fetch_metadata(Some(&topic), Duration::from_secs(5))
                .ok()?;
            let listed = metadata.topics().iter().find(|t| t.name() == topic)?;
            listed.error().is_none().then(|| listed.partitions().len())
        });
        match found.await {
            Some(n) if n > 0 => Ok(n),
            other => Err(format!("{other:?} partitions")),
        }
    })
    .await;
    assert_eq!(
        partitions,
        usize::try_from(PARTITIONS).unwrap(),
        "topic {topic} has the wrong number of partitions"
    );
}

/// Deletes `topic` from the shared broker (best effort: memory storage, tidiness only).
pub async fn delete_topic(topic: &str) {
    let _ = try_delete_topic(&tansu_bin(), KAFKA, topic).await;
}

/// High watermarks (next offset to be written) of every partition of `topic`.
pub async fn high_watermarks(broker: &str, topic: &str) -> Vec<i64> {
    let topic = topic.to_owned();
    with_client(broker, move |client| {
        (0..PARTITIONS)
            .map(|p| {
                client
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("watermarks of {topic}[{p}]: {e}"))
                    .1
            })
            .collect()
    })
    .await
}

/// Runs `request` on a blocking thread with a fresh [`consumer_config`] client of `broker`.
async fn with_client<T: Send + 'static>(
    broker: &str,
    request: impl FnOnce(&BaseConsumer) -> T + Send + 'static,
) -> T {
    let config = consumer_config(broker);
    tokio::task::spawn_blocking(move || request(&config.create().expect("metadata client")))
        .await
        .unwrap()
}

/// A test consumer's configuration: a fresh group, no commits, from the earliest offset, short
/// fetch waits.
pub fn consumer_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", format!("it-consumer-{}", hex8()))
        .set("client.id", "it-consumer")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        .set("fetch.wait.max.ms", "20")
        .set("reconnect.backoff.max.ms", "500");
    c
}

/// One record as the test consumer read it.
#[derive(Debug, Clone)]
pub struct Record {
    /// Topic read from.
    pub topic: String,
    /// Partition read from.
    pub partition: i32,
    /// Offset in the partition.
    pub offset: i64,
    /// Record key (lossy UTF-8).
    pub key: Option<String>,
    /// In wire order; values as (lossy) UTF-8, `None` for a null value.
    pub headers: Vec<(String, Option<String>)>,
    /// Value bytes.
    pub payload: Vec<u8>,
}

impl Record {
    fn of(m: &BorrowedMessage<'_>) -> Self {
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        let headers = m.headers().map(|headers| {
            headers
                .iter()
                .map(|h| (h.key.to_owned(), h.value.map(text)))
                .collect()
        });
        Self {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(text),
            headers: headers.unwrap_or_default(),
            payload: m.payload().unwrap_or_default().to_vec(),
        }
    }

    /// The first header called `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// The row id carried in `ce_id`.
    pub fn id(&self) -> Option<Uuid> {
        self.header("ce_id").and_then(|s| Uuid::parse_str(s).ok())
    }
}

/// A consumer on its own thread that assigns every partition of its topics from the beginning
/// (no group coordination) and keeps every record it reads.
pub struct Collector {
    records: Arc<Mutex<Vec<Record>>>,
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Collector {
    /// Starts reading every partition of `topics` on `brokers` from the beginning.
    pub fn start(brokers: &str, topics: &[&str]) -> Self {
        Self::start_with(&consumer_config(brokers), topics)
    }

    /// Like [`Collector::start`], with a consumer made from `config` (e.g. with SASL/SSL
    /// properties added to [`consumer_config`]).
    pub fn start_with(config: &ClientConfig, topics: &[&str]) -> Self {
        let consumer: BaseConsumer = config.create().expect("create test consumer");
        let mut tpl = TopicPartitionList::new();
        for topic in topics {
            for p in 0..PARTITIONS {
                tpl.add_partition_offset(topic, p, Offset::Beginning)
                    .expect("assignment");
            }
        }
        consumer.assign(&tpl).expect("assign partitions");
        let records = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (sink, error_sink, stopped) =
            (Arc::clone(&records), Arc::clone(&errors), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !stopped.load(Ordering::SeqCst) {
                match consumer.poll(Duration::from_millis(100)) {
                    None => {}
                    Some(Err(e)) => error_sink.lock().unwrap().push(e.to_string()),
                    Some(Ok(m)) => sink.lock().unwrap().push(Record::of(&m)),
                }
            }
        });
        Self {
            records,
            errors,
            stop,
            thread: Some(thread),
        }
    }

    /// Records read so far.
    pub fn count(&self) -> usize {
        self.records.lock().unwrap().len()
    }

    /// A copy of every record read so far, in reading order.
    pub fn records(&self) -> Vec<Record> {
        self.records.lock().unwrap().clone()
    }

    /// Takes the high watermarks of `topic` on `broker` and waits until the consumer has read
    /// every record below them: everything the broker held at that moment has been received.
    pub async fn wait_caught_up(&self, broker: &str, topic: &str, timeout: Duration) {
        let high = &high_watermarks(broker, topic).await;
        let what = format!("the test consumer reads {topic} up to {high:?}");
        wait_until(timeout, &what, async || {
            let mut next = vec![0i64; high.len()];
            let records = self.records.lock().unwrap();
            for r in records.iter().filter(|r| r.topic == topic) {
                let p = usize::try_from(r.partition).unwrap();
                next[p] = next[p].max(r.offset + 1);
            }
            if next.iter().zip(high).all(|(n, h)| n >= h) {
                return Ok(());
            }
            let errors = self.errors.lock().unwrap();
            let last = &errors[errors.len().saturating_sub(3)..];
            Err(format!("read up to {next:?}; consumer errors: {last:?}"))
        })
        .await;
    }

    /// Stops the consumer thread and returns everything it read.
    pub async fn stop(mut self) -> Vec<Record> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            tokio::task::spawn_blocking(move || t.join())
                .await
                .unwrap()
                .expect("consumer thread panicked");
        }
        self.records()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        // The thread notices within one poll and closes its consumer; not joined here.
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// How many times each row id (`ce_id`) occurs in `records`; panics on a record without one.
pub fn id_counts(records: &[Record]) -> HashMap<Uuid, usize> {
    let mut out = HashMap::new();
    for r in records {
        let id = r
            .id()
            .unwrap_or_else(|| panic!("record without a valid ce_id: {r:?}"));
        *out.entry(id).or_insert(0) += 1;
    }
    out
}

/// Asserts that `records` carry each of `want` exactly once and no other row (`what` names
/// them in the failure).
pub fn assert_each_once(what: &str, records: &[Record], want: &[Uuid]) {
    let counts = id_counts(records);
    let want: HashSet<Uuid> = want.iter().copied().collect();
    assert_eq!(
        counts.keys().copied().collect::<HashSet<_>>(),
        want,
        "{what}"
    );
    assert!(
        counts.values().all(|n| *n == 1),
        "{what}: duplicates: {counts:?}"
    );
}

/// Stops `relay` (asserting a clean exit, see [`RelayProcess::stop`]), deletes `topics` and
/// drops `table`: the end of most Kafka tests.
pub async fn finish_topics(relay: RelayProcess, table: TestTable, topics: &[&str]) {
    relay.stop().await;
    for t in topics {
        delete_topic(t).await;
    }
    table.drop_table().await;
}

/// A private tansu broker with memory storage, killed when dropped.
pub struct Tansu {
    child: Child,
    port: u16,
}

impl Tansu {
    /// Starts tansu listening on 127.0.0.1:`port` and advertising `advertised`; its output
    /// goes to `log`. Returns once the port accepts connections.
    pub async fn start(port: u16, advertised: SocketAddr, log: &Path) -> Self {
        Self::start_with(port, advertised, log, &[]).await
    }

    /// Like [`Tansu::start`], with `extra` broker arguments (e.g. `--authentication`).
    pub async fn start_with(port: u16, advertised: SocketAddr, log: &Path, extra: &[&str]) -> Self {
        let out = append_to(log).expect("tansu log file");
        let mut child = Command::new(tansu_bin())
            .arg("broker")
            .arg("--listener-url")
            .arg(format!("tcp://127.0.0.1:{port}"))
            .arg("--advertised-listener-url")
            .arg(format!("tcp://{advertised}"))
            .arg("--storage-engine")
            .arg("memory://tansu/")
            .args(extra)
            .env("RUST_LOG", "warn")
            // tansu resolves a `file://` schema registry against its working directory
            // (`file:///tmp/x` opens `<cwd>/tmp/x`): started from `/`, an absolute path is itself.
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().expect("log fd")))
            .stderr(Stdio::from(out))
            .kill_on_drop(true)
            .spawn()
            .expect("start tansu");
        let what = format!("tansu listens on port {port}");
        wait_until(Duration::from_secs(20), &what, async || {
            if let Some(status) = child.try_wait().expect("try_wait tansu") {
                let output = std::fs::read_to_string(log).unwrap_or_default();
                panic!("tansu on port {port} exited at start with {status}:\n{output}");
            }
            match TcpStream::connect(("127.0.0.1", port)).await {
                Ok(_) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await;
        Self { child, port }
    }

    /// The broker's own address (not the advertised one).
    pub fn direct(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// SIGKILL, and waits until it is gone.
    pub async fn kill(mut self) {
        self.child.start_kill().expect("SIGKILL tansu");
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("tansu did not die within 10s")
            .expect("wait for tansu");
        assert!(!status.success(), "tansu should die by SIGKILL: {status}");
    }
}

/// `outbox-relay run` for `table`, publishing to `brokers` with topic template `topic`,
/// `message_timeout` 10 s, metrics server off.
pub fn kafka_relay(table: &TestTable, brokers: &str, topic: &str, instance: &str) -> RelayBuilder {
    RelayBuilder::for_table(table, instance)
        .set("publisher.kind", "kafka")
        .set("publisher.kafka.brokers", brokers)
        .set("publisher.kafka.topic", topic)
        .set("publisher.kafka.message_timeout", "10s")
}

/// Creates `topic` with [`PARTITIONS`] partitions through the Kafka admin API, for brokers
/// that `tansu topic create` cannot talk to (one that requires SASL); `props` are added to the
/// admin client's configuration (`security.protocol`, `sasl.*`, `ssl.*`).
pub async fn create_topic_with(brokers: &str, props: &[(&str, &str)], topic: &str) {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in props {
        config.set(*k, *v);
    }
    let admin: AdminClient<DefaultClientContext> = config.create().expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {topic} on {brokers}: {e}"));
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t} on {brokers}: {e}"));
    }
}

/// Reads `topic` (every partition, from the beginning) on `brokers` until `want` records
/// carrying a `ce_id` were read or `timeout` passed; returns their ids in the order read.
pub async fn read_ids(brokers: &str, topic: &str, want: usize, timeout: Duration) -> Vec<String> {
    let collector = Collector::start(brokers, &[topic]);
    let deadline = Instant::now() + timeout;
    while collector.count() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    collector
        .stop()
        .await
        .iter()
        .filter_map(|r| r.header("ce_id").map(str::to_owned))
        .collect()
}

/// A TLS-terminating front on 127.0.0.1: presents a certificate for `localhost` and
/// `127.0.0.1` signed by a throwaway CA, and forwards the decrypted bytes to a plaintext broker
/// on 127.0.0.1:`upstream`. The broker must advertise [`TlsFront::addr`] so that clients come
/// back through the front after their metadata request.
pub struct TlsFront {
    addr: SocketAddr,
    /// PEM file of the CA that signed the front's certificate (for `ssl.ca.location`).
    pub ca_pem: PathBuf,
    handshakes_ok: Arc<AtomicUsize>,
    handshakes_failed: Arc<AtomicUsize>,
    accept: JoinHandle<()>,
}

/// A TLS server configuration for `127.0.0.1` and `localhost`, its certificate signed by a
/// fresh CA named `ca_name` whose PEM is written to `dir/<ca_file>`: (config, that path).
pub(crate) fn loopback_tls(
    dir: &Path,
    ca_name: &str,
    ca_file: &str,
) -> (rustls::ServerConfig, PathBuf) {
    let (ca, ca_pem) = test_ca(ca_name);
    let leaf_key = KeyPair::generate().expect("leaf key");
    let leaf = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("leaf params")
        .signed_by(&leaf_key, &ca)
        .expect("sign leaf");
    let path = dir.join(ca_file);
    std::fs::write(&path, ca_pem).expect("write CA");
    let key =
        rustls::pki_types::PrivateKeyDer::try_from(leaf_key.serialize_der()).expect("leaf key DER");
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(vec![leaf.der().clone()], key)
    .expect("server certificate");
    (config, path)
}

/// A self-signed CA: (issuer, its certificate as PEM).
pub(crate) fn test_ca(name: &str) -> (CertifiedIssuer<'static, KeyPair>, String) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(params, key).expect("self-sign CA");
    let pem = ca.pem();
    (ca, pem)
}

/// Writes the PEM of a CA that signed nothing the tests serve: a client trusting only it must
/// refuse every [`TlsFront`].
pub fn write_unrelated_ca(dir: &Path) -> PathBuf {
    let (_, pem) = test_ca("outbox-relay unrelated CA");
    let path = dir.join("unrelated-ca.pem");
    std::fs::write(&path, pem).expect("write unrelated CA");
    path
}

impl TlsFront {
    /// Starts the front; the CA's PEM goes to `dir`. `upstream` need not listen yet.
    pub async fn start(upstream: u16, dir: &Path) -> Self {
        let (config, path) = loopback_tls(dir, "outbox-relay test CA", "kafka-ca.pem");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind TLS front");
        let addr = listener.local_addr().expect("TLS front address");
        let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (ok_count, failed_count) = (Arc::clone(&ok), Arc::clone(&failed));
        let accept = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let (ok_count, failed_count) = (Arc::clone(&ok_count), Arc::clone(&failed_count));
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        failed_count.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    ok_count.fetch_add(1, Ordering::SeqCst);
                    if let Ok(mut up) = TcpStream::connect(("127.0.0.1", upstream)).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                    }
                });
            }
        });
        Self {
            addr,
            ca_pem: path,
            handshakes_ok: ok,
            handshakes_failed: failed,
            accept,
        }
    }

    /// Where clients connect (and what the broker must advertise).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// TLS handshakes completed so far.
    pub fn handshakes_ok(&self) -> usize {
        self.handshakes_ok.load(Ordering::SeqCst)
    }

    /// TLS handshakes that failed so far (a client that did not trust the certificate).
    pub fn handshakes_failed(&self) -> usize {
        self.handshakes_failed.load(Ordering::SeqCst)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
