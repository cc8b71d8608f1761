//! Operations, end to end against the local PostgreSQL and RabbitMQ (contract §6, §7): what an
//! operator sees on `/metrics`, `/healthz` and `/readyz` (also through a broker outage), the
//! `status` and `dead-letters` commands against rows in known states, what `check`, `migrate`
//! and `run` do with a missing, dropped or version-1 table (upgraded in place with rows
//! pending and in flight), table vacuuming, retention cleanup, configuration errors, and a
//! real Prometheus scraping the relay with the shipped alert rules loaded.
//!
//! Each test has its own table (`ops_<hex>` created by the binary's own `migrate`, or an
//! `it_…` table of the kit) and its own exchange and queue; the tests that read `/metrics` or
//! the probes have their own metrics port.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{
    NewRow, PG_URL, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, TempDir, TestTable, finish,
    free_port, hex8, http_get, local, migrate_table, pg_connect, sample, scrape, wait_for_sample,
    wait_until,
};
use outbox_relay::config::TableName;
use outbox_relay::store::schema::{self, MIGRATIONS};
use outbox_relay::telemetry::names;
use serde_json::{Value, json};
use uuid::Uuid;

/// Generous bound for anything that normally takes a few seconds (gauges refresh every 5 s,
/// broker reconnects back off up to 30 s).
const WAIT: Duration = Duration::from_secs(60);

// ---- fixtures ---------------------------------------------------------------------------------

/// The binary configured for `table` only (no broker needed): for `migrate`, `status`,
/// `dead-letters`.
fn cli(table: &str) -> RelayBuilder {
    RelayBuilder::bare(table)
        .set("database.url", PG_URL)
        .set("database.table", table)
}

/// [`cli`] for `check` or `run` with `database.auto_migrate` set to `auto`, no metrics server.
fn cli_auto(table: &str, auto: bool) -> RelayBuilder {
    cli(table)
        .set("database.auto_migrate", auto.to_string())
        .set("metrics.listen", "")
}

