//! Redis Streams (`publisher.kind = "redis"`) end to end: the real binary, PostgreSQL and
//! `redis-server` on 127.0.0.1:6379. Each test uses its own stream keys (a unique prefix,
//! [`RedisStreams`]) and table.
//!
//! Covered: the entry's fields exactly as the contract lists them (signature verified over the
//! stream key), `max_len` trimming, per-aggregate order with 1,000 aggregates while a quarter
//! of them fail with `WRONGTYPE` mid-run, a `WRONGTYPE` row dead-lettered without holding back
//! other aggregates, a 10 s outage (a proxy cut with rows flowing: nothing lost, no attempt
//! spent, `/readyz` and `outbox_broker_connected` follow), a relay SIGKILLed three times during
//! a 20k drain (nothing lost or reordered, duplicates within `max_in_flight` per kill), a
//! server unreachable at start, no reply within `publisher.redis.timeout` (handed
//! back), a row over the server's `proto-max-bulk-len`, `check` against a reachable and an
//! unreachable server, and `rediss://` (TLS in front of the server: a trusted CA relays, an
//! untrusted one spends nothing).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

#[path = "signing/verify.rs"]
mod verify;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::kafka::{TlsFront, write_unrelated_ca};
use common::{
    Analysis, NewRow, Proxy, REDIS_ADDR, REDIS_URL, RedisStreams, RelayBuilder, RelayProcess,
    RowState, TempDir, TestTable, analyse, assert_none, expected_row_headers, free_port, http_get,
    local, not_sent_once, redis_relay, scrape, spawn_steady_writer, time_problem, wait_until,
};
use redis::AsyncCommands;
use serde_json::{Value, json};

/// How long rows or entries may take to show up.
const WAIT: Duration = Duration::from_secs(60);

/// A table, the test's streams and a relay publishing to `<prefix>.{aggregate_type}` on the
/// local Redis (metrics server off).
async fn setup(test: &str) -> (TestTable, RedisStreams, RelayBuilder) {
    let table = TestTable::new(test).await;
    let streams = RedisStreams::new(test).await;
    let relay = redis_relay(&table, REDIS_URL, &streams.template(), test);
    (table, streams, relay)
}

/// Drops the table and deletes the test's keys.
async fn teardown(table: TestTable, streams: RedisStreams) {
    streams.teardown().await;
    table.drop_table().await;
}

