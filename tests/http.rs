//! The webhook sink (`publisher.kind = "http"`), end to end: the real binary against a real
//! table and a real HTTP endpoint on loopback (`outbox_testkit::webhook`), scripted per request.
//! Every answer of the contract's table (§4) gives its outcome: 2xx confirms; other statuses
//! spend an attempt with the status and the start of the body as `last_error`; refused, cut,
//! TLS failures, timeouts, 408, 429 and 503 (with `Retry-After`, seconds or a date), 502 and
//! 504 spend none; `/readyz` and `outbox_broker_connected` say whether the endpoint answers.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;
#[path = "signing/verify.rs"]
mod verify;

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use common::webhook::{Endpoint, Received, Reply};
use common::{NewRow, RelayBuilder, RowState, TempDir, TestTable, analyse, wait_until};
use hmac::{Hmac, Mac};
use serde_json::json;
use sha2::Sha256;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// A relay publishing `table` to `url` with short timeouts and retry delays.
fn http_relay(table: &TestTable, url: &str, instance: &str) -> RelayBuilder {
    RelayBuilder::for_table(table, instance)
        .set("publisher.kind", "http")
        .set("publisher.http.url", url)
        .set("publisher.http.timeout", "1s")
        .set("retry.base_delay", "50ms")
        .set("retry.max_delay", "200ms")
        .set("relay.poll_interval", "200ms")
}

/// Waits until `done` holds for every row of `table`; returns the rows.
async fn wait_rows(
    table: &TestTable,
    what: &str,
    done: impl Fn(&RowState) -> bool,
) -> HashMap<Uuid, RowState> {
    wait_until(WAIT, what, async || {
        let rows = table.rows().await;
        let waiting: Vec<String> = rows
            .iter()
            .filter(|r| !done(r))
            .map(|r| {
                format!(
                    "{} {} attempts {} {:?}",
                    r.aggregate_id.as_deref().unwrap_or("-"),
                    r.status,
                    r.attempts,
                    r.last_error
                )
            })
            .collect();
        if waiting.is_empty() {
            Ok(rows.into_iter().map(|r| (r.id, r)).collect())
        } else {
            Err(waiting.join("; "))
        }
    })
    .await
}

/// The requests per message id.
fn by_id(requests: &[Received]) -> HashMap<String, Vec<Received>> {
    let mut out: HashMap<String, Vec<Received>> = HashMap::new();
    for r in requests {
        out.entry(r.id().unwrap_or_default())
            .or_default()
            .push(r.clone());
    }
    out
}

/// The status the endpoint gives a path `/h/<status>` (the aggregate id is the status).
fn status_of(r: &Received) -> u16 {
    r.path
        .rsplit('/')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200)
}

/// An endpoint that answers each request with `answer(request, n)`, `n` counting the requests
/// so far (this one included) with the same `key(request)`.
async fn counting(
    key: impl Fn(&Received) -> String + Send + Sync + 'static,
    answer: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static,
) -> Endpoint {
    let counts: Mutex<HashMap<String, usize>> = Mutex::default();
    Endpoint::start(move |r| {
        let n = {
            let mut counts = counts.lock().unwrap();
            let n = counts.entry(key(r)).or_insert(0);
            *n += 1;
            *n
        };
        answer(r, n)
    })
    .await
}

