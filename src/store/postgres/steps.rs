//! The steps `migrate` runs a migration in, one after the other, so that no transaction holds
//! a lock that blocks the application's inserts while it reads the table. Each statement of a
//! migration says how it runs ([`Runs`], declared in [`super::migrations`]):
//! - an index statement that PostgreSQL refuses in a transaction block (`CREATE INDEX
//!   CONCURRENTLY`, `DROP INDEX CONCURRENTLY`) is a step of its own, run outside any
//!   transaction: it builds or drops the index while inserts go on;
//! - `ALTER TABLE … VALIDATE CONSTRAINT` is a transaction of its own: it reads every row under
//!   a lock that lets inserts through, which it must not do while holding the `ACCESS
//!   EXCLUSIVE` lock the statements before it (adding a column or a `NOT VALID` constraint)
//!   take for a moment;
//! - the statements between them run together in one transaction.
//!
//! A table that `migrate` creates in the same run is empty and used by nobody yet: each version
//! is then one transaction and its index statements lose `CONCURRENTLY` (a concurrent build
//! waits for every older transaction of the database, which on a new table buys nothing).

use crate::config::TableName;

/// How a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// In a transaction of its own.
    Transaction,
    /// Alone, outside any transaction block (a `CONCURRENTLY` statement).
    Concurrent,
}

/// One step of a migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// How it runs.
    pub kind: StepKind,
    /// Its statements, each ended by `;`.
    pub sql: String,
    /// The index a concurrent build creates (its name as written): an INVALID index of that
    /// name, left by an interrupted build, is dropped before the build.
    pub builds_index: Option<String>,
}

impl Step {
    /// How the step begins, quoted (`which begins with …`), for logs and errors: the words
    /// of its first statement, which need not be the one that waited.
    pub fn summary(&self) -> String {
        let words: Vec<&str> = self.sql.split_whitespace().take(9).collect();
        let mut text = words.join(" ");
        if let Some(pos) = text.find(['(', ';']) {
            text.truncate(pos);
        }
        format!("`{} …`", text.trim_end())
    }
}

/// How `migrate` runs a statement of a migration (declared with it, in
/// [`super::migrations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// In one transaction with the statements around it.
    WithOthers,
    /// In a transaction of its own (`VALIDATE CONSTRAINT`: it reads every row).
    OwnTransaction,
    /// Alone, outside any transaction block (an index statement `{{concurrently}}`);
    /// `builds`: the index it creates, when it creates one.
    Alone {
        /// The index's name (a template, see [`Statement::sql`]).
        builds: Option<&'static str>,
    },
}

/// One statement of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Statement {
    /// What stands before it in the migration's file: blank lines and comments.
    pub before: &'static str,
    /// The statement without its `;`, names as placeholders: `{{table}}` the table (qualified
    /// when configured so), `{{name}}` its bare name, `{{concurrently}}` `CONCURRENTLY` or
    /// nothing.
    pub sql: &'static str,
    /// How it runs.
    pub runs: Runs,
}

/// `template` for `table`; `concurrently`: an index statement that runs alone keeps its
/// `CONCURRENTLY`.
pub fn render(template: &str, table: &TableName, concurrently: bool) -> String {
    template
        .replace("{{table}}", &table.qualified())
        .replace("{{name}}", &table.name)
        .replace(
            "{{concurrently}}",
            if concurrently { "CONCURRENTLY" } else { "" },
        )
}

impl Statement {
    /// The statement for `table`, ended by `;`, as it runs on an existing table.
    pub fn for_table(&self, table: &TableName) -> String {
        format!("{};", render(self.sql, table, true))
    }
}

/// The migration of `statements` as its file reads, rendered for `table` (its comments too).
pub fn file(statements: &[Statement], table: &TableName) -> String {
    let mut out = String::new();
    for statement in statements {
        out.push_str(&render(statement.before, table, true));
        out.push_str(&statement.for_table(table));
    }
    out.push('\n');
    out
}

