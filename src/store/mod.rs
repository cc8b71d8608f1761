//! PostgreSQL: every query the relay runs lives here (claim, settle, reclaim, the ordering
//! watermark's observations, migrations, status and dead-letter tools).
//!
//! Claiming is a state change (`pending` → `processing`) committed before anything is
//! published, so no row lock is ever held across a call to the broker. Settling only touches
//! rows still locked by this instance, so a row whose lease was reclaimed by another relay is
//! never overwritten.

pub mod schema;

use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;
use tokio_postgres::types::{FromSql, Type};
use uuid::Uuid;

use crate::config::{DatabaseConfig, Ordering, TableName};
use crate::message::{APPLICATION_NAME, OutboxMessage, PayloadKind};

/// A database failure; none of these carry the connection URL.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be had from the pool (database down, pool exhausted, timeout).
    #[error("cannot get a database connection: {}", chain(.0))]
    Pool(#[from] deadpool_postgres::PoolError),
    /// A statement failed.
    #[error("database error: {}", chain(.0))]
    Db(#[from] tokio_postgres::Error),
    /// The schema is missing or not what the relay expects.
    #[error("{0}")]
    Schema(String),
    /// The URL could not be turned into a pool.
    #[error("cannot build the connection pool: {0}")]
    Build(String),
    /// Some ids given to a dead-letter command are not dead letters; nothing was changed.
    #[error("not dead letters (nothing was changed): {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    NotDeadLetters(Vec<Uuid>),
}

/// An error and its causes, `outer: inner: innermost` (tokio-postgres hides the cause of
/// connection and TLS failures behind a generic message).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

impl StoreError {
    /// Whether the error is a lost or refused connection rather than a bad statement.
    pub fn is_connection(&self) -> bool {
        match self {
            Self::Pool(_) => true,
            Self::Db(e) => e.is_closed() || e.code().is_none(),
            Self::Schema(_) | Self::Build(_) | Self::NotDeadLetters(_) => false,
        }
    }
}

/// Short alias for store results.
pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Raw bytes of a `jsonb`, `json`, `bytea` or `text` column: the payload as it goes on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawBytes(pub(crate) Vec<u8>);

impl<'a> FromSql<'a> for RawBytes {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // jsonb's binary form is a version byte (1) followed by the JSON text.
            match raw.split_first() {
                Some((1, text)) => Ok(Self(text.to_vec())),
                _ => Err("unsupported jsonb binary version".into()),
            }
        } else {
            Ok(Self(raw.to_vec()))
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::JSONB | Type::JSON | Type::BYTEA | Type::TEXT | Type::VARCHAR
        )
    }
}

/// A row that passed its deadline before it could be published (see [`Store::claim_and_expire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// Row id.
    pub id: Uuid,
    /// Aggregate type (for logs).
    pub aggregate_type: String,
}

/// What one claim round did: rows to publish, and rows that expired instead.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Claimed rows (now `processing`), in `seq` order.
    pub rows: Vec<OutboxMessage>,
    /// Rows moved to `expired` (or deleted, retention 0) by the sweep before the claim.
    pub expired: Vec<Expired>,
}

/// A message-level failure to record: back off, or dead-letter when out of attempts.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Row id.
    pub id: Uuid,
    /// Why it failed (stored in `last_error`).
    pub error: String,
    /// Delay before the next attempt.
    pub delay: Duration,
}

/// What [`Store::fail`] did with the failures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailOutcome {
    /// Rows scheduled for another attempt.
    pub retried: u64,
    /// Rows moved to `failed`.
    pub dead_lettered: Vec<Uuid>,
}

/// One observation for the ordering watermark (see [`crate::watermark`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WriterSnapshot {
    /// Transactions (xid as text) that hold a lock on the outbox table, other than relays.
    pub writers: Vec<String>,
    /// Age in seconds of the oldest of those transactions.
    pub oldest_writer_age: Option<f64>,
}

/// `last_error` prefix of rows reclaimed from a relay that died while holding them.
const SUSPECT: &str = "lease expired:";
const NOT_SUSPECT: &str = "(last_error IS NULL OR last_error NOT LIKE 'lease expired:%')";
const NOT_SUSPECT_C: &str = "(c.last_error IS NULL OR c.last_error NOT LIKE 'lease expired:%')";
/// Rows whose deadline has passed are never claimed, even in the moment before the expiry
/// sweep marks them (a heap filter on rows the claim reads anyway: free when no row expires).
const NOT_DUE: &str = "(expires_at IS NULL OR expires_at > now())";
const NOT_DUE_C: &str = "(c.expires_at IS NULL OR c.expires_at > now())";
/// An earlier row that still holds back its aggregate: anything but `sent` and `expired`.
/// Spelled as the predicate of the `<table>_open_idx` partial index, so the planner uses it.
const OPEN_E: &str = "e.status NOT IN ('sent', 'expired')";
const OPEN_H: &str = "h.status NOT IN ('sent', 'expired')";

// Claims update `WHERE t.id = ANY(ARRAY(SELECT id FROM <picked>))` rather than joining the
// picked ids: with a join the generic plan estimated the row count from LIMIT $1 and hashed the
// whole table (a sequential scan per claim, 46 ms at 100k rows); the array form always probes
// the primary key.
const RETURNING: &str = "t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, \
                         t.headers, t.destination, t.attempts, t.created_at, t.expires_at";

/// The relay's hot-path statements for `table`, as the relay sends them, for tools that replay
/// them outside the relay (the benchmark's pgbench ceiling): like `migrate --print` for the
/// DDL. Parameters stay `$n` placeholders, documented per statement.
#[derive(Debug, Clone)]
pub struct HotPathSql {
    /// The claim with `ordering = "none"`: `$1` batch size, `$2` instance id; returns the
    /// claimed rows.
    pub claim: String,
    /// Marking confirmed rows sent: `$1` ids (`uuid[]`), `$2` instance id.
    pub mark_sent: String,
}

