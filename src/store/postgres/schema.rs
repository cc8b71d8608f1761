//! The migrations applied to the configured table, and the start-up inspection of it.
//!
//! The migrations are declared in [`super::migrations`], the table's names as placeholders,
//! and rendered for the configured table; `sql/` holds them rendered for the default table
//! `outbox_messages`, for users to copy as they are.
//!
//! `migrate` applies each version as its [`steps`](super::steps), every lock under
//! a short `lock_timeout`, so that it never holds up the application's inserts for long.

use std::time::Duration;

use tokio_postgres::error::SqlState;

use super::predicates::{quote_literal, valid_index};
use super::steps::{Step, StepKind};
use super::{PgStore, Result, StoreError};
use crate::config::TableName;
use crate::message::PayloadKind;

/// How long each lock `migrate` needs is waited for (PostgreSQL's `lock_timeout`). While
/// `migrate` waits for a lock on the table, every insert queues behind it: this bounds how
/// long the application can stall on a transaction that holds the table.
pub const LOCK_TIMEOUT: &str = "3s";

/// How many times a version whose locks were not granted is tried before `migrate` fails.
pub const LOCK_TRIES: u32 = 3;

/// The pause between two tries of a version (the application's inserts run meanwhile).
const LOCK_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// Serialises concurrent `migrate`s across versions (a session-level advisory lock). Tried
/// every [`MIGRATE_LOCK_POLL`], never waited for inside a statement: a session waiting in a
/// statement holds a snapshot, which the concurrent index build of the `migrate` holding the
/// lock waits for (a deadlock).
const MIGRATE_LOCK: &str = "SELECT pg_try_advisory_lock(hashtext('outbox-relay:migrate'))";
const MIGRATE_LOCK_POLL: Duration = Duration::from_millis(200);
const MIGRATE_UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext('outbox-relay:migrate'))";

pub use super::migrations::{MIGRATIONS, Migration};

/// The table that records which version each outbox table is at.
pub const VERSION_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS outbox_relay_schema_version (\n    \
    table_name text PRIMARY KEY,\n    version integer NOT NULL,\n    \
    applied_at timestamptz NOT NULL DEFAULT now()\n)";

/// The whole DDL for `table`, as `migrate --print` shows it and `migrate` applies it.
pub fn full_ddl(table: &TableName) -> String {
    let mut out = String::new();
    if let Some(schema) = &table.schema {
        out.push_str(&format!("CREATE SCHEMA IF NOT EXISTS {schema};\n\n"));
    }
    for m in MIGRATIONS {
        out.push_str(&format!("-- {} (version {})\n", m.name, m.version));
        out.push_str(&m.render(table));
        out.push('\n');
    }
    out
}

/// What `migrate --print` adds with `database.partition_interval` set: the partitioning
/// `migrate` does after the versions is not printed, since its statements are made from the
/// table as it stands (its indexes, grants and rows), so the output says so rather than pass
/// for the whole of it.
pub fn partitioning_note(table: &TableName, interval: std::time::Duration) -> String {
    format!(
        "-- database.partition_interval = \"{}\": `outbox-relay migrate` then partitions {table}\n\
         -- by created_at (range partitions of that interval ahead of now, and a DEFAULT one),\n\
         -- in steps made from the table as it stands (its indexes, grants and rows), which are\n\
         -- not printed here. Run `outbox-relay migrate` to partition it (docs/operations.md,\n\
         -- \"Partitioned tables\").\n",
        humantime::format_duration(interval)
    )
}

/// The table's schema as found in the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaState {
    /// The outbox table exists.
    pub table_exists: bool,
    /// Versions `migrate` would apply, in order (every one when the table does not exist).
    pub pending: Vec<i32>,
    /// The table's version is known: read from its catalog (PostgreSQL) or recorded by
    /// `migrate` (not so on MySQL for DDL applied by hand).
    pub recorded: bool,
}