/// A fresh `ops_<hex>` table, created by `outbox-relay migrate`.
async fn ops_table() -> TestTable {
    let name = format!("ops_{}", hex8());
    let applied = migrate_table(&name).await;
    let all: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(applied, all, "a fresh table gets every migration");
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
           now() + $5::float8 * interval '1 second', now() - $6::float8 * interval '1 second', \
           now() - $7::float8 * interval '1 second', $8, \
           CASE WHEN $3 = 'processing' THEN 'ops-other-relay' END, \
           CASE WHEN $3 = 'processing' THEN now() END) \
         RETURNING id",
        table.name
    );
    let mut ids = Vec::new();
    for r in rows {
        let row = table
            .db
            .query_one(
                &sql,
                &[
                    &r.aggregate_type,
                    &r.aggregate_id,
                    &r.status,
                    &r.attempts,
                    &r.available_in_secs,
                    &r.created_secs_ago,
                    &r.sent_secs_ago,
                    &r.last_error,
                ],
            )
            .await
            .unwrap_or_else(|e| panic!("insert {r:?}: {e}"));
        ids.push(row.get(0));
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

/// Waits until `/readyz` answers `want`; its body.
async fn wait_ready(port: u16, want: u16) -> String {
    let what = format!("/readyz answers {want}");
    wait_until(WAIT, &what, async || {
        match http_get(local(port), "/readyz").await? {
            (code, body) if code == want => Ok(body),
            (code, body) => Err(format!("{code}: {body:?}")),
        }
    })
    .await
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

    let body = wait_ready(port, 200).await;
    assert_eq!(body, "database: up\nbroker: up\n");
    let (code, body) = http_get(local(port), "/healthz").await.unwrap();
    assert_eq!((code, body.trim()), (200, "ok"));
    connected(1.0).await;

    let mut rows: Vec<NewRow> = (0..5)
        .map(|n| NewRow::new("order", Some(&format!("o-{n}")), "created", json!({"n": n})))
        .collect();
    rows.push(NewRow::new("invoice", Some("i-1"), "issued", json!({})));
    rows.push(NewRow::new("invoice", None, "issued", json!({})));
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
    for name in histograms {
        assert!(
            sample(&text, &format!("{name}_bucket"), &[("le", "+Inf")]).is_some(),
            "{name} has no +Inf bucket"
        );
        assert!(sample(&text, &format!("{name}_sum"), &[]).is_some());
    }
    for name in [names::PUBLISH_DURATION, names::END_TO_END_LATENCY] {
        let count = sample(&text, &format!("{name}_count"), &[]).unwrap();
        assert_eq!(count, 7.0, "{name}_count after 7 confirms");
        assert_eq!(
            sample(&text, &format!("{name}_bucket"), &[("le", "+Inf")]),
            Some(7.0)
        );
    }
    let claimed = sample(&text, &format!("{}_sum", names::CLAIM_BATCH_SIZE), &[]).unwrap();
    assert!(claimed >= 7.0, "claims returned {claimed} rows in total");
    let instance = format!("{}-relay", table.name);
    let info = [
        ("instance", instance.as_str()),
        ("publisher", "rabbitmq"),
        ("version", env!("CARGO_PKG_VERSION")),
    ];
    let info = sample(&text, names::RELAY_INFO, &info);
    assert_eq!(info, Some(1.0), "outbox_relay_info:\n{text}");
    for kind in ["message", "connection"] {
        assert_eq!(
            sample(&text, names::PUBLISH_FAILURES, &[("kind", kind)]),
            Some(0.0),
            "publish failures of kind {kind}"
        );
    }
    assert_eq!(sample(&text, names::DEAD_LETTERED, &[]), Some(0.0));
    for state in ["ready", "waiting"] {
        assert!(sample(&text, names::PENDING, &[("state", state)]).is_some());
    }
    // Every per-table metric carries the outbox's name (contract §7): here, the table's.
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
        assert!(
            sample(&text, name, &outbox).is_some(),
            "{name} has no sample labelled outbox=\"{}\"",
            table.name
        );
    }
    // No high-cardinality labels: neither a row id nor an aggregate id appears anywhere.
    let leaked = ids.iter().find(|id| text.contains(&id.to_string()));
    assert!(leaked.is_none(), "a row id leaked into /metrics");
    assert!(
        !text.contains("o-1"),
        "an aggregate id leaked into /metrics"
    );

    // The broker goes away while nothing is in flight (every row is settled): the cut is seen
    // on the connection alone.
    let before_cut = rabbit.count();
    proxy.cut();
    let body = wait_ready(port, 503).await;
    assert_eq!(body, "database: up\nbroker: down\n");
    // /healthz is liveness only: a broker outage must not get the process restarted.
    assert_eq!(http_get(local(port), "/healthz").await.unwrap().0, 200);
    connected(0.0).await;

    let during = table
        .insert_ids(&[
            NewRow::new("order", Some("o-1"), "updated", json!({})),
            NewRow::new("order", Some("o-2"), "created", json!({})),
            NewRow::new("invoice", Some("i-1"), "issued", json!({})),
            NewRow::new("invoice", None, "issued", json!({})),
        ])
        .await;
    // Wait until the 4 rows inserted during the outage show as ready.
    let (ready, waiting) = ([("state", "ready")], [("state", "waiting")]);
    wait_for_sample(port, WAIT, names::PENDING, &ready, |v| v == 4.0).await;
    // Wait until the rows inserted during the outage count as late.
    wait_for_sample(port, WAIT, names::OLDEST_READY_AGE, &[], |v| v > 0.0).await;
    let age1 = sample(&scrape(port).await.unwrap(), names::OLDEST_PENDING_AGE, &[]).unwrap();
    // Wait until the lag grows while the broker is unreachable.
    let grown = |v: f64| v >= age1 + 1.0;
    let age2 = wait_for_sample(port, WAIT, names::OLDEST_PENDING_AGE, &[], grown).await;
    assert!(age2 > 1.0, "lag {age2}");
    let text = scrape(port).await.unwrap();
    assert_eq!(sample(&text, names::PENDING, &waiting), Some(0.0));
    let (code, _) = http_get(local(port), "/readyz").await.unwrap();
    assert_eq!(code, 503, "still not ready");
    assert_eq!(
        rabbit.count(),
        before_cut,
        "nothing was published during the outage"
    );
    let untried = table
        .count_where("status = 'pending' AND attempts = 0")
        .await;
    assert_eq!(untried, 4, "an outage spends no attempt");
    let unavailable = "broker unavailable; not claiming rows";
    relay.wait_for_log(unavailable, 2, WAIT).await;
    // Wait until the lost connection and the failed reconnects are counted.
    let connection = [("kind", "connection")];
    let counted = |v: f64| v >= 3.0;
    let failures = wait_for_sample(port, WAIT, names::PUBLISH_FAILURES, &connection, counted).await;
    assert!(failures >= 3.0, "{failures}");

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
    assert_eq!(
        sample(&text, names::PUBLISH_FAILURES, &[("kind", "message")]),
        Some(0.0)
    );
    let body = wait_ready(port, 200).await;
    assert_eq!(body, "database: up\nbroker: up\n");
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
    insert_states(
        &table,
        &[
            // In flight for 500 s: the oldest unsent row.
            state_row("order", Some("o1"), "processing", 500.0),
            // Waiting out a backoff for another 300 s: not late, but the oldest waiting.
            state_row("order", Some("o2"), "pending", 200.0).available_in(300.0),
            // Its backoff ended 30 s ago: ready for 30 s (not 100).
            state_row("order", Some("o3"), "pending", 100.0).available_in(-30.0),
            // Ready since its insert 10 s ago.
            state_row("invoice", None, "pending", 10.0),
        ],
    )
    .await;
    let mut raw = outbox_relay::config::RawConfig::default();
    raw.database.url = PG_URL.to_owned();
    raw.database.table = Some(table.name.clone());
    raw.metrics.listen = String::new();
    let config = raw.validate().unwrap();
    let store =
        outbox_relay::store::Store::new(&config.database, &config.relay.instance_id).unwrap();
    let b = store.backlog().await.unwrap();
    let near = |got: f64, want: f64| (got - want).abs() < 5.0;
    assert_eq!((b.ready, b.waiting), (2, 1), "{b:?}");
    assert!(near(b.oldest_ready_age, 30.0), "{b:?}");
    assert!(near(b.oldest_waiting_age, 200.0), "{b:?}");
    assert!(near(b.oldest_pending_age, 500.0), "{b:?}");
    table.drop_table().await;
}

