//! `[publisher.nats]`: the NATS JetStream section, its validation, and what validating it
//! needs: the server URL taken apart (async-nats does not read credentials from a URL) and its
//! redaction for logs, the check that a subject can be published to, and the subject filter a
//! template's subjects fall under.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, HumanDuration, PublisherConfig, positive};
use crate::template::Template;

/// `[publisher.nats]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawNats {
    /// Server URL, `nats://` or `tls://`, optionally with `user:password@` or `token@`
    /// (default `nats://127.0.0.1:4222`).
    pub url: String,
    /// Subject template (default `outbox.{aggregate_type}.{event_type}`).
    pub subject: String,
    /// How long to wait for a stream's publish acknowledgement (default 30s).
    pub ack_timeout: HumanDuration,
    /// A JetStream stream to create (file storage, capturing the subjects the templates
    /// render) at start and after every reconnect unless it exists, for development (default
    /// empty: none).
    pub declare_stream: String,
}

impl Default for RawNats {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            subject: "outbox.{aggregate_type}.{event_type}".into(),
            ack_timeout: HumanDuration(Duration::from_secs(30)),
            declare_stream: String::new(),
        }
    }
}

/// The validated NATS JetStream settings.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL as written (may hold a password or token: print it only through
    /// [`redact`]).
    pub url: String,
    /// `url` taken apart: the address to dial and the credentials.
    pub server: ServerUrl,
    /// Subject template.
    pub subject: Template,
    /// Publish-acknowledgement wait.
    pub ack_timeout: Duration,
    /// The development stream to create if it does not exist, if any.
    pub declare_stream: Option<String>,
}

/// `[publisher.nats]`: a `nats://` or `tls://` URL with a host, a subject template that renders
/// to a valid publish subject, a positive `ack_timeout`.
pub(super) fn validate_nats(n: RawNats) -> Result<NatsConfig, ConfigError> {
    let server = ServerUrl::parse(&n.url)
        .map_err(|reason| ConfigError::invalid("publisher.nats.url", reason))?;
    let subject = Template::parse(&n.subject)
        .map_err(|e| ConfigError::invalid("publisher.nats.subject", e.to_string()))?;
    // Literal parts must make a subject whatever the row says (placeholders are checked per
    // message: a row whose values break the subject is one failed row).
    let sample = subject.render(&crate::template::Fields {
        aggregate_type: "a",
        event_type: "e",
        aggregate_id: Some("i"),
    });
    if let Err(why) = check_subject(&sample) {
        return Err(ConfigError::invalid(
            "publisher.nats.subject",
            format!("{:?} does not render to a NATS subject: {why}", n.subject),
        ));
    }
    positive("publisher.nats.ack_timeout", n.ack_timeout)?;
    let declare_stream =
        stream_name(&n.declare_stream).map_err(|why| ConfigError::invalid(DECLARE_STREAM, why))?;
    Ok(NatsConfig {
        url: n.url,
        server,
        subject,
        ack_timeout: n.ack_timeout.0,
        declare_stream,
    })
}

/// The key of the development stream.
const DECLARE_STREAM: &str = "publisher.nats.declare_stream";

