//! Fault injection for the fault tests (`tests/faults.rs`), compiled only with the
//! `fault-injection` feature, which the tests' dev-dependency turns on and a release build
//! never has.

use std::sync::OnceLock;

use crate::message::OutboxMessage;
use crate::publish::envelope::row_headers;

/// The header name of `OUTBOX_RELAY_TEST_CRASH_HEADER`, read once.
static HEADER: OnceLock<Option<String>> = OnceLock::new();

/// The header name of `OUTBOX_RELAY_TEST_SETTLE_PANIC_HEADER`, read once.
static SETTLE_PANIC_HEADER: OnceLock<Option<String>> = OnceLock::new();

/// The crash switch: with `OUTBOX_RELAY_TEST_CRASH_HEADER=<name>` set, the process aborts when
/// it is about to publish a row whose headers contain `<name>`, as a row that crashes the
/// relay would.
pub(crate) fn crash_switch(msg: &OutboxMessage) {
    let header = HEADER.get_or_init(|| std::env::var("OUTBOX_RELAY_TEST_CRASH_HEADER").ok());
    if let Some(name) = header
        && row_headers(msg).0.iter().any(|(k, _)| k == name)
    {
        eprintln!(
            "test crash switch: aborting before publishing row {}",
            msg.id
        );
        std::process::abort();
    }
}

/// The settle panic switch: with `OUTBOX_RELAY_TEST_SETTLE_PANIC_HEADER=<name>` set, the relay
/// panics when it is about to record the outcomes of a batch holding a row whose headers
/// contain `<name>`, as a bug outside the publish would.
pub(crate) fn settle_panic_switch<'a>(batch: impl IntoIterator<Item = &'a OutboxMessage>) {
    let header = SETTLE_PANIC_HEADER
        .get_or_init(|| std::env::var("OUTBOX_RELAY_TEST_SETTLE_PANIC_HEADER").ok());
    if let Some(name) = header
        && let Some(msg) = batch
            .into_iter()
            .find(|m| row_headers(m).0.iter().any(|(k, _)| k == name))
    {
        panic!("test settle panic switch: row {} is in this batch", msg.id);
    }
}
