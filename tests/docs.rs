//! The manual stays true to the code: every configuration key the relay accepts has a row in
//! `docs/configuration.md`, and every row names a key it accepts; every metric the relay
//! exports has a row in `docs/operations.md`, and every row names one it exports; the README's
//! configuration snippet and the crate's description name every publisher kind; every file
//! under `src/` is named in `docs/development.md`'s module map, and every file it names exists.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeSet;

use common::{repo_file, repo_path, source_files};
use outbox_relay::config::{PublisherKind, RawConfig, RawOutbox};
use outbox_relay::telemetry::names;
use serde_json::Value;

/// The dotted paths of the leaves of `value` under `prefix`. A map the user fills with keys of
/// their own (`publisher.kafka.properties`, `publisher.http.headers`: empty by default) is one
/// leaf.
fn leaves(prefix: &str, value: &Value, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (key, v) in map {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                leaves(&path, v, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// Every key `relay.toml` accepts, `[[outboxes]]` entries' as `outboxes[].<key>`.
fn config_keys() -> BTreeSet<String> {
    let mut config = serde_json::to_value(RawConfig::default()).unwrap();
    config.as_object_mut().unwrap().remove("outboxes");
    let mut keys = BTreeSet::new();
    leaves("", &config, &mut keys);
    let entry: RawOutbox = serde_json::from_value(serde_json::json!({ "table": "t" })).unwrap();
    leaves(
        "outboxes[]",
        &serde_json::to_value(entry).unwrap(),
        &mut keys,
    );
    keys
}

/// The first cells of `doc`'s table rows that are one backticked name matching `is_name`.
fn table_names(doc: &str, is_name: impl Fn(&str) -> bool) -> BTreeSet<String> {
    doc.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once("` |"))
        .map(|(name, _)| name.to_owned())
        .filter(|name| is_name(name))
        .collect()
}

/// Asserts that a doc names what exists and only that: `missing` introduces what exists and
/// `documented` lacks, `unknown` what `documented` names that does not exist.
fn assert_both_ways(
    existing: &BTreeSet<String>,
    documented: &BTreeSet<String>,
    missing: &str,
    unknown: &str,
) {
    let undocumented: Vec<_> = existing.difference(documented).collect();
    let absent: Vec<_> = documented.difference(existing).collect();
    assert!(undocumented.is_empty(), "{missing}: {undocumented:?}");
    assert!(absent.is_empty(), "{unknown}: {absent:?}");
}

#[test]
fn every_configuration_key_is_documented_and_every_documented_key_exists() {
    let doc = repo_file("docs/configuration.md");
    let is_key = |name: &str| {
        name.contains('.')
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || "._[]".contains(c))
    };
    let documented = table_names(&doc, is_key);
    let accepted = config_keys();
    assert!(accepted.len() > 40, "too few keys found: {accepted:?}");
    assert_both_ways(
        &accepted,
        &documented,
        "keys without a row in docs/configuration.md",
        "docs/configuration.md documents keys the relay does not accept",
    );
}

/// The keys the shipped `relay.toml` names, set or commented out (`# key = …` under a
/// `[section]` or `# [section]` line), as dotted paths.
fn shipped_keys(toml: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let mut section = String::new();
    for line in toml.lines() {
        let line = line.trim().trim_start_matches('#').trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.split_once(']')) {
            section = name.0.to_owned();
        } else if let Some((key, _)) = line.split_once('=') {
            let key = key.trim();
            if !section.is_empty()
                && !key.is_empty()
                && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                keys.insert(format!("{section}.{key}"));
            }
        }
    }
    keys
}

/// The README says the shipped `relay.toml` lists every key with its default: each key is
/// there (an optional one commented out), and nothing else.
#[test]
fn the_shipped_relay_toml_lists_every_key() {
    let accepted: BTreeSet<String> = config_keys()
        .into_iter()
        .filter(|k| !k.starts_with("outboxes[]"))
        .collect();
    let shipped = shipped_keys(&repo_file("relay.toml"));
    assert_both_ways(
        &accepted,
        &shipped,
        "keys relay.toml does not list",
        "relay.toml lists keys the relay does not accept",
    );
}

#[test]
fn every_configuration_key_row_names_its_environment_variable() {
    let doc = repo_file("docs/configuration.md");
    for line in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        let key = cells[0].trim_start_matches("| `").trim_end_matches('`');
        if key.starts_with("outboxes[]") || !key.contains('.') {
            continue;
        }
        let env = format!("`RELAY_{}`", key.to_uppercase().replace('.', "__"));
        assert_eq!(cells.get(1), Some(&env.as_str()), "{line}");
    }
}

#[test]
fn every_metric_is_documented_and_every_documented_metric_exists() {
    let doc = repo_file("docs/operations.md");
    let documented = table_names(&doc, |name| name.starts_with("outbox_"));
    let exported: BTreeSet<String> = names::ALL
        .iter()
        .chain(names::OPTIONAL)
        .map(|n| (*n).to_owned())
        .collect();
    assert_both_ways(
        &exported,
        &documented,
        "metrics without a row in docs/operations.md",
        "docs/operations.md documents metrics the relay does not export",
    );
}

