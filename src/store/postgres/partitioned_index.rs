//! Replacing an index of a partitioned table while the application inserts: PostgreSQL builds
//! no index `CONCURRENTLY` on a partitioned table, so `migrate` makes the new index on the
//! table alone (`CREATE INDEX … ON ONLY`: INVALID, a change to the catalog only), builds it
//! concurrently on each partition and attaches each; the table's index becomes valid once
//! every partition has one attached. Then the old index, if the version replaces one, is
//! dropped under a moment's lock (PostgreSQL drops no partitioned index concurrently). Each step is idempotent, so a
//! `migrate` that was interrupted picks up where it stopped.

use super::migrations::IndexSwap;
use super::schema::StepAt;
use super::steps::{Step, StepKind, render};
use super::{PgStore, Result, StoreError};

/// PostgreSQL's longest name, in bytes: a longer one is cut short (with a notice).
const NAME_MAX: usize = 63;

/// How many times the partitions are listed for ones that lack the index: a partition the
/// relay creates meanwhile gets the table's index as it is made, so a second round is rare.
const ROUNDS: usize = 5;

/// The partitions of table `$1` that have no index attached to the partitioned index `$2`:
/// their name, schema-qualified name, oid and schema (quoted).
const WITHOUT_INDEX: &str = "SELECT c.relname::text, format('%I.%I', n.nspname, c.relname), c.oid::bigint, \
             format('%I', n.nspname) \
       FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
       JOIN pg_namespace n ON n.oid = c.relnamespace \
      WHERE i.inhparent = to_regclass($1) \
        AND NOT EXISTS (SELECT 1 FROM pg_index x JOIN pg_inherits a ON a.inhrelid = x.indexrelid \
                         WHERE x.indrelid = c.oid AND a.inhparent = to_regclass($2)) \
      ORDER BY c.relname";

/// One index attached to the partitioned index `$1`, schema-qualified.
const ATTACHED: &str = "SELECT format('%I.%I', n.nspname, c.relname) \
       FROM pg_inherits a JOIN pg_class c ON c.oid = a.inhrelid \
       JOIN pg_namespace n ON n.oid = c.relnamespace \
      WHERE a.inhparent = to_regclass($1) LIMIT 1";

/// Whether the index `$1` is valid.
const VALID: &str =
    "SELECT coalesce((SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)), false)";

/// `name` as a quoted identifier.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The name of a partition's own index `suffix` (`_waiting_idx`): after the partition, or,
/// when that would be longer than PostgreSQL keeps, after as much of it as fits and its oid.
fn partition_index_name(partition: &str, oid: i64, suffix: &str) -> String {
    let whole = format!("{partition}{suffix}");
    if whole.len() <= NAME_MAX {
        return whole;
    }
    let tail = format!("_{oid}{suffix}");
    let mut cut = NAME_MAX.saturating_sub(tail.len());
    while !partition.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}{tail}", &partition[..cut])
}

/// What a swap builds on a table: the index's name, bare and qualified, and the suffix its
/// partitions' indexes are named with.
struct Names {
    index: String,
    qualified: String,
    suffix: String,
}

/// How many steps a version that makes `swap` has on a partitioned table, as its log lines
/// count them: the table's index (`ON ONLY`), the partitions' indexes (one step, however many
/// partitions), the drop of the index it replaces if it replaces one, and the version's
/// record.
fn swap_phases(swap: &IndexSwap) -> usize {
    3 + usize::from(swap.drops.is_some())
}

/// Where the record of version `version`, which makes `swap`, is among its steps on a
/// partitioned table: the last.
pub(super) fn record_at(version: i32, swap: &IndexSwap) -> StepAt {
    let steps = swap_phases(swap);
    StepAt::of(version, steps - 1, steps)
}

/// A step of `kind` running `sql`.
fn step(kind: StepKind, sql: String, builds_index: Option<String>) -> Step {
    Step {
        kind,
        sql,
        builds_index,
    }
}

