//! Configuration: figment layering (defaults ← TOML file ← `RELAY_*` environment), then
//! validation into a [`Config`] that the rest of the crate can trust.
//!
//! The raw structs mirror `relay.toml` one to one (unknown keys are rejected), a file per
//! section: `database`, `relay`, `retry`, `publisher`, `metrics`, `cleanup`,
//! `signing`, `traces` (`[tracing]`), `console`; each validates its own section. Closed sets are serde enums
//! (`publisher.rabbitmq.exchange_type`, `cloudevents_prefix`) or, where the raw field stays a
//! string (`relay.ordering`, `publisher.kind`: the benchmark sets them as text), matched by one
//! helper that names every choice. [`Config`] holds parsed durations, templates and
//! identifiers. Every rejection names the key at fault.

mod cleanup;
mod console;
mod database;
mod http;
mod metrics;
pub mod nats;
mod outboxes;
mod publisher;
mod relay;
mod retry;
mod signing;
mod traces;

use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::{Dict, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use cleanup::{CleanupConfig, RawCleanup};
pub use console::{CONSOLE_TOKEN_ENV, ConsoleConfig, MIN_CONSOLE_TOKEN_CHARS, RawConsole};
pub use database::{
    DatabaseConfig, DatabaseKind, RawDatabase, TableName, mysql_opts, validate_identifier,
};
pub use http::{
    HeaderText, HttpConfig, HttpMethod, HttpMode, RESERVED_HEADERS, RawHttp, TRACE_CONTEXT_HEADERS,
};
pub use metrics::RawMetrics;
pub use nats::{NatsConfig, RawNats};
pub use outboxes::{OutboxConfig, RawOutbox};
pub use publisher::{
    CloudEventsPrefix, ExchangeType, KafkaConfig, PublisherConfig, PublisherKind, RabbitMqConfig,
    RawKafka, RawPublisher, RawRabbitMq, RawRedis, RedisConfig, valid_kafka_topic,
};
pub use relay::{Ordering, RawRelay, RelayConfig, default_instance_id};
pub use retry::RawRetry;
pub use signing::{
    BASE64_PREFIX, MIN_SIGNING_KEY_BYTES, RawSigning, SIGNING_KEY_ENV, Secret, SigningConfig,
};
pub use traces::{
    DEFAULT_SERVICE_NAME, OTEL_ENDPOINT_ENV, OTEL_PROTOCOL_ENV, OTEL_SERVICE_NAME_ENV, OtelEnv,
    OtlpProtocol, RawTracing, TracingConfig,
};

use crate::redact::redact_url;
use crate::retry::RetryPolicy;

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
        /// The dotted key, e.g. `database.table` or `outboxes[1].table`.
        key: std::borrow::Cow<'static, str>,
        /// What is wrong and what is expected.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(key: impl Into<std::borrow::Cow<'static, str>>, reason: impl Into<String>) -> Self {
        Self::Invalid {
            key: key.into(),
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
                let d = humantime::parse_duration(v.trim()).map_err(|e| {
                    E::custom(format!(
                        "bad duration {v:?}: {e} (write e.g. \"500ms\", \"30s\", \"5m\")"
                    ))
                })?;
                if d > LONGEST_DURATION {
                    return Err(E::custom(format!(
                        "duration {v:?} is longer than 100 years, the longest any setting takes"
                    )));
                }
                Ok(HumanDuration(d))
            }
        }
        d.deserialize_str(V)
    }
}

/// The longest duration any setting takes: 100 years (365-day years). Longer ones would
/// overflow the database's interval arithmetic at run time, round after round.
const LONGEST_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

fn dur(s: &str) -> HumanDuration {
    HumanDuration(humantime::parse_duration(s).unwrap_or_default())
}