#[test]
fn the_readme_is_a_short_manual_that_links_every_page_of_docs() {
    let readme = repo_file("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= 350,
        "README.md has {lines} lines: depth goes in docs/"
    );
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for page in std::fs::read_dir(&dir).unwrap() {
        let name = page.unwrap().file_name().into_string().unwrap();
        assert!(
            readme.contains(&format!("(docs/{name}")),
            "README.md does not link docs/{name}"
        );
    }
}

/// Every `publisher.kind` the relay accepts, read from the closed set itself: the choices
/// serde names when it rejects a kind that does not exist.
fn publisher_kinds() -> Vec<String> {
    let rejected = serde_json::from_str::<PublisherKind>("\"?\"").unwrap_err();
    let message = rejected.to_string();
    let (_, choices) = message.split_once("expected one of ").unwrap();
    let kinds: Vec<String> = choices
        .split(", ")
        .map(|c| c.split('`').nth(1).unwrap().to_owned())
        .collect();
    assert!(kinds.len() >= 6, "{message}");
    kinds
}

#[test]
fn the_readme_snippet_and_the_crate_description_name_every_publisher_kind() {
    let kinds = publisher_kinds();
    let readme = repo_file("README.md");
    let line = readme
        .lines()
        .find(|l| l.starts_with("kind = \"rabbitmq\""))
        .expect("README.md's configuration snippet sets publisher.kind");
    let missing: Vec<&String> = kinds
        .iter()
        .filter(|k| !line.contains(&format!("\"{k}\"")))
        .collect();
    assert!(missing.is_empty(), "README.md: {line:?} omits {missing:?}");

    let manifest = repo_file("Cargo.toml");
    let description = manifest
        .lines()
        .find_map(|l| l.strip_prefix("description = "))
        .expect("Cargo.toml has a description");
    let lower = description.to_lowercase();
    let missing: Vec<&String> = kinds
        .iter()
        .filter(|k| !lower.contains(k.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "Cargo.toml's description {description:?} omits {missing:?}"
    );
}

/// The backticked spans of `line`.
fn backticked(line: &str) -> impl Iterator<Item = &str> {
    line.split('`').skip(1).step_by(2)
}

/// A name in the module map that is a path: from the repository's root (`src/…`), or a bare
/// file or directory name (`claim.rs`, `postgres/`) inside the directory of its list item.
fn map_path(name: &str) -> Option<&str> {
    let bare = name.trim_end_matches('/');
    let is_file = [".rs", ".css", ".js"].iter().any(|ext| name.ends_with(ext));
    let is_dir = name.ends_with('/');
    let is_name = !bare.is_empty()
        && bare
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-".contains(c));
    let rooted = name.starts_with("src/");
    ((is_file || is_dir) && (rooted || is_name)).then_some(name)
}

/// The files and the directories `docs/development.md`'s `## Module map` names, from the
/// repository's root. A list item's directory is the first directory it names (`src/store/`,
/// or `postgres/` inside its parent item's), else its parent item's; bare names are inside it.
fn module_map(doc: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (_, section) = doc
        .split_once("\n## Module map\n")
        .expect("docs/development.md has a `## Module map` section");
    let section = section.split("\n## ").next().unwrap();
    let (mut files, mut dirs) = (BTreeSet::new(), BTreeSet::new());
    // The directory of each open list item, outermost first, and whether the innermost item
    // has named its own yet.
    let mut items: Vec<String> = Vec::new();
    let mut named = true;
    for line in section.lines() {
        let text = line.trim_start();
        if text.starts_with("- ") {
            items.truncate((line.len() - text.len()) / 2);
            items.push(items.last().cloned().unwrap_or_else(|| "src/".to_owned()));
            named = false;
        }
        for name in backticked(line).filter_map(map_path) {
            let here = items.last().map_or("src/", String::as_str);
            let path = if name.starts_with("src/") {
                name.to_owned()
            } else {
                format!("{here}{name}")
            };
            if !path.ends_with('/') {
                files.insert(path);
                continue;
            }
            if !named && let Some(item) = items.last_mut() {
                item.clone_from(&path);
                named = true;
            }
            dirs.insert(path);
        }
    }
    (files, dirs)
}

#[test]
fn the_module_map_names_every_source_file_and_only_those() {
    let (listed, dirs) = module_map(&repo_file("docs/development.md"));
    let present = source_files("src");
    assert!(present.len() > 50, "too few files found: {present:?}");
    assert_both_ways(
        &present,
        &listed,
        "files under src/ that docs/development.md's module map does not name",
        "docs/development.md's module map names files that do not exist",
    );
    let absent: Vec<_> = dirs.iter().filter(|dir| !repo_path(dir).is_dir()).collect();
    assert!(
        absent.is_empty(),
        "docs/development.md's module map names directories that do not exist: {absent:?}"
    );
}
