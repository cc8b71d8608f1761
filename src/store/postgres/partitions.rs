//! Partitioned outbox tables (`database.partition_interval`): `migrate`'s conversion of a
//! plain table in place, the partitions created ahead of time, and retention by dropping
//! whole partitions.
//!
//! Layout: the table is `PARTITION BY RANGE (created_at)` with the primary key
//! `(id, created_at)`. Partitions named `<name>_p<YYYYMMDD>_<HHMM>` (the UTC start of their
//! range) cover `[start, start + interval)`, aligned on the Unix epoch; `<name>_default` catches
//! any row outside them, so an insert never fails for want of a partition. A converted table
//! keeps its rows where they are: it becomes the partition `<name>_plain`, `FROM (MINVALUE) TO
//! (<bound>)`, and is dropped like the others once past retention.
//!
//! Retention: a partition whose range ended more than `cleanup.retention` ago is dropped
//! whole; its few unfinished rows (a dead letter, a row still pending or in flight) are moved
//! to DEFAULT first, the same rows with the same columns (see [`Store::retire_partition`]).
//!
//! Locks: creating a partition (`CREATE TABLE … (LIKE …)`, then `ATTACH PARTITION`) takes
//! SHARE UPDATE EXCLUSIVE on the table, which inserts pass, and ACCESS EXCLUSIVE on the new
//! table and on the DEFAULT partition (claims wait for it); dropping one detaches it first,
//! which takes ACCESS EXCLUSIVE on the table for a moment (the detach, the move of at most
//! [`MOVE_AT_MOST`] rows by index, the drop). Each is requested under [`LOCK_TIMEOUT`] and,
//! when it is not granted, tried again at the next round rather than queue the application's
//! inserts behind it. One relay at a time does this work (a transaction-level advisory lock
//! per table).

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::error::SqlState;

use super::migrations::{DROP_WAKEUP_TRIGGER, ROOM_FOR_UPDATES, STORAGE_SETTINGS, WAKEUP_TRIGGER};
use super::operator::cleanup_sql;
use super::predicates::quote_literal;
use super::{PgStore, Result, StoreError};
use crate::config::TableName;

/// How long the relay's partition work waits for a lock before it gives up for this round:
/// the application's inserts queue behind a lock request on the table, so this bounds how
/// long an insert can wait on the relay.
pub const LOCK_TIMEOUT: &str = "200ms";

/// How far ahead of `now()` partitions exist: at least this many intervals, and at least
/// [`AHEAD_AT_LEAST`].
pub const AHEAD: u32 = 2;

/// Partitions exist at least this far ahead, however short the interval: creating one needs
/// a moment's exclusive lock on DEFAULT, which a long transaction reading the table delays; the
/// partitions ahead carry the inserts meanwhile.
pub const AHEAD_AT_LEAST: Duration = Duration::from_secs(10 * 60);

/// A converted table's old rows stay in the `_plain` partition, whose upper bound is this far
/// ahead (at least; rounded up to the interval): the bound's `CHECK` constraint is in force on
/// the plain table from the moment it is added until the table is swapped, so the bound must
/// stay ahead of `now()` while the constraint is validated.
const CONVERSION_MARGIN: Duration = Duration::from_secs(15 * 60);

/// Why a partition past retention is kept. A partition's unfinished rows are moved out when
/// it is dropped, so the first three apply only to one with more than [`MOVE_AT_MOST`] of
/// them (or some, and no DEFAULT partition): the most urgent status among them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeptFor {
    /// It holds dead letters (kept until an operator retries or discards enough of them).
    Failed,
    /// It holds rows being published.
    Processing,
    /// It holds rows not yet published.
    Pending,
    /// Its lock was not granted within [`LOCK_TIMEOUT`] (tried again next round).
    Locked,
}

impl KeptFor {
    /// Every reason, for gauges.
    pub const ALL: [KeptFor; 4] = [Self::Failed, Self::Processing, Self::Pending, Self::Locked];

    /// The metric label and the word in logs.
    pub fn label(self) -> &'static str {
        match self {
            Self::Failed => "failed",
            Self::Processing => "processing",
            Self::Pending => "pending",
            Self::Locked => "locked",
        }
    }
}

/// One partition of the table, as the catalog has it.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// Schema-qualified, quoted where needed: safe to splice into SQL.
    pub name: String,
    /// The DEFAULT partition.
    pub default: bool,
    /// Start of its range (`None`: DEFAULT or `MINVALUE`).
    pub lower: Option<DateTime<Utc>>,
    /// End of its range (`None`: DEFAULT or `MAXVALUE`).
    pub upper: Option<DateTime<Utc>>,
}

/// The table as the partition work sees it.
#[derive(Debug, Clone)]
pub struct Layout {
    /// `PARTITION BY RANGE`.
    pub partitioned: bool,
    /// Whether this session may create and drop partitions (owns the table).
    pub may_own: bool,
    /// The database's clock.
    pub now: DateTime<Utc>,
    /// Its partitions, range ones by start, DEFAULT first.
    pub partitions: Vec<Partition>,
}

