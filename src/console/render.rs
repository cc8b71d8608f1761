//! The console's HTML: the page layout, the overview's outbox cards, the dead-letter list, the
//! message lookup and the notices for bad input, plus the formatting every page shares
//! (counts, durations, times, payloads). Everything written into a page goes through
//! [`escape`]. Pure: the routes gather the data, these functions only write it.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};

use super::chart::Chart;
use crate::store::{Backlog, COUNT_CAP, ConsoleCounts, DeadLetterRow, MessageRow};

/// The most payload text a page shows; the rest is cut with a note.
pub const MAX_SHOWN_BYTES: usize = 64 * 1024;

/// Dead letters per page.
pub const PER_PAGE: i64 = 25;

/// `text` with `&`, `<`, `>`, `"` and `'` escaped, safe in element content and attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `text` as one URL path segment (everything but unreserved characters percent-encoded).
pub fn path_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// `n` with thousands separators: `12,345`.
pub fn count(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A count read up to [`COUNT_CAP`]: at the cap it shows as `100,000+`.
pub fn capped(n: i64) -> String {
    if n >= COUNT_CAP {
        format!("{}+", count(COUNT_CAP))
    } else {
        count(n)
    }
}

/// `n` `things` with the singular when `n` is 1: `1 dead letter`, `3 dead letters`,
/// `2 outboxes` (`-es` after `s`, `x`, `ch`, `sh`).
pub fn plural(n: i64, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        let es = ["s", "x", "ch", "sh"]
            .iter()
            .any(|end| thing.ends_with(end));
        format!("{} {thing}{}", count(n), if es { "es" } else { "s" })
    }
}

/// A number of seconds as a person reads it: `0 s`, `17 ms`, `3.2 s`, `42 s`, `4 min 10 s`,
/// `2 h 3 min`, `3 d 4 h`.
pub fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs <= 0.0 {
        return "0 s".to_owned();
    }
    if secs < 0.9995 {
        return format!("{} ms", (secs * 1000.0).round());
    }
    if secs < 10.0 {
        return format!("{secs:.1} s");
    }
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A rate: `0/s`, `3.5/s`, `120/s`.
pub fn rate(per_second: f64) -> String {
    if per_second <= 0.0 {
        "0/s".to_owned()
    } else if per_second < 10.0 {
        format!("{}/s", (per_second * 10.0).round() / 10.0)
    } else {
        format!("{}/s", count(per_second.round() as i64))
    }
}

/// A timestamp as a `<time>` element: the exact instant in its `datetime`, milliseconds in
/// UTC in its text.
pub fn time(t: DateTime<Utc>) -> String {
    format!(
        "<time datetime=\"{}\">{}</time>",
        t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        t.format("%Y-%m-%d %H:%M:%S%.3f UTC")
    )
}

/// A payload or headers column made readable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    /// What the bytes are: `JSON`, `text` or `binary`.
    pub kind: &'static str,
    /// The bytes' length.
    pub bytes: usize,
    /// Pretty-printed JSON, the text, or a hex dump; cut at [`MAX_SHOWN_BYTES`].
    pub text: String,
    /// Whether `text` was cut.
    pub truncated: bool,
}

/// `bytes` made readable: JSON pretty-printed, other UTF-8 as it is, anything else as a hex
/// dump (16 bytes a line with their printable characters).
pub fn shown(bytes: &[u8]) -> Shown {
    let (kind, text) = if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        let pretty = serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string());
        ("JSON", pretty)
    } else if let Ok(s) = std::str::from_utf8(bytes) {
        ("text", s.to_owned())
    } else {
        let mut dump = String::new();
        for (i, line) in bytes.chunks(16).take(MAX_SHOWN_BYTES / 16 / 4).enumerate() {
            let hex: Vec<String> = line.iter().map(|b| format!("{b:02x}")).collect();
            let ascii: String = line
                .iter()
                .map(|b| {
                    if b.is_ascii_graphic() || *b == b' ' {
                        char::from(*b)
                    } else {
                        '.'
                    }
                })
                .collect();
            let _ = writeln!(dump, "{:08x}  {:<47}  {ascii}", i * 16, hex.join(" "));
        }
        ("binary", dump)
    };
    let mut text = text;
    let mut truncated = bytes.len() > MAX_SHOWN_BYTES / 4 && kind == "binary";
    if text.len() > MAX_SHOWN_BYTES {
        let mut cut = MAX_SHOWN_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        truncated = true;
    }
    Shown {
        kind,
        bytes: bytes.len(),
        text,
        truncated,
    }
}

