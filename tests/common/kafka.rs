//! Kafka side of the harness: the shared test kit's `kafka` module re-exported.

pub use outbox_testkit::kafka::*;