impl Layout {
    /// The range partitions (not DEFAULT).
    pub fn ranges(&self) -> impl Iterator<Item = &Partition> {
        self.partitions.iter().filter(|p| !p.default)
    }

    /// The DEFAULT partition.
    pub fn default_partition(&self) -> Option<&Partition> {
        self.partitions.iter().find(|p| p.default)
    }

    /// The interval the newest range partition was made with (for a partitioned table whose
    /// relay has no `partition_interval` set).
    pub fn newest_interval(&self) -> Option<Duration> {
        let newest = self.ranges().filter(|p| p.upper.is_some()).last()?;
        let width = newest.upper? - newest.lower?;
        width.to_std().ok().filter(|w| !w.is_zero())
    }

    /// The ranges to create so that partitions cover `now() + AHEAD × interval`: from the end
    /// of the newest partition (or the start of the current interval, whichever is later) on.
    pub fn missing_ahead(&self, interval: Duration) -> Vec<(DateTime<Utc>, DateTime<Utc>)> {
        let Ok(step) = chrono::Duration::from_std(interval) else {
            return Vec::new();
        };
        let current = align_down(self.now, interval);
        let mut start = self
            .ranges()
            .filter_map(|p| p.upper)
            .max()
            .map_or(current, |u| u.max(current));
        let at_least = chrono::Duration::from_std(AHEAD_AT_LEAST).unwrap_or_default();
        let target = self.now + (step * i32::try_from(AHEAD).unwrap_or(2)).max(at_least);
        let mut out = Vec::new();
        while start < target {
            out.push((start, start + step));
            start += step;
        }
        out
    }
}

/// `at` rounded down to a multiple of `interval` since the Unix epoch.
pub fn align_down(at: DateTime<Utc>, interval: Duration) -> DateTime<Utc> {
    let secs = i64::try_from(interval.as_secs()).unwrap_or(i64::MAX).max(1);
    let t = at.timestamp();
    DateTime::from_timestamp(t - t.rem_euclid(secs), 0).unwrap_or(at)
}

/// The name of the partition starting at `start`.
pub fn partition_name(table: &TableName, start: DateTime<Utc>) -> String {
    table.prefixed(&start.format("_p%Y%m%d_%H%M").to_string())
}

/// A timestamp as an SQL literal.
fn literal(at: DateTime<Utc>) -> String {
    format!("'{}'", at.format("%Y-%m-%d %H:%M:%S+00"))
}

/// What became of a partition that retention looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retired {
    /// Detached and dropped, after its unfinished rows (counted here) were moved to DEFAULT.
    Dropped(Leftovers),
    /// Kept, whole, and why: more than [`MOVE_AT_MOST`] unfinished rows (or some, and no
    /// DEFAULT partition to take them), the most urgent status among them; or its lock.
    Kept(KeptFor),
    /// Another relay holds the partition work now.
    Busy,
}

/// At most this many unfinished rows are moved out of a partition past retention so that it
/// can be dropped: the move runs while the table's `ACCESS EXCLUSIVE` lock is held, so it must
/// stay short (tens of milliseconds). A partition with more is kept whole until it has fewer.
pub const MOVE_AT_MOST: i64 = 1000;

/// The unfinished rows of a partition, by status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Dead letters.
    pub failed: i64,
    /// Rows being published (their lease, relay and attempts move with them).
    pub processing: i64,
    /// Rows not yet published.
    pub pending: i64,
}

impl Leftovers {
    /// From `(status, count)` rows.
    fn from_rows(rows: &[tokio_postgres::Row]) -> std::result::Result<Self, tokio_postgres::Error> {
        let mut out = Self::default();
        for r in rows {
            let n: i64 = r.try_get(1)?;
            match r.try_get::<_, String>(0)?.as_str() {
                "failed" => out.failed += n,
                "processing" => out.processing += n,
                // Any other unfinished status counts as waiting to be published.
                _ => out.pending += n,
            }
        }
        Ok(out)
    }

    /// All of them.
    pub fn total(&self) -> i64 {
        self.failed + self.processing + self.pending
    }

    /// Why they keep their partition, if they do: more than [`MOVE_AT_MOST`], or any when
    /// there is no DEFAULT partition to take them.
    fn keeps(&self, has_default: bool) -> Option<KeptFor> {
        let moveable = self.total() <= MOVE_AT_MOST && (has_default || self.total() == 0);
        if moveable {
            None
        } else if self.failed > 0 {
            Some(KeptFor::Failed)
        } else if self.processing > 0 {
            Some(KeptFor::Processing)
        } else {
            Some(KeptFor::Pending)
        }
    }
}

/// The partition work's statements, rendered for the table.
#[derive(Debug, Clone)]
struct PartitionSql {
    layout: &'static str,
    partitions: &'static str,
    lock: String,
}