/// Userinfo in the URL (docs/http.md) is sent as Basic authentication and masked in logs; a
/// row's `Authorization` never replaces it (left out with one warning), and `outbox-signature`
/// signs the URL as sent, without the userinfo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn userinfo_in_the_url_is_sent_as_basic_authentication() {
    let table = TestTable::new("http_basic").await;
    let endpoint = Endpoint::start(|_| Reply::status(200)).await;
    let url = endpoint
        .url("/basic")
        .replacen("http://", "http://hook-user:s3cret-pw@", 1);
    let mut rows = Vec::new();
    for (i, name) in ["Authorization", "authorization", "AUTHORIZATION"]
        .iter()
        .enumerate()
    {
        rows.push(
            NewRow::new("order", Some(&format!("o-{i}")), "created", json!({}))
                .headers(json!({ *name: "Bearer row-chosen", "x-tenant": "t1" })),
        );
    }
    let ids = table.insert_ids(&rows).await;
    let relay = http_relay(&table, &url, "http-basic")
        .set("signing.key_id", "k1")
        .set("signing.key", SECRET)
        .spawn();
    table.wait_all_sent(WAIT).await;
    let got = by_id(&endpoint.messages());
    let key = STANDARD.decode(&SECRET[6..]).unwrap();
    let keys: HashMap<&str, &[u8]> = HashMap::from([("k1", key.as_slice())]);
    let sent_url = endpoint.url("/basic");
    assert!(!sent_url.contains('@'));
    for id in &ids {
        let id = id.to_string();
        let request = &got[&id][0];
        // base64("hook-user:s3cret-pw")
        let basic = "Basic aG9vay11c2VyOnMzY3JldC1wdw==";
        assert_eq!(request.header_all("authorization"), [basic]);
        assert_eq!(request.header("x-tenant"), Some("t1"));
        // The routing line is the URL without the userinfo: the receiver needs no password.
        let attrs = [
            id.as_str(),
            request.header("ce-source").unwrap(),
            request.header("ce-type").unwrap(),
            request.header("ce-subject").unwrap(),
            sent_url.as_str(),
            request.header("ce-time").unwrap(),
            "application/json",
        ];
        let sig = request.header("outbox-signature").unwrap();
        assert!(
            verify::verify(sig, &keys, attrs, &request.body),
            "{sig} over {attrs:?}"
        );
    }
    let logs = relay.stderr();
    assert!(
        !logs.contains("s3cret-pw"),
        "the password is logged:\n{logs}"
    );
    for name in ["Authorization", "authorization", "AUTHORIZATION"] {
        let warned = logs
            .lines()
            .filter(|l| {
                l.contains("row header left out")
                    && l.split_whitespace().any(|w| w == format!("header={name}"))
            })
            .count();
        assert_eq!(warned, 1, "{name}: {}", relay.tail(30));
    }
    relay.stop().await;
    table.drop_table().await;
}