/// What every page's frame needs.
#[derive(Debug, Clone)]
pub struct Layout<'a> {
    /// The page's title (before ` · outbox-relay`).
    pub title: &'a str,
    /// Which page: `overview`, `dead-letters`, `message` or `notice` (the script's mode).
    pub page: &'static str,
    /// The JSON endpoint the page's script polls, if any.
    pub api: Option<String>,
    /// The relay's instance id.
    pub instance: &'a str,
    /// Whether retry and discard are on (the confirmation dialog is in the page).
    pub actions: bool,
}

/// A whole page: `main` inside the shared frame (header with the lookup, footer, the
/// confirmation dialog when actions are on).
pub fn page(layout: &Layout<'_>, main: &str) -> String {
    let api = layout
        .api
        .as_deref()
        .map(|a| format!(" data-api=\"{}\"", escape(a)))
        .unwrap_or_default();
    let dialog = if layout.actions {
        "<dialog id=\"confirm\" aria-labelledby=\"confirm-title\">\
           <form method=\"dialog\">\
             <h2 id=\"confirm-title\">Please confirm</h2>\
             <p id=\"confirm-text\"></p>\
             <label for=\"confirm-token\">Console token</label>\
             <input id=\"confirm-token\" type=\"password\" autocomplete=\"off\" spellcheck=\"false\" required>\
             <p class=\"muted small\">Sent as <code>Authorization: Bearer</code>; kept in this tab only.</p>\
             <div class=\"buttons\">\
               <button value=\"ok\" id=\"confirm-ok\" class=\"primary\">Confirm</button>\
               <button value=\"cancel\" formnovalidate>Cancel</button>\
             </div>\
           </form>\
         </dialog>"
    } else {
        ""
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"color-scheme\" content=\"light dark\">\
         <title>{title} · outbox-relay</title>\
         <link rel=\"stylesheet\" href=\"/assets/console.css\">\
         <script src=\"/assets/console.js\" defer></script></head>\
         <body data-page=\"{page}\"{api}>\
         <a class=\"skip\" href=\"#main\">Skip to content</a>\
         <header class=\"top\"><div class=\"wrap\">\
           <a class=\"brand\" href=\"/\">outbox-relay <span>console</span></a>\
           <form class=\"lookup\" action=\"/messages\" method=\"get\" role=\"search\">\
             <label for=\"lookup-id\" class=\"sr\">Message id</label>\
             <input id=\"lookup-id\" name=\"id\" placeholder=\"Look up a message id\" autocomplete=\"off\" spellcheck=\"false\">\
             <button>Look up</button>\
           </form>\
         </div></header>\
         <main id=\"main\" class=\"wrap\">{main}</main>\
         <footer class=\"wrap muted\">instance {instance} · outbox-relay {version} · \
           <a href=\"/metrics\">metrics</a> · <a href=\"/readyz\">readiness</a></footer>\
         <p id=\"offline\" class=\"notice error\" role=\"alert\" hidden>Cannot reach the relay; the figures are not being updated. Retrying…</p>\
         <div id=\"flash\" role=\"status\" aria-live=\"polite\"></div>\
         {dialog}</body></html>",
        title = escape(layout.title),
        page = layout.page,
        instance = escape(layout.instance),
        version = env!("CARGO_PKG_VERSION"),
    )
}

/// A notice in a page: what went wrong and where to go from there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The heading.
    pub title: String,
    /// The explanation (plain text).
    pub text: String,
    /// Links offered: (text, href).
    pub links: Vec<(String, String)>,
}

/// A notice as the page's main content.
pub fn notice(n: &Notice) -> String {
    let links = n
        .links
        .iter()
        .map(|(text, href)| format!("<a href=\"{}\">{}</a>", escape(href), escape(text)))
        .collect::<Vec<_>>()
        .join(" · ");
    format!(
        "<div class=\"notice error\" role=\"alert\"><h1>{}</h1><p>{}</p></div><p>{links}</p>",
        escape(&n.title),
        escape(&n.text)
    )
}