impl PartitionSql {
    fn new(table: &TableName) -> Self {
        Self {
            // $1 the table.
            layout: "SELECT c.relkind = 'p', \
                       pg_has_role(c.relowner, 'MEMBER') \
                         OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), now() \
                       FROM pg_class c WHERE c.oid = to_regclass($1)",
            // $1 the table. The bounds as text are in the session's time zone: cast back in
            // the same session.
            partitions: "SELECT format('%I.%I', n.nspname, c.relname), \
                           coalesce(pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT', false), \
                           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \\(''([^'']+)''\\)'))[1]::timestamptz, \
                           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz \
                         FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
                         JOIN pg_namespace n ON n.oid = c.relnamespace \
                         WHERE i.inhparent = to_regclass($1) ORDER BY 2 DESC, 3 NULLS FIRST",
            lock: format!(
                "SELECT pg_try_advisory_xact_lock(hashtext({}))",
                quote_literal(&format!("outbox-relay:partitions:{}", table.qualified()))
            ),
        }
    }
}

/// The storage settings of a queue table (schema version 3's autovacuum settings and version
/// 5's fillfactor), rendered for `relation`: every partition gets them (a partitioned table
/// holds none).
fn storage_settings(relation: &TableName) -> String {
    format!(
        "{}\n{}",
        STORAGE_SETTINGS.for_table(relation),
        ROOM_FOR_UPDATES.for_table(relation)
    )
}

/// `name` (qualified, from the catalog) as a [`TableName`] for rendering.
fn as_table(schema: Option<&str>, bare: &str) -> TableName {
    TableName {
        schema: schema.map(str::to_owned),
        name: bare.to_owned(),
    }
}

impl PgStore {
    /// The table's partitioning as the catalog has it; `None` when the table does not exist.
    pub async fn layout(&self) -> Result<Option<Layout>> {
        let client = self.client().await?;
        let sql = PartitionSql::new(&self.table);
        let t = self.table.qualified();
        let Some(row) = client.query_opt(sql.layout, &[&t]).await? else {
            return Ok(None);
        };
        let mut layout = Layout {
            partitioned: row.try_get(0)?,
            may_own: row.try_get::<_, Option<bool>>(1)?.unwrap_or(false),
            now: row.try_get(2)?,
            partitions: Vec::new(),
        };
        for r in client.query(sql.partitions, &[&t]).await? {
            layout.partitions.push(Partition {
                name: r.try_get(0)?,
                default: r.try_get(1)?,
                lower: r.try_get(2)?,
                upper: r.try_get(3)?,
            });
        }
        Ok(Some(layout))
    }

    /// Creates the partitions missing ahead of `now()` (see [`Layout::missing_ahead`]), each
    /// in a transaction of its own; returns their names. Nothing when another relay holds the
    /// partition work.
    pub async fn create_partitions_ahead(
        &self,
        layout: &Layout,
        interval: Duration,
    ) -> Result<Vec<String>> {
        let mut created = Vec::new();
        let default = layout.default_partition().map(|p| p.name.clone());
        for (lo, hi) in layout.missing_ahead(interval) {
            match self.create_partition(lo, hi, default.as_deref()).await? {
                Some(name) => created.push(name),
                None => break,
            }
        }
        Ok(created)
    }

    /// Creates the partition `[lo, hi)` as a table of its own, moves the rows of that range
    /// out of DEFAULT into it (attaching refuses a range DEFAULT has rows of), and attaches it.
    /// `None` when another relay holds the partition work.
    async fn create_partition(
        &self,
        lo: DateTime<Utc>,
        hi: DateTime<Utc>,
        default: Option<&str>,
    ) -> Result<Option<String>> {
        let t = self.table.qualified();
        let name = partition_name(&self.table, lo);
        let bare = name.rsplit('.').next().unwrap_or(&name).to_owned();
        let part = as_table(self.table.schema.as_deref(), &bare);
        let (lo, hi) = (literal(lo), literal(hi));
        // The locks ATTACH takes, taken first and in the order the relay's statements take
        // them (the table, then its partitions): rows moved out of DEFAULT are then locked by
        // nobody else (a settle of one of them waits for this transaction instead of holding
        // a lock it would wait for: a deadlock), and no row reaches DEFAULT between the move
        // and the attach (which would refuse the range).
        let mut sql = format!("LOCK TABLE {t} IN SHARE UPDATE EXCLUSIVE MODE;\n");
        if let Some(default) = default {
            sql.push_str(&format!("LOCK TABLE {default} IN ACCESS EXCLUSIVE MODE;\n"));
        }
        sql.push_str(&format!(
            "CREATE TABLE {name} (LIKE {t} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE);\n{}\n",
            storage_settings(&part)
        ));
        if let Some(default) = default {
            sql.push_str(&format!(
                "WITH moved AS (DELETE FROM {default} WHERE created_at >= {lo} AND created_at < {hi} RETURNING *) \
                 INSERT INTO {name} SELECT * FROM moved;\n"
            ));
        }
        sql.push_str(&format!(
            "ALTER TABLE {t} ATTACH PARTITION {name} FOR VALUES FROM ({lo}) TO ({hi});"
        ));
        Ok(self.partition_work(&sql).await?.then_some(name))
    }

