//! What the integration tests import as `common::…`: the shared test kit (`testkit/`, crate
//! `outbox-testkit`, also used by the benchmark) re-exported, so that every helper exists once.
//! Kafka's side is `common::kafka`. Helpers that only the tests need belong here.

// Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code, unused_imports)]

pub mod kafka;

pub use outbox_testkit::*;

/// The binary under test (the kit finds the same file next to the test executable).
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
