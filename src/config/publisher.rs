//! `[publisher]`: which broker, and each transport's settings (`[publisher.rabbitmq]`,
//! `[publisher.kafka]`, `[publisher.redis]`; `[publisher.nats]` is in `nats.rs`,
//! `[publisher.http]` in `http.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::nats::{RawNats, validate_nats};
use super::{ConfigError, HumanDuration, NatsConfig, positive};
use crate::redact::redact_url;
use crate::template::Template;

/// `publisher.kind`: which broker to publish to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    /// RabbitMQ via lapin (the default).
    RabbitMq,
    /// Kafka via rdkafka.
    Kafka,
    /// CloudEvents JSON lines on standard output (development).
    Stdout,
    /// NATS JetStream via async-nats.
    Nats,
    /// Redis Streams (`XADD`) via the `redis` crate.
    Redis,
    /// One HTTP request per message (webhooks), via reqwest.
    Http,
}

/// `publisher.rabbitmq.exchange_type`: the AMQP exchange types the relay declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeType {
    /// Routing key equals the binding key.
    Direct,
    /// Routing key matches the binding pattern (the default).
    Topic,
    /// Every bound queue.
    Fanout,
    /// Matched on headers.
    Headers,
}

impl ExchangeType {
    /// The type as AMQP names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Topic => "topic",
            Self::Fanout => "fanout",
            Self::Headers => "headers",
        }
    }
}

/// `[publisher.rabbitmq]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRabbitMq {
    /// AMQP URL (default `amqp://guest:guest@127.0.0.1:5672/%2f`).
    pub url: String,
    /// Exchange to publish to (default `outbox`).
    pub exchange: String,
    /// Exchange type when declared (default `topic`).
    pub exchange_type: ExchangeType,
    /// Declare the exchange (durable) at start and after every reconnect (default true).
    pub declare_exchange: bool,
    /// Routing key template (default `{aggregate_type}.{event_type}`).
    pub routing_key: String,
    /// How long to wait for a publisher confirm (default 30s).
    pub confirm_timeout: HumanDuration,
    /// A durable queue to declare and bind to the exchange at start and after every
    /// reconnect, for development (default empty: none; the shipped relay.toml: `outbox.dev`).
    pub declare_queue: String,
    /// The binding key of `declare_queue` (default `#`: every message on a topic exchange).
    pub queue_binding: String,
    /// Header-name prefix of the CloudEvents attributes (default `cloudEvents:`).
    pub cloudevents_prefix: CloudEventsPrefix,
    /// PEM file of a CA that signs the broker's certificate, trusted besides the system's
    /// (`amqps://` only; default empty: the system trust store alone).
    pub tls_ca_file: String,
}

/// How CloudEvents attributes are named in RabbitMQ headers
/// (`publisher.rabbitmq.cloudevents_prefix`): a closed set, one per consumer convention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum CloudEventsPrefix {
    /// `cloudEvents:`: the CloudEvents AMQP binding (Spring AMQP, the SDKs' AMQP bindings).
    #[default]
    #[serde(rename = "cloudEvents:")]
    Colon,
    /// `cloudEvents_`: the AMQP binding's JMS-safe spelling.
    #[serde(rename = "cloudEvents_")]
    Underscore,
    /// `ce-`: Knative eventing-rabbitmq and the Python SDK's RabbitMQ binding.
    #[serde(rename = "ce-")]
    Dash,
}

impl CloudEventsPrefix {
    /// The prefix as written in headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Colon => "cloudEvents:",
            Self::Underscore => "cloudEvents_",
            Self::Dash => "ce-",
        }
    }
}

/// `[publisher.kafka]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKafka {
    /// Comma-separated bootstrap servers (default `127.0.0.1:9092`).
    pub brokers: String,
    /// Topic template (default `{aggregate_type}`).
    pub topic: String,
    /// librdkafka `message.timeout.ms` (default 30s).
    pub message_timeout: HumanDuration,
    /// Extra librdkafka properties, passed through unchanged.
    pub properties: BTreeMap<String, String>,
}