/// The steps of migration `m` for `table`, the last recording the version in `versions` (the
/// version table, schema-qualified): with the version's last transaction, or in one of its
/// own. `fresh`: the table does not exist yet.
fn version_steps(m: &Migration, table: &TableName, versions: &str, fresh: bool) -> Vec<Step> {
    let mut steps = m.steps(table, fresh);
    let record = record_version(m, table, versions);
    match steps.last_mut() {
        Some(last) if last.kind == StepKind::Transaction => last.sql.push_str(&record),
        _ => steps.push(Step {
            kind: StepKind::Transaction,
            sql: record,
            builds_index: None,
        }),
    }
    steps
}

/// The statement that records `m` as applied to `table` in `versions`.
fn record_version(m: &Migration, table: &TableName, versions: &str) -> String {
    format!(
        "INSERT INTO {versions} (table_name, version) VALUES ({}, {}) \
         ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now();",
        quote_literal(&table.qualified()),
        m.version
    )
}

/// [`record_version`] as a step of its own.
fn record_step(m: &Migration, table: &TableName, versions: &str) -> Step {
    Step {
        kind: StepKind::Transaction,
        sql: record_version(m, table, versions),
        builds_index: None,
    }
}

impl SchemaState {
    /// What start-up does with a table in this state (`table` names it in the error):
    /// without `auto_migrate`, a missing table is an error saying to run `migrate` and
    /// nothing is applied; `partition` is whether to partition it (PostgreSQL).
    pub fn plan(
        self,
        table: &TableName,
        auto_migrate: bool,
        partition: bool,
    ) -> Result<SchemaPlan> {
        if !self.table_exists && !auto_migrate {
            return Err(StoreError::Schema(format!(
                "table {table} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true"
            )));
        }
        let (apply, behind) = match (auto_migrate, self.recorded) {
            (true, _) => (self.pending, Vec::new()),
            (false, true) => (Vec::new(), self.pending),
            (false, false) => (Vec::new(), Vec::new()),
        };
        Ok(SchemaPlan {
            table_exists: self.table_exists,
            apply,
            behind,
            partition,
        })
    }
}

struct Current {
    table_exists: bool,
    version: i32,
}

/// The version the table is at: 0 when it does not exist (so that a dropped table is created
/// again), else what its catalog shows, or the recorded version when that is lower.
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
    if !table_exists {
        return Ok(Current {
            table_exists,
            version: 0,
        });
    }
    let recorded = if recorded {
        client
            .query_opt(
                "SELECT version FROM outbox_relay_schema_version WHERE table_name = $1",
                &[&key],
            )
            .await?
            .map(|r| r.try_get::<_, i32>(0))
            .transpose()?
    } else {
        None
    };
    let found = found_version(client, table).await?;
    // What exists decides: a record names the version `migrate` finished (lower than what
    // the catalog shows after an interrupted run, whose version is applied again), but a
    // table re-created from older DDL, or recorded under another spelling of its name (or
    // none), is at the version its catalog shows.
    Ok(Current {
        table_exists,
        version: recorded.map_or(found, |r| r.min(found)),
    })
}

/// The newest schema version whose marks the table's catalog shows, each version's on top of
/// the one before. Each mark is the last thing its version makes, so a version that was
/// interrupted is not counted (and is applied again): 2 its last index, `<table>_expired_idx`,
/// built and valid; 3 the waiters table; 4 a wake-up trigger with a `WHEN` condition; 5 a
/// `fillfactor` set on the table (or, partitioned, on a partition): version 5 sets 50, and
/// one an operator chose since counts as well; 6 `<table>_waiting_idx` built and valid and
/// version 2's `<table>_open_idx` gone; 7 `<table>_blocker_idx` built and valid. (Versions 3 to 5 run in one transaction each.)
async fn found_version<C: deadpool_postgres::GenericClient + Sync>(
    client: &C,
    table: &TableName,
) -> Result<i32> {
    let sql = format!(
        "SELECT {}, \
           to_regclass($2) IS NOT NULL, \
           EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass($1) \
                     AND tgname = $3 AND tgqual IS NOT NULL), \
           EXISTS (SELECT 1 FROM pg_class c \
                    WHERE (c.oid = to_regclass($1) \
                           OR c.oid IN (SELECT inhrelid FROM pg_inherits \
                                         WHERE inhparent = to_regclass($1))) \
                      AND EXISTS (SELECT 1 FROM unnest(c.reloptions) o \
                                   WHERE o LIKE 'fillfactor=%')), \
           {} AND to_regclass($6) IS NULL, \
           {}",
        valid_index("$4", "$1"),
        valid_index("$5", "$1"),
        valid_index("$7", "$1"),
    );
    let row = client
        .query_one(
            &sql,
            &[
                &table.qualified(),
                &table.prefixed("_waiters"),
                &format!("{}_wakeup", table.name),
                &table.prefixed("_expired_idx"),
                &table.prefixed("_waiting_idx"),
                &table.prefixed("_open_idx"),
                &table.prefixed("_blocker_idx"),
            ],
        )
        .await?;
    let mut version = 1;
    for mark in 0..6 {
        if !row.try_get::<_, bool>(mark)? {
            break;
        }
        version += 1;
    }
    Ok(version)
}

