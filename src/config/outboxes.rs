//! `[[outboxes]]`: the tables one relay serves, each with its own table and optionally its own
//! database URL, CloudEvents source, ordering and routing template; whatever an entry leaves
//! out it inherits from `[database]`, `[relay]` and the publisher (docs/configuration.md).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::database::{database_name, not_on_mysql};
use super::{
    ConfigError, DatabaseConfig, DatabaseKind, Ordering, PublisherConfig, TableName, choose,
};
use crate::template::Template;

/// One `[[outboxes]]` entry as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOutbox {
    /// Name in metrics, logs and `--outbox` (default: the table as written).
    #[serde(default)]
    pub name: Option<String>,
    /// The outbox table, optionally schema-qualified (required).
    pub table: String,
    /// Its database (default `database.url`).
    #[serde(default)]
    pub url: Option<String>,
    /// CloudEvents `source` (default `relay.source`, else `/outbox/<database>/<table>`).
    #[serde(default)]
    pub source: Option<String>,
    /// `aggregate` or `none` (default `relay.ordering`).
    #[serde(default)]
    pub ordering: Option<String>,
    /// RabbitMQ routing-key template (default `publisher.rabbitmq.routing_key`).
    #[serde(default)]
    pub routing_key: Option<String>,
    /// Kafka topic template (default `publisher.kafka.topic`).
    #[serde(default)]
    pub topic: Option<String>,
    /// NATS subject template (default `publisher.nats.subject`).
    #[serde(default)]
    pub subject: Option<String>,
    /// Redis stream key template (default `publisher.redis.stream`).
    #[serde(default)]
    pub stream: Option<String>,
}

/// One validated outbox.
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// Its name (the `outbox` metric label, `--outbox NAME`).
    pub name: String,
    /// Its database and table (pool size and `auto_migrate` come from `[database]`).
    pub database: DatabaseConfig,
    /// Its ordering.
    pub ordering: Ordering,
    /// Its CloudEvents `source`.
    pub source: String,
    /// Its routing-key, topic, subject or stream template, when it overrides the publisher's.
    pub route: Option<Template>,
}

/// What entries inherit.
pub(super) struct Inherited<'a> {
    pub database: &'a DatabaseConfig,
    pub ordering: Ordering,
    /// `relay.source` when it was set.
    pub source: Option<&'a str>,
    pub publisher: &'a PublisherConfig,
}

/// Validates every entry; names must be unique, and so must tables within one database.
pub(super) fn validate(
    raw: Vec<RawOutbox>,
    inherited: &Inherited<'_>,
) -> Result<Vec<OutboxConfig>, ConfigError> {
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut tables: HashMap<(String, String), usize> = HashMap::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, o) in raw.into_iter().enumerate() {
        let key = |field: &str| format!("outboxes[{i}].{field}");
        let url = o.url.unwrap_or_else(|| inherited.database.url.clone());
        let kind = DatabaseKind::of(&url);
        let table = TableName::parse_for(&o.table, kind)
            .map_err(|r| ConfigError::invalid(key("table"), r))?;
        let name = o.name.unwrap_or_else(|| o.table.clone());
        unique_name(&mut names, &name, i).map_err(|r| ConfigError::invalid(key("name"), r))?;
        let dbname = database_name(&key("url"), &url)?;
        if kind == DatabaseKind::Mysql && inherited.database.partition_interval.is_some() {
            return Err(not_on_mysql());
        }
        // Compared with the schema spelled out: an unqualified name is the URL's database on
        // MySQL and (the default search_path) `public` on PostgreSQL.
        let default_schema = match kind {
            DatabaseKind::Mysql => dbname.as_str(),
            DatabaseKind::Postgres => "public",
        };
        let resolved = format!(
            "{}.{}",
            table.schema.as_deref().unwrap_or(default_schema),
            table.name
        );
        if let Some(first) = tables.insert((url.clone(), resolved), i) {
            return Err(ConfigError::invalid(
                key("table"),
                format!(
                    "{table} in the same database is already served by outboxes[{first}] \
                     (an unqualified name is the same table as the one in {default_schema})"
                ),
            ));
        }
        let ordering = match o.ordering {
            Some(s) => ordering_of(&s).map_err(|e| rename(e, key("ordering")))?,
            None => inherited.ordering,
        };
        let source = source(o.source.as_deref().or(inherited.source), &dbname, &table)
            .map_err(|r| ConfigError::invalid(key("source"), r))?;
        let overrides = [
            ("routing_key", o.routing_key),
            ("topic", o.topic),
            ("subject", o.subject),
            ("stream", o.stream),
        ];
        let route = route(overrides, inherited.publisher, &key)?;
        out.push(OutboxConfig {
            name,
            database: DatabaseConfig {
                url,
                kind,
                table,
                ..inherited.database.clone()
            },
            ordering,
            source,
            route,
        });
    }
    Ok(out)
}