// ---- table health ------------------------------------------------------------------------------

#[tokio::test]
async fn the_relay_vacuums_its_table_when_autovacuum_is_off() {
    let table = TestTable::new("ops_vacuum").await;
    // Off for this table whatever the server says (this machine's server has it off anyway).
    let off = format!(
        "ALTER TABLE {} SET (autovacuum_enabled = false)",
        table.name
    );
    table.db.batch_execute(&off).await.unwrap();
    let rabbit = RabbitFixture::new("ops_vacuum", "#", "barrier.x").await;
    let relay = relay(&table, &rabbit, None)
        .set("cleanup.retention", "0s")
        .spawn();
    // 8,000 rows sent and deleted leave about 16,000 dead tuples (claim + delete).
    let rows: Vec<NewRow> = (0..8_000)
        .map(|i| NewRow::new("vac", None, "tick", json!({ "i": i })))
        .collect();
    for chunk in rows.chunks(2_000) {
        table.insert(chunk).await;
    }
    relay
        .wait_for_log("vacuumed the outbox table", 1, WAIT)
        .await;
    assert!(relay.stderr().contains("reason=\"autovacuum is off\""));
    // Every row is sent and deleted.
    table.wait_count("true", 0, WAIT).await;
    // Later vacuums keep the dead tuples below the threshold.
    let sql = "SELECT coalesce(n_dead_tup, 0) FROM pg_stat_user_tables \
               WHERE relid = $1::text::regclass";
    wait_until(WAIT, "dead tuples fall below 10,000", async || {
        let row = table.db.query_one(sql, &[&table.name]).await;
        let dead: i64 = row.map_err(|e| e.to_string())?.get(0);
        (dead < 10_000)
            .then_some(())
            .ok_or_else(|| format!("{dead} dead tuples"))
    })
    .await;
    finish(relay, table, rabbit).await;
}

// ---- status -----------------------------------------------------------------------------------

/// The integer counts of `status --json` (contract §6), in the human table's column order.
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

/// The integer counts of a `status --json` object in [`COUNT_KEYS`] order, plus its oldest
/// age; checks its keys.
fn counts(v: &Value, top: bool) -> ([i64; 8], f64) {
    let obj = v.as_object().expect("a JSON object");
    let mut want: BTreeSet<&str> = COUNT_KEYS.into_iter().collect();
    want.insert("oldest_pending_age_seconds");
    if top {
        want.insert("by_aggregate_type");
        // Always present (one outbox here, named after the table): one shape for scripts.
        want.insert("by_outbox");
    }
    let have: BTreeSet<&str> = obj.keys().map(String::as_str).collect();
    assert_eq!(have, want, "status --json keys (contract §6)");
    let ints = COUNT_KEYS.map(|k| obj[k].as_i64().expect("an integer count"));
    let age = obj["oldest_pending_age_seconds"].as_f64();
    (ints, age.expect("a number"))
}