/// A bare token as the URL's userinfo (`http://TOKEN@host/`) is sent as Basic authentication
/// (the token as the user, an empty password) and shown as `***@` by `check`, the logs and
/// the start line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_in_the_url_is_sent_as_basic_authentication_and_never_shown() {
    let table = TestTable::new("http_token").await;
    let endpoint = Endpoint::start(|_| Reply::status(200)).await;
    let url = endpoint
        .url("/hook")
        .replacen("http://", "http://APIKEYSECRET@", 1);
    let masked = endpoint.url("/hook").replacen("http://", "http://***@", 1);
    let out = http_relay(&table, &url, "http-token-check")
        .output(&["check"], WAIT)
        .await;
    assert!(out.status.success(), "{out:?}");
    out.assert_stdout_has(&format!("broker: ok (http POST {masked}"));
    assert!(!format!("{out:?}").contains("APIKEYSECRET"), "{out:?}");
    let id = table
        .insert_one(NewRow::new("order", Some("o-1"), "created", json!({})))
        .await;
    let relay = http_relay(&table, &url, "http-token").spawn();
    table.wait_all_sent(WAIT).await;
    let got = by_id(&endpoint.messages());
    // base64("APIKEYSECRET:")
    assert_eq!(
        got[&id.to_string()][0].header("authorization"),
        Some("Basic QVBJS0VZU0VDUkVUOg==")
    );
    let logs = relay.stderr();
    assert!(logs.contains(&masked), "{}", relay.tail(30));
    assert!(
        !logs.contains("APIKEYSECRET"),
        "the token is logged:\n{logs}"
    );
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_level_answers_spend_attempts_with_status_and_body_and_2xx_confirms() {
    let table = TestTable::new("http_statuses").await;
    let endpoint = Endpoint::start(|r| match status_of(r) {
        code @ 200..=299 => Reply::status(code),
        code @ 300..=399 => Reply::status(code).header("location", "https://elsewhere.example/x"),
        code => Reply::status(code).body(&format!("{{\"error\":\"refused with {code}\"}}\n")),
    })
    .await;
    let confirm = [200, 201, 202, 204];
    let refuse = [301, 400, 401, 404, 409, 410, 413, 422, 500];
    let rows: Vec<NewRow> = confirm
        .iter()
        .chain(&refuse)
        .map(|c| NewRow::new("order", Some(&c.to_string()), "created", json!({"code": c})))
        .collect();
    table.insert(&rows).await;
    let relay = http_relay(&table, &endpoint.url("/h/{aggregate_id}"), "http-statuses")
        .set("retry.max_attempts", "2")
        .spawn();
    let rows = wait_rows(&table, "every row is sent or dead-lettered", |r| {
        r.status == "sent" || r.status == "failed"
    })
    .await;
    let requests = by_id(&endpoint.messages());
    for row in rows.values() {
        let code: u16 = row.aggregate_id.as_deref().unwrap().parse().unwrap();
        let seen = requests.get(&row.id.to_string()).map_or(0, Vec::len);
        if confirm.contains(&code) {
            assert_eq!(
                (row.status.as_str(), row.attempts, seen),
                ("sent", 1, 1),
                "{code}"
            );
            assert_eq!(row.last_error, None, "{code}");
        } else {
            assert_eq!(
                (row.status.as_str(), row.attempts, seen),
                ("failed", 2, 2),
                "{code}"
            );
            let error = row.last_error.clone().unwrap_or_default();
            assert!(
                error.starts_with(&format!("HTTP {code} ")),
                "{code}: {error}"
            );
            if code == 301 {
                assert!(error.contains("redirects are not followed"), "{error}");
                assert!(error.contains("https://elsewhere.example/x"), "{error}");
            } else {
                assert!(
                    error.ends_with(&format!(": {{\"error\":\"refused with {code}\"}}")),
                    "{code}: {error}"
                );
            }
        }
    }
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_level_answers_spend_no_attempt_and_retry_after_is_honoured() {
    let table = TestTable::new("http_unavailable").await;
    // Each aggregate names a failure; its row gets that failure twice, then a 204.
    let kind = |r: &Received| r.path.rsplit('/').next().unwrap_or_default().to_owned();
    let endpoint = counting(kind, move |r, n| {
        if r.method == "HEAD" {
            return Reply::status(200);
        }
        if n > 2 {
            return Reply::status(204);
        }
        match kind(r).as_str() {
            "timeout" => Reply::status(204).after(Duration::from_secs(3)),
            "cut" => Reply::CutMidBody,
            "429" => Reply::status(429)
                .header("retry-after", "2")
                .body("slow down"),
            code => Reply::status(code.parse().unwrap()).body("try later"),
        }
    })
    .await;
    let kinds = ["408", "429", "502", "503", "504", "timeout", "cut"];
    let rows: Vec<NewRow> = kinds
        .iter()
        .map(|k| NewRow::new("order", Some(k), "created", json!({"kind": k})))
        .collect();
    table.insert(&rows).await;
    // One attempt only: a failure that spent it would dead-letter the row.
    let relay = http_relay(
        &table,
        &endpoint.url("/h/{aggregate_id}"),
        "http-unavailable",
    )
    .set("retry.max_attempts", "1")
    .spawn();
    let rows = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    let requests = by_id(&endpoint.messages());
    for row in rows.values() {
        let kind = row.aggregate_id.clone().unwrap();
        let seen = &requests[&row.id.to_string()];
        assert_eq!((row.attempts, seen.len()), (1, 3), "{kind}");
        assert_eq!(seen.last().unwrap().status, Some(204), "{kind}");
        if kind == "429" {
            // The endpoint asked for 2 s; the next request came no sooner.
            for pair in seen.windows(2) {
                let gap = pair[1].at - pair[0].at;
                assert!(
                    gap >= Duration::from_millis(1950),
                    "429 retried after {gap:?}"
                );
            }
        }
    }
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_answering_5xx_and_429_never_dead_letters() {
    let table = TestTable::new("http_outage").await;
    let endpoint = counting(
        |_| String::new(),
        |_, n| Reply::status([502, 503, 504, 429][n % 4]).body("down for maintenance"),
    )
    .await;
    let rows = NewRow::numbered(20, "order", Some(("o", 5)), "created");
    table.insert(&rows).await;
    let relay = http_relay(&table, &endpoint.url("/h"), "http-outage")
        .set("retry.max_attempts", "1")
        .spawn();
    common::wait_for_count(WAIT, "the endpoint refuses 30 requests", 30, || {
        endpoint.message_count()
    })
    .await;
    let dead = table.count_where("status = 'failed'").await;
    assert_eq!(dead, 0, "a 5xx/429 endpoint dead-lettered rows");
    assert_eq!(table.count_where("attempts > 1").await, 0);
    endpoint.script(|_| Reply::status(200));
    let rows = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    assert!(rows.values().all(|r| r.attempts == 1));
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_dead_letters_only_its_row_while_other_aggregates_flow() {
    let table = TestTable::new("http_poison").await;
    let endpoint = Endpoint::start(|r| {
        if r.text().contains("\"poison\"") {
            Reply::status(400).body("unknown customer 7")
        } else {
            Reply::status(200)
        }
    })
    .await;
    let poison = table
        .insert_one(NewRow::new(
            "order",
            Some("bad"),
            "created",
            json!({"poison": true}),
        ))
        .await;
    let held = table
        .insert_one(NewRow::new(
            "order",
            Some("bad"),
            "updated",
            json!({"n": 1}),
        ))
        .await;
    table
        .insert(&NewRow::numbered(
            90,
            "order",
            Some(("good", 30)),
            "created",
        ))
        .await;
    let relay = http_relay(&table, &endpoint.url("/h"), "http-poison")
        .set("retry.max_attempts", "3")
        .spawn();
    wait_rows(
        &table,
        "the poison row fails and the others are sent",
        |r| r.id == held || r.status == if r.id == poison { "failed" } else { "sent" },
    )
    .await;
    let p = table.row(poison).await;
    assert_eq!(p.attempts, 3);
    assert_eq!(
        p.last_error.as_deref(),
        Some("HTTP 400 Bad Request: unknown customer 7")
    );
    let h = table.row(held).await;
    assert_eq!((h.status.as_str(), h.attempts), ("pending", 0));
    let requests = by_id(&endpoint.messages());
    assert!(!requests.contains_key(&held.to_string()));
    assert_eq!(requests[&poison.to_string()].len(), 3);
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_then_listening_endpoint_is_probed_and_then_served() {
    let table = TestTable::new("http_refused").await;
    let port = common::free_port();
    let url = format!("http://127.0.0.1:{port}/h/{{aggregate_type}}");
    let ids = table
        .insert_ids(&NewRow::numbered(10, "order", Some(("o", 3)), "created"))
        .await;
    let relay = http_relay(&table, &url, "http-refused").spawn();
    relay
        .wait_for_log("not claiming rows until it is back", 2, WAIT)
        .await;
    assert!(
        relay.stderr().contains("does not answer"),
        "{}",
        relay.tail(20)
    );
    assert_eq!(
        table
            .count_where("status = 'pending' AND attempts = 0")
            .await,
        10
    );
    let endpoint = Endpoint::start_on(port, |_| Reply::status(202)).await;
    let rows = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    assert!(rows.values().all(|r| r.attempts == 1));
    let received = endpoint.received();
    assert_eq!(received[0].method, "HEAD", "the first request is the probe");
    assert_eq!(received[0].path, "/");
    let delivered: HashSet<String> = endpoint
        .messages()
        .iter()
        .filter_map(Received::id)
        .collect();
    assert_eq!(delivered.len(), ids.len());
    assert!(endpoint.messages().iter().all(|r| r.path == "/h/order"));
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_our_own_ca_is_served_and_an_untrusted_certificate_spends_nothing() {
    let table = TestTable::new("http_tls").await;
    let dir = TempDir::new("http-tls");
    let (endpoint, ca) = Endpoint::start_tls(dir.path(), |_| Reply::status(200)).await;
    let url = endpoint.url("/secure/{event_type}");
    table
        .insert(&NewRow::numbered(5, "order", Some(("o", 5)), "created"))
        .await;

    // A relay that trusts another CA: handshakes fail, nothing is spent, nothing arrives.
    let unrelated = common::kafka::write_unrelated_ca(dir.path());
    let untrusting = http_relay(&table, &url, "http-tls-untrusted")
        .env("SSL_CERT_FILE", unrelated.display().to_string())
        .spawn();
    common::wait_for_count(WAIT, "two failed handshakes", 2, || {
        endpoint.handshakes_failed()
    })
    .await;
    assert_eq!(
        table
            .count_where("status = 'pending' AND attempts = 0")
            .await,
        5
    );
    assert_eq!(endpoint.received().len(), 0);
    untrusting.stop().await;

    let relay = http_relay(&table, &url, "http-tls")
        .env("SSL_CERT_FILE", ca.display().to_string())
        .spawn();
    let rows = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    assert!(rows.values().all(|r| r.attempts == 1));
    assert!(
        endpoint
            .messages()
            .iter()
            .all(|r| r.path == "/secure/created")
    );
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_aggregate_order_holds_across_1000_aggregates_with_a_randomly_slow_endpoint() {
    let table = TestTable::new("http_order").await;
    let endpoint = Endpoint::start(|r| {
        // A delay of 0–19 ms drawn from the message id: random, and the same on a retry.
        let spread = r
            .id()
            .unwrap_or_default()
            .bytes()
            .fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(b)));
        Reply::status(204).after(Duration::from_millis(spread % 20))
    })
    .await;
    table
        .insert(&NewRow::numbered(
            3000,
            "order",
            Some(("a", 1000)),
            "updated",
        ))
        .await;
    // Up to 1,000 requests at once: the default timeout, so that none times out (a timeout
    // would hand rows back and send them again).
    let relay = http_relay(&table, &endpoint.url("/h"), "http-order")
        .set("relay.ordering", "aggregate")
        .set("publisher.http.timeout", "10s")
        .spawn();
    table.wait_all_sent(Duration::from_secs(180)).await;
    let rows = table.rows().await;
    let arrivals: Vec<String> = endpoint
        .messages()
        .iter()
        .filter_map(Received::id)
        .collect();
    let analysis = analyse(&rows, arrivals.iter().map(String::as_str));
    analysis.assert_complete("1,000 aggregates over HTTP");
    relay.stop().await;
    table.drop_table().await;
}

/// The Standard Webhooks check written from the specification (not the relay's signer):
/// HMAC-SHA256 over `<id>.<timestamp>.<body>` with the secret's bytes, base64, matched against
/// any `v1,` entry of the space-separated header; the timestamp within five minutes.
fn standard_webhooks_verify(secret: &str, r: &Received) -> Result<(), String> {
    let key = STANDARD
        .decode(
            secret
                .strip_prefix("whsec_")
                .ok_or("secret without whsec_")?,
        )
        .map_err(|e| e.to_string())?;
    let id = r.header("webhook-id").ok_or("no webhook-id")?;
    let ts = r
        .header("webhook-timestamp")
        .ok_or("no webhook-timestamp")?;
    let sent: i64 = ts.parse().map_err(|_| "bad timestamp")?;
    if (chrono::Utc::now().timestamp() - sent).abs() > 300 {
        return Err(format!("timestamp {sent} too far from now"));
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).map_err(|e| e.to_string())?;
    mac.update(format!("{id}.{ts}.").as_bytes());
    mac.update(&r.body);
    let want = STANDARD.encode(mac.finalize().into_bytes());
    let header = r
        .header("webhook-signature")
        .ok_or("no webhook-signature")?;
    header
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .any(|sig| sig == want)
        .then_some(())
        .ok_or_else(|| format!("no signature matches in {header:?}"))
}

const SECRET: &str = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_mode_is_signed_for_standard_webhooks_and_row_headers_never_override_ours() {
    let table = TestTable::new("http_signed").await;
    let endpoint = Endpoint::start(|_| Reply::status(200).body("ok")).await;
    let headers = json!({
        "x-tenant": "t1",
        "ce-type": "forged",
        "webhook-id": "forged",
        "bad name": "dropped",
        "x-line": "a\nb",
        "n": 7,
        "gone": null
    });
    let mut rows = Vec::new();
    for i in 0..3 {
        let row = NewRow::new(
            "order",
            Some(&format!("o {i}/é")),
            "created",
            json!({"i": i}),
        );
        rows.push(row.headers(headers.clone()));
    }
    rows.push(NewRow::new("order", None, "pinged", json!([1, 2])).destination("/elsewhere"));
    let ids = table.insert_ids(&rows).await;
    let relay = http_relay(
        &table,
        &endpoint.url("/in/{aggregate_type}/{aggregate_id}?v=1"),
        "http-signed",
    )
    .set("signing.key_id", "k1")
    .set("signing.key", SECRET)
    .set(
        "publisher.http.headers.authorization",
        "Bearer static-token",
    )
    .spawn();
    let states = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    assert!(
        states
            .values()
            .all(|r| r.attempts == 1 && r.last_error.is_none())
    );
    let key = STANDARD.decode(&SECRET[6..]).unwrap();
    let keys: HashMap<&str, &[u8]> = HashMap::from([("k1", key.as_slice())]);
    let requests = endpoint.messages();
    assert_eq!(requests.len(), ids.len());
    for r in &requests {
        standard_webhooks_verify(SECRET, r).unwrap();
        let id = r.id().unwrap();
        assert_eq!(r.header("webhook-id"), Some(id.as_str()));
        let row = &states[&id.parse::<Uuid>().unwrap()];
        assert_eq!(r.method, "POST");
        assert_eq!(r.header("authorization"), Some("Bearer static-token"));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(r.header("ce-specversion"), Some("1.0"));
        assert_eq!(r.header_all("ce-type"), [row.event_type.as_str()]);
        assert_eq!(r.header_all("webhook-id").len(), 1);
        assert_eq!(r.header("ce-source"), Some(table.default_source().as_str()));
        assert_eq!(r.header("ce-aggregatetype"), Some("order"));
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body, row.payload);
        // The routing line of outbox-signature is the full URL as sent.
        let url = endpoint.url(&r.path);
        let subject = row.aggregate_id.as_deref().unwrap_or("");
        let attrs = [
            id.as_str(),
            r.header("ce-source").unwrap(),
            r.header("ce-type").unwrap(),
            subject,
            url.as_str(),
            r.header("ce-time").unwrap(),
            "application/json",
        ];
        let sig = r.header("outbox-signature").unwrap();
        assert!(
            verify::verify(sig, &keys, attrs, &r.body),
            "{sig} over {attrs:?}"
        );
        match &row.aggregate_id {
            Some(agg) => {
                // Percent-encoded into the path; the ce-subject header per the HTTP binding.
                let i = &agg[2..3];
                assert_eq!(r.path, format!("/in/order/o%20{i}%2F%C3%A9?v=1"));
                assert_eq!(
                    r.header("ce-subject"),
                    Some(format!("o%20{i}/%C3%A9").as_str())
                );
                assert_eq!(r.header("x-tenant"), Some("t1"));
                assert_eq!(r.header("n"), Some("7"));
                assert!(r.header("bad name").is_none() && r.header("x-line").is_none());
                assert!(r.header("gone").is_none());
            }
            None => {
                assert_eq!(r.path, "/elsewhere?v=1");
                assert!(r.header("ce-subject").is_none());
            }
        }
    }
    // One warning per dropped header name, however many rows carried it.
    for name in ["ce-type", "webhook-id", "bad name", "x-line"] {
        let warned = relay
            .stderr()
            .lines()
            .filter(|l| l.contains("row header left out") && l.contains(name))
            .count();
        assert_eq!(warned, 1, "{name}: {}", relay.tail(30));
    }
    assert!(!relay.stderr().contains("static-token"));
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_mode_sends_the_cloudevents_object_signed() {
    let table = TestTable::new("http_structured").await;
    let endpoint = Endpoint::start(|_| Reply::status(201)).await;
    let id = table
        .insert_one(NewRow::new(
            "order",
            Some("42"),
            "created",
            json!({"total": 12.50}),
        ))
        .await;
    let relay = http_relay(&table, &endpoint.url("/events"), "http-structured")
        .set("publisher.http.mode", "structured")
        .set("publisher.http.method", "PUT")
        .set("signing.key_id", "k1")
        .set("signing.key", SECRET)
        .spawn();
    table.wait_all_sent(WAIT).await;
    let r = endpoint.messages().pop().unwrap();
    assert_eq!(r.method, "PUT");
    assert_eq!(
        r.header("content-type"),
        Some("application/cloudevents+json")
    );
    assert!(r.header("ce-id").is_none());
    let event: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(event["id"], id.to_string());
    assert_eq!(event["specversion"], "1.0");
    assert_eq!(event["type"], "created");
    assert_eq!(event["subject"], "42");
    assert_eq!(event["datacontenttype"], "application/json");
    assert_eq!(event["data"]["total"].to_string(), "12.5");
    standard_webhooks_verify(SECRET, &r).unwrap();
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_drain_loses_nothing_and_duplicates_stay_within_max_in_flight() {
    let table = TestTable::new("http_kill").await;
    let endpoint = Endpoint::start(|_| Reply::status(204).after(Duration::from_millis(2))).await;
    table
        .insert(&NewRow::numbered(
            3000,
            "order",
            Some(("k", 300)),
            "updated",
        ))
        .await;
    let max_in_flight = 200;
    let relay = |instance: &str| {
        http_relay(&table, &endpoint.url("/h"), instance)
            .set("relay.max_in_flight", max_in_flight.to_string())
            .set("relay.batch_size", "100")
            .set("relay.lease_timeout", "2s")
    };
    let mut victim = relay("http-kill-1").spawn();
    common::wait_for_count(WAIT, "800 requests", 800, || endpoint.message_count()).await;
    victim.sigkill();
    let survivor = relay("http-kill-2").spawn();
    table.wait_all_sent(Duration::from_secs(180)).await;
    let rows = table.rows().await;
    let arrivals: Vec<String> = endpoint
        .messages()
        .iter()
        .filter_map(Received::id)
        .collect();
    let analysis = analyse(&rows, arrivals.iter().map(String::as_str));
    analysis.assert_complete("kill -9 during an HTTP drain");
    assert!(
        analysis.duplicates <= max_in_flight,
        "{} duplicates, more than max_in_flight {max_in_flight}",
        analysis.duplicates
    );
    println!(
        "http kill -9: rows={} lost={} duplicates={}",
        rows.len(),
        analysis.lost.len(),
        analysis.duplicates
    );
    survivor.stop().await;
    table.drop_table().await;
}

/// `/readyz` and `outbox_broker_connected` answered together: (status, gauge).
async fn readiness(port: u16) -> (Result<u16, String>, Option<f64>) {
    let ready = common::http_get(common::local(port), "/readyz")
        .await
        .map(|(s, _)| s);
    let text = common::scrape(port).await.unwrap_or_default();
    (ready, common::sample(&text, "outbox_broker_connected", &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_and_broker_connected_say_whether_the_endpoint_answers_and_a_503_retry_after_date_is_honoured()
 {
    let table = TestTable::new("http_ready").await;
    let endpoint = Endpoint::start(|_| Reply::status(204)).await;
    let port = common::free_port();
    table
        .insert(&NewRow::numbered(5, "order", Some(("r", 5)), "created"))
        .await;
    let relay = http_relay(&table, &endpoint.url("/h"), "http-ready")
        .set("metrics.listen", common::local(port).to_string())
        .spawn();
    table.wait_all_sent(WAIT).await;
    let what = "/readyz answers 200 and outbox_broker_connected is 1 while the endpoint answers";
    wait_until(WAIT, what, async || match readiness(port).await {
        (Ok(200), Some(1.0)) => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .await;

    // 503 with Retry-After as an HTTP date 3 s ahead (whole seconds: at least 2 s from now).
    endpoint.script(|r| {
        if r.method == "HEAD" {
            return Reply::status(200);
        }
        let at = chrono::Utc::now() + chrono::Duration::seconds(3);
        Reply::status(503)
            .header(
                "retry-after",
                &at.format("%a, %d %b %Y %H:%M:%S GMT").to_string(),
            )
            .body("maintenance")
    });
    let late = table
        .insert_one(NewRow::new("order", Some("late"), "created", json!({})))
        .await;
    let what =
        "/readyz answers 503 and outbox_broker_connected is 0 while the endpoint answers 503";
    wait_until(WAIT, what, async || match readiness(port).await {
        (Ok(503), Some(0.0)) => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .await;
    common::wait_for_count(WAIT, "the late row is refused twice", 7, || {
        endpoint.message_count()
    })
    .await;
    endpoint.script(|_| Reply::status(204));
    let rows = wait_rows(&table, "every row is sent", |r| r.status == "sent").await;
    assert_eq!(rows[&late].attempts, 1, "a 503 spent an attempt");
    let requests = by_id(&endpoint.messages());
    let tries = &requests[&late.to_string()];
    assert!(
        tries.len() >= 3,
        "{} requests for the late row",
        tries.len()
    );
    for pair in tries.windows(2) {
        let gap = pair[1].at - pair[0].at;
        assert!(
            gap >= Duration::from_millis(1900),
            "503 with Retry-After retried after {gap:?}"
        );
    }
    let what = "/readyz answers 200 and outbox_broker_connected is 1 once the endpoint answers 2xx";
    wait_until(WAIT, what, async || match readiness(port).await {
        (Ok(200), Some(1.0)) => Ok(()),
        other => Err(format!("{other:?}")),
    })
    .await;
    relay.stop().await;
    table.drop_table().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_probes_the_origin_and_bad_settings_exit_2_naming_the_key() {
    let table = TestTable::new("http_check").await;
    let endpoint = Endpoint::start(|_| Reply::status(404)).await;
    let out = http_relay(&table, &endpoint.url("/h/{event_type}"), "http-check")
        .set("publisher.http.headers.authorization", "Bearer hunter2")
        .output(&["check"], WAIT)
        .await;
    assert!(out.status.success(), "{out:?}");
    out.assert_stdout_has("broker: ok (http POST http://127.0.0.1:");
    assert!(!format!("{out:?}").contains("hunter2"));
    let probes = endpoint.received();
    assert_eq!(probes.len(), 1);
    assert_eq!(
        (probes[0].method.as_str(), probes[0].path.as_str()),
        ("HEAD", "/")
    );
    assert!(probes[0].header("authorization").is_none());

    let closed = format!("http://127.0.0.1:{}/h", common::free_port());
    let out = http_relay(&table, &closed, "http-check-closed")
        .output(&["check"], WAIT)
        .await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    out.assert_stdout_has("broker: FAILED");

    for (key, value) in [
        ("publisher.http.url", "ftp://user:hunter2@h/x"),
        ("publisher.http.url", "http://127.0.0.1/{tenant}"),
        ("publisher.http.url", "http://{aggregate_type}.example.com/"),
        ("publisher.http.method", "DELETE"),
        ("publisher.http.mode", "batch"),
    ] {
        let out = http_relay(&table, &endpoint.url("/h"), "http-check-bad")
            .set(key, value)
            .output(&["check"], WAIT)
            .await;
        assert_eq!(out.status.code(), Some(2), "{key}: {out:?}");
        assert!(out.stderr.contains(key), "{key}: {}", out.stderr);
        assert!(!out.stderr.contains("hunter2"), "{}", out.stderr);
    }
    table.drop_table().await;
}