/// Renders [`HotPathSql`] for `table`.
pub fn hot_path_sql(table: &TableName) -> HotPathSql {
    let q = Queries::new(table);
    HotPathSql {
        claim: q.claim_none,
        mark_sent: q.mark_sent,
    }
}

/// The SQL text of every statement, rendered once for the configured table.
#[derive(Debug, Clone)]
struct Queries {
    claim_none: String,
    claim_suspect: String,
    suspects_waiting: String,
    claim_aggregate: String,
    expire: String,
    expire_delete: String,
    mark_sent: String,
    delete_sent: String,
    fail: String,
    release: String,
    reclaim: String,
    heartbeat: String,
    last_seq: String,
    writers: String,
    backlog: String,
    status: String,
    blocked_by_type: String,
    dead_letters: String,
    retry_dead: String,
    discard_dead: String,
    cleanup: String,
    mark_waiting: String,
    unmark_waiting: String,
    writers_active: String,
    clean_waiters: String,
    has_waiters: String,
    table_health: String,
    vacuum: String,
}

impl Queries {
    fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let seq = table.prefixed("_seq");
        let waiters = table.prefixed("_waiters");
        // A ready row reclaimed from a dead relay that is the head of its aggregate (or has
        // none) and at or below the watermark (`$W`).
        let suspect_where = format!(
            "c.status = 'pending' AND c.available_at <= now() AND c.last_error LIKE '{SUSPECT}%' \
             AND {NOT_DUE_C} \
             AND (c.aggregate_id IS NULL OR (c.seq <= $W AND NOT EXISTS ( \
               SELECT 1 FROM {t} e WHERE e.aggregate_type = c.aggregate_type \
                 AND e.aggregate_id = c.aggregate_id AND {OPEN_E} AND e.seq < c.seq)))"
        );
        let suspect = suspect_where.replace("$W", "$1");
        let suspect_2 = suspect_where.replace("$W", "$2");
        Self {
            // $1 batch size, $2 instance id.
            claim_none: format!(
                "WITH cand AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND available_at <= now() AND {NOT_SUSPECT} AND {NOT_DUE} \
                   ORDER BY seq LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $2, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
                 RETURNING {RETURNING}"
            ),
            // One row that was held by a relay that died (a suspect of the crash), claimed on its
            // own so that a row which kills the relay spends only its own attempts, never those
            // of rows that happened to share its batch. $1 instance id, $2 watermark.
            // $1 watermark. The same rows claim_suspect would take.
            suspects_waiting: format!("SELECT EXISTS (SELECT 1 FROM {t} c WHERE {suspect})"),
            claim_suspect: format!(
                "WITH cand AS ( \
                   SELECT c.id FROM {t} c WHERE {suspect_2} \
                   ORDER BY c.seq LIMIT 1 \
                   FOR UPDATE OF c SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $1, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
                 RETURNING {RETURNING}"
            ),
            // $1 batch size, $2 instance id, $3 watermark (highest seq that is final), $4 scan window.
            //
            // Candidates skip aggregates whose head (first unsent row) is not ready (in flight
            // elsewhere, backing off or dead), so a long blocked aggregate cannot fill the scan
            // window and starve the others. Aggregates with a row in flight (`busy`, from the
            // small processing index, hashed) are skipped before that per-row head probe: in a
            // steady drain most blocked rows are behind an in-flight head, and a hash lookup
            // costs a fraction of an index probe (bench: a claim over 98k blocked rows went
            // from 480 ms to 26 ms). `busy` is capped so that it stays hashable; aggregates left
            // out of it fall through to the head probe, which decides alone.
            // A candidate is claimable when every unsent row of its aggregate with a smaller seq
            // is itself a candidate locked by this statement (so the whole run goes to one
            // relay, published in seq order) — checked per candidate against the gap to the
            // previous candidate of its aggregate, then required along the whole chain.
            // Candidates that another relay holds are skipped (SKIP LOCKED), which leaves a gap
            // and so blocks everything after them: no two relays ever hold one aggregate.
            claim_aggregate: format!(
                "WITH busy AS MATERIALIZED ( \
                   SELECT DISTINCT b.aggregate_type, b.aggregate_id FROM {t} b \
                   WHERE b.status = 'processing' AND b.aggregate_id IS NOT NULL \
                   LIMIT 10000), \
                 cand AS ( \
                   SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id FROM {t} c \
                   WHERE c.status = 'pending' AND c.available_at <= now() AND {NOT_SUSPECT_C} \
                     AND {NOT_DUE_C} \
                     AND (c.aggregate_id IS NULL OR (c.seq <= $3 \
                       AND (c.aggregate_type, c.aggregate_id) NOT IN (SELECT * FROM busy) AND ( \
                       SELECT h.status = 'pending' AND h.available_at <= now() FROM {t} h \
                       WHERE h.aggregate_type = c.aggregate_type AND h.aggregate_id = c.aggregate_id \
                         AND {OPEN_H} ORDER BY h.seq LIMIT 1))) \
                   ORDER BY c.seq LIMIT $4 \
                   FOR UPDATE OF c SKIP LOCKED), \
                 ranked AS ( \
                   SELECT c.*, lag(c.seq) OVER (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.seq) AS prev_seq \
                   FROM cand c), \
                 checked AS ( \
                   SELECT r.id, r.seq, r.aggregate_type, r.aggregate_id, \
                     (r.aggregate_id IS NULL OR NOT EXISTS ( \
                        SELECT 1 FROM {t} e \
                        WHERE e.aggregate_type = r.aggregate_type AND e.aggregate_id = r.aggregate_id \
                          AND {OPEN_E} AND e.seq < r.seq \
                          AND (r.prev_seq IS NULL OR e.seq > r.prev_seq))) AS free \
                   FROM ranked r), \
                 chained AS ( \
                   SELECT id, seq, bool_and(free) OVER (PARTITION BY aggregate_type, aggregate_id ORDER BY seq) AS ok \
                   FROM checked), \
                 picked AS ( \
                   SELECT id FROM chained WHERE ok ORDER BY seq LIMIT $1) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $2, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM picked)) \
                 RETURNING {RETURNING}"
            ),
            // Pending rows past their deadline become `expired` (or are deleted, retention 0),
            // oldest deadline first, through the small `<table>_expiry_idx`. Rows in flight
            // are not touched: a row claimed before its deadline is published. $1 batch size.
            expire: format!(
                "WITH due AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= now() \
                   ORDER BY expires_at LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'expired', locked_by = NULL, locked_at = NULL, \
                   last_error = 'expired: its deadline ' \
                     || to_char(t.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') \
                     || ' passed before it was published (after ' || t.attempts || ' attempts)' \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
                 RETURNING t.id, t.aggregate_type"
            ),
            expire_delete: format!(
                "WITH due AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= now() \
                   ORDER BY expires_at LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 DELETE FROM {t} AS t WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
                 RETURNING t.id, t.aggregate_type"
            ),
            // $1 ids, $2 instance id.
            mark_sent: format!(
                "UPDATE {t} SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL, last_error = NULL \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            delete_sent: format!(
                "DELETE FROM {t} WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // $1 ids, $2 errors, $3 delays (ms), $4 instance id, $5 max attempts.
            fail: format!(
                "UPDATE {t} AS t SET \
                   status = CASE WHEN t.attempts >= $5 THEN 'failed' ELSE 'pending' END, \
                   available_at = CASE WHEN t.attempts >= $5 THEN t.available_at \
                                  ELSE now() + f.delay_ms * interval '1 millisecond' END, \
                   last_error = f.error, locked_by = NULL, locked_at = NULL \
                 FROM unnest($1::uuid[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms) \
                 WHERE t.id = f.id AND t.status = 'processing' AND t.locked_by = $4 \
                 RETURNING t.id, t.status"
            ),
            // Hand back without spending the attempt the claim counted. $1 ids, $2 instance id.
            release: format!(
                "UPDATE {t} SET status = 'pending', attempts = greatest(attempts - 1, 0), \
                   locked_by = NULL, locked_at = NULL \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // Keeps this relay's leases alive while it waits for a slow broker, so only a relay
            // that stopped ever has its rows reclaimed. Only the ids the relay tracks: a row
            // claimed in its name whose answer was lost must expire. $1 ids, $2 instance id.
            heartbeat: format!(
                "UPDATE {t} SET locked_at = now() \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // Rows whose lease expired: the claim already spent their attempt. $1 lease (ms), $2 max attempts.
            reclaim: format!(
                "UPDATE {t} SET \
                   status = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, \
                   last_error = '{SUSPECT} relay ' || coalesce(locked_by, '?') || ' stopped while holding the row', \
                   available_at = now(), locked_by = NULL, locked_at = NULL \
                 WHERE status = 'processing' AND locked_at < now() - $1::bigint * interval '1 millisecond' \
                 RETURNING id, status"
            ),
            status: format!(
                "SELECT aggregate_type, \
                   count(*) FILTER (WHERE status = 'pending' AND available_at <= now()), \
                   count(*) FILTER (WHERE status = 'pending' AND available_at > now()), \
                   count(*) FILTER (WHERE status = 'processing'), \
                   count(*) FILTER (WHERE status = 'sent'), \
                   count(*) FILTER (WHERE status = 'failed'), \
                   coalesce(extract(epoch FROM now() - min(created_at) FILTER (WHERE status IN ('pending', 'processing'))), 0)::float8, \
                   count(*) FILTER (WHERE status = 'expired') \
                 FROM {t} GROUP BY aggregate_type ORDER BY aggregate_type"
            ),
            blocked_by_type: format!(
                "SELECT aggregate_type, count(DISTINCT aggregate_id) FROM {t} f \
                 WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND NOT EXISTS ( \
                   SELECT 1 FROM {t} e WHERE e.aggregate_type = f.aggregate_type \
                     AND e.aggregate_id = f.aggregate_id AND {OPEN_E} AND e.seq < f.seq) \
                 GROUP BY aggregate_type"
            ),
            // $1 limit.
            dead_letters: format!(
                "SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, available_at \
                 FROM {t} WHERE status = 'failed' ORDER BY seq LIMIT $1"
            ),
            // $1 ids, $2 all.
            retry_dead: format!(
                "UPDATE {t} SET status = 'pending', attempts = 0, available_at = now() \
                 WHERE status = 'failed' AND ($2 OR id = ANY($1)) RETURNING id"
            ),
            discard_dead: format!(
                "DELETE FROM {t} WHERE status = 'failed' AND ($2 OR id = ANY($1)) RETURNING id"
            ),
            // $1 retention (ms), $2 batch size. Short statements: no long locks on the table.
            // Expired rows are kept as long after their deadline as sent rows after sending.
            cleanup: format!(
                "DELETE FROM {t} WHERE id IN ( \
                   (SELECT id FROM {t} WHERE status = 'sent' AND sent_at < now() - $1::bigint * interval '1 millisecond' \
                    ORDER BY sent_at LIMIT $2) \
                   UNION ALL \
                   (SELECT id FROM {t} WHERE status = 'expired' AND expires_at < now() - $1::bigint * interval '1 millisecond' \
                    ORDER BY expires_at LIMIT $2) \
                   LIMIT $2)"
            ),
            last_seq: format!("SELECT last_value, is_called FROM {seq}"),
            // The wake-up (schema version 3): an idle relay's row makes the insert trigger
            // NOTIFY. $1 instance id, $2 LISTEN backend pid, $3 lifetime (ms).
            mark_waiting: format!(
                "INSERT INTO {waiters} (relay, pid, alive_until) \
                 VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond') \
                 ON CONFLICT (relay) DO UPDATE SET pid = EXCLUDED.pid, alive_until = EXCLUDED.alive_until"
            ),
            // $1 instance id.
            unmark_waiting: format!("DELETE FROM {waiters} WHERE relay = $1"),
            // $1 the table's oid. Whether a transaction that may still commit rows is running:
            // it may have passed its wake-up check before this relay marked itself waiting.
            writers_active:
                "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'relation' AND l.relation = $1 AND l.granted \
                        AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
                        AND a.application_name NOT LIKE 'outbox-relay%')"
                    .to_owned(),
            // Rows of relays whose LISTEN session is gone (they died), or long expired.
            clean_waiters: format!(
                "DELETE FROM {waiters} w WHERE w.alive_until < now() - interval '1 minute' \
                 OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)"
            ),
            has_waiters: format!("SELECT to_regclass('{waiters}') IS NOT NULL"),
            // $1 the table's oid. Dead tuples and vacuum history of the table; whether
            // autovacuum may run on it (server setting and the table's own option).
            table_health: "SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0), \
                   extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8, \
                   current_setting('autovacuum') = 'on' \
                     AND coalesce((SELECT option_value FROM pg_options_to_table(c.reloptions) \
                                   WHERE option_name = 'autovacuum_enabled'), 'true')::bool, \
                   pg_total_relation_size(c.oid), \
                   pg_has_role(c.relowner, 'MEMBER') \
                     OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
                   EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid) \
                 FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid \
                 WHERE c.oid = $1"
                .to_owned(),
            // No truncation: it takes an ACCESS EXCLUSIVE lock at the end of the table, which
            // would stall inserts and claims (and is replayed on standbys).
            vacuum: format!("VACUUM (ANALYZE, TRUNCATE false) {t}"),
            // Cheap on a large table: each part walks a partial index. The oldest unsent row is
            // approximated by the lowest seq among pending and processing rows. A ready row's
            // age counts from when it became ready (its insert, or the end of its backoff).
            backlog: format!(
                "SELECT p.ready, p.waiting, \
                   (SELECT coalesce(extract(epoch FROM now() - least( \
                       (SELECT created_at FROM {t} WHERE status = 'pending' ORDER BY seq LIMIT 1), \
                       (SELECT min(created_at) FROM {t} WHERE status = 'processing'))), 0)::float8), \
                   (SELECT count(*) FROM {t} WHERE status = 'failed'), \
                   (SELECT count(*) FROM (SELECT DISTINCT f.aggregate_type, f.aggregate_id FROM {t} f \
                      WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND NOT EXISTS ( \
                        SELECT 1 FROM {t} e WHERE e.aggregate_type = f.aggregate_type \
                          AND e.aggregate_id = f.aggregate_id AND {OPEN_E} AND e.seq < f.seq)) b), \
                   p.ready_age, p.waiting_age \
                 FROM (SELECT count(*) FILTER (WHERE available_at <= now()) AS ready, \
                         count(*) FILTER (WHERE available_at > now()) AS waiting, \
                         coalesce(extract(epoch FROM now() - min(greatest(created_at, available_at)) \
                           FILTER (WHERE available_at <= now())), 0)::float8 AS ready_age, \
                         coalesce(extract(epoch FROM now() - min(created_at) \
                           FILTER (WHERE available_at > now())), 0)::float8 AS waiting_age \
                       FROM {t} WHERE status = 'pending') p"
            ),
            // $1 the table's oid. Transactions that hold a lock on the table and may still commit
            // rows; the relay's own sessions (application_name outbox-relay…) never insert.
            writers:
                "SELECT a.backend_xid::text, extract(epoch FROM now() - a.xact_start)::float8 \
                      FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'relation' AND l.relation = $1 AND l.granted \
                        AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
                        AND a.application_name NOT LIKE 'outbox-relay%'"
                    .to_owned(),
        }
    }
}