/// Checks that each of `rows` reached its stream, in order per aggregate, a duplicate at worst
/// (`case` names the scenario), prints the figures (`<label> rows=… duplicates=… <extra>`),
/// then stops `relay` and cleans up; the analysis, for the caller's own bounds.
async fn finish(
    (relay, table, streams): (RelayProcess, TestTable, RedisStreams),
    rows: &[RowState],
    case: &str,
    (label, extra): (&str, String),
) -> Analysis {
    let analysis = streams.analyse(rows).await;
    analysis.assert_complete(case);
    println!(
        "{label} rows={} duplicates={} {extra}",
        rows.len(),
        analysis.duplicates
    );
    relay.stop().await;
    teardown(table, streams).await;
    analysis
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_are_exactly_as_contracted_and_signed_over_the_stream_key() {
    let (table, streams, relay) = setup("redis_fields").await;
    let key = b"0123456789abcdef0123456789abcdef".as_slice();
    let relay = relay
        .set("signing.key_id", "k1")
        .set("signing.key", "0123456789abcdef0123456789abcdef")
        .spawn();
    let special = streams.key("special");
    let rows = [
        NewRow::new("order", Some("o-1"), "created", json!({"a": 1, "s": "é✓"})).headers(
            json!({"trace": "t-1", "n": 5, "nested": {"k": [1]}, "gone": null, "outbox-signature": "forged"}),
        ),
        NewRow::new("order", None, "noted", json!([1, "two"])),
        NewRow::new("order", Some("o-2"), "moved", json!({})).destination(&special),
    ];
    let ids = table.insert_ids(&rows).await;
    table.wait_all_sent(WAIT).await;
    let by_id: HashMap<_, RowState> = table.rows().await.into_iter().map(|r| (r.id, r)).collect();

    let order = streams.key("order");
    let mut entries = streams.entries(&order).await;
    entries.extend(streams.entries(&special).await);
    assert_eq!(entries.len(), 3, "{entries:#?}");
    let keys = HashMap::from([("k1", key)]);
    for entry in &entries {
        let id: uuid::Uuid = entry.field("id").unwrap().parse().unwrap();
        assert!(ids.contains(&id));
        let row = &by_id[&id];
        let mut names = vec!["id", "source", "specversion", "type"];
        if row.aggregate_id.is_some() {
            names.push("subject");
        }
        names.extend([
            "time",
            "datacontenttype",
            "aggregatetype",
            "headers",
            "data",
            "outbox-signature",
        ]);
        assert_eq!(entry.names(), names, "fields of {id}");
        let field = |n: &str| entry.field(n).unwrap();
        assert_eq!(field("source"), table.default_source());
        assert_eq!(field("specversion"), "1.0");
        assert_eq!(field("type"), row.event_type);
        assert_eq!(entry.field("subject"), row.aggregate_id);
        let time = entry.field("time");
        assert_eq!(time_problem("time", time.as_deref(), row.created_at), None);
        assert_eq!(field("datacontenttype"), "application/json");
        assert_eq!(field("aggregatetype"), "order");
        // The row's headers, stringified, nulls dropped; the forged signature replaced.
        let mut want = expected_row_headers(&row.headers);
        want.remove("outbox-signature");
        let got: BTreeMap<String, String> = serde_json::from_str(&field("headers")).unwrap();
        assert_eq!(got, want, "headers of {id}");
        let data: Value = serde_json::from_str(&field("data")).unwrap();
        assert_eq!(data, row.payload, "data of {id}");
        let stream = if row.destination.is_some() {
            &special
        } else {
            &order
        };
        let subject = row.aggregate_id.clone().unwrap_or_default();
        let attrs = [
            id.to_string(),
            field("source"),
            field("type"),
            subject,
            stream.clone(),
            field("time"),
            field("datacontenttype"),
        ];
        let attrs = attrs.each_ref().map(String::as_str);
        let body = entry.fields.iter().find(|(k, _)| k == "data").unwrap();
        let sig = field("outbox-signature");
        assert!(
            verify::verify(&sig, &keys, attrs, &body.1),
            "signature of {id}: {sig}"
        );
    }
    relay.stop().await;
    teardown(table, streams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_len_trims_each_stream() {
    let (table, streams, relay) = setup("redis_trim").await;
    let relay = relay.set("publisher.redis.max_len", "10").spawn();
    let ids = table
        .insert_ids(&NewRow::numbered(500, "trim", Some(("X", 1)), "e"))
        .await;
    table.wait_all_sent(WAIT).await;
    let key = streams.key("trim");
    let len = streams.len(&key).await;
    // `MAXLEN ~` removes whole radix-tree nodes (100 entries each by default): at least 10 stay,
    // and far fewer than 500.
    assert!(
        (10..=200).contains(&len),
        "XLEN {key} = {len} after 500 XADDs"
    );
    let entries = streams.entries(&key).await;
    let last = entries.last().and_then(|e| e.field("id"));
    assert_eq!(last, Some(ids[499].to_string()), "the newest entry is kept");
    relay.stop().await;
    teardown(table, streams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_holds_per_aggregate_with_1000_aggregates_and_wrongtype_failures_mid_run() {
    let (table, streams, relay) = setup("redis_order").await;
    let relay = relay
        .ordered()
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "400ms")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", "1000")
        .spawn();
    // 1,000 aggregates over four streams (aggregate types t0..t3), 10 rows each, inserted in
    // rounds so that every aggregate has rows in flight while the next round arrives.
    let row = |i: usize| {
        let a = i % 1000;
        NewRow::new(
            &format!("t{}", a % 4),
            Some(&format!("a{a}")),
            "e",
            json!({ "i": i }),
        )
    };
    let (t3, moved) = (streams.key("t3"), streams.key("t3-before"));
    let mut conn = streams.conn();
    for round in 0..10 {
        let rows: Vec<NewRow> = (round * 1000..(round + 1) * 1000).map(row).collect();
        table.insert(&rows).await;
        if round == 4 {
            // Mid-run, t3's stream key becomes a string: its XADDs fail with WRONGTYPE
            // (message-level), its aggregates back off and hold their later rows. One
            // MULTI/EXEC, so that no XADD lands between the two on a new stream that the SET
            // would then overwrite.
            streams.wait_for_entries(1000, WAIT).await;
            let _: () = redis::pipe()
                .atomic()
                .cmd("RENAME")
                .arg(&t3)
                .arg(&moved)
                .ignore()
                .cmd("SET")
                .arg(&t3)
                .arg("not a stream")
                .ignore()
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    let what = "t3 rows are rejected with WRONGTYPE";
    wait_until(WAIT, what, async || {
        let n = table
            .count_where("attempts > 1 AND last_error LIKE '%WRONGTYPE%'")
            .await;
        if n > 0 { Ok(n) } else { Err("none yet".into()) }
    })
    .await;
    // The other aggregates are not held back meanwhile.
    let others = "aggregate_type <> 't3' AND status <> 'sent'";
    table.wait_count(others, 0, WAIT).await;
    let _: () = conn.del(&t3).await.unwrap();
    table.wait_all_sent(WAIT).await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), 10_000);
    // t3's arrivals: what reached the stream before it was moved, then the new stream; then
    // the other aggregates' streams.
    let mut keys = vec![moved.clone(), t3.clone()];
    keys.extend((0..3).map(|t| streams.key(&format!("t{t}"))));
    let mut ids: Vec<String> = Vec::new();
    for key in &keys {
        ids.extend(
            streams
                .entries(key)
                .await
                .iter()
                .filter_map(|e| e.field("id")),
        );
    }
    let analysis = analyse(&rows, ids.iter().map(String::as_str));
    analysis.assert_exactly_once("1,000 aggregates with WRONGTYPE mid-run");
    relay.stop().await;
    teardown(table, streams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrongtype_row_is_dead_lettered_without_holding_back_other_aggregates() {
    let (table, streams, relay) = setup("redis_wrongtype").await;
    let bad = streams.key("bad");
    let mut conn = streams.conn();
    let _: () = conn.set(&bad, "a string, not a stream").await.unwrap();
    let relay = relay
        .ordered()
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .set("retry.jitter", "0")
        .set("retry.max_attempts", "2")
        .spawn();
    let dead = table
        .insert_ids(&NewRow::numbered(3, "bad", Some(("X", 1)), "e"))
        .await;
    let ok = table
        .insert_ids(&NewRow::numbered(200, "ok", Some(("Y", 20)), "e"))
        .await;
    let what = "X's head is dead-lettered with WRONGTYPE";
    let failed = |r: &RowState| r.status == "failed";
    let head = table.wait_row(dead[0], WAIT, what, failed).await;
    let error = head.last_error.unwrap_or_default();
    assert!(error.contains("WRONGTYPE"), "{error}");
    assert_eq!(head.attempts, 2);
    let ok_rows = table.rows_by_id(&ok).await;
    let sent = ok_rows.values().filter(|r| r.status == "sent").count();
    if sent < ok.len() {
        table
            .wait_count("aggregate_type = 'ok' AND status <> 'sent'", 0, WAIT)
            .await;
    }
    assert_eq!(streams.len(&streams.key("ok")).await, 200);
    for id in &dead[1..] {
        let r = table.row(*id).await;
        let state = (r.status.as_str(), r.attempts);
        assert_eq!(
            state,
            ("pending", 0),
            "rows behind a dead letter wait, no attempt spent"
        );
    }
    let kind: String = redis::cmd("TYPE")
        .arg(&bad)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "string", "nothing was written over the key");
    relay.stop().await;
    teardown(table, streams).await;
}

/// Rows dead-lettered or left with a spent attempt.
const SPENT: &str = "status = 'failed' OR (status = 'pending' AND attempts > 0)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10s_outage_with_rows_flowing_loses_nothing_and_spends_no_attempt() {
    let test = "redis_outage";
    let table = TestTable::new(test).await;
    let streams = RedisStreams::new(test).await;
    let proxy = Proxy::start(REDIS_ADDR).await;
    let port = free_port();
    let url = format!("redis://{}", proxy.addr());
    let relay = redis_relay(&table, &url, &streams.template(), test)
        .ordered()
        .set("metrics.listen", local(port).to_string())
        .set("relay.lease_timeout", "120s")
        .set("retry.base_delay", "100ms")
        .set("publisher.redis.timeout", "5s")
        .spawn();
    let writer = spawn_steady_writer(&table.name, "cut", 13, 20);
    streams.wait_for_entries(300, WAIT).await;
    let connected = |text: &str| common::sample(text, "outbox_broker_connected", &[]);
    let metrics = scrape(port).await.unwrap();
    assert_eq!(connected(&metrics), Some(1.0), "{metrics}");

    // Cut with XADDs in flight: hold Redis's replies back until rows are claimed and
    // unconfirmed, then drop every connection and refuse new ones for 10 s.
    proxy.stall();
    let unsettled =
        "status = 'processing' AND locked_at < clock_timestamp() - interval '300 milliseconds'";
    let what = "rows are in flight when the connection is cut";
    wait_until(Duration::from_secs(10), what, async || {
        match table.count_where(unsettled).await {
            0 => Err("none processing".to_owned()),
            n => Ok(n),
        }
    })
    .await;
    let before = proxy.accepted();
    proxy.cut();
    let cut_at = Instant::now();
    relay
        .wait_for_log("broker unavailable", 1, Duration::from_secs(10))
        .await;
    let what = "/readyz fails and outbox_broker_connected is 0 during the outage";
    wait_until(Duration::from_secs(10), what, async || {
        let ready = http_get(local(port), "/readyz").await.map(|(s, _)| s);
        let text = scrape(port).await.unwrap_or_default();
        match (ready, connected(&text)) {
            (Ok(503), Some(0.0)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    while cut_at.elapsed() < Duration::from_secs(10) {
        let spent = table.count_where(SPENT).await;
        assert_eq!(spent, 0, "the outage spent attempts:\n{}", relay.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waiting = table.count_where("status <> 'sent'").await;
    assert!(waiting > 0, "rows should have piled up during the outage");
    proxy.heal();
    relay.wait_for_log("connected to the broker", 2, WAIT).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (stop, writer) = writer;
    stop.cancel();
    let written = writer.await.unwrap();
    assert!(written > 0);
    table.wait_all_sent(WAIT).await;
    assert!(
        proxy.accepted() > before,
        "the relay came back through the proxy"
    );
    let ready = http_get(local(port), "/readyz").await.map(|(s, _)| s);
    assert_eq!(ready, Ok(200));

    let rows = table.rows().await;
    assert_none("rows not sent with attempts = 1", &not_sent_once(&rows));
    let handed_back = relay.log_count("handing the row back");
    assert!(
        handed_back >= 1,
        "rows in flight at the cut were handed back"
    );
    // A cut can lose the reply of an XADD that Redis executed: that row is published again (a
    // duplicate), never lost or reordered.
    let figures = format!("unsent_at_heal={waiting} handed_back_logs={handed_back}");
    let parts = (relay, table, streams);
    finish(parts, &rows, "10 s outage", ("REDIS-OUTAGE", figures)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sigkills_during_a_20k_drain_lose_and_reorder_nothing() {
    let (table, streams, _) = setup("redis_sigkill").await;
    let max_in_flight = 500;
    let rows: Vec<NewRow> = (0..20_000)
        .map(|i| {
            let a = i % 1000;
            NewRow::new("acct", Some(&format!("a{a}")), "e", json!({ "i": i }))
        })
        .collect();
    for chunk in rows.chunks(2000) {
        table.insert(chunk).await;
    }
    let spawn = |n: usize| {
        redis_relay(&table, REDIS_URL, &streams.template(), &format!("kill{n}"))
            .ordered()
            .set("relay.max_in_flight", max_in_flight.to_string())
            .set("relay.lease_timeout", "2s")
            .set("retry.max_attempts", "100")
            .quiet()
            .spawn()
    };
    let key = streams.key("acct");
    let mut relay = spawn(0);
    let mut held_at_kill = Vec::new();
    for k in 1..=3 {
        let since = streams.len(&key).await;
        let what = format!("relay {k} holds rows and publishes");
        let label = relay.label.clone();
        wait_until(WAIT, &what, async || {
            let held = format!("status = 'processing' AND locked_by = '{label}'");
            let held = table.count_where(&held).await;
            let progress = streams.len(&key).await.saturating_sub(since);
            if held > 0 && progress >= 1000 {
                Ok(held)
            } else {
                Err(format!("{held} held, {progress} published"))
            }
        })
        .await;
        relay.sigkill();
        let status = relay.wait_exit(Duration::from_secs(10)).await;
        assert_eq!(status.signal(), Some(9));
        let held = format!("status = 'processing' AND locked_by = '{label}'");
        held_at_kill.push(table.count_where(&held).await);
        relay = spawn(k);
    }
    table.wait_all_sent(Duration::from_secs(180)).await;
    let rows = table.rows().await;
    let figures = format!("kills=3 held_at_each_kill={held_at_kill:?}");
    let case = "three SIGKILLs during a 20k drain";
    let analysis = finish(
        (relay, table, streams),
        &rows,
        case,
        ("REDIS-SIGKILL", figures),
    )
    .await;
    let bound = 3 * max_in_flight;
    let why = format!("duplicates beyond max_in_flight ({max_in_flight}) per kill");
    assert!(
        analysis.duplicates <= bound,
        "{} {why}",
        analysis.duplicates
    );
    assert!(
        held_at_kill.iter().sum::<i64>() > 0,
        "no kill caught rows in flight"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_redis_and_never_prints_its_password() {
    let table = TestTable::new("redis_check").await;
    let check = |url: &str| {
        RelayBuilder::operator(&table.name)
            .set("publisher.kind", "redis")
            .set("publisher.redis.url", url)
            .output(&["check"], Duration::from_secs(30))
    };
    let ok = check(REDIS_URL).await;
    assert!(ok.status.success(), "{}\n{}", ok.stdout, ok.stderr);
    ok.assert_stdout_has(
        "broker: ok (redis redis://127.0.0.1:6379 stream \"outbox.{aggregate_type}\")",
    );
    // Nothing listens on this port: exit 1, the password masked.
    let down = format!("redis://user:hunter2@127.0.0.1:{}", free_port());
    let failed = check(&down).await;
    assert_eq!(failed.status.code(), Some(1), "{}", failed.stdout);
    failed.assert_stdout_has("broker: FAILED");
    let all = format!("{}{}", failed.stdout, failed.stderr);
    assert!(
        !all.contains("hunter2") && all.contains("user:***@"),
        "{all}"
    );
    let bad = check("redis://127.0.0.1:6379/notadb").await;
    assert_eq!(bad.status.code(), Some(2), "{}", bad.stderr);
    assert!(bad.stderr.contains("publisher.redis.url"), "{}", bad.stderr);
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_at_start_is_waited_for() {
    let test = "redis_late";
    let table = TestTable::new(test).await;
    let streams = RedisStreams::new(test).await;
    let proxy = Proxy::start(REDIS_ADDR).await;
    proxy.cut();
    let url = format!("redis://{}", proxy.addr());
    let mut relay = redis_relay(&table, &url, &streams.template(), test)
        .set("retry.base_delay", "100ms")
        .spawn();
    let ids = table
        .insert_ids(&NewRow::numbered(50, "late", Some(("X", 5)), "e"))
        .await;
    relay
        .wait_for_log("broker unavailable", 2, Duration::from_secs(20))
        .await;
    assert!(relay.is_running(), "the relay exited:\n{}", relay.stderr());
    assert_eq!(
        table.count_where("attempts > 0").await,
        0,
        "nothing claimed"
    );
    proxy.heal();
    table.wait_all_sent(WAIT).await;
    let rows = table.rows_by_id(&ids).await;
    let rows: Vec<RowState> = rows.into_values().collect();
    assert_none("rows not sent once", &not_sent_once(&rows));
    streams
        .analyse(&rows)
        .await
        .assert_exactly_once("after a late start");
    relay.stop().await;
    teardown(table, streams).await;
}

/// Sets the server's `proto-max-bulk-len` and puts the old value back on drop (synchronously,
/// so a failing test restores it too).
struct BulkLimit(String);

impl BulkLimit {
    fn set(bytes: &str) -> Self {
        let mut conn = redis::Client::open(REDIS_URL)
            .unwrap()
            .get_connection()
            .unwrap();
        let old: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("proto-max-bulk-len")
            .query(&mut conn)
            .unwrap();
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("proto-max-bulk-len")
            .arg(bytes)
            .query(&mut conn)
            .unwrap();
        Self(old[1].clone())
    }
}

impl Drop for BulkLimit {
    fn drop(&mut self) {
        if let Ok(mut conn) = redis::Client::open(REDIS_URL).and_then(|c| c.get_connection()) {
            let _: Result<(), _> = redis::cmd("CONFIG")
                .arg("SET")
                .arg("proto-max-bulk-len")
                .arg(&self.0)
                .query(&mut conn);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_the_servers_bulk_limit_is_one_failed_row() {
    // 1 MB is the least Redis accepts; only this test sends anything near it.
    let _limit = BulkLimit::set("1mb");
    let (table, streams, relay) = setup("redis_huge").await;
    let relay = relay
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .set("retry.max_attempts", "2")
        .spawn();
    let big = "x".repeat(1_100_000);
    let huge = table
        .insert_one(NewRow::new("huge", Some("H"), "e", json!({ "big": big })))
        .await;
    let ok = table
        .insert_ids(&NewRow::numbered(100, "ok", Some(("Y", 10)), "e"))
        .await;
    let what = "the huge row is dead-lettered";
    let row = table
        .wait_row(huge, WAIT, what, |r| r.status == "failed")
        .await;
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains("proto-max-bulk-len"), "{error}");
    table
        .wait_count("aggregate_type = 'ok' AND status <> 'sent'", 0, WAIT)
        .await;
    assert_eq!(streams.len(&streams.key("ok")).await, ok.len());
    assert_eq!(streams.len(&streams.key("huge")).await, 0);
    relay.stop().await;
    teardown(table, streams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_verifies_the_server_and_an_untrusted_certificate_spends_nothing() {
    let test = "redis_tls";
    let (table, streams, _) = setup(test).await;
    let dir = TempDir::new(test);
    // TLS terminated in front of the local server, with a certificate from a fresh CA.
    let front = TlsFront::start(6379, dir.path()).await;
    let url = format!("rediss://127.0.0.1:{}", front.addr().port());
    let ids = table
        .insert_ids(&NewRow::numbered(20, "tls", Some(("T", 4)), "created"))
        .await;

    // A relay that trusts another CA: handshakes fail, nothing is claimed or spent.
    let unrelated = write_unrelated_ca(dir.path());
    let untrusting = redis_relay(&table, &url, &streams.template(), "redis-tls-untrusted")
        .env("SSL_CERT_FILE", unrelated.display().to_string())
        .spawn();
    common::wait_for_count(WAIT, "two failed handshakes", 2, || {
        front.handshakes_failed()
    })
    .await;
    assert_eq!(table.count_where("attempts > 0").await, 0);
    assert_eq!(streams.keys().await, Vec::<String>::new());
    untrusting.stop().await;

    let relay = redis_relay(&table, &url, &streams.template(), "redis-tls")
        .env("SSL_CERT_FILE", front.ca_pem.display().to_string())
        .spawn();
    table.wait_all_sent(WAIT).await;
    let rows: Vec<RowState> = table.rows_by_id(&ids).await.into_values().collect();
    assert_none("rows not sent once", &not_sent_once(&rows));
    streams
        .analyse(&rows)
        .await
        .assert_exactly_once("over rediss://");
    assert!(front.handshakes_ok() >= 1);

    // `check` over TLS too.
    let check = RelayBuilder::operator(&table.name)
        .set("publisher.kind", "redis")
        .set("publisher.redis.url", &url)
        .env("SSL_CERT_FILE", front.ca_pem.display().to_string())
        .output(&["check"], Duration::from_secs(30))
        .await;
    assert!(check.status.success(), "{}\n{}", check.stdout, check.stderr);
    check.assert_stdout_has(&format!("broker: ok (redis {url} stream"));
    relay.stop().await;
    teardown(table, streams).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reply_within_the_timeout_hands_the_row_back_without_spending_an_attempt() {
    let test = "redis_no_reply";
    let table = TestTable::new(test).await;
    let streams = RedisStreams::new(test).await;
    let proxy = Proxy::start(REDIS_ADDR).await;
    let url = format!("redis://{}", proxy.addr());
    let relay = redis_relay(&table, &url, &streams.template(), test)
        .set("publisher.redis.timeout", "2s")
        .spawn();
    // The XADD reaches Redis and is appended; its reply never comes back.
    let (_, held) = common::an_unanswered_publish_is_handed_back(
        &table,
        &proxy,
        &relay,
        "reply",
        "handing the row back without spending an attempt",
        async |n| streams.wait_for_entries(n, WAIT).await,
    )
    .await;
    // At least once: the unanswered XADD was appended, and its republish may be too.
    let entries = streams.entries(&streams.key("reply")).await;
    let copies = entries
        .iter()
        .filter(|e| e.field("id") == Some(held.to_string()))
        .count();
    assert!((1..=2).contains(&copies), "{entries:?}");
    relay.stop().await;
    teardown(table, streams).await;
}
