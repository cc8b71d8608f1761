//! The statements as checked in under `sql/statements/<database>/`: one file per statement the
//! store renders (for the default table), laid out one clause per line, so that a review reads
//! each statement whole. A unit test of each store compares what the code renders with the
//! files; `OUTBOX_WRITE_SQL=1 cargo test --lib statements` writes them again after a change.

use std::collections::BTreeSet;
use std::path::PathBuf;

/// Words that start a new line when outside a string literal and at a word boundary.
const BREAK_BEFORE: &[&str] = &[
    "WITH ",
    "SELECT ",
    "FROM ",
    "WHERE ",
    "AND ",
    "OR ",
    "ORDER BY ",
    "GROUP BY ",
    "LIMIT ",
    "FOR UPDATE",
    "UPDATE ",
    "SET ",
    "DELETE ",
    "INSERT ",
    "VALUES ",
    "RETURNING ",
    "LEFT JOIN ",
    "JOIN ",
    "UNION ",
    "ON CONFLICT ",
];

/// `sql` with runs of whitespace outside string literals made one space, and a line break
/// (indented two spaces per open parenthesis) before each clause keyword.
pub(crate) fn layout(sql: &str) -> String {
    let mut flat = String::with_capacity(sql.len());
    let mut quoted = false;
    for c in sql.chars() {
        if c == '\'' {
            quoted = !quoted;
        }
        if !quoted && c.is_whitespace() {
            if !flat.ends_with(' ') && !flat.is_empty() {
                flat.push(' ');
            }
        } else {
            flat.push(c);
        }
    }
    let flat = flat.trim();
    let mut out = String::with_capacity(flat.len() + 64);
    let (mut depth, mut quoted) = (0usize, false);
    for (i, c) in flat.char_indices() {
        let before = &flat[..i];
        let boundary = i > 0
            && before.ends_with([' ', '('])
            && !["FOR ", "LEFT ", "CROSS ", "INNER "]
                .iter()
                .any(|w| before.ends_with(w));
        if !quoted && boundary && BREAK_BEFORE.iter().any(|k| flat[i..].starts_with(k)) {
            while out.ends_with(' ') {
                out.pop();
            }
            out.push('\n');
            out.push_str(&"  ".repeat(depth));
        }
        match c {
            '\'' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth = depth.saturating_sub(1),
            _ => {}
        }
        out.push(c);
    }
    out.push('\n');
    out
}

/// Compares `catalog` (name, statement) with the files in `sql/statements/<database>/`
/// (`<name>.sql`), or writes them when `OUTBOX_WRITE_SQL` is set. Panics (a test) naming each
/// statement that differs, is missing or is left over.
pub(crate) fn check(database: &str, catalog: &[(String, String)]) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("sql/statements")
        .join(database);
    let write = std::env::var_os("OUTBOX_WRITE_SQL").is_some();
    if write {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    }
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    for (name, sql) in catalog {
        assert!(names.insert(name.clone()), "statement {name} listed twice");
        let path = dir.join(format!("{name}.sql"));
        let want = layout(sql);
        if write {
            std::fs::write(&path, &want).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(have) if have == want => {}
            Ok(_) => problems.push(format!("{name}.sql differs from what the code renders")),
            Err(_) => problems.push(format!("{name}.sql is missing")),
        }
    }
    let present = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    for file in present {
        let stem = file.strip_suffix(".sql").unwrap_or(&file);
        if !names.contains(stem) {
            problems.push(format!("{file} is no statement the code renders"));
        }
    }
    assert!(
        problems.is_empty(),
        "sql/statements/{database}/: {}; run `OUTBOX_WRITE_SQL=1 cargo test --lib statements` and review the diff",
        problems.join("; ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clauses_start_lines_and_literals_are_left_alone() {
        let sql = "WITH c AS ( SELECT id FROM t WHERE a = 'x  AND y' AND b <= now()   ORDER BY seq \
                   LIMIT $1 FOR UPDATE SKIP LOCKED) UPDATE t SET s = 1 WHERE t.id = ANY(ARRAY(SELECT id FROM c))";
        assert_eq!(
            layout(sql),
            "WITH c AS (\n  SELECT id\n  FROM t\n  WHERE a = 'x  AND y'\n  AND b <= now()\n  \
             ORDER BY seq\n  LIMIT $1\n  FOR UPDATE SKIP LOCKED)\nUPDATE t\nSET s = 1\nWHERE t.id = ANY(ARRAY(\n    SELECT id\n    FROM c))\n"
        );
    }
}