/// The table's schema as found in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaState {
    /// The outbox table exists.
    pub table_exists: bool,
    /// Versions `migrate` would apply, in order (every one when the table does not exist).
    pub pending: Vec<i32>,
}

struct Current {
    table_exists: bool,
    version: i32,
}

/// The version the table is at: the recorded one, or 0 when the table does not exist (so
/// that a dropped table is created again) or nothing was recorded.
async fn current_version<C: deadpool_postgres::GenericClient + Sync>(
    client: &C,
    table: &TableName,
) -> Result<Current> {
    let key = table.qualified();
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, \
                    to_regclass('outbox_relay_schema_version') IS NOT NULL",
            &[&key],
        )
        .await?;
    let (table_exists, recorded): (bool, bool) = (row.get(0), row.get(1));
    let version = if table_exists && recorded {
        client
            .query_opt(
                "SELECT version FROM outbox_relay_schema_version WHERE table_name = $1",
                &[&key],
            )
            .await?
            .map_or(0, |r| r.get(0))
    } else {
        0
    };
    Ok(Current {
        table_exists,
        version,
    })
}

/// The outbox table and its connection pool.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    table: TableName,
    instance_id: String,
    q: std::sync::Arc<Queries>,
}

/// Set on every pooled session (plain `SET`s, so poolers such as PgBouncer accept them):
/// - `synchronous_commit = off`: the relay's own commits (claim, settle) need not wait for the
///   WAL flush. A database crash can undo the last fraction of a second of them; those rows
///   then go out again (at-least-once holds, duplicates stay bounded by `max_in_flight`). The
///   application's inserts keep the server's setting.
/// - `plan_cache_mode = force_generic_plan`: the claim statement's plan does not depend on its
///   parameters (it walks partial indexes), so planning it on every call is wasted work.
const SESSION_SETTINGS: &str =
    "SET synchronous_commit = off; SET plan_cache_mode = force_generic_plan";