/// Why entry `i`'s `name` cannot name it (see [`check_name`]), or is another entry's already;
/// records it in `names`.
fn unique_name(names: &mut HashMap<String, usize>, name: &str, i: usize) -> Result<(), String> {
    check_name(name)?;
    match names.insert(name.to_owned(), i) {
        Some(first) => Err(format!(
            "{name:?} is also the name of outboxes[{first}] (a name defaults to the table as written): give each outbox its own name"
        )),
        None => Ok(()),
    }
}

/// An entry's `ordering`.
fn ordering_of(value: &str) -> Result<Ordering, ConfigError> {
    choose(
        "outboxes[].ordering",
        value,
        &[("aggregate", Ordering::Aggregate), ("none", Ordering::None)],
    )
}

/// Why `name` cannot name an outbox, if it cannot.
fn check_name(name: &str) -> Result<(), String> {
    if name.trim().is_empty() || name.len() > 100 || name.chars().any(char::is_control) {
        return Err(format!("{name:?} must be 1 to 100 printable characters"));
    }
    Ok(())
}

/// The CloudEvents `source`: the one configured, else `/outbox/<database>/<table>`.
fn source(
    configured: Option<&str>,
    dbname: &str,
    table: &TableName,
) -> Result<String, &'static str> {
    match configured {
        Some(s) if s.trim().is_empty() => Err("must not be empty"),
        Some(s) => Ok(s.to_owned()),
        None => Ok(format!("/outbox/{dbname}/{table}")),
    }
}

/// The publisher each route override applies to: (key, `publisher.kind`, what it routes).
const ROUTE_KEYS: [(&str, &str, &str); 4] = [
    ("routing_key", "rabbitmq", "RabbitMQ"),
    ("topic", "kafka", "Kafka"),
    ("subject", "nats", "NATS"),
    ("stream", "redis", "Redis"),
];

