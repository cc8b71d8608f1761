//! The web console (docs/console.md) in a real Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver: `common::browser`), against the relay binary,
//! PostgreSQL and RabbitMQ: the overview shows what the table holds and the lag rising while
//! the broker is cut; dead letters are listed with their errors and payloads; retry and discard
//! work with the token and are refused without it; a lookup shows a sent row's `sent_at`;
//! payloads can be hidden and the console turned off; bad input gets a clear answer, never a 500;
//! the pages fit 360 px and follow the dark scheme; actions asked for without a token stop
//! `run` and `check` but not the operator's commands.
//!
//! `screenshots` (ignored; `cargo test --test console screenshots -- --ignored`) writes the
//! pictures in docs/images/.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::browser::{Browser, Element, Key, Locator};
use common::{
    NewRow, Proxy, RABBIT_ADDR, RabbitFixture, RelayBuilder, TestTable, free_port, http_get,
    http_post, local, wait_until,
};
use serde_json::{Value, json};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);
/// The console token of the tests that allow actions.
const TOKEN: &str = "console-test-token-4f9c2a71";

/// `run` for `table` and `rabbit` with the console on `127.0.0.1:port`; an unroutable row is
/// dead-lettered after two quick attempts.
fn console_relay(table: &TestTable, rabbit: &RabbitFixture, port: u16) -> RelayBuilder {
    RelayBuilder::for_test(table, rabbit, &format!("{}-relay", table.name))
        .set("relay.poll_interval", "200ms")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .set("retry.base_delay", "100ms")
        .set("retry.max_delay", "200ms")
        .set("retry.jitter", "0.0")
        .set("retry.max_attempts", "2")
}

/// [`console_relay`] with retry and discard allowed behind [`TOKEN`] (given as
/// `RELAY_CONSOLE__TOKEN`).
fn acting_relay(table: &TestTable, rabbit: &RabbitFixture, port: u16) -> RelayBuilder {
    console_relay(table, rabbit, port)
        .set("console.allow_actions", "true")
        .set("console.token", TOKEN)
}

/// The fixtures of a test: its table and exchange (only `ok.#` reaches the queue, so a row
/// routed to `nowhere` is unroutable).
async fn fixtures(test: &str) -> (TestTable, RabbitFixture) {
    let table = TestTable::new(test).await;
    let rabbit = RabbitFixture::new(test, "ok.#", "ok.barrier").await;
    (table, rabbit)
}

/// Waits until the relay's HTTP listener answers.
async fn wait_listening(port: u16) {
    wait_until(WAIT, "the relay's HTTP listener answers", async || {
        http_get(local(port), "/healthz").await.map(|_| ())
    })
    .await;
}

fn url(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

/// Rows that cannot be delivered (routed to `nowhere`); each payload names its index.
fn unroutable(n: usize) -> Vec<NewRow> {
    (0..n)
        .map(|i| {
            NewRow::new(
                "ok",
                Some(&format!("lost-{i}")),
                "order.lost",
                json!({ "order": i, "note": "<b>not markup</b>", "amount": 12.50 }),
            )
            .headers(json!({ "tenant": "acme", "attempt-note": i }))
            .destination("nowhere")
        })
        .collect()
}

/// Inserts `rows` and waits until they are all dead letters.
async fn dead_letters(table: &TestTable, rows: &[NewRow]) -> Vec<Uuid> {
    let ids = table.insert_ids(rows).await;
    let list = ids
        .iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(",");
    let condition = format!("status = 'failed' AND id IN ({list})");
    table.wait_count(&condition, ids.len() as i64, WAIT).await;
    ids
}

/// The figure `key` of `outbox`'s card on the overview, as shown.
async fn figure(b: &Browser, outbox: &str, key: &str) -> Option<String> {
    b.text(&format!(
        "section.outbox[data-outbox=\"{outbox}\"] [data-k=\"{key}\"]"
    ))
    .await
}

/// A count as the console writes it (`1,234`).
fn number(text: &str) -> Option<i64> {
    text.replace(',', "").trim().parse().ok()
}

/// A duration as the console writes it (`17 ms`, `3.2 s`, `4 min 10 s`, `2 h 3 min`), in
/// seconds.
fn seconds(text: &str) -> Option<f64> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut total = 0.0;
    for pair in words.chunks(2) {
        let [value, unit] = pair else { return None };
        let value: f64 = value.parse().ok()?;
        total += value
            * match *unit {
                "ms" => 0.001,
                "s" => 1.0,
                "min" => 60.0,
                "h" => 3600.0,
                "d" => 86_400.0,
                _ => return None,
            };
    }
    Some(total)
}

/// The overview's counts, in the order a card shows them.
const FIGURES: [&str; 7] = [
    "ready",
    "waiting",
    "processing",
    "sent",
    "failed",
    "expired",
    "blocked",
];

