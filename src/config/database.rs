//! `[database]`: the database URL (PostgreSQL or MySQL/MariaDB), the pool and the outbox
//! table's name.

use serde::{Deserialize, Serialize};

use super::{ConfigError, HumanDuration};

/// `database.table` when not set.
pub const DEFAULT_TABLE: &str = "outbox_messages";
use mysql_async::{Opts, OptsBuilder, SslOpts};

use crate::redact::redact_url;

/// `[database]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDatabase {
    /// Database URL: `postgres://user:pass@host:port/db?sslmode=...`, or
    /// `mysql://user:pass@host:port/db?ssl-mode=...` for MySQL and MariaDB.
    pub url: String,
    /// Connections in the pool (default 8).
    pub pool_size: usize,
    /// Outbox table, optionally schema-qualified (default `outbox_messages`).
    pub table: Option<String>,
    /// Apply `sql/` at start (default false; the shipped relay.toml sets true).
    pub auto_migrate: bool,
    /// Partition the table by `created_at` in ranges this long (at least 1m, whole minutes);
    /// unset: one plain table.
    #[serde(default)]
    pub partition_interval: Option<HumanDuration>,
    /// How long the relay waits for the database's answer to one of its statements before it
    /// counts the connection as lost (default 30s).
    pub query_timeout: HumanDuration,
}

impl Default for RawDatabase {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            pool_size: 8,
            table: None,
            auto_migrate: false,
            partition_interval: None,
            query_timeout: super::dur("30s"),
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
        // Derived object names (`<name>_next_seq`, `<name>_aggregate_idx`) must fit in 63 bytes.
        if name.len() > 40 {
            return Err(format!(
                "{name:?} is longer than 40 characters (names of its index and functions are derived from it)"
            ));
        }
        validate_identifier(name)?;
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

/// PostgreSQL's reserved key words (`pg_get_keywords()`, categories R and T, of PostgreSQL 16):
/// the relay writes table names unquoted, so none of these can name a table.
const PG_RESERVED: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

impl TableName {
    /// [`TableName::parse`], then [`TableName::check_reserved`] for the database `kind`.
    pub fn parse_for(raw: &str, kind: DatabaseKind) -> Result<Self, String> {
        let table = Self::parse(raw)?;
        table.check_reserved(kind)?;
        Ok(table)
    }

