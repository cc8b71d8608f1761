//! What the integration tests import as `common::…`: the shared test kit (`testkit/`, crate
//! `outbox-testkit`, also used by the benchmark) re-exported, so that every helper exists once.
//! Kafka's side is `common::kafka`. Helpers that only the tests need belong here.

// Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code, unused_imports)]

pub mod kafka;

pub use outbox_testkit::*;

use std::collections::BTreeMap;

use serde_json::Value;

/// The binary under test (the kit finds the same file next to the test executable).
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// The contract's §4 rule for row headers: strings as they are, other values as their JSON
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
