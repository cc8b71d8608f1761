//! Configuration: figment layering (defaults ← TOML file ← `RELAY_*` environment), then
//! validation into a [`Config`] that the rest of the crate can trust.
//!
//! The raw structs mirror `relay.toml` one to one (unknown keys are rejected); [`Config`] holds
//! parsed durations, templates and identifiers. Every rejection names the key at fault.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::redact::redact_url;
use crate::retry::RetryPolicy;
use crate::template::Template;

/// Everything that can be wrong with a configuration. Each message names the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--config` named a file that does not exist.
    #[error(
        "config file {0} does not exist (pass an existing file to --config, or omit it to use ./relay.toml or the defaults)"
    )]
    MissingFile(PathBuf),
    /// The file or environment could not be parsed (unknown key, wrong type, bad syntax).
    #[error("{0}")]
    Load(String),
    /// A value parsed but is not acceptable.
    #[error("invalid value for {key}: {reason}")]
    Invalid {
        /// The dotted key, e.g. `database.table`.
        key: &'static str,
        /// What is wrong and what is expected.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(key: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key,
            reason: reason.into(),
        }
    }
}

/// A duration written as a human string (`"500ms"`, `"5m"`); bare numbers are rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration string with a unit, such as \"500ms\", \"30s\" or \"5m\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                humantime::parse_duration(v.trim())
                    .map(HumanDuration)
                    .map_err(|e| {
                        E::custom(format!(
                            "bad duration {v:?}: {e} (write e.g. \"500ms\", \"30s\", \"5m\")"
                        ))
                    })
            }
        }
        d.deserialize_str(V)
    }
}

fn dur(s: &str) -> HumanDuration {
    HumanDuration(humantime::parse_duration(s).unwrap_or_default())
}

/// `[database]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    /// PostgreSQL URL (`postgres://user:pass@host:port/db?sslmode=...`).
    pub url: String,
    /// Connections in the pool (default 8).
    pub pool_size: usize,
    /// Outbox table, optionally schema-qualified (default `outbox_messages`).
    pub table: String,
    /// Apply `sql/` at start (default false; the shipped relay.toml sets true).
    pub auto_migrate: bool,
}

/// `[relay]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRelay {
    /// Name written to `locked_by` (default host name + pid).
    pub instance_id: Option<String>,
    /// Rows claimed per round trip (default 500).
    pub batch_size: usize,
    /// Messages published but not yet settled, at most (default 1000).
    pub max_in_flight: usize,
    /// Fallback poll period when idle (default 1s).
    pub poll_interval: HumanDuration,
    /// LISTEN for the insert trigger's NOTIFY (default true).
    pub notify: bool,
    /// Age after which another relay may reclaim a `processing` row (default 60s).
    pub lease_timeout: HumanDuration,
    /// `aggregate` (default) or `none`.
    pub ordering: String,
    /// CloudEvents `source` (default `/outbox/<database>/<table>`).
    pub source: Option<String>,
    /// How long SIGTERM waits for in-flight messages (default 30s).
    pub shutdown_timeout: HumanDuration,
}

/// `[retry]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetry {
    /// First retry delay (default 1s).
    pub base_delay: HumanDuration,
    /// Delay cap (default 5m).
    pub max_delay: HumanDuration,
    /// Attempts before dead-lettering (default 12).
    pub max_attempts: u32,
    /// Random fraction taken off each delay (default 0.2).
    pub jitter: f64,
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
    pub exchange_type: String,
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

/// `[publisher]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPublisher {
    /// `rabbitmq` (default), `kafka` or `stdout` (JSON lines, for development).
    pub kind: String,
    /// RabbitMQ settings.
    pub rabbitmq: RawRabbitMq,
    /// Kafka settings.
    pub kafka: RawKafka,
}

/// `[metrics]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMetrics {
    /// Address of the metrics and health server (default `127.0.0.1:9187`; empty disables it).
    pub listen: String,
}

/// `[cleanup]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCleanup {
    /// Keep `sent` rows this long (default 24h); `"0s"` deletes rows on confirm.
    pub retention: HumanDuration,
    /// How often the cleanup runs (default 1m).
    pub interval: HumanDuration,
    /// Rows deleted per statement (default 5000).
    pub batch_size: usize,
}

/// A secret as written (`signing.key`): its `Debug` never shows it.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

/// A string that may have been written as a number: the environment provider parses
/// `RELAY_SIGNING__KEY_ID=2026` as an integer.
fn text_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOrNumber {
        Text(String),
        Unsigned(u64),
        Signed(i64),
    }
    Ok(Option::<TextOrNumber>::deserialize(d)?.map(|v| match v {
        TextOrNumber::Text(s) => s,
        TextOrNumber::Unsigned(n) => n.to_string(),
        TextOrNumber::Signed(n) => n.to_string(),
    }))
}

