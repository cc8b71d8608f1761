//! Operations, end to end against the local PostgreSQL and RabbitMQ (docs/operations.md): what an
//! operator sees on `/metrics`, `/healthz` and `/readyz` (also through a broker outage), the
//! `status` and `dead-letters` commands against rows in known states, what `check`, `migrate`,
//! `run` and the operator's commands do with a missing, dropped or version-1 table (upgraded in place with rows
//! pending and in flight), table vacuuming, retention cleanup, configuration errors, and a
//! real Prometheus scraping the relay with the shipped alert rules loaded.
//!
//! Each test has its own table (`ops_<hex>` created by the binary's own `migrate`, or an
//! `it_…` table of the kit) and its own exchange and queue; the tests that read `/metrics` or
//! the probes have their own metrics port.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::time::Duration;

use common::{
    CmdOutput, NewRow, PG_URL, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, TempDir, TestTable,
    finish, free_port, hex8, http_get, local, migrate_table, pg_connect, sample, scrape,
    table_and_exchange, wait_for_sample, wait_until,
};
use outbox_relay::config::{Ordering, TableName};
use outbox_relay::store::Store;
use outbox_relay::store::schema::{self, MIGRATIONS};
use outbox_relay::telemetry::names;
use serde_json::{Value, json};
use tokio_postgres::types::{FromSqlOwned, ToSql};
use uuid::Uuid;

/// Generous bound for anything that normally takes a few seconds (gauges refresh every 5 s,
/// broker reconnects back off up to 30 s).
const WAIT: Duration = Duration::from_secs(60);

// ---- fixtures ---------------------------------------------------------------------------------

/// [`RelayBuilder::operator`] for `check` or `run` with `database.auto_migrate` set to `auto`,
/// no metrics server.
fn cli_auto(table: &str, auto: bool) -> RelayBuilder {
    RelayBuilder::operator(table)
        .set("database.auto_migrate", auto.to_string())
        .set("metrics.listen", "")
}

/// `outbox-relay migrate` applies to `table` every schema version from `first` on (from 1: a
/// new or dropped table), in order; run again, it finds the table up to date.
async fn assert_migrates(table: &str, first: i32) {
    let applied = migrate_table(table).await;
    let versions = MIGRATIONS.iter().map(|m| m.version);
    let want: Vec<i32> = versions.filter(|v| *v >= first).collect();
    assert_eq!(applied, want, "migrate {table}");
    let again = migrate_table(table).await;
    assert!(again.is_empty(), "re-migrating {table} applied {again:?}");
}

/// Runs the binary as `builder` configures it, with `args`; asserts that it exits with `code`.
async fn exits(builder: RelayBuilder, args: &[&str], code: i32) -> CmdOutput {
    let out = builder.output(args, WAIT).await;
    assert_eq!(out.status.code(), Some(code), "{args:?}: {out:?}");
    out
}

/// A fresh `ops_<hex>` table, created by `outbox-relay migrate`.
async fn ops_table() -> TestTable {
    let name = format!("ops_{}", hex8());
    assert_migrates(&name, 1).await;
    let db = pg_connect().await;
    TestTable { name, db }
}

/// `run` for `table` and `rabbit`, metrics on `127.0.0.1:port` (or disabled), polling fast.
fn relay(table: &TestTable, rabbit: &RabbitFixture, metrics_port: Option<u16>) -> RelayBuilder {
    let metrics = metrics_port.map_or_else(String::new, |p| format!("127.0.0.1:{p}"));
    RelayBuilder::for_test(table, rabbit, &format!("{}-relay", table.name))
        .set("relay.poll_interval", "200ms")
        .set("metrics.listen", metrics)
}

/// A row of `aggregate_type`/`aggregate_id` with event `event_type` and an empty payload.
fn event(aggregate_type: &str, aggregate_id: Option<&str>, event_type: &str) -> NewRow {
    NewRow::new(aggregate_type, aggregate_id, event_type, json!({}))
}

/// A row inserted directly in a given state, as if the relay (or an operator) had put it there.
#[derive(Debug, Clone)]
struct StateRow {
    aggregate_type: &'static str,
    aggregate_id: Option<&'static str>,
    status: &'static str,
    attempts: i32,
    created_secs_ago: f64,
    available_in_secs: f64,
    sent_secs_ago: Option<f64>,
    last_error: Option<&'static str>,
}

/// A row of `aggregate_type`/`aggregate_id` in `status`, created `created_secs_ago`, ready
/// (available since 1 s), sent 1 s ago when `sent`.
fn state_row(
    aggregate_type: &'static str,
    aggregate_id: Option<&'static str>,
    status: &'static str,
    created_secs_ago: f64,
) -> StateRow {
    StateRow {
        aggregate_type,
        aggregate_id,
        status,
        attempts: 0,
        created_secs_ago,
        available_in_secs: -1.0,
        sent_secs_ago: (status == "sent").then_some(1.0),
        last_error: None,
    }
}

impl StateRow {
    fn available_in(mut self, secs: f64) -> Self {
        self.available_in_secs = secs;
        self
    }
    fn sent(mut self, secs_ago: f64) -> Self {
        self.sent_secs_ago = Some(secs_ago);
        self
    }
    fn failed_after(mut self, attempts: i32, error: &'static str) -> Self {
        self.attempts = attempts;
        self.last_error = Some(error);
        self
    }
}

/// Inserts `rows` one statement each (so `seq` follows the slice order); returns their ids.
async fn insert_states(table: &TestTable, rows: &[StateRow]) -> Vec<Uuid> {
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts, \
           available_at, created_at, sent_at, last_error, locked_by, locked_at) \
         VALUES ($1, $2, 'ops.event', '{{\"ops\": true}}'::jsonb, $3, $4, \
           now() + make_interval(secs => $5), now() - make_interval(secs => $6), \
           now() - make_interval(secs => $7), $8, \
           CASE WHEN $3 = 'processing' THEN 'ops-other-relay' END, \
           CASE WHEN $3 = 'processing' THEN now() END) \
         RETURNING id",
        table.name
    );
    let mut ids = Vec::new();
    for r in rows {
        let params: [&(dyn ToSql + Sync); 8] = [
            &r.aggregate_type,
            &r.aggregate_id,
            &r.status,
            &r.attempts,
            &r.available_in_secs,
            &r.created_secs_ago,
            &r.sent_secs_ago,
            &r.last_error,
        ];
        let row = table.db.query_one(&sql, &params).await;
        ids.push(row.unwrap_or_else(|e| panic!("insert {r:?}: {e}")).get(0));
    }
    ids
}

/// `(status, attempts, last_error, available_at <= now())` of a row, `None` when it is gone.
async fn row_state(table: &TestTable, id: Uuid) -> Option<(String, i32, Option<String>, bool)> {
    let sql = format!(
        "SELECT status, attempts, last_error, available_at <= now() FROM {} WHERE id = $1",
        table.name
    );
    let row = table.db.query_opt(&sql, &[&id]).await.expect("select row");
    row.map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
}

/// Asserts that row `id` is `pending` with no attempt spent, available now, and `last_error`.
async fn assert_pending_now(table: &TestTable, id: Uuid, last_error: Option<&str>) {
    let want = ("pending".to_owned(), 0, last_error.map(str::to_owned), true);
    assert_eq!(row_state(table, id).await, Some(want), "row {id}");
}

