//! Applying the migrations of [`super::migrations`] (their files are `sql/mysql/`); the
//! start-up inspection (server version, the table's columns and payload type).

use mysql_async::Row;
use mysql_async::prelude::Queryable;

use super::claim::column;
pub use super::migrations::{MIGRATIONS, Migration, Statement};
use super::{MysqlStore, Result, StoreError};
use crate::config::TableName;
use crate::message::PayloadKind;
use crate::store::{SchemaPlan, SchemaState};

/// The oldest servers the relay runs on: the first with `SKIP LOCKED` and `NOWAIT`.
const MYSQL_MIN: (u32, u32, u32) = (8, 0, 1);
const MARIADB_MIN: (u32, u32, u32) = (10, 6, 0);

/// Every column the relay reads or writes.
const COLUMNS: &[&str] = &[
    "seq",
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "headers",
    "destination",
    "status",
    "attempts",
    "available_at",
    "locked_at",
    "locked_by",
    "last_error",
    "created_at",
    "sent_at",
    "expires_at",
];

/// Serialises concurrent `migrate`s (a named lock, waited for up to 30 s).
const MIGRATE_LOCK: &str = "SELECT GET_LOCK('outbox-relay:migrate', 30)";
const MIGRATE_UNLOCK: &str = "SELECT RELEASE_LOCK('outbox-relay:migrate')";