/// `[signing]` as written. Both keys or neither: without them messages are not signed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSigning {
    /// Key id written into every signature (`kid=`), so consumers know which key to check.
    #[serde(default, deserialize_with = "text_or_number")]
    pub key_id: Option<String>,
    /// HMAC-SHA256 key: at least 32 bytes; `base64:<standard base64>` for binary keys. Best
    /// given as `RELAY_SIGNING__KEY` rather than in the file.
    pub key: Option<Secret>,
}

/// The whole file as written, before validation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// `[database]`
    pub database: RawDatabase,
    /// `[relay]`
    pub relay: RawRelay,
    /// `[retry]`
    pub retry: RawRetry,
    /// `[publisher]`
    pub publisher: RawPublisher,
    /// `[metrics]`
    pub metrics: RawMetrics,
    /// `[cleanup]`
    pub cleanup: RawCleanup,
    /// `[signing]`
    #[serde(default)]
    pub signing: RawSigning,
}

impl Default for RawConfig {
    fn default() -> Self {
        Self {
            database: RawDatabase {
                url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
                pool_size: 8,
                table: "outbox_messages".into(),
                auto_migrate: false,
            },
            relay: RawRelay {
                instance_id: None,
                batch_size: 500,
                max_in_flight: 1000,
                poll_interval: dur("1s"),
                notify: true,
                lease_timeout: dur("60s"),
                ordering: "aggregate".into(),
                source: None,
                shutdown_timeout: dur("30s"),
            },
            retry: RawRetry {
                base_delay: dur("1s"),
                max_delay: dur("5m"),
                max_attempts: 12,
                jitter: 0.2,
            },
            publisher: RawPublisher {
                kind: "rabbitmq".into(),
                rabbitmq: RawRabbitMq {
                    url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
                    exchange: "outbox".into(),
                    exchange_type: "topic".into(),
                    declare_exchange: true,
                    routing_key: "{aggregate_type}.{event_type}".into(),
                    confirm_timeout: dur("30s"),
                    declare_queue: String::new(),
                    queue_binding: "#".into(),
                    cloudevents_prefix: CloudEventsPrefix::Colon,
                },
                kafka: RawKafka {
                    brokers: "127.0.0.1:9092".into(),
                    topic: "{aggregate_type}".into(),
                    message_timeout: dur("30s"),
                    properties: BTreeMap::new(),
                },
            },
            metrics: RawMetrics {
                listen: "127.0.0.1:9187".into(),
            },
            cleanup: RawCleanup {
                retention: dur("24h"),
                interval: dur("1m"),
                batch_size: 5000,
            },
            signing: RawSigning::default(),
        }
    }
}

/// A validated table name: `name` or `schema.name`, each a bare SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    /// The schema, when qualified.
    pub schema: Option<String>,
    /// The table's own name.
    pub name: String,
}

impl TableName {
    /// Parses and validates `schema.table` or `table`.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let mut parts = raw.split('.');
        let (schema, name) = match (parts.next(), parts.next(), parts.next()) {
            (Some(name), None, _) => (None, name),
            (Some(schema), Some(name), None) => (Some(schema), name),
            _ => {
                return Err(format!(
                    "{raw:?} has more than one '.'; write table or schema.table"
                ));
            }
        };
        if let Some(schema) = schema {
            validate_identifier(schema)?;
        }
        validate_identifier(name)?;
        // Derived object names (`<name>_next_seq`, `<name>_aggregate_idx`) must fit in 63 bytes.
        if name.len() > 40 {
            return Err(format!(
                "{name:?} is longer than 40 characters (names of its index and functions are derived from it)"
            ));
        }
        Ok(Self {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        })
    }

    /// `schema.name` or `name`, as written: safe to splice into SQL.
    pub fn qualified(&self) -> String {
        self.prefixed("")
    }

    /// The qualified name of a derived object, `schema.<name><suffix>`.
    pub fn prefixed(&self, suffix: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}{suffix}", self.name),
            None => format!("{}{suffix}", self.name),
        }
    }

    /// The NOTIFY channel: the table name as written.
    pub fn channel(&self) -> String {
        self.qualified()
    }
}

impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.qualified())
    }
}

/// Accepts bare SQL identifiers only: a letter or `_`, then letters, digits or `_`, at most 63 bytes.
pub fn validate_identifier(ident: &str) -> Result<(), String> {
    let mut chars = ident.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') || ident.len() > 63 {
        return Err(format!(
            "{ident:?} is not a bare SQL identifier (letters, digits and '_', not starting with a digit, at most 63 characters)"
        ));
    }
    Ok(())
}

