//! The producer's life: the librdkafka configuration, the client context (librdkafka's logs
//! and errors to tracing, the broker's reachability, the last client error), the producer in
//! use (in the publisher's connection slot) and the solo producer.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, Producer};

use super::KafkaPublisher;
use crate::config::KafkaConfig;
use crate::publish::ConnectError;
use crate::publish::slot::Connection;

/// Routes librdkafka's errors and logs to tracing, tracks broker reachability and keeps the
/// last client-level error, which says *why* a broker cannot be used (TLS, SASL, network).
pub(super) struct Context {
    pub(super) up: Arc<AtomicBool>,
    pub(super) last_error: Arc<Mutex<Option<LastError>>>,
    /// This producer's generation, and the publisher's current one: a replaced producer's
    /// errors (its purge raises a fatal gapless error) say nothing about the broker now.
    pub(super) generation: u64,
    pub(super) current: Arc<AtomicU64>,
}

impl Context {
    /// Not replaced: no producer was created after it (the one being created already has the
    /// newest generation).
    pub(super) fn is_current(&self) -> bool {
        self.generation >= self.current.load(Ordering::Relaxed)
    }
}

/// A client-level error as reported, and when it was last logged at `warn`.
pub(super) struct LastError {
    pub(super) text: String,
    logged: Instant,
}

/// The same client error is logged at `warn` at most this often (librdkafka repeats it on
/// every reconnect attempt).
const REPEAT_WARN_EVERY: Duration = Duration::from_secs(30);

impl ClientContext for Context {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel as L;
        if !self.is_current() {
            tracing::debug!(target: "rdkafka", facility = fac, "replaced producer: {message}");
            return;
        }
        match level {
            // A connection failure (`FAIL`) is also raised as an error event: logged there.
            L::Emerg | L::Alert | L::Critical | L::Error if fac != "FAIL" => {
                tracing::error!(target: "rdkafka", facility = fac, "{message}")
            }
            // The relay sets the gapless guarantee itself: librdkafka's note that it is
            // experimental is not the operator's to act on.
            L::Warning if !is_own_setting_note(fac, message) => {
                tracing::warn!(target: "rdkafka", facility = fac, "{message}")
            }
            _ => tracing::debug!(target: "rdkafka", facility = fac, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if !self.is_current() {
            tracing::debug!(target: "rdkafka", error = %error, "replaced producer: {reason}");
            return;
        }
        let code = error.rdkafka_error_code();
        if matches!(
            code,
            Some(
                RDKafkaErrorCode::AllBrokersDown
                    | RDKafkaErrorCode::Fatal
                    | RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SSL
            )
        ) {
            self.up.store(false, Ordering::Relaxed);
        }
        if code == Some(RDKafkaErrorCode::AllBrokersDown) {
            // "N/M brokers are down" follows the error that brought them down, logged below.
            tracing::debug!(target: "rdkafka", error = %error, "{reason}");
            return;
        }
        // "<broker>: <what> (after 3ms in state X)": the suffix changes on every repeat.
        let what = reason.split(" (after ").next().unwrap_or(reason);
        let text = format!("{what}{}", hint(code, what));
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        match last.as_mut() {
            Some(l) if l.text == text && l.logged.elapsed() < REPEAT_WARN_EVERY => {
                tracing::debug!(target: "rdkafka", error = %error, "{text}");
            }
            _ => {
                tracing::warn!(target: "rdkafka", error = %error, "{text}");
                *last = Some(LastError {
                    text,
                    logged: Instant::now(),
                });
            }
        }
    }
}

/// What to look at for a client-level error whose cause is usually the configuration.
fn hint(code: Option<RDKafkaErrorCode>, reason: &str) -> &'static str {
    // Skip the "sasl_ssl://host:port/id: " prefix: the protocol name is not the problem.
    let what = reason.split_once(": ").map_or(reason, |(_, w)| w);
    if code == Some(RDKafkaErrorCode::SSL) || what.contains("SSL") || what.contains("certificate") {
        " (TLS failed: check security.protocol and ssl.ca.location, or the broker's certificate)"
    } else if code == Some(RDKafkaErrorCode::Authentication) || what.contains("SASL") {
        " (SASL failed: check security.protocol, sasl.mechanism, sasl.username and sasl.password)"
    } else {
        ""
    }
}

/// The producer in use and its generation.
pub(super) struct Current {
    pub(super) producer: FutureProducer<Context>,
    pub(super) generation: u64,
}