/// `status --json` for `table`, parsed.
async fn status_json(table: &str) -> Value {
    let out = cli(table).output(&["status", "--json"], WAIT).await;
    assert!(out.status.success(), "{}", out.stderr);
    serde_json::from_str(&out.stdout).expect("status --json is JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_rows_by_state_and_aggregate_type() {
    let table = ops_table().await;

    // An empty table: zeros, no types.
    let v = status_json(&table.name).await;
    assert_eq!(counts(&v, true), ([0; 8], 0.0));
    assert_eq!(v["by_aggregate_type"], json!({}));

    insert_states(
        &table,
        &[
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
        ],
    )
    .await;

    let v = status_json(&table.name).await;
    let by_outbox = v["by_outbox"].as_object().expect("by_outbox");
    assert_eq!(by_outbox.len(), 1, "{v}");
    let single = by_outbox[&table.name].clone();
    let mut totals = v.clone();
    totals.as_object_mut().unwrap().remove("by_outbox");
    assert_eq!(single, totals, "one outbox: its entry is the totals");
    let t = &v["by_aggregate_type"];
    let types = t.as_object().expect("by_aggregate_type");
    let type_names: Vec<&str> = types.keys().map(String::as_str).collect();
    assert_eq!(type_names, ["", "invoice", "order"]);
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
    let out = cli(&table.name).output(&["status"], WAIT).await;
    assert!(out.status.success(), "{}", out.stderr);
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

async fn table_exists(db: &tokio_postgres::Client, name: &str) -> bool {
    let sql = "SELECT to_regclass($1) IS NOT NULL";
    db.query_one(sql, &[&name]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_makes_the_start_up_decision_about_a_missing_table() {
    let name = format!("ops_{}", hex8());
    let db = pg_connect().await;

    // auto_migrate on: `run` would create the table, so `check` is satisfied (and creates
    // nothing itself).
    let out = cli_auto(&name, true).output(&["check"], WAIT).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    out.assert_stdout_has(&format!(
        "table {name} does not exist yet and will be created on start"
    ));
    assert!(!table_exists(&db, &name).await, "check created the table");

    // auto_migrate off: `check` fails and names the fixes, and `run` refuses with the same words.
    let fix = format!(
        "table {name} does not exist: run `outbox-relay migrate`, or set database.auto_migrate = true"
    );
    let out = cli_auto(&name, false).output(&["check"], WAIT).await;
    assert_eq!(out.status.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains(&fix), "{}", out.stdout);
    let out = cli_auto(&name, false).output(&["run"], WAIT).await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&fix), "{}", out.stderr);
    assert!(!table_exists(&db, &name).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_auto_migrate_recreate_a_dropped_table() {
    let table = ops_table().await;
    let drop = format!("DROP TABLE {}", table.name);

    // Version 1 stays recorded in outbox_relay_schema_version; the table is what counts.
    table.db.batch_execute(&drop).await.unwrap();
    let out = cli(&table.name).output(&["migrate"], WAIT).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    out.assert_stdout_has("applied schema versions [1");
    assert!(table_exists(&table.db, &table.name).await);
    let again = cli(&table.name).output(&["migrate"], WAIT).await;
    assert!(again.stdout.contains("is up to date"), "{}", again.stdout);

    table.db.batch_execute(&drop).await.unwrap();
    let relay = cli_auto(&table.name, true).spawn();
    relay
        .wait_for_log("applied schema migrations", 1, WAIT)
        .await;
    relay.wait_for_log("outbox-relay starting", 1, WAIT).await;
    relay.stop().await;
    // The whole schema is back: the sequence and its default work.
    let inserted = table
        .insert(&[NewRow::new("order", Some("o-1"), "created", json!({}))])
        .await;
    assert_eq!(inserted.len(), 1);
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
    let ddl = schema::render(MIGRATIONS[0].sql, &t);
    db.batch_execute(&ddl).await.expect("version 1 DDL");
    let record = "INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ($1, 1)";
    db.execute(record, &[&table.name]).await.unwrap();
    let ids = table
        .insert_ids(&NewRow::numbered(300, "order", Some(("u-", 7)), "e"))
        .await;
    let claim = format!(
        "UPDATE {0} SET status = 'processing', attempts = 1, locked_by = 'v1-relay', \
         locked_at = now() WHERE seq IN (SELECT seq FROM {0} ORDER BY seq LIMIT 100)",
        table.name
    );
    db.execute(&claim, &[]).await.unwrap();
    (table, ids)
}

/// A version-1 table with rows pending and in flight, upgraded in place by `migrate` or by
/// `run` with `auto_migrate` (`auto`); `run` without it refuses the table. Upgraded (schema
/// version 3), it has the `expired` status, its indexes and the deferred wake-up trigger; a
/// relay drains every row (the old relay's once their lease runs out), expires a row with a
/// past deadline and is woken at once when idle.
async fn upgrade_a_version_1_table(auto: bool) {
    let (table, ids) = version_1_table().await;
    let rabbit = RabbitFixture::new("ops_upgrade", "#", "barrier.ops").await;
    // Not a "database down" loop that never publishes: a clear refusal naming the fix.
    let out = cli_auto(&table.name, false).output(&["run"], WAIT).await;
    let refused = "a version-1 table without auto_migrate must be refused naming the fix";
    assert_eq!(out.status.code(), Some(1), "{refused}: {}", out.stderr);
    assert!(
        out.stderr.contains("predates schema version 2")
            && out.stderr.contains("run `outbox-relay migrate`"),
        "{refused}: {}",
        out.stderr
    );

    // A 10 s poll: only the wake-up can bring a row out at once.
    let relay = relay(&table, &rabbit, None)
        .set("relay.lease_timeout", "2s")
        .set("relay.poll_interval", "10s");
    let relay = if auto {
        let relay = relay.set("database.auto_migrate", "true").spawn();
        let migrated = "applied schema migrations";
        relay
            .wait_for_log(migrated, 1, Duration::from_secs(30))
            .await;
        relay
    } else {
        let out = cli(&table.name).output(&["migrate"], WAIT).await;
        assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
        out.assert_stdout_has("applied schema versions [2");
        let out = cli(&table.name).output(&["migrate"], WAIT).await;
        assert!(out.stdout.contains("is up to date"), "{}", out.stdout);
        // The file itself is idempotent, as users may apply it from their own migrations.
        let t = TableName::parse(&table.name).unwrap();
        let (db, again) = (&table.db, schema::render(MIGRATIONS[1].sql, &t));
        db.batch_execute(&again).await.expect("0002 applied twice");
        // The rows are untouched.
        let s = table.status_counts().await;
        assert_eq!((s["pending"], s["processing"]), (200, 100), "{s:?}");
        relay.spawn()
    };

    // Catalogue queries about this table: `$1` is its name.
    let texts = async |sql: &str| -> Vec<String> {
        let rows = table.db.query(sql, &[&table.name]).await.unwrap();
        rows.iter().map(|r| r.get(0)).collect()
    };
    let version =
        texts("SELECT version::text FROM outbox_relay_schema_version WHERE table_name = $1").await;
    assert_eq!(version, ["3"]);
    let check = texts(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = to_regclass($1) AND conname = $1 || '_status_check'",
    )
    .await;
    assert!(
        check.len() == 1 && check[0].contains("'expired'"),
        "{check:?}"
    );
    let indexes = texts("SELECT indexname::text FROM pg_indexes WHERE tablename = $1").await;
    for want in ["open_idx", "expiry_idx", "expired_idx"] {
        assert!(
            indexes.iter().any(|i| i.ends_with(want)),
            "{want} in {indexes:?}"
        );
    }
    assert!(
        !indexes.iter().any(|i| i.ends_with("_aggregate_idx")),
        "{indexes:?}"
    );
    let triggers = texts(
        "SELECT tgname || ' deferrable ' || tgdeferrable FROM pg_trigger \
         WHERE tgrelid = $1::text::regclass AND NOT tgisinternal",
    )
    .await;
    assert_eq!(triggers, [format!("{}_wakeup deferrable true", table.name)]);

    let late = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, expires_at) \
         VALUES ('order', 'u-1', 'late', '{{}}', now() - interval '1 second') RETURNING id",
        table.name
    );
    let late: Uuid = table.db.query_one(&late, &[]).await.unwrap().get(0);
    rabbit.wait_for_ids(&ids, WAIT).await;
    let what = "every row settles";
    let settled = |s: &BTreeMap<String, i64>| s["sent"] == 300 && s.get("expired") == Some(&1);
    table.wait_for_counts(WAIT, what, settled).await;
    assert_eq!(table.row(late).await.status, "expired");

    // The upgraded table wakes the idle relay at once (the poll is 10 s).
    let waiting = format!("SELECT count(*) FROM {}_waiters", table.name);
    wait_until(
        Duration::from_secs(20),
        "the relay records that it waits",
        async || {
            let n: i64 = table.db.query_one(&waiting, &[]).await.unwrap().get(0);
            (n == 1).then_some(()).ok_or_else(|| format!("{n}"))
        },
    )
    .await;
    let id = table
        .insert_one(NewRow::new("order", Some("u-1"), "e", json!({})))
        .await;
    rabbit.wait_for_ids(&[id], Duration::from_secs(2)).await;
    // The row is marked sent just after its confirm: wait for that, then only the late row
    // is left unsent.
    table
        .wait_count("status <> 'sent'", 1, Duration::from_secs(10))
        .await;
    finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_upgrades_a_version_1_table_in_place_with_rows_pending_and_in_flight() {
    upgrade_a_version_1_table(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_migrate_upgrades_a_version_1_table_in_place_with_rows_pending_and_in_flight() {
    upgrade_a_version_1_table(true).await;
}

// ---- dead letters -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_list_retry_and_discard() {
    let table = ops_table().await;
    let ids = insert_states(
        &table,
        &[
            state_row("order", Some("o-1"), "failed", 1.0).failed_after(12, "nack: boom 1"),
            state_row("order", Some("o-2"), "failed", 1.0).failed_after(12, "nack: boom 2"),
            state_row("invoice", Some("i-1"), "failed", 1.0).failed_after(12, "nack: boom 3"),
            state_row("invoice", None, "failed", 1.0).failed_after(12, "nack: boom 4"),
            state_row("order", Some("o-3"), "pending", 1.0),
        ],
    )
    .await;
    let (f1, f2, f3, f4, pending) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    let dl = async |args: &[&str]| {
        let all = [&["dead-letters"], args].concat();
        cli(&table.name).output(&all, WAIT).await
    };

    // list --json: the contract's shape, oldest (lowest seq) first, only failed rows.
    let out = dl(&["list", "--json"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let list: Vec<Value> = serde_json::from_str(&out.stdout).expect("a JSON array");
    assert_eq!(list.len(), 4);
    let keys: BTreeSet<&str> = "outbox id seq aggregate_type aggregate_id event_type attempts \
                                last_error created_at available_at"
        .split(' ')
        .collect();
    let mut last_seq = i64::MIN;
    for (n, (item, id)) in list.iter().zip([f1, f2, f3, f4]).enumerate() {
        let have: BTreeSet<&str> = item
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(have, keys);
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

    let out = dl(&["list", "--limit", "2", "--json"]).await;
    let limited: Vec<Value> = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(limited, list[..2]);

    let out = dl(&["list"]).await;
    assert!(out.status.success());
    for (id, error) in [(f1, "nack: boom 1"), (f4, "nack: boom 4")] {
        let listed = out.stdout.lines().find(|l| l.starts_with(&id.to_string()));
        let line = listed.unwrap_or_else(|| panic!("{id} not listed in:\n{}", out.stdout));
        let shown = line.contains("attempts 12") && line.ends_with(error);
        assert!(shown, "{line}");
    }

    // retry --id: back to pending, attempts reset, available now, last_error kept.
    let out = dl(&["retry", "--id", &f1.to_string()]).await;
    assert!(out.status.success(), "{}", out.stderr);
    out.assert_stdout_has("1 dead letter(s) set back to pending");
    assert_eq!(
        row_state(&table, f1).await,
        Some(("pending".into(), 0, Some("nack: boom 1".into()), true))
    );

    // discard --id: gone.
    let out = dl(&["discard", "--id", &f2.to_string()]).await;
    assert!(out.status.success(), "{}", out.stderr);
    out.assert_stdout_has("1 dead letter(s) discarded");
    assert_eq!(row_state(&table, f2).await, None);

    // Ids that are not dead letters: a non-zero exit naming them, nothing changed.
    let unknown = Uuid::new_v4();
    for verb in ["retry", "discard"] {
        for id in [unknown, pending, f2] {
            let out = dl(&[verb, "--id", &id.to_string()]).await;
            let (code, err) = (out.status.code(), &out.stderr);
            assert_eq!(code, Some(1), "{verb} --id {id}: {err}");
            let named = err.contains(&id.to_string());
            assert!(named, "{verb} --id {id}: the error names the id: {err}");
        }
    }
    assert_eq!(
        row_state(&table, pending).await,
        Some(("pending".into(), 0, None, true))
    );
    // Not a UUID at all: a usage error.
    let out = dl(&["retry", "--id", "not-a-uuid"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", out.stderr);

    // retry --all: every remaining dead letter.
    let out = dl(&["retry", "--all"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    out.assert_stdout_has("2 dead letter(s) set back to pending");
    for (id, n) in [(f3, 3), (f4, 4)] {
        assert_eq!(
            row_state(&table, id).await,
            Some(("pending".into(), 0, Some(format!("nack: boom {n}")), true))
        );
    }
    let out = dl(&["list", "--json"]).await;
    assert_eq!(out.stdout.trim(), "[]");
    let out = dl(&["list"]).await;
    assert!(out.stdout.contains("no dead letters"), "{}", out.stdout);
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
    let ids = insert_states(
        &table,
        &[
            state_row("order", Some("o-1"), "sent", 7200.0).sent(3600.0),
            state_row("order", Some("o-2"), "sent", 7200.0).sent(3600.0),
            state_row("order", None, "sent", 7200.0).sent(60.0),
            // Kept: a dead letter, and a row in backoff for an hour (the relay leaves it alone).
            state_row("order", Some("o-3"), "failed", 7200.0).failed_after(12, "nack"),
            state_row("order", Some("o-4"), "pending", 7200.0).available_in(3600.0),
        ],
    )
    .await;
    let (old_sent, kept) = ids.split_at(3);
    let first = relay(&table, &rabbit, None)
        .set("cleanup.retention", "1s")
        .set("cleanup.interval", "1s")
        .spawn();

    // The old sent rows are deleted.
    table.wait_count("status = 'sent'", 0, WAIT).await;
    first
        .wait_for_log("deleted sent rows past retention", 1, WAIT)
        .await;

    // A fresh row is published, stays `sent` for about the retention, then goes too.
    let fresh = table
        .insert_one(NewRow::new("order", Some("o-5"), "created", json!({})))
        .await;
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
    for (id, status) in kept.iter().zip(["failed", "pending"]) {
        let state = row_state(&table, *id).await.map(|s| s.0);
        assert_eq!(state.as_deref(), Some(status));
    }
    for id in old_sent {
        assert_eq!(row_state(&table, *id).await, None);
    }
    first.stop().await;

    // Retention 0: every published row is deleted on confirm; the dead letter stays.
    let relay = relay(&table, &rabbit, None)
        .set("cleanup.retention", "0s")
        .spawn();
    let ids = table
        .insert_ids(&NewRow::numbered(20, "order", Some(("z-", 4)), "created"))
        .await;
    let what = "every published row is deleted";
    table
        .wait_for_counts(WAIT, what, |counts| {
            assert_eq!(
                counts["sent"], 0,
                "with retention 0s no row is ever left sent"
            );
            counts.values().sum::<i64>() == 2
        })
        .await;
    rabbit.wait_for_ids(&ids, WAIT).await;
    // The two left are the dead letter (never deleted automatically) and the row in backoff.
    for (id, status) in kept.iter().zip(["failed", "pending"]) {
        let state = row_state(&table, *id).await.map(|s| s.0);
        assert_eq!(state.as_deref(), Some(status), "retention 0s keeps {id}");
    }

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
        let rules = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yml");
        let config = dir.write(
            "prometheus.yml",
            &format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: outbox-relay\n    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n",
                rules = rules.display()
            ),
        );
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
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start prometheus ({e}): install it with `apt-get update && apt-get install -y prometheus` (.ci/run does this in CI)"
                )
            });
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

    /// An instant query: the value of each series.
    async fn query(&self, promql: &str) -> Result<Vec<f64>, String> {
        let q: String = url::form_urlencoded::byte_serialize(promql.as_bytes()).collect();
        let data = self.api(&format!("query?query={q}")).await?;
        let value = |pair: &Value| -> Result<f64, String> {
            pair[1]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| format!("bad sample {pair}"))
        };
        match data["resultType"].as_str() {
            Some("vector") => data["result"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| value(&r["value"]))
                .collect(),
            Some("scalar") => Ok(vec![value(&data["result"])?]),
            other => Err(format!("unexpected result type {other:?} for {promql}")),
        }
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
    // A row in backoff (old, but not late: it must not trip the lag alert by itself), a dead
    // letter that blocks o-9, and a ready row of o-9 behind it (late: the lag is large and
    // steady).
    insert_states(
        &table,
        &[
            state_row("order", Some("o-1"), "pending", 1000.0).available_in(3600.0),
            state_row("order", Some("o-9"), "failed", 1.0).failed_after(12, "nack"),
            state_row("order", Some("o-9"), "pending", 1000.0).available_in(-1000.0),
        ],
    )
    .await;
    let port = free_port();
    let relay = relay(&table, &rabbit, Some(port)).spawn();
    wait_ready(port, 200).await;
    let ids = table
        .insert_ids(&[
            NewRow::new("order", Some("o-2"), "created", json!({})),
            NewRow::new("order", Some("o-3"), "created", json!({})),
            NewRow::new("invoice", Some("i-1"), "issued", json!({})),
        ])
        .await;
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
    assert!(
        lag >= 1000.0,
        "the blocked ready row is 1000 s old: lag {lag}"
    );

    // Every dashboard query runs on a real Prometheus and returns series.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/outbox-relay.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in dashboard["panels"].as_array().unwrap() {
        let title = p["title"].as_str().unwrap();
        for t in p["targets"].as_array().cloned().unwrap_or_default() {
            exprs.push((title.to_owned(), t["expr"].as_str().unwrap().to_owned()));
        }
    }
    assert!(exprs.len() > 10, "dashboard queries: {}", exprs.len());
    // rate() needs two samples inside its window: wait for a few scrapes.
    let scrapes = r#"count_over_time(up{job="outbox-relay"}[1m])"#;
    prom.wait_value(scrapes, |n| n >= 3.0).await;
    for (title, expr) in &exprs {
        let q = expr
            .replace("$__rate_interval", "1m")
            .replace("$job", ".*")
            .replace("$instance", ".*")
            .replace("$outbox", ".*");
        let what = format!("panel {title:?} ({q}) returns series");
        wait_until(Duration::from_secs(20), &what, async || {
            match prom.query(&q).await {
                Ok(series) if !series.is_empty() => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }

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
        let firing = |n: &&str| {
            states
                .get(*n)
                .is_some_and(|s| s == "pending" || s == "firing")
        };
        let tripped = [
            "OutboxDeadLetters",
            "OutboxBlockedAggregates",
            "OutboxLagHigh",
        ];
        if states.len() >= 6 && tripped.iter().all(firing) {
            Ok(states)
        } else {
            Err(format!("{states:?}"))
        }
    })
    .await;
    assert_eq!(states["OutboxRelayDown"], "inactive", "{states:?}");
    assert_eq!(states["OutboxOrderingHeldBack"], "inactive", "{states:?}");

    prom.stop().await;
    finish(relay, table, rabbit).await;
}

// ---- configuration errors ----------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_errors_exit_2_with_one_line_naming_the_key() {
    let missing = "/nonexistent/outbox-relay/relay.toml";
    // (what, command, the file's contents (none: no such file), what the one line names)
    let cases = [
        (
            "unknown key",
            "check",
            Some("[relay]\nbatch_sise = 3\n"),
            "relay.batch_sise",
        ),
        (
            "hostile table name",
            "check",
            Some("[database]\ntable = \"x; drop table y\"\n"),
            "database.table",
        ),
        (
            "unparsable duration",
            "run",
            Some("[relay]\npoll_interval = \"soon\"\n"),
            "relay.poll_interval",
        ),
        (
            "bare number duration",
            "run",
            Some("[retry]\nbase_delay = 5\n"),
            "retry.base_delay",
        ),
        ("missing file", "check", None, missing),
    ];
    for (what, command, toml, key) in cases {
        let dir = TempDir::new("config");
        let path = toml.map_or_else(|| missing.into(), |t| dir.write("bad.toml", t));
        let args = ["--config", path.to_str().unwrap(), command];
        let out = RelayBuilder::bare("config")
            .output(&args, Duration::from_secs(20))
            .await;
        assert_eq!(out.status.code(), Some(2), "{what}: {out:?}");
        let lines: Vec<&str> = out.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{what}: stderr should be one line: {out:?}");
        assert!(
            lines[0].contains(key),
            "{what}: {:?} should name {key}",
            lines[0]
        );
        assert!(out.stdout.is_empty(), "{what}: {out:?}");
    }
}