    /// Refuses a name PostgreSQL reserves (`check`, `order`, `user`): every statement would
    /// fail on it. (MySQL's are found when `migrate` or `check` first reaches the server.)
    pub fn check_reserved(&self, kind: DatabaseKind) -> Result<(), String> {
        if kind != DatabaseKind::Postgres {
            return Ok(());
        }
        for part in self.schema.iter().chain(std::iter::once(&self.name)) {
            if PG_RESERVED.contains(&part.to_ascii_lowercase().as_str()) {
                return Err(format!(
                    "{part:?} is a reserved word in PostgreSQL, which the relay's unquoted SQL cannot use as a name: pick another"
                ));
            }
        }
        Ok(())
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

/// Which database an outbox lives in, from its URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatabaseKind {
    /// PostgreSQL 13+ (`postgres://`, `postgresql://` or a key=value connection string).
    Postgres,
    /// MySQL 8.0.1+ or MariaDB 10.6+ (`mysql://`).
    Mysql,
}

/// The scheme of `url` (`postgres`, `mysql`, …), if it has one (`None` for a key=value
/// connection string).
fn url_scheme(url: &str) -> Option<&str> {
    url.trim_start().split_once("://").map(|(scheme, _)| scheme)
}

impl DatabaseKind {
    /// The kind a URL names: `mysql://` is MySQL/MariaDB, anything else PostgreSQL.
    pub fn of(url: &str) -> Self {
        if url_scheme(url).is_some_and(|s| s.eq_ignore_ascii_case("mysql")) {
            Self::Mysql
        } else {
            Self::Postgres
        }
    }
}

/// How the URL asks for TLS (`ssl-mode`, as the `mysql` client's `--ssl-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SslMode {
    /// No TLS (`DISABLED`, and `PREFERRED`, the default: a server with a self-signed
    /// certificate keeps working out of the box).
    Off,
    /// TLS, any certificate (`REQUIRED`).
    Required,
    /// TLS, a certificate signed by a trusted CA (`VERIFY_CA`).
    VerifyCa,
    /// TLS, a trusted certificate for the host name (`VERIFY_IDENTITY`).
    VerifyIdentity,
}

/// The connection options of a `mysql://` URL: mysql_async's own query parameters, plus the
/// TLS options it does not read (`ssl-mode`, `ssl-ca`, as the MySQL clients spell them). The
/// error says what is wrong with it, without the URL (which may hold a password).
///
/// The connection goes over TCP to the URL's host, as the URL says, unless it asks for
/// `prefer_socket=true` (mysql_async would otherwise move a connection to 127.0.0.1 onto the
/// server's Unix socket).
pub fn mysql_opts(url: &str) -> Result<Opts, String> {
    let mut parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
    let mut mode = SslMode::Off;
    let mut ca: Option<String> = None;
    let mut rest: Vec<(String, String)> = Vec::new();
    let mut socket_chosen = false;
    for (k, v) in parsed.query_pairs() {
        match k.to_ascii_lowercase().replace('_', "-").as_str() {
            "ssl-mode" | "sslmode" => mode = SslMode::parse(&v)?,
            "ssl-ca" | "sslrootcert" => ca = Some(v.into_owned()),
            // The pool is database.pool_size's: the driver's own bounds would clash with it.
            "pool-min" | "pool-max" => {
                return Err(format!(
                    "{k} in the URL: the relay sizes its pool with database.pool_size; remove it"
                ));
            }
            key => {
                socket_chosen |= key == "prefer-socket";
                rest.push((k.into_owned(), v.into_owned()));
            }
        }
    }
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    let base = Opts::from_url(parsed.as_str()).map_err(|e| e.to_string())?;
    let mut builder = OptsBuilder::from_opts(base).ssl_opts(mode.ssl_opts(ca)?);
    // The driver takes the host as written, brackets and all, and looks `[::1]` up as a name:
    // an IPv6 literal is given without them.
    if let Some(url::Host::Ipv6(ip)) = parsed.host() {
        builder = builder.ip_or_hostname(ip.to_string());
    }
    Ok(if socket_chosen {
        builder
    } else {
        builder.prefer_socket(false)
    }
    .into())
}

impl SslMode {
    /// An `ssl-mode` value, as the `mysql` client spells it (case and `-`/`_` aside).
    fn parse(value: &str) -> Result<Self, String> {
        Ok(
            match value.to_ascii_uppercase().replace('-', "_").as_str() {
                "DISABLED" | "DISABLE" | "PREFERRED" | "PREFER" => Self::Off,
                "REQUIRED" | "REQUIRE" => Self::Required,
                "VERIFY_CA" => Self::VerifyCa,
                "VERIFY_IDENTITY" | "VERIFY_FULL" => Self::VerifyIdentity,
                other => {
                    return Err(format!(
                        "ssl-mode={other} is not one of DISABLED, PREFERRED, REQUIRED, VERIFY_CA, VERIFY_IDENTITY"
                    ));
                }
            },
        )
    }