/// `publisher.nats.declare_stream` as a JetStream stream name: `None` when empty; an error
/// for what JetStream refuses in a name (whitespace, `.`, `*`, `>`, path separators, control
/// characters, more than 255 bytes).
fn stream_name(raw: &str) -> Result<Option<String>, String> {
    let name = raw.trim();
    if name.is_empty() {
        return Ok(None);
    }
    if name.len() > 255 {
        return Err("is longer than 255 bytes".to_owned());
    }
    if let Some(c) = name
        .chars()
        .find(|&c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
    {
        return Err(format!(
            "{name:?} is not a JetStream stream name: it contains {c:?} (no spaces, '.', '*', '>', '/' or '\\'; e.g. OUTBOX)"
        ));
    }
    Ok(Some(name.to_owned()))
}

/// With `publisher.nats.declare_stream`, every subject template in use (`route` of each
/// outbox, else the publisher's) must start with a fixed token: the stream captures the
/// subjects under it, and a stream cannot capture every subject (`>`).
pub(super) fn check_declared_stream(
    publisher: &PublisherConfig,
    routes: impl Iterator<Item = Option<Template>>,
) -> Result<(), ConfigError> {
    let PublisherConfig::Nats(n) = publisher else {
        return Ok(());
    };
    if n.declare_stream.is_none() {
        return Ok(());
    }
    for route in routes {
        let template = route.unwrap_or_else(|| n.subject.clone());
        if filter_of(&template) == ">" {
            return Err(ConfigError::invalid(
                DECLARE_STREAM,
                format!(
                    "needs subject templates that start with a fixed token (e.g. \"outbox.{{aggregate_type}}\"), but {:?} starts with a placeholder: a stream cannot capture every subject",
                    template.as_str()
                ),
            ));
        }
    }
    Ok(())
}

/// Why `subject` cannot be published to, if it cannot: empty, whitespace or control
/// characters, an empty token (`a..b`, a leading or trailing `.`), or a wildcard token.
pub fn check_subject(subject: &str) -> Result<(), String> {
    if subject.is_empty() {
        return Err("it is empty".to_owned());
    }
    if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("it contains whitespace or control characters".to_owned());
    }
    for token in subject.split('.') {
        match token {
            "" => {
                return Err("it has an empty token (a leading, trailing or double '.')".to_owned());
            }
            "*" | ">" => {
                return Err(format!(
                    "{token:?} is a wildcard, not a subject to publish to"
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The subject filter every subject `template` renders falls under: its leading whole tokens
/// without a placeholder, then `>` (a placeholder's value may hold dots); the template itself
/// when it has no placeholder.
pub fn filter_of(template: &Template) -> String {
    let prefix = template.literal_prefix();
    if prefix == template.as_str() {
        return prefix.to_owned();
    }
    match prefix.rfind('.') {
        Some(dot) => format!("{}.>", &prefix[..dot]),
        None => ">".to_owned(),
    }
}

/// Credentials found in the URL's userinfo.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// No userinfo.
    None,
    /// `user:password@`.
    UserPassword(String, String),
    /// `token@` (a userinfo without a password is a token, as the NATS tools read it).
    Token(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::UserPassword(user, _) => write!(f, "UserPassword({user:?}, ***)"),
            Self::Token(_) => f.write_str("Token(***)"),
        }
    }
}

/// A validated server URL: the address to dial (without credentials) and the credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUrl {
    /// `nats://host:port` or `tls://host:port`.
    pub address: String,
    /// What the userinfo held.
    pub credentials: Credentials,
}

impl ServerUrl {
    /// Parses `raw`; the error says what is wrong and shows the URL redacted.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let shown = redact(raw);
        let url = url::Url::parse(raw.trim())
            .map_err(|e| format!("{shown} is not a URL ({e}); write nats://host:4222"))?;
        if !matches!(url.scheme(), "nats" | "tls") {
            return Err(format!("{shown} must start with nats:// or tls://"));
        }
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h.to_owned(),
            _ => return Err(format!("{shown} has no host")),
        };
        if url.path().len() > 1 || url.query().is_some() {
            return Err(format!(
                "{shown} has a path or query, which NATS does not use (write scheme://[credentials@]host:port)"
            ));
        }
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| format!("{shown} has credentials that are not UTF-8"))
        };
        let credentials = match (url.username(), url.password()) {
            ("", None) => Credentials::None,
            (user, Some(pass)) => Credentials::UserPassword(decode(user)?, decode(pass)?),
            (token, None) => Credentials::Token(decode(token)?),
        };
        let port = url.port().unwrap_or(4222);
        Ok(Self {
            address: format!("{}://{host}:{port}", url.scheme()),
            credentials,
        })
    }
}