/// One outbox on the overview.
#[derive(Debug, Clone)]
pub struct Card {
    /// The outbox's name.
    pub name: String,
    /// Its table, schema-qualified as configured.
    pub table: String,
    /// Its database URL, password masked.
    pub database: String,
    /// Whether its database answered at last contact.
    pub database_up: bool,
    /// Why the outbox cannot start although its database answers (its table missing, say).
    pub database_problem: Option<String>,
    /// The backlog task's last figures and how old they are (seconds); `None` before the first.
    pub backlog: Option<(f64, Backlog)>,
    /// The console's own counts, or why they could not be read.
    pub counts: Result<ConsoleCounts, String>,
    /// Throughput, failures and lag.
    pub charts: [Chart; 3],
    /// Rows this relay dead-lettered in the charts' window.
    pub dead_lettered_recently: u64,
}

/// The charts' keys and titles, in the order of [`Card::charts`].
pub const CHARTS: [(&str, &str); 3] = [
    ("throughput", "Throughput"),
    ("failures", "Failures"),
    ("lag", "Lag"),
];

/// The figures of a card by key (`ready`, `lag`, …), formatted: the page's `data-k` elements
/// and the JSON the script updates them from.
pub fn card_values(c: &Card) -> Vec<(&'static str, String)> {
    const NONE: &str = "—";
    let b = c.backlog.map(|(_, b)| b);
    let from_backlog = |f: fn(&Backlog) -> String| b.as_ref().map(f).unwrap_or(NONE.into());
    let from_counts =
        |f: fn(&ConsoleCounts) -> String| c.counts.as_ref().map(f).unwrap_or(NONE.into());
    let as_of = match (&c.backlog, &c.counts) {
        (None, _) => "waiting for the first backlog reading".to_owned(),
        (Some((age, _)), Ok(_)) => format!("backlog figures from {} ago", duration(*age)),
        (Some((age, _)), Err(e)) => format!(
            "backlog figures from {} ago; other counts unavailable: {e}",
            duration(*age)
        ),
    };
    vec![
        ("ready", from_backlog(|b| count(b.ready))),
        ("waiting", from_backlog(|b| count(b.waiting))),
        ("processing", from_counts(|n| count(n.processing))),
        ("sent", from_counts(|n| capped(n.sent))),
        ("failed", from_backlog(|b| count(b.failed))),
        ("expired", from_counts(|n| capped(n.expired))),
        ("lag", from_backlog(|b| duration(b.oldest_ready_age))),
        ("oldest", from_backlog(|b| duration(b.oldest_pending_age))),
        ("blocked", from_backlog(|b| count(b.blocked_aggregates))),
        (
            "failed_recently",
            format!(
                "{} new in 15 min",
                count(i64::try_from(c.dead_lettered_recently).unwrap_or(i64::MAX))
            ),
        ),
        (
            "database",
            match (&c.database_problem, c.database_up) {
                (_, true) => "database connected".to_owned(),
                (Some(why), false) => format!("cannot start: {why}"),
                (None, false) => "database unreachable".to_owned(),
            },
        ),
        ("as_of", as_of),
    ]
}

/// The card's states by key, as classes the page sets: `database` (up), `failed` (has dead
/// letters), `blocked` (has blocked aggregates).
pub fn card_flags(c: &Card) -> Vec<(&'static str, bool)> {
    let b = c.backlog.map(|(_, b)| b).unwrap_or_default();
    vec![
        ("database", c.database_up),
        ("failed", b.failed > 0),
        ("blocked", b.blocked_aggregates > 0),
    ]
}

/// The overview's main content: the broker line and a card per outbox.
pub fn overview(broker_up: bool, publisher: &str, cards: &[Card]) -> String {
    let mut out = format!(
        "<h1 class=\"sr\">Overview</h1><div class=\"status-line\">{}<span class=\"muted\">publishing to <code>{}</code></span></div>",
        badge("broker", broker_text(broker_up), broker_up),
        escape(publisher)
    );
    if cards.is_empty() {
        out.push_str(
            "<p class=\"notice\">No outbox has started yet: the relay is still connecting to its databases.</p>",
        );
    }
    for (i, c) in cards.iter().enumerate() {
        out.push_str(&card(i, c));
    }
    out
}

/// The broker badge's text.
pub fn broker_text(up: bool) -> String {
    if up {
        "broker connected"
    } else {
        "broker disconnected"
    }
    .to_owned()
}