impl Store {
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
        let pool = Pool::builder(mgr)
            .max_size(cfg.pool_size)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_secs(5)))
            .wait_timeout(Some(Duration::from_secs(10)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .post_create(deadpool_postgres::Hook::async_fn(|client, _| {
                Box::pin(async move {
                    client
                        .batch_execute(SESSION_SETTINGS)
                        .await
                        .map_err(deadpool_postgres::HookError::Backend)
                })
            }))
            .build()
            .map_err(|e| StoreError::Build(e.to_string()))?;
        Ok(Self {
            pool,
            table: cfg.table.clone(),
            instance_id: instance_id.to_owned(),
            q: std::sync::Arc::new(Queries::new(&cfg.table)),
        })
    }

    /// The configured table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// This relay's `locked_by` value.
    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// A pooled connection (for callers such as tests and CLI tools).
    pub async fn client(&self) -> Result<deadpool_postgres::Object> {
        Ok(self.pool.get().await?)
    }

    /// Round trip to the database.
    pub async fn ping(&self) -> Result<()> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// Applies pending migrations under an advisory lock; returns the versions applied.
    ///
    /// What is pending is decided by what exists, not only by what was recorded: when the
    /// table is missing (never created, or dropped since) every file is applied again (they
    /// are idempotent), whatever `outbox_relay_schema_version` says.
    pub async fn migrate(&self) -> Result<Vec<i32>> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('outbox-relay:migrate'))",
            &[],
        )
        .await?;
        tx.batch_execute(schema::VERSION_TABLE_DDL).await?;
        let key = self.table.qualified();
        let current = current_version(&tx, &self.table).await?.version;
        if let Some(schema) = &self.table.schema {
            tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
        let mut applied = Vec::new();
        for m in schema::MIGRATIONS.iter().filter(|m| m.version > current) {
            tx.batch_execute(&schema::render(m.sql, &self.table))
                .await?;
            applied.push(m.version);
        }
        if let Some(&version) = applied.last() {
            tx.execute(
                "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, $2) \
                 ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()",
                &[&key, &version],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(applied)
    }

    /// Whether the table exists and which schema versions `migrate` would apply, read
    /// without changing anything (for `check` and the start-up decision).
    pub async fn schema_state(&self) -> Result<SchemaState> {
        let client = self.client().await?;
        let current = current_version(&client, &self.table).await?;
        Ok(SchemaState {
            table_exists: current.table_exists,
            pending: schema::MIGRATIONS
                .iter()
                .map(|m| m.version)
                .filter(|&v| v > current.version)
                .collect(),
        })
    }

    /// Checks that the table exists and returns its payload kind and oid.
    pub async fn inspect(&self) -> Result<(PayloadKind, u32)> {
        let client = self.client().await?;
        let t = self.table.qualified();
        let row = client
            .query_opt(
                "SELECT c.oid, format_type(a.atttypid, a.atttypmod), EXISTS ( \
                   SELECT 1 FROM pg_attribute x WHERE x.attrelid = c.oid \
                     AND x.attname = 'expires_at' AND NOT x.attisdropped) \
                 FROM pg_class c LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'payload' \
                 WHERE c.oid = to_regclass($1)",
                &[&t],
            )
            .await?
            .ok_or_else(|| {
                StoreError::Schema(format!(
                    "table {t} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true"
                ))
            })?;
        let oid: u32 = row.try_get(0)?;
        let ty: Option<String> = row.try_get(1)?;
        let has_expiry: bool = row.try_get(2)?;
        if !has_expiry {
            // Every claim would fail on the missing column (and look like a database outage).
            return Err(StoreError::Schema(format!(
                "table {t} predates schema version 2 (no expires_at column): run `outbox-relay migrate`, \
                 or set database.auto_migrate = true"
            )));
        }
        let kind = match ty.as_deref() {
            Some("jsonb" | "json") => PayloadKind::Json,
            Some("bytea") => PayloadKind::Binary,
            Some(other) => {
                return Err(StoreError::Schema(format!(
                    "{t}.payload has type {other}; the relay supports jsonb, json and bytea"
                )));
            }
            None => return Err(StoreError::Schema(format!("{t} has no payload column"))),
        };
        Ok((kind, oid))
    }

    /// Expires the pending rows whose deadline has passed (marked `expired`, never published),
    /// then claims up to `limit` ready rows as [`Store::claim_and_expire`] does with expired
    /// rows kept; returns the claimed rows only.
    pub async fn claim(
        &self,
        ordering: Ordering,
        limit: usize,
        watermark: i64,
    ) -> Result<Vec<OutboxMessage>> {
        Ok(self
            .claim_and_expire(ordering, limit, watermark, false)
            .await?
            .rows)
    }

    /// Expires pending rows past their deadline (up to `limit`; deleted instead when
    /// `delete_expired`, retention 0), then claims up to `limit` ready rows. With
    /// [`Ordering::Aggregate`], only rows at or below `watermark` (for rows with an aggregate
    /// id) whose earlier open rows all come along.
    ///
    /// The two statements are pipelined on one connection and run in the order sent, so the
    /// claim already sees the rows just expired as no longer holding back their aggregates;
    /// with no deadline in the table the sweep is one probe of an empty partial index, in the
    /// claim's round trip.
    pub async fn claim_and_expire(
        &self,
        ordering: Ordering,
        limit: usize,
        watermark: i64,
        delete_expired: bool,
    ) -> Result<Claim> {
        let client = self.client().await?;
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let expire = client
            .prepare_cached(if delete_expired {
                &self.q.expire_delete
            } else {
                &self.q.expire
            })
            .await?;
        let expire_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&limit];
        let (expired, rows) = match ordering {
            Ordering::None => {
                let stmt = client.prepare_cached(&self.q.claim_none).await?;
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
                    [&limit, &self.instance_id];
                tokio::join!(
                    client.query(&expire, &expire_params),
                    client.query(&stmt, &params)
                )
            }
            Ordering::Aggregate => {
                let stmt = client.prepare_cached(&self.q.claim_aggregate).await?;
                let scan = limit.saturating_mul(4).max(1000);
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                    [&limit, &self.instance_id, &watermark, &scan];
                tokio::join!(
                    client.query(&expire, &expire_params),
                    client.query(&stmt, &params)
                )
            }
        };
        let expired = expired?
            .iter()
            .map(|r| {
                Ok(Expired {
                    id: r.try_get(0)?,
                    aggregate_type: r.try_get(1)?,
                })
            })
            .collect::<Result<Vec<_>, tokio_postgres::Error>>()?;
        let mut rows = rows?
            .iter()
            .map(message_of)
            .collect::<Result<Vec<_>, tokio_postgres::Error>>()?;
        rows.sort_unstable_by_key(|m| m.seq);
        Ok(Claim { rows, expired })
    }

    /// Whether a row reclaimed from a dead relay is ready to be claimed (see `SUSPECT`).
    pub async fn suspects_waiting(&self, watermark: i64) -> Result<bool> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.suspects_waiting).await?;
        Ok(client.query_one(&stmt, &[&watermark]).await?.try_get(0)?)
    }

    /// Claims one row that a dead relay held (see `SUSPECT`), if any is ready; it is then
    /// published in a batch of its own.
    pub async fn claim_suspect(&self, watermark: i64) -> Result<Option<OutboxMessage>> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim_suspect).await?;
        let row = client
            .query_opt(&stmt, &[&self.instance_id, &watermark])
            .await?;
        Ok(row.as_ref().map(message_of).transpose()?)
    }

    /// Marks confirmed rows `sent`, or deletes them when `delete` (retention 0).
    pub async fn mark_sent(&self, ids: &[Uuid], delete: bool) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let sql = if delete {
            &self.q.delete_sent
        } else {
            &self.q.mark_sent
        };
        let stmt = client.prepare_cached(sql).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Records message-level failures: back to `pending` after `delay`, or `failed` once the
    /// row has used `max_attempts`.
    pub async fn fail(&self, failures: &[Failure], max_attempts: u32) -> Result<FailOutcome> {
        if failures.is_empty() {
            return Ok(FailOutcome::default());
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<i64> = failures
            .iter()
            .map(|f| i64::try_from(f.delay.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.fail).await?;
        let rows = client
            .query(&stmt, &[&ids, &errors, &delays, &self.instance_id, &max])
            .await?;
        let mut out = FailOutcome::default();
        for r in rows {
            let status: &str = r.try_get(1)?;
            if status == "failed" {
                out.dead_lettered.push(r.try_get(0)?);
            } else {
                out.retried += 1;
            }
        }
        Ok(out)
    }

    /// Hands rows back to `pending` without spending an attempt (connection-level failure,
    /// shutdown, or rows never published because an earlier row of their aggregate failed).
    pub async fn release(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.release).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Renews the leases of `ids` where this instance still holds them; returns how many.
    pub async fn heartbeat(&self, ids: &[Uuid]) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.heartbeat).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Returns `processing` rows whose lease expired to `pending` (or `failed` when out of
    /// attempts). Returns (reclaimed, dead-lettered).
    pub async fn reclaim_expired(&self, lease: Duration, max_attempts: u32) -> Result<(u64, u64)> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.reclaim).await?;
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let rows = client.query(&stmt, &[&lease_ms, &max]).await?;
        let failed = rows
            .iter()
            .filter(|r| r.get::<_, &str>(1) == "failed")
            .count() as u64;
        Ok((rows.len() as u64 - failed, failed))
    }

    /// One observation for the ordering guard: the highest `seq` drawn so far (committed or
    /// not), then the transactions that hold a lock on the outbox table and might still commit
    /// rows. The two statements are pipelined on one connection, which the server runs in the
    /// order sent: the sequence is read strictly before the locks (see [`crate::watermark`]).
    pub async fn observe(&self, table_oid: u32) -> Result<(i64, WriterSnapshot)> {
        let client = self.client().await?;
        let seq_stmt = client.prepare_cached(&self.q.last_seq).await?;
        let writers_stmt = client.prepare_cached(&self.q.writers).await?;
        let oid_param: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let (seq_row, rows) = tokio::join!(
            client.query_one(&seq_stmt, &[]),
            client.query(&writers_stmt, &oid_param)
        );
        let seq_row = seq_row?;
        let last: i64 = seq_row.try_get(0)?;
        let called: bool = seq_row.try_get(1)?;
        let last = if called { last } else { last - 1 };
        let rows = rows?;
        let mut writers = Vec::with_capacity(rows.len());
        let mut oldest: Option<f64> = None;
        for r in rows {
            writers.push(r.try_get::<_, String>(0)?);
            let age: Option<f64> = r.try_get(1)?;
            if let Some(age) = age {
                oldest = Some(oldest.map_or(age, |o| o.max(age)));
            }
        }
        writers.sort_unstable();
        writers.dedup();
        Ok((
            last,
            WriterSnapshot {
                writers,
                oldest_writer_age: oldest,
            },
        ))
    }
}