/// How rows of one aggregate are ordered on the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// Per `(aggregate_type, aggregate_id)`, in `seq` order, one confirmed before the next.
    Aggregate,
    /// No ordering promise; maximum parallelism.
    None,
}

/// The validated `[database]` section.
#[derive(Debug, Clone)]
pub struct DatabaseConfig {
    /// Connection URL (may hold a password: log only [`DatabaseConfig::redacted_url`]).
    pub url: String,
    /// Pool size.
    pub pool_size: usize,
    /// Outbox table.
    pub table: TableName,
    /// Apply migrations at start.
    pub auto_migrate: bool,
}

impl DatabaseConfig {
    /// The URL with its password masked.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }
}

/// The validated `[relay]` section.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// Written to `locked_by`.
    pub instance_id: String,
    /// Rows per claim.
    pub batch_size: usize,
    /// Published-but-unsettled messages, at most.
    pub max_in_flight: usize,
    /// Idle poll period.
    pub poll_interval: Duration,
    /// LISTEN/NOTIFY wake-up.
    pub notify: bool,
    /// Lease after which `processing` rows are reclaimed.
    pub lease_timeout: Duration,
    /// Ordering mode.
    pub ordering: Ordering,
    /// CloudEvents `source`.
    pub source: String,
    /// Drain deadline on SIGTERM.
    pub shutdown_timeout: Duration,
}

/// The validated RabbitMQ settings.
#[derive(Debug, Clone)]
pub struct RabbitMqConfig {
    /// AMQP URL (may hold a password).
    pub url: String,
    /// Exchange name (empty: the default exchange).
    pub exchange: String,
    /// Exchange type for the declaration.
    pub exchange_type: String,
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

/// Which broker to publish to.
#[derive(Debug, Clone)]
pub enum PublisherConfig {
    /// RabbitMQ via lapin.
    RabbitMq(RabbitMqConfig),
    /// Kafka via rdkafka.
    Kafka(KafkaConfig),
    /// CloudEvents JSON lines on standard output (development, piping).
    Stdout,
}

impl PublisherConfig {
    /// `rabbitmq`, `kafka` or `stdout`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::RabbitMq(_) => "rabbitmq",
            Self::Kafka(_) => "kafka",
            Self::Stdout => "stdout",
        }
    }
}

/// The validated `[cleanup]` section.
#[derive(Debug, Clone)]
pub struct CleanupConfig {
    /// Age after which `sent` rows are deleted; zero deletes on confirm.
    pub retention: Duration,
    /// Cleanup period.
    pub interval: Duration,
    /// Rows per DELETE.
    pub batch_size: usize,
}

/// The validated `[signing]` section: sign every message with this key.
#[derive(Clone)]
pub struct SigningConfig {
    /// Key id (letters, digits, `.`, `_`, `-`, `:`; at most 64).
    pub key_id: String,
    /// Key bytes (at least 32). Never logged: `Debug` shows only the length.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for SigningConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningConfig")
            .field("key_id", &self.key_id)
            .field("key", &format_args!("<{} bytes, redacted>", self.key.len()))
            .finish()
    }
}

/// The smallest signing key accepted, in bytes (HMAC-SHA256's output size).
pub const MIN_SIGNING_KEY_BYTES: usize = 32;

/// The prefix of a `signing.key` written as standard base64.
pub const BASE64_PREFIX: &str = "base64:";

/// The environment variable that may hold `signing.key`, read as is (figment would parse a
/// key that looks like a number or a list, and echo it in its error).
pub const SIGNING_KEY_ENV: &str = "RELAY_SIGNING__KEY";