/// The whole file as written, before validation; its default is every section's default (the
/// documented defaults, docs/configuration.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
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
    /// `[tracing]`
    #[serde(default)]
    pub tracing: RawTracing,
    /// `[console]`
    #[serde(default)]
    pub console: RawConsole,
    /// `[[outboxes]]`: the tables this relay serves (none: one, `database.table`).
    #[serde(default)]
    pub outboxes: Vec<RawOutbox>,
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
    /// `[tracing]`; `None`: tracing is off (no endpoint configured).
    pub tracing: Option<TracingConfig>,
    /// `[console]`
    pub console: ConsoleConfig,
    /// The outboxes served: `[[outboxes]]`, or the one table of `[database]` (never empty).
    /// With `[[outboxes]]`, `database.table` above is the first outbox's table.
    pub outboxes: Vec<OutboxConfig>,
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
        // The signing key and the console token are read from the environment as is (see
        // SIGNING_KEY_ENV, CONSOLE_TOKEN_ENV).
        let env = env.split("__").filter(|k| {
            ![
                "config",
                "log_format",
                "log",
                "signing.key",
                "console.token",
            ]
            .iter()
            .any(|n| k.as_str().eq_ignore_ascii_case(n))
        });
        let mut raw = extract_with_env(&figment, EnvText::new(env))?;
        if let Ok(key) = std::env::var(SIGNING_KEY_ENV) {
            raw.signing.key = Some(Secret(key));
        }
        if let Ok(token) = std::env::var(CONSOLE_TOKEN_ENV) {
            raw.console.token = Some(Secret(token));
        }
        raw.validate_with(&OtelEnv::from_process())
    }
}

/// The `RELAY_*` variables as a figment provider that keeps each value's text as written, so
/// that a string key (`relay.instance_id`, a header value) set to `00123` or `1.50` is that
/// text. Figment's own provider parses every value (`00123` becomes the number 123); here a
/// value is read that way only for the keys in `parsed`: those that turned out to take a
/// number or a boolean ([`extract_with_env`]). A value written as an array or a table
/// (`[a, b]`, `{k = v}`) is parsed as before.
#[derive(Clone)]
struct EnvText {
    env: Env,
    // Dotted keys, as the provider names them (lower case), read as figment parses them.
    parsed: std::collections::HashSet<String>,
}

impl EnvText {
    fn new(env: Env) -> Self {
        Self {
            env,
            parsed: std::collections::HashSet::new(),
        }
    }

    /// The value of the variable for `key` as figment parses it, when that is a number, a
    /// boolean or a character rather than the text itself.
    fn parses_otherwise(&self, key: &str) -> bool {
        self.env.iter().any(|(k, raw)| {
            k.as_str() == key
                && matches!(
                    parse_env_value(&raw),
                    Value::Num(..) | Value::Bool(..) | Value::Char(..)
                )
        })
    }
}

/// `raw` as figment's environment provider reads it (numbers, booleans, arrays, tables, or
/// else the text).
fn parse_env_value(raw: &str) -> Value {
    match raw.parse::<Value>() {
        Ok(value) => value,
        Err(never) => match never {},
    }
}

impl Provider for EnvText {
    fn metadata(&self) -> Metadata {
        self.env.metadata()
    }

    fn data(&self) -> Result<figment::value::Map<Profile, Dict>, figment::Error> {
        let mut dict = Dict::new();
        for (key, raw) in self.env.iter() {
            let parsed = parse_env_value(&raw);
            // As figment reads it: the text trimmed, and a quoted string (`"007"`) unquoted.
            let text = raw.trim();
            let value = if self.parsed.contains(key.as_str())
                || matches!(parsed, Value::Dict(..) | Value::Array(..))
                || (text.starts_with('"') && matches!(parsed, Value::String(..)))
            {
                parsed
            } else {
                Value::from(text.to_owned())
            };
            if let Value::Dict(_, nested) = figment::util::nest(key.as_str(), value) {
                merge_dict(&mut dict, nested);
            }
        }
        Ok(self.env.profile.collect(dict))
    }
}

/// `from` merged into `into`, tables key by key, a later value replacing an earlier one.
fn merge_dict(into: &mut Dict, from: Dict) {
    for (key, value) in from {
        match (into.get_mut(&key), value) {
            (Some(Value::Dict(_, existing)), Value::Dict(_, nested)) => {
                merge_dict(existing, nested);
            }
            (_, value) => {
                into.insert(key, value);
            }
        }
    }
}

