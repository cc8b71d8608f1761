//! A migration file cut into the steps `migrate` runs one after the other, so that no
//! transaction holds a lock that blocks the application's inserts while it reads the table.
//!
//! The file's statements (split at the `;` outside quotes, dollar quotes and comments) are
//! grouped:
//! - a statement PostgreSQL refuses in a transaction block (`CREATE INDEX CONCURRENTLY`,
//!   `DROP INDEX CONCURRENTLY`) is a step of its own, run outside any transaction: it builds or
//!   drops the index while inserts go on;
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
    /// The start of its first statement, for logs and errors.
    pub fn summary(&self) -> String {
        let words: Vec<&str> = self.sql.split_whitespace().take(9).collect();
        let mut text = words.join(" ");
        if let Some(pos) = text.find(['(', ';']) {
            text.truncate(pos);
        }
        text.trim_end().to_owned()
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

/// The statements of `sql`, without their leading comments and trailing `;`.
pub fn statements(sql: &str) -> Vec<&str> {
    let bytes = sql.as_bytes();
    let (mut out, mut start, mut i) = (Vec::new(), 0, 0);
    while i < bytes.len() {
        i = match bytes[i] {
            b';' => {
                out.push(&sql[start..i]);
                start = i + 1;
                i + 1
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                sql[i..].find('\n').map_or(bytes.len(), |n| i + n + 1)
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => sql[i + 2..]
                .find("*/")
                .map_or(bytes.len(), |n| i + 2 + n + 2),
            q @ (b'\'' | b'"') => sql[i + 1..]
                .find(q as char)
                .map_or(bytes.len(), |n| i + 1 + n + 1),
            b'$' => skip_dollar_quote(sql, i),
            _ => i + 1,
        };
    }
    out.push(&sql[start..]);
    out.into_iter()
        .map(strip_leading_comments)
        .filter(|s| !s.is_empty())
        .collect()
}

/// Past the dollar-quoted string starting at `at` (`$tag$ … $tag$`), or just past the `$`.
fn skip_dollar_quote(sql: &str, at: usize) -> usize {
    let after_word = sql[..at]
        .chars()
        .next_back()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let rest = &sql[at + 1..];
    let tag_len = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let is_quote = !after_word
        && rest[tag_len..].starts_with('$')
        && !rest.starts_with(|c: char| c.is_ascii_digit());
    if !is_quote {
        return at + 1;
    }
    let tag = &sql[at..at + tag_len + 2];
    let body = at + tag.len();
    sql[body..]
        .find(tag)
        .map_or(sql.len(), |n| body + n + tag.len())
}

/// `statement` without the whitespace and comments before it and the whitespace after it.
fn strip_leading_comments(mut statement: &str) -> &str {
    loop {
        statement = statement.trim();
        if statement.starts_with("--") {
            statement = statement.split_once('\n').map_or("", |(_, rest)| rest);
        } else if let Some(rest) = statement.strip_prefix("/*") {
            statement = rest.split_once("*/").map_or("", |(_, rest)| rest);
        } else {
            return statement;
        }
    }
}

/// The first `n` words of `statement`, upper-cased.
fn head(statement: &str, n: usize) -> Vec<String> {
    statement
        .split_whitespace()
        .take(n)
        .map(str::to_ascii_uppercase)
        .collect()
}

/// Whether `statement` cannot run in a transaction block (a `CONCURRENTLY` index statement).
fn is_concurrent(statement: &str) -> bool {
    let h = head(statement, 4);
    let h: Vec<&str> = h.iter().map(String::as_str).collect();
    matches!(
        h.as_slice(),
        ["CREATE" | "DROP", "INDEX", "CONCURRENTLY", ..]
            | ["CREATE", "UNIQUE", "INDEX", "CONCURRENTLY", ..]
    )
}

/// Whether `statement` validates a constraint (reads the whole table).
fn is_validation(statement: &str) -> bool {
    let words = head(statement, usize::MAX);
    words.first().is_some_and(|w| w == "ALTER")
        && words
            .windows(2)
            .any(|w| w[0] == "VALIDATE" && w[1] == "CONSTRAINT")
}

/// The index `CREATE [UNIQUE] INDEX CONCURRENTLY [IF NOT EXISTS] name` builds.
fn built_index(statement: &str) -> Option<String> {
    let words: Vec<&str> = statement.split_whitespace().take(9).collect();
    let upper: Vec<String> = words.iter().map(|w| w.to_ascii_uppercase()).collect();
    if upper.first().map(String::as_str) != Some("CREATE") {
        return None;
    }
    let mut at = upper.iter().position(|w| w == "CONCURRENTLY")? + 1;
    if upper
        .get(at..at + 3)
        .is_some_and(|w| w == ["IF", "NOT", "EXISTS"])
    {
        at += 3;
    }
    let name = words.get(at)?;
    let plain = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    (plain && !name.eq_ignore_ascii_case("ON")).then(|| (*name).to_owned())
}

/// `statement` without its `CONCURRENTLY` keyword (for a table created in this run).
fn without_concurrently(statement: &str) -> String {
    match statement.to_ascii_uppercase().find("CONCURRENTLY") {
        Some(pos) => format!("{}{}", &statement[..pos], &statement[pos + 12..]),
        None => statement.to_owned(),
    }
}

/// The steps of `sql` (one rendered migration file); `new_table` when the table is created in
/// the same run (then the whole file is one transaction, see the module doc).
pub fn old_steps(sql: &str, new_table: bool) -> Vec<Step> {
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
    for statement in statements(sql) {
        if new_table {
            group.push_str(&without_concurrently(statement));
            group.push_str(";\n");
        } else if is_concurrent(statement) {
            flush(&mut group, &mut out);
            out.push(Step {
                kind: StepKind::Concurrent,
                sql: format!("{statement};"),
                builds_index: built_index(statement),
            });
        } else if is_validation(statement) {
            flush(&mut group, &mut out);
            group.push_str(statement);
            group.push(';');
            flush(&mut group, &mut out);
        } else {
            group.push_str(statement);
            group.push_str(";\n");
        }
    }
    flush(&mut group, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_split_outside_quotes_dollar_quotes_and_comments() {
        let sql = "-- a comment; with a semicolon\nCREATE TABLE t (a text DEFAULT 'x;y');\n\
                   CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$\nBEGIN RETURN 1; END\n$$;\n\
                   /* block; */ SELECT $1, \"we;ird\" FROM t; -- trailing\n";
        assert_eq!(
            statements(sql),
            [
                "CREATE TABLE t (a text DEFAULT 'x;y')",
                "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$\nBEGIN RETURN 1; END\n$$",
                "SELECT $1, \"we;ird\" FROM t",
            ]
        );
    }

    #[test]
    fn dollar_quotes_with_a_tag_end_at_the_same_tag() {
        let sql = "DO $body$ BEGIN PERFORM '$$;'; END $body$; SELECT 1";
        assert_eq!(
            statements(sql),
            ["DO $body$ BEGIN PERFORM '$$;'; END $body$", "SELECT 1"]
        );
    }

    const FILE: &str = "ALTER TABLE t ADD COLUMN IF NOT EXISTS e timestamptz NULL;\n\
        ALTER TABLE t ADD CONSTRAINT c CHECK (x) NOT VALID;\n\
        ALTER TABLE t VALIDATE CONSTRAINT c;\n\
        -- the index\n\
        CREATE INDEX CONCURRENTLY IF NOT EXISTS t_open_idx\n    ON t (a) WHERE b;\n\
        DROP INDEX CONCURRENTLY IF EXISTS s.t_old_idx;\n\
        ALTER TABLE t SET (fillfactor = 90);\n";

    #[test]
    fn index_builds_run_alone_and_validation_in_its_own_transaction() {
        let steps = old_steps(FILE, false);
        let kinds: Vec<StepKind> = steps.iter().map(|s| s.kind).collect();
        use StepKind::{Concurrent as C, Transaction as T};
        assert_eq!(kinds, [T, T, C, C, T]);
        assert!(steps[0].sql.contains("ADD COLUMN") && steps[0].sql.contains("NOT VALID"));
        assert!(!steps[0].sql.contains("VALIDATE"));
        assert_eq!(steps[1].sql, "ALTER TABLE t VALIDATE CONSTRAINT c;");
        assert_eq!(steps[2].builds_index.as_deref(), Some("t_open_idx"));
        assert_eq!(
            steps[2].summary(),
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS t_open_idx ON t"
        );
        assert_eq!(steps[3].builds_index, None);
        assert_eq!(steps[4].sql, "ALTER TABLE t SET (fillfactor = 90);\n");
    }

    #[test]
    fn a_new_table_gets_one_transaction_without_concurrently() {
        let steps = old_steps(FILE, true);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].kind, StepKind::Transaction);
        assert!(!steps[0].sql.to_ascii_uppercase().contains("CONCURRENTLY"));
        assert!(
            steps[0]
                .sql
                .contains("CREATE INDEX  IF NOT EXISTS t_open_idx")
        );
        assert!(steps[0].sql.contains("DROP INDEX  IF EXISTS s.t_old_idx;"));
    }

    #[test]
    fn built_index_names_only_what_a_concurrent_create_builds() {
        assert_eq!(
            built_index("CREATE UNIQUE INDEX CONCURRENTLY i ON t (a)").as_deref(),
            Some("i")
        );
        assert_eq!(built_index("CREATE INDEX CONCURRENTLY ON t (a)"), None);
        assert_eq!(built_index("DROP INDEX CONCURRENTLY i"), None);
    }
}

#[cfg(test)]
mod equivalence {
    use super::*;
    use crate::store::postgres::migrations::MIGRATIONS;
    use crate::store::postgres::schema::old_render;

    #[test]
    fn explicit_steps_render_as_the_files_did() {
        for m in MIGRATIONS {
            let path = format!("{}/sql/{}", env!("CARGO_MANIFEST_DIR"), m.name);
            let old = std::fs::read_to_string(path).unwrap();
            for name in [
                "outbox_messages",
                "events",
                "app.events",
                "zzschema.zztable",
            ] {
                let t = TableName::parse(name).unwrap();
                let rendered = old_render(&old, &t);
                assert_eq!(file(m.statements, &t), rendered, "v{} {name}", m.version);
                for new_table in [false, true] {
                    assert_eq!(
                        steps(m.statements, &t, new_table),
                        old_steps(&rendered, new_table),
                        "v{} {name} {new_table}",
                        m.version
                    );
                }
            }
        }
    }
}