/// `[publisher.redis]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedis {
    /// `redis://[user:password@]host[:port][/db]` (default `redis://127.0.0.1:6379`).
    pub url: String,
    /// Stream key template (default `outbox.{aggregate_type}`).
    pub stream: String,
    /// Trims each stream to about this many entries (`XADD … MAXLEN ~ n`); unset: no trimming.
    pub max_len: Option<u64>,
    /// How long to wait for the reply to an `XADD` before the connection is given up
    /// (default 10s).
    pub timeout: HumanDuration,
}

/// `[publisher]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPublisher {
    /// `rabbitmq` (default), `kafka`, `stdout` (JSON lines, for development) or `http`.
    pub kind: PublisherKind,
    /// RabbitMQ settings.
    pub rabbitmq: RawRabbitMq,
    /// Kafka settings.
    pub kafka: RawKafka,
    /// NATS JetStream settings.
    #[serde(default)]
    pub nats: RawNats,
    /// Redis Streams settings.
    pub redis: RawRedis,
    /// HTTP webhook settings.
    #[serde(default)]
    pub http: super::http::RawHttp,
}

impl Default for RawPublisher {
    fn default() -> Self {
        Self {
            kind: PublisherKind::RabbitMq,
            rabbitmq: RawRabbitMq {
                url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
                exchange: "outbox".into(),
                exchange_type: ExchangeType::Topic,
                declare_exchange: true,
                routing_key: "{aggregate_type}.{event_type}".into(),
                confirm_timeout: super::dur("30s"),
                declare_queue: String::new(),
                queue_binding: "#".into(),
                cloudevents_prefix: CloudEventsPrefix::Colon,
                tls_ca_file: String::new(),
            },
            kafka: RawKafka {
                brokers: "127.0.0.1:9092".into(),
                topic: "{aggregate_type}".into(),
                message_timeout: super::dur("30s"),
                properties: BTreeMap::new(),
            },
            nats: RawNats::default(),
            redis: RawRedis {
                url: "redis://127.0.0.1:6379".into(),
                stream: "outbox.{aggregate_type}".into(),
                max_len: None,
                timeout: super::dur("10s"),
            },
            http: super::RawHttp::default(),
        }
    }
}

/// The validated RabbitMQ settings.
#[derive(Debug, Clone)]
pub struct RabbitMqConfig {
    /// AMQP URL (may hold a password).
    pub url: String,
    /// Exchange name (empty: the default exchange).
    pub exchange: String,
    /// Exchange type for the declaration.
    pub exchange_type: ExchangeType,
    /// Declare the exchange.
    pub declare_exchange: bool,
    /// Routing key template.
    pub routing_key: Template,
    /// Confirm wait.
    pub confirm_timeout: Duration,
    /// A development queue to declare (durable) and bind to the exchange, if any.
    pub declare_queue: Option<String>,
    /// Its binding key.
    pub queue_binding: String,
    /// Header-name prefix of the CloudEvents attributes.
    pub cloudevents_prefix: CloudEventsPrefix,
    /// The certificates (PEM) of `tls_ca_file`, trusted besides the system trust store.
    pub tls_ca_pem: Option<String>,
}

/// The validated Kafka settings.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    /// Bootstrap servers.
    pub brokers: String,
    /// Topic template.
    pub topic: Template,
    /// Delivery timeout.
    pub message_timeout: Duration,
    /// librdkafka pass-through properties.
    pub properties: BTreeMap<String, String>,
}

/// Whether `topic` is a legal Kafka topic name: 1-249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub fn valid_kafka_topic(topic: &str) -> bool {
    !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// A Kafka topic template (under `key`) whose literal text makes every topic it renders