/// The outbox table's health as PostgreSQL's statistics see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableHealth {
    /// `pg_stat_user_tables.n_dead_tup`.
    pub dead_tuples: i64,
    /// `pg_stat_user_tables.n_live_tup`.
    pub live_tuples: i64,
    /// Seconds since the last vacuum (manual or auto), if any.
    pub since_vacuum: Option<f64>,
    /// Whether autovacuum may run on the table (server `autovacuum` and the table's option).
    pub autovacuum: bool,
    /// Table + indexes + TOAST, bytes.
    pub total_bytes: i64,
    /// Whether this session may vacuum the table (owner or superuser).
    pub may_vacuum: bool,
    /// Whether a vacuum of the table (autovacuum or another relay's) is running now.
    pub vacuum_running: bool,
}

impl Store {
    /// Whether the table has the wake-up of schema version 3 (`<table>_waiters`).
    pub async fn has_waiters(&self) -> Result<bool> {
        let client = self.client().await?;
        Ok(client
            .query_one(&self.q.has_waiters, &[])
            .await?
            .try_get(0)?)
    }

    /// Records that this relay is idle and LISTENing on the backend `pid`, for `lifetime`: until
    /// then (or [`Store::unmark_waiting`]) every inserting transaction NOTIFYs once.
    pub async fn mark_waiting(&self, pid: i32, lifetime: Duration) -> Result<()> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.mark_waiting).await?;
        let ms = i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX);
        client
            .execute(&stmt, &[&self.instance_id, &pid, &ms])
            .await?;
        Ok(())
    }

    /// [`Store::mark_waiting`], then [`Store::writers_active`] once the record is committed,
    /// pipelined on one connection (one round trip; the server runs them in order).
    pub async fn mark_waiting_then_writers(
        &self,
        pid: i32,
        lifetime: Duration,
        table_oid: u32,
    ) -> Result<bool> {
        let client = self.client().await?;
        let mark = client.prepare_cached(&self.q.mark_waiting).await?;
        let writers = client.prepare_cached(&self.q.writers_active).await?;
        let ms = i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX);
        let oid: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let mark_params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&self.instance_id, &pid, &ms];
        let (marked, active) = tokio::join!(
            client.execute(&mark, &mark_params),
            client.query_one(&writers, &oid)
        );
        marked?;
        Ok(active?.try_get(0)?)
    }

    /// This relay is busy: inserts stop notifying on its account.
    pub async fn unmark_waiting(&self) -> Result<()> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.unmark_waiting).await?;
        client.execute(&stmt, &[&self.instance_id]).await?;
        Ok(())
    }

    /// Whether a transaction that may still commit rows (one holding a lock on the table) is
    /// running, other than the relays' own.
    pub async fn writers_active(&self, table_oid: u32) -> Result<bool> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.writers_active).await?;
        let oid: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        Ok(client.query_one(&stmt, &oid).await?.try_get(0)?)
    }

    /// Deletes the waiting marks of relays whose LISTEN session has ended; returns how many.
    pub async fn clean_waiters(&self) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.clean_waiters).await?;
        Ok(client.execute(&stmt, &[]).await?)
    }

    /// Dead tuples, size and autovacuum state of the table.
    pub async fn table_health(&self, table_oid: u32) -> Result<TableHealth> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.table_health).await?;
        let oid: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let r = client.query_one(&stmt, &oid).await?;
        Ok(TableHealth {
            dead_tuples: r.try_get(0)?,
            live_tuples: r.try_get(1)?,
            since_vacuum: r.try_get(2)?,
            autovacuum: r.try_get(3)?,
            total_bytes: r.try_get(4)?,
            may_vacuum: r.try_get(5)?,
            vacuum_running: r.try_get(6)?,
        })
    }

    /// Runs a plain `VACUUM (ANALYZE)` of the table on a pooled connection outside any
    /// transaction. It takes a SHARE UPDATE EXCLUSIVE lock, which claims, settles and inserts
    /// do not conflict with.
    pub async fn vacuum(&self) -> Result<()> {
        let client = self.client().await?;
        client.batch_execute(&self.q.vacuum).await?;
        Ok(())
    }
}