/// The steps of a migration's `statements` for `table`; `new_table` when the table is created
/// in the same run (then the whole migration is one transaction, see the module doc).
pub fn steps(statements: &[Statement], table: &TableName, new_table: bool) -> Vec<Step> {
    let mut out = Vec::new();
    let mut group = String::new();
    let flush = |group: &mut String, out: &mut Vec<Step>| {
        if !group.is_empty() {
            out.push(Step {
                kind: StepKind::Transaction,
                sql: std::mem::take(group),
                builds_index: None,
            });
        }
    };
    for statement in statements {
        let sql = render(statement.sql, table, !new_table);
        match statement.runs {
            _ if new_table => {
                group.push_str(&sql);
                group.push_str(";\n");
            }
            Runs::Alone { builds } => {
                flush(&mut group, &mut out);
                out.push(Step {
                    kind: StepKind::Concurrent,
                    sql: format!("{sql};"),
                    builds_index: builds.map(|name| render(name, table, true)),
                });
            }
            Runs::OwnTransaction => {
                flush(&mut group, &mut out);
                group.push_str(&sql);
                group.push(';');
                flush(&mut group, &mut out);
            }
            Runs::WithOthers => {
                group.push_str(&sql);
                group.push_str(";\n");
            }
        }
    }
    flush(&mut group, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-2-like migration: a column, a constraint added `NOT VALID` then validated,
    /// two index statements that run alone, and a setting.
    const MIGRATION: &[Statement] = &[
        Statement {
            before: "-- a header\n",
            sql: "ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS e timestamptz NULL",
            runs: Runs::WithOthers,
        },
        Statement {
            before: "\n",
            sql: "ALTER TABLE {{table}} ADD CONSTRAINT {{name}}_c CHECK (x) NOT VALID",
            runs: Runs::WithOthers,
        },
        Statement {
            before: "\n",
            sql: "ALTER TABLE {{table}} VALIDATE CONSTRAINT {{name}}_c",
            runs: Runs::OwnTransaction,
        },
        Statement {
            before: "\n-- the index\n",
            sql: "CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_open_idx\n    ON {{table}} (a) WHERE b",
            runs: Runs::Alone {
                builds: Some("{{name}}_open_idx"),
            },
        },
        Statement {
            before: "\n",
            sql: "DROP INDEX {{concurrently}} IF EXISTS {{table}}_old_idx",
            runs: Runs::Alone { builds: None },
        },
        Statement {
            before: "\n",
            sql: "ALTER TABLE {{table}} SET (fillfactor = 90)",
            runs: Runs::WithOthers,
        },
    ];

    #[test]
    fn index_builds_run_alone_and_validation_in_its_own_transaction() {
        let t = TableName::parse("s.t").unwrap();
        let steps = steps(MIGRATION, &t, false);
        let kinds: Vec<StepKind> = steps.iter().map(|s| s.kind).collect();
        use StepKind::{Concurrent as C, Transaction as T};
        assert_eq!(kinds, [T, T, C, C, T]);
        assert_eq!(
            steps[0].sql,
            "ALTER TABLE s.t ADD COLUMN IF NOT EXISTS e timestamptz NULL;\n\
             ALTER TABLE s.t ADD CONSTRAINT t_c CHECK (x) NOT VALID;\n"
        );
        assert_eq!(steps[1].sql, "ALTER TABLE s.t VALIDATE CONSTRAINT t_c;");
        assert_eq!(steps[2].builds_index.as_deref(), Some("t_open_idx"));
        assert_eq!(
            steps[2].summary(),
            "`CREATE INDEX CONCURRENTLY IF NOT EXISTS t_open_idx ON s.t …`"
        );
        assert_eq!(
            steps[3].sql,
            "DROP INDEX CONCURRENTLY IF EXISTS s.t_old_idx;"
        );
        assert_eq!(steps[3].builds_index, None);
        assert_eq!(steps[4].sql, "ALTER TABLE s.t SET (fillfactor = 90);\n");
    }

    #[test]
    fn a_new_table_gets_one_transaction_without_concurrently() {
        let t = TableName::parse("s.t").unwrap();
        let steps = steps(MIGRATION, &t, true);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].kind, StepKind::Transaction);
        assert!(!steps[0].sql.contains("CONCURRENTLY"), "{}", steps[0].sql);
        assert!(
            steps[0]
                .sql
                .contains("CREATE INDEX  IF NOT EXISTS t_open_idx")
        );
        assert!(steps[0].sql.contains("DROP INDEX  IF EXISTS s.t_old_idx;"));
    }

    #[test]
    fn the_file_is_every_statement_with_what_stands_before_it() {
        let t = TableName::parse("t").unwrap();
        let text = file(&MIGRATION[3..5], &t);
        assert_eq!(
            text,
            "\n-- the index\nCREATE INDEX CONCURRENTLY IF NOT EXISTS t_open_idx\n    ON t (a) WHERE b;\
             \nDROP INDEX CONCURRENTLY IF EXISTS t_old_idx;\n"
        );
    }
}