/// illegal, refused with the reason; checked on a sample rendering, as a NATS subject is.
pub(super) fn check_kafka_topic(key: &str, template: &Template) -> Result<(), ConfigError> {
    let sample = template.render(&crate::template::Fields {
        aggregate_type: "a",
        event_type: "e",
        aggregate_id: Some("i"),
    });
    if valid_kafka_topic(&sample) {
        return Ok(());
    }
    Err(ConfigError::invalid(
        key.to_owned(),
        format!(
            "{:?} is not a valid Kafka topic name (1-249 of [a-zA-Z0-9._-], placeholders aside)",
            template.as_str()
        ),
    ))
}

/// The validated Redis Streams settings.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Server URL (may hold a password).
    pub url: String,
    /// Stream key template.
    pub stream: Template,
    /// `MAXLEN ~` of every `XADD`, if any.
    pub max_len: Option<u64>,
    /// Reply wait of one command.
    pub timeout: Duration,
}

/// Which broker to publish to.
#[derive(Debug, Clone)]
pub enum PublisherConfig {
    /// RabbitMQ via lapin.
    RabbitMq(RabbitMqConfig),
    /// Kafka via rdkafka.
    Kafka(KafkaConfig),
    /// CloudEvents JSON lines on standard output (development, piping).
    Stdout,
    /// NATS JetStream via async-nats.
    Nats(NatsConfig),
    /// Redis Streams.
    Redis(RedisConfig),
    /// HTTP webhooks via reqwest.
    Http(super::http::HttpConfig),
}

impl PublisherConfig {
    /// `rabbitmq`, `kafka`, `stdout` or `nats`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "rabbitmq",
            Self::Kafka(_) => "kafka",
            Self::Stdout => "stdout",
            Self::Nats(_) => "nats",
            Self::Redis(_) => "redis",
            Self::Http(_) => "http",
        }
    }

    /// The routing-key (RabbitMQ) or topic (Kafka) template outboxes inherit; the stdout sink
    /// routes nowhere (`{aggregate_type}`, used only if a signature needs a route).
    pub fn route(&self) -> crate::template::Template {
        match self {
            Self::RabbitMq(c) => c.routing_key.clone(),
            Self::Kafka(c) => c.topic.clone(),
            Self::Stdout => crate::template::Template::aggregate_type(),
            Self::Nats(c) => c.subject.clone(),
            Self::Redis(c) => c.stream.clone(),
            Self::Http(c) => c.url.clone(),
        }
    }
}

impl RawPublisher {
    /// Checks the section of the chosen transport (the others are ignored).
    pub(super) fn validate(self) -> Result<PublisherConfig, ConfigError> {
        let p = self;
        Ok(match p.kind {
            PublisherKind::RabbitMq => {
                let q = p.rabbitmq;
                if !(q.url.starts_with("amqp://") || q.url.starts_with("amqps://")) {
                    return Err(ConfigError::invalid(
                        "publisher.rabbitmq.url",
                        format!("{} must start with amqp:// or amqps://", redact_url(&q.url)),
                    ));
                }
                if q.exchange.len() > 255 {
                    return Err(ConfigError::invalid(
                        "publisher.rabbitmq.exchange",
                        "is longer than 255 bytes",
                    ));
                }
                positive("publisher.rabbitmq.confirm_timeout", q.confirm_timeout)?;
                let declare_queue = validate_dev_queue(&q)?;
                let tls_ca_pem = read_rabbitmq_ca(&q)?;
                let routing_key = Template::parse(&q.routing_key).map_err(|e| {
                    ConfigError::invalid("publisher.rabbitmq.routing_key", e.to_string())
                })?;
                PublisherConfig::RabbitMq(RabbitMqConfig {
                    url: q.url,
                    exchange: q.exchange,
                    exchange_type: q.exchange_type,
                    declare_exchange: q.declare_exchange,
                    routing_key,
                    confirm_timeout: q.confirm_timeout.0,
                    declare_queue,
                    queue_binding: q.queue_binding,
                    cloudevents_prefix: q.cloudevents_prefix,
                    tls_ca_pem,
                })
            }
            PublisherKind::Kafka => {
                let k = p.kafka;
                if k.brokers.trim().is_empty() {
                    return Err(ConfigError::invalid(
                        "publisher.kafka.brokers",
                        "must not be empty",
                    ));
                }
                positive("publisher.kafka.message_timeout", k.message_timeout)?;
                let topic = Template::parse(&k.topic)
                    .map_err(|e| ConfigError::invalid("publisher.kafka.topic", e.to_string()))?;
                check_kafka_topic("publisher.kafka.topic", &topic)?;
                PublisherConfig::Kafka(KafkaConfig {
                    brokers: k.brokers,
                    topic,
                    message_timeout: k.message_timeout.0,
                    properties: k.properties,
                })
            }
            PublisherKind::Stdout => PublisherConfig::Stdout,
            PublisherKind::Nats => PublisherConfig::Nats(validate_nats(p.nats)?),
            PublisherKind::Redis => PublisherConfig::Redis(p.redis.validate()?),
            PublisherKind::Http => PublisherConfig::Http(p.http.validate()?),
        })
    }
}