fn validate_signing(s: RawSigning) -> Result<Option<SigningConfig>, ConfigError> {
    let (key_id, key) = match (s.key_id, s.key) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(ConfigError::invalid(
                "signing.key",
                format!("must be set when signing.key_id is (in the file or as {SIGNING_KEY_ENV})"),
            ));
        }
        (None, Some(_)) => {
            return Err(ConfigError::invalid(
                "signing.key_id",
                "must be set when signing.key is (consumers pick the verification key by it)",
            ));
        }
        (Some(id), Some(key)) => (id, key),
    };
    let id_ok = !key_id.is_empty()
        && key_id.len() <= 64
        && key_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
    if !id_ok {
        return Err(ConfigError::invalid(
            "signing.key_id",
            format!(
                "{key_id:?} is not 1 to 64 of letters, digits, '.', '_', '-', ':' (it goes into the header as kid=...)"
            ),
        ));
    }
    // Never echo the key in an error: only its length and what is expected.
    let bytes = match key.0.strip_prefix(BASE64_PREFIX) {
        Some(b64) => {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|_| {
                    ConfigError::invalid(
                        "signing.key",
                        "the text after \"base64:\" is not standard base64 (A-Z, a-z, 0-9, '+', '/', padded with '='); the value is not shown",
                    )
                })?
        }
        None => key.0.into_bytes(),
    };
    if bytes.len() < MIN_SIGNING_KEY_BYTES {
        return Err(ConfigError::invalid(
            "signing.key",
            format!(
                "is {} bytes; at least {MIN_SIGNING_KEY_BYTES} are required (e.g. \"base64:\" followed by the output of `openssl rand -base64 32`)",
                bytes.len()
            ),
        ));
    }
    Ok(Some(SigningConfig { key_id, key: bytes }))
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// `[database]`
    pub database: DatabaseConfig,
    /// `[relay]`
    pub relay: RelayConfig,
    /// `[retry]`
    pub retry: RetryPolicy,
    /// `[publisher]`
    pub publisher: PublisherConfig,
    /// `[metrics] listen`; `None` when disabled.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// `[cleanup]`
    pub cleanup: CleanupConfig,
    /// `[signing]`; `None`: messages are not signed.
    pub signing: Option<SigningConfig>,
}

/// Where the configuration file comes from.
#[derive(Debug, Clone)]
pub enum ConfigSource {
    /// `--config PATH` or `RELAY_CONFIG`: must exist.
    Explicit(PathBuf),
    /// `./relay.toml` if it exists, else defaults + environment.
    Default,
}

/// The default file name looked up in the working directory.
pub const DEFAULT_FILE: &str = "relay.toml";

impl Config {
    /// Loads defaults ← file ← `RELAY_*` environment, then validates.
    pub fn load(source: &ConfigSource) -> Result<Self, ConfigError> {
        Self::load_with_env(source, Env::prefixed("RELAY_"))
    }

    /// As [`Config::load`], with an explicit environment provider (for tests).
    pub fn load_with_env(source: &ConfigSource, env: Env) -> Result<Self, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig::default()));
        match source {
            ConfigSource::Explicit(path) => {
                if !path.is_file() {
                    return Err(ConfigError::MissingFile(path.clone()));
                }
                figment = figment.merge(Toml::file_exact(path));
            }
            ConfigSource::Default => {
                if Path::new(DEFAULT_FILE).is_file() {
                    figment = figment.merge(Toml::file_exact(DEFAULT_FILE));
                }
            }
        }
        // RELAY_CONFIG names the file and RELAY_LOG_* tune logging; neither is a config key.
        // The signing key is read from the environment as is (see SIGNING_KEY_ENV).
        let env = env.split("__").filter(|k| {
            !["config", "log_format", "log", "signing.key"]
                .iter()
                .any(|n| k.as_str().eq_ignore_ascii_case(n))
        });
        let mut raw: RawConfig = figment
            .merge(env)
            .extract()
            .map_err(|e| ConfigError::Load(describe_figment_error(e)))?;
        if let Ok(key) = std::env::var(SIGNING_KEY_ENV) {
            raw.signing.key = Some(Secret(key));
        }
        raw.validate()
    }
}

