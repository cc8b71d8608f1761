//! What the integration tests import as `common::…`: the shared test kit (`testkit/`, crate
//! `outbox-testkit`, also used by the benchmark) re-exported, so that every helper exists once.
//! Kafka's side is `common::kafka`. Helpers that only the tests need belong here.

// Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code, unused_imports)]

pub mod envelope;
pub mod kafka;
pub mod transport;

pub use outbox_testkit::*;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde_json::Value;

/// `relative` in the repository (the relay crate's root: `deploy/…`, `scripts/…`).
pub fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The text of the repository's file `relative`; panics naming it.
pub fn repo_file(relative: &str) -> String {
    let path = repo_path(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Every file under the repository's folder `dir` (`src`, `src/config`), from the repository's
/// root (`src/lib.rs`).
pub fn source_files(dir: &str) -> std::collections::BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = std::collections::BTreeSet::new();
    let mut stack = vec![root.join(dir)];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let relative = path.strip_prefix(root).unwrap();
                files.insert(relative.to_str().unwrap().replace('\\', "/"));
            }
        }
    }
    files
}

/// The binary under test (the kit finds the same file next to the test executable).
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// The docs/wire-format.md rule for row headers: strings as they are, other values as their JSON
/// text, nulls omitted.
pub fn expected_row_headers(headers: &Value) -> BTreeMap<String, String> {
    headers
        .as_object()
        .expect("headers object")
        .iter()
        .filter_map(|(k, v)| match v {
            Value::Null => None,
            Value::String(s) => Some((k.clone(), s.clone())),
            other => Some((k.clone(), other.to_string())),
        })
        .collect()
}

/// Row `n` of the bulk tests: 100 aggregates (`a-0`..`a-49` orders, `a-50`..`a-99`
/// customers), one row in 53 without aggregate id, headers of every JSON kind (a null among
/// them) on most rows, none on every fourth.
pub fn bulk_row(n: usize) -> NewRow {
    let a = n % 100;
    let aggregate_type = if a < 50 { "order" } else { "customer" };
    let aggregate_id = (!n.is_multiple_of(53)).then(|| format!("a-{a}"));
    let event_type = ["created", "updated", "deleted"][n % 3];
    let payload = serde_json::json!({"n": n, "name": format!("row {n}"), "nested": {"list": [n, "x", null], "ok": true}, "text": "é✓ \"quoted\""});
    let row = NewRow::new(aggregate_type, aggregate_id.as_deref(), event_type, payload);
    if n % 4 == 3 {
        return row;
    }
    row.headers(serde_json::json!({
        "trace": format!("t-{n}"), "n": n, "ratio": 0.5, "flag": n.is_multiple_of(2),
        "nested": {"k": [n]}, "gone": null,
    }))
}

/// The docs/wire-format.md checks of the time attribute `name` (`cloudEvents:time`, `ce_time`):
/// RFC 3339 with at least millisecond precision, equal to `created_at`; the problem found.
pub fn time_problem(name: &str, value: Option<&str>, created_at: DateTime<Utc>) -> Option<String> {
    let Some(t) = value else {
        return Some(format!("no {name}"));
    };
    let frac = t
        .split('.')
        .nth(1)
        .map_or(0, |f| f.chars().take_while(char::is_ascii_digit).count());
    if frac < 3 {
        return Some(format!("{name} {t:?} has less than millisecond precision"));
    }
    match DateTime::parse_from_rfc3339(t) {
        Ok(parsed) if parsed.with_timezone(&Utc) == created_at => None,
        Ok(_) => Some(format!("{name} {t} != created_at {created_at}")),
        Err(e) => Some(format!("{name} {t:?} is not RFC 3339: {e}")),
    }
}

/// The shared middle of the "answer never comes back" tests (NATS, Redis): with one row of
/// `aggregate_type` already sent, `proxy` holds the broker's answers while a second row is
/// published; the broker stores it (`stored(2)` waits for that), the relay logs
/// `handed_back` and hands the row back to `pending` without spending an attempt; once the
/// proxy heals, both rows are sent once. Returns the two rows' ids.
pub async fn an_unanswered_publish_is_handed_back(
    table: &TestTable,
    proxy: &Proxy,
    relay: &RelayProcess,
    aggregate_type: &str,
    handed_back: &str,
    stored: impl AsyncFn(usize),
) -> (uuid::Uuid, uuid::Uuid) {
    use serde_json::json;
    const WAIT: std::time::Duration = std::time::Duration::from_secs(60);
    let first = table
        .insert_one(NewRow::new(
            aggregate_type,
            Some("a-1"),
            "created",
            json!({}),
        ))
        .await;
    table.wait_all_sent(WAIT).await;
    proxy.hold_answers();
    let held = table
        .insert_one(NewRow::new(
            aggregate_type,
            Some("a-2"),
            "created",
            json!({}),
        ))
        .await;
    stored(2).await;
    relay.wait_for_log(handed_back, 1, WAIT).await;
    let row = table
        .wait_row(held, WAIT, "handed back", |r| r.status == "pending")
        .await;
    assert_eq!(
        row.attempts, 0,
        "connection-level: no attempt spent: {row:?}"
    );
    proxy.heal();
    table.wait_all_sent(WAIT).await;
    let rows = table.rows_by_id(&[first, held]).await;
    assert_none(
        "rows",
        &not_sent_once(&rows.into_values().collect::<Vec<_>>()),
    );
    (first, held)
}

/// The strike of the SIGKILL tests: lets the survivors work a while (0.3–1.5 s), waits (up to
/// `wait`) until `victim` holds rows (`count_where` counts a table's rows matching a condition)
/// and `delivered()` has grown by at least 100, then kills `victim` with SIGKILL, asserts it
/// died by it, and returns how many rows it held at its death.
pub async fn sigkill_while_holding_rows(
    victim: &mut RelayProcess,
    wait: std::time::Duration,
    count_where: impl AsyncFn(&str) -> i64,
    delivered: impl Fn() -> usize,
) -> i64 {
    use std::os::unix::process::ExitStatusExt;
    let label = victim.label.clone();
    let since = delivered();
    let pause = 300 + rand::random_range(0..1200);
    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
    let held_now = format!("status = 'processing' AND locked_by = '{label}'");
    let what = format!("{label} holds rows and deliveries progress");
    wait_until(wait, &what, async || {
        let held = count_where(&held_now).await;
        let progress = delivered() - since;
        if held > 0 && progress >= 100 {
            Ok(())
        } else {
            Err(format!("{held} held by {label}, {progress} delivered"))
        }
    })
    .await;
    victim.sigkill();
    let status = victim.wait_exit(std::time::Duration::from_secs(10)).await;
    assert_eq!(status.signal(), Some(9), "{label} should die by SIGKILL");
    count_where(&held_now).await
}