/// `figment` (defaults and file) with `env` merged over it, as [`RawConfig`], or the error
/// naming the key (and variable) at fault. An environment
/// value is text first; where a key takes a number or a boolean and the text did not fit
/// ("expected u64, found string"), it is read again as figment parses it (`500`, `true`),
/// one key at a time. A string key thus keeps the text as written, a numeric key parses it
/// as before, and a value that is neither is rejected as before.
fn extract_with_env(figment: &Figment, mut env: EnvText) -> Result<RawConfig, ConfigError> {
    loop {
        let error = match figment.clone().merge(env.clone()).extract::<RawConfig>() {
            Ok(raw) => return Ok(raw),
            Err(error) => error,
        };
        let retry = error.clone().into_iter().find_map(|e| {
            let from_env = e
                .metadata
                .as_ref()
                .is_some_and(|m| m.source.is_none() && m.name.contains("environment variable"));
            let key = e.path.join(".");
            (from_env
                && matches!(
                    e.kind,
                    figment::error::Kind::InvalidType(figment::error::Actual::Str(_), _)
                )
                && !env.parsed.contains(&key)
                && env.parses_otherwise(&key))
            .then_some(key)
        });
        match retry {
            Some(key) => {
                env.parsed.insert(key);
            }
            None => return Err(ConfigError::Load(describe_figment_error(error))),
        }
    }
}