fn describe_figment_error(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let origin = e
                .metadata
                .as_ref()
                .and_then(|m| m.source.as_ref().map(|s| format!(" (in {s})")))
                .or_else(|| e.metadata.as_ref().map(|m| format!(" (from {})", m.name)))
                .unwrap_or_default();
            // A value that did not parse is quoted in the error: never the signing key's.
            let what = if key.starts_with("signing.key") && !key.starts_with("signing.key_id") {
                "not a string (the value is not shown)".to_owned()
            } else {
                redact_url(&e.kind.to_string())
            };
            if key.is_empty() {
                format!("configuration error{origin}: {what}")
            } else {
                format!("configuration error at {key}{origin}: {what}")
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl RawConfig {
    /// Checks every value and converts the file's shape into [`Config`].
    pub fn validate(self) -> Result<Config, ConfigError> {
        let d = self.database;
        if d.url.trim().is_empty() {
            return Err(ConfigError::invalid("database.url", "must not be empty"));
        }
        let pg: tokio_postgres::Config = d.url.parse().map_err(|e| {
            ConfigError::invalid(
                "database.url",
                format!("{} is not a PostgreSQL URL: {e}", redact_url(&d.url)),
            )
        })?;
        if d.pool_size < 2 || d.pool_size > 1000 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                format!("{} is out of range (2..=1000)", d.pool_size),
            ));
        }
        let table =
            TableName::parse(&d.table).map_err(|r| ConfigError::invalid("database.table", r))?;

        let r = self.relay;
        let instance_id = match r.instance_id {
            Some(id) if id.trim().is_empty() => {
                return Err(ConfigError::invalid(
                    "relay.instance_id",
                    "must not be empty",
                ));
            }
            Some(id) => id,
            None => default_instance_id(),
        };
        if r.batch_size == 0 || r.batch_size > 10_000 {
            return Err(ConfigError::invalid(
                "relay.batch_size",
                format!("{} is out of range (1..=10000)", r.batch_size),
            ));
        }
        if r.max_in_flight < r.batch_size || r.max_in_flight > 100_000 {
            return Err(ConfigError::invalid(
                "relay.max_in_flight",
                format!(
                    "{} must be at least relay.batch_size ({}) and at most 100000",
                    r.max_in_flight, r.batch_size
                ),
            ));
        }
        positive("relay.poll_interval", r.poll_interval)?;
        positive("relay.lease_timeout", r.lease_timeout)?;
        let ordering = match r.ordering.as_str() {
            "aggregate" => Ordering::Aggregate,
            "none" => Ordering::None,
            other => {
                return Err(ConfigError::invalid(
                    "relay.ordering",
                    format!("{other:?} is not one of \"aggregate\", \"none\""),
                ));
            }
        };
        let source = match r.source {
            Some(s) if s.trim().is_empty() => {
                return Err(ConfigError::invalid("relay.source", "must not be empty"));
            }
            Some(s) => s,
            None => format!(
                "/outbox/{}/{}",
                pg.get_dbname().unwrap_or("postgres"),
                table
            ),
        };

        let rt = self.retry;
        positive("retry.base_delay", rt.base_delay)?;
        if rt.max_delay.0 < rt.base_delay.0 {
            return Err(ConfigError::invalid(
                "retry.max_delay",
                "must be at least retry.base_delay",
            ));
        }
        if rt.max_attempts == 0 {
            return Err(ConfigError::invalid(
                "retry.max_attempts",
                "must be at least 1",
            ));
        }
        if !(0.0..=1.0).contains(&rt.jitter) {
            return Err(ConfigError::invalid(
                "retry.jitter",
                format!("{} is not a fraction between 0 and 1", rt.jitter),
            ));
        }

        let p = self.publisher;
        let publisher = match p.kind.as_str() {
            "rabbitmq" => {
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
                if !matches!(
                    q.exchange_type.as_str(),
                    "direct" | "topic" | "fanout" | "headers"
                ) {
                    return Err(ConfigError::invalid(
                        "publisher.rabbitmq.exchange_type",
                        format!(
                            "{:?} is not one of direct, topic, fanout, headers",
                            q.exchange_type
                        ),
                    ));
                }
                positive("publisher.rabbitmq.confirm_timeout", q.confirm_timeout)?;
                let declare_queue = validate_dev_queue(&q)?;
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
                })
            }
            "kafka" => {
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
                PublisherConfig::Kafka(KafkaConfig {
                    brokers: k.brokers,
                    topic,
                    message_timeout: k.message_timeout.0,
                    properties: k.properties,
                })
            }
            "stdout" => PublisherConfig::Stdout,
            other => {
                return Err(ConfigError::invalid(
                    "publisher.kind",
                    format!("{other:?} is not one of \"rabbitmq\", \"kafka\", \"stdout\""),
                ));
            }
        };

        let metrics_listen = if self.metrics.listen.trim().is_empty() {
            None
        } else {
            Some(self.metrics.listen.parse().map_err(|e| {
                ConfigError::invalid(
                    "metrics.listen",
                    format!(
                        "{:?} is not an address like 127.0.0.1:9187: {e}",
                        self.metrics.listen
                    ),
                )
            })?)
        };

        let signing = validate_signing(self.signing)?;

        let c = self.cleanup;
        positive("cleanup.interval", c.interval)?;
        if c.batch_size == 0 {
            return Err(ConfigError::invalid(
                "cleanup.batch_size",
                "must be at least 1",
            ));
        }

        Ok(Config {
            database: DatabaseConfig {
                url: d.url,
                pool_size: d.pool_size,
                table,
                auto_migrate: d.auto_migrate,
            },
            relay: RelayConfig {
                instance_id,
                batch_size: r.batch_size,
                max_in_flight: r.max_in_flight,
                poll_interval: r.poll_interval.0,
                notify: r.notify,
                lease_timeout: r.lease_timeout.0,
                ordering,
                source,
                shutdown_timeout: r.shutdown_timeout.0,
            },
            retry: RetryPolicy {
                base_delay: rt.base_delay.0,
                max_delay: rt.max_delay.0,
                max_attempts: rt.max_attempts,
                jitter: rt.jitter,
            },
            publisher,
            metrics_listen,
            cleanup: CleanupConfig {
                retention: c.retention.0,
                interval: c.interval.0,
                batch_size: c.batch_size,
            },
            signing,
        })
    }
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