/// Waits until `/readyz` answers `want`, then asserts that its body is `body`.
async fn wait_ready(port: u16, want: u16, body: &str) {
    let what = format!("/readyz answers {want}");
    let got = wait_until(WAIT, &what, async || {
        match http_get(local(port), "/readyz").await? {
            (code, body) if code == want => Ok(body),
            (code, body) => Err(format!("{code}: {body:?}")),
        }
    })
    .await;
    assert_eq!(got, body, "/readyz answered {want} with another body");
}

/// `expr` over `table`'s row of `pg_stat_user_tables` (the statistics the relay reads).
async fn table_stat<T: FromSqlOwned>(table: &TestTable, expr: &str) -> Result<T, String> {
    let sql = format!("SELECT {expr} FROM pg_stat_user_tables WHERE relid = $1::text::regclass");
    let row = table.db.query_one(&sql, &[&table.name]).await;
    Ok(row.map_err(|e| e.to_string())?.get(0))
}

// ---- /metrics, /healthz, /readyz --------------------------------------------------------------

/// What an operator reads over HTTP: every contract name on `/metrics` once rows are
/// published, then `/readyz`, `/healthz` and the gauges through a broker outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_probes_show_publishing_and_a_broker_outage() {
    let table = ops_table().await;
    let rabbit = RabbitFixture::new("ops_metrics", "#", "barrier.ops").await;
    let (proxy, port) = (Proxy::start(RABBIT_ADDR).await, free_port());
    let relay = relay(&table, &rabbit, Some(port))
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .spawn();
    let connected = async |want: f64| {
        wait_for_sample(port, WAIT, names::BROKER_CONNECTED, &[], |v| v == want).await;
    };

    wait_ready(port, 200, "database: up\nbroker: up\n").await;
    let (code, body) = http_get(local(port), "/healthz").await.unwrap();
    assert_eq!((code, body.trim()), (200, "ok"));
    connected(1.0).await;

    let mut rows = NewRow::numbered(5, "order", Some(("o-", 5)), "created");
    rows.push(event("invoice", Some("i-1"), "issued"));
    rows.push(event("invoice", None, "issued"));
    let ids = table.insert_ids(&rows).await;
    rabbit.wait_for_ids(&ids, WAIT).await;
    table.wait_all_sent(WAIT).await;

    for (aggregate_type, n) in [("order", 5.0), ("invoice", 2.0)] {
        let labels = [("aggregate_type", aggregate_type)];
        wait_for_sample(port, WAIT, names::PUBLISHED, &labels, |v| v == n).await;
    }
    let text = scrape(port).await.unwrap();

    // Every name of the contract, with its type; histograms with buckets, sum and count.
    let histograms = [
        names::PUBLISH_DURATION,
        names::END_TO_END_LATENCY,
        names::CLAIM_BATCH_SIZE,
    ];
    for name in names::ALL {
        let kind = match name {
            n if histograms.contains(n) => "histogram",
            n if n.ends_with("_total") => "counter",
            _ => "gauge",
        };
        assert!(
            text.lines().any(|l| l == format!("# TYPE {name} {kind}")),
            "/metrics lacks `# TYPE {name} {kind}`:\n{text}"
        );
    }
    let inf_bucket = |name: &str| sample(&text, &format!("{name}_bucket"), &[("le", "+Inf")]);
    let part = |name: &str, suffix: &str| sample(&text, &format!("{name}_{suffix}"), &[]);
    for name in histograms {
        assert!(inf_bucket(name).is_some(), "{name} has no +Inf bucket");
        assert!(part(name, "sum").is_some(), "{name} has no _sum");
    }
    // One observation per confirm.
    for name in [names::PUBLISH_DURATION, names::END_TO_END_LATENCY] {
        assert_eq!(part(name, "count"), Some(7.0), "{name}_count: 7 confirms");
        assert_eq!(inf_bucket(name), Some(7.0), "{name} +Inf: 7 confirms");
    }
    let claimed = part(names::CLAIM_BATCH_SIZE, "sum").unwrap();
    assert!(claimed >= 7.0, "claims returned {claimed} rows in total");
    let instance = format!("{}-relay", table.name);
    let labels = [
        ("instance", instance.as_str()),
        ("publisher", "rabbitmq"),
        ("version", env!("CARGO_PKG_VERSION")),
    ];
    let info = sample(&text, names::RELAY_INFO, &labels);
    assert_eq!(info, Some(1.0), "outbox_relay_info:\n{text}");
    for kind in ["message", "connection"] {
        let failures = sample(&text, names::PUBLISH_FAILURES, &[("kind", kind)]);
        assert_eq!(failures, Some(0.0), "publish failures of kind {kind}");
    }
    assert_eq!(sample(&text, names::DEAD_LETTERED, &[]), Some(0.0));
    for state in ["ready", "waiting"] {
        assert!(sample(&text, names::PENDING, &[("state", state)]).is_some());
    }
    // Every per-table metric carries the outbox's name (docs/operations.md): here, the table's.
    let outbox = [("outbox", table.name.as_str())];
    for name in [
        names::PENDING,
        names::OLDEST_READY_AGE,
        names::PUBLISHED,
        names::PUBLISH_FAILURES,
        names::DEAD_LETTERED,
        names::EXPIRED,
        names::WATERMARK_LAG,
        &format!("{}_count", names::END_TO_END_LATENCY),
        &format!("{}_count", names::CLAIM_BATCH_SIZE),
    ] {
        let labelled = sample(&text, name, &outbox);
        assert!(labelled.is_some(), "no {outbox:?} sample of {name}");
    }
    // No high-cardinality labels: neither a row id nor an aggregate id appears anywhere.
    let leaked = ids.iter().find(|id| text.contains(&id.to_string()));
    assert!(leaked.is_none(), "a row id leaked into /metrics");
    assert!(!text.contains("o-1"), "aggregate id o-1 is in /metrics");

    // The broker goes away while nothing is in flight (every row is settled): the cut is seen
    // on the connection alone.
    let before_cut = rabbit.count();
    proxy.cut();
    wait_ready(port, 503, "database: up\nbroker: down\n").await;
    // /healthz is liveness only: a broker outage must not get the process restarted.
    assert_eq!(http_get(local(port), "/healthz").await.unwrap().0, 200);
    connected(0.0).await;

    let outage_rows = [
        event("order", Some("o-1"), "updated"),
        event("order", Some("o-2"), "created"),
        event("invoice", Some("i-1"), "issued"),
        event("invoice", None, "issued"),
    ];
    let during = table.insert_ids(&outage_rows).await;
    // Wait until the 4 rows inserted during the outage show as ready.
    let (ready, waiting) = ([("state", "ready")], [("state", "waiting")]);
    wait_for_sample(port, WAIT, names::PENDING, &ready, |v| v == 4.0).await;
    // Wait until the rows inserted during the outage count as late.
    wait_for_sample(port, WAIT, names::OLDEST_READY_AGE, &[], |v| v > 0.0).await;
    let age1 = sample(&scrape(port).await.unwrap(), names::OLDEST_PENDING_AGE, &[]).unwrap();
    let grown = |v: f64| v >= age1 + 1.0;
    let age2 = wait_for_sample(port, WAIT, names::OLDEST_PENDING_AGE, &[], grown).await;
    assert!(age2 > 1.0, "lag {age2}");
    let text = scrape(port).await.unwrap();
    assert_eq!(sample(&text, names::PENDING, &waiting), Some(0.0));
    let (code, _) = http_get(local(port), "/readyz").await.unwrap();
    assert_eq!(code, 503, "still not ready");
    assert_eq!(rabbit.count(), before_cut, "published during the outage");
    let untried = table
        .count_where("status = 'pending' AND attempts = 0")
        .await;
    assert_eq!(untried, 4, "an outage spends no attempt");
    let unavailable = "broker unavailable; not claiming rows";
    relay.wait_for_log(unavailable, 2, WAIT).await;
    // Wait until the lost connection and at least two failed reconnects are counted.
    let connection = [("kind", "connection")];
    let counted = |v: f64| v >= 3.0;
    wait_for_sample(port, WAIT, names::PUBLISH_FAILURES, &connection, counted).await;

    proxy.heal();
    connected(1.0).await;
    // Exactly one lost connection plus one count per failed reconnect the relay logged.
    let text = scrape(port).await.unwrap();
    let failed_reconnects = relay.log_count(unavailable);
    assert_eq!(relay.log_count("lost the broker connection"), 1);
    assert_eq!(
        sample(&text, names::PUBLISH_FAILURES, &connection),
        Some(1.0 + failed_reconnects as f64),
        "connection failures after {failed_reconnects} failed reconnects"
    );
    let message_failures = sample(&text, names::PUBLISH_FAILURES, &[("kind", "message")]);
    assert_eq!(message_failures, Some(0.0));
    wait_ready(port, 200, "database: up\nbroker: up\n").await;
    rabbit.wait_for_ids(&during, WAIT).await;
    wait_until(WAIT, "the backlog gauges fall back to 0", async || {
        let text = scrape(port).await?;
        let got = (
            sample(&text, names::PENDING, &ready),
            sample(&text, names::PENDING, &waiting),
            sample(&text, names::OLDEST_PENDING_AGE, &[]),
            sample(&text, names::OLDEST_READY_AGE, &[]),
        );
        (got == (Some(0.0), Some(0.0), Some(0.0), Some(0.0)))
            .then_some(())
            .ok_or_else(|| format!("(ready, waiting, oldest age, ready age) = {got:?}"))
    })
    .await;

    finish(relay, table, rabbit).await;
}