/// The bytes `%XX` escapes in `s` stand for (a URL's userinfo); anything else as written.
pub fn percent_decoded(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = s.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

fn describe_figment_error(e: figment::Error) -> String {
    e.into_iter()
        .map(|e| {
            let key = e.path.join(".");
            let from_env = e
                .metadata
                .as_ref()
                .is_some_and(|m| m.source.is_none() && m.name.contains("environment variable"));
            let origin = if from_env && !e.path.is_empty() {
                // The variable itself, as figment read it (keys are matched in any case).
                let var = format!("RELAY_{}", e.path.join("__").to_uppercase());
                if matches!(e.kind, figment::error::Kind::UnknownField(..)) {
                    // The unknown key may be a section (`RELAY_PUBLISHR__KIND`): name the
                    // variable that is set, not the key's path.
                    let nested = format!("{var}__");
                    let var = std::env::vars_os()
                        .filter_map(|(name, _)| name.into_string().ok())
                        .find(|name| {
                            let upper = name.to_uppercase();
                            upper == var || upper.starts_with(&nested)
                        })
                        .unwrap_or(var);
                    format!(
                        " (from the environment variable {var}: every RELAY_* variable is read as a \
                         configuration key, RELAY_<SECTION>__<KEY>; rename or unset it)"
                    )
                } else {
                    format!(" (from the environment variable {var})")
                }
            } else {
                e.metadata
                    .as_ref()
                    .and_then(|m| m.source.as_ref().map(|s| format!(" (in {s})")))
                    .or_else(|| e.metadata.as_ref().map(|m| format!(" (from {})", m.name)))
                    .unwrap_or_default()
            };
            if let figment::error::Kind::UnknownVariant(value, expected) = &e.kind
                && let Some(message) = closed_set_error(&key, value, expected)
            {
                return message;
            }
            // A value that did not parse is quoted in the error: never the signing key's or
            // the console token's.
            let secret = (key.starts_with("signing.key") && !key.starts_with("signing.key_id"))
                || key.starts_with("console.token");
            let what = if secret {
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

/// The keys whose values form a closed set read as a serde enum.
const CLOSED_SETS: [&str; 3] = [
    "relay.ordering",
    "publisher.kind",
    "publisher.rabbitmq.exchange_type",
];

/// The message of a value outside a serde enum's closed set, naming the key and every choice as
/// [`choose`] does (`None` for other keys: figment's own message names the choices).
fn closed_set_error(key: &str, value: &str, expected: &[&str]) -> Option<String> {
    CLOSED_SETS.contains(&key).then(|| {
        let names: Vec<String> = expected.iter().map(|n| format!("{n:?}")).collect();
        format!(
            "invalid value for {key}: {value:?} is not one of {}",
            names.join(", ")
        )
    })
}

/// The choice written as `value` among `choices` (a closed set kept as a string in the raw
/// struct), or the rejection naming `key` and every choice.
pub(super) fn choose<T: Copy>(
    key: &'static str,
    value: &str,
    choices: &[(&str, T)],
) -> Result<T, ConfigError> {
    choices
        .iter()
        .find(|(name, _)| *name == value)
        .map(|(_, choice)| *choice)
        .ok_or_else(|| {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
            ConfigError::invalid(key, format!("{value:?} is not one of {}", names.join(", ")))
        })
}

impl RawConfig {
    /// Checks every value and converts the file's shape into [`Config`] (the standard `OTEL_*`
    /// variables are not consulted: see [`RawConfig::validate_with`]).
    pub fn validate(self) -> Result<Config, ConfigError> {
        self.validate_with(&OtelEnv::default())
    }

    /// [`RawConfig::validate`], with the standard `OTEL_*` variables `[tracing]` honours.
    pub fn validate_with(self, otel: &OtelEnv) -> Result<Config, ConfigError> {
        let table_set = self.database.table.is_some();
        let table_as_written = self
            .database
            .table
            .clone()
            .unwrap_or_else(|| database::DEFAULT_TABLE.to_owned());
        let explicit_source = self.relay.source.clone();
        let (database, dbname) = self.database.validate()?;
        let relay = self.relay.validate(&dbname, &database.table)?;
        let retry = self.retry.validate()?;
        let publisher = self.publisher.validate()?;
        let metrics_listen = self.metrics.validate()?;
        let signing = self.signing.validate()?;
        let tracing = self.tracing.validate(otel)?;
        let cleanup = self.cleanup.validate()?;
        let console = self.console.validate()?;
        let outboxes = if self.outboxes.is_empty() {
            vec![OutboxConfig {
                name: table_as_written,
                database: database.clone(),
                ordering: relay.ordering,
                source: relay.source.clone(),
                route: None,
            }]
        } else {
            if table_set {
                return Err(ConfigError::invalid(
                    "database.table",
                    "is set together with [[outboxes]]: give each outbox its table there, and remove database.table",
                ));
            }
            outboxes::validate(
                self.outboxes,
                &outboxes::Inherited {
                    database: &database,
                    ordering: relay.ordering,
                    source: explicit_source.as_deref(),
                    publisher: &publisher,
                },
            )?
        };
        nats::check_declared_stream(&publisher, outboxes.iter().map(|o| o.route.clone()))?;
        Ok(Config {
            outboxes,
            database,
            relay,
            retry,
            publisher,
            metrics_listen,
            cleanup,
            signing,
            tracing,
            console,
        })
    }
}

pub(super) fn positive(key: &'static str, d: HumanDuration) -> Result<(), ConfigError> {
    if d.0.is_zero() {
        return Err(ConfigError::invalid(key, "must be greater than zero"));
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Loads `toml` as `--config` with `env` set, inside a figment jail (own cwd and env).
    #[allow(clippy::result_large_err)] // figment::Jail's closure returns figment::Error
    pub(crate) fn load_str(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
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

    pub(crate) fn err(toml: &str) -> String {
        load_str(toml, &[]).unwrap_err().to_string()
    }

    /// `toml` is rejected with a message naming every `has` and none of `hides` (secrets).
    pub(crate) fn err_has(toml: &str, has: &[&str], hides: &[&str]) {
        let e = err(toml);
        for h in has {
            assert!(e.contains(h), "{toml:?}: {e}\n(wanted {h:?})");
        }
        for h in hides {
            assert!(!e.contains(h), "{toml:?}: {e}\n(shows {h:?})");
        }
    }

    /// `toml` is rejected with a message that starts with `message`.
    pub(crate) fn rejects(toml: &str, message: &str) {
        let e = err(toml);
        assert!(e.starts_with(message), "{toml:?}: {e}");
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
        assert_eq!(q.exchange_type, ExchangeType::Topic);
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
    fn environment_text_stays_text_for_string_keys_while_numeric_keys_parse() {
        let c = load_str(
            "",
            &[
                ("RELAY__INSTANCE_ID", "1"),
                ("RELAY__SOURCE", "0042"),
                ("RELAY__BATCH_SIZE", "200"),
                ("RELAY__NOTIFY", "false"),
                ("RETRY__JITTER", "0.1"),
                ("RETRY__MAX_ATTEMPTS", "007"),
                ("SIGNING__KEY_ID", "02026"),
                (
                    "SIGNING__KEY",
                    "base64:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
                ),
                ("PUBLISHER__RABBITMQ__EXCHANGE", "1.50"),
                ("PUBLISHER__RABBITMQ__DECLARE_EXCHANGE", "true"),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.instance_id, "1");
        assert_eq!(c.relay.source, "0042");
        assert_eq!(c.relay.batch_size, 200);
        assert!(!c.relay.notify);
        assert_eq!(c.retry.jitter, 0.1);
        assert_eq!(c.retry.max_attempts, 7);
        assert_eq!(c.signing.map(|s| s.key_id).as_deref(), Some("02026"));
        let PublisherConfig::RabbitMq(q) = c.publisher else {
            panic!("rabbitmq")
        };
        assert_eq!(q.exchange, "1.50");
        assert!(q.declare_exchange);

        let c = load_str(
            "[publisher]\nkind = \"nats\"\n",
            &[
                ("PUBLISHER__NATS__SUBJECT", "123"),
                ("PUBLISHER__NATS__DECLARE_STREAM", "2026"),
            ],
        )
        .unwrap();
        let PublisherConfig::Nats(n) = c.publisher else {
            panic!("nats")
        };
        assert_eq!(n.subject.as_str(), "123");
        assert_eq!(n.declare_stream.as_deref(), Some("2026"));

        let c = load_str(
            "[publisher]\nkind = \"redis\"\n",
            &[("PUBLISHER__REDIS__STREAM", "00123")],
        )
        .unwrap();
        let PublisherConfig::Redis(r) = c.publisher else {
            panic!("redis")
        };
        assert_eq!(r.stream.as_str(), "00123");
    }

    #[test]
    fn environment_text_is_trimmed_and_unquoted_as_before() {
        // A value read from a file with its newline, and one quoted to keep it text.
        let c = load_str(
            "",
            &[
                ("RELAY__INSTANCE_ID", "relay-7\n"),
                ("RELAY__SOURCE", "\"007\""),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.instance_id, "relay-7");
        assert_eq!(c.relay.source, "007");
    }

    #[test]
    fn a_value_that_fits_no_type_is_still_rejected_naming_its_variable() {
        for (var, value) in [
            ("RELAY__BATCH_SIZE", "1.5"),
            ("RELAY__NOTIFY", "maybe"),
            ("RELAY__POLL_INTERVAL", "5"),
        ] {
            let e = load_str("", &[(var, value)]).unwrap_err().to_string();
            assert!(e.contains(&format!("RELAY_{var}")), "{var}: {e}");
        }
        // A file's value keeps its type: a quoted number is no number there.
        let e = err("[relay]\nbatch_size = \"200\"\n");
        assert!(e.contains("relay.batch_size"), "{e}");
    }

    #[test]
    fn a_misspelled_section_names_the_variable_that_is_set() {
        let e = load_str("", &[("PUBLISHR__KIND", "nats")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("environment variable RELAY_PUBLISHR__KIND:"),
            "{e}"
        );
    }

    #[test]
    fn an_environment_variable_that_is_no_key_is_named_in_the_error() {
        for (var, value) in [("PORT", "tcp://10.0.0.1:9187"), ("DATABASE_URL", "x")] {
            let e = load_str("", &[(var, value)]).unwrap_err().to_string();
            let named = format!("from the environment variable RELAY_{var}:");
            assert!(e.contains(&named), "{e}");
            assert!(e.contains("RELAY_<SECTION>__<KEY>"), "{e}");
        }
        // A bad value of a real key names its variable too.
        let e = load_str("", &[("RELAY__BATCH_SIZE", "many")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RELAY_RELAY__BATCH_SIZE"), "{e}");
        assert!(!e.contains("rename or unset"), "a real key: {e}");
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

    #[test]
    fn unknown_key_is_named() {
        err_has("[relay]\nbatch_sise = 3\n", &["batch_sise"], &[]);
        err_has("[nonsense]\n", &["nonsense"], &[]);
    }

    #[test]
    fn bare_number_duration_is_rejected() {
        err_has(
            "[relay]\npoll_interval = 5\n",
            &["relay.poll_interval", "duration"],
            &[],
        );
    }

    #[test]
    fn bad_duration_string_is_rejected() {
        err_has(
            "[retry]\nbase_delay = \"soon\"\n",
            &["retry.base_delay", "soon"],
            &[],
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
        err_has(
            "[publisher.rabbitmq]\nurl = \"http://guest:hunter2@x\"\n",
            &["publisher.rabbitmq.url"],
            &["hunter2"],
        );
        err_has(
            "[database]\nurl = \"postgres://u:hunter2@h:notaport/db\"\n",
            &["database.url"],
            &["hunter2"],
        );
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