fn percent_decode(s: &str) -> Option<String> {
    String::from_utf8(super::percent_decoded(s)).ok()
}

/// `raw` with its secrets masked: the password of `user:password@`, or the whole userinfo when
/// it is a token (`token@`), in each URL of a comma-separated list
/// ([`crate::redact::redact_url_tokens`]).
pub fn redact(raw: &str) -> String {
    crate::redact::redact_url_tokens(raw)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err_has, load_str, rejects};
    use super::*;

    fn filter(t: &str) -> String {
        filter_of(&Template::parse(t).unwrap())
    }

    #[test]
    fn filters_keep_the_whole_tokens_before_the_first_placeholder() {
        assert_eq!(filter("outbox.{aggregate_type}.{event_type}"), "outbox.>");
        assert_eq!(filter("a.b.x{event_type}"), "a.b.>");
        assert_eq!(filter("{aggregate_type}.created"), ">");
        assert_eq!(filter("orders.created"), "orders.created");
    }

    #[test]
    fn credentials_are_taken_from_the_url() {
        let u = ServerUrl::parse("nats://app:p%40ss@127.0.0.1:4223").unwrap();
        assert_eq!(u.address, "nats://127.0.0.1:4223");
        assert_eq!(
            u.credentials,
            Credentials::UserPassword("app".into(), "p@ss".into())
        );
        let t = ServerUrl::parse("tls://s3cr3t@nats.example").unwrap();
        assert_eq!(t.address, "tls://nats.example:4222");
        assert_eq!(t.credentials, Credentials::Token("s3cr3t".into()));
        assert!(!format!("{t:?}{u:?}").contains("s3cr3t"));
        assert!(!format!("{u:?}").contains("p@ss"));
        let plain = ServerUrl::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(plain.credentials, Credentials::None);
    }

    #[test]
    fn bad_urls_are_explained_without_their_secrets() {
        for (raw, says) in [
            ("http://u:hunter2@x:4222", "must start with nats://"),
            ("127.0.0.1:4222", "nats://"),
            ("nats://hunter2@", "host"),
            ("nats://x:4222/path", "path"),
        ] {
            let e = ServerUrl::parse(raw).unwrap_err();
            assert!(e.contains(says), "{raw}: {e}");
            assert!(!e.contains("hunter2"), "{raw}: {e}");
        }
    }

    #[test]
    fn redaction_masks_passwords_and_tokens() {
        assert_eq!(redact("nats://u:pw@h:1"), "nats://u:***@h:1");
        assert_eq!(redact("nats://tok@h:1"), "nats://***@h:1");
        assert_eq!(redact("nats://h:1"), "nats://h:1");
        assert_eq!(
            redact("nats://u:pw1@h:1,nats://v:pw2@h:2,nats://tok@h:3"),
            "nats://u:***@h:1,nats://v:***@h:2,nats://***@h:3"
        );
        let e = ServerUrl::parse("nats://u:SECRETX@127.0.0.1:4222,nats://v:SECRETY@127.0.0.1:4223")
            .unwrap_err();
        assert!(!e.contains("SECRET"), "{e}");
        // A comma inside a password is no list.
        assert_eq!(redact("nats://u:pa,ss@h:1"), "nats://u:***@h:1");
        assert_eq!(redact("nats://to,ken@h:1"), "nats://***@h:1");
    }

    #[test]
    fn subjects_are_checked_before_publishing() {
        assert!(check_subject("outbox.order.created").is_ok());
        assert!(check_subject("a-b_c.é").is_ok());
        for bad in ["", "a..b", ".a", "a.", "a b", "a.*.b", "a.>", "a\tb"] {
            assert!(check_subject(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn nats_defaults_and_rejections_name_their_keys() {
        let c = load_str("[publisher]\nkind = \"nats\"\n", &[]).unwrap();
        let PublisherConfig::Nats(n) = &c.publisher else {
            panic!("nats")
        };
        assert_eq!(n.url, "nats://127.0.0.1:4222");
        assert_eq!(n.subject.as_str(), "outbox.{aggregate_type}.{event_type}");
        assert_eq!(n.ack_timeout, Duration::from_secs(30));
        assert_eq!(c.publisher.kind(), "nats");
        assert_eq!(c.publisher.route().as_str(), n.subject.as_str());
        let nats = "[publisher]\nkind = \"nats\"\n[publisher.nats]\n";
        rejects(
            &format!("{nats}ack_timeout = \"0s\"\n"),
            "invalid value for publisher.nats.ack_timeout: must be greater than zero",
        );
        err_has(
            &format!("{nats}url = \"http://u:hunter2@x:4222\"\n"),
            &["publisher.nats.url", "nats://", "u:***@x"],
            &["hunter2"],
        );
        err_has(
            &format!("{nats}url = \"nats://s3cr3t-token@\"\n"),
            &["publisher.nats.url", "host"],
            &["s3cr3t"],
        );
        err_has(
            &format!("{nats}subject = \"outbox.{{tenant}}\"\n"),
            &["publisher.nats.subject", "tenant"],
            &[],
        );
        for bad in [
            "outbox events.{event_type}",
            "outbox..{event_type}",
            "outbox.>",
            "a.*.{event_type}",
        ] {
            err_has(
                &format!("{nats}subject = \"{bad}\"\n"),
                &["publisher.nats.subject", "NATS subject"],
                &[],
            );
        }
        // Another publisher's section is not checked.
        load_str("[publisher.nats]\nurl = \"http://x\"\n", &[]).unwrap();
        let env = [("PUBLISHER__NATS__SUBJECT", "env.{aggregate_type}")];
        let c = load_str("[publisher]\nkind = \"nats\"\n", &env).unwrap();
        assert_eq!(c.publisher.route().as_str(), "env.{aggregate_type}");
    }

    #[test]
    fn declare_stream_is_a_stream_name_over_fixed_subjects() {
        let nats = "[publisher]\nkind = \"nats\"\n[publisher.nats]\n";
        let c = load_str(nats, &[]).unwrap();
        let PublisherConfig::Nats(n) = &c.publisher else {
            panic!("nats")
        };
        assert_eq!(n.declare_stream, None);
        let env = [("PUBLISHER__NATS__DECLARE_STREAM", "OUTBOX_DEV")];
        let c = load_str(nats, &env).unwrap();
        let PublisherConfig::Nats(n) = &c.publisher else {
            panic!("nats")
        };
        assert_eq!(n.declare_stream.as_deref(), Some("OUTBOX_DEV"));
        for bad in ["out box", "out.box", "out*", "out>", "a/b", "a\\\\b"] {
            err_has(
                &format!("{nats}declare_stream = \"{bad}\"\n"),
                &[DECLARE_STREAM, "not a JetStream stream name"],
                &[],
            );
        }
        err_has(
            &format!("{nats}declare_stream = \"{}\"\n", "S".repeat(256)),
            &[DECLARE_STREAM, "255"],
            &[],
        );
        err_has(
            &format!("{nats}declare_stream = \"S\"\nsubject = \"{{aggregate_type}}.x\"\n"),
            &[DECLARE_STREAM, "fixed token", "{aggregate_type}.x"],
            &[],
        );
        // An outbox's own subject is held to the same rule.
        let outboxes = "[[outboxes]]\ntable = \"a\"\n[[outboxes]]\ntable = \"b\"\nsubject = \"{event_type}\"\n";
        err_has(
            &format!("{nats}declare_stream = \"S\"\n{outboxes}"),
            &[DECLARE_STREAM, "\"{event_type}\""],
            &[],
        );
        // Without the stream, such templates are fine; another publisher ignores the key.
        load_str(&format!("{nats}subject = \"{{aggregate_type}}.x\"\n"), &[]).unwrap();
        load_str("[publisher.nats]\ndeclare_stream = \"a.b\"\n", &[]).unwrap();
    }
}