impl RawRedis {
    /// `[publisher.redis]`: a `redis://` or `rediss://` URL with a host, a template, a
    /// positive `max_len` and `timeout`.
    fn validate(self) -> Result<RedisConfig, ConfigError> {
        let key = "publisher.redis.url";
        let shown = redact_url(&self.url);
        let parsed = url::Url::parse(&self.url)
            .map_err(|e| ConfigError::invalid(key, format!("{shown} is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "redis" | "rediss") {
            return Err(ConfigError::invalid(
                key,
                format!("{shown} must start with redis:// or rediss://"),
            ));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(ConfigError::invalid(key, format!("{shown} names no host")));
        }
        let db = parsed.path().trim_start_matches('/');
        if !db.is_empty() && db.parse::<u32>().is_err() {
            return Err(ConfigError::invalid(
                key,
                format!("{shown}: the path must be a database number, not {db:?}"),
            ));
        }
        if parsed.fragment().is_some() {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{shown} has a #fragment; certificate checks cannot be turned off (trust a private CA with SSL_CERT_FILE instead)"
                ),
            ));
        }
        // Whatever else the client would refuse when it connects (a query it does not know).
        ::redis::Client::open(self.url.as_str()).map_err(|e| {
            ConfigError::invalid(
                key,
                format!("{shown} is not usable by the Redis client: {e}"),
            )
        })?;
        let stream = Template::parse(&self.stream)
            .map_err(|e| ConfigError::invalid("publisher.redis.stream", e.to_string()))?;
        if self.max_len == Some(0) {
            return Err(ConfigError::invalid(
                "publisher.redis.max_len",
                "must be at least 1 (leave it unset for no trimming)",
            ));
        }
        positive("publisher.redis.timeout", self.timeout)?;
        Ok(RedisConfig {
            url: self.url,
            stream,
            max_len: self.max_len,
            timeout: self.timeout.0,
        })
    }
}

/// `publisher.rabbitmq.tls_ca_file`: the PEM text of the CA file, `None` when unset. The
/// file must hold at least one certificate, and the URL must be `amqps://`.
fn read_rabbitmq_ca(q: &RawRabbitMq) -> Result<Option<String>, ConfigError> {
    const KEY: &str = "publisher.rabbitmq.tls_ca_file";
    if q.tls_ca_file.is_empty() {
        return Ok(None);
    }
    if !q.url.starts_with("amqps://") {
        return Err(ConfigError::invalid(
            KEY,
            "is set but publisher.rabbitmq.url is not amqps:// (the CA is only used over TLS)",
        ));
    }
    use rustls::pki_types::pem::PemObject as _;
    let pem = std::fs::read_to_string(&q.tls_ca_file)
        .map_err(|e| ConfigError::invalid(KEY, format!("cannot read {:?}: {e}", q.tls_ca_file)))?;
    let certificates = rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ConfigError::invalid(KEY, format!("{:?} is not PEM: {e}", q.tls_ca_file)))?;
    if certificates.is_empty() {
        return Err(ConfigError::invalid(
            KEY,
            format!("{:?} holds no PEM certificate", q.tls_ca_file),
        ));
    }
    Ok(Some(pem))
}