// ---- lag gauges --------------------------------------------------------------------------------

#[tokio::test]
async fn lag_gauges_tell_rows_ready_now_from_rows_in_backoff() {
    let table = ops_table().await;
    let rows = [
        // In flight for 500 s: the oldest unsent row.
        state_row("order", Some("o1"), "processing", 500.0),
        // Waiting out a backoff for another 300 s: not late, but the oldest waiting.
        state_row("order", Some("o2"), "pending", 200.0).available_in(300.0),
        // Its backoff ended 30 s ago: ready for 30 s (not 100).
        state_row("order", Some("o3"), "pending", 100.0).available_in(-30.0),
        // Ready since its insert 10 s ago.
        state_row("invoice", None, "pending", 10.0),
    ];
    insert_states(&table, &rows).await;
    let store = store_for(&table);
    let b = store.backlog(Ordering::Aggregate).await.unwrap();
    let near = |got: f64, want: f64| (got - want).abs() < 5.0;
    assert_eq!((b.ready, b.waiting), (2, 1), "{b:?}");
    assert!(near(b.oldest_ready_age, 30.0), "{b:?}");
    assert!(near(b.oldest_waiting_age, 200.0), "{b:?}");
    assert!(near(b.oldest_pending_age, 500.0), "{b:?}");
    table.drop_table().await;
}

/// A store on `table` with the defaults, metrics off.
fn store_for(table: &TestTable) -> Store {
    let mut raw = outbox_relay::config::RawConfig::default();
    raw.database.url = PG_URL.to_owned();
    raw.database.table = Some(table.name.clone());
    raw.metrics.listen = String::new();
    let config = raw.validate().unwrap();
    Store::new(&config.database, &config.relay.instance_id).unwrap()
}

// ---- table health ------------------------------------------------------------------------------

#[tokio::test]
async fn the_relay_vacuums_its_table_when_autovacuum_is_off() {
    let (table, rabbit) = table_and_exchange("ops_vacuum").await;
    // Off for this table whatever the server says (this machine's server has it off anyway).
    let off = format!("ALTER TABLE {} SET (autovacuum_enabled = off)", table.name);
    table.db.batch_execute(&off).await.unwrap();
    let relay = relay(&table, &rabbit, None)
        .set("cleanup.retention", "0s")
        .spawn();
    // 8,000 rows sent and deleted leave about 16,000 dead tuples (claim + delete).
    for chunk in NewRow::numbered(8_000, "vac", None, "tick").chunks(2_000) {
        table.insert(chunk).await;
    }
    let vacuumed = "vacuumed the outbox table";
    relay.wait_for_log(vacuumed, 1, WAIT).await;
    assert!(relay.stderr().contains("reason=\"autovacuum is off\""));
    // Every row is sent and deleted.
    table.wait_count("true", 0, WAIT).await;
    // Later vacuums keep the dead tuples below the threshold.
    wait_until(WAIT, "dead tuples fall below 10,000", async || {
        let dead: i64 = table_stat(&table, "coalesce(n_dead_tup, 0)").await?;
        (dead < 10_000)
            .then_some(())
            .ok_or_else(|| format!("{dead} dead tuples"))
    })
    .await;
    finish(relay, table, rabbit).await;
}

/// Statistics younger than ten minutes are left alone: the relay's vacuum is then a plain
/// `VACUUM` (sampling the table again costs several times the vacuum), which still empties
/// the table of dead tuples.
#[tokio::test]
async fn a_vacuum_leaves_statistics_younger_than_ten_minutes_alone() {
    let (table, rabbit) = table_and_exchange("ops_vacuum_fresh").await;
    let off = format!("ALTER TABLE {} SET (autovacuum_enabled = off)", table.name);
    table.db.batch_execute(&off).await.unwrap();
    // The backlog first, then statistics that have seen it: the relay has no reason to
    // analyze before its vacuum.
    for chunk in NewRow::numbered(8_000, "fresh", None, "tick").chunks(2_000) {
        table.insert(chunk).await;
    }
    let analyze = format!("ANALYZE {}", table.name);
    table.db.batch_execute(&analyze).await.unwrap();
    let analyses = async || table_stat::<i64>(&table, "analyze_count + autoanalyze_count").await;
    // PostgreSQL before 15 reports statistics with a delay.
    wait_until(WAIT, "the statistics count the ANALYZE", async || {
        let n = analyses().await?;
        (n == 1)
            .then_some(())
            .ok_or_else(|| format!("{n} analyses"))
    })
    .await;

    let relay = relay(&table, &rabbit, None)
        .set("cleanup.retention", "0s")
        .spawn();
    relay
        .wait_for_log("vacuumed the outbox table", 1, WAIT)
        .await;
    let log = relay.stderr();
    assert!(log.contains("analyzed=false"), "{log}");
    assert!(!log.contains("analyzed=true"), "{log}");
    table.wait_count("true", 0, WAIT).await;
    assert_eq!(analyses().await.unwrap(), 1, "the table was analyzed again");
    let vacuums: i64 = table_stat(&table, "vacuum_count").await.unwrap();
    assert!(vacuums >= 1, "{vacuums} vacuums counted");
    finish(relay, table, rabbit).await;
}