impl Connection for Current {
    fn generation(&self) -> u64 {
        self.generation
    }

    /// From here its outcomes are stale (see `KafkaPublisher::note`). Dropping the last
    /// handle purges what it still holds (so it cannot deliver a handed-back record's
    /// successors later) and waits up to 500 ms: off the async threads.
    fn retire(self: Arc<Self>) {
        let fatal = self.producer.client().fatal_error();
        tracing::warn!(fatal = ?fatal, generation = self.generation, "replacing the Kafka producer");
        drop(tokio::task::spawn_blocking(move || drop(self)));
    }
}

/// Property names whose values must never be logged.
pub(super) fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password")
        || k.contains("secret")
        || k.ends_with(".key")
        || k.contains("key.pem")
        || k.contains("jaas")
}

/// librdkafka's configuration warning about a setting the relay makes itself.
fn is_own_setting_note(facility: &str, message: &str) -> bool {
    facility == "CONFWARN" && message.contains("enable.gapless.guarantee")
}

/// A client context that logs nothing above debug: for the client that
/// [`KafkaPublisher::check_properties`] creates only to hear librdkafka's verdict.
struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, _: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        tracing::debug!(target: "rdkafka", facility = fac, "{message}");
    }
}

impl rdkafka::producer::ProducerContext for Quiet {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, (): ()) {}
}

/// librdkafka's complaint about the configuration, for errors and logs. A property it refuses
/// is named without its value (rdkafka's own text quotes the value, a secret under a misspelled
/// name as well); elsewhere the values of secret properties are shown as `***`.
pub(super) fn config_error(
    e: &KafkaError,
    properties: &std::collections::BTreeMap<String, String>,
) -> String {
    match e {
        KafkaError::ClientConfig(_, desc, key, _) => format!(
            "Client config error: {} (property {key:?}; its value is not shown)",
            without_secrets(desc, properties)
        ),
        other => without_secrets(&other.to_string(), properties),
    }
}

/// `text` with the value of every secret property in `properties` shown as `***`:
/// librdkafka quotes a property's name and value in its configuration errors.
pub(super) fn without_secrets(
    text: &str,
    properties: &std::collections::BTreeMap<String, String>,
) -> String {
    properties
        .iter()
        .filter(|(k, v)| is_secret(k) && !v.is_empty())
        .fold(text.to_owned(), |text, (_, v)| {
            text.replace(v.as_str(), "***")
        })
}