/// The version table, in the connection's database.
const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS outbox_relay_schema_version ( \
    table_name VARCHAR(255) NOT NULL PRIMARY KEY, \
    version INT NOT NULL, \
    applied_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB";

/// The whole DDL for `table`, as `migrate --print` shows it.
pub fn full_ddl(table: &TableName) -> String {
    let mut out = String::from("-- MySQL / MariaDB\n");
    for m in MIGRATIONS {
        out.push_str(&format!("-- {} (version {})\n", m.name, m.version));
        out.push_str(&m.render(table));
        out.push('\n');
    }
    out
}

/// `major.minor.patch` at the start of a `VERSION()` string.
fn version_of(text: &str) -> (u32, u32, u32) {
    let mut parts = text
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

/// Why the server `version` (as `VERSION()` prints it) is too old, if it is.
pub fn too_old(version: &str) -> Option<String> {
    let (mariadb, min) = if version.to_ascii_lowercase().contains("mariadb") {
        (true, MARIADB_MIN)
    } else {
        (false, MYSQL_MIN)
    };
    (version_of(version) < min).then(|| {
        format!(
            "the server is {} {version}; outbox-relay needs {} {}.{}.{} or later (SKIP LOCKED and NOWAIT)",
            if mariadb { "MariaDB" } else { "MySQL" },
            if mariadb { "MariaDB" } else { "MySQL" },
            min.0,
            min.1,
            min.2
        )
    })
}

impl MysqlStore {
    /// The schema and table name to look the table up by.
    fn schema_and_name(&self) -> (Option<String>, String) {
        (self.table.schema.clone(), self.table.name.clone())
    }

    /// Whether the table exists and its recorded version (0 when missing or not recorded).
    async fn current(&self, conn: &mut mysql_async::Conn) -> Result<(bool, i32)> {
        let (schema, name) = self.schema_and_name();
        let exists: Option<i64> = conn
            .exec_first(
                "SELECT COUNT(*) FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
                (schema, name),
            )
            .await?;
        let exists = exists.unwrap_or(0) > 0;
        let recorded: Option<i64> = conn
            .query_first(
                "SELECT COUNT(*) FROM information_schema.TABLES \
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outbox_relay_schema_version'",
            )
            .await?;
        let version = if exists && recorded.unwrap_or(0) > 0 {
            conn.exec_first(
                "SELECT version FROM outbox_relay_schema_version WHERE table_name = ?",
                (self.table.qualified(),),
            )
            .await?
            .unwrap_or(0)
        } else {
            0
        };
        Ok((exists, version))
    }

    /// Applies the migrations the table lacks; returns the versions applied. Concurrent
    /// `migrate`s are serialised by a named lock; each statement is idempotent.
    pub async fn migrate(&self) -> Result<Vec<i32>> {
        let mut conn = self.conn().await?;
        self.check_version(&mut conn).await?;
        let locked: Option<i64> = conn.query_first(MIGRATE_LOCK).await?;
        if locked != Some(1) {
            return Err(StoreError::Locked(
                "another `outbox-relay migrate` held the migration lock for 30 s: run `outbox-relay migrate` again".into(),
            ));
        }
        let result = self.apply(&mut conn).await;
        conn.query_drop(MIGRATE_UNLOCK).await?;
        result
    }

    async fn apply(&self, conn: &mut mysql_async::Conn) -> Result<Vec<i32>> {
        conn.query_drop(VERSION_TABLE).await?;
        let (_, version) = self.current(conn).await?;
        let mut applied = Vec::new();
        for m in MIGRATIONS.iter().filter(|m| m.version > version) {
            for stmt in m.statements_for(&self.table) {
                conn.query_drop(stmt).await?;
            }
            // `CREATE TABLE IF NOT EXISTS` leaves a table of that name as it was: one that is
            // not an outbox table is an error, and no version is recorded for it.
            self.shape(conn).await?;
            conn.exec_drop(
                "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES (?, ?) \
                 ON DUPLICATE KEY UPDATE version = VALUES(version), applied_at = NOW(6)",
                (self.table.qualified(), m.version),
            )
            .await?;
            applied.push(m.version);
        }
        Ok(applied)
    }

    /// Fails with a sentence naming the version needed when the server is too old.
    async fn check_version(&self, conn: &mut mysql_async::Conn) -> Result<()> {
        let version: Option<String> = conn.query_first("SELECT VERSION()").await?;
        match version.as_deref().and_then(too_old) {
            Some(why) => Err(StoreError::Schema(why)),
            None => Ok(()),
        }
    }

    /// Whether the table exists and which versions `migrate` would apply.
    pub async fn schema_state(&self) -> Result<SchemaState> {
        let mut conn = self.conn().await?;
        let (table_exists, version) = self.current(&mut conn).await?;
        Ok(SchemaState {
            table_exists,
            pending: MIGRATIONS
                .iter()
                .map(|m| m.version)
                .filter(|&v| v > version)
                .collect(),
            recorded: version > 0,
        })
    }

    /// Whether the relay's user may update and delete the table's rows, as claims and
    /// settles do: both run on no row, in a transaction rolled back (`check`).
    pub async fn may_write(&self) -> Result<()> {
        let t = self.table.qualified();
        let mut conn = self.conn().await?;
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await?;
        // Privileges are checked when a statement starts, whatever rows it then touches.
        tx.query_drop(format!("UPDATE {t} SET status = status WHERE 1 = 0"))
            .await?;
        tx.query_drop(format!("DELETE FROM {t} WHERE 1 = 0"))
            .await?;
        tx.rollback().await?;
        Ok(())
    }

    /// Checks the server's version and the table's columns; returns the payload kind (and 0:
    /// MySQL tables have no oid).
    pub async fn inspect(&self) -> Result<(PayloadKind, u32)> {
        let mut conn = self.conn().await?;
        self.check_version(&mut conn).await?;
        self.shape(&mut conn).await
    }

    /// Checks the table's columns (an error naming what is missing); returns the payload kind
    /// (and 0: MySQL tables have no oid).
    async fn shape(&self, conn: &mut mysql_async::Conn) -> Result<(PayloadKind, u32)> {
        let (schema, name) = self.schema_and_name();
        let t = self.table.qualified();
        let rows: Vec<Row> = conn
            .exec(
                "SELECT COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS \
                 WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
                (schema, name),
            )
            .await?;
        if rows.is_empty() {
            return Err(StoreError::Schema(format!(
                "table {t} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true"
            )));
        }
        let mut found = std::collections::HashMap::new();
        for mut r in rows {
            let name: String = column(&mut r, 0, "COLUMN_NAME")?;
            let ty: String = column(&mut r, 1, "DATA_TYPE")?;
            found.insert(name.to_ascii_lowercase(), ty.to_ascii_lowercase());
        }
        let missing: Vec<&str> = COLUMNS
            .iter()
            .copied()
            .filter(|c| !found.contains_key(*c))
            .collect();
        if !missing.is_empty() {
            return Err(StoreError::Schema(format!(
                "table {t} is not an outbox table: it has no column {} (see sql/mysql/ for the table the relay needs)",
                missing.join(", no column ")
            )));
        }
        let kind = match found.get("payload").map(String::as_str) {
            Some("json" | "longtext" | "mediumtext" | "text") => PayloadKind::Json,
            Some("longblob" | "mediumblob" | "blob" | "varbinary" | "binary") => {
                PayloadKind::Binary
            }
            Some(other) => {
                return Err(StoreError::Schema(format!(
                    "{t}.payload has type {other}; the relay supports JSON and LONGBLOB/VARBINARY"
                )));
            }
            None => return Err(StoreError::Schema(format!("{t} has no payload column"))),
        };
        Ok((kind, 0))
    }

    /// Decides what start-up does about the schema; an error when `run` could not start.
    pub async fn plan_schema(&self, auto_migrate: bool) -> Result<SchemaPlan> {
        let plan = self
            .schema_state()
            .await?
            .plan(&self.table, auto_migrate, false)?;
        if !plan.table_exists {
            self.can_create().await?;
        }
        Ok(plan)
    }

    /// Whether start-up could create the table: its database exists, and the server parses
    /// the `CREATE TABLE` that names it (prepared, never run: a name MySQL reserves fails
    /// here rather than at start).
    async fn can_create(&self) -> Result<()> {
        let mut conn = self.conn().await?;
        let database: Option<String> = conn
            .exec_first(
                "SELECT SCHEMA_NAME FROM information_schema.SCHEMATA \
                  WHERE SCHEMA_NAME = COALESCE(?, DATABASE())",
                (self.table.schema.clone(),),
            )
            .await?;
        if database.is_none() {
            return Err(StoreError::Schema(match &self.table.schema {
                Some(db) => format!(
                    "database {db} (of database.table {}) does not exist: create it, or name one that does",
                    self.table
                ),
                None => "the URL names no database that exists: name one in database.url \
                         (mysql://…/<database>) or in database.table (<database>.<table>)"
                    .to_owned(),
            }));
        }
        let create = MIGRATIONS[0]
            .statements_for(&self.table)
            .into_iter()
            .find(|s| s.trim_start().starts_with("CREATE TABLE"));
        if let Some(create) = create {
            let statement = conn.prep(create).await.map_err(|e| match e {
                mysql_async::Error::Server(s) if s.code == 1064 => StoreError::Schema(format!(
                    "table {} cannot be created: the server does not take its name unquoted \
                     (a word MySQL or MariaDB reserves: order, group, key, …); pick another \
                     name for database.table",
                    self.table
                )),
                e => e.into(),
            })?;
            conn.close(statement).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_without_skip_locked_are_named() {
        assert!(too_old("10.11.19-MariaDB-0+deb12u1").is_none());
        assert!(too_old("8.0.36").is_none());
        assert!(too_old("8.4.0-commercial").is_none());
        let old = too_old("10.5.23-MariaDB").unwrap_or_default();
        assert!(old.contains("MariaDB 10.6.0 or later"), "{old}");
        let old = too_old("5.7.44-log").unwrap_or_default();
        assert!(old.contains("MySQL 8.0.1 or later"), "{old}");
    }
}
