//! Kafka side of the harness: the shared test kit's `kafka` module re-exported.

pub use outbox_testkit::kafka::*;

/// Where a record landed and which row it carries: (partition, offset, seq).
pub type Placed = (i32, i64, i64);