impl Store {
    /// The backlog gauges: pending (ready / waiting), oldest unsent, ready and waiting ages,
    /// dead letters, blocked aggregates.
    pub async fn backlog(&self) -> Result<crate::telemetry::Backlog> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.backlog).await?;
        let r = client.query_one(&stmt, &[]).await?;
        Ok(crate::telemetry::Backlog {
            ready: r.try_get(0)?,
            waiting: r.try_get(1)?,
            oldest_pending_age: r.try_get(2)?,
            failed: r.try_get(3)?,
            blocked_aggregates: r.try_get(4)?,
            oldest_ready_age: r.try_get(5)?,
            oldest_waiting_age: r.try_get(6)?,
        })
    }
}

/// Row counts for `status` (contract §6).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StatusCounts {
    /// `ready + waiting`.
    pub pending: i64,
    /// Pending and available now.
    pub ready: i64,
    /// Pending, waiting for a retry.
    pub waiting: i64,
    /// Claimed, not yet settled.
    pub processing: i64,
    /// Confirmed (and not yet removed by retention).
    pub sent: i64,
    /// Dead letters.
    pub failed: i64,
    /// Past their deadline before they could be published (and not yet removed by retention).
    pub expired: i64,
    /// Age of the oldest unsent (pending or processing) row.
    pub oldest_pending_age_seconds: f64,
    /// Aggregates whose earliest unsent row is `failed`.
    pub blocked_aggregates: i64,
}