impl KafkaPublisher {
    /// The librdkafka configuration: our required settings, then the user's properties, then
    /// (with `ordered`) what pipelined runs need.
    pub fn client_config(cfg: &KafkaConfig, ordered: bool) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &cfg.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set(
                "message.timeout.ms",
                cfg.message_timeout.as_millis().to_string(),
            )
            .set("client.id", crate::message::APPLICATION_NAME)
            // An unknown topic must fail its message (message-level) before the message times
            // out (connection-level); librdkafka's default waits 30 s.
            .set(
                "topic.metadata.propagation.max.ms",
                (cfg.message_timeout / 2)
                    .min(Duration::from_secs(5))
                    .as_millis()
                    .to_string(),
            );
        for (k, v) in &cfg.properties {
            c.set(k, v);
        }
        if ordered {
            // No librdkafka timeout (0 = infinite): a timed-out record would leave a gap the
            // gapless guarantee does not cover. `message_timeout` is the relay's own deadline.
            c.set("message.timeout.ms", "0")
                .set("enable.gapless.guarantee", "true");
        }
        c
    }

    /// Whether librdkafka takes `cfg` as the relay applies it (`ordered`: as the pipelined
    /// producer, the properties it sets itself left out as `for_ordering` leaves them out):
    /// `Err` is its complaint ([`config_error`]). The client is dropped at once (it may have
    /// begun to reach the brokers for its producer id meanwhile; nothing is sent).
    pub fn check_properties(cfg: &KafkaConfig, ordered: bool) -> Result<(), String> {
        let mut cfg = cfg.clone();
        if ordered {
            for key in super::ORDERED_OVERRIDES {
                cfg.properties.remove(*key);
            }
        }
        Self::client_config(&cfg, ordered)
            .create_with_context::<_, rdkafka::producer::BaseProducer<Quiet>>(Quiet)
            .map(drop)
            .map_err(|e| config_error(&e, &cfg.properties))
    }

    /// A new producer of `generation` (it replaces the one in use, if any).
    pub(super) fn create_producer(&self, generation: u64) -> Result<Current, ConnectError> {
        let ctx = Context {
            up: Arc::clone(&self.up),
            last_error: Arc::clone(&self.last_error),
            generation,
            current: Arc::clone(self.slot.generation()),
        };
        let producer: FutureProducer<Context> = Self::client_config(&self.cfg, self.ordered)
            .create_with_context(ctx)
            .map_err(|e| {
                ConnectError(format!(
                    "cannot create the Kafka producer: {}",
                    config_error(&e, &self.cfg.properties)
                ))
            })?;
        Ok(Current {
            producer,
            generation,
        })
    }

    /// The solo producer, created (or replaced after a fatal error) as needed: the user's
    /// properties, one record to a batch, no linger, one request in flight. Not idempotent:
    /// it sends one record at a time and waits for its report, so there is nothing for
    /// idempotence to keep in order, and a broker's rejection does not leave it fatal.
    pub(super) fn solo_producer(&self) -> Result<FutureProducer<Context>, String> {
        let mut solo = self.solo.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = solo.as_ref().filter(|p| p.client().fatal_error().is_none()) {
            return Ok(p.clone());
        }
        let mut config = Self::client_config(&self.cfg, false);
        config
            .remove("queue.buffering.max.ms")
            .set("linger.ms", "0")
            .set("batch.num.messages", "1")
            .set("enable.idempotence", "false")
            .set("max.in.flight.requests.per.connection", "1");
        let ctx = Context {
            up: Arc::new(AtomicBool::new(true)),
            last_error: Arc::new(Mutex::new(None)),
            generation: 0,
            current: Arc::new(AtomicU64::new(0)),
        };
        let p: FutureProducer<Context> = config.create_with_context(ctx).map_err(|e| {
            format!(
                "cannot create the Kafka solo producer: {}",
                config_error(&e, &self.cfg.properties)
            )
        })?;
        *solo = Some(p.clone());
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_name_the_settings_to_check() {
        let tls = hint(
            None,
            "ssl://b:9093/bootstrap: SSL handshake failed: certificate verify failed",
        );
        assert!(tls.contains("ssl.ca.location"), "{tls}");
        let sasl = hint(
            Some(RDKafkaErrorCode::Authentication),
            "sasl_ssl://b:9093/bootstrap: SASL authentication error: unknown-user",
        );
        assert!(sasl.contains("sasl.password"), "{sasl}");
        // The protocol in the broker's name is not a TLS problem.
        assert_eq!(hint(None, "ssl://b:9093/bootstrap: Connection refused"), "");
        assert_eq!(hint(None, "sasl_ssl://b:9093/1: Disconnected"), "");
    }

    /// The settings only; that an ordered producer keeps order through a record failing
    /// mid-run is shown against the broker by
    /// `a_record_failing_mid_run_stops_its_aggregate_and_the_rest_follows_in_order`
    /// (tests/dead_letters.rs).
    #[test]
    fn the_producer_is_configured_for_ordered_idempotent_delivery() {
        let c = KafkaPublisher::client_config(
            &super::super::tests::config(&[("message.timeout.ms", "5")]),
            true,
        );
        assert_eq!(c.get("enable.idempotence"), Some("true"));
        assert_eq!(c.get("enable.gapless.guarantee"), Some("true"));
        assert_eq!(c.get("message.timeout.ms"), Some("0"));
        let unordered = KafkaPublisher::client_config(&super::super::tests::config(&[]), false);
        assert_eq!(unordered.get("message.timeout.ms"), Some("5000"));
        assert_eq!(unordered.get("enable.gapless.guarantee"), None);
    }

    #[test]
    fn secrets_are_recognised() {
        assert!(is_secret("sasl.password"));
        assert!(is_secret("ssl.key.password"));
        assert!(is_secret("sasl.oauthbearer.client.secret"));
        assert!(is_secret("ssl.key.pem"));
        assert!(!is_secret("compression.type"));
        let properties = [
            ("sasl.jaas.config".to_owned(), "JAASSECRET".to_owned()),
            ("linger.ms".to_owned(), "5".to_owned()),
        ]
        .into();
        assert_eq!(
            without_secrets(
                "Java JAAS configuration is not supported: sasl.jaas.config JAASSECRET (linger.ms 5)",
                &properties
            ),
            "Java JAAS configuration is not supported: sasl.jaas.config *** (linger.ms 5)"
        );
    }
}