/// `publisher.rabbitmq.declare_queue` and `queue_binding`: `None` when no queue is declared.
fn validate_dev_queue(q: &RawRabbitMq) -> Result<Option<String>, ConfigError> {
    if q.queue_binding.len() > 255 {
        return Err(ConfigError::invalid(
            "publisher.rabbitmq.queue_binding",
            "is longer than 255 bytes",
        ));
    }
    let name = q.declare_queue.trim();
    if name.is_empty() {
        return Ok(None);
    }
    if name.len() > 255 {
        return Err(ConfigError::invalid(
            "publisher.rabbitmq.declare_queue",
            "is longer than 255 bytes",
        ));
    }
    if name.starts_with("amq.") {
        return Err(ConfigError::invalid(
            "publisher.rabbitmq.declare_queue",
            format!("{name:?} starts with \"amq.\", which RabbitMQ reserves for itself"),
        ));
    }
    if q.exchange.is_empty() {
        return Err(ConfigError::invalid(
            "publisher.rabbitmq.declare_queue",
            "needs a named publisher.rabbitmq.exchange (the default exchange cannot be bound)",
        ));
    }
    Ok(Some(name.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err_has, load_str, rejects};
    use super::*;

    #[test]
    fn stdout_publisher_needs_no_section() {
        let c = load_str("[publisher]\nkind = \"stdout\"\n", &[]).unwrap();
        assert!(matches!(c.publisher, PublisherConfig::Stdout));
        assert_eq!(c.publisher.kind(), "stdout");
    }

    #[test]
    fn unknown_placeholder_is_rejected() {
        err_has(
            "[publisher.rabbitmq]\nrouting_key = \"{tenant}.x\"\n",
            &["publisher.rabbitmq.routing_key", "tenant"],
            &[],
        );
    }

    #[test]
    fn rabbitmq_ca_file_must_hold_a_certificate_and_go_with_amqps() {
        let dir = std::env::temp_dir().join(format!("relay-ca-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, empty) = (dir.join("ca.pem"), dir.join("empty.pem"));
        let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
        std::fs::write(&ca, pem).unwrap();
        std::fs::write(&empty, "no certificate here\n").unwrap();
        let rabbit = |url: &str, file: &std::path::Path| {
            format!("[publisher.rabbitmq]\nurl = \"{url}\"\ntls_ca_file = {file:?}\n")
        };
        let tls = "amqps://guest:guest@127.0.0.1:5671/%2f";
        let c = load_str(&rabbit(tls, &ca), &[]).unwrap();
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("rabbitmq")
        };
        assert_eq!(q.tls_ca_pem.as_deref(), Some(pem));
        let key = "publisher.rabbitmq.tls_ca_file";
        err_has(&rabbit(tls, &empty), &[key, "no PEM certificate"], &[]);
        err_has(
            &rabbit(tls, &dir.join("missing.pem")),
            &[key, "cannot read"],
            &[],
        );
        let plain = "amqp://guest:guest@127.0.0.1:5672/%2f";
        err_has(&rabbit(plain, &ca), &[key, "not amqps://"], &[]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dev_queue_is_checked() {
        let c = load_str(
            "[publisher.rabbitmq]\ndeclare_queue = \"outbox.dev\"\nqueue_binding = \"order.#\"\n",
            &[],
        )
        .unwrap();
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("rabbitmq")
        };
        assert_eq!(q.declare_queue.as_deref(), Some("outbox.dev"));
        assert_eq!(q.queue_binding, "order.#");
        let queue = "publisher.rabbitmq.declare_queue";
        let rabbit = |toml: &str| format!("[publisher.rabbitmq]\n{toml}\n");
        err_has(
            &rabbit("declare_queue = \"amq.mine\""),
            &[queue, "reserves"],
            &[],
        );
        let default_exchange = rabbit("exchange = \"\"\ndeclare_queue = \"q\"");
        err_has(&default_exchange, &[queue, "default exchange"], &[]);
        let long = "x".repeat(256);
        err_has(
            &rabbit(&format!("declare_queue = \"{long}\"")),
            &[queue],
            &[],
        );
        let binding = format!("queue_binding = \"{long}\"");
        err_has(
            &rabbit(&binding),
            &["publisher.rabbitmq.queue_binding"],
            &[],
        );
    }

    #[test]
    fn cloudevents_prefix_is_a_closed_set() {
        for (written, want) in [
            ("cloudEvents:", CloudEventsPrefix::Colon),
            ("cloudEvents_", CloudEventsPrefix::Underscore),
            ("ce-", CloudEventsPrefix::Dash),
        ] {
            let c = load_str(
                &format!("[publisher.rabbitmq]\ncloudevents_prefix = \"{written}\"\n"),
                &[],
            )
            .unwrap();
            let PublisherConfig::RabbitMq(q) = c.publisher else {
                panic!("rabbitmq")
            };
            assert_eq!(q.cloudevents_prefix, want);
            assert_eq!(want.as_str(), written);
        }
        err_has(
            "[publisher.rabbitmq]\ncloudevents_prefix = \"ce_\"\n",
            &[
                "publisher.rabbitmq.cloudevents_prefix",
                "ce_",
                "cloudEvents:",
                "ce-",
            ],
            &[],
        );
    }

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[publisher.rabbitmq]\nurl = \"http://x\"\n",
            "invalid value for publisher.rabbitmq.url: http://x must start with amqp:// or amqps://",
        );
        let long = "x".repeat(256);
        rejects(
            &format!("[publisher.rabbitmq]\nexchange = \"{long}\"\n"),
            "invalid value for publisher.rabbitmq.exchange: is longer than 255 bytes",
        );
        rejects(
            "[publisher.rabbitmq]\nconfirm_timeout = \"0s\"\n",
            "invalid value for publisher.rabbitmq.confirm_timeout: must be greater than zero",
        );
        let kafka = "[publisher]\nkind = \"kafka\"\n[publisher.kafka]\n";
        rejects(
            &format!("{kafka}brokers = \" \"\n"),
            "invalid value for publisher.kafka.brokers: must not be empty",
        );
        rejects(
            &format!("{kafka}message_timeout = \"0s\"\n"),
            "invalid value for publisher.kafka.message_timeout: must be greater than zero",
        );
        err_has(
            &format!("{kafka}topic = \"{{nope}}\"\n"),
            &["invalid value for publisher.kafka.topic", "nope"],
            &[],
        );
        rejects(
            &format!("{kafka}topic = \"orders events\"\n"),
            "invalid value for publisher.kafka.topic: \"orders events\" is not a valid Kafka topic name (1-249 of [a-zA-Z0-9._-], placeholders aside)",
        );
        err_has(
            &format!("{kafka}topic = \"billing/{{event_type}}\"\n"),
            &["publisher.kafka.topic", "not a valid Kafka topic name"],
            &[],
        );
        // A placeholder may render anything; its literals are legal.
        assert!(load_str(&format!("{kafka}topic = \"billing.{{event_type}}\"\n"), &[]).is_ok());
    }

    #[test]
    fn kafka_topic_names() {
        assert!(valid_kafka_topic("orders"));
        assert!(valid_kafka_topic("a.b-c_D9"));
        for bad in ["", ".", "..", "has space", "slash/topic"] {
            assert!(!valid_kafka_topic(bad), "{bad:?}");
        }
        assert!(valid_kafka_topic(&"x".repeat(249)));
        assert!(!valid_kafka_topic(&"x".repeat(250)));
    }

    /// A Redis publisher with the section's defaults.
    const REDIS: &str = "[publisher]\nkind = \"redis\"\n[publisher.redis]\n";

    #[test]
    fn the_redis_section_has_defaults_and_takes_its_keys() {
        let c = load_str(REDIS, &[]).unwrap();
        let PublisherConfig::Redis(r) = &c.publisher else {
            panic!("redis")
        };
        assert_eq!(r.url, "redis://127.0.0.1:6379");
        assert_eq!(r.stream.as_str(), "outbox.{aggregate_type}");
        assert_eq!((r.max_len, r.timeout), (None, Duration::from_secs(10)));
        assert_eq!(c.publisher.kind(), "redis");
        let c = load_str(
            &format!("{REDIS}url = \"rediss://:pw@h:6380/2\"\nstream = \"s.{{event_type}}\"\nmax_len = 1000\n"),
            &[],
        )
        .unwrap();
        let PublisherConfig::Redis(r) = &c.publisher else {
            panic!("redis")
        };
        assert_eq!(
            (r.max_len, r.stream.as_str()),
            (Some(1000), "s.{event_type}")
        );
    }

    #[test]
    fn each_redis_rejection_names_its_key_and_never_shows_the_password() {
        rejects(
            &format!("{REDIS}url = \"http://u:hunter2@h\"\n"),
            "invalid value for publisher.redis.url: http://u:***@h must start with redis:// or rediss://",
        );
        err_has(
            &format!("{REDIS}url = \"redis://:hunter2@h/x\"\n"),
            &["publisher.redis.url", "database number", ":***@"],
            &["hunter2"],
        );
        err_has(
            &format!("{REDIS}url = \"not a url hunter2\"\n"),
            &["publisher.redis.url", "is not a URL"],
            &[],
        );
        err_has(
            &format!("{REDIS}stream = \"{{tenant}}\"\n"),
            &["publisher.redis.stream", "tenant"],
            &[],
        );
        rejects(
            &format!("{REDIS}max_len = 0\n"),
            "invalid value for publisher.redis.max_len: must be at least 1 (leave it unset for no trimming)",
        );
        rejects(
            &format!("{REDIS}timeout = \"0s\"\n"),
            "invalid value for publisher.redis.timeout: must be greater than zero",
        );
        err_has(&format!("{REDIS}maxlen = 5\n"), &["maxlen"], &[]);
        err_has(
            &format!("{REDIS}url = \"rediss://:hunter2@h#insecure\"\n"),
            &["publisher.redis.url", "#fragment", "SSL_CERT_FILE"],
            &["hunter2"],
        );
        err_has(
            &format!("{REDIS}url = \"rediss://:hunter2@h/0?protocol=resp9\"\n"),
            &["publisher.redis.url", "not usable by the Redis client"],
            &["hunter2"],
        );
    }

    #[test]
    fn kind_and_exchange_type_are_closed_sets_with_the_same_messages() {
        rejects(
            "[publisher]\nkind = \"sqs\"\n",
            "invalid value for publisher.kind: \"sqs\" is not one of \"rabbitmq\", \"kafka\", \"stdout\", \"nats\", \"redis\", \"http\"",
        );
        rejects(
            "[publisher.rabbitmq]\nexchange_type = \"x-delayed\"\n",
            "invalid value for publisher.rabbitmq.exchange_type: \"x-delayed\" is not one of \"direct\", \"topic\", \"fanout\", \"headers\"",
        );
        let c = load_str("[publisher.rabbitmq]\nexchange_type = \"fanout\"\n", &[]).unwrap();
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("rabbitmq")
        };
        assert_eq!(q.exchange_type, ExchangeType::Fanout);
        let c = load_str("[publisher]\nkind = \"kafka\"\n", &[]).unwrap();
        assert_eq!(c.publisher.kind(), "kafka");
    }
}