/// The counts the overview shows, read from the table the way the console defines them.
async fn table_counts(table: &TestTable) -> BTreeMap<&'static str, i64> {
    let t = &table.name;
    let sql = format!(
        "SELECT count(*) FILTER (WHERE status = 'pending' AND available_at <= now()), \
           count(*) FILTER (WHERE status = 'pending' AND available_at > now()), \
           count(*) FILTER (WHERE status = 'processing'), \
           count(*) FILTER (WHERE status = 'sent'), \
           count(*) FILTER (WHERE status = 'failed'), \
           count(*) FILTER (WHERE status = 'expired'), \
           (SELECT count(DISTINCT (f.aggregate_type, f.aggregate_id)) FROM {t} f \
              WHERE f.status = 'failed' AND f.aggregate_id IS NOT NULL AND NOT EXISTS ( \
                SELECT 1 FROM {t} o WHERE o.aggregate_type = f.aggregate_type \
                  AND o.aggregate_id = f.aggregate_id AND o.seq < f.seq \
                  AND o.status NOT IN ('sent', 'expired'))) \
         FROM {t}"
    );
    let r = table.db.query_one(&sql, &[]).await.unwrap();
    FIGURES
        .into_iter()
        .enumerate()
        .map(|(i, k)| (k, r.get::<_, i64>(i)))
        .collect()
}

/// The same counts as the overview shows them (`None` for a figure not shown as a number).
async fn shown_counts(b: &Browser, outbox: &str) -> BTreeMap<&'static str, Option<i64>> {
    let mut out = BTreeMap::new();
    for k in FIGURES {
        out.insert(k, figure(b, outbox, k).await.as_deref().and_then(number));
    }
    out
}

/// Waits until the overview shows the table's counts.
async fn wait_counts_match(b: &Browser, table: &TestTable) -> BTreeMap<&'static str, i64> {
    wait_until(WAIT, "the overview shows the table's counts", async || {
        let want = table_counts(table).await;
        let shown = shown_counts(b, &table.name).await;
        if want.iter().all(|(k, n)| shown.get(k) == Some(&Some(*n))) {
            Ok(want)
        } else {
            Err(format!("page {shown:?}, table {want:?}"))
        }
    })
    .await
}

/// The lag the overview shows, in seconds.
async fn shown_lag(b: &Browser, outbox: &str) -> Result<f64, String> {
    let text = figure(b, outbox, "lag").await.unwrap_or_default();
    seconds(&text).ok_or_else(|| format!("lag shows {text:?}"))
}

// ---- the overview ------------------------------------------------------------------------------