impl PgStore {
    /// The table is partitioned.
    async fn is_partitioned<C: deadpool_postgres::GenericClient + Sync>(
        &self,
        client: &C,
    ) -> Result<bool> {
        Ok(client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_class WHERE oid = to_regclass($1) AND relkind = 'p')",
                &[&self.table.qualified()],
            )
            .await?
            .try_get(0)?)
    }
}

/// The oldest transactions of the database that hold a snapshot (what a concurrent index
/// build waits for besides the table's lockers), in the columns of the lock holders' query.
const OLDER_SNAPSHOTS: &str = "SELECT pid, 'an older snapshot', \
        extract(epoch FROM now() - xact_start)::float8, state, application_name \
   FROM pg_stat_activity \
  WHERE datname = current_database() AND backend_xmin IS NOT NULL \
    AND xact_start IS NOT NULL AND pid <> pg_backend_pid() \
  ORDER BY xact_start LIMIT 3";

/// Where a step is: version (0 for the set-up), its index and the version's step count.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepAt {
    version: i32,
    index: usize,
    count: usize,
}

impl StepAt {
    /// Step `index` (from 0) of `count` of version `version`.
    pub(super) const fn of(version: i32, index: usize, count: usize) -> StepAt {
        StepAt {
            version,
            index,
            count,
        }
    }

    const SETUP: StepAt = StepAt {
        version: 0,
        index: 0,
        count: 1,
    };
    /// A step of partitioning the table (`database.partition_interval`), after the versions.
    pub(super) const PARTITIONING: StepAt = StepAt {
        version: -1,
        index: 0,
        count: 1,
    };
}

/// Runs `sql` in one transaction whose locks are each requested under [`LOCK_TIMEOUT`], with
/// `search_path` set to `schema, pg_temp` when given.
async fn in_transaction(
    client: &mut deadpool_postgres::Object,
    schema: Option<&str>,
    sql: &str,
) -> std::result::Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT set_config('lock_timeout', $1, true), \
                CASE WHEN $2::text IS NOT NULL \
                  THEN set_config('search_path', quote_ident($2) || ', pg_temp', true) END",
        &[&LOCK_TIMEOUT, &schema],
    )
    .await?;
    tx.batch_execute(sql).await?;
    tx.commit().await
}

impl PgStore {
    /// Applies pending migrations; returns the versions applied.
    ///
    /// What is pending is decided by what exists, not only by what was recorded: when the
    /// table is missing (never created, or dropped since) every file is applied again (they
    /// are idempotent), whatever `outbox_relay_schema_version` says.
    ///
    /// Concurrent `migrate`s are serialised by a session-level advisory lock. Each version is
    /// applied as the [`steps`](super::steps) of its file, one after the other: short
    /// transactions, and index statements run `CONCURRENTLY` outside any transaction, so no
    /// transaction holds the table's locks while it reads the table, nor across versions. A
    /// version is recorded once all its steps are applied; they are idempotent, so a `migrate`
    /// that was interrupted applies that version's steps again (dropping an INVALID index an
    /// interrupted build left). Every lock is requested under [`LOCK_TIMEOUT`]: a step whose
    /// locks cannot be had is tried [`LOCK_TRIES`] times in all, then `migrate` fails with
    /// [`StoreError::Locked`] naming the step and the sessions that hold the table (what was
    /// applied before it stays applied).
    pub async fn migrate(&self) -> Result<Vec<i32>> {
        let mut client = self.client().await?;
        let mut waited = false;
        while !client
            .query_one(MIGRATE_LOCK, &[])
            .await?
            .try_get::<_, bool>(0)?
        {
            if !waited {
                tracing::info!(table = %self.table, "migrate: waiting for another migrate of this database to finish");
                waited = true;
            }
            tokio::time::sleep(MIGRATE_LOCK_POLL).await;
        }
        let applied = self.migrate_locked(&mut client).await;
        // On a lost connection the session, and with it the lock, is gone already.
        let unlocked = client.execute(MIGRATE_UNLOCK, &[]).await;
        let applied = applied?;
        unlocked?;
        Ok(applied)
    }