/// A backlog in a table the planner has no statistics for (autovacuum off, never analyzed):
/// the relay analyzes it before its first vacuum would, and every row goes out.
#[tokio::test]
async fn the_relay_analyzes_a_backlog_the_statistics_have_not_seen() {
    let (table, rabbit) = table_and_exchange("ops_analyze").await;
    let off = format!("ALTER TABLE {} SET (autovacuum_enabled = off)", table.name);
    table.db.batch_execute(&off).await.unwrap();
    table
        .insert(&NewRow::numbered(3_000, "ana", Some(("a-", 50)), "tick"))
        .await;
    // The relay reads the inserts from the statistics, which a session reports at the end of a
    // transaction at most once a second: wait until they show them.
    wait_until(WAIT, "the statistics count the 3,000 rows", async || {
        let live: i64 = table_stat(&table, "coalesce(n_live_tup, 0)").await?;
        (live >= 3_000)
            .then_some(())
            .ok_or_else(|| format!("{live} live rows"))
    })
    .await;
    let analyzed = async || table_stat::<bool>(&table, "last_analyze IS NOT NULL").await;
    assert!(
        !analyzed().await.unwrap(),
        "the new table was analyzed already"
    );

    let relay = relay(&table, &rabbit, None)
        .set("relay.ordering", "aggregate")
        .spawn();
    // At its first look at the table (the next one would be 30 s later, the outbox idle).
    relay
        .wait_for_log("analyzed the outbox table", 1, Duration::from_secs(15))
        .await;
    table.wait_all_sent(WAIT).await;
    assert!(analyzed().await.unwrap(), "last_analyze is still empty");
    // Fewer than 10,000 dead tuples: no vacuum (whose ANALYZE would have done it) ran.
    assert_eq!(relay.log_count("vacuumed the outbox table"), 0);
    finish(relay, table, rabbit).await;
}

// ---- status -----------------------------------------------------------------------------------

/// The integer counts of `status --json` (docs/operations.md), in the human table's column order.
const COUNT_KEYS: [&str; 8] = [
    "pending",
    "ready",
    "waiting",
    "processing",
    "sent",
    "failed",
    "expired",
    "blocked_aggregates",
];

/// The keys of a JSON object.
fn keys(v: &Value) -> BTreeSet<&str> {
    let obj = v.as_object().expect("a JSON object");
    obj.keys().map(String::as_str).collect()
}

/// The integer counts of a `status --json` object in [`COUNT_KEYS`] order, plus its oldest
/// age; checks its keys.
fn counts(v: &Value, top: bool) -> ([i64; 8], f64) {
    let mut want: BTreeSet<&str> = COUNT_KEYS.into_iter().collect();
    want.insert("oldest_pending_age_seconds");
    if top {
        // `by_outbox` is always there (here one, named after the table): one shape for scripts.
        want.extend(["by_aggregate_type", "by_outbox"]);
    }
    assert_eq!(keys(v), want, "status --json keys (docs/operations.md)");
    let ints = COUNT_KEYS.map(|k| v[k].as_i64().expect("an integer count"));
    let age = v["oldest_pending_age_seconds"].as_f64();
    (ints, age.expect("a number"))
}

