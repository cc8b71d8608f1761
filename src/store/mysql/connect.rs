//! Connections: the `mysql://` URL with its TLS options (`ssl-mode`, `ssl-ca`, as the MySQL
//! clients spell them), the pool, and the settings of every pooled session.

use std::sync::Arc;
use std::time::Duration;

use mysql_async::{Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts, SslOpts};

use super::claim::ClaimSql;
use super::operator::OperatorSql;
use super::settle::SettleSql;
use super::{MysqlStore, Queries, Result, StoreError};
use crate::config::{DatabaseConfig, TableName};
use crate::redact::redact_url;

/// Run on every new pooled session:
/// - READ COMMITTED: InnoDB takes no gap locks for the relay's locking reads and updates, so
///   an application's `INSERT` (an insert-intention lock on a gap) never waits for the relay;
/// - time zone UTC: `TIMESTAMP` columns read as UTC;
/// - short lock waits: the relay's statements skip or probe locked rows (`SKIP LOCKED`,
///   `NOWAIT`); a wait longer than this is a conflict to retry, not a queue to join.
pub const SESSION_SETTINGS: &[&str] = &[
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
    "SET time_zone = '+00:00'",
    "SET SESSION innodb_lock_wait_timeout = 5",
    "SET SESSION lock_wait_timeout = 5",
];

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

/// Splits `url` into the options mysql_async reads and the TLS options it does not
/// (`ssl-mode`, `ssl-ca`), and builds the connection options.
pub(super) fn opts(url: &str) -> Result<Opts> {
    let bad = |why: String| StoreError::Build(format!("{}: {why}", redact_url(url)));
    let mut parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
    let mut mode = SslMode::Off;
    let mut ca: Option<String> = None;
    let mut rest: Vec<(String, String)> = Vec::new();
    for (k, v) in parsed.query_pairs() {
        match k.to_ascii_lowercase().replace('_', "-").as_str() {
            "ssl-mode" | "sslmode" => {
                mode = match v.to_ascii_uppercase().replace('-', "_").as_str() {
                    "DISABLED" | "DISABLE" | "PREFERRED" | "PREFER" => SslMode::Off,
                    "REQUIRED" | "REQUIRE" => SslMode::Required,
                    "VERIFY_CA" => SslMode::VerifyCa,
                    "VERIFY_IDENTITY" | "VERIFY_FULL" => SslMode::VerifyIdentity,
                    other => {
                        return Err(bad(format!(
                            "ssl-mode={other} is not one of DISABLED, PREFERRED, REQUIRED, VERIFY_CA, VERIFY_IDENTITY"
                        )));
                    }
                }
            }
            "ssl-ca" | "sslrootcert" => ca = Some(v.into_owned()),
            _ => rest.push((k.into_owned(), v.into_owned())),
        }
    }
    if rest.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(rest);
    }
    let base = Opts::from_url(parsed.as_str()).map_err(|e| bad(e.to_string()))?;
    let ssl = match mode {
        SslMode::Off => None,
        SslMode::Required => Some(
            SslOpts::default()
                .with_danger_accept_invalid_certs(true)
                .with_danger_skip_domain_validation(true),
        ),
        SslMode::VerifyCa => Some(SslOpts::default().with_danger_skip_domain_validation(true)),
        SslMode::VerifyIdentity => Some(SslOpts::default()),
    };
    let ssl = match (ssl, ca) {
        (Some(s), Some(ca)) => Some(s.with_root_certs(vec![std::path::PathBuf::from(ca).into()])),
        (Some(s), None) => Some(s),
        (None, Some(_)) => {
            return Err(bad(
                "ssl-ca is set but ssl-mode asks for no TLS: add ssl-mode=VERIFY_CA or VERIFY_IDENTITY"
                    .into(),
            ));
        }
        (None, None) => None,
    };
    Ok(OptsBuilder::from_opts(base).ssl_opts(ssl).into())
}

impl MysqlStore {
    /// Builds the pool; connects lazily, so this succeeds while the database is down.
    pub fn new(cfg: &DatabaseConfig, instance_id: &str) -> Result<Self> {
        let base = opts(&cfg.url)?;
        let constraints = PoolConstraints::new(0, cfg.pool_size.max(1))
            .ok_or_else(|| StoreError::Build("database.pool_size out of range".into()))?;
        let pool_opts = PoolOpts::default()
            .with_constraints(constraints)
            // Session settings are made once per connection (below), not after every use.
            .with_reset_connection(false)
            .with_inactive_connection_ttl(Duration::from_secs(60));
        let opts = OptsBuilder::from_opts(base)
            .pool_opts(pool_opts)
            .init(SESSION_SETTINGS.to_vec())
            .tcp_keepalive(Some(Duration::from_secs(10)))
            .stmt_cache_size(64);
        let opts: Opts = opts.into();
        let pool = Pool::new(opts.clone());
        let mut store = Self::with_pool(pool, opts, &cfg.table, instance_id);
        store.query_timeout = cfg.query_timeout;
        Ok(store)
    }

    /// Another table in the same database, sharing this store's pool.
    pub fn for_table(&self, table: &TableName) -> Self {
        let mut store = Self::with_pool(
            self.pool.clone(),
            self.opts.clone(),
            table,
            &self.instance_id,
        );
        store.query_timeout = self.query_timeout;
        store
    }

    fn with_pool(pool: Pool, opts: Opts, table: &TableName, instance_id: &str) -> Self {
        Self {
            pool,
            opts,
            query_timeout: Duration::from_secs(30),
            table: table.clone(),
            instance_id: instance_id.to_owned(),
            q: Arc::new(Queries {
                claim: ClaimSql::new(table),
                settle: SettleSql::new(table),
                operator: OperatorSql::new(table),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_options_are_read_and_taken_out_of_the_url() {
        let o = opts("mysql://u:p@127.0.0.1:3306/db").unwrap_or_else(|e| panic!("{e}"));
        assert!(o.ssl_opts().is_none());
        assert_eq!(o.db_name(), Some("db"));
        let o = opts("mysql://u:p@127.0.0.1:3306/db?ssl-mode=REQUIRED")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(o.ssl_opts().is_some_and(SslOpts::accept_invalid_certs));
        let o = opts("mysql://u:p@127.0.0.1/db?ssl-mode=VERIFY_IDENTITY&ssl-ca=/tmp/ca.pem")
            .unwrap_or_else(|e| panic!("{e}"));
        let ssl = o.ssl_opts().unwrap_or_else(|| panic!("TLS expected"));
        assert!(!ssl.accept_invalid_certs() && !ssl.skip_domain_validation());
        assert_eq!(ssl.root_certs().len(), 1);
    }

    #[test]
    fn bad_ssl_options_are_named_and_the_password_is_not() {
        let e = opts("mysql://u:secret@h/db?ssl-mode=SOMETIMES")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("ssl-mode=SOMETIMES") && !e.contains("secret"),
            "{e}"
        );
        let e = opts("mysql://u:secret@h/db?ssl-ca=/x.pem")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("ssl-ca") && !e.contains("secret"), "{e}");
    }
}
