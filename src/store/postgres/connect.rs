//! Connections: the libpq URL (with the relay's `application_name`), TLS for
//! `sslmode=require`, the pool and the settings of every pooled session, the sessions given up
//! when a server turns read-only, and the statements of the wake-up listener's own session.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use super::claim::ClaimSql;
use super::maintenance::MaintenanceSql;
use super::observe::ObserveSql;
use super::operator::OperatorSql;
use super::settle::SettleSql;
use super::waiting::WaitingSql;
use super::{PgStore, Queries, Result, StoreError};
use crate::config::{DatabaseConfig, TableName};
use crate::message::APPLICATION_NAME;

/// Set on every pooled session, as plain `SET`s (so poolers such as PgBouncer accept them);
/// tools that replay the relay's statements (the benchmark's pgbench) set them too:
/// - `synchronous_commit = off`: the relay's own commits (claim, settle) need not wait for the
///   WAL flush. A database crash can undo the last fraction of a second of them; those rows
///   then go out again (at-least-once holds, duplicates stay bounded by `max_in_flight`). The
///   application's inserts keep the server's setting.
/// - `plan_cache_mode = force_generic_plan`: the claim statement's plan does not depend on its
///   parameters (it walks partial indexes), so planning it on every call is wasted work.
/// - `jit = off`: PostgreSQL compiles a statement whose estimated cost passes
///   `jit_above_cost` on every execution, a cached plan's too. The relay's statements are
///   short and run thousands of times a minute; a cost estimate that counts a rarely taken
///   branch as always taken (the ordered claim's probe past its hash of aggregates in flight)
///   made each claim spend 1.5 s compiling.
/// - `max_parallel_workers_per_gather = 0`: the relay's reads that walk many rows (the backlog
///   gauges' count of pending rows, the console's counts) run in one process. In parallel
///   they took more CPU in all (74 against 49 ms for the backlog gauges over 100,000 pending
///   rows) for no measurable gain in wall time, on cores the application's own statements
///   need.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    ("synchronous_commit", "off"),
    ("plan_cache_mode", "force_generic_plan"),
    ("jit", "off"),
    ("max_parallel_workers_per_gather", "0"),
];

/// The sessions to give up because a server refused a write as read-only: every session made
/// until the last such refusal. The pool closes them at their next checkout instead of reusing
/// them (a primary turned read-only keeps its sessions open, and a session, once made, never
/// looks for another server), and the LISTEN session starts over. Clones share the mark.
#[derive(Debug, Clone)]
pub struct StaleSessions(Arc<tokio::sync::watch::Sender<Option<Instant>>>);

impl Default for StaleSessions {
    fn default() -> Self {
        Self(Arc::new(tokio::sync::watch::Sender::new(None)))
    }
}

impl StaleSessions {
    /// Every session made until now is stale.
    pub fn mark(&self) {
        self.0.send_replace(Some(Instant::now()));
    }

    /// Whether a session made at `created` is stale.
    pub fn is_stale(&self, created: Instant) -> bool {
        self.0.borrow().is_some_and(|mark| created <= mark)
    }

    /// Changes with every [`StaleSessions::mark`] after this call.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Option<Instant>> {
        self.0.subscribe()
    }
}

impl PgStore {
    /// Builds the pool; connects lazily, so this succeeds while the database is down.
    pub fn new(cfg: &DatabaseConfig, instance_id: &str) -> Result<Self> {
        let pg = pg_config(&cfg.url)?;
        let mgr_cfg = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let mgr = if tls_required(&pg) {
            Manager::from_config(pg, make_tls()?, mgr_cfg)
        } else {
            Manager::from_config(pg, NoTls, mgr_cfg)
        };
        let stale = StaleSessions::default();
        let pool = Pool::builder(mgr)
            .max_size(cfg.pool_size)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_secs(5)))
            .wait_timeout(Some(Duration::from_secs(10)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .pre_recycle({
                let stale = stale.clone();
                deadpool_postgres::Hook::sync_fn(move |_, metrics| {
                    if stale.is_stale(metrics.created) {
                        Err(deadpool_postgres::HookError::message(
                            "made before the server refused a write as read-only",
                        ))
                    } else {
                        Ok(())
                    }
                })
            })
            .post_create(deadpool_postgres::Hook::async_fn(|client, _| {
                Box::pin(async move {
                    let set: Vec<String> = SESSION_SETTINGS
                        .iter()
                        .map(|(name, value)| format!("SET {name} = {value}"))
                        .collect();
                    client
                        .batch_execute(&set.join("; "))
                        .await
                        .map_err(deadpool_postgres::HookError::Backend)
                })
            }))
            .build()
            .map_err(|e| StoreError::Build(e.to_string()))?;
        let mut store =
            Self::with_pool(pool, stale, &cfg.table, instance_id, cfg.partition_interval);
        store.query_timeout = cfg.query_timeout;
        Ok(store)
    }

    /// Another table in the same database, sharing this store's pool (several outboxes in
    /// one database use one pool).
    pub fn for_table(&self, table: &TableName) -> Self {
        let mut store = Self::with_pool(
            self.pool.clone(),
            self.stale.clone(),
            table,
            &self.instance_id,
            self.partition_interval,
        );
        store.query_timeout = self.query_timeout;
        store
    }

    /// The store of `table` on `pool`; its settles are rendered for a partitioned table when
    /// `partition_interval` is set.
    fn with_pool(
        pool: Pool,
        stale: StaleSessions,
        table: &TableName,
        instance_id: &str,
        partition_interval: Option<std::time::Duration>,
    ) -> Self {
        Self {
            pool,
            stale,
            table: table.clone(),
            instance_id: instance_id.to_owned(),
            partition_interval,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            blocker_index: std::sync::Arc::default(),
            q: std::sync::Arc::new(Queries {
                claim: ClaimSql::new(table),
                settle: SettleSql::new(table, partition_interval.is_some()),
                observe: ObserveSql::new(table),
                waiting: WaitingSql::new(table),
                maintenance: MaintenanceSql::new(table),
                operator: OperatorSql::new(table),
            }),
        }
    }
}