    /// The driver's TLS options for this mode, trusting `ca` too when given.
    fn ssl_opts(self, ca: Option<String>) -> Result<Option<SslOpts>, String> {
        let ssl = match self {
            Self::Off => None,
            Self::Required => Some(
                SslOpts::default()
                    .with_danger_accept_invalid_certs(true)
                    .with_danger_skip_domain_validation(true),
            ),
            Self::VerifyCa => Some(SslOpts::default().with_danger_skip_domain_validation(true)),
            Self::VerifyIdentity => Some(SslOpts::default()),
        };
        match (ssl, ca) {
            (Some(s), Some(ca)) => Ok(Some(
                s.with_root_certs(vec![std::path::PathBuf::from(ca).into()]),
            )),
            (ssl, None) => Ok(ssl),
            (None, Some(_)) => Err(
                "ssl-ca is set but ssl-mode asks for no TLS: add ssl-mode=VERIFY_CA or VERIFY_IDENTITY"
                    .into(),
            ),
        }
    }
}

/// Checks a database URL (`key` is the configuration key it came from, for the error) and
/// returns the name of its database (the default CloudEvents source's).
pub(super) fn database_name(key: &str, url: &str) -> Result<String, ConfigError> {
    let key = key.to_owned();
    match DatabaseKind::of(url) {
        DatabaseKind::Postgres => {
            let pg: tokio_postgres::Config = url.parse().map_err(|e| {
                let foreign = url_scheme(url).is_some_and(|scheme| {
                    !["postgres", "postgresql"]
                        .iter()
                        .any(|s| scheme.eq_ignore_ascii_case(s))
                });
                let hint = if foreign {
                    " (the relay takes postgres:// or postgresql:// for PostgreSQL, mysql:// for MySQL and MariaDB)"
                } else {
                    ""
                };
                ConfigError::invalid(
                    key.clone(),
                    format!("{} is not a PostgreSQL URL: {e}{hint}", redact_url(url)),
                )
            })?;
            Ok(pg.get_dbname().unwrap_or("postgres").to_owned())
        }
        DatabaseKind::Mysql => {
            let opts = mysql_opts(url).map_err(|e| {
                ConfigError::invalid(
                    key.clone(),
                    format!("{} is not a MySQL URL: {e}", redact_url(url)),
                )
            })?;
            match opts.db_name() {
                Some(db) if !db.is_empty() => Ok(db.to_owned()),
                _ => Err(ConfigError::invalid(
                    key,
                    format!(
                        "{} names no database: write mysql://user:password@host:3306/<database>",
                        redact_url(url)
                    ),
                )),
            }
        }
    }
}

/// The validated `[database]` section.
#[derive(Debug, Clone)]
pub struct DatabaseConfig {
    /// Connection URL (may hold a password: log only [`DatabaseConfig::redacted_url`]).
    pub url: String,
    /// PostgreSQL or MySQL, from the URL.
    pub kind: DatabaseKind,
    /// Pool size.
    pub pool_size: usize,
    /// Outbox table.
    pub table: TableName,
    /// Apply migrations at start.
    pub auto_migrate: bool,
    /// The partitions' width, when the table is partitioned (see `store::partitions`).
    pub partition_interval: Option<std::time::Duration>,
    /// How long a statement may go unanswered before the connection counts as lost.
    pub query_timeout: std::time::Duration,
}

impl DatabaseConfig {
    /// The URL with its password masked.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }
}

impl RawDatabase {
    /// Checks the section; also returns the URL's database name (the default CloudEvents
    /// source's).
    pub(super) fn validate(self) -> Result<(DatabaseConfig, String), ConfigError> {
        let d = self;
        if d.url.trim().is_empty() {
            return Err(ConfigError::invalid("database.url", "must not be empty"));
        }
        let dbname = database_name("database.url", &d.url)?;
        let kind = DatabaseKind::of(&d.url);
        if d.pool_size < 2 || d.pool_size > 1000 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                format!("{} is out of range (2..=1000)", d.pool_size),
            ));
        }
        let table = TableName::parse_for(d.table.as_deref().unwrap_or(DEFAULT_TABLE), kind)
            .map_err(|r| ConfigError::invalid("database.table", r))?;
        let partition_interval = d.partition_interval.map(|i| i.0);
        if let Some(i) = partition_interval
            && (i < std::time::Duration::from_secs(60)
                || i.subsec_nanos() != 0
                || i.as_secs() % 60 != 0)
        {
            return Err(ConfigError::invalid(
                "database.partition_interval",
                format!(
                    "{} is not a whole number of minutes of at least 1m (e.g. \"1h\", \"1d\")",
                    humantime::format_duration(i)
                ),
            ));
        }

        if kind == DatabaseKind::Mysql && partition_interval.is_some() {
            return Err(not_on_mysql());
        }
        super::positive("database.query_timeout", d.query_timeout)?;
        Ok((
            DatabaseConfig {
                url: d.url,
                kind,
                pool_size: d.pool_size,
                table,
                auto_migrate: d.auto_migrate,
                partition_interval,
                query_timeout: d.query_timeout.0,
            },
            dbname,
        ))
    }
}