/// The entry's routing override, if it sets one: at most one of `routing_key` (RabbitMQ),
/// `topic` (Kafka), `subject` (NATS) or `stream` (Redis), the one of this relay's publisher,
/// and a template (a NATS one that renders to a subject).
fn route(
    overrides: [(&str, Option<String>); 4],
    publisher: &PublisherConfig,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<Template>, ConfigError> {
    let mut set = overrides
        .into_iter()
        .filter_map(|(field, value)| Some((field, value?)));
    let Some((field, value)) = set.next() else {
        return Ok(None);
    };
    if let Some((second, _)) = set.next() {
        let all = ROUTE_KEYS
            .map(|(k, _, what)| format!("{k} ({what})"))
            .join(", ");
        return Err(ConfigError::invalid(
            key(second),
            format!("set one of {all}, not several ({field} is set too)"),
        ));
    }
    let wants = ROUTE_KEYS
        .iter()
        .find(|(k, ..)| *k == field)
        .map_or("", |(_, kind, _)| *kind);
    if publisher.kind() != wants {
        return Err(ConfigError::invalid(
            key(field),
            format!(
                "applies only with publisher.kind = \"{wants}\" (this relay publishes with {:?})",
                publisher.kind()
            ),
        ));
    }
    let template =
        Template::parse(&value).map_err(|e| ConfigError::invalid(key(field), e.to_string()))?;
    if field == "topic" {
        super::publisher::check_kafka_topic(&key(field), &template)?;
    }
    if field == "subject" {
        let sample = template.render(&crate::template::Fields {
            aggregate_type: "a",
            event_type: "e",
            aggregate_id: Some("i"),
        });
        super::nats::check_subject(&sample).map_err(|why| {
            ConfigError::invalid(
                key(field),
                format!("{value:?} does not render to a NATS subject: {why}"),
            )
        })?;
    }
    Ok(Some(template))
}

/// The same error under the entry's own key.
fn rename(e: ConfigError, key: String) -> ConfigError {
    match e {
        ConfigError::Invalid { reason, .. } => ConfigError::invalid(key, reason),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, load_str};

    const TWO: &str = "[publisher]\nkind = \"rabbitmq\"\n\
        [[outboxes]]\ntable = \"orders.outbox\"\n\
        [[outboxes]]\nname = \"billing\"\ntable = \"billing_outbox\"\n\
        url = \"postgres://u:secret@db2:5432/billing\"\nordering = \"none\"\n\
        source = \"/billing\"\nrouting_key = \"billing.{event_type}\"\n";

    #[test]
    fn entries_inherit_what_they_leave_out() {
        let c = load_str(&format!("[relay]\nordering = \"aggregate\"\n{TWO}"), &[]).unwrap();
        assert_eq!(c.outboxes.len(), 2);
        let (a, b) = (&c.outboxes[0], &c.outboxes[1]);
        assert_eq!(a.name, "orders.outbox");
        assert_eq!(a.database.url, c.database.url);
        assert_eq!(a.ordering, super::Ordering::Aggregate);
        assert_eq!(a.source, "/outbox/postgres/orders.outbox");
        assert!(a.route.is_none());
        assert_eq!(b.name, "billing");
        assert_eq!(b.database.table.qualified(), "billing_outbox");
        assert!(b.database.url.contains("db2"));
        assert_eq!(b.database.pool_size, c.database.pool_size);
        assert_eq!(b.ordering, super::Ordering::None);
        assert_eq!(b.source, "/billing");
        assert_eq!(b.route.as_ref().unwrap().as_str(), "billing.{event_type}");
    }

    #[test]
    fn a_nats_outbox_may_have_its_own_subject() {
        let nats = "[publisher]\nkind = \"nats\"\n[[outboxes]]\ntable = \"a\"\n";
        let c = load_str(
            &format!("{nats}subject = \"billing.{{event_type}}\"\n"),
            &[],
        )
        .unwrap();
        assert_eq!(
            c.outboxes[0].route.as_ref().unwrap().as_str(),
            "billing.{event_type}"
        );
        for (extra, want) in [
            (
                "subject = \"a b.{event_type}\"",
                "does not render to a NATS subject",
            ),
            ("subject = \"{nope}\"", "nope"),
            ("topic = \"t\"\nsubject = \"s\"", "not several"),
        ] {
            let e = err(&format!("{nats}{extra}\n"));
            assert!(
                e.starts_with("invalid value for outboxes[0].subject:") && e.contains(want),
                "{e}"
            );
        }
        let e = err("[[outboxes]]\ntable = \"a\"\nsubject = \"s\"\n");
        assert!(
            e.contains("applies only with publisher.kind = \"nats\""),
            "{e}"
        );
    }

    #[test]
    fn a_kafka_outboxs_topic_is_a_legal_name() {
        let kafka = "[publisher]\nkind = \"kafka\"\n[[outboxes]]\ntable = \"a\"\n";
        let c = load_str(&format!("{kafka}topic = \"billing.{{event_type}}\"\n"), &[]).unwrap();
        assert_eq!(
            c.outboxes[0].route.as_ref().unwrap().as_str(),
            "billing.{event_type}"
        );
        let e = err(&format!("{kafka}topic = \"billing events\"\n"));
        assert!(
            e.starts_with("invalid value for outboxes[0].topic:")
                && e.contains("not a valid Kafka topic name"),
            "{e}"
        );
    }

    #[test]
    fn a_redis_outbox_may_have_its_own_stream() {
        let redis = "[publisher]\nkind = \"redis\"\n[[outboxes]]\ntable = \"a\"\n";
        let c = load_str(
            &format!("{redis}stream = \"billing.{{event_type}}\"\n"),
            &[],
        )
        .unwrap();
        assert_eq!(
            c.outboxes[0].route.as_ref().unwrap().as_str(),
            "billing.{event_type}"
        );
        let e = err(&format!("{redis}stream = \"{{nope}}\"\n"));
        assert!(
            e.starts_with("invalid value for outboxes[0].stream:"),
            "{e}"
        );
        let e = err(&format!("{redis}stream = \"s\"\nrouting_key = \"r\"\n"));
        assert!(
            e.starts_with("invalid value for outboxes[0].stream:") && e.contains("not several"),
            "{e}"
        );
        let e = err("[[outboxes]]\ntable = \"a\"\nstream = \"s\"\n");
        assert!(
            e.starts_with(
                "invalid value for outboxes[0].stream: applies only with publisher.kind = \"redis\""
            ),
            "{e}"
        );
    }

    #[test]
    fn without_entries_the_database_table_is_the_one_outbox() {
        let c = load_str("[database]\ntable = \"app.events\"\n", &[]).unwrap();
        assert_eq!(c.outboxes.len(), 1);
        assert_eq!(c.outboxes[0].name, "app.events");
        assert_eq!(c.outboxes[0].source, c.relay.source);
        let c = load_str("", &[]).unwrap();
        assert_eq!(c.outboxes[0].name, "outbox_messages");
    }

    /// Each configuration is refused with an error that holds its text.
    fn rejected(cases: impl IntoIterator<Item = (String, &'static str)>) {
        for (toml, want) in cases {
            let e = err(&toml);
            assert!(e.contains(want), "{toml}\n=> {e}\n(wanted {want})");
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn outboxes_that_clash_are_refused_naming_both() {
        rejected([
            (
                format!("[database]\ntable = \"x\"\n{TWO}"),
                "invalid value for database.table: is set together with [[outboxes]]",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\n[[outboxes]]\ntable = \"a\"\n".to_owned(),
                "invalid value for outboxes[1].name: \"a\" is also the name of outboxes[0]",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\n[[outboxes]]\nname = \"b\"\ntable = \"a\"\n"
                    .to_owned(),
                "invalid value for outboxes[1].table: a in the same database is already served by outboxes[0]",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\n[[outboxes]]\nname = \"b\"\ntable = \"public.a\"\n"
                    .to_owned(),
                "invalid value for outboxes[1].table: public.a in the same database is already served by outboxes[0] (an unqualified name is the same table as the one in public)",
            ),
            (
                "[database]\nurl = \"mysql://root@127.0.0.1:3306/test\"\n\
                 [[outboxes]]\ntable = \"test.a\"\n[[outboxes]]\nname = \"b\"\ntable = \"a\"\n"
                    .to_owned(),
                "invalid value for outboxes[1].table: a in the same database is already served by outboxes[0] (an unqualified name is the same table as the one in test)",
            ),
        ]);
    }

    #[test]
    fn every_rejection_names_its_key() {
        rejected([
            (
                "[[outboxes]]\ntable = \"a;drop\"\n".to_owned(),
                "invalid value for outboxes[0].table:",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\nordering = \"fifo\"\n".to_owned(),
                "invalid value for outboxes[0].ordering: \"fifo\" is not one of",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\ntopic = \"t\"\n".to_owned(),
                "invalid value for outboxes[0].topic: applies only with publisher.kind = \"kafka\"",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\nrouting_key = \"{nope}\"\n".to_owned(),
                "invalid value for outboxes[0].routing_key:",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\nsource = \" \"\n".to_owned(),
                "invalid value for outboxes[0].source: must not be empty",
            ),
            (
                "[[outboxes]]\nname = \"\"\ntable = \"a\"\n".to_owned(),
                "invalid value for outboxes[0].name:",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\nurl = \"mysql://x\"\n".to_owned(),
                "invalid value for outboxes[0].url:",
            ),
            (
                "[[outboxes]]\ntable = \"a\"\ncolour = \"red\"\n".to_owned(),
                "colour",
            ),
            ("[[outboxes]]\nname = \"a\"\n".to_owned(), "table"),
        ]);
    }
}