    /// Runs `sql` in one transaction under [`LOCK_TIMEOUT`] if this session gets the
    /// partition work's advisory lock; `false` when another session has it.
    ///
    /// A lock not granted in time is a [`StoreError::Locked`] naming the sessions that hold
    /// the table, as `migrate` names them.
    async fn partition_work(&self, sql: &str) -> Result<bool> {
        let mut client = self.client().await?;
        let Some(tx) = self.begin_partition_work(&mut client).await? else {
            return Ok(false);
        };
        match tx.batch_execute(sql).await {
            Ok(()) => {}
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                tx.rollback().await?;
                let holders = self
                    .lock_holders(&client, super::steps::StepKind::Transaction)
                    .await?;
                return Err(StoreError::Locked(format!(
                    "a lock on table {} was not granted within {LOCK_TIMEOUT}, {holders}",
                    self.table
                )));
            }
            Err(e) => return Err(e.into()),
        }
        tx.commit().await?;
        Ok(true)
    }

    /// A transaction under [`LOCK_TIMEOUT`] holding the partition work's advisory lock (one
    /// relay at a time per table); `None` when another session has the lock.
    async fn begin_partition_work<'a>(
        &self,
        client: &'a mut deadpool_postgres::Object,
    ) -> Result<Option<deadpool_postgres::Transaction<'a>>> {
        let tx = client.transaction().await?;
        tx.execute(
            "SELECT set_config('lock_timeout', $1, true)",
            &[&LOCK_TIMEOUT],
        )
        .await?;
        let lock = PartitionSql::new(&self.table).lock;
        let held: bool = tx.query_one(&lock, &[]).await?.try_get(0)?;
        Ok(held.then_some(tx))
    }

    /// Detaches and drops `partition`, moving its unfinished rows (`pending`, `processing`,
    /// `failed`) out first: in one transaction under [`LOCK_TIMEOUT`], it detaches the
    /// partition (from then on no row can reach or leave it), inserts those rows through the
    /// table, where `default` (the DEFAULT partition) catches them since no range covers theirs
    /// any more, and drops it. Every column is copied (id, seq, `created_at`, status, lease,
    /// attempts), so the rows are the same rows to the relay, its ordering and the operator
    /// commands. Kept instead, whole, when it holds more than [`MOVE_AT_MOST`] unfinished rows
    /// or has some and the table has no DEFAULT partition: see [`Retired`].
    pub async fn retire_partition(
        &self,
        partition: &Partition,
        default: Option<&str>,
    ) -> Result<Retired> {
        let mut client = self.client().await?;
        let columns = self.copied_columns(&client).await?;
        let Some(tx) = self.begin_partition_work(&mut client).await? else {
            return Ok(Retired::Busy);
        };
        match self
            .move_out_and_drop(&tx, &partition.name, default, &columns)
            .await
        {
            Ok(Retired::Dropped(moved)) => {
                tx.commit().await?;
                Ok(Retired::Dropped(moved))
            }
            Ok(kept) => {
                tx.rollback().await?;
                Ok(kept)
            }
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                tx.rollback().await?;
                Ok(Retired::Kept(KeptFor::Locked))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// [`Store::retire_partition`]'s statements in `tx`; the caller commits only on
    /// [`Retired::Dropped`].
    async fn move_out_and_drop(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        p: &str,
        default: Option<&str>,
        columns: &str,
    ) -> std::result::Result<Retired, tokio_postgres::Error> {
        let t = self.table.qualified();
        // Every read of the partition below goes through the partial indexes of unfinished
        // rows (one arm of the OR per status: the pending, failed and processing indexes of
        // every schema version), never a sequential scan of its sent rows, whatever its
        // statistics say: from the DETACH on, the application's inserts wait for this
        // transaction.
        tx.batch_execute("SET LOCAL enable_seqscan = off").await?;
        let unfinished_rows = "(status = 'pending' OR status = 'failed' OR status = 'processing')";
        let unfinished = format!(
            "SELECT status, count(*) FROM (SELECT status FROM {p} \
               WHERE {unfinished_rows} LIMIT {}) u GROUP BY status",
            MOVE_AT_MOST + 1
        );
        let before = Leftovers::from_rows(&tx.query(&unfinished, &[]).await?)?;
        if let Some(why) = before.keeps(default.is_some()) {
            return Ok(Retired::Kept(why));
        }
        tx.batch_execute(&format!("ALTER TABLE {t} DETACH PARTITION {p}"))
            .await?;
        // Again, detached: a row inserted with an old `created_at` or claimed meanwhile counts.
        let leftovers = Leftovers::from_rows(&tx.query(&unfinished, &[]).await?)?;
        if let Some(why) = leftovers.keeps(default.is_some()) {
            return Ok(Retired::Kept(why));
        }
        if leftovers.total() > 0 {
            // The rows are not new: no wake-up for them. Schema version 4's trigger queues
            // none once this transaction's flag is set, and its one deferred call would run at
            // commit, while the lock is held, and costs there far more than the move itself.
            tx.execute(
                "SELECT set_config('outbox.woke_' || to_regclass($1)::oid::text, '1', true)",
                &[&t],
            )
            .await?;
            tx.batch_execute(&format!(
                "INSERT INTO {t} ({columns}) OVERRIDING SYSTEM VALUE \
                   SELECT {columns} FROM {p} WHERE {unfinished_rows}"
            ))
            .await?;
        }
        tx.batch_execute(&format!("DROP TABLE {p}")).await?;
        Ok(Retired::Dropped(leftovers))
    }

    /// The table's columns that an insert may set (not generated ones), quoted and in order,
    /// for copying rows between partitions whose column order may differ (a converted table
    /// keeps its own).
    async fn copied_columns(&self, client: &deadpool_postgres::Object) -> Result<String> {
        let row = client
            .query_one(
                "SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute \
                  WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped \
                    AND attgenerated = ''",
                &[&self.table.qualified()],
            )
            .await?;
        row.try_get::<_, Option<String>>(0)?
            .ok_or_else(|| StoreError::Schema(format!("table {} does not exist", self.table)))
    }

    /// Rows in the DEFAULT partition.
    pub async fn rows_in(&self, partition: &str) -> Result<i64> {
        let client = self.client().await?;
        Ok(client
            .query_one(&format!("SELECT count(*) FROM {partition}"), &[])
            .await?
            .try_get(0)?)
    }

    /// Deletes up to `batch` finished rows past `retention` from `relation` (one partition);
    /// returns how many.
    pub async fn cleanup_batch_in(
        &self,
        relation: &str,
        retention: Duration,
        batch: usize,
    ) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&cleanup_sql(relation)).await?;
        let ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        Ok(client.execute(&stmt, &[&ms, &batch]).await?)
    }
}

