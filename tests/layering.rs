//! The import graph runs one way: `config/` assembles the transports' sections and never reaches
//! into `publish/` (so a transport can become an optional cargo feature without `cfg`s inside
//! `config/`), and `publish/` never reaches into `otel/` (tracing wraps a publisher, the trace
//! context constant lives with the message). The files are read as text: any mention of the
//! module by its crate path counts, in a `use` or inline, whole or in a `crate::{…}` group.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use common::{repo_file, source_files};

/// Whether `text` names the crate's top-level module `module`: `crate::module` anywhere, or
/// `module` first in a group `crate::{…}` or after one of its commas.
fn mentions(text: &str, module: &str) -> bool {
    let is_word_end = |rest: &str| !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_');
    let direct = text.match_indices("crate::").any(|(at, found)| {
        let rest = &text[at + found.len()..];
        rest.strip_prefix(module).is_some_and(is_word_end)
    });
    let grouped = text.match_indices("crate::{").any(|(at, found)| {
        let group = &text[at + found.len()..];
        let mut depth = 0usize;
        let mut start = 0;
        for (i, c) in group.char_indices() {
            let item_start = match c {
                '{' => {
                    depth += 1;
                    None
                }
                '}' if depth == 0 => Some(i),
                '}' => {
                    depth -= 1;
                    None
                }
                ',' if depth == 0 => Some(i),
                _ => None,
            };
            if let Some(end) = item_start {
                let item = group[start..end].trim();
                if item.strip_prefix(module).is_some_and(is_word_end) {
                    return true;
                }
                if c == '}' {
                    return false;
                }
                start = i + 1;
            }
        }
        false
    });
    direct || grouped
}

/// Asserts that no file under `dir` (which holds more than `at_least` files, so that it was
/// found) mentions the crate's module `module`; `why` is the rule, for the failure message.
fn assert_never_mentions(dir: &str, at_least: usize, module: &str, why: &str) {
    let files = source_files(dir);
    assert!(files.len() > at_least, "{dir}/ not found");
    let found: Vec<String> = files
        .into_iter()
        .filter(|file| mentions(&repo_file(file), module))
        .collect();
    assert!(
        found.is_empty(),
        "files under {dir}/ that mention crate::{module} ({why}): {found:?}"
    );
}

#[test]
fn the_mention_check_sees_each_form_of_import() {
    for text in [
        "use crate::publish::nats::url;",
        "let s = crate::publish::nats::check_subject(x);",
        "use crate::{error::Error, publish::Publisher};",
        "use crate::{\n    publish,\n    store::Row,\n};",
        "use crate::{store::{Row, Status}, publish::nats};",
    ] {
        assert!(mentions(text, "publish"), "not seen: {text:?}");
    }
    for text in [
        "use crate::publisher_kind::Kind;",
        "use crate::{store::{publish, Row}, config};",
        "use super::publish::Publisher;",
        "// publish",
    ] {
        assert!(!mentions(text, "publish"), "seen wrongly: {text:?}");
    }
}

#[test]
fn config_never_imports_publish() {
    let why = "config assembles the transports' sections and never reaches into publish/";
    assert_never_mentions("src/config", 3, "publish", why);
}

#[test]
fn publish_never_imports_otel() {
    let why = "tracing is a Publisher wrapper in otel/; publish/ never reaches into it";
    assert_never_mentions("src/publish", 10, "otel", why);
}