fn badge(key: &str, text: String, ok: bool) -> String {
    format!(
        "<span class=\"badge {}\" data-k=\"{key}\" data-flag=\"{key}\">{}</span>",
        if ok { "ok" } else { "bad" },
        escape(&text)
    )
}

fn card(i: usize, c: &Card) -> String {
    let values = card_values(c);
    let dead_letters = format!("/outboxes/{}/dead-letters", path_segment(&c.name));
    let mut out = format!(
        "<section class=\"outbox\" data-outbox=\"{name}\" aria-labelledby=\"outbox-{i}\">\
         <header><h2 id=\"outbox-{i}\">{name}</h2>{db}\
         <p class=\"muted where\">table <code>{table}</code> · <code>{url}</code></p></header>\
         <div class=\"tiles\">",
        name = escape(&c.name),
        db = badge("database", value_raw(&values, "database"), c.database_up),
        table = escape(&c.table),
        url = escape(&c.database),
    );
    tiles(&mut out, &values, &card_flags(c), &dead_letters);
    out.push_str("</div><div class=\"charts\">");
    charts(&mut out, c);
    let _ = write!(
        out,
        "</div><p class=\"foot muted\"><span data-k=\"as_of\">{}</span> · oldest unsent row <span data-k=\"oldest\">{}</span> · <a href=\"{}\">dead letters</a></p></section>",
        escape(&value_raw(&values, "as_of")),
        escape(&value_raw(&values, "oldest")),
        escape(&dead_letters)
    );
    out
}