/// What a plain table needs before `migrate` can partition it: a refusal names the table,
/// what is wrong and what to do. `$1` the table.
const SHAPE: &str = "SELECT \
      (SELECT format_type(a.atttypid, a.atttypmod) || CASE WHEN a.attnotnull THEN '' ELSE ' NULL' END \
         FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'created_at' AND NOT a.attisdropped), \
      (SELECT string_agg(x.relname, ', ') FROM pg_index i JOIN pg_class x ON x.oid = i.indexrelid \
         WHERE i.indrelid = c.oid AND i.indisunique AND NOT i.indisprimary \
           AND x.relname <> $2), \
      (SELECT string_agg(k.conname || ' on ' || k.conrelid::regclass::text, ', ') FROM pg_constraint k \
         WHERE k.contype = 'f' AND (k.confrelid = c.oid OR k.conrelid = c.oid)), \
      EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid OR h.inhparent = c.oid) \
    FROM pg_class c WHERE c.oid = to_regclass($1)";

impl PgStore {
    /// `migrate`'s last step with `partition_interval` set: partitions a plain table (a new
    /// one in one transaction; an existing one in place, see [`PgStore::convert`]), then creates
    /// the partitions ahead. On a partitioned table, only the latter.
    pub(super) async fn partition(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        interval: Duration,
        new_table: bool,
    ) -> Result<()> {
        let layout = self
            .layout()
            .await?
            .ok_or_else(|| StoreError::Schema(format!("table {} does not exist", self.table)))?;
        if !layout.partitioned {
            self.check_shape(client).await?;
            self.convert(client, schema, interval, new_table, layout.now)
                .await?;
        }
        let layout = self
            .layout()
            .await?
            .ok_or_else(|| StoreError::Schema(format!("table {} does not exist", self.table)))?;
        let created = self.create_partitions_ahead(&layout, interval).await?;
        if !created.is_empty() {
            tracing::info!(table = %self.table, partitions = ?created, "migrate: created partitions ahead");
        }
        Ok(())
    }

    /// Refuses a table `migrate` cannot partition, naming what stands in the way.
    async fn check_shape(&self, client: &deadpool_postgres::Object) -> Result<()> {
        let t = self.table.qualified();
        let keep = format!("{}_id_created_idx", self.table.name);
        let row = client.query_one(SHAPE, &[&t, &keep]).await?;
        let created_at: Option<String> = row.try_get(0)?;
        let unique: Option<String> = row.try_get(1)?;
        let foreign: Option<String> = row.try_get(2)?;
        let inherits: bool = row.try_get(3)?;
        let problem = if created_at.as_deref() != Some("timestamp with time zone") {
            Some(format!(
                "its created_at column is {}, not timestamptz NOT NULL",
                created_at.as_deref().unwrap_or("missing")
            ))
        } else if let Some(unique) = unique {
            Some(format!(
                "it has unique indexes besides its primary key ({unique}), which a partitioned table cannot keep without created_at"
            ))
        } else if let Some(foreign) = foreign {
            Some(format!("foreign keys reference it or from it ({foreign})"))
        } else if inherits {
            Some("it takes part in table inheritance".to_owned())
        } else {
            None
        };
        match problem {
            None => Ok(()),
            Some(problem) => Err(StoreError::Schema(format!(
                "database.partition_interval is set, but table {t} cannot be partitioned: {problem}; \
                 change the table, or unset database.partition_interval to keep it plain"
            ))),
        }
    }
}

impl PgStore {
    /// Runs one step of the conversion like a migration step (lock timeout, tries, the
    /// sentence naming who holds the table).
    async fn conversion_step(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        step: super::steps::Step,
    ) -> Result<()> {
        self.run_step(
            client,
            Some(schema),
            super::schema::StepAt::PARTITIONING,
            &step,
        )
        .await
    }
}

