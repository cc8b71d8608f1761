//! Every MySQL schema migration as explicit statements, with the names it uses spelled as
//! placeholders: `{{table}}` the table's name (schema-qualified when configured so), `{{name}}`
//! its bare name (index and constraint names, which MySQL keeps per table and per schema).
//! Each statement keeps the comments before it, so that rendering a migration for the default
//! table gives back its file under `sql/mysql/`, which users copy as it is (a test checks that
//! it does).

use crate::config::TableName;

/// One versioned migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version recorded in `outbox_relay_schema_version` once applied.
    pub version: i32,
    /// Its file under `sql/mysql/`: the migration rendered for the default table.
    pub name: &'static str,
    /// Its statements, in order; `migrate` runs each as it stands (MySQL commits DDL at once).
    pub statements: &'static [Statement],
}

/// One statement of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Statement {
    /// What stands before it in the migration's file: blank lines and comments.
    pub before: &'static str,
    /// The statement without its `;`, names as placeholders (see the module doc).
    pub sql: &'static str,
}

/// `template` for `table`.
fn render(template: &str, table: &TableName) -> String {
    template
        .replace("{{table}}", &table.qualified())
        .replace("{{name}}", &table.name)
}

impl Migration {
    /// Its file rendered for `table`, comments included (what `migrate --print` shows).
    pub fn render(&self, table: &TableName) -> String {
        let mut out = String::new();
        for s in self.statements {
            out.push_str(&render(s.before, table));
            out.push_str(&render(s.sql, table));
            out.push(';');
        }
        out.push('\n');
        out
    }

    /// Its statements for `table`, in order, without their `;`: what `migrate` runs.
    pub fn statements_for(&self, table: &TableName) -> Vec<String> {
        self.statements
            .iter()
            .map(|s| render(s.sql, table))
            .collect()
    }
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    name: "0001_outbox_messages.sql",
    statements: V1,
}];

/// Version 1 (`sql/mysql/0001_outbox_messages.sql`): the table, its indexes and checks.
const V1: &[Statement] = &[Statement {
    before: r#"-- outbox-relay schema version 1 for MySQL 8.0.13+ and MariaDB 10.6+ (InnoDB).
-- Plain, idempotent DDL: copy it into your own migrations, or let `outbox-relay migrate`
-- apply it (it records the version in outbox_relay_schema_version).
--
-- The application's whole integration is one statement in its own transaction:
--   INSERT INTO {{table}} (aggregate_type, aggregate_id, event_type, payload)
--   VALUES ('order', '42', 'order.created', '{"total": 10}');
-- Timestamps are TIMESTAMP(6): stored in UTC whatever the session's time_zone.
"#,
    sql: r#"CREATE TABLE IF NOT EXISTS {{table}} (
    seq            BIGINT        NOT NULL AUTO_INCREMENT,          -- insert order
    id             CHAR(36)      CHARACTER SET ascii NOT NULL DEFAULT (uuid()),  -- message id, for dedup downstream
    aggregate_type VARCHAR(255)  NOT NULL DEFAULT '',
    aggregate_id   VARCHAR(255)  NULL,                             -- NULL: no ordering constraint
    event_type     VARCHAR(255)  NOT NULL,
    payload        JSON          NOT NULL,                         -- LONGBLOB/VARBINARY also accepted (binary formats)
    headers        JSON          NOT NULL DEFAULT ('{}'),          -- copied to message headers
    destination    VARCHAR(1024) NULL,                             -- per-row override of the routing key / topic
    status         VARCHAR(16)   CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    attempts       INT           NOT NULL DEFAULT 0,
    available_at   TIMESTAMP(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    locked_at      TIMESTAMP(6)  NULL DEFAULT NULL,
    locked_by      VARCHAR(255)  NULL,
    last_error     TEXT          NULL,
    created_at     TIMESTAMP(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    sent_at        TIMESTAMP(6)  NULL DEFAULT NULL,
    expires_at     TIMESTAMP(6)  NULL DEFAULT NULL,                -- not published after it
    PRIMARY KEY (seq),
    UNIQUE KEY {{name}}_id_idx (id),
    -- The claim (pending rows in seq order), retention and the gauges: InnoDB appends the
    -- primary key, so this is (status, seq).
    KEY {{name}}_status_idx (status),
    -- Ordering: an aggregate's open rows before a given seq, read with a locking probe.
    KEY {{name}}_aggregate_idx (aggregate_type, aggregate_id, status, seq),
    CONSTRAINT {{name}}_status_check
        CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'expired')),
    CONSTRAINT {{name}}_id_check
        CHECK (id REGEXP '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$')
) ENGINE = InnoDB"#,
}];

#[cfg(test)]
mod tests {
    use super::*;

    /// The files under `sql/mysql/`, in version order.
    const FILES: &[(&str, &str)] = &[(
        "0001_outbox_messages.sql",
        include_str!("../../../sql/mysql/0001_outbox_messages.sql"),
    )];

    #[test]
    fn each_migration_rendered_for_the_default_table_is_its_file() {
        let table = TableName::parse("outbox_messages").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(MIGRATIONS.len(), FILES.len());
        for (m, (name, text)) in MIGRATIONS.iter().zip(FILES) {
            assert_eq!(m.name, *name);
            assert_eq!(m.render(&table), *text, "{name}");
        }
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }

    /// Rendered for another table, the file reads as the default one's with the table's names
    /// in place of `outbox_messages`: derived names (`outbox_messages_…`) get the bare name,
    /// every other reference the qualified one.
    #[test]
    fn a_migration_renders_for_a_qualified_table() {
        let t = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        for (m, (_, text)) in MIGRATIONS.iter().zip(FILES) {
            let expected = text
                .replace("outbox_messages_", "events_")
                .replace("outbox_messages", "app.events");
            assert_eq!(m.render(&t), expected, "{}", m.name);
        }
        let stmts = MIGRATIONS[0].statements_for(&t);
        assert_eq!(stmts.len(), 1, "{stmts:?}");
        let s = &stmts[0];
        assert!(
            s.starts_with("CREATE TABLE IF NOT EXISTS app.events ("),
            "{s}"
        );
        assert!(s.contains("KEY events_aggregate_idx"), "{s}");
        assert!(s.contains("CONSTRAINT events_status_check"), "{s}");
        assert!(!s.contains("outbox_messages") && !s.contains("{{"), "{s}");
    }
}