/// Whether the URL asks for TLS (`sslmode=require`). `prefer` (libpq's default) connects
/// without TLS, so a server with a self-signed certificate keeps working out of the box.
pub fn tls_required(pg: &tokio_postgres::Config) -> bool {
    pg.get_ssl_mode() == tokio_postgres::config::SslMode::Require
}
/// TLS for `sslmode=require`: rustls, verifying the server against the system trust store.
pub fn make_tls() -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        // A certificate the store cannot parse is skipped, as libpq would.
        let _ = roots.add(cert);
    }
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Build(format!("TLS setup failed: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}
/// `database.query_timeout` of a store built without a configuration (see [`PgStore::new`]).
const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// TCP keepalive of every session unless the URL sets its own (`keepalives_idle`,
/// `keepalives_interval`, `keepalives_retries`, `tcp_user_timeout`): a peer that vanished (a
/// host down, a network partition) closes an idle session, LISTEN's included, after about a
/// minute rather than the system's two hours; data left unacknowledged for
/// [`TCP_USER_TIMEOUT`] closes it too. A peer that acknowledges but never answers is the
/// client-side deadlines' ([`Store::bounded`]).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_RETRIES: u32 = 3;
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// tokio-postgres's keepalive idle when not set: two hours.
const KEEPALIVE_IDLE_DEFAULT: Duration = Duration::from_secs(2 * 60 * 60);

/// Parses a libpq URL and names the session `outbox-relay` unless the URL names it; sets the
/// TCP keepalive and user timeout the URL leaves unset.
pub fn pg_config(url: &str) -> Result<tokio_postgres::Config> {
    let mut pg: tokio_postgres::Config = url
        .parse()
        .map_err(|e| StoreError::Build(format!("bad database URL: {e}")))?;
    if pg.get_application_name().is_none() {
        pg.application_name(APPLICATION_NAME);
    }
    pg.connect_timeout(Duration::from_secs(5));
    if pg.get_keepalives_idle() == KEEPALIVE_IDLE_DEFAULT {
        pg.keepalives_idle(KEEPALIVE_IDLE);
    }
    if pg.get_keepalives_interval().is_none() {
        pg.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if pg.get_keepalives_retries().is_none() {
        pg.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if pg.get_tcp_user_timeout().is_none() {
        pg.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    Ok(pg)
}
/// `LISTEN` on the table's NOTIFY channel, for the wake-up listener's own session.
pub fn listen_sql(channel: &str) -> String {
    format!("LISTEN \"{channel}\"")
}
/// The session's backend pid (the listener's, named in the relay's waiting record).
pub const BACKEND_PID_SQL: &str = "SELECT pg_backend_pid()";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_named_unless_the_url_names_them() {
        let pg = pg_config("postgres://u@h/db").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pg.get_application_name(), Some(APPLICATION_NAME));
        assert!(!tls_required(&pg));
        let pg = pg_config("postgres://u@h/db?application_name=mine&sslmode=require")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pg.get_application_name(), Some("mine"));
        assert!(tls_required(&pg));
    }

    #[test]
    fn sessions_keep_alive_unless_the_url_says_otherwise() {
        let pg = pg_config("postgres://u@h/db").unwrap_or_else(|e| panic!("{e}"));
        assert!(pg.get_keepalives());
        assert_eq!(pg.get_keepalives_idle(), KEEPALIVE_IDLE);
        assert_eq!(pg.get_keepalives_interval(), Some(KEEPALIVE_INTERVAL));
        assert_eq!(pg.get_keepalives_retries(), Some(KEEPALIVE_RETRIES));
        assert_eq!(pg.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        let url = "postgres://u@h/db?keepalives_idle=600&keepalives_retries=9&tcp_user_timeout=120";
        let pg = pg_config(url).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pg.get_keepalives_idle(), Duration::from_secs(600));
        assert_eq!(pg.get_keepalives_retries(), Some(9));
        assert_eq!(pg.get_tcp_user_timeout(), Some(&Duration::from_secs(120)));
    }

    #[test]
    fn a_bad_url_is_a_build_error_without_the_password() {
        let e = pg_config("postgres://u:hunter2@h:notaport/db")
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, StoreError::Build(_)), "{e}");
    }

    #[test]
    fn sessions_made_before_a_read_only_refusal_are_stale() {
        let stale = StaleSessions::default();
        let before = Instant::now();
        assert!(!stale.is_stale(before), "nothing is stale before a refusal");
        let listener = stale.subscribe();
        stale.clone().mark();
        assert!(stale.is_stale(before), "clones share the mark");
        assert!(!stale.is_stale(Instant::now() + Duration::from_millis(1)));
        assert!(
            listener.has_changed().unwrap_or(false),
            "the LISTEN session is told"
        );
    }

    #[test]
    fn listen_quotes_the_channel() {
        assert_eq!(listen_sql("app.events"), "LISTEN \"app.events\"");
    }
}