/// The old table's name once converted: it stays as the first partition.
fn plain_name(table: &TableName) -> TableName {
    as_table(table.schema.as_deref(), &format!("{}_plain", table.name))
}

/// The `CHECK` constraint that lets the plain table be attached without a scan under lock.
fn bound_constraint(table: &TableName) -> String {
    format!("{}_partition_bound", table.name)
}

/// The index on `(id, created_at)` built before the swap: the partitioned table's primary key.
fn key_index(table: &TableName) -> String {
    format!("{}_id_created_idx", table.name)
}

impl PgStore {
    /// Partitions the plain table. A table created in this run (empty, used by nobody yet) is
    /// replaced in one transaction. An existing one is converted in place, each step
    /// idempotent so that a `migrate` that was interrupted finishes the job:
    /// 1. `CREATE UNIQUE INDEX CONCURRENTLY` on `(id, created_at)` (inserts go on);
    /// 2. a `CHECK (created_at < bound)` added `NOT VALID` (a moment's lock), `bound` at least
    ///    [`CONVERSION_MARGIN`] ahead, then validated in a transaction of its own (reads the
    ///    table under a lock inserts pass);
    /// 3. the swap, one short transaction under `lock_timeout`: the table is renamed
    ///    `<name>_plain` and attached, without a scan thanks to the constraint, as the partition
    ///    `FROM (MINVALUE) TO (bound)` of a new partitioned table of the old name, which takes
    ///    its indexes (attaching the plain table's own), sequence, wake-up trigger and grants,
    ///    and a DEFAULT partition.
    ///
    /// Rows pending and in flight stay in place; relays running on meanwhile find the same
    /// rows by the same statements (theirs are planned again on the new table).
    async fn convert(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        interval: Duration,
        new_table: bool,
        now: DateTime<Utc>,
    ) -> Result<()> {
        if new_table {
            return self.swap(client, None).await;
        }
        let t = self.table.qualified();
        let index = key_index(&self.table);
        self.conversion_step(
            client,
            schema,
            super::steps::Step {
                kind: super::steps::StepKind::Concurrent,
                sql: format!("CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {index} ON {t} (id, created_at);"),
                builds_index: Some(index.clone()),
            },
        )
        .await?;
        let bound = self.conversion_bound(client, schema, interval, now).await?;
        self.swap(client, Some(bound)).await
    }

    /// Step 2 of [`PgStore::convert`]: the bound's constraint, added unless one far enough ahead
    /// is there (from an interrupted run), and validated; returns the bound.
    async fn conversion_bound(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        interval: Duration,
        now: DateTime<Utc>,
    ) -> Result<DateTime<Utc>> {
        let t = self.table.qualified();
        let name = bound_constraint(&self.table);
        let found = client
            .query_opt(
                "SELECT CASE WHEN m ~ '^\\d{4}-\\d\\d-\\d\\d' THEN m::timestamptz END \
                   FROM (SELECT (regexp_match(pg_get_constraintdef(oid), '''([^'']+)'''))[1] AS m \
                           FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2) c",
                &[&t, &name],
            )
            .await?;
        let margin = chrono::Duration::from_std(CONVERSION_MARGIN).unwrap_or_default();
        let found: Option<DateTime<Utc>> = match found {
            Some(row) => row.try_get(0)?,
            None => None,
        };
        let bound = match found {
            Some(bound) if bound > now + margin / 2 => bound,
            _ => {
                let step = chrono::Duration::from_std(interval).unwrap_or_default();
                let bound = align_down(now + margin, interval) + step;
                self.conversion_step(
                    client,
                    schema,
                    super::steps::Step {
                        kind: super::steps::StepKind::Transaction,
                        sql: format!(
                            "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {name};\n\
                             ALTER TABLE {t} ADD CONSTRAINT {name} CHECK (created_at < {}) NOT VALID;",
                            literal(bound)
                        ),
                        builds_index: None,
                    },
                )
                .await?;
                bound
            }
        };
        self.conversion_step(
            client,
            schema,
            super::steps::Step {
                kind: super::steps::StepKind::Transaction,
                sql: format!("ALTER TABLE {t} VALIDATE CONSTRAINT {name};"),
                builds_index: None,
            },
        )
        .await?;
        Ok(bound)
    }

    /// Step 3 of [`PgStore::convert`] (`bound` set), or the replacement of a new table (`None`),
    /// in one transaction under `migrate`'s lock timeout, tried like a migration step.
    async fn swap(
        &self,
        client: &mut deadpool_postgres::Object,
        bound: Option<DateTime<Utc>>,
    ) -> Result<()> {
        let mut attempt = 1;
        loop {
            match self.swap_once(client, bound).await {
                Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                    let holders = self
                        .lock_holders(&*client, super::steps::StepKind::Transaction)
                        .await?;
                    if attempt >= super::schema::LOCK_TRIES {
                        return Err(StoreError::Locked(format!(
                            "could not partition {} (the swap of the plain table for the partitioned one): \
                             a lock it needs was not granted within {} ({} tries), {holders}; the steps before it \
                             are applied and stay so: end or wait for that transaction and run `outbox-relay migrate` again",
                            self.table,
                            super::schema::LOCK_TIMEOUT,
                            super::schema::LOCK_TRIES
                        )));
                    }
                    tracing::warn!(table = %self.table, attempt, "migrate: the lock the partitioning swap needs was not granted, {holders}; retrying");
                    attempt += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                other => return Ok(other?),
            }
        }
    }

