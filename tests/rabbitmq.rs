//! The RabbitMQ publisher under a channel closed mid-drain and over TLS (docs/design.md,
//! docs/security.md): a row that makes the broker close the channel it is on, among 10,000 rows
//! in flight, loses and reorders nothing and spends no attempt of the rows that were merely on
//! that channel; `amqps://` to a TLS endpoint whose certificate our own CA signed
//! (`publisher.rabbitmq.tls_ca_file`) delivers, and a wrong CA is refused before any row is
//! claimed. The real binary as a child process, each test on its own table and exchange.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};

use common::kafka::{TlsFront, write_unrelated_ca};
use common::{
    Delivered, NewRow, RABBIT_ADDR, RabbitFixture, RelayBuilder, RelayProcess, RowState, TempDir,
    TestTable, assert_none, finish, not_sent_cleanly, not_sent_once, table_and_exchange,
};
use serde_json::json;

const LONG: Duration = Duration::from_secs(180);

/// Rows of the drain, in [`AGGREGATES`] aggregates: with ordering on, about one message per
/// aggregate is in flight, so a few hundred are unconfirmed on the four channels at any time.
const ROWS: usize = 10_000;
const AGGREGATES: usize = 500;

/// A header RabbitMQ refuses in a message: `CC` (sender-selected distribution) must be an array
/// of routing keys, and a string there makes the broker close the channel (406
/// PRECONDITION_FAILED) instead of routing the message, as an application's row can.
fn channel_closer(event: &str) -> NewRow {
    NewRow::new("o", Some("closer"), event, json!({})).headers(json!({ "CC": "not-an-array" }))
}

/// Inserts `rows` in chunks (one statement each), in order.
async fn insert_in_chunks(table: &TestTable, rows: &[NewRow]) -> Vec<uuid::Uuid> {
    let mut ids = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(2_000) {
        ids.extend(table.insert_ids(chunk).await);
    }
    ids
}

/// The relay's "closed a publishing channel" lines (one per closed channel), and the sum of
/// their `unconfirmed=N`: messages that were on a channel when the broker closed it.
fn unconfirmed_on_closed_channels(relay: &RelayProcess) -> (usize, usize) {
    let logs = relay.stderr();
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("closed a publishing channel"))
        .collect();
    let sum = lines
        .iter()
        .filter_map(|l| {
            let rest = &l[l.find("unconfirmed=")? + "unconfirmed=".len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<usize>().ok()
        })
        .sum();
    (lines.len(), sum)
}

/// The log filter that shows each message published again after a closure (debug).
const REPUBLISH_LOG: &str =
    "info,lapin=error,tokio_postgres=warn,outbox_relay::publish::rabbitmq=debug";

/// When each message that was on a closed channel was published again (the relay's debug
/// line), by id.
fn republished(relay: &RelayProcess) -> Vec<(DateTime<Utc>, String)> {
    relay
        .stderr()
        .lines()
        .filter(|l| l.contains("publishing again a message that was unconfirmed"))
        .filter_map(|l| {
            let stamp = l.split_whitespace().find(|w| w.ends_with('Z'))?;
            let at = DateTime::parse_from_rfc3339(stamp)
                .ok()?
                .with_timezone(&Utc);
            let id = l[l.find(" id=")? + 4..].split_whitespace().next()?;
            Some((at, id.to_owned()))
        })
        .collect()
}

/// How long after the first closure every message that was on a closed channel had arrived
/// (the refused one never does): `anchor` is one moment in both clocks.
fn recovery(
    deliveries: &[Delivered],
    republished: &[(DateTime<Utc>, String)],
    anchor: (DateTime<Utc>, Instant),
) -> Option<Duration> {
    let closed_at = republished.iter().map(|(at, _)| *at).min()?;
    let ids: HashSet<&str> = republished.iter().map(|(_, id)| id.as_str()).collect();
    let last = deliveries
        .iter()
        .filter(|d| ids.contains(d.message_id.as_str()))
        .map(|d| d.received_at)
        .max()?;
    let last = anchor.0 + chrono::Duration::from_std(last - anchor.1).ok()?;
    (last - closed_at).to_std().ok()
}