impl StatusCounts {
    fn add(&mut self, o: &StatusCounts) {
        self.pending += o.pending;
        self.ready += o.ready;
        self.waiting += o.waiting;
        self.processing += o.processing;
        self.sent += o.sent;
        self.failed += o.failed;
        self.expired += o.expired;
        self.oldest_pending_age_seconds = self
            .oldest_pending_age_seconds
            .max(o.oldest_pending_age_seconds);
        self.blocked_aggregates += o.blocked_aggregates;
    }
}

/// `status --json`: overall counts plus the same per aggregate type.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct StatusReport {
    /// Totals.
    #[serde(flatten)]
    pub overall: StatusCounts,
    /// Per `aggregate_type`.
    pub by_aggregate_type: std::collections::BTreeMap<String, StatusCounts>,
}

/// One row of `dead-letters list`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeadLetter {
    /// Row id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Attempts used.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// Insert time.
    pub created_at: DateTime<Utc>,
    /// When the last attempt was scheduled.
    pub available_at: DateTime<Utc>,
}

/// Which dead letters an operator command applies to.
#[derive(Debug, Clone)]
pub enum Selection {
    /// These ids (ids that are not dead letters are left alone).
    Ids(Vec<Uuid>),
    /// Every dead letter.
    All,
}

impl Store {
    /// Counts by status, overall and per aggregate type.
    pub async fn status(&self) -> Result<StatusReport> {
        let client = self.client().await?;
        let rows = client.query(&self.q.status, &[]).await?;
        let blocked = client.query(&self.q.blocked_by_type, &[]).await?;
        let mut report = StatusReport::default();
        for r in rows {
            let ready: i64 = r.try_get(1)?;
            let waiting: i64 = r.try_get(2)?;
            let counts = StatusCounts {
                pending: ready + waiting,
                ready,
                waiting,
                processing: r.try_get(3)?,
                sent: r.try_get(4)?,
                failed: r.try_get(5)?,
                expired: r.try_get(7)?,
                oldest_pending_age_seconds: r.try_get(6)?,
                blocked_aggregates: 0,
            };
            report.by_aggregate_type.insert(r.try_get(0)?, counts);
        }
        for r in blocked {
            let ty: String = r.try_get(0)?;
            let n: i64 = r.try_get(1)?;
            report
                .by_aggregate_type
                .entry(ty)
                .or_default()
                .blocked_aggregates = n;
        }
        for c in report.by_aggregate_type.values() {
            report.overall.add(c);
        }
        Ok(report)
    }