    async fn swap_once(
        &self,
        client: &mut deadpool_postgres::Object,
        bound: Option<DateTime<Utc>>,
    ) -> std::result::Result<(), tokio_postgres::Error> {
        let t = self.table.qualified();
        let tx = client.transaction().await?;
        tx.execute(
            "SELECT set_config('lock_timeout', $1, true)",
            &[&super::schema::LOCK_TIMEOUT],
        )
        .await?;
        if let Some(schema) = &self.table.schema {
            tx.execute(
                "SELECT set_config('search_path', quote_ident($1) || ', pg_temp', true)",
                &[schema],
            )
            .await?;
        }
        tx.batch_execute(&format!("LOCK TABLE {t} IN ACCESS EXCLUSIVE MODE"))
            .await?;
        let indexes = tx
            .query(
                "SELECT c.relname::text, pg_get_indexdef(i.indexrelid), i.indisprimary, \
                        (SELECT conname::text FROM pg_constraint k WHERE k.conindid = i.indexrelid AND k.contype = 'p') \
                   FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
                  WHERE i.indrelid = to_regclass($1) ORDER BY 1",
                &[&t],
            )
            .await?;
        let grants = tx
            .query(
                "SELECT a.privilege_type, CASE WHEN a.grantee = 0 THEN 'PUBLIC' \
                        ELSE quote_ident(pg_get_userbyid(a.grantee)) END \
                   FROM pg_class c, aclexplode(c.relacl) a \
                  WHERE c.oid = to_regclass($1) AND a.grantee <> c.relowner",
                &[&t],
            )
            .await?;
        let mut plan = SwapPlan::new(&self.table, bound);
        for r in &indexes {
            plan.index(r.try_get(0)?, r.try_get(1)?, r.try_get(2)?, r.try_get(3)?);
        }
        for r in &grants {
            plan.grant(r.try_get(0)?, r.try_get(1)?);
        }
        tx.batch_execute(&plan.sql()).await?;
        tx.commit().await
    }
}

/// The swap's statements, built from the catalog as found under the table's lock.
struct SwapPlan {
    table: TableName,
    plain: TableName,
    bound: Option<DateTime<Utc>>,
    renames: Vec<String>,
    primary: Option<String>,
    indexes: Vec<String>,
    grants: Vec<String>,
}

impl SwapPlan {
    fn new(table: &TableName, bound: Option<DateTime<Utc>>) -> Self {
        Self {
            table: table.clone(),
            plain: plain_name(table),
            bound,
            renames: Vec::new(),
            primary: None,
            indexes: Vec::new(),
            grants: Vec::new(),
        }
    }

    /// One index of the plain table: the partitioned table gets the same one under the same
    /// name (attaching the plain table's, renamed `<index>_plain`, instead of building one).
    fn index(&mut self, name: String, def: String, primary: bool, constraint: Option<String>) {
        if primary {
            self.primary = constraint.or(Some(name));
            return;
        }
        if name == key_index(&self.table) {
            return;
        }
        let Some((_, tail)) = def.split_once(" USING ") else {
            return;
        };
        let unique = if def.starts_with("CREATE UNIQUE") {
            "UNIQUE "
        } else {
            ""
        };
        let qualified = as_table(self.table.schema.as_deref(), &name).qualified();
        self.renames.push(format!(
            "ALTER INDEX {qualified} RENAME TO {};",
            plain_index(&name)
        ));
        self.indexes.push(format!(
            "CREATE {unique}INDEX {name} ON {} USING {tail};",
            self.table.qualified()
        ));
    }

    fn grant(&mut self, privilege: String, grantee: String) {
        self.grants.push(format!(
            "GRANT {privilege} ON {} TO {grantee};",
            self.table.qualified()
        ));
    }