fn positive(key: &'static str, d: HumanDuration) -> Result<(), ConfigError> {
    if d.0.is_zero() {
        return Err(ConfigError::invalid(key, "must be greater than zero"));
    }
    Ok(())
}

/// Host name + pid, e.g. `web-1:4242`.
pub fn default_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loads `toml` as `--config` with `env` set, inside a figment jail (own cwd and env).
    #[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
    fn load_str(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let mut out = None;
        figment::Jail::expect_with(|jail| {
            jail.create_file("test.toml", toml)?;
            for (k, v) in env {
                jail.set_env(format!("RELAY_{k}"), v);
            }
            out = Some(Config::load(&ConfigSource::Explicit("test.toml".into())));
            Ok(())
        });
        out.unwrap()
    }

    #[test]
    fn defaults_match_the_contract() {
        let c = load_str("", &[]).unwrap();
        assert_eq!(c.database.pool_size, 8);
        assert_eq!(c.database.table.qualified(), "outbox_messages");
        assert!(!c.database.auto_migrate);
        assert_eq!(c.relay.batch_size, 500);
        assert_eq!(c.relay.max_in_flight, 1000);
        assert_eq!(c.relay.poll_interval, Duration::from_secs(1));
        assert!(c.relay.notify);
        assert_eq!(c.relay.lease_timeout, Duration::from_secs(60));
        assert_eq!(c.relay.ordering, Ordering::Aggregate);
        assert_eq!(c.relay.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(c.relay.source, "/outbox/postgres/outbox_messages");
        assert_eq!(c.retry.base_delay, Duration::from_secs(1));
        assert_eq!(c.retry.max_delay, Duration::from_secs(300));
        assert_eq!(c.retry.max_attempts, 12);
        assert!((c.retry.jitter - 0.2).abs() < f64::EPSILON);
        assert_eq!(c.cleanup.retention, Duration::from_secs(86_400));
        assert_eq!(c.cleanup.interval, Duration::from_secs(60));
        assert_eq!(c.cleanup.batch_size, 5000);
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9187".parse().unwrap()));
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("default publisher is rabbitmq")
        };
        assert_eq!(q.exchange, "outbox");
        assert_eq!(q.exchange_type, "topic");
        assert!(q.declare_exchange);
        assert_eq!(q.routing_key.as_str(), "{aggregate_type}.{event_type}");
        assert_eq!(q.confirm_timeout, Duration::from_secs(30));
        assert_eq!(q.declare_queue, None);
        assert_eq!(q.queue_binding, "#");
        assert_eq!(q.cloudevents_prefix.as_str(), "cloudEvents:");
        assert!(
            c.relay
                .instance_id
                .contains(&std::process::id().to_string())
        );
    }

    #[test]
    fn env_overrides_file() {
        let c = load_str(
            "[relay]\nbatch_size = 100\n[publisher.rabbitmq]\nexchange = \"from-file\"\n",
            &[
                ("RELAY__BATCH_SIZE", "200"),
                ("PUBLISHER__RABBITMQ__EXCHANGE", "from-env"),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.batch_size, 200);
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("rabbitmq")
        };
        assert_eq!(q.exchange, "from-env");
    }

    #[test]
    fn relay_config_and_log_format_variables_are_not_config_keys() {
        let c = load_str(
            "",
            &[
                ("LOG_FORMAT", "json"),
                ("CONFIG", "x.toml"),
                ("LOG", "debug"),
            ],
        );
        assert!(c.is_ok(), "{:?}", c.err().map(|e| e.to_string()));
    }

    #[test]
    fn file_overrides_defaults() {
        let c = load_str(
            "[database]\ntable = \"app.events_outbox\"\n[relay]\nordering = \"none\"\npoll_interval = \"250ms\"\n",
            &[],
        )
        .unwrap();
        assert_eq!(c.database.table.schema.as_deref(), Some("app"));
        assert_eq!(c.database.table.name, "events_outbox");
        assert_eq!(c.relay.ordering, Ordering::None);
        assert_eq!(c.relay.poll_interval, Duration::from_millis(250));
    }

    fn err(toml: &str) -> String {
        load_str(toml, &[]).unwrap_err().to_string()
    }

    #[test]
    fn stdout_publisher_needs_no_section() {
        let c = load_str("[publisher]\nkind = \"stdout\"\n", &[]).unwrap();
        assert!(matches!(c.publisher, PublisherConfig::Stdout));
        assert_eq!(c.publisher.kind(), "stdout");
    }

    #[test]
    fn unknown_key_is_named() {
        let e = err("[relay]\nbatch_sise = 3\n");
        assert!(e.contains("batch_sise"), "{e}");
        let e = err("[nonsense]\n");
        assert!(e.contains("nonsense"), "{e}");
    }

    #[test]
    fn bare_number_duration_is_rejected() {
        let e = err("[relay]\npoll_interval = 5\n");
        assert!(
            e.contains("relay.poll_interval") && e.contains("duration"),
            "{e}"
        );
    }

    #[test]
    fn bad_duration_string_is_rejected() {
        let e = err("[retry]\nbase_delay = \"soon\"\n");
        assert!(e.contains("retry.base_delay") && e.contains("soon"), "{e}");
    }

    #[test]
    fn hostile_table_name_is_rejected() {
        let e = err("[database]\ntable = \"x; drop table y\"\n");
        assert!(
            e.contains("database.table") && e.contains("identifier"),
            "{e}"
        );
        assert!(err("[database]\ntable = \"a.b.c\"\n").contains("database.table"));
        assert!(err("[database]\ntable = \"1abc\"\n").contains("database.table"));
    }

    #[test]
    fn unknown_placeholder_is_rejected() {
        let e = err("[publisher.rabbitmq]\nrouting_key = \"{tenant}.x\"\n");
        assert!(
            e.contains("publisher.rabbitmq.routing_key") && e.contains("tenant"),
            "{e}"
        );
    }

    #[test]
    fn ranges_are_checked() {
        assert!(err("[relay]\nbatch_size = 0\n").contains("relay.batch_size"));
        assert!(
            err("[relay]\nbatch_size = 600\nmax_in_flight = 500\n").contains("relay.max_in_flight")
        );
        assert!(err("[retry]\njitter = 1.5\n").contains("retry.jitter"));
        assert!(err("[retry]\nmax_attempts = 0\n").contains("retry.max_attempts"));
        assert!(err("[relay]\nordering = \"fifo\"\n").contains("relay.ordering"));
        assert!(err("[publisher]\nkind = \"sqs\"\n").contains("publisher.kind"));
        assert!(err("[metrics]\nlisten = \"nowhere\"\n").contains("metrics.listen"));
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
        let e = err("[publisher.rabbitmq]\ndeclare_queue = \"amq.mine\"\n");
        assert!(
            e.contains("publisher.rabbitmq.declare_queue") && e.contains("reserves"),
            "{e}"
        );
        let e = err("[publisher.rabbitmq]\nexchange = \"\"\ndeclare_queue = \"q\"\n");
        assert!(
            e.contains("publisher.rabbitmq.declare_queue") && e.contains("default exchange"),
            "{e}"
        );
        let long = "x".repeat(256);
        let e = err(&format!(
            "[publisher.rabbitmq]\ndeclare_queue = \"{long}\"\n"
        ));
        assert!(e.contains("publisher.rabbitmq.declare_queue"), "{e}");
        let e = err(&format!(
            "[publisher.rabbitmq]\nqueue_binding = \"{long}\"\n"
        ));
        assert!(e.contains("publisher.rabbitmq.queue_binding"), "{e}");
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
        let e = err("[publisher.rabbitmq]\ncloudevents_prefix = \"ce_\"\n");
        assert!(
            e.contains("publisher.rabbitmq.cloudevents_prefix")
                && e.contains("ce_")
                && e.contains("cloudEvents:")
                && e.contains("ce-"),
            "{e}"
        );
    }

    #[test]
    fn shipped_file_declares_the_development_queue() {
        let c = Config::load_with_env(
            &ConfigSource::Explicit(Path::new(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_FILE)),
            Env::prefixed("RELAYTEST_NONE_"),
        )
        .unwrap();
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("the shipped relay.toml publishes to RabbitMQ")
        };
        assert_eq!(q.exchange, "outbox");
        assert_eq!(q.declare_queue.as_deref(), Some("outbox.dev"));
        assert_eq!(q.queue_binding, "#");
    }

    #[test]
    fn password_never_in_errors() {
        let e = err("[publisher.rabbitmq]\nurl = \"http://guest:hunter2@x\"\n");
        assert!(
            !e.contains("hunter2") && e.contains("publisher.rabbitmq.url"),
            "{e}"
        );
        let e = err("[database]\nurl = \"postgres://u:hunter2@h:notaport/db\"\n");
        assert!(!e.contains("hunter2") && e.contains("database.url"), "{e}");
    }

    const KEY32: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn signing_is_off_by_default_and_takes_text_or_base64_keys() {
        assert!(load_str("", &[]).unwrap().signing.is_none());
        let c = load_str(
            &format!("[signing]\nkey_id = \"k-2026.1\"\nkey = \"{KEY32}\"\n"),
            &[],
        )
        .unwrap();
        let s = c.signing.unwrap();
        assert_eq!(
            (s.key_id.as_str(), s.key.as_slice()),
            ("k-2026.1", KEY32.as_bytes())
        );
        // 32 zero bytes in base64, from the environment (read as is, never parsed).
        let b64 = format!("base64:{}", "A".repeat(43) + "=");
        let c = load_str(
            "[signing]\nkey_id = \"k2\"\n",
            &[("SIGNING__KEY", b64.as_str())],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key, vec![0u8; 32]);
        // A numeric key id from the environment is a key id.
        let c = load_str(
            &format!("[signing]\nkey = \"{KEY32}\"\n"),
            &[("SIGNING__KEY_ID", "2026")],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key_id, "2026");
        // A key of digits only stays text.
        let digits = "1".repeat(40);
        let c = load_str(
            "[signing]\nkey_id = \"k3\"\n",
            &[("SIGNING__KEY", digits.as_str())],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key, digits.as_bytes());
    }

    #[test]
    fn signing_rejections_name_the_key_and_never_show_it() {
        let short = "hunter2-short-key";
        let e = err(&format!("[signing]\nkey_id = \"k\"\nkey = \"{short}\"\n"));
        assert!(
            e.contains("signing.key") && e.contains("17 bytes") && !e.contains(short),
            "{e}"
        );
        let e = err("[signing]\nkey_id = \"k\"\nkey = \"base64:hunter2!!not*base64\"\n");
        assert!(
            e.contains("signing.key") && e.contains("base64") && !e.contains("hunter2"),
            "{e}"
        );
        let e = err(&format!("[signing]\nkey = \"{KEY32}\"\n"));
        assert!(e.contains("signing.key_id") && !e.contains(KEY32), "{e}");
        assert!(err("[signing]\nkey_id = \"k\"\n").contains("signing.key"));
        let e = err(&format!("[signing]\nkey_id = \"a;b\"\nkey = \"{KEY32}\"\n"));
        assert!(e.contains("signing.key_id") && !e.contains(KEY32), "{e}");
        // A key that is not a string: figment would quote it in its error.
        let e = err("[signing]\nkey_id = \"k\"\nkey = 12345678901234567\n");
        assert!(
            e.contains("signing.key") && !e.contains("12345678901234567"),
            "{e}"
        );
        let e = err("[signing]\nkey_idd = \"k\"\n");
        assert!(e.contains("key_idd"), "{e}");
    }

    #[test]
    fn debug_output_never_shows_the_signing_key() {
        let c = load_str(
            &format!("[signing]\nkey_id = \"k\"\nkey = \"{KEY32}\"\n"),
            &[],
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains(KEY32) && shown.contains("32 bytes, redacted"),
            "{shown}"
        );
        let raw = RawSigning {
            key_id: Some("k".into()),
            key: Some(Secret(KEY32.into())),
        };
        assert!(!format!("{raw:?}").contains(KEY32));
    }

    #[test]
    fn missing_explicit_file_is_an_error() {
        let e = Config::load_with_env(
            &ConfigSource::Explicit("/nonexistent/relay.toml".into()),
            Env::prefixed("RELAYTEST_NONE_"),
        )
        .unwrap_err();
        assert!(matches!(e, ConfigError::MissingFile(_)));
    }

    #[test]
    fn identifiers() {
        assert!(validate_identifier("outbox_messages").is_ok());
        assert!(validate_identifier("_x1").is_ok());
        assert!(validate_identifier("").is_err());
        assert!(validate_identifier("a-b").is_err());
        assert!(validate_identifier("a\"b").is_err());
        assert!(validate_identifier(&"a".repeat(64)).is_err());
        let t = TableName::parse("app.outbox").unwrap();
        assert_eq!(t.qualified(), "app.outbox");
        assert_eq!(t.prefixed("_seq"), "app.outbox_seq");
        assert_eq!(t.channel(), "app.outbox");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            /// Arbitrary file contents load or fail with an error that names the problem;
            /// they never panic.
            #[test]
            fn loader_never_panics(body in "(\\[[a-z.]{1,12}\\]\n|[a-z_]{1,12} = (\"[^\"\\\\]{0,12}\"|[0-9]{1,4}|true)\n){0,6}") {
                match load_str(&body, &[]) {
                    Ok(_) => {}
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
            }

            #[test]
            fn table_names_are_identifiers_or_errors(raw in ".{0,80}") {
                if let Ok(t) = TableName::parse(&raw) {
                    prop_assert!(t.qualified().chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'));
                }
            }
        }
    }
}