/// `status --json` for `table`, parsed.
async fn status_json(table: &str) -> Value {
    let out = exits(RelayBuilder::operator(table), &["status", "--json"], 0).await;
    serde_json::from_str(&out.stdout).expect("status --json is JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_rows_by_state_and_aggregate_type() {
    let table = ops_table().await;

    // An empty table: zeros, no types.
    let v = status_json(&table.name).await;
    assert_eq!(counts(&v, true), ([0; 8], 0.0));
    assert_eq!(v["by_aggregate_type"], json!({}));

    let rows = [
        // order: 2 ready, 1 waiting, 1 processing, 3 sent, 2 failed that block o-6 and o-7.
        state_row("order", Some("o-1"), "pending", 100.0),
        state_row("order", Some("o-2"), "pending", 10.0),
        state_row("order", Some("o-3"), "pending", 1.0)
            .available_in(3600.0)
            .failed_after(2, "nack"),
        state_row("order", Some("o-4"), "processing", 50.0),
        state_row("order", Some("o-5"), "sent", 7200.0).sent(3600.0),
        state_row("order", Some("o-5"), "sent", 7200.0).sent(3600.0),
        state_row("order", None, "sent", 7200.0),
        state_row("order", Some("o-6"), "failed", 7200.0).failed_after(12, "nack"),
        // An expired row holds nothing back: o-7's failed row after it blocks o-7.
        state_row("order", Some("o-7"), "expired", 7200.0),
        state_row("order", Some("o-7"), "failed", 7200.0).failed_after(12, "nack"),
        // invoice: i-1 blocked by its failed row; i-2's failed row sits behind a pending
        // one (not blocked); a failed row without aggregate id blocks nothing.
        state_row("invoice", Some("i-1"), "failed", 7200.0).failed_after(12, "unroutable"),
        state_row("invoice", Some("i-2"), "pending", 30.0),
        state_row("invoice", Some("i-2"), "failed", 30.0).failed_after(12, "unroutable"),
        state_row("invoice", None, "sent", 1.0),
        state_row("invoice", None, "failed", 7200.0).failed_after(12, "too large"),
        // The empty aggregate type.
        state_row("", None, "pending", 5.0),
    ];
    insert_states(&table, &rows).await;

    let v = status_json(&table.name).await;
    let outboxes = keys(&v["by_outbox"]);
    assert_eq!(outboxes, [table.name.as_str()].into(), "{v}");
    let mut totals = v.clone();
    totals.as_object_mut().unwrap().remove("by_outbox");
    let single = &v["by_outbox"][&table.name];
    assert_eq!(*single, totals, "one outbox: its entry is the totals");
    let t = &v["by_aggregate_type"];
    assert_eq!(keys(t), ["", "invoice", "order"].into());
    // Per line of the human table: the JSON object, its counts in COUNT_KEYS order (pending,
    // ready, waiting, processing, sent, failed, expired, blocked) and the age of its oldest
    // unsent row (pending or processing), seconds since created_at.
    let want = [
        ("order", &t["order"], [3, 2, 1, 1, 3, 2, 1, 2], 100.0),
        ("invoice", &t["invoice"], [1, 1, 0, 0, 1, 3, 0, 1], 30.0),
        ("(empty)", &t[""], [1, 1, 0, 0, 0, 0, 0, 0], 5.0),
        ("TOTAL", &v, [5, 4, 1, 1, 4, 5, 1, 3], 100.0),
    ];
    // Give or take the time this test took so far.
    let near = |age: f64, want: f64| age >= want && age < want + 60.0;
    for (name, obj, want_counts, oldest) in &want {
        let (c, age) = counts(obj, *name == "TOTAL");
        assert_eq!(c, *want_counts, "{name}");
        assert_eq!(c[0], c[1] + c[2], "{name}: pending = ready + waiting");
        assert!(near(age, *oldest), "{name} oldest {age}");
    }

    // The human table: the same numbers, one line per type plus TOTAL.
    let out = exits(RelayBuilder::operator(&table.name), &["status"], 0).await;
    let mut lines = out.stdout.lines();
    let header: Vec<&str> = lines.next().expect("a header").split_whitespace().collect();
    let want_header =
        "AGGREGATE TYPE PENDING READY WAITING PROCESSING SENT FAILED EXPIRED BLOCKED OLDEST (s)";
    assert_eq!(header, want_header.split(' ').collect::<Vec<_>>());
    let table_rows: BTreeMap<String, Vec<String>> = lines
        .map(|l| {
            let mut cells = l.split_whitespace().map(str::to_owned);
            (cells.next().expect("a name"), cells.collect())
        })
        .collect();
    for (name, _, c, _) in &want {
        let cells = table_rows
            .get(*name)
            .unwrap_or_else(|| panic!("no {name} line in:\n{}", out.stdout));
        let human = c.map(|n| n.to_string());
        assert_eq!(cells[..8], human[..], "{name} line in:\n{}", out.stdout);
        let oldest: f64 = cells[8].parse().expect("oldest seconds");
        assert!(oldest >= 0.0, "{name} oldest {oldest}");
    }
    assert_eq!(table_rows.len(), 4, "{}", out.stdout);
    let total_oldest: f64 = table_rows["TOTAL"][8].parse().unwrap();
    assert!(near(total_oldest, 99.9), "TOTAL oldest {total_oldest}");

    table.drop_table().await;
}

// ---- check and migrate decide by what exists (missing, dropped, version-1 tables) -------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_makes_the_start_up_decision_about_a_missing_table() {
    let name = format!("ops_{}", hex8());
    // Never created: only its name is used.
    let table = TestTable {
        name: name.clone(),
        db: pg_connect().await,
    };

    // auto_migrate on: `run` would create the table, so `check` is satisfied (and creates
    // nothing itself).
    let out = exits(cli_auto(&name, true), &["check"], 0).await;
    out.assert_stdout_has(&format!(
        "table {name} does not exist yet and will be created on start"
    ));
    assert!(!table.exists().await, "check created the table");

    // auto_migrate off: `check` fails and names the fixes, and `run` refuses with the same words.
    let fix = format!(
        "table {name} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true"
    );
    let out = exits(cli_auto(&name, false), &["check"], 1).await;
    out.assert_stdout_has(&fix);
    let out = exits(cli_auto(&name, false), &["run"], 1).await;
    assert!(out.stderr.contains(&fix), "{}", out.stderr);
    // The operator's commands say the same, not the database's "relation does not exist".
    for args in [
        &["status"][..],
        &["dead-letters", "list"],
        &["dead-letters", "retry", "--all"],
    ] {
        let out = exits(cli_auto(&name, false), args, 1).await;
        assert!(out.stderr.contains(&fix), "{args:?}: {}", out.stderr);
    }
    assert!(!table.exists().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_auto_migrate_recreate_a_dropped_table() {
    let table = ops_table().await;
    let drop = format!("DROP TABLE {}", table.name);

    // Version 1 stays recorded in outbox_relay_schema_version; the table is what counts.
    table.db.batch_execute(&drop).await.unwrap();
    assert_migrates(&table.name, 1).await;
    assert!(table.exists().await);

    table.db.batch_execute(&drop).await.unwrap();
    let relay = cli_auto(&table.name, true).spawn();
    let migrated = "applied schema migrations";
    relay.wait_for_log(migrated, 1, WAIT).await;
    relay.wait_for_log("outbox-relay starting", 1, WAIT).await;
    relay.stop().await;
    // The whole schema is back: the sequence and its default work (the insert returns its row).
    let row = event("order", Some("o-1"), "created");
    table.insert_one(row).await;
    table.drop_table().await;
}

/// A version-1 table as `migrate` of an earlier release left it (its DDL only, with the
/// statement trigger that notified on every insert, recorded at version 1) holding 300 rows:
/// 200 pending, and 100 in flight, claimed by a relay of that release that is gone, its lease
/// running. Returns the table and the rows' ids.
async fn version_1_table() -> (TestTable, Vec<Uuid>) {
    let (name, db) = (format!("it_ops_v1_{}", hex8()), pg_connect().await);
    let table = TestTable { name, db };
    let (db, t) = (&table.db, TableName::parse(&table.name).unwrap());
    db.batch_execute(schema::VERSION_TABLE_DDL).await.unwrap();
    let ddl = MIGRATIONS[0].render(&t);
    db.batch_execute(&ddl).await.expect("version 1 DDL");
    let record = "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, 1)";
    db.execute(record, &[&table.name]).await.unwrap();
    let rows = NewRow::numbered(300, "order", Some(("u-", 7)), "e");
    let ids = table.insert_ids(&rows).await;
    let claim = format!(
        "UPDATE {0} SET status = 'processing', attempts = 1, locked_by = 'v1-relay', \
         locked_at = now() WHERE seq IN (SELECT seq FROM {0} ORDER BY seq LIMIT 100)",
        table.name
    );
    db.execute(&claim, &[]).await.unwrap();
    (table, ids)
}

/// How [`upgrade_a_version_1_table`] upgrades the table.
enum Upgrade {
    /// `outbox-relay migrate`, then `run`; also checks `migrate`'s output, that the file can be
    /// applied twice and that the rows are untouched.
    Migrate,
    /// `run` with `database.auto_migrate = true`.
    AutoMigrate,
}

/// A version-1 table with rows pending and in flight, upgraded in place (`how`); `run` without
/// `auto_migrate` refuses it. Upgraded (the latest schema version), it has the `expired` status, its
/// indexes and the deferred wake-up trigger; a relay drains every row (the old relay's once
/// their lease runs out), expires a row with a past deadline and is woken at once when idle.
async fn upgrade_a_version_1_table(how: Upgrade) {
    let (table, ids) = version_1_table().await;
    let rabbit = RabbitFixture::new("ops_upgrade", "#", "barrier.ops").await;
    // Not a "database down" loop that never publishes: a clear refusal naming the fix.
    let out = exits(cli_auto(&table.name, false), &["run"], 1).await;
    let refused = "a version-1 table without auto_migrate must be refused naming the fix";
    for words in ["predates schema version 2", "run `outbox-relay migrate`"] {
        assert!(out.stderr.contains(words), "{refused}: {}", out.stderr);
    }

    // A 10 s poll: only the wake-up can bring a row out at once.
    let relay = relay(&table, &rabbit, None)
        .set("relay.lease_timeout", "2s")
        .set("relay.poll_interval", "10s");
    let relay = match how {
        Upgrade::AutoMigrate => {
            let relay = relay.set("database.auto_migrate", "true").spawn();
            let migrated = "applied schema migrations";
            relay
                .wait_for_log(migrated, 1, Duration::from_secs(30))
                .await;
            relay
        }
        Upgrade::Migrate => {
            assert_migrates(&table.name, 2).await;
            // The files themselves are idempotent, as users may apply them from their own
            // migrations: every one after the first, again, in order.
            let t = TableName::parse(&table.name).unwrap();
            // Statement by statement, as `psql -f` applies them: their index statements run
            // CONCURRENTLY, which a transaction block refuses.
            for m in &MIGRATIONS[1..] {
                for statement in m.statements_for(&t) {
                    table
                        .db
                        .batch_execute(&statement)
                        .await
                        .unwrap_or_else(|e| panic!("{} applied twice: {e}", m.name));
                }
            }
            // The rows are untouched.
            let s = table.status_counts().await;
            assert_eq!((s["pending"], s["processing"]), (200, 100), "{s:?}");
            relay.spawn()
        }
    };

    // Catalogue queries about this table: `$1` is its name.
    let texts = async |sql: &str| -> Vec<String> {
        let rows = table.db.query(sql, &[&table.name]).await.unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    };
    let version =
        texts("SELECT version::text FROM outbox_relay_schema_version WHERE table_name = $1").await;
    let latest = MIGRATIONS.last().map(|m| m.version.to_string());
    assert_eq!(version, Vec::from_iter(latest));
    let check = texts(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = to_regclass($1) AND conname = $1 || '_status_check'",
    )
    .await;
    assert_eq!(check.len(), 1, "one status check: {check:?}");
    assert!(check[0].contains("'expired'"), "{check:?}");
    let indexes = texts("SELECT indexname::text FROM pg_indexes WHERE tablename = $1").await;
    let has_index = |suffix: &str| indexes.iter().any(|i| i.ends_with(suffix));
    for want in ["waiting_idx", "expiry_idx", "expired_idx", "blocker_idx"] {
        assert!(has_index(want), "{want} in {indexes:?}");
    }
    // Version 1's aggregate index is gone (version 2 replaced it with open_idx, version 6
    // that with waiting_idx).
    for gone in ["_aggregate_idx", "_open_idx"] {
        assert!(!has_index(gone), "{gone} in {indexes:?}");
    }
    let triggers = texts(
        "SELECT tgname || ' deferrable ' || tgdeferrable FROM pg_trigger \
         WHERE tgrelid = $1::text::regclass AND NOT tgisinternal",
    )
    .await;
    assert_eq!(triggers, [format!("{}_wakeup deferrable true", table.name)]);

    let late = table
        .insert_one(NewRow::order(Some("u-1"), "late").expires_in(-1.0))
        .await;
    rabbit.wait_for_ids(&ids, WAIT).await;
    let what = "every row settles";
    let settled = |s: &BTreeMap<String, i64>| s["sent"] == 300 && s.get("expired") == Some(&1);
    table.wait_for_counts(WAIT, what, settled).await;
    assert_eq!(table.row(late).await.status, "expired");

    // The upgraded table wakes the idle relay at once (the poll is 10 s).
    let what = "the relay records that it waits";
    let one = |waiters: &[String]| waiters.len() == 1;
    table.wait_waiters(Duration::from_secs(20), what, one).await;
    let id = table.insert_one(event("order", Some("u-1"), "e")).await;
    rabbit.wait_for_ids(&[id], Duration::from_secs(2)).await;
    // The row is marked sent just after its confirm: wait for that, then only the late row
    // is left unsent.
    let unsent = "status <> 'sent'";
    table.wait_count(unsent, 1, Duration::from_secs(10)).await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_version_1_table_in_place_with_rows_pending_and_in_flight() {
    upgrade_a_version_1_table(Upgrade::Migrate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_migrate_upgrades_a_version_1_table_in_place_with_rows_pending_and_in_flight() {
    upgrade_a_version_1_table(Upgrade::AutoMigrate).await;
}

// ---- dead letters -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_retry_and_discard() {
    let table = ops_table().await;
    let rows = [
        state_row("order", Some("o-1"), "failed", 1.0).failed_after(12, "nack: boom 1"),
        state_row("order", Some("o-2"), "failed", 1.0).failed_after(12, "nack: boom 2"),
        state_row("invoice", Some("i-1"), "failed", 1.0).failed_after(12, "nack: boom 3"),
        state_row("invoice", None, "failed", 1.0).failed_after(12, "nack: boom 4"),
        state_row("order", Some("o-3"), "pending", 1.0),
    ];
    let ids = insert_states(&table, &rows).await;
    let (f1, f2, f3, f4, pending) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    // `dead-letters <args>`, which must exit with `code`.
    let dl = async |args: &[&str], code: i32| {
        let all = [&["dead-letters"], args].concat();
        exits(RelayBuilder::operator(&table.name), &all, code).await
    };

    // list --json: the contract's shape, oldest (lowest seq) first, only failed rows.
    let out = dl(&["list", "--json"], 0).await;
    let list: Vec<Value> = serde_json::from_str(&out.stdout).expect("a JSON array");
    assert_eq!(list.len(), 4);
    let want_keys: BTreeSet<&str> = "outbox id seq aggregate_type aggregate_id event_type \
                                     attempts last_error created_at available_at"
        .split(' ')
        .collect();
    let mut last_seq = i64::MIN;
    for (n, (item, id)) in list.iter().zip([f1, f2, f3, f4]).enumerate() {
        assert_eq!(keys(item), want_keys);
        assert_eq!(item["id"], id.to_string());
        assert_eq!(item["outbox"], table.name.as_str());
        assert_eq!(item["attempts"], 12);
        assert_eq!(item["event_type"], "ops.event");
        assert_eq!(item["last_error"], format!("nack: boom {}", n + 1));
        let seq = item["seq"].as_i64().unwrap();
        assert!(seq > last_seq, "ordered by seq");
        last_seq = seq;
        for ts in ["created_at", "available_at"] {
            let text = item[ts].as_str().unwrap();
            let parsed = chrono::DateTime::parse_from_rfc3339(text);
            assert!(parsed.is_ok(), "{ts} is RFC 3339: {text}");
        }
    }
    assert_eq!(list[3]["aggregate_id"], Value::Null);
    assert_eq!(list[2]["aggregate_type"], "invoice");

    let out = dl(&["list", "--limit", "2", "--json"], 0).await;
    let limited: Vec<Value> = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(limited, list[..2]);

    let out = dl(&["list"], 0).await;
    for (id, error) in [(f1, "nack: boom 1"), (f4, "nack: boom 4")] {
        let listed = out.stdout.lines().find(|l| l.starts_with(&id.to_string()));
        let line = listed.unwrap_or_else(|| panic!("{id} not listed in:\n{}", out.stdout));
        assert!(line.contains("attempts 12"), "{line}");
        assert!(line.ends_with(error), "{line}");
    }

    // retry --id: back to pending, attempts reset, available now, last_error kept.
    let out = dl(&["retry", "--id", &f1.to_string()], 0).await;
    out.assert_stdout_has("1 dead letter(s) set back to pending");
    assert_pending_now(&table, f1, Some("nack: boom 1")).await;

    // discard --id: gone.
    let out = dl(&["discard", "--id", &f2.to_string()], 0).await;
    out.assert_stdout_has("1 dead letter(s) discarded");
    assert_eq!(row_state(&table, f2).await, None);

    // Ids that are not dead letters: exit 1 naming them, nothing changed.
    let unknown = Uuid::new_v4();
    for verb in ["retry", "discard"] {
        for id in [unknown, pending, f2].map(|id| id.to_string()) {
            let err = dl(&[verb, "--id", &id], 1).await.stderr;
            assert!(err.contains(&id), "{verb} --id {id}: no id in {err}");
        }
    }
    assert_pending_now(&table, pending, None).await;
    // Not a UUID at all: a usage error.
    dl(&["retry", "--id", "not-a-uuid"], 2).await;

    // retry --all: every remaining dead letter.
    let out = dl(&["retry", "--all"], 0).await;
    out.assert_stdout_has("2 dead letter(s) set back to pending");
    assert_pending_now(&table, f3, Some("nack: boom 3")).await;
    assert_pending_now(&table, f4, Some("nack: boom 4")).await;
    let out = dl(&["list", "--json"], 0).await;
    assert_eq!(out.stdout.trim(), "[]");
    dl(&["list"], 0).await.assert_stdout_has("no dead letters");
    assert_eq!(table.status_counts().await["pending"], 4);

    table.drop_table().await;
}

// ---- retention --------------------------------------------------------------------------------

/// Retention 1 s: sent rows go once their `sent_at` is that old, and nothing else does; then
/// retention 0: rows go on confirm, and dead letters still stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_sent_rows_or_rows_on_confirm_and_nothing_else() {
    let table = ops_table().await;
    let rabbit = RabbitFixture::new("ops_retention", "#", "barrier.ops").await;
    let rows = [
        state_row("order", Some("o-1"), "sent", 7200.0).sent(3600.0),
        state_row("order", Some("o-2"), "sent", 7200.0).sent(3600.0),
        state_row("order", None, "sent", 7200.0).sent(60.0),
        // Kept: a dead letter, and a row in backoff for an hour (the relay leaves it alone).
        state_row("order", Some("o-3"), "failed", 7200.0).failed_after(12, "nack"),
        state_row("order", Some("o-4"), "pending", 7200.0).available_in(3600.0),
    ];
    let ids = insert_states(&table, &rows).await;
    // The status of each row above ("gone" once deleted).
    let statuses = async || {
        let left = table.rows_by_id(&ids).await;
        let status = |id| left.get(id).map_or("gone".to_owned(), |r| r.status.clone());
        ids.iter().map(status).collect::<Vec<_>>()
    };
    let only_kept = ["gone", "gone", "gone", "failed", "pending"];
    let first = relay(&table, &rabbit, None)
        .set("cleanup.retention", "1s")
        .set("cleanup.interval", "1s")
        .spawn();

    table.wait_count("status = 'sent'", 0, WAIT).await;
    let deleted = "deleted sent rows past retention";
    first.wait_for_log(deleted, 1, WAIT).await;

    // A fresh row is published, stays `sent` for about the retention, then goes too.
    let row = event("order", Some("o-5"), "created");
    let fresh = table.insert_one(row).await;
    let mut oldest_seen_sent: Option<f64> = None;
    let sql = format!(
        "SELECT status, extract(epoch FROM now() - sent_at)::float8 FROM {} WHERE id = $1",
        table.name
    );
    wait_until(WAIT, "the fresh row is sent, then deleted", async || {
        let row = table.db.query_opt(&sql, &[&fresh]).await;
        let Some(r) = row.map_err(|e| e.to_string())? else {
            return Ok(());
        };
        let status: String = r.get(0);
        if status == "sent" {
            let age: f64 = r.get(1);
            oldest_seen_sent = Some(oldest_seen_sent.map_or(age, |o: f64| o.max(age)));
        }
        Err(format!("status {status}"))
    })
    .await;
    rabbit.wait_for_ids(&[fresh], WAIT).await;
    let oldest = oldest_seen_sent.expect("the fresh row was never seen as sent");
    assert!(
        oldest >= 0.5,
        "a recently sent row must outlive the 1s retention; it was last seen sent {oldest}s after its confirm"
    );

    // The failed row and the pending row survived every cleanup run so far.
    assert_eq!(statuses().await, only_kept, "under retention 1s");
    first.stop().await;

    // Retention 0: every published row is deleted on confirm; the dead letter stays.
    let relay = relay(&table, &rabbit, None)
        .set("cleanup.retention", "0s")
        .spawn();
    let batch = NewRow::numbered(20, "order", Some(("z-", 4)), "created");
    let published = table.insert_ids(&batch).await;
    let what = "every published row is deleted";
    let deleted = |counts: &BTreeMap<String, i64>| {
        assert_eq!(counts["sent"], 0, "retention 0s left a row sent");
        counts.values().sum::<i64>() == 2
    };
    table.wait_for_counts(WAIT, what, deleted).await;
    rabbit.wait_for_ids(&published, WAIT).await;
    // The two left are the dead letter (never deleted automatically) and the row in backoff.
    assert_eq!(statuses().await, only_kept, "under retention 0s");

    finish(relay, table, rabbit).await;
}

// ---- a real Prometheus ------------------------------------------------------------------------

/// `prometheus` (the Debian package) scraping one target every second, with the shipped alert
/// rules loaded; killed when dropped.
struct Prometheus {
    child: tokio::process::Child,
    port: u16,
    _dir: TempDir,
}

impl Prometheus {
    async fn start(target_port: u16) -> Self {
        let dir = TempDir::new("ops-prometheus");
        let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/alerts.yml");
        let yaml = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules}\n\
             scrape_configs:\n  - job_name: outbox-relay\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
        );
        let config = dir.write("prometheus.yml", &yaml);
        let log = dir.path().join("prometheus.log");
        let port = free_port();
        let child = tokio::process::Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("prometheus log file"))
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start prometheus: install it with `apt-get update && apt-get install -y prometheus` (.ci/run does this in CI)");
        wait_until(WAIT, "prometheus is ready", async || {
            match http_get(local(port), "/-/ready").await {
                Ok((200, _)) => Ok(()),
                other => {
                    let log = std::fs::read_to_string(&log).unwrap_or_default();
                    Err(format!("{other:?}; its log:\n{log}"))
                }
            }
        })
        .await;
        Self {
            child,
            port,
            _dir: dir,
        }
    }

    /// `GET /api/v1/<path>`, the `data` of a successful answer.
    async fn api(&self, path: &str) -> Result<Value, String> {
        let (code, body) = http_get(local(self.port), &format!("/api/v1/{path}")).await?;
        let v: Value = serde_json::from_str(&body).map_err(|e| format!("{code}: {e}: {body}"))?;
        if code != 200 || v["status"] != "success" {
            return Err(format!("{code}: {body}"));
        }
        Ok(v["data"].clone())
    }

    /// An instant query (every query here returns a vector): the value of each series.
    async fn query(&self, promql: &str) -> Result<Vec<f64>, String> {
        let q: String = url::form_urlencoded::byte_serialize(promql.as_bytes()).collect();
        let data = self.api(&format!("query?query={q}")).await?;
        if data["resultType"] != "vector" {
            return Err(format!("{promql} returned {data}, not a vector"));
        }
        let value_of = |series: &Value| -> Result<f64, String> {
            let value = series["value"][1].as_str().and_then(|v| v.parse().ok());
            value.ok_or_else(|| format!("bad sample in {series}"))
        };
        let result = data["result"].as_array().cloned().unwrap_or_default();
        result.iter().map(value_of).collect()
    }

    /// The single value of `promql`.
    async fn value(&self, promql: &str) -> Result<f64, String> {
        match self.query(promql).await?.as_slice() {
            [v] => Ok(*v),
            other => Err(format!("{promql}: {} series", other.len())),
        }
    }

    /// Waits until the single value of `promql` satisfies `ok`.
    async fn wait_value(&self, promql: &str, ok: impl Fn(f64) -> bool) {
        let what = format!("Prometheus: {promql} is as the test wants");
        wait_until(WAIT, &what, async || match self.value(promql).await {
            Ok(v) if ok(v) => Ok(()),
            other => Err(format!("{other:?}")),
        })
        .await;
    }

    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_relay_and_evaluates_the_shipped_rules() {
    let table = ops_table().await;
    let rabbit = RabbitFixture::new("ops_prometheus", "#", "barrier.ops").await;
    // A row in backoff (old, but not late: it must not trip the lag alert), a dead letter that
    // blocks o-9, and a ready row of o-9 behind it: 1,000 s past its `available_at`, but not
    // claimable, so it is not lag (the blocked-aggregates alert says why it waits).
    let backlog = [
        state_row("order", Some("o-1"), "pending", 1000.0).available_in(3600.0),
        state_row("order", Some("o-9"), "failed", 1.0).failed_after(12, "nack"),
        state_row("order", Some("o-9"), "pending", 1000.0).available_in(-1000.0),
    ];
    insert_states(&table, &backlog).await;
    let port = free_port();
    let relay = relay(&table, &rabbit, Some(port)).spawn();
    wait_ready(port, 200, "database: up\nbroker: up\n").await;
    let rows = [
        event("order", Some("o-2"), "created"),
        event("order", Some("o-3"), "created"),
        event("invoice", Some("i-1"), "issued"),
    ];
    let ids = table.insert_ids(&rows).await;
    rabbit.wait_for_ids(&ids, WAIT).await;

    let prom = Prometheus::start(port).await;
    for (q, want) in [
        // Prometheus scrapes the relay.
        (r#"up{job="outbox-relay"}"#, 1.0),
        (r#"outbox_pending_messages{state="waiting"}"#, 1.0),
        (r#"outbox_pending_messages{state="ready"}"#, 1.0),
        ("outbox_failed_messages", 1.0),
        ("outbox_blocked_aggregates", 1.0),
        ("sum(outbox_published_total)", 3.0),
        ("outbox_end_to_end_latency_seconds_count", 3.0),
    ] {
        prom.wait_value(q, |v| v == want).await;
    }
    // The lag Prometheus holds is the value the relay serves (the gauge changes every 5 s,
    // the scrape every 1 s: compare when both relay readings around the query agree).
    let what = "Prometheus holds the relay's current lag";
    let lag = wait_until(WAIT, what, async || {
        let before = sample(&scrape(port).await?, names::OLDEST_READY_AGE, &[]);
        let held = prom.value(names::OLDEST_READY_AGE).await?;
        let after = sample(&scrape(port).await?, names::OLDEST_READY_AGE, &[]);
        match (before, after) {
            (Some(b), Some(a)) if a == b && (held - a).abs() < 1e-9 => Ok(held),
            _ => Err(format!("relay {before:?}/{after:?}, Prometheus {held}")),
        }
    })
    .await;
    assert_eq!(
        lag, 0.0,
        "lag {lag}: the only ready row is blocked behind a dead letter, which is not lag"
    );

    // Every dashboard query runs on a real Prometheus and returns series.
    let json = include_str!("../deploy/grafana/outbox-relay.json");
    let dashboard: Value = serde_json::from_str(json).unwrap();
    // rate() needs two samples inside its window: wait for a few scrapes.
    let scrapes = r#"count_over_time(up{job="outbox-relay"}[1m])"#;
    prom.wait_value(scrapes, |n| n >= 3.0).await;
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let q = target["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m")
                .replace("$job", ".*")
                .replace("$instance", ".*")
                .replace("$outbox", ".*");
            let what = format!("panel {} ({q}) returns series", panel["title"]);
            wait_until(Duration::from_secs(20), &what, async || {
                match prom.query(&q).await {
                    Ok(series) if !series.is_empty() => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            })
            .await;
            queries += 1;
        }
    }
    assert!(queries > 10, "only {queries} dashboard queries");

    // The shipped rules load and evaluate; the ones this state should trip are pending (or
    // firing), and the relay is not reported down.
    let states = wait_until(WAIT, "every rule is evaluated", async || {
        let data = prom.api("rules").await?;
        let mut states = BTreeMap::new();
        for group in data["groups"].as_array().unwrap() {
            for rule in group["rules"].as_array().unwrap() {
                let name = rule["name"].as_str().unwrap().to_owned();
                if rule["health"] != "ok" {
                    let (health, error) = (&rule["health"], &rule["lastError"]);
                    return Err(format!("{name}: health {health} {error}"));
                }
                states.insert(name, rule["state"].as_str().unwrap_or_default().to_owned());
            }
        }
        // Pending or firing.
        let active = |name: &&str| states.get(*name).is_some_and(|s| s != "inactive");
        let tripped = ["OutboxDeadLetters", "OutboxBlockedAggregates"];
        if states.len() >= 6 && tripped.iter().all(active) {
            Ok(states)
        } else {
            Err(format!("{states:?}"))
        }
    })
    .await;
    assert_eq!(states["OutboxRelayDown"], "inactive", "{states:?}");
    assert_eq!(states["OutboxLagHigh"], "inactive", "{states:?}");
    assert_eq!(states["OutboxOrderingHeldBack"], "inactive", "{states:?}");

    prom.stop().await;
    finish(relay, table, rabbit).await;
}

// ---- configuration errors ----------------------------------------------------------------------

/// A bad configuration file, or none at the given path, makes `check` and `run` exit 2 with one
/// line on stderr that names the offending key (or the file), and nothing on stdout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_errors_exit_2_with_one_line_naming_the_key() {
    let dir = TempDir::new("config");
    // (what, the key the file sets (`section.field`), its bad TOML value)
    let cases = [
        ("unknown key", "relay.batch_sise", "3"),
        ("hostile table name", "database.table", "'x; drop table y'"),
        ("unparsable duration", "relay.poll_interval", "'soon'"),
        ("bare number duration", "retry.base_delay", "5"),
    ];
    // (what, the file, what the one line names)
    let mut files = Vec::new();
    for (what, key, value) in cases {
        let (section, field) = key.split_once('.').unwrap();
        let toml = format!("[{section}]\n{field} = {value}\n");
        files.push((what, dir.write(&format!("{field}.toml"), &toml), key));
    }
    let missing = "/nonexistent/outbox-relay/relay.toml";
    files.push(("missing file", missing.into(), missing));
    for (what, path, key) in files {
        for command in ["check", "run"] {
            let args = ["--config", path.to_str().unwrap(), command];
            let out = RelayBuilder::bare("config")
                .output(&args, Duration::from_secs(20))
                .await;
            let case = format!("{what}, {command}");
            assert_eq!(out.status.code(), Some(2), "{case}: {out:?}");
            let lines: Vec<&str> = out.stderr.lines().collect();
            assert_eq!(lines.len(), 1, "{case}: stderr should be one line: {out:?}");
            assert!(lines[0].contains(key), "{case}: no {key} in {:?}", lines[0]);
            assert!(out.stdout.is_empty(), "{case}: {out:?}");
        }
    }
}