/// The overview's counts are the table's (each status, blocked aggregates), they change in
/// place (no reload) as rows come and go, and while the broker is cut the broker shows
/// disconnected, the lag rises and connection-level failures appear in the failures chart; once
/// the broker is back everything is sent and the lag falls to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_shows_the_tables_counts_and_the_lag_rising_while_the_broker_is_cut() {
    let (table, rabbit) = fixtures("console_overview").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let port = free_port();
    let relay = console_relay(&table, &rabbit, port)
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        // The row seeded as another relay's claim stays processing.
        .set("relay.lease_timeout", "10m")
        .spawn();
    relay.wait_broker_connected(WAIT).await;
    let sent = table
        .insert_ids(&NewRow::numbered(5, "ok", Some(("s-", 5)), "created"))
        .await;
    rabbit.wait_for_ids(&sent, WAIT).await;
    table.wait_all_sent(WAIT).await;

    // Rows in every other state, as the relay, another relay or an operator leaves them.
    let seed = format!(
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status, attempts, \
           last_error, available_at, locked_at, locked_by, expires_at) VALUES \
         ('ok', 'blk-1', 'e', '{{}}', 'failed', 2, 'seeded', now(), NULL, NULL, NULL), \
         ('ok', 'blk-2', 'e', '{{}}', 'failed', 2, 'seeded', now(), NULL, NULL, NULL), \
         ('ok', 'later-1', 'e', '{{}}', 'pending', 1, 'seeded', now() + interval '1 hour', NULL, NULL, NULL), \
         ('ok', 'later-2', 'e', '{{}}', 'pending', 1, 'seeded', now() + interval '1 hour', NULL, NULL, NULL), \
         ('ok', 'later-3', 'e', '{{}}', 'pending', 1, 'seeded', now() + interval '1 hour', NULL, NULL, NULL), \
         ('ok', 'held', 'e', '{{}}', 'processing', 1, NULL, now(), now(), 'another-relay', NULL), \
         ('ok', 'gone-1', 'e', '{{}}', 'expired', 0, NULL, now(), NULL, NULL, now() - interval '1 minute'), \
         ('ok', 'gone-2', 'e', '{{}}', 'expired', 0, NULL, now(), NULL, NULL, now() - interval '1 minute')",
        t = table.name
    );
    table.db.batch_execute(&seed).await.unwrap();

    let b = Browser::start().await;
    b.goto(&url(port, "/")).await;
    let counts = wait_counts_match(&b, &table).await;
    assert_eq!(
        (counts["sent"], counts["failed"], counts["waiting"]),
        (5, 2, 3),
        "the seeded rows: {counts:?}"
    );
    assert_eq!(
        (counts["processing"], counts["expired"], counts["blocked"]),
        (1, 2, 2)
    );
    assert_eq!(
        b.text("[data-k=\"broker\"]").await.as_deref(),
        Some("broker connected")
    );
    // From here on the page must update in place: a reload would drop this marker.
    b.eval("window.consoleTestMarker = 42; return null;", vec![])
        .await;

    proxy.cut();
    let stuck = table
        .insert_ids(&NewRow::numbered(4, "ok", Some(("r-", 4)), "created"))
        .await;
    wait_until(
        WAIT,
        "the overview shows the broker disconnected",
        async || match b.text("[data-k=\"broker\"]").await {
            Some(t) if t == "broker disconnected" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    let counts = wait_counts_match(&b, &table).await;
    assert_eq!(counts["ready"], 4, "{counts:?}");
    let first = wait_until(WAIT, "the lag reaches 3 s", async || {
        let lag = shown_lag(&b, &table.name).await?;
        if lag >= 3.0 {
            Ok(lag)
        } else {
            Err(format!("{lag} s"))
        }
    })
    .await;
    wait_until(WAIT, "the lag keeps rising", async || {
        let lag = shown_lag(&b, &table.name).await?;
        if lag >= first + 4.0 {
            Ok(())
        } else {
            Err(format!("{lag} s (first {first} s)"))
        }
    })
    .await;
    // The lost connection and the failed reconnects, from the relay's own counters.
    wait_until(
        WAIT,
        "the failures chart shows connection-level failures",
        async || {
            let bars = b
                .find_all("section.outbox [data-chart=\"failures\"] svg rect.conn")
                .await;
            let caption = b
                .text("section.outbox [data-chart=\"failures\"] [data-cap]")
                .await
                .unwrap_or_default();
            if !bars.is_empty() && !caption.contains(" 0 connection") {
                Ok(())
            } else {
                Err(format!("{} bars, caption {caption:?}", bars.len()))
            }
        },
    )
    .await;
    let marker = b.eval("return window.consoleTestMarker;", vec![]).await;
    assert_eq!(
        marker,
        json!(42),
        "the page was reloaded instead of updated"
    );

    proxy.heal();
    rabbit.wait_for_ids(&stuck, WAIT).await;
    let counts = wait_counts_match(&b, &table).await;
    assert_eq!((counts["ready"], counts["sent"]), (0, 9), "{counts:?}");
    wait_until(WAIT, "the lag falls back to 0", async || {
        match shown_lag(&b, &table.name).await? {
            0.0 => Ok(()),
            lag => Err(format!("{lag} s")),
        }
    })
    .await;
    assert_eq!(
        b.text("[data-k=\"broker\"]").await.as_deref(),
        Some("broker connected")
    );
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

// ---- dead letters ------------------------------------------------------------------------------

/// Opens the dead-letter row `id`'s details with the keyboard and returns the row.
async fn open_row(b: &Browser, id: Uuid) -> Element {
    let row = b.find(&format!("li.dl[data-id=\"{id}\"]")).await;
    let summary = row.find(Locator::Css("summary")).await.unwrap();
    summary.send_keys(&Key::Enter.to_string()).await.unwrap();
    wait_until(WAIT, "the row opens", async || {
        let open = row
            .find(Locator::Css("details"))
            .await
            .map_err(|e| e.to_string())?
            .attr("open")
            .await
            .map_err(|e| e.to_string())?;
        open.map(|_| ()).ok_or_else(|| "closed".to_owned())
    })
    .await;
    row
}

/// Presses the button `label` in `row` (with the keyboard), enters `token` in the
/// confirmation dialog and confirms with Enter.
async fn confirm_action(b: &Browser, row: &Element, label: &str, token: &str) {
    let buttons = row
        .find_all(Locator::Css("button[data-action]"))
        .await
        .unwrap();
    let mut pressed = false;
    for button in buttons {
        if button.text().await.unwrap() == label {
            button.send_keys(&Key::Enter.to_string()).await.unwrap();
            pressed = true;
            break;
        }
    }
    assert!(pressed, "no {label} button in the row");
    let input = b.find("dialog#confirm[open] #confirm-token").await;
    input.clear().await.unwrap();
    input
        .send_keys(&format!("{token}{}", Key::Enter))
        .await
        .unwrap();
}

/// The flash message once it says something.
async fn flash(b: &Browser) -> String {
    wait_until(WAIT, "the page reports the outcome", async || {
        match b.text("#flash.show").await {
            Some(t) if !t.is_empty() => Ok(t),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// A row dead-lettered as unroutable is listed with its error; opened (with the keyboard) it
/// shows its payload and headers pretty-printed. With actions allowed and the token, Retry
/// publishes it again (the consumer receives it, the row ends sent) and Discard deletes another;
/// the list follows without a reload and each action is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_show_their_error_and_payload_and_retry_and_discard_act_with_the_token() {
    let (table, rabbit) = fixtures("console_dead_letters").await;
    let port = free_port();
    let relay = acting_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    let rows = unroutable(2);
    let ids = dead_letters(&table, &rows).await;
    let row = table.row(ids[0]).await;
    let error = row.last_error.clone().unwrap();
    assert!(error.contains("NO_ROUTE"), "{error}");

    let b = Browser::start().await;
    let page = format!("/outboxes/{}/dead-letters", table.name);
    b.goto(&url(port, &page)).await;
    assert_eq!(
        b.text("[data-k=\"total\"]").await.as_deref(),
        Some("2 dead letters")
    );
    let li = open_row(&b, ids[0]).await;
    let shown_error = li
        .find(Locator::Css("[data-field=\"last_error\"]"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        shown_error.contains("NO_ROUTE") && error.starts_with(&shown_error.replace('…', "")),
        "listed error {shown_error:?}, row's {error:?}"
    );
    for (field, want) in [("payload", &rows[0].payload), ("headers", &rows[0].headers)] {
        let text = li
            .find(Locator::Css(&format!("pre[data-field=\"{field}\"]")))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(text.contains("\n  \""), "{field} is pretty-printed: {text}");
        let shown: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(&shown, want, "{field}");
    }

    // Retry, once the route exists: delivered, sent.
    rabbit.bind("nowhere").await;
    confirm_action(&b, &li, "Retry", TOKEN).await;
    let said = flash(&b).await;
    assert!(said.starts_with(&format!("Retried {}", ids[0])), "{said}");
    let delivered = rabbit.wait_for_delivery(ids[0], WAIT).await;
    assert_eq!(
        serde_json::from_slice::<Value>(&delivered.body).unwrap(),
        rows[0].payload
    );
    table
        .wait_row(ids[0], WAIT, "the retried row is sent", |r| {
            r.status == "sent"
        })
        .await;
    wait_until(WAIT, "the list drops the retried row", async || {
        let n = b
            .find_all(&format!("li.dl[data-id=\"{}\"]", ids[0]))
            .await
            .len();
        let total = b.text("[data-k=\"total\"]").await;
        if n == 0 && total.as_deref() == Some("1 dead letter") {
            Ok(())
        } else {
            Err(format!("{n} rows, {total:?}"))
        }
    })
    .await;

    // Discard: gone from the table and the list; the token is remembered in the tab.
    let li = open_row(&b, ids[1]).await;
    let row = li.clone();
    let buttons = row
        .find_all(Locator::Css("button[data-action]"))
        .await
        .unwrap();
    let mut discard = None;
    for button in buttons {
        if button.text().await.unwrap() == "Discard" {
            discard = Some(button);
        }
    }
    discard
        .unwrap()
        .send_keys(&Key::Enter.to_string())
        .await
        .unwrap();
    let remembered = b.find("dialog#confirm[open] #confirm-token").await;
    assert_eq!(
        remembered.prop("value").await.unwrap().as_deref(),
        Some(TOKEN)
    );
    let question = b.text("#confirm-text").await.unwrap();
    assert!(
        question.starts_with(&format!("Discard dead letter {}", ids[1])),
        "{question}"
    );
    b.find("#confirm-ok").await.click().await.unwrap();
    let said = wait_until(WAIT, "the page reports the discard", async || {
        match b.text("#flash.show").await {
            Some(t) if t.starts_with("Discarded") => Ok(t),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(said.contains(&ids[1].to_string()), "{said}");
    table
        .wait_count(&format!("id = '{}'", ids[1]), 0, WAIT)
        .await;
    wait_until(WAIT, "the list is empty", async || {
        match b.text("#dl-list .empty").await {
            Some(t) if t.contains("No dead letters") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    assert!(
        !rabbit.id_counts().contains_key(&ids[1].to_string()),
        "a discarded row is never published"
    );
    assert_eq!(relay.log_count("console: dead letters retried"), 1);
    assert_eq!(relay.log_count("console: dead letters discarded"), 1);
    assert!(
        relay.log_count(&ids[1].to_string()) >= 1,
        "the discard's log names the row"
    );
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

/// The POST paths of `outbox`'s dead letter `id`.
fn action_paths(outbox: &str, id: Uuid) -> [String; 4] {
    let base = format!("/api/outboxes/{outbox}/dead-letters");
    [
        format!("{base}/{id}/retry"),
        format!("{base}/{id}/discard"),
        format!("{base}/retry-all"),
        format!("{base}/discard-all"),
    ]
}

/// Read-only (the default), the pages have no action buttons and every action answers 403,
/// even with a token. With actions allowed, a POST without the token or with a wrong one is 403
/// too (in the page as well: the refusal is shown), and nothing changes; the refusals are logged
/// once, not once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_token_actions_are_refused_and_nothing_changes() {
    let (table, rabbit) = fixtures("console_refused").await;
    let port = free_port();
    let relay = console_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    let id = dead_letters(&table, &unroutable(1)).await[0];

    let b = Browser::start().await;
    let page = format!("/outboxes/{}/dead-letters", table.name);
    b.goto(&url(port, &page)).await;
    open_row(&b, id).await;
    assert!(b.find_all("button[data-action]").await.is_empty());
    assert!(b.find_all("dialog#confirm").await.is_empty());
    let bearer = format!("Bearer {TOKEN}");
    for path in action_paths(&table.name, id) {
        let (code, body) = http_post(local(port), &path, &[("Authorization", &bearer)])
            .await
            .unwrap();
        assert_eq!(code, 403, "{path}: {body}");
        assert!(body.contains("actions are off"), "{body}");
    }
    relay.stop().await;

    let port = free_port();
    let relay = acting_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    for path in action_paths(&table.name, id) {
        for headers in [
            vec![],
            vec![("Authorization", "Bearer not-the-console-token")],
            vec![("Authorization", TOKEN)],
            vec![("Authorization", "Basic b3BlcmF0b3I6c2VjcmV0")],
        ] {
            let (code, body) = http_post(local(port), &path, &headers).await.unwrap();
            assert_eq!(code, 403, "{path} with {headers:?}: {body}");
            assert!(body.contains("Refused"), "{body}");
            let why = match headers.first() {
                None => "no console token",
                Some((_, v)) if v.starts_with("Bearer") => "wrong console token",
                Some(_) => "not a Bearer token",
            };
            assert!(body.contains(why), "{path} with {headers:?}: {body}");
        }
    }
    b.goto(&url(port, &page)).await;
    let li = open_row(&b, id).await;
    confirm_action(&b, &li, "Retry", "a-wrong-token-of-some-length").await;
    let said = flash(&b).await;
    assert!(said.contains("wrong console token"), "{said}");

    let row = table.row(id).await;
    assert_eq!(
        (row.status.as_str(), row.attempts),
        ("failed", 2),
        "{row:?}"
    );
    assert_eq!(
        b.find_all(&format!("li.dl[data-id=\"{id}\"]")).await.len(),
        1
    );
    assert_eq!(
        relay.log_count("refused a dead-letter action"),
        1,
        "13 refusals within a minute are one warning"
    );
    assert_eq!(relay.log_count(TOKEN), 0, "no token in the logs");
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

// ---- lookup, settings ------------------------------------------------------------------------

/// A message id typed into the header's lookup (keyboard only) opens the message: sent, one
/// attempt, and the `sent_at` the row has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_by_id_shows_a_sent_rows_sent_at() {
    let (table, rabbit) = fixtures("console_lookup").await;
    let port = free_port();
    let relay = console_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    let id = table
        .insert_one(NewRow::new("ok", Some("l-1"), "created", json!({"n": 1})))
        .await;
    let row = table
        .wait_row(id, WAIT, "the row is sent", |r| r.status == "sent")
        .await;
    let sent_at = row.sent_at.unwrap();

    let b = Browser::start().await;
    b.goto(&url(port, "/")).await;
    b.find("#lookup-id")
        .await
        .send_keys(&format!("{id}{}", Key::Enter))
        .await
        .unwrap();
    let time = wait_until(WAIT, "the message page shows sent_at", async || {
        let el = b
            .client
            .find(Locator::Css("[data-field=\"sent_at\"] time"))
            .await
            .map_err(|e| e.to_string())?;
        el.attr("datetime").await.map_err(|e| e.to_string())
    })
    .await;
    assert_eq!(
        time.as_deref(),
        Some(
            sent_at
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .as_str()
        )
    );
    let shown = b.text("[data-field=\"sent_at\"] time").await.unwrap();
    assert_eq!(
        shown,
        sent_at.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()
    );
    assert_eq!(
        b.text("[data-field=\"status\"]").await.as_deref(),
        Some("sent")
    );
    assert_eq!(
        b.text("[data-field=\"attempts\"]").await.as_deref(),
        Some("1")
    );
    let current = b.client.current_url().await.unwrap();
    assert_eq!(current.path(), "/messages");
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

/// `console.show_payloads = false`: the dead-letter list and the lookup say payloads and
/// headers are hidden and carry neither, in the pages or their JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_payloads_false_hides_payloads_and_headers() {
    let (table, rabbit) = fixtures("console_no_payloads").await;
    let port = free_port();
    let relay = console_relay(&table, &rabbit, port)
        .set("console.show_payloads", "false")
        .spawn();
    wait_listening(port).await;
    let secret = "personal-data-7d1e";
    let row = NewRow::new("ok", Some("p-1"), "created", json!({ "email": secret }))
        .headers(json!({ "x-person": secret }))
        .destination("nowhere");
    let id = dead_letters(&table, &[row]).await[0];

    let b = Browser::start().await;
    let page = format!("/outboxes/{}/dead-letters", table.name);
    b.goto(&url(port, &page)).await;
    let li = open_row(&b, id).await;
    let text = li.text().await.unwrap();
    assert!(text.contains("Payload and headers hidden"), "{text}");
    assert!(b.find_all("pre[data-field=\"payload\"]").await.is_empty());
    b.goto(&url(port, &format!("/messages?id={id}"))).await;
    let text = b.text("#message-body").await.unwrap();
    assert!(text.contains("Payload and headers hidden"), "{text}");
    for path in [
        page.clone(),
        format!("/api/outboxes/{}/dead-letters", table.name),
        format!("/messages?id={id}"),
        format!("/api/messages/{id}"),
    ] {
        let (code, body) = http_get(local(port), &path).await.unwrap();
        assert_eq!(code, 200, "{path}");
        assert!(!body.contains(secret), "{path} shows the payload: {body}");
        assert!(body.contains(&id.to_string()), "{path} shows the row");
    }
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

/// `console.enabled = false`: no console (404 at `/` and under it), `/metrics` and the health
/// checks answer as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_console_is_404_while_metrics_and_health_answer() {
    let (table, rabbit) = fixtures("console_off").await;
    let port = free_port();
    let relay = console_relay(&table, &rabbit, port)
        .set("console.enabled", "false")
        .spawn();
    wait_listening(port).await;
    for path in ["/", "/api/overview", "/messages", "/assets/console.js"] {
        let (code, _) = http_get(local(port), path).await.unwrap();
        assert_eq!(code, 404, "{path}");
    }
    let (code, body) = http_get(local(port), "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("outbox_relay_info"), "{body}");
    assert_eq!(http_get(local(port), "/healthz").await.unwrap().0, 200);
    assert_eq!(relay.log_count("serving the web console"), 0);
    common::finish(relay, table, rabbit).await;
}

/// Bad input gets a page that says what is wrong, with the right status, never a 500: an
/// unknown outbox, page numbers that are not numbers or are past the last page, an id that is
/// not a UUID or that no outbox has, a page that does not exist, an unknown action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_message_never_a_500() {
    let (table, rabbit) = fixtures("console_bad_input").await;
    let port = free_port();
    let relay = acting_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    dead_letters(&table, &unroutable(1)).await;
    let t = &table.name;
    let unknown = Uuid::new_v4();
    let cases: Vec<(String, u16, String)> = vec![
        (
            "/outboxes/no_such_outbox/dead-letters".into(),
            404,
            format!("No outbox named \"no_such_outbox\" This relay serves: {t}."),
        ),
        (
            format!("/outboxes/{t}/dead-letters?page=abc"),
            400,
            "\"abc\" is not a page number: pages are counted from 1.".into(),
        ),
        (
            format!("/outboxes/{t}/dead-letters?page=0"),
            400,
            "\"0\" is not a page number".into(),
        ),
        (
            format!("/outboxes/{t}/dead-letters?page=99"),
            404,
            format!("Page 99 is past the last page Outbox {t} has 1 dead letter (1 page)."),
        ),
        (
            "/messages?id=42".into(),
            400,
            "\"42\" is not a message id: ids are UUIDs".into(),
        ),
        (
            format!("/messages?id={unknown}"),
            404,
            format!("No outbox has a row with id {unknown}"),
        ),
        (
            "/no/such/page".into(),
            404,
            "The console has no page at /no/such/page.".into(),
        ),
    ];
    let b = Browser::start().await;
    for (path, status, message) in &cases {
        let (code, body) = http_get(local(port), path).await.unwrap();
        assert_eq!(code, *status, "{path}: {body}");
        b.goto(&url(port, path)).await;
        let shown = b
            .text("[role=\"alert\"]:not([hidden])")
            .await
            .unwrap_or_default();
        let shown = shown.replace('\n', " ");
        assert!(
            shown.contains(message.as_str()),
            "{path}: shows {shown:?}, wanted {message:?}"
        );
    }
    // The JSON endpoints and the actions answer the same way.
    let bearer = format!("Bearer {TOKEN}");
    for (path, post, status) in [
        ("/api/messages/not-a-uuid".to_owned(), false, 400),
        (
            format!("/api/outboxes/{t}/dead-letters?page=-1"),
            false,
            400,
        ),
        ("/api/outboxes/nope/dead-letters".to_owned(), false, 404),
        ("/api/no-such-endpoint".to_owned(), false, 404),
        (
            format!("/api/outboxes/{t}/dead-letters/x/retry/again"),
            true,
            404,
        ),
        (
            format!("/api/outboxes/{t}/dead-letters/not-a-uuid/retry"),
            true,
            400,
        ),
        (
            format!("/api/outboxes/{t}/dead-letters/{unknown}/retry"),
            true,
            409,
        ),
        (
            format!("/api/outboxes/{t}/dead-letters/{unknown}/explode"),
            true,
            404,
        ),
        (
            format!("/api/outboxes/{t}/dead-letters/explode-all"),
            true,
            404,
        ),
        (
            "/api/outboxes/nope/dead-letters/retry-all".to_owned(),
            true,
            404,
        ),
    ] {
        let (code, body) = if post {
            http_post(local(port), &path, &[("Authorization", &bearer)])
                .await
                .unwrap()
        } else {
            http_get(local(port), &path).await.unwrap()
        };
        assert_eq!(code, status, "{path}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert!(
            error["error"].as_str().is_some_and(|e| e.len() > 20),
            "{path}: {body}"
        );
    }
    assert_eq!(
        table.count_where("status = 'failed'").await,
        1,
        "nothing was changed"
    );
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

/// Every page fits a 360 px wide screen without sideways scrolling, with a dead letter open;
/// and the pages follow `prefers-color-scheme` (dark background in the dark scheme, light in
/// the light one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_fit_360_px_and_follow_the_colour_scheme() {
    let (table, rabbit) = fixtures("console_narrow").await;
    let port = free_port();
    let relay = acting_relay(&table, &rabbit, port).spawn();
    wait_listening(port).await;
    let id = dead_letters(&table, &unroutable(1)).await[0];

    let b = Browser::start().await;
    b.viewport(360, 780).await;
    // What sticks out past 360 px (a phone widens the layout to fit it), for the message.
    let overflow = "return [...document.querySelectorAll('body *')] \
        .filter(e => e.getBoundingClientRect().right > 360.5) \
        .map(e => e.tagName + '.' + e.className + ' ' + Math.round(e.getBoundingClientRect().right));";
    let pages = [
        "/".to_owned(),
        format!("/outboxes/{}/dead-letters", table.name),
        format!("/messages?id={id}"),
    ];
    for page in &pages {
        b.goto(&url(port, page)).await;
        if page.contains("dead-letters") {
            open_row(&b, id).await;
        }
        let width = b.eval("return window.innerWidth;", vec![]).await;
        let wide = b.eval(overflow, vec![]).await;
        assert_eq!(width, json!(360), "{page} is wider than 360 px: {wide}");
        assert_eq!(wide, json!([]), "{page}: these stick out at 360 px");
    }
    let background = "return getComputedStyle(document.body).backgroundColor;";
    let luminance = |css: &Value| {
        let text = css.as_str().unwrap_or_default();
        let parts: Vec<f64> = text
            .trim_start_matches("rgb(")
            .trim_end_matches(')')
            .split(',')
            .filter_map(|p| p.trim().parse().ok())
            .collect();
        assert_eq!(parts.len(), 3, "{text}");
        (0.2126 * parts[0] + 0.7152 * parts[1] + 0.0722 * parts[2]) / 255.0
    };
    b.dark(true).await;
    let dark = luminance(&b.eval(background, vec![]).await);
    b.dark(false).await;
    let light = luminance(&b.eval(background, vec![]).await);
    assert!(dark < 0.2 && light > 0.8, "dark {dark}, light {light}");
    b.close().await;
    common::finish(relay, table, rabbit).await;
}

// ---- screenshots ---------------------------------------------------------------------------------

/// An order event of `round`, row `i`.
fn order_row(round: usize, i: usize) -> NewRow {
    let order = format!("{}", 10_400 + (round * 31 + i) % 97);
    let event = ["order.created", "order.paid", "order.shipped"][i % 3];
    NewRow::new(
        "order",
        Some(&order),
        event,
        json!({ "order_id": order, "total": 19.99 + i as f64, "currency": "EUR",
                "lines": [{ "sku": "TSHIRT-M", "qty": 2 }] }),
    )
    .headers(json!({ "tenant": "acme", "source": "checkout" }))
}

/// An invoice event of `round`; `lost` ones go to a destination nothing is bound to.
fn invoice_row(round: usize, lost: bool) -> NewRow {
    let row = NewRow::new(
        "invoice",
        Some(&format!("INV-2026-{round:04}")),
        "invoice.issued",
        json!({ "invoice": format!("INV-2026-{round:04}"), "amount": 249.0, "due": "2026-12-31",
                "customer": { "id": 5521, "country": "DE" } }),
    )
    .headers(json!({ "tenant": "acme", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" }));
    if lost {
        row.destination("erp.invoices")
    } else {
        row
    }
}

/// Two outboxes (`orders`, `billing`) relayed with traffic for about three and a half minutes,
/// a 30 s broker outage and a few unroutable invoices; then writes
/// docs/images/console-<page>-<width>.png for the overview, the dead letters (one open) and a
/// lookup, at 1280 and 360 px wide, and the overview at 360 in the dark scheme.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes docs/images/*.png; run by hand: cargo test --test console screenshots -- --ignored"]
async fn screenshots() {
    let orders = TestTable::new("orders").await;
    let billing = TestTable::new("billing").await;
    let rabbit = RabbitFixture::new("console_shots", "order.#", "order.barrier").await;
    rabbit.bind("invoice.#").await;
    let proxy = Proxy::start(RABBIT_ADDR).await;
    let port = free_port();
    let dir = common::TempDir::new("console_shots");
    let config = dir.write(
        "relay.toml",
        &format!(
            "[[outboxes]]\nname = \"orders\"\ntable = \"{}\"\n\n[[outboxes]]\nname = \"billing\"\ntable = \"{}\"\n",
            orders.name, billing.name
        ),
    );
    let relay = RelayBuilder::for_test(&orders, &rabbit, "relay-7f9c")
        .unset("RELAY_DATABASE__TABLE")
        .set("relay.poll_interval", "200ms")
        .set("metrics.listen", format!("127.0.0.1:{port}"))
        .set("publisher.rabbitmq.url", proxy.amqp_url())
        .set("retry.base_delay", "2s")
        .set("retry.max_delay", "10s")
        .set("retry.max_attempts", "4")
        .set("console.allow_actions", "true")
        .set("console.token", TOKEN)
        .quiet()
        .spawn_with(&["--config", config.to_str().unwrap(), "run"]);
    wait_listening(port).await;
    let mut lost = Vec::new();
    for round in 0..210usize {
        let n = 12 + (round * 7) % 25 + if (60..90).contains(&round) { 30 } else { 0 };
        let rows: Vec<NewRow> = (0..n).map(|i| order_row(round, i)).collect();
        orders.insert_ids(&rows).await;
        if round % 3 == 0 {
            billing.insert_one(invoice_row(round, false)).await;
        }
        if round % 50 == 10 {
            lost.push(billing.insert_one(invoice_row(round, true)).await);
        }
        match round {
            120 => proxy.cut(),
            150 => proxy.heal(),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    let failed = "status = 'failed' AND destination = 'erp.invoices'";
    billing.wait_count(failed, lost.len() as i64, WAIT).await;
    let sent = orders.insert_one(order_row(0, 0)).await;
    orders
        .wait_row(sent, WAIT, "the looked-up row is sent", |r| {
            r.status == "sent"
        })
        .await;
    tokio::time::sleep(Duration::from_secs(6)).await;

    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/images");
    let b = Browser::start().await;
    let shoot = async |path: &str, name: &str, width: u32, dark: bool, open: Option<Uuid>| {
        b.dark(dark).await;
        b.viewport(width, 900).await;
        b.goto(&url(port, path)).await;
        if let Some(id) = open {
            open_row(&b, id).await;
            // The keyboard focus ring is not part of the picture.
            b.eval("document.activeElement.blur(); return null;", vec![])
                .await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let png = b.screenshot_page(width, 900).await;
        let suffix = if dark { "-dark" } else { "" };
        let file = docs.join(format!("console-{name}-{width}{suffix}.png"));
        std::fs::write(&file, png).unwrap();
        // About a third of the size, no visible change (Debian's pngquant, when installed).
        let quantized = std::process::Command::new("pngquant")
            .args([
                "--quality=70-90",
                "--speed=1",
                "--force",
                "--skip-if-larger",
                "--ext=.png",
            ])
            .arg(&file)
            .status()
            .is_ok_and(|s| s.success());
        eprintln!("wrote {} (quantized: {quantized})", file.display());
    };
    let dead = "/outboxes/billing/dead-letters";
    let lookup = format!("/messages?id={sent}");
    for width in [1280, 360] {
        shoot("/", "overview", width, false, None).await;
        shoot(dead, "dead-letters", width, false, lost.first().copied()).await;
        shoot(&lookup, "message", width, false, None).await;
    }
    shoot("/", "overview", 360, true, None).await;
    b.close().await;
    relay.stop().await;
    rabbit.teardown().await;
    orders.drop_table().await;
    billing.drop_table().await;
}

/// `allow_actions` without a token (the token given to the daemon's environment only):
/// `run` and `check` refuse it (exit 2, naming the key), while the operator's commands, which
/// serve no console, still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_without_a_token_stop_run_and_check_but_not_the_operators_commands() {
    let table = TestTable::new("console_no_token").await;
    let op = || RelayBuilder::operator(&table.name).set("console.allow_actions", "true");
    let status = op().output(&["status"], WAIT).await;
    assert!(status.status.success(), "{}", status.stderr);
    let list = op().output(&["dead-letters", "list"], WAIT).await;
    assert!(list.status.success(), "{}", list.stderr);
    for command in ["check", "run"] {
        let out = op().output(&[command], WAIT).await;
        assert_eq!(out.status.code(), Some(2), "{command}: {}", out.stderr);
        let said = "console.allow_actions: is true but console.token is not set";
        assert!(out.stderr.contains(said), "{command}: {}", out.stderr);
    }
    table.drop_table().await;
}