impl PgStore {
    /// Applies `swap` to the partitioned table in `schema` as version `version`'s steps.
    pub(super) async fn swap_partitioned_index(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        version: i32,
        swap: &IndexSwap,
    ) -> Result<()> {
        let t = self.table.qualified();
        let index = render(swap.builds, &self.table, true);
        let names = Names {
            qualified: match &self.table.schema {
                Some(s) => format!("{s}.{index}"),
                None => format!("{}.{index}", quoted(schema)),
            },
            suffix: index
                .strip_prefix(self.table.name.as_str())
                .unwrap_or("_idx")
                .to_owned(),
            index,
        };
        let on_only = format!(
            "CREATE INDEX IF NOT EXISTS {} ON ONLY {t} {};",
            names.index, swap.definition
        );
        let on_only = step(StepKind::Transaction, on_only, None);
        let phases = swap_phases(swap);
        self.run_step(
            client,
            Some(schema),
            StepAt::of(version, 0, phases),
            &on_only,
        )
        .await?;
        for _ in 0..ROUNDS {
            if !self
                .index_partitions(client, schema, version, swap, &names)
                .await?
            {
                break;
            }
        }
        if !self
            .revalidated(client, schema, StepAt::of(version, 1, phases), &names)
            .await?
        {
            return Err(StoreError::Schema(format!(
                "index {} of {t} is not valid after {ROUNDS} rounds of attaching the \
                 partitions' indexes (partitions kept appearing, or one of them is partitioned \
                 itself): run `outbox-relay migrate` again",
                names.qualified
            )));
        }
        let Some(drops) = swap.drops else {
            return Ok(());
        };
        let drop = format!("DROP INDEX IF EXISTS {};", render(drops, &self.table, true));
        let drop = step(StepKind::Transaction, drop, None);
        self.run_step(client, Some(schema), StepAt::of(version, 2, phases), &drop)
            .await
    }

    /// Whether the table's index is valid, once more made so when every partition has its
    /// index attached but the table's stayed INVALID (the last partition that lacked one was
    /// detached or dropped meanwhile): attaching an attached index again has PostgreSQL
    /// check the table's.
    async fn revalidated(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        at: StepAt,
        names: &Names,
    ) -> Result<bool> {
        if client
            .query_one(VALID, &[&names.qualified])
            .await?
            .try_get(0)?
        {
            return Ok(true);
        }
        let Some(row) = client.query_opt(ATTACHED, &[&names.qualified]).await? else {
            return Ok(false);
        };
        let child: String = row.try_get(0)?;
        let attach = format!("ALTER INDEX {} ATTACH PARTITION {child};", names.qualified);
        let attach = step(StepKind::Transaction, attach, None);
        self.run_step(client, Some(schema), at, &attach).await?;
        Ok(client
            .query_one(VALID, &[&names.qualified])
            .await?
            .try_get(0)?)
    }

    /// Builds and attaches the index of each partition that has none attached to the table's;
    /// whether there was any.
    async fn index_partitions(
        &self,
        client: &mut deadpool_postgres::Object,
        schema: &str,
        version: i32,
        swap: &IndexSwap,
        names: &Names,
    ) -> Result<bool> {
        let t = self.table.qualified();
        let missing = client.query(WITHOUT_INDEX, &[&t, &names.qualified]).await?;
        for row in &missing {
            let name: String = row.try_get(0)?;
            let partition: String = row.try_get(1)?;
            let own = partition_index_name(&name, row.try_get(2)?, &names.suffix);
            let own_schema: String = row.try_get(3)?;
            let at = StepAt::of(version, 1, swap_phases(swap));
            let build = format!(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS {} ON {partition} {};",
                quoted(&own),
                swap.definition
            );
            let build = step(StepKind::Concurrent, build, Some(own.clone()));
            self.run_step(client, Some(schema), at, &build).await?;
            let attach = format!(
                "ALTER INDEX {} ATTACH PARTITION {own_schema}.{};",
                names.qualified,
                quoted(&own)
            );
            let attach = step(StepKind::Transaction, attach, None);
            self.run_step(client, Some(schema), at, &attach).await?;
        }
        Ok(!missing.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::migrations::MIGRATIONS;

    #[test]
    fn a_partition_index_name_fits_and_stays_apart() {
        assert_eq!(
            partition_index_name("outbox_messages_p20261130", 42, "_waiting_idx"),
            "outbox_messages_p20261130_waiting_idx"
        );
        let long = "a".repeat(60);
        let one = partition_index_name(&format!("{long}_1"), 16384, "_waiting_idx");
        let two = partition_index_name(&format!("{long}_2"), 16385, "_waiting_idx");
        assert!(
            one.len() <= NAME_MAX && two.len() <= NAME_MAX,
            "{one} {two}"
        );
        assert_ne!(one, two);
        assert!(one.ends_with("_16384_waiting_idx"), "{one}");
    }

    #[test]
    fn the_partitioned_swap_builds_what_the_file_builds() {
        for m in MIGRATIONS {
            let Some(swap) = m.on_partitions else {
                continue;
            };
            let sql: String = m.statements.iter().map(|s| s.sql).collect();
            assert!(sql.contains(swap.builds), "version {}", m.version);
            assert!(sql.contains(swap.definition), "version {}", m.version);
            if let Some(drops) = swap.drops {
                assert!(sql.contains(drops), "version {}", m.version);
            }
        }
    }
}