    async fn migrate_locked(&self, client: &mut deadpool_postgres::Object) -> Result<Vec<i32>> {
        let key = self.table.qualified();
        let schema: String = match &self.table.schema {
            Some(schema) => schema.clone(),
            // Where the table is, or where version 1 will create it.
            None => client
                .query_one(
                    "SELECT coalesce((SELECT n.nspname::text FROM pg_class c \
                       JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)), \
                       current_schema()::text, 'public')",
                    &[&key],
                )
                .await?
                .try_get(0)?,
        };
        let setup = match &self.table.schema {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS {schema};\n{VERSION_TABLE_DDL}"),
            None => VERSION_TABLE_DDL.to_owned(),
        };
        let setup = Step {
            kind: StepKind::Transaction,
            sql: setup,
            builds_index: None,
        };
        self.run_step(client, None, StepAt::SETUP, &setup).await?;
        // Named with its schema: each version runs with its own search_path.
        let versions: String = client
            .query_one(
                "SELECT quote_ident(n.nspname) || '.outbox_relay_schema_version' FROM pg_class c \
                   JOIN pg_namespace n ON n.oid = c.relnamespace \
                  WHERE c.oid = to_regclass('outbox_relay_schema_version')",
                &[],
            )
            .await?
            .try_get(0)?;
        let current = current_version(&*client, &self.table).await?;
        let partitioned = current.table_exists && self.is_partitioned(&*client).await?;
        let mut applied = Vec::new();
        for m in MIGRATIONS.iter().filter(|m| m.version > current.version) {
            if let (true, Some(swap)) = (partitioned, &m.on_partitions) {
                self.swap_partitioned_index(client, &schema, m.version, swap)
                    .await?;
                // The last of its steps: the ones before it stay applied if it fails.
                let record = record_step(m, &self.table, &versions);
                let at = super::partitioned_index::record_at(m.version, swap);
                self.run_step(client, Some(&schema), at, &record).await?;
                applied.push(m.version);
                continue;
            }
            let steps = version_steps(m, &self.table, &versions, !current.table_exists);
            let count = steps.len();
            for (index, step) in steps.iter().enumerate() {
                let at = StepAt::of(m.version, index, count);
                self.run_step(client, Some(&schema), at, step).await?;
            }
            applied.push(m.version);
        }
        if let Some(interval) = self.partition_interval() {
            self.partition(client, &schema, interval, !current.table_exists)
                .await?;
        }
        Ok(applied)
    }