/// The card's tiles (counts, lag, blocked aggregates), appended to `out`.
fn tiles(
    out: &mut String,
    values: &[(&'static str, String)],
    flags: &[(&'static str, bool)],
    dead_letters: &str,
) {
    let value = |k: &str| escape(&value_raw(values, k));
    let flag = |k: &str| flags.iter().any(|(key, on)| *key == k && *on);
    for (k, label, hint) in [
        ("ready", "Ready", "pending, due now"),
        ("waiting", "Waiting", "pending, backing off"),
        ("processing", "Processing", "claimed, awaiting the broker"),
        ("sent", "Sent", "kept until retention"),
    ] {
        let _ = write!(
            out,
            "<div class=\"tile\" data-tile=\"{k}\"><span class=\"label\">{label}</span><span class=\"num\" data-k=\"{k}\">{}</span><span class=\"hint\">{hint}</span></div>",
            value(k)
        );
    }
    let _ = write!(
        out,
        "<a class=\"tile link{}\" data-tile=\"failed\" data-flag=\"failed\" href=\"{}\"><span class=\"label\">Failed</span><span class=\"num\" data-k=\"failed\">{}</span><span class=\"hint\">dead letters · <span data-k=\"failed_recently\">{}</span></span></a>",
        if flag("failed") { " warn" } else { "" },
        escape(dead_letters),
        value("failed"),
        value("failed_recently")
    );
    for (k, label, hint, warn) in [
        ("expired", "Expired", "past their deadline", false),
        ("lag", "Lag", "oldest ready row's age", false),
        (
            "blocked",
            "Blocked",
            "aggregates held by a dead letter",
            flag("blocked"),
        ),
    ] {
        let _ = write!(
            out,
            "<div class=\"tile{}\" data-tile=\"{k}\"{}><span class=\"label\">{label}</span><span class=\"num\" data-k=\"{k}\">{}</span><span class=\"hint\">{hint}</span></div>",
            if warn { " warn" } else { "" },
            if k == "blocked" {
                " data-flag=\"blocked\""
            } else {
                ""
            },
            value(k)
        );
    }
}

/// The card's three charts, appended to `out`.
fn charts(out: &mut String, c: &Card) {
    for ((key, title), chart) in CHARTS.iter().zip(&c.charts) {
        let note = match *key {
            "throughput" => "messages the broker confirmed, per second",
            "failures" => {
                "per 10 s: <i class=\"sw msg\"></i>message-level <i class=\"sw conn\"></i>connection-level"
            }
            _ => "age of the oldest row that could be published now",
        };
        let _ = write!(
            out,
            "<figure class=\"chart-box\" data-chart=\"{key}\"><figcaption><span class=\"title\">{title}</span><span class=\"cap\" data-cap>{}</span></figcaption>\
             <div class=\"plot\"><span class=\"scale\" data-scale>{}</span><div class=\"svg\" data-svg>{}</div></div>\
             <div class=\"xaxis\" aria-hidden=\"true\"><span>−15 min</span><span>−10</span><span>−5</span><span>now</span></div>\
             <p class=\"note\">{note}</p></figure>",
            escape(&chart.caption),
            escape(&chart.scale),
            chart.svg
        );
    }
}

fn value_raw(values: &[(&'static str, String)], k: &str) -> String {
    values
        .iter()
        .find(|(key, _)| *key == k)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

/// One page of an outbox's dead letters.
#[derive(Debug, Clone)]
pub struct DeadLetters<'a> {
    /// The outbox's name.
    pub outbox: &'a str,
    /// The page shown, from 1.
    pub page: i64,
    /// Dead letters in the outbox (up to the count cap).
    pub total: i64,
    /// The page's rows.
    pub rows: &'a [DeadLetterRow],
    /// Whether retry and discard are on.
    pub actions: bool,
    /// Whether payloads and headers are shown.
    pub show_payloads: bool,
}

impl DeadLetters<'_> {
    /// Pages in all (at least 1).
    pub fn pages(&self) -> i64 {
        ((self.total + PER_PAGE - 1) / PER_PAGE).max(1)
    }

    /// The page's headline: `3 dead letters` (`100,000+` past the cap).
    pub fn total_text(&self) -> String {
        if self.total >= COUNT_CAP {
            format!("{} dead letters", capped(self.total))
        } else {
            plural(self.total, "dead letter")
        }
    }

    /// `Page 1 of 3`.
    pub fn page_text(&self) -> String {
        format!("Page {} of {}", count(self.page), count(self.pages()))
    }

    fn href(&self, page: i64) -> String {
        format!(
            "/outboxes/{}/dead-letters?page={page}",
            path_segment(self.outbox)
        )
    }

    fn api(&self, tail: &str) -> String {
        format!(
            "/api/outboxes/{}/dead-letters{tail}",
            path_segment(self.outbox)
        )
    }
}

/// The dead-letter page's main content.
pub fn dead_letters(d: &DeadLetters<'_>) -> String {
    let mut out = format!(
        "<nav class=\"crumbs\" aria-label=\"Breadcrumb\"><a href=\"/\">Overview</a> › outbox {name}</nav>\
         <h1>Dead letters <span class=\"muted\">· {name}</span></h1>\
         <div class=\"toolbar\"><strong data-k=\"total\">{total}</strong>",
        name = escape(d.outbox),
        total = escape(&d.total_text()),
    );
    if d.actions {
        let _ = write!(
            out,
            "<span class=\"bulk\">{}{}</span>",
            action_button(
                "Retry all",
                &d.api("/retry-all"),
                &format!(
                    "Retry every dead letter of outbox {}? They go back to pending with their attempts reset and are published again, in order.",
                    d.outbox
                ),
                false
            ),
            action_button(
                "Discard all",
                &d.api("/discard-all"),
                &format!(
                    "Discard every dead letter of outbox {}? The rows are deleted: consumers will never receive these events.",
                    d.outbox
                ),
                true
            )
        );
    }
    out.push_str("</div>");
    let _ = write!(
        out,
        "<p class=\"muted small\">Oldest first. Open a row to see its whole error{}{}.</p>",
        if d.show_payloads {
            ", its payload and its headers"
        } else {
            " (payloads and headers are hidden: console.show_payloads = false)"
        },
        if d.actions {
            ", and to retry or discard it"
        } else {
            ""
        }
    );
    let _ = write!(
        out,
        "<div class=\"dl-head\" aria-hidden=\"true\"><span>Id</span><span>Aggregate</span><span>Event type</span><span>Attempts</span><span>Last error</span><span>Created</span></div>\
         <ul class=\"dl-list\" id=\"dl-list\" aria-label=\"Dead letters\">{}</ul>",
        dead_letter_items(d)
    );
    out.push_str(&pager(d));
    out
}

fn pager(d: &DeadLetters<'_>) -> String {
    let prev = if d.page > 1 {
        format!(
            "<a rel=\"prev\" href=\"{}\">‹ Previous</a>",
            escape(&d.href(d.page - 1))
        )
    } else {
        "<span class=\"muted\">‹ Previous</span>".to_owned()
    };
    let next = if d.page < d.pages() {
        format!(
            "<a rel=\"next\" href=\"{}\">Next ›</a>",
            escape(&d.href(d.page + 1))
        )
    } else {
        "<span class=\"muted\">Next ›</span>".to_owned()
    };
    format!(
        "<nav class=\"pager\" aria-label=\"Pages\">{prev}<span data-k=\"pageinfo\">{}</span>{next}</nav>",
        escape(&d.page_text())
    )
}

fn action_button(label: &str, url: &str, question: &str, danger: bool) -> String {
    format!(
        "<button type=\"button\" class=\"{}\" data-action=\"{}\" data-confirm=\"{}\">{}</button>",
        if danger { "danger" } else { "primary" },
        escape(url),
        escape(question),
        escape(label)
    )
}

/// The list items of a dead-letter page (what the script swaps in when the list changes).
pub fn dead_letter_items(d: &DeadLetters<'_>) -> String {
    if d.rows.is_empty() {
        return "<li class=\"empty\">No dead letters in this outbox.</li>".to_owned();
    }
    let mut out = String::new();
    for row in d.rows {
        let r = &row.letter;
        let id = r.id.to_string();
        let aggregate = match &r.aggregate_id {
            Some(a) => format!("{} / {}", r.aggregate_type, a),
            None => r.aggregate_type.clone(),
        };
        let error = r
            .last_error
            .as_deref()
            .map(crate::redact::redact_url)
            .unwrap_or_default();
        let _ = write!(
            out,
            "<li class=\"dl\" data-id=\"{id}\"><details><summary>\
               <span class=\"c id\" data-label=\"Id\"><code>{short}</code></span>\
               <span class=\"c agg\" data-label=\"Aggregate\">{aggregate}</span>\
               <span class=\"c ev\" data-label=\"Event type\">{event}</span>\
               <span class=\"c att\" data-label=\"Attempts\">{attempts}</span>\
               <span class=\"c err\" data-label=\"Last error\" data-field=\"last_error\">{error}</span>\
               <span class=\"c at\" data-label=\"Created\">{created}</span>\
             </summary><div class=\"body\">\
               <dl class=\"props\"><dt>Id</dt><dd><code>{id}</code> · <a href=\"/messages?id={id}\">look up</a></dd>\
               <dt>Last error</dt><dd><pre class=\"wrap-text\">{error}</pre></dd></dl>",
            short = &id[..8],
            aggregate = escape(&aggregate),
            event = escape(&r.event_type),
            attempts = r.attempts,
            error = escape(&error),
            created = time(r.created_at),
        );
        out.push_str(&payload_blocks(
            row.payload.as_deref(),
            row.headers.as_deref(),
            d.show_payloads,
        ));
        if d.actions {
            out.push_str(&dead_letter_buttons(d, &id));
        }
        out.push_str("</div></details></li>");
    }
    out
}

/// A dead letter's Retry and Discard buttons.
fn dead_letter_buttons(d: &DeadLetters<'_>, id: &str) -> String {
    let base = format!("/{id}");
    format!(
        "<div class=\"buttons\">{}{}</div>",
        action_button(
            "Retry",
            &d.api(&format!("{base}/retry")),
            &format!(
                "Retry dead letter {id} of outbox {}? It goes back to pending with its attempts reset and is published again.",
                d.outbox
            ),
            false
        ),
        action_button(
            "Discard",
            &d.api(&format!("{base}/discard")),
            &format!(
                "Discard dead letter {id} of outbox {}? The row is deleted: consumers will never receive this event.",
                d.outbox
            ),
            true
        )
    )
}

/// The payload and headers blocks, or the note that they are hidden.
fn payload_blocks(payload: Option<&[u8]>, headers: Option<&[u8]>, show: bool) -> String {
    if !show {
        return "<p class=\"muted hidden-payload\">Payload and headers hidden (console.show_payloads = false).</p>".to_owned();
    }
    let mut out = String::new();
    for (title, field, bytes) in [
        ("Payload", "payload", payload),
        ("Headers", "headers", headers),
    ] {
        let Some(bytes) = bytes else { continue };
        let s = shown(bytes);
        let _ = write!(
            out,
            "<h3>{title} <span class=\"muted small\">{} · {}{}</span></h3><pre class=\"code\" data-field=\"{field}\" tabindex=\"0\">{}</pre>",
            s.kind,
            plural(s.bytes as i64, "byte"),
            if s.truncated { " · cut" } else { "" },
            escape(&s.text)
        );
    }
    out
}

/// A message found by the lookup, in one outbox.
#[derive(Debug, Clone)]
pub struct Found {
    /// The outbox whose table holds it.
    pub outbox: String,
    /// The row.
    pub row: MessageRow,
}

/// The lookup page's main content: the form, then the message (or `notice`).
pub fn message(query: &str, body: &str) -> String {
    format!(
        "<h1>Message lookup</h1>\
         <form class=\"lookup-big\" action=\"/messages\" method=\"get\">\
           <label for=\"message-id\">Message id (the row's <code>id</code>, a UUID)</label>\
           <div class=\"row\"><input id=\"message-id\" name=\"id\" value=\"{}\" autocomplete=\"off\" spellcheck=\"false\"><button>Look up</button></div>\
         </form><div id=\"message-body\">{body}</div>",
        escape(query)
    )
}

/// What the lookup shows of the rows found (the script swaps it in on each refresh).
pub fn message_body(found: &[Found], show_payloads: bool) -> String {
    found
        .iter()
        .map(|f| message_section(f, show_payloads))
        .collect()
}

/// When a row was sent, and how long after it was created ("—" while unsent).
fn sent_text(r: &MessageRow) -> String {
    match r.sent_at {
        Some(at) => {
            let after = (at - r.created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
            format!("{} · {} after it was created", time(at), duration(after))
        }
        None => "—".to_owned(),
    }
}

/// When a row was claimed and by which relay ("—" when it is not).
fn claimed_text(r: &MessageRow) -> String {
    match (&r.locked_at, &r.locked_by) {
        (Some(at), Some(by)) => format!("{} by {}", time(*at), escape(by)),
        (Some(at), None) => time(*at),
        _ => "—".to_owned(),
    }
}

/// A dead letter's link to its outbox's dead-letter page (empty for other rows).
fn dead_letters_link(f: &Found) -> String {
    if f.row.status != "failed" {
        return String::new();
    }
    format!(
        " · <a href=\"/outboxes/{}/dead-letters\">dead letters of this outbox</a>",
        escape(&path_segment(&f.outbox))
    )
}

/// One message found by the lookup: its fields, payload and headers.
fn message_section(f: &Found, show_payloads: bool) -> String {
    let r = &f.row;
    let opt_time = |t: Option<DateTime<Utc>>| t.map(time).unwrap_or_else(|| "—".to_owned());
    let error = r
        .last_error
        .as_deref()
        .map(crate::redact::redact_url)
        .unwrap_or_else(|| "—".to_owned());
    let aggregate = match &r.aggregate_id {
        Some(a) => format!("{} / {}", r.aggregate_type, a),
        None => format!("{} (no aggregate id: unordered)", r.aggregate_type),
    };
    let mut out = format!(
        "<section class=\"message\" data-outbox=\"{outbox}\"><h2>In outbox {outbox} <span class=\"badge status {status}\" data-field=\"status\">{status}</span></h2>\
         <dl class=\"props\">\
           <dt>Id</dt><dd><code>{id}</code>{dead_letters}</dd>\
           <dt>Aggregate</dt><dd>{aggregate}</dd>\
           <dt>Event type</dt><dd>{event}</dd>\
           <dt>Attempts</dt><dd data-field=\"attempts\">{attempts}</dd>\
           <dt>Last error</dt><dd data-field=\"last_error\"><span class=\"wrap-text\">{error}</span></dd>\
           <dt>Created</dt><dd data-field=\"created_at\">{created}</dd>\
           <dt>Available</dt><dd data-field=\"available_at\">{available}</dd>\
           <dt>Claimed</dt><dd data-field=\"locked_at\">{locked}</dd>\
           <dt>Sent</dt><dd data-field=\"sent_at\">{sent}</dd>\
           <dt>Expires</dt><dd data-field=\"expires_at\">{expires}</dd>\
           <dt>Destination</dt><dd>{destination}</dd>\
           <dt>Seq</dt><dd>{seq}</dd>\
         </dl>",
        outbox = escape(&f.outbox),
        status = escape(&r.status),
        id = r.id,
        aggregate = escape(&aggregate),
        event = escape(&r.event_type),
        attempts = r.attempts,
        error = escape(&error),
        created = time(r.created_at),
        dead_letters = dead_letters_link(f),
        available = time(r.available_at),
        locked = claimed_text(r),
        sent = sent_text(r),
        expires = opt_time(r.expires_at),
        destination = r
            .destination
            .as_deref()
            .map(escape)
            .unwrap_or_else(|| "— (the routing template)".to_owned()),
        seq = r.seq,
    );
    out.push_str(&payload_blocks(
        r.payload.as_deref(),
        r.headers.as_deref(),
        show_payloads,
    ));
    out.push_str("</section>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped_for_content_and_attributes() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(path_segment("app.events/ü x"), "app.events%2F%C3%BC%20x");
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(-1_234_567), "-1,234,567");
        assert_eq!(capped(COUNT_CAP - 1), "99,999");
        assert_eq!(capped(COUNT_CAP), "100,000+");
        assert_eq!(plural(1, "dead letter"), "1 dead letter");
        assert_eq!(plural(1200, "byte"), "1,200 bytes");
        assert_eq!(plural(2, "outbox"), "2 outboxes");
        assert_eq!(rate(0.0), "0/s");
        assert_eq!(rate(3.46), "3.5/s");
        assert_eq!(rate(1234.4), "1,234/s");
    }

    #[test]
    fn durations_keep_two_units_at_most() {
        assert_eq!(duration(0.0), "0 s");
        assert_eq!(duration(f64::NAN), "0 s");
        assert_eq!(duration(0.0174), "17 ms");
        assert_eq!(duration(0.9996), "1.0 s");
        assert_eq!(duration(3.24), "3.2 s");
        assert_eq!(duration(42.4), "42 s");
        assert_eq!(duration(250.0), "4 min 10 s");
        assert_eq!(duration(7380.0), "2 h 3 min");
        assert_eq!(duration(3.0 * 86_400.0 + 4.0 * 3600.0), "3 d 4 h");
    }

    #[test]
    fn times_carry_the_exact_instant() {
        let t = DateTime::parse_from_rfc3339("2026-03-01T09:08:07.123456Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(
            time(t),
            "<time datetime=\"2026-03-01T09:08:07.123456Z\">2026-03-01 09:08:07.123 UTC</time>"
        );
    }

    #[test]
    fn payloads_are_pretty_printed_or_dumped() {
        let j = shown(br#"{"total":99.50,"items":[1,2]}"#);
        assert_eq!(j.kind, "JSON");
        assert_eq!(
            j.text,
            "{\n  \"items\": [\n    1,\n    2\n  ],\n  \"total\": 99.50\n}"
        );
        let t = shown("plain é".as_bytes());
        assert_eq!((t.kind, t.text.as_str()), ("text", "plain é"));
        let b = shown(&[0xff, 0x00, b'A', b'z']);
        assert_eq!(b.kind, "binary");
        assert!(b.text.starts_with("00000000  ff 00 41 7a"), "{}", b.text);
        assert!(b.text.trim_end().ends_with("..Az"), "{}", b.text);
        let big = shown("x".repeat(MAX_SHOWN_BYTES + 10).as_bytes());
        assert!(big.truncated && big.text.len() == MAX_SHOWN_BYTES);
        assert_eq!(big.bytes, MAX_SHOWN_BYTES + 10);
    }

    #[test]
    fn pages_count_from_one_and_round_up() {
        let d = |total| DeadLetters {
            outbox: "o",
            page: 1,
            total,
            rows: &[],
            actions: false,
            show_payloads: true,
        };
        assert_eq!(d(0).pages(), 1);
        assert_eq!(d(PER_PAGE).pages(), 1);
        assert_eq!(d(PER_PAGE + 1).pages(), 2);
        assert_eq!(d(1).total_text(), "1 dead letter");
        assert_eq!(d(COUNT_CAP).total_text(), "100,000+ dead letters");
        assert!(dead_letter_items(&d(0)).contains("No dead letters"));
    }

    #[test]
    fn hidden_payloads_say_so_and_show_nothing() {
        let html = payload_blocks(Some(b"{\"secret\":1}"), Some(b"{}"), false);
        assert!(html.contains("hidden") && !html.contains("secret"));
        let html = payload_blocks(Some(b"{\"a\":\"<b>\"}"), Some(b"{}"), true);
        assert!(html.contains("&lt;b&gt;") && html.contains("data-field=\"headers\""));
    }
}
