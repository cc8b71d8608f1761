//! NATS JetStream end to end (docs/nats.md) against the real `nats-server -js` on
//! 127.0.0.1:4222: each test creates its own stream capturing its own subjects.
//! - The message: CloudEvents NATS binding headers, `Nats-Msg-Id` = row id, the row's headers
//!   (ours win), a signature that an independent verifier accepts.
//! - Order per aggregate over 1,000 aggregates, with failures injected mid-run (rows whose
//!   subject no stream captures yet).
//! - A message-level failure (no stream, a payload above `max_payload`) is dead-lettered
//!   without holding back other aggregates.
//! - A 10 s outage (a proxy cut) with rows flowing: nothing lost, no attempt spent, `/readyz`
//!   and `outbox_broker_connected` follow the connection.
//! - kill -9 of the relay 3 times during a 20k drain: the duplicate window leaves 0 duplicates
//!   in the stream, 0 lost, order kept.
//! - No acknowledgement within `ack_timeout`: the row is handed back (no attempt spent), stored once.
//! - A stream whose duplicate window is shorter than twice the lease is warned about by `check`
//!   and at start.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;
#[path = "signing/verify.rs"]
mod verify;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::nats::{NATS_ADDR, NATS_URL, NatsStream, StreamMessage, nats_relay};
use common::{
    NewRow, Proxy, RelayBuilder, RowState, TestTable, analyse, assert_none, free_port, http_get,
    local, not_sent_once, wait_for_sample, wait_until,
};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
const KEY: &str = "nats-signing-key-0123456789abcdefghijklmn";

/// The stream's messages checked against the rows: nothing lost, foreign, duplicated or (per
/// aggregate) out of order.
fn assert_exactly_once_in_order(what: &str, rows: &[RowState], messages: &[StreamMessage]) {
    analyse(rows, messages.iter().map(StreamMessage::id)).assert_exactly_once(what);
}