    /// Runs `step` with each lock requested under [`LOCK_TIMEOUT`] and `search_path` set to
    /// `schema, pg_temp` when given (what the wake-up function pins). Tried [`LOCK_TRIES`]
    /// times when a lock cannot be had.
    pub(super) async fn run_step(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: Option<&str>,
        at: StepAt,
        step: &Step,
    ) -> Result<()> {
        let mut attempt = 1;
        loop {
            let started = std::time::Instant::now();
            let result = match step.kind {
                StepKind::Transaction => in_transaction(client, schema, &step.sql).await,
                StepKind::Concurrent => self.concurrently(client, schema, step).await,
            };
            match result {
                Ok(()) => {
                    tracing::debug!(
                        table = %self.table,
                        version = at.version,
                        step = at.index + 1,
                        steps = at.count,
                        ms = started.elapsed().as_millis() as u64,
                        "migrate: applied the step that begins {}",
                        step.summary()
                    );
                    return Ok(());
                }
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    let holders = self.lock_holders(&*client, step.kind).await?;
                    if attempt >= LOCK_TRIES {
                        return Err(StoreError::Locked(self.locked_sentence(at, step, &holders)));
                    }
                    tracing::warn!(
                        table = %self.table,
                        version = at.version,
                        attempt,
                        "migrate: a lock the step that begins {} needs was not granted within {LOCK_TIMEOUT}, {holders}; retrying",
                        step.summary()
                    );
                    attempt += 1;
                    tokio::time::sleep(LOCK_RETRY_PAUSE).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// What `migrate` says when a step's locks were not granted: what it could not do, who
    /// holds the table, what stays applied and to run it again.
    fn locked_sentence(&self, at: StepAt, step: &Step, holders: &str) -> String {
        let t = &self.table;
        if at.version < 0 {
            return format!(
                "could not partition {t} (the step that begins {}): a lock it needs was not granted within \
                 {LOCK_TIMEOUT} ({LOCK_TRIES} tries), {holders}; the steps before it are applied \
                 and stay so (each is idempotent): end or wait for that transaction and run \
                 `outbox-relay migrate` again",
                step.summary()
            );
        }
        if at.version == 0 {
            return format!(
                "could not create outbox_relay_schema_version for {t}: a lock it needs was not \
                 granted within {LOCK_TIMEOUT} ({LOCK_TRIES} tries), {holders}; end or wait for \
                 that transaction and run `outbox-relay migrate` again"
            );
        }
        let applied = if at.index == 0 {
            "nothing of that version was applied".to_owned()
        } else {
            format!(
                "its steps before this one are applied and stay so (each is idempotent; the \
                 version is recorded once all {} are)",
                at.count
            )
        };
        format!(
            "could not apply schema version {} to {t} (step {} of {}, which begins {}): a lock it needs was \
             not granted within {LOCK_TIMEOUT} ({LOCK_TRIES} tries), {holders}; {applied}: end \
             or wait for that transaction and run `outbox-relay migrate` again",
            at.version,
            at.index + 1,
            at.count,
            step.summary()
        )
    }

    /// Runs a [`StepKind::Concurrent`] step outside any transaction, the session's
    /// `lock_timeout` and `search_path` set for it and reset after. An INVALID index of the
    /// name it builds (an interrupted concurrent build) is dropped first: `IF NOT EXISTS`
    /// would keep it.
    async fn concurrently(
        &self,
        client: &deadpool_postgres::Object,
        schema: Option<&str>,
        step: &Step,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        client
            .execute(
                "SELECT set_config('lock_timeout', $1, false), \
                        CASE WHEN $2::text IS NOT NULL \
                          THEN set_config('search_path', quote_ident($2) || ', pg_temp', false) END",
                &[&LOCK_TIMEOUT, &schema],
            )
            .await?;
        let result = async {
            if let (Some(index), Some(schema)) = (&step.builds_index, schema) {
                let invalid = client
                    .query_opt(
                        "SELECT quote_ident($1) || '.' || quote_ident($2) FROM pg_index \
                          WHERE indexrelid = to_regclass(quote_ident($1) || '.' || quote_ident($2)) \
                            AND NOT indisvalid",
                        &[&schema, index],
                    )
                    .await?;
                if let Some(row) = invalid {
                    let name: String = row.try_get(0)?;
                    tracing::warn!(
                        table = %self.table,
                        "migrate: dropping the INVALID index {name} an interrupted build left, to build it again"
                    );
                    client
                        .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"))
                        .await?;
                }
            }
            client.batch_execute(&step.sql).await
        }
        .await;
        // On a lost connection the session, and its settings, are gone already.
        let reset = client
            .batch_execute("RESET lock_timeout; RESET search_path")
            .await;
        result?;
        reset
    }

    /// Who holds a lock on the table (or its other objects), as a phrase: "held by pid 123
    /// (RowExclusiveLock, transaction open 42 s, idle in transaction, application \"psql\")".
    /// A concurrent index build also waits for every older transaction of the database: when
    /// nothing holds the table, those are named ("held up by pid 123 (an older snapshot, …)").
    pub(super) async fn lock_holders<C: deadpool_postgres::GenericClient + Sync>(
        &self,
        client: &C,
        kind: StepKind,
    ) -> Result<String> {
        let mut verb = "held by";
        let mut rows = client
            .query(
                "SELECT a.pid, string_agg(DISTINCT l.mode, '/'), \
                        extract(epoch FROM now() - min(a.xact_start))::float8, \
                        min(a.state), min(a.application_name) \
                   FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                  WHERE l.locktype = 'relation' AND l.granted AND a.pid <> pg_backend_pid() \
                    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
                    AND l.relation IN (SELECT c.oid FROM pg_class c WHERE c.oid = to_regclass($1) \
                          OR c.oid IN (SELECT i.indexrelid FROM pg_index i WHERE i.indrelid = to_regclass($1)) \
                          OR c.oid = to_regclass($1 || '_waiters') OR c.oid = to_regclass($1 || '_seq')) \
                  GROUP BY a.pid ORDER BY 3 DESC NULLS LAST LIMIT 3",
                &[&self.table.qualified()],
            )
            .await?;
        if rows.is_empty() && kind == StepKind::Concurrent {
            verb = "held up by";
            rows = client.query(OLDER_SNAPSHOTS, &[]).await?;
        }
        if rows.is_empty() {
            return Ok(format!("{verb} a session that has ended since"));
        }
        let mut parts = Vec::new();
        for r in rows {
            let pid: i32 = r.try_get(0)?;
            let modes: Option<String> = r.try_get(1)?;
            let age: Option<f64> = r.try_get(2)?;
            let state: Option<String> = r.try_get(3)?;
            let app: Option<String> = r.try_get(4)?;
            let mut what = vec![modes.unwrap_or_default()];
            if let Some(age) = age {
                what.push(format!("transaction open {age:.0} s"));
            }
            if let Some(state) = state {
                what.push(state);
            }
            if let Some(app) = app.filter(|a| !a.is_empty()) {
                what.push(format!("application \"{app}\""));
            }
            parts.push(format!("pid {pid} ({})", what.join(", ")));
        }
        Ok(format!("{verb} {}", parts.join(" and ")))
    }

    /// Whether the table exists and which schema versions `migrate` would apply, read
    /// without changing anything (for `check` and the start-up decision).
    pub async fn schema_state(&self) -> Result<SchemaState> {
        let client = self.client().await?;
        let current = current_version(&client, &self.table).await?;
        Ok(SchemaState {
            table_exists: current.table_exists,
            pending: MIGRATIONS
                .iter()
                .map(|m| m.version)
                .filter(|&v| v > current.version)
                .collect(),
            recorded: current.version > 0,
        })
    }

    /// The channel the table's wake-up trigger notifies: the table's name as it was written
    /// when `migrate` made the trigger, which may be spelled otherwise than now (`t` against
    /// `public.t`). `None` without such a trigger function.
    pub async fn notify_channel(&self) -> Result<Option<String>> {
        let function = self.table.prefixed("_wakeup()");
        let row = self
            .client()
            .await?
            .query_one(
                "SELECT substring(pg_get_functiondef(p) from 'pg_notify\\(''([^'']*)''') \
                 FROM (SELECT to_regprocedure($1) AS p) f",
                &[&function],
            )
            .await?;
        Ok(row.try_get(0)?)
    }

    /// Whether the relay's user may update and delete the table's rows, as claims and
    /// settles do: both run on no row, in a transaction rolled back (`check`).
    pub async fn may_write(&self) -> Result<()> {
        let t = self.table.qualified();
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        // Privileges are checked when a statement starts, whatever rows it then touches.
        tx.batch_execute(&format!(
            "UPDATE {t} SET status = status WHERE false; DELETE FROM {t} WHERE false"
        ))
        .await?;
        tx.rollback().await?;
        Ok(())
    }

    /// Checks that the table exists and returns its payload kind and oid; notes whether it has
    /// schema version 7's `<table>_blocker_idx` (see [`PgStore::has_blocker_index`]).
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
        // Looked at again: `migrate` may have just built it.
        self.look_for_blocker_index(&client).await?;
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
}

/// The start-up decision about the schema, shared by `run` (which acts on it) and `check`
/// (which reports it): a missing table is fine when `database.auto_migrate` will create it,
/// and an error naming the fix otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaPlan {
    /// The table exists now.
    pub table_exists: bool,
    /// Schema versions start-up applies (empty without `auto_migrate`).
    pub apply: Vec<i32>,
    /// Schema versions the table lacks, by the version `migrate` recorded, that start-up
    /// leaves to `migrate` (without `auto_migrate`): `check` and `run` say so. Empty when the
    /// table's version is not known (MySQL DDL applied by hand).
    pub behind: Vec<i32>,
    /// Start-up partitions the plain table (`auto_migrate` and `partition_interval` set).
    pub partition: bool,
}

/// [`PgStore::has_blocker_index`] not looked at yet.
const BLOCKER_UNKNOWN: u8 = 0;
/// The table has no valid `<table>_blocker_idx`.
const BLOCKER_ABSENT: u8 = 1;
/// The table has a valid `<table>_blocker_idx`.
const BLOCKER_PRESENT: u8 = 2;

impl PgStore {
    /// Whether the table has schema version 7's `<table>_blocker_idx`, which the ordered claim
    /// then reads; a table below version 7 gets the claim that probes each candidate's head
    /// instead. Looked at once per store (and again by [`PgStore::inspect`] at start): a table
    /// migrated to version 7 while a relay runs gets the new claim at that relay's next start.
    pub(super) async fn has_blocker_index(
        &self,
        client: &deadpool_postgres::Object,
    ) -> Result<bool> {
        match self
            .blocker_index
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            BLOCKER_UNKNOWN => self.look_for_blocker_index(client).await,
            known => Ok(known == BLOCKER_PRESENT),
        }
    }

    /// Reads from the catalog whether the table has a valid `<table>_blocker_idx`, and notes it.
    async fn look_for_blocker_index(&self, client: &deadpool_postgres::Object) -> Result<bool> {
        let valid: bool = client
            .query_one(
                &format!("SELECT {}", valid_index("$1", "$2")),
                &[
                    &self.table.prefixed("_blocker_idx"),
                    &self.table.qualified(),
                ],
            )
            .await?
            .try_get(0)?;
        let known = if valid {
            BLOCKER_PRESENT
        } else {
            BLOCKER_ABSENT
        };
        self.blocker_index
            .store(known, std::sync::atomic::Ordering::Relaxed);
        Ok(valid)
    }

    /// Decides what start-up does about the schema; an error when `run` could not start.
    pub async fn plan_schema(&self, auto_migrate: bool) -> Result<SchemaPlan> {
        let state = self.schema_state().await?;
        let partition = auto_migrate
            && state.table_exists
            && self.partition_interval().is_some()
            && self.layout().await?.is_some_and(|l| !l.partitioned);
        state.plan(self.table(), auto_migrate, partition)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files under `sql/`, as users copy them, are the migrations rendered for the default
    /// table.
    #[test]
    fn each_file_under_sql_is_its_migration_for_the_default_table() {
        let t = TableName::parse("outbox_messages").unwrap();
        let files = [
            include_str!("../../../sql/0001_outbox_messages.sql"),
            include_str!("../../../sql/0002_expiry.sql"),
            include_str!("../../../sql/0003_wakeup_and_storage.sql"),
            include_str!("../../../sql/0004_bulk_wakeup.sql"),
            include_str!("../../../sql/0005_room_for_updates.sql"),
            include_str!("../../../sql/0006_waiting_index.sql"),
            include_str!("../../../sql/0007_blocker_index.sql"),
        ];
        assert_eq!(MIGRATIONS.len(), files.len());
        for (m, text) in MIGRATIONS.iter().zip(files) {
            assert!(
                m.name.starts_with(&format!("{:04}_", m.version)),
                "{}",
                m.name
            );
            assert_eq!(m.render(&t), text, "sql/{} differs", m.name);
        }
    }

    /// Renders `migration` for `app.events` and asserts that no default name is left and that
    /// the result contains every one of `needles`.
    fn assert_renders_for_app_events(migration: &Migration, needles: &[&str]) {
        let t = TableName::parse("app.events").unwrap();
        let sql = migration.render(&t);
        assert!(!sql.contains("outbox_messages"), "{sql}");
        for needle in needles {
            assert!(sql.contains(needle), "missing {needle:?} in:\n{sql}");
        }
    }

    #[test]
    fn qualified_table_renders_every_kind_of_name() {
        assert_renders_for_app_events(
            &MIGRATIONS[0],
            &[
                "CREATE SEQUENCE IF NOT EXISTS app.events_seq;",
                "CREATE OR REPLACE FUNCTION app.events_next_seq()",
                "nextval('app.events_seq')",
                "CREATE TABLE IF NOT EXISTS app.events (",
                "DEFAULT app.events_next_seq()",
                "OWNED BY app.events.seq",
                "CREATE INDEX IF NOT EXISTS events_pending_idx\n    ON app.events (seq)",
                "pg_notify('app.events', '')",
                "DROP TRIGGER IF EXISTS events_notify ON app.events;",
                "CREATE TRIGGER events_notify\n    AFTER INSERT ON app.events",
                "EXECUTE FUNCTION app.events_notify()",
            ],
        );
    }

    #[test]
    fn expiry_migration_names_constraints_bare_and_drops_the_qualified_index() {
        assert_renders_for_app_events(
            &MIGRATIONS[1],
            &[
                "ALTER TABLE app.events ADD COLUMN IF NOT EXISTS expires_at",
                "DROP CONSTRAINT IF EXISTS events_status_check;",
                "ADD CONSTRAINT events_status_check\n",
                "VALIDATE CONSTRAINT events_status_check;",
                "DROP INDEX CONCURRENTLY IF EXISTS app.events_aggregate_idx;",
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS events_expiry_idx\n    ON app.events",
            ],
        );
        assert_eq!(MIGRATIONS[1].version, 2);
    }

    #[test]
    fn wakeup_renders_for_a_qualified_table() {
        let v3 = MIGRATIONS.iter().find(|m| m.version == 3).unwrap();
        assert_renders_for_app_events(
            v3,
            &[
                "CREATE UNLOGGED TABLE IF NOT EXISTS app.events_waiters (",
                "CREATE OR REPLACE FUNCTION app.events_wakeup()",
                "SELECT 1 FROM app.events_waiters WHERE alive_until > now()",
                "pg_notify('app.events', '')",
                "DROP TRIGGER IF EXISTS events_notify ON app.events;",
                "CREATE CONSTRAINT TRIGGER events_wakeup\n    AFTER INSERT ON app.events",
                "EXECUTE FUNCTION app.events_wakeup()",
                "DROP FUNCTION IF EXISTS app.events_notify();",
                "ALTER TABLE app.events SET (",
            ],
        );
    }

    #[test]
    fn bulk_wakeup_renders_its_once_per_transaction_condition_for_a_qualified_table() {
        let v4 = MIGRATIONS.iter().find(|m| m.version == 4).unwrap();
        assert_renders_for_app_events(
            v4,
            &[
                "CREATE OR REPLACE FUNCTION app.events_wakeup()",
                "SELECT 1 FROM app.events_waiters WHERE alive_until > now()",
                "pg_notify('app.events', '')",
                "DROP TRIGGER IF EXISTS events_wakeup ON app.events;",
                "CREATE CONSTRAINT TRIGGER events_wakeup\n    AFTER INSERT ON app.events",
                "current_setting('outbox.woke_' || 'app.events'::regclass::oid::text, true)",
                "set_config('outbox.woke_' || 'app.events'::regclass::oid::text, '1', true)",
                "EXECUTE FUNCTION app.events_wakeup()",
            ],
        );
    }

    #[test]
    fn room_for_updates_renders_for_a_qualified_table() {
        let v5 = MIGRATIONS.iter().find(|m| m.version == 5).unwrap();
        assert_renders_for_app_events(
            v5,
            &[
                "WHERE c.oid = 'app.events'::regclass AND c.relkind = 'r'",
                "WHERE i.inhparent = 'app.events'::regclass",
                "SET (fillfactor = 50)",
            ],
        );
    }

    #[test]
    fn migrations_are_in_version_order() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }

    #[test]
    fn full_ddl_creates_schema() {
        let t = TableName::parse("app.events").unwrap();
        assert!(full_ddl(&t).starts_with("CREATE SCHEMA IF NOT EXISTS app;"));
        let t = TableName::parse("events").unwrap();
        assert!(full_ddl(&t).starts_with("-- 0001_outbox_messages.sql"));
    }
}