    /// Dead letters in `seq` order.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        let client = self.client().await?;
        let rows = client.query(&self.q.dead_letters, &[&limit]).await?;
        rows.iter()
            .map(|r| {
                Ok(DeadLetter {
                    id: r.try_get(0)?,
                    seq: r.try_get(1)?,
                    aggregate_type: r.try_get(2)?,
                    aggregate_id: r.try_get(3)?,
                    event_type: r.try_get(4)?,
                    attempts: r.try_get(5)?,
                    last_error: r.try_get(6)?,
                    created_at: r.try_get(7)?,
                    available_at: r.try_get(8)?,
                })
            })
            .collect()
    }

    /// Sets dead letters back to `pending` with attempts reset (keeping `last_error`); returns
    /// the ids changed.
    pub async fn retry_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead(&self.q.retry_dead, sel).await
    }

    /// Deletes dead letters; returns the ids removed.
    pub async fn discard_dead_letters(&self, sel: &Selection) -> Result<Vec<Uuid>> {
        self.apply_dead(&self.q.discard_dead, sel).await
    }

    /// Deletes up to `batch` `sent` rows older than `retention`; returns how many.
    pub async fn cleanup_batch(&self, retention: Duration, batch: usize) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.cleanup).await?;
        let ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        Ok(client.execute(&stmt, &[&ms, &batch]).await?)
    }

    /// Applies `sql` to the selected dead letters in one transaction: when any given id is
    /// not a dead letter, nothing is changed.
    async fn apply_dead(&self, sql: &str, sel: &Selection) -> Result<Vec<Uuid>> {
        let (ids, all) = match sel {
            Selection::Ids(ids) => (ids.clone(), false),
            Selection::All => (Vec::new(), true),
        };
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let rows = tx.query(sql, &[&ids, &all]).await?;
        let changed = rows
            .iter()
            .map(|r| r.try_get(0))
            .collect::<Result<Vec<Uuid>, _>>()?;
        let missing: Vec<Uuid> = ids
            .iter()
            .filter(|id| !changed.contains(id))
            .copied()
            .collect();
        if !missing.is_empty() {
            tx.rollback().await?;
            return Err(StoreError::NotDeadLetters(missing));
        }
        tx.commit().await?;
        Ok(changed)
    }
}

fn message_of(r: &tokio_postgres::Row) -> Result<OutboxMessage, tokio_postgres::Error> {
    Ok(OutboxMessage {
        id: r.try_get(0)?,
        seq: r.try_get(1)?,
        aggregate_type: r.try_get(2)?,
        aggregate_id: r.try_get(3)?,
        event_type: r.try_get(4)?,
        payload: r.try_get::<_, RawBytes>(5)?.0,
        headers: r.try_get::<_, RawBytes>(6)?.0,
        destination: r.try_get(7)?,
        attempts: r.try_get(8)?,
        created_at: r.try_get(9)?,
        expires_at: r.try_get(10)?,
    })
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

/// `LISTEN` on the table's NOTIFY channel, for the wake-up listener's own session.
pub fn listen_sql(channel: &str) -> String {
    format!("LISTEN \"{channel}\"")
}

/// The session's backend pid (the listener's, named in the relay's waiting record).
pub const BACKEND_PID_SQL: &str = "SELECT pg_backend_pid()";

/// Parses a libpq URL and names the session `outbox-relay` unless the URL names it.
pub fn pg_config(url: &str) -> Result<tokio_postgres::Config> {
    let mut pg: tokio_postgres::Config = url
        .parse()
        .map_err(|e| StoreError::Build(format!("bad database URL: {e}")))?;
    if pg.get_application_name().is_none() {
        pg.application_name(APPLICATION_NAME);
    }
    pg.connect_timeout(Duration::from_secs(5));
    Ok(pg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_path_sql_is_the_relays_own_for_the_table() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let sql = hot_path_sql(&table);
        let q = Queries::new(&table);
        assert_eq!(sql.claim, q.claim_none);
        assert_eq!(sql.mark_sent, q.mark_sent);
        assert!(sql.claim.contains("app.events") && sql.claim.contains("FOR UPDATE SKIP LOCKED"));
        assert!(sql.mark_sent.contains("id = ANY($1)"));
    }
}