#[tokio::test]
async fn messages_carry_the_cloudevents_nats_binding_and_a_verifiable_signature() {
    let table = TestTable::new("nats_headers").await;
    let stream = NatsStream::new("nats_headers").await;
    let clashing = json!({
        "trace": "t-1", "n": 1, "nested": {"k": [1]}, "gone": null,
        "ce-id": "forged", "content-type": "text/plain", "Nats-Msg-Id": "forged",
    });
    let custom = format!("{}.custom.dest", stream.prefix);
    let ids = table
        .insert_ids(&[
            NewRow::new("order", Some("o-1"), "created", json!({"a": 1, "é": "✓"}))
                .headers(clashing.clone()),
            NewRow::new("order", None, "noted", json!([1, 2])).headers(clashing),
            NewRow::new("order", Some("o-1"), "shipped", json!({})).destination(&custom),
        ])
        .await;
    let relay = nats_relay(&table, &stream, NATS_URL, "nats-headers")
        .set("signing.key_id", "k1")
        .env("RELAY_SIGNING__KEY", KEY)
        .spawn();
    table.wait_all_sent(WAIT).await;
    let messages = stream.messages().await;
    let rows = table.rows().await;
    assert_exactly_once_in_order("headers", &rows, &messages);

    let by_id: HashMap<String, &RowState> = rows.iter().map(|r| (r.id.to_string(), r)).collect();
    for m in &messages {
        let row = by_id[m.id()];
        let id = row.id.to_string();
        let time = m.header("ce-time").unwrap_or_default().to_owned();
        assert_eq!(
            common::time_problem("ce-time", Some(&time), row.created_at),
            None
        );
        let subject = match &row.destination {
            Some(d) => d.clone(),
            None => format!("{}.order.{}", stream.prefix, row.event_type),
        };
        assert_eq!(m.subject, subject);
        let source = table.default_source();
        let sig = m.header("outbox-signature").unwrap_or_default().to_owned();
        let mut want: BTreeMap<String, String> = [
            ("ce-id", id.as_str()),
            ("ce-source", source.as_str()),
            ("ce-specversion", "1.0"),
            ("ce-type", row.event_type.as_str()),
            ("ce-time", time.as_str()),
            ("ce-aggregatetype", "order"),
            ("Content-Type", "application/json"),
            ("Nats-Msg-Id", id.as_str()),
            ("outbox-signature", sig.as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        if let Some(a) = &row.aggregate_id {
            want.insert("ce-subject".into(), a.clone());
        }
        if row.headers != json!({}) {
            for (k, v) in [("trace", "t-1"), ("n", "1"), ("nested", r#"{"k":[1]}"#)] {
                want.insert(k.into(), v.into());
            }
        }
        assert_eq!(m.headers, want, "headers of {id}");
        let body: Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(body, row.payload, "body of {id}");
        let keys = HashMap::from([("k1", KEY.as_bytes())]);
        let subject_attr = row.aggregate_id.clone().unwrap_or_default();
        let attrs = [
            id.as_str(),
            source.as_str(),
            row.event_type.as_str(),
            subject_attr.as_str(),
            m.subject.as_str(),
            time.as_str(),
            "application/json",
        ];
        assert!(
            verify::verify(&sig, &keys, attrs, &m.payload),
            "signature of {id}"
        );
        let mut tampered = m.payload.clone();
        tampered.push(b' ');
        assert!(!verify::verify(&sig, &keys, attrs, &tampered));
    }
    assert_eq!(ids.len(), messages.len());
    // Two rows carry the same three clashing names: one warning per name.
    let warned = "named like one the relay sets itself";
    assert_eq!(relay.log_count(warned), 3, "{}", relay.stderr());
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn order_per_aggregate_holds_over_1000_aggregates_through_failures_mid_run() {
    let table = TestTable::new("nats_order").await;
    let stream = NatsStream::new("nats_order").await;
    // Only `<prefix>.ok.>` is captured at first: rows sent to `<prefix>.late.…` fail.
    let ok = format!("{}.ok.>", stream.prefix);
    stream.set_subjects(std::slice::from_ref(&ok)).await;
    let mut rows = NewRow::numbered(10_000, "order", Some(("a-", 1_000)), "created");
    // The 5th row of 20 aggregates goes where no stream listens yet; 5 rows follow it.
    let late = |i: usize| i % 1_000 < 20 && i / 1_000 == 4;
    for (i, row) in rows.iter_mut().enumerate() {
        if late(i) {
            row.destination = Some(format!("{}.late.a-{}", stream.prefix, i % 1_000));
        }
    }
    for chunk in rows.chunks(2_500) {
        table.insert(chunk).await;
    }
    let relay = nats_relay(&table, &stream, NATS_URL, "nats-order")
        .set(
            "publisher.nats.subject",
            format!("{}.ok.{{aggregate_type}}.{{event_type}}", stream.prefix),
        )
        .set("relay.ordering", "aggregate")
        .set("retry.base_delay", "200ms")
        .set("retry.max_delay", "1s")
        .set("retry.max_attempts", "1000")
        .spawn();
    // Everything but the 20 failing rows and the 5 behind each goes through.
    let held = 20 * 6;
    table
        .wait_count("status = 'sent'", 10_000 - held, WAIT)
        .await;
    table
        .wait_count(
            "attempts >= 2 AND last_error LIKE '%no JetStream stream captures%'",
            20,
            WAIT,
        )
        .await;
    let early = table.rows().await;
    let failing: Vec<&RowState> = early.iter().filter(|r| r.destination.is_some()).collect();
    let sent_behind: Vec<String> = early
        .iter()
        .filter(|r| r.status == "sent")
        .filter(|r| {
            failing
                .iter()
                .any(|f| f.aggregate_id == r.aggregate_id && f.seq < r.seq)
        })
        .map(|r| format!("{:?} seq {}", r.aggregate_id, r.seq))
        .collect();
    assert_none(
        "rows sent while an earlier row of their aggregate failed",
        &sent_behind,
    );

    stream
        .set_subjects(&[ok, format!("{}.late.>", stream.prefix)])
        .await;
    table.wait_all_sent(WAIT).await;
    let messages = stream.messages().await;
    let rows = table.rows().await;
    assert_exactly_once_in_order("1000 aggregates with failures mid-run", &rows, &messages);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn a_subject_no_stream_captures_and_an_oversize_payload_are_dead_lettered_alone() {
    let table = TestTable::new("nats_dead").await;
    let stream = NatsStream::new("nats_dead").await;
    let nowhere = format!("it.nowhere.{}", common::hex8());
    let lost = table
        .insert_one(NewRow::new("order", Some("x-1"), "created", json!({})).destination(&nowhere))
        .await;
    let behind = table
        .insert_one(NewRow::new("order", Some("x-1"), "updated", json!({})))
        .await;
    let big = table
        .insert_one(NewRow::new(
            "order",
            Some("x-2"),
            "created",
            json!({"blob": "x".repeat(1_100_000)}),
        ))
        .await;
    let others = table
        .insert_ids(&NewRow::numbered(200, "order", Some(("o-", 20)), "created"))
        .await;
    let relay = nats_relay(&table, &stream, NATS_URL, "nats-dead")
        .set("relay.ordering", "aggregate")
        .set("retry.base_delay", "100ms")
        .set("retry.max_attempts", "2")
        .spawn();
    let dead = |id, why: &'static str| {
        let table = &table;
        async move {
            table
                .wait_row(id, WAIT, "dead-lettered", |r| r.status == "failed")
                .await
                .last_error
                .filter(|e| e.contains(why))
                .unwrap_or_else(|| panic!("{id}: last_error should say {why:?}"))
        }
    };
    dead(lost, "no JetStream stream captures").await;
    dead(big, "max_payload").await;
    table
        .wait_count(
            "status = 'sent'",
            i64::try_from(others.len()).unwrap(),
            WAIT,
        )
        .await;
    let rows = table.rows_by_id(&others).await;
    let problems = not_sent_once(&rows.values().cloned().collect::<Vec<_>>());
    assert_none(
        "other aggregates' rows not sent on their first attempt",
        &problems,
    );
    let held = table.row(behind).await;
    assert_eq!(
        (held.status.as_str(), held.attempts),
        ("pending", 0),
        "held behind its failed row"
    );
    assert_eq!(stream.count().await, 200);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn a_10s_outage_loses_nothing_spends_no_attempt_and_shows_on_readyz() {
    let table = TestTable::new("nats_outage").await;
    let stream = NatsStream::new("nats_outage").await;
    let proxy = Proxy::start(NATS_ADDR).await;
    let port = free_port();
    let relay = nats_relay(
        &table,
        &stream,
        &format!("nats://{}", proxy.addr()),
        "nats-outage",
    )
    .set("relay.ordering", "aggregate")
    .set("metrics.listen", format!("127.0.0.1:{port}"))
    .set("publisher.nats.ack_timeout", "5s")
    .spawn();
    let (stop, writer) = common::spawn_steady_writer(&table.name, "o", 50, 20);
    stream.wait_count(300, WAIT).await;
    let connected = "outbox_broker_connected";
    wait_for_sample(port, WAIT, connected, &[], |v| v == 1.0).await;

    proxy.cut();
    wait_for_sample(port, WAIT, connected, &[], |v| v == 0.0).await;
    wait_ready(port, 503).await;
    // The outage lasts 10 s while the writer keeps inserting.
    tokio::time::sleep(Duration::from_secs(10)).await;
    proxy.heal();
    wait_for_sample(port, WAIT, connected, &[], |v| v == 1.0).await;
    wait_ready(port, 200).await;
    stop.cancel();
    let written = writer.await.unwrap();
    table.wait_all_sent(WAIT).await;

    let rows = table.rows().await;
    assert_eq!(rows.len(), written);
    assert_none(
        "rows that spent more than one attempt",
        &not_sent_once(&rows),
    );
    let messages = stream.messages().await;
    assert_exactly_once_in_order("through a 10 s outage", &rows, &messages);
    let text = common::scrape(port).await.unwrap();
    let conn = common::sample(
        &text,
        "outbox_publish_failures_total",
        &[("kind", "connection")],
    );
    assert!(
        conn.unwrap_or(0.0) >= 1.0,
        "the outage counts as a connection failure"
    );
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn check_connects_hides_credentials_and_rejects_a_bad_url_with_exit_2() {
    let table = TestTable::new("nats_check").await;
    let check = |url: &str| {
        RelayBuilder::operator(&table.name)
            .set("publisher.kind", "nats")
            .set("publisher.nats.url", url)
            .output(&["check"], Duration::from_secs(60))
    };
    // The test server has no authorization: it ignores the credentials.
    let ok = check("nats://app:hunter2@127.0.0.1:4222").await;
    assert!(ok.status.success(), "{ok:?}");
    ok.assert_stdout_has("broker: ok (nats nats://app:***@127.0.0.1:4222");
    let token = check("nats://s3cr3t-token@127.0.0.1:4222").await;
    token.assert_stdout_has("broker: ok (nats nats://***@127.0.0.1:4222");
    let down = check(&format!("nats://127.0.0.1:{}", free_port())).await;
    assert_eq!(down.status.code(), Some(1), "{down:?}");
    down.assert_stdout_has("broker: FAILED");
    let bad = check("http://app:hunter2@127.0.0.1:4222").await;
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    assert!(bad.stderr.contains("publisher.nats.url"), "{bad:?}");
    for out in [&ok, &token, &down, &bad] {
        let all = format!("{}{}", out.stdout, out.stderr);
        assert!(!all.contains("hunter2") && !all.contains("s3cr3t"), "{all}");
    }
    table.drop_table().await;
}

#[tokio::test]
async fn a_server_unreachable_at_start_is_waited_for() {
    let table = TestTable::new("nats_late").await;
    let stream = NatsStream::new("nats_late").await;
    let proxy = Proxy::start(NATS_ADDR).await;
    proxy.cut();
    let ids = table
        .insert_ids(&NewRow::numbered(50, "order", Some(("l-", 5)), "created"))
        .await;
    let mut relay = nats_relay(
        &table,
        &stream,
        &format!("nats://{}", proxy.addr()),
        "nats-late",
    )
    .spawn();
    relay.wait_for_log("broker unavailable", 2, WAIT).await;
    assert!(relay.is_running(), "the relay waits for the server");
    proxy.heal();
    table.wait_all_sent(WAIT).await;
    let rows = table.rows_by_id(&ids).await;
    assert_none(
        "rows",
        &not_sent_once(&rows.into_values().collect::<Vec<_>>()),
    );
    assert_eq!(stream.count().await, 50);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

/// Waits until `/readyz` answers `want`.
async fn wait_ready(port: u16, want: u16) {
    wait_until(
        WAIT,
        &format!("/readyz answers {want}"),
        async || match http_get(local(port), "/readyz").await? {
            (code, _) if code == want => Ok(()),
            (code, body) => Err(format!("{code} {body}")),
        },
    )
    .await;
}

#[tokio::test]
async fn kill_9_three_times_during_a_20k_drain_leaves_no_duplicate_in_the_stream() {
    let table = TestTable::new("nats_kill").await;
    let stream = NatsStream::new("nats_kill").await;
    let rows = NewRow::numbered(20_000, "order", Some(("k-", 1_000)), "created");
    for chunk in rows.chunks(5_000) {
        table.insert(chunk).await;
    }
    let spawn = |instance: &str| {
        nats_relay(&table, &stream, NATS_URL, instance)
            .set("relay.ordering", "aggregate")
            // Well inside the stream's 2-minute duplicate window.
            .set("relay.lease_timeout", "5s")
            .set("retry.max_attempts", "100")
            .spawn()
    };
    let mut relay = spawn("nats-kill-0");
    for k in 1..=3u64 {
        // Killed while it holds rows (a fast drain can otherwise be between claims).
        let held = format!(
            "status = 'processing' AND locked_by = 'nats-kill-{}'",
            k - 1
        );
        wait_until(WAIT, "the relay publishes and holds rows", async || {
            let (count, holding) = (stream.count().await, table.count_where(&held).await);
            if count >= k * 4_000 && holding > 0 {
                Ok(())
            } else {
                Err(format!("{count} in the stream, {holding} held"))
            }
        })
        .await;
        relay.sigkill();
        let status = relay.wait_exit(Duration::from_secs(10)).await;
        assert!(!status.success(), "killed relay {k} exited {status}");
        relay = spawn(&format!("nats-kill-{k}"));
    }
    table.wait_all_sent(Duration::from_secs(300)).await;
    let rows = table.rows().await;
    let messages = stream.messages().await;
    // Rows the killed relays held were claimed again (and those already published were
    // dropped by the duplicate window, or the stream would hold more than 20,000).
    assert!(
        table.count_where("attempts >= 2").await > 0,
        "no row was reclaimed after a kill"
    );
    assert_eq!(messages.len(), 20_000, "the stream holds each row once");
    assert_exactly_once_in_order("3 kill -9 during a 20k drain", &rows, &messages);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn a_duplicate_window_shorter_than_the_lease_needs_is_warned_about_at_start_and_by_check() {
    let table = TestTable::new("nats_window").await;
    let stream = NatsStream::new("nats_window").await;
    let check = || {
        RelayBuilder::operator(&table.name)
            .set("publisher.kind", "nats")
            .set("publisher.nats.url", NATS_URL)
            .set("publisher.nats.subject", stream.subject_template())
            .set("relay.lease_timeout", "60s")
            .output(&["check"], Duration::from_secs(60))
    };
    // The kit's window (2 min) is twice the lease: nothing to say.
    let fine = check().await;
    assert!(fine.status.success(), "{fine:?}");
    assert!(!fine.stdout.contains("WARNING"), "{fine:?}");

    stream.set_duplicate_window(Duration::from_secs(10)).await;
    let short = check().await;
    assert!(short.status.success(), "advice, not a failure: {short:?}");
    let said = format!(
        "broker: WARNING: stream {:?} has a duplicate window of 10s but relay.lease_timeout is 1m",
        stream.name
    );
    short.assert_stdout_has(&said);
    short.assert_stdout_has("set the stream's duplicate_window to at least 2m");

    // `run` says the same once, at its first connect, and relays all the same.
    let relay = nats_relay(&table, &stream, NATS_URL, "nats-window")
        .set("relay.lease_timeout", "60s")
        .spawn();
    let id = table
        .insert_one(NewRow::new("order", Some("w-1"), "created", json!({})))
        .await;
    table.wait_all_sent(WAIT).await;
    relay
        .wait_for_log("has a duplicate window of 10s", 1, WAIT)
        .await;
    assert_eq!(relay.log_count("has a duplicate window of"), 1);
    assert_eq!(stream.messages().await[0].id(), id.to_string());
    relay.stop().await;

    // A template no stream captures is said too.
    let nowhere = RelayBuilder::operator(&table.name)
        .set("publisher.kind", "nats")
        .set(
            "publisher.nats.subject",
            format!("{}-none.{{aggregate_type}}", stream.prefix),
        )
        .output(&["check"], Duration::from_secs(60))
        .await;
    nowhere.assert_stdout_has("broker: WARNING: no JetStream stream captures subjects under");
    stream.teardown().await;
    table.drop_table().await;
}

#[tokio::test]
async fn no_ack_within_ack_timeout_hands_the_row_back_without_spending_an_attempt() {
    let table = TestTable::new("nats_no_ack").await;
    let stream = NatsStream::new("nats_no_ack").await;
    let proxy = Proxy::start(NATS_ADDR).await;
    let relay = nats_relay(
        &table,
        &stream,
        &format!("nats://{}", proxy.addr()),
        "nats-no-ack",
    )
    .set("publisher.nats.ack_timeout", "2s")
    .spawn();
    // The publish reaches the stream; its acknowledgement never comes back.
    let (first, held) = common::an_unanswered_publish_is_handed_back(
        &table,
        &proxy,
        &relay,
        "order",
        "no publish acknowledgement within 2s",
        async |n| stream.wait_count(n as u64, WAIT).await,
    )
    .await;
    // Published twice, stored once: the republish fell in the duplicate window.
    let ids: Vec<String> = stream
        .messages()
        .await
        .iter()
        .map(|m| m.id().to_owned())
        .collect();
    assert_eq!(ids, [first.to_string(), held.to_string()]);
    relay.stop().await;
    stream.teardown().await;
    table.drop_table().await;
}