    fn sql(&self) -> String {
        let (t, name) = (self.table.qualified(), &self.table.name);
        let plain = self.plain.qualified();
        let check = bound_constraint(&self.table);
        let mut sql = vec![format!("ALTER TABLE {t} RENAME TO {};", self.plain.name)];
        if self.bound.is_some() {
            sql.extend(self.renames.iter().cloned());
            if let Some(primary) = &self.primary {
                sql.push(format!("ALTER TABLE {plain} DROP CONSTRAINT {primary};"));
            }
            sql.push(format!(
                "ALTER TABLE {plain} ADD CONSTRAINT {name}_plain_pkey PRIMARY KEY USING INDEX {};",
                key_index(&self.table)
            ));
            sql.push(format!("DROP TRIGGER IF EXISTS {name}_wakeup ON {plain};"));
        }
        sql.push(format!(
            "CREATE TABLE {t} (LIKE {plain} INCLUDING DEFAULTS INCLUDING CONSTRAINTS \
             INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY RANGE (created_at);"
        ));
        sql.push(format!(
            "ALTER TABLE {t} DROP CONSTRAINT IF EXISTS {check};"
        ));
        sql.push(format!(
            "ALTER SEQUENCE {} OWNED BY {t}.seq;",
            self.table.prefixed("_seq")
        ));
        match self.bound {
            Some(bound) => {
                sql.push(format!(
                    "ALTER TABLE {t} ATTACH PARTITION {plain} FOR VALUES FROM (MINVALUE) TO ({});",
                    literal(bound)
                ));
                sql.push(format!("ALTER TABLE {plain} DROP CONSTRAINT {check};"));
            }
            None => sql.push(format!("DROP TABLE {plain};")),
        }
        sql.push(format!(
            "ALTER TABLE {t} ADD CONSTRAINT {name}_pkey PRIMARY KEY (id, created_at);"
        ));
        sql.extend(self.indexes.iter().cloned());
        let default = self.table.prefixed("_default");
        sql.push(format!("CREATE TABLE {default} PARTITION OF {t} DEFAULT;"));
        let default_table = as_table(self.table.schema.as_deref(), &format!("{name}_default"));
        sql.push(storage_settings(&default_table));
        sql.extend(wakeup_trigger(&self.table));
        sql.extend(self.grants.iter().cloned());
        sql.join("\n")
    }
}

/// The plain table's index `name` once the partitioned table takes the name.
fn plain_index(name: &str) -> String {
    format!("{name}_plain")
}

/// Schema version 4's wake-up trigger statements, rendered for `table`: created on the
/// partitioned table, PostgreSQL clones the trigger onto every partition.
fn wakeup_trigger(table: &TableName) -> Vec<String> {
    [DROP_WAKEUP_TRIGGER, WAKEUP_TRIGGER]
        .iter()
        .map(|s| s.for_table(table))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s)
            .unwrap_or_else(|e| panic!("{e}"))
            .with_timezone(&Utc)
    }

    fn range(lo: &str, hi: &str) -> Partition {
        Partition {
            name: format!("p_{lo}"),
            default: false,
            lower: Some(at(lo)),
            upper: Some(at(hi)),
        }
    }

    #[test]
    fn ranges_align_on_the_epoch_and_are_named_by_their_utc_start() {
        let day = Duration::from_secs(86_400);
        assert_eq!(
            align_down(at("2026-11-27T23:59:59Z"), day),
            at("2026-11-27T00:00:00Z")
        );
        let t = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            partition_name(&t, at("2026-11-27T05:30:00Z")),
            "app.events_p20261127_0530"
        );
        assert_eq!(
            literal(at("2026-11-27T05:30:00Z")),
            "'2026-11-27 05:30:00+00'"
        );
    }

    #[test]
    fn missing_ranges_go_on_from_the_newest_partition_to_the_horizon() {
        let hour = Duration::from_secs(3600);
        let mut layout = Layout {
            partitioned: true,
            may_own: true,
            now: at("2026-11-27T10:20:00Z"),
            partitions: vec![range("2026-11-27T10:00:00Z", "2026-11-27T11:00:00Z")],
        };
        let missing = layout.missing_ahead(hour);
        // Two hours ahead of 10:20: up to 12:20, so 11-12 and 12-13.
        assert_eq!(
            missing,
            [
                (at("2026-11-27T11:00:00Z"), at("2026-11-27T12:00:00Z")),
                (at("2026-11-27T12:00:00Z"), at("2026-11-27T13:00:00Z"))
            ]
        );
        // A one-minute interval still keeps ten minutes ahead; nothing is made in the past.
        layout.partitions = vec![range("2026-11-27T09:00:00Z", "2026-11-27T09:01:00Z")];
        let missing = layout.missing_ahead(Duration::from_secs(60));
        assert_eq!(
            missing.first().map(|r| r.0),
            Some(at("2026-11-27T10:20:00Z"))
        );
        assert_eq!(
            missing.last().map(|r| r.1),
            Some(at("2026-11-27T10:30:00Z"))
        );
        assert_eq!(layout.newest_interval(), Some(Duration::from_secs(60)));
    }

    #[test]
    fn a_few_unfinished_rows_are_moved_and_too_many_keep_their_partition_for_the_most_urgent_reason()
     {
        let few = Leftovers {
            failed: 1,
            processing: 2,
            pending: MOVE_AT_MOST - 3,
        };
        assert_eq!(few.keeps(true), None);
        assert_eq!(Leftovers::default().keeps(false), None, "nothing to move");
        assert_eq!(
            few.keeps(false),
            Some(KeptFor::Failed),
            "no DEFAULT to take them"
        );
        let many = Leftovers {
            pending: few.pending + 1,
            ..few
        };
        assert_eq!(many.total(), MOVE_AT_MOST + 1);
        assert_eq!(many.keeps(true), Some(KeptFor::Failed));
        let in_flight = Leftovers {
            failed: 0,
            pending: many.pending + 1,
            ..many
        };
        assert_eq!(in_flight.keeps(true), Some(KeptFor::Processing));
        let behind = Leftovers {
            pending: MOVE_AT_MOST + 1,
            ..Leftovers::default()
        };
        assert_eq!(behind.keeps(true), Some(KeptFor::Pending));
    }
}