/// How delivery went on around the closures, from the consumer's arrival times: the longest
/// pause between two deliveries, and the median and slowest full 100 ms windows of the drain.
fn delivery_pace(deliveries: &[Delivered]) -> String {
    let (Some(first), Some(last)) = (deliveries.first(), deliveries.last()) else {
        return "no deliveries".to_owned();
    };
    let start: Instant = first.received_at;
    let window_ms = 100;
    let windows = (last.received_at - start).as_millis() / window_ms + 1;
    let mut per_window = vec![0usize; usize::try_from(windows).unwrap()];
    let mut longest_gap = Duration::ZERO;
    let mut previous = start;
    for d in deliveries {
        let i = (d.received_at - start).as_millis() / window_ms;
        per_window[usize::try_from(i).unwrap()] += 1;
        longest_gap = longest_gap.max(d.received_at - previous);
        previous = d.received_at;
    }
    // The last window is partial.
    let full = &per_window[..per_window.len().saturating_sub(1).max(1)];
    let mut sorted = full.to_vec();
    sorted.sort_unstable();
    format!(
        "drain_ms={} longest_delivery_gap_ms={} median_per_100ms={} slowest_per_100ms={}",
        (last.received_at - start).as_millis(),
        longest_gap.as_millis(),
        sorted[sorted.len() / 2],
        sorted[0]
    )
}

/// A row the broker refuses by closing its channel, among 10,000 rows of 500 aggregates being
/// drained (ordering on): the broker closes the channel with a few hundred messages unconfirmed
/// on it. The culprit alone spends its attempts (it is published again on the channels, then
/// alone, where the closure is its own) and is dead-lettered; every other row is delivered in
/// `seq` order per aggregate, none lost, each sent on its first attempt (the ones on the
/// closed channel were published again, not handed back or charged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_closed_mid_drain_loses_reorders_and_charges_nothing_but_its_culprit() {
    let (table, rabbit) = table_and_exchange("rmq_channel_close").await;
    let mut rows = NewRow::numbered(ROWS, "o", Some(("a-", AGGREGATES)), "e");
    rows.splice(
        ROWS / 2..ROWS / 2,
        [
            channel_closer("closes"),
            NewRow::new("o", Some("closer"), "after", json!({})),
        ],
    );
    let ids = insert_in_chunks(&table, &rows).await;
    let anchor = (Utc::now(), Instant::now());
    let (closer, follower) = (ids[ROWS / 2], ids[ROWS / 2 + 1]);
    let relay = RelayBuilder::for_test(&table, &rabbit, "rmq-channel-close")
        .ordered()
        .set("retry.base_delay", "200ms")
        .set("retry.max_attempts", "2")
        .env("RUST_LOG", REPUBLISH_LOG)
        .spawn();

    let what = "the row that closes channels is dead-lettered";
    table
        .wait_row(closer, LONG, what, |r| r.status == "failed")
        .await;
    table.wait_count("status = 'sent'", ROWS as i64, LONG).await;
    rabbit.barrier().await;

    let all = table.rows().await;
    let expected: Vec<RowState> = all
        .iter()
        .filter(|r| r.id != closer && r.id != follower)
        .cloned()
        .collect();
    let analysis = rabbit.analyse(&expected);
    analysis.assert_complete("channel closed mid-drain");
    assert_none(
        "rows not sent on their first attempt",
        &not_sent_once(&expected),
    );
    let closer_row = table.row(closer).await;
    assert_eq!(closer_row.attempts, 2, "{closer_row:?}");
    let error = closer_row.last_error.clone().unwrap_or_default();
    assert!(error.contains("the broker closed the channel"), "{error}");
    let follower_row = table.row(follower).await;
    assert_eq!(
        (follower_row.status.as_str(), follower_row.attempts),
        ("pending", 0),
        "the follower waits behind its dead letter, no attempt spent: {follower_row:?}"
    );
    assert!(
        !rabbit.id_counts().contains_key(&closer.to_string()),
        "the refused message was delivered"
    );
    let (closures, unconfirmed) = unconfirmed_on_closed_channels(&relay);
    let deliveries = rabbit.deliveries();
    let republished = republished(&relay);
    let recovered = recovery(&deliveries, &republished, anchor);
    println!(
        "RABBITMQ-CHANNEL-CLOSE rows={} lost={} reordered={} duplicates={} closures={closures} \
         unconfirmed_on_closed_channels={unconfirmed} republished={} published_alone={} \
         all_republished_arrived_ms={:?} {}",
        expected.len(),
        analysis.lost.len(),
        analysis.reordered.len(),
        analysis.duplicates,
        republished.len(),
        relay.log_count("publishing it alone"),
        recovered.map(|d| d.as_millis()),
        delivery_pace(&deliveries)
    );
    assert!(closures >= 1, "no channel closure logged");
    // A settler logs its channel's closure when it ends: had one outlived its closed channel,
    // the messages it answered would outnumber the ones it reported.
    let answered = republished.len() + relay.log_count("publishing it alone");
    assert_eq!(
        unconfirmed, answered,
        "messages on closed channels reported by the settlers that ended != messages answered \
         as on a closed channel"
    );
    assert!(
        unconfirmed > 1,
        "only the culprit was on the closed channels ({unconfirmed}): the test did not close a \
         channel that carried other messages"
    );
    finish(relay, table, rabbit).await;
}

