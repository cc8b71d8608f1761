//! # outbox-testkit
//!
//! What the integration tests (`tests/`) and the benchmark (`bench/`) both need to drive the
//! real `outbox-relay` binary against the real services, each helper once:
//! - [`process`]: the binary as a child process configured only by `RELAY_*` variables
//!   ([`RelayBuilder`], [`RelayProcess`]), temp dirs, the default log filter;
//! - [`db`]: connections, a fresh outbox table per test ([`TestTable`], created by
//!   `outbox-relay migrate`), rows to insert and concurrent or paced writers;
//! - [`mysql`]: a fresh MySQL/MariaDB outbox table per test ([`MysqlTable`]), rows inserted
//!   and read back as the application and an operator would;
//! - [`outbox`]: either database ([`Db`]): a test's outbox table on it ([`TestOutbox`]), an
//!   application's connection ([`DbConn`]), and [`on_both_databases!`] to run a scenario
//!   written once on each;
//! - [`rabbit`]: an exchange with a collecting consumer ([`RabbitFixture`]) and durable
//!   exchange + queue pairs ([`DurableBinding`]);
//! - [`failover`]: a PostgreSQL primary and its synchronous streaming standby ([`PgPair`]),
//!   to crash, promote or turn read-only;
//! - [`kafka`]: topics (through the tansu CLI), a collecting consumer, a private tansu, a TLS
//!   front;
//! - [`nats`]: a JetStream stream per test, read back in stream order;
//! - [`redis`]: a test's own stream keys read back with `XRANGE` ([`RedisStreams`]), the
//!   relay configured for Redis;
//! - [`proxy`]: a TCP proxy that can cut or stall a connection;
//! - [`http`]: a plain GET or POST, the relay's `/metrics` text and its samples;
//! - [`browser`]: a headless Chromium on its own chromedriver, for the console's pages;
//! - [`webhook`]: a scripted HTTP endpoint (plain or TLS) that records every request;
//! - [`otlp`]: an OTLP/HTTP trace receiver that decodes what the relay exports;
//! - [`check`]: deliveries checked against rows (lost, duplicated, foreign, out of order).
//!
//! The kit does not depend on the `outbox-relay` library: it talks to the binary, the database
//! and the brokers the way an operator and an application do. Test-flavoured helpers panic with
//! a message that says how far things got (in a test, the panic is the report); what the
//! benchmark uses returns `Result`.
//!
//! Every fixture gets a unique name (`it_<test>_<hex>`, `it.<test>.<hex>`) so tests run in
//! parallel without seeing each other's rows or messages.

pub mod browser;
pub mod check;
pub mod db;
pub mod failover;
pub mod http;
pub mod kafka;
pub mod mariadb_tls;
pub mod mysql;
pub mod nats;
pub mod otlp;
pub mod outbox;
pub mod process;
pub mod proxy;
pub mod rabbit;
pub mod redis;
pub mod webhook;

use std::time::{Duration, Instant};

pub use self::redis::{Entry, REDIS_ADDR, REDIS_URL, RedisStreams, redis_relay};
pub use check::*;
pub use db::*;
pub use failover::{PgPair, PgServer};
pub use http::*;
pub use mysql::{MYSQL_ADDR, MYSQL_URL, MysqlTable, mysql_conn};
pub use outbox::{Db, DbConn, TestOutbox};
pub use process::*;
pub use proxy::*;
pub use rabbit::*;

/// The test database (trust auth).
pub const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The test broker.
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The broker's TCP address, for the proxy.
pub const RABBIT_ADDR: &str = "127.0.0.1:5672";

/// Eight random hex digits.
pub fn hex8() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// `name` lower-cased, every character but `[a-z0-9]` replaced by `_`, at most `max` bytes.
pub fn slug(name: &str, max: usize) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(max)
        .collect()
}

/// A local port that was free a moment ago (bound on 127.0.0.1:0, then released).
pub fn try_free_port() -> std::io::Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()
        .map(|a| a.port())
}

/// [`try_free_port`], panicking when no port can be bound.
pub fn free_port() -> u16 {
    try_free_port().expect("bind 127.0.0.1:0")
}

/// Polls `check` every 20 ms until it returns `Ok`, and returns that value. After `timeout` it
/// panics naming `what` and the last observation (the `Err` text), so a failure says how far
/// things got.
pub async fn wait_until<T>(
    timeout: Duration,
    what: &str,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let start = Instant::now();
    loop {
        let last = match check().await {
            Ok(v) => return v,
            Err(e) => e,
        };
        if start.elapsed() >= timeout {
            panic!("timed out after {timeout:?} waiting until {what}; last observation: {last}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `count()` (messages received, records read) reaches `min`; panics after
/// `timeout`, naming `what` and the last count.
pub async fn wait_for_count(timeout: Duration, what: &str, min: usize, count: impl Fn() -> usize) {
    wait_until(timeout, what, async || {
        let n = count();
        if n >= min {
            Ok(())
        } else {
            Err(format!("{n} so far"))
        }
    })
    .await;
}

/// A test's own outbox table and exchange (its queue bound with `#`): what most RabbitMQ tests
/// start from. [`drop_both`] removes them.
pub async fn table_and_exchange(test: &str) -> (TestTable, RabbitFixture) {
    let table = TestTable::new(test).await;
    (table, RabbitFixture::new(test, "#", "it.barrier").await)
}

/// Deletes the exchange and drops the table of [`table_and_exchange`].
pub async fn drop_both(table: TestTable, rabbit: RabbitFixture) {
    rabbit.teardown().await;
    table.drop_table().await;
}

/// Stops `relay` (asserting a clean exit, see [`RelayProcess::stop`]), then [`drop_both`].
pub async fn finish(relay: RelayProcess, table: TestTable, rabbit: RabbitFixture) {
    finish_with(relay, table, rabbit.teardown()).await;
}

/// The end of a test: stops `relay` (asserting a clean exit, see [`RelayProcess::stop`]), runs
/// `teardown` (what the test made on the broker goes), then drops `table`.
pub async fn finish_with(
    relay: RelayProcess,
    table: TestTable,
    teardown: impl Future<Output = ()>,
) {
    relay.stop().await;
    teardown.await;
    table.drop_table().await;
}