/// `database.partition_interval` set for a MySQL outbox.
pub(super) fn not_on_mysql() -> ConfigError {
    ConfigError::invalid(
        "database.partition_interval",
        "partitioned outboxes are PostgreSQL only; on MySQL/MariaDB retention deletes sent rows in batches: remove the key",
    )
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, err_has, rejects};
    use super::*;

    #[test]
    fn an_ipv6_host_is_an_address_not_a_name() {
        let o = mysql_opts("mysql://root@[::1]:3307/test").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.ip_or_hostname(), "::1");
        assert_eq!(o.tcp_port(), 3307);
        let o = mysql_opts("mysql://root@localhost:3307/test").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.ip_or_hostname(), "localhost");
    }

    #[test]
    fn ssl_options_are_read_and_taken_out_of_the_url() {
        let o = mysql_opts("mysql://u:p@127.0.0.1:3306/db").unwrap_or_else(|e| panic!("{e}"));
        assert!(o.ssl_opts().is_none());
        assert_eq!(o.db_name(), Some("db"));
        let o = mysql_opts("mysql://u:p@127.0.0.1:3306/db?ssl-mode=REQUIRED")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(o.ssl_opts().is_some_and(SslOpts::accept_invalid_certs));
        let o = mysql_opts("mysql://u:p@127.0.0.1/db?ssl-mode=VERIFY_IDENTITY&ssl-ca=/tmp/ca.pem")
            .unwrap_or_else(|e| panic!("{e}"));
        let ssl = o.ssl_opts().unwrap_or_else(|| panic!("TLS expected"));
        assert!(!ssl.accept_invalid_certs() && !ssl.skip_domain_validation());
        assert_eq!(ssl.root_certs().len(), 1);
    }

    #[test]
    fn bad_ssl_options_are_named_and_the_password_is_not() {
        let e = mysql_opts("mysql://u:secret@h/db?ssl-mode=SOMETIMES")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("ssl-mode=SOMETIMES") && !e.contains("secret"),
            "{e}"
        );
        let e = mysql_opts("mysql://u:secret@h/db?ssl-ca=/x.pem")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("ssl-ca") && !e.contains("secret"), "{e}");
    }

    #[test]
    fn hostile_table_name_is_rejected() {
        err_has(
            "[database]\ntable = \"x; drop table y\"\n",
            &["database.table", "identifier"],
            &[],
        );
        assert!(err("[database]\ntable = \"a.b.c\"\n").contains("database.table"));
        assert!(err("[database]\ntable = \"1abc\"\n").contains("database.table"));
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

    #[test]
    fn partition_interval_is_whole_minutes_of_at_least_one() {
        for bad in ["30s", "90s", "0s", "1m 500ms"] {
            rejects(
                &format!("[database]\npartition_interval = \"{bad}\"\n"),
                "invalid value for database.partition_interval",
            );
        }
        let c = super::super::tests::load_str("[database]\npartition_interval = \"1h\"\n", &[])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.database.partition_interval,
            Some(std::time::Duration::from_secs(3600))
        );
    }

    #[test]
    fn each_rejection_names_its_key() {
        rejects(
            "[database]\nurl = \" \"\n",
            "invalid value for database.url: must not be empty",
        );
        rejects(
            "[database]\nurl = \"postgres://h:x/db\"\n",
            "invalid value for database.url: postgres://h:x/db is not a PostgreSQL URL",
        );
        rejects(
            "[database]\ntable = \"check\"\n",
            "invalid value for database.table: \"check\" is a reserved word in PostgreSQL",
        );
        rejects(
            "[database]\ntable = \"User.events\"\n",
            "invalid value for database.table: \"User\" is a reserved word in PostgreSQL",
        );
        crate::config::tests::err_has(
            "[database]\nurl = \"mysql://root@127.0.0.1:3306/test?pool_max=2\"\n",
            &["database.url", "pool_max in the URL", "database.pool_size"],
            &[],
        );
        let long = "t".repeat(70);
        rejects(
            &format!("[database]\ntable = \"{long}\"\n"),
            &format!("invalid value for database.table: \"{long}\" is longer than 40 characters"),
        );
        crate::config::tests::err_has(
            "[database]\nurl = \"mariadb://root@127.0.0.1:3306/test\"\n",
            &["database.url", "mysql:// for MySQL and MariaDB"],
            &[],
        );
        rejects(
            "[database]\npool_size = 1\n",
            "invalid value for database.pool_size: 1 is out of range (2..=1000)",
        );
        rejects(
            "[database]\npool_size = 1001\n",
            "invalid value for database.pool_size: 1001 is out of range (2..=1000)",
        );
        rejects(
            "[database]\nquery_timeout = \"0s\"\n",
            "invalid value for database.query_timeout: must be greater than zero",
        );
        let long = "t".repeat(41);
        err_has(
            &format!("[database]\ntable = \"{long}\"\n"),
            &["database.table", "longer than 40"],
            &[],
        );
    }
}