/// A TLS endpoint in front of the test broker (the kit's TLS-terminating front on
/// 127.0.0.1:5672), a relay that trusts only what the system trusts plus `ca`.
async fn relay_over_tls(
    table: &TestTable,
    rabbit: &RabbitFixture,
    front: &TlsFront,
    ca: &std::path::Path,
    instance: &str,
) -> RelayProcess {
    let url = format!("amqps://guest:guest@127.0.0.1:{}/%2f", front.addr().port());
    RelayBuilder::for_test(table, rabbit, instance)
        .ordered()
        .set("publisher.rabbitmq.url", url)
        .set("publisher.rabbitmq.tls_ca_file", ca.to_str().unwrap())
        .spawn()
}

/// The TLS front for these tests: RabbitMQ's plain port behind a certificate of our own CA.
async fn tls_front(dir: &TempDir) -> TlsFront {
    let port = RABBIT_ADDR.rsplit(':').next().unwrap().parse().unwrap();
    TlsFront::start(port, dir.path()).await
}

/// `amqps://` through a TLS endpoint whose certificate our own CA signed, that CA given as
/// `publisher.rabbitmq.tls_ca_file`: every row delivered once, in order, on its first attempt,
/// over connections the front accepted as TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_our_own_ca_delivers_every_row_through_a_tls_endpoint() {
    let dir = TempDir::new("rmq-tls");
    let front = tls_front(&dir).await;
    let (table, rabbit) = table_and_exchange("rmq_tls").await;
    let rows = NewRow::numbered(300, "o", Some(("t-", 30)), "e");
    table.insert(&rows).await;
    let relay = relay_over_tls(&table, &rabbit, &front, &front.ca_pem, "rmq-tls").await;
    table.wait_count("status = 'sent'", 300, LONG).await;
    rabbit.barrier().await;
    let all = table.rows().await;
    rabbit
        .analyse(&all)
        .assert_exactly_once("amqps with our own CA");
    assert_none("rows not sent cleanly", &not_sent_cleanly(&all));
    assert!(front.handshakes_ok() >= 1, "no TLS handshake at the front");
    assert_eq!(front.handshakes_failed(), 0, "a TLS handshake failed");
    finish(relay, table, rabbit).await;
}

/// `amqps://` to the same endpoint trusting a CA that did not sign its certificate: the relay
/// refuses the certificate, says so in a sentence that names the key to set, keeps retrying,
/// and claims nothing meanwhile (every row pending, no attempt spent, no lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_with_a_wrong_ca_is_refused_and_no_row_is_claimed() {
    let dir = TempDir::new("rmq-tls-wrong");
    let front = tls_front(&dir).await;
    let wrong = write_unrelated_ca(dir.path());
    let (table, rabbit) = table_and_exchange("rmq_tls_wrong").await;
    let rows = NewRow::numbered(20, "o", Some(("w-", 4)), "e");
    table.insert(&rows).await;
    let relay = relay_over_tls(&table, &rabbit, &front, &wrong, "rmq-tls-wrong").await;
    let refusal = "set publisher.rabbitmq.tls_ca_file to the CA that signed it";
    // Twice: refused at start and again on the next attempt to connect.
    relay.wait_for_log(refusal, 2, LONG).await;
    assert!(
        front.handshakes_failed() >= 2,
        "the front saw no refused handshake"
    );
    assert_eq!(
        front.handshakes_ok(),
        0,
        "a handshake with the wrong CA succeeded"
    );
    let line = relay.stderr();
    let line = line.lines().find(|l| l.contains(refusal)).unwrap();
    assert!(line.contains("not claiming rows"), "{line}");
    assert!(
        !line.contains("guest:guest"),
        "the password was logged: {line}"
    );
    let all = table.rows().await;
    let claimed: Vec<String> = all
        .iter()
        .filter(|r| r.status != "pending" || r.attempts != 0 || r.locked_by.is_some())
        .map(|r| format!("{} {} attempts {}", r.id, r.status, r.attempts))
        .collect();
    assert_none("rows claimed while the broker was refused", &claimed);
    assert_eq!(rabbit.count(), 0, "something was delivered");
    finish(relay, table, rabbit).await;
}
