//! The console's HTTP side: the pages, the JSON their script polls, the retry and discard
//! POSTs (token checked, refusals logged at most once a minute) and the embedded assets.
//!
//! Bad input never reaches a 500: an unknown outbox, a page past the last, an id that is not a
//! UUID or a database that does not answer each get a page (or JSON) that says what is wrong.

use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use uuid::Uuid;

use super::chart::{self, Chart};
use super::history::Point;
use super::render::{self, Card, DeadLetters, Found, Layout, Notice, PER_PAGE};
use super::{Console, View, within};
use crate::store::{PageRequest, Selection, StoreError};

/// How often a refused action may be logged (the rest are counted into the next line).
pub(super) const REFUSALS_LOGGED_EVERY: Duration = Duration::from_secs(60);

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");

/// What a page may load: its own stylesheet and script, and nothing from elsewhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; style-src 'self'; script-src 'self'; \
     connect-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

type Shared = Arc<Console>;

/// The console's routes on `console`.
pub(super) fn router(console: Shared) -> Router {
    Router::new()
        .route("/", get(overview_page))
        .route("/outboxes/{outbox}/dead-letters", get(dead_letters_page))
        .route("/messages", get(message_page))
        .route("/api/overview", get(overview_json))
        .route(
            "/api/outboxes/{outbox}/dead-letters",
            get(dead_letters_json),
        )
        .route("/api/messages/{id}", get(message_json))
        .route(
            "/api/outboxes/{outbox}/dead-letters/{action}",
            post(act_on_all),
        )
        .route(
            "/api/outboxes/{outbox}/dead-letters/{id}/{action}",
            post(act_on_one),
        )
        .route("/assets/console.css", get(|| asset(CSS, "text/css")))
        .route("/assets/console.js", get(|| asset(JS, "text/javascript")))
        .fallback(not_found)
        .with_state(console)
}

/// At most one admission per `every`; counts the refusals in between.
#[derive(Debug)]
pub(super) struct RateLimit {
    every: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl RateLimit {
    pub(super) fn new(every: Duration) -> Self {
        Self {
            every,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(events not admitted since the last admission)` when this event may be logged
    /// at `now`; `None` (and counted) otherwise.
    pub(super) fn admit(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.every)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Why a request could not be answered as asked.
#[derive(Debug)]
enum Problem {
    /// 400: the input is malformed.
    BadInput(Notice),
    /// 404: nothing by that name or id, or a page past the last.
    NotFound(Notice),
    /// 503: the database did not answer.
    Unavailable(Notice),
}

impl Problem {
    fn parts(&self) -> (StatusCode, &Notice) {
        match self {
            Self::BadInput(n) => (StatusCode::BAD_REQUEST, n),
            Self::NotFound(n) => (StatusCode::NOT_FOUND, n),
            Self::Unavailable(n) => (StatusCode::SERVICE_UNAVAILABLE, n),
        }
    }

    fn database(outbox: &str, e: &dyn std::fmt::Display) -> Self {
        Self::Unavailable(Notice {
            title: format!("The database of outbox {outbox} did not answer"),
            text: format!("{e}. The page retries on its own; the relay reconnects by itself."),
            links: vec![("Overview".into(), "/".into())],
        })
    }
}

fn security_headers(h: &mut HeaderMap) {
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
}

fn html(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    security_headers(h);
    r
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    security_headers(h);
    r
}

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

impl Console {
    fn layout<'a>(&'a self, title: &'a str, page: &'static str, api: Option<String>) -> Layout<'a> {
        Layout {
            title,
            page,
            api,
            instance: &self.instance,
            actions: self.config.actions_token.is_some(),
        }
    }

    fn problem_page(&self, problem: &Problem) -> Response {
        let (status, notice) = problem.parts();
        let layout = self.layout(&notice.title, "notice", None);
        html(status, render::page(&layout, &render::notice(notice)))
    }

    fn unknown_outbox(&self, name: &str) -> Problem {
        let names: Vec<String> = self.views().iter().map(|v| v.name.clone()).collect();
        Problem::NotFound(Notice {
            title: format!("No outbox named {name:?}"),
            text: if names.is_empty() {
                "No outbox has started yet.".to_owned()
            } else {
                format!("This relay serves: {}.", names.join(", "))
            },
            links: vec![("Overview".into(), "/".into())],
        })
    }

    async fn cards(&self) -> Vec<Card> {
        let views = self.views();
        let cards = views.iter().map(|v| async move {
            let counts = v.counts().await.map_err(|e| e.to_string());
            card_of(v, counts)
        });
        futures::future::join_all(cards).await
    }
}

/// One outbox's card from its figures, counts and history.
fn card_of(v: &View, counts: Result<crate::store::ConsoleCounts, String>) -> Card {
    let now = Instant::now();
    let points = v
        .history
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .points(now);
    Card {
        name: v.name.clone(),
        table: v.table.clone(),
        database: v.database.clone(),
        database_up: v.database_health.get(),
        database_problem: v.database_health.problem(),
        backlog: v
            .metrics
            .last_backlog()
            .map(|(at, b)| (now.saturating_duration_since(at).as_secs_f64(), b)),
        counts,
        charts: charts(&points),
        dead_lettered_recently: points.iter().map(|p| p.dead_lettered).sum(),
    }
}

/// Throughput, failures and lag over the points of a history.
fn charts(points: &[Point]) -> [Chart; 3] {
    let throughput: Vec<_> = points.iter().map(|p| (p.ago, Some(p.per_second))).collect();
    let failures: Vec<_> = points
        .iter()
        .map(|p| (p.ago, p.message_failures, p.connection_failures))
        .collect();
    let lag: Vec<_> = points.iter().map(|p| (p.ago, p.lag)).collect();
    let sum = |f: fn(&Point) -> u64| points.iter().map(f).sum::<u64>();
    let caption = if points.is_empty() {
        "collecting (a point every 10 s)".to_owned()
    } else {
        format!(
            "15 min: {} message, {} connection",
            render::count(sum(|p| p.message_failures) as i64),
            render::count(sum(|p| p.connection_failures) as i64),
        )
    };
    [
        chart::line("Throughput", &throughput, 1.0, render::rate),
        chart::bars("Failures", &failures, ("msg", "conn"), caption),
        chart::line("Lag", &lag, 10.0, render::duration),
    ]
}

fn card_json(c: &Card) -> Value {
    let values: serde_json::Map<String, Value> = render::card_values(c)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Value::String(v)))
        .collect();
    let flags: serde_json::Map<String, Value> = render::card_flags(c)
        .into_iter()
        .map(|(k, v)| (k.to_owned(), Value::Bool(v)))
        .collect();
    let charts: serde_json::Map<String, Value> = render::CHARTS
        .iter()
        .zip(&c.charts)
        .map(|((key, _), ch)| {
            (
                (*key).to_owned(),
                json!({ "svg": ch.svg, "scale": ch.scale, "caption": ch.caption }),
            )
        })
        .collect();
    json!({ "name": c.name, "values": values, "flags": flags, "charts": charts })
}

async fn overview_page(State(c): State<Shared>) -> Response {
    let cards = c.cards().await;
    let publisher = c.publisher.get().map(String::as_str).unwrap_or("");
    let main = render::overview(c.health.broker(), publisher, &cards);
    let layout = c.layout("Overview", "overview", Some("/api/overview".into()));
    html(StatusCode::OK, render::page(&layout, &main))
}

async fn overview_json(State(c): State<Shared>) -> Response {
    let cards = c.cards().await;
    let broker = c.health.broker();
    let body = json!({
        "broker": { "up": broker, "text": render::broker_text(broker) },
        "outboxes": cards.iter().map(card_json).collect::<Vec<_>>(),
    });
    json_response(StatusCode::OK, &body)
}

/// The value of `key` in a query string.
fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    url::form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.into_owned())
}

/// The page number asked for (1 when none), or the notice that it is not one.
fn page_number(query: Option<&str>, outbox: &str) -> Result<i64, Problem> {
    let Some(raw) = query_value(query, "page") else {
        return Ok(1);
    };
    match raw.trim().parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(Problem::BadInput(Notice {
            title: "Not a page number".into(),
            text: format!("{raw:?} is not a page number: pages are counted from 1."),
            links: vec![(
                "First page".into(),
                format!(
                    "/outboxes/{}/dead-letters?page=1",
                    render::path_segment(outbox)
                ),
            )],
        })),
    }
}

/// What a dead-letter page shows: its rows and count, read in one statement.
struct DeadLetterData {
    page: i64,
    total: i64,
    rows: Vec<crate::store::DeadLetterRow>,
}

async fn dead_letter_data(
    c: &Console,
    outbox: &str,
    query: Option<&str>,
) -> Result<(Arc<View>, DeadLetterData), Problem> {
    let view = c.view(outbox).ok_or_else(|| c.unknown_outbox(outbox))?;
    let page = page_number(query, outbox)?;
    let read = within(view.store.dead_letter_page(PageRequest {
        page: page - 1,
        per_page: PER_PAGE,
        show_payloads: c.config.show_payloads,
    }))
    .await
    .map_err(|e| Problem::database(outbox, &e))?;
    let pages = ((read.total + PER_PAGE - 1) / PER_PAGE).max(1);
    if page > pages {
        let first = format!(
            "/outboxes/{}/dead-letters?page=1",
            render::path_segment(outbox)
        );
        return Err(Problem::NotFound(Notice {
            title: format!("Page {page} is past the last page"),
            text: format!(
                "Outbox {outbox} has {} ({}).",
                render::plural(read.total, "dead letter"),
                render::plural(pages, "page")
            ),
            links: vec![
                ("First page".into(), first),
                ("Overview".into(), "/".into()),
            ],
        }));
    }
    Ok((
        view,
        DeadLetterData {
            page,
            total: read.total,
            rows: read.rows,
        },
    ))
}

impl Console {
    fn dead_letters_view<'a>(&self, outbox: &'a str, d: &'a DeadLetterData) -> DeadLetters<'a> {
        DeadLetters {
            outbox,
            page: d.page,
            total: d.total,
            rows: &d.rows,
            actions: self.config.actions_token.is_some(),
            show_payloads: self.config.show_payloads,
        }
    }
}

/// Answers a request for a dead-letter page: `answer` with what the page shows, `problem` with
/// what is wrong (an unknown outbox, a bad or past page number, the database).
async fn on_dead_letters(
    c: &Console,
    outbox: &str,
    query: Option<&str>,
    answer: impl FnOnce(&DeadLetters<'_>) -> Response,
    problem: impl FnOnce(&Problem) -> Response,
) -> Response {
    match dead_letter_data(c, outbox, query).await {
        Ok((view, data)) => answer(&c.dead_letters_view(&view.name, &data)),
        Err(p) => problem(&p),
    }
}

async fn dead_letters_page(
    State(c): State<Shared>,
    Path(outbox): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let answer = |d: &DeadLetters<'_>| {
        let api = format!(
            "/api/outboxes/{}/dead-letters?page={}",
            render::path_segment(d.outbox),
            d.page
        );
        let title = format!("Dead letters · {}", d.outbox);
        let layout = c.layout(&title, "dead-letters", Some(api));
        html(
            StatusCode::OK,
            render::page(&layout, &render::dead_letters(d)),
        )
    };
    on_dead_letters(&c, &outbox, query.as_deref(), answer, |p| c.problem_page(p)).await
}

fn problem_json(p: &Problem) -> Response {
    let (status, n) = p.parts();
    json_response(
        status,
        &json!({ "error": format!("{} — {}", n.title, n.text) }),
    )
}

async fn dead_letters_json(
    State(c): State<Shared>,
    Path(outbox): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let answer = |d: &DeadLetters<'_>| {
        let body = json!({
            "values": { "total": d.total_text(), "pageinfo": d.page_text() },
            "items": render::dead_letter_items(d),
        });
        json_response(StatusCode::OK, &body)
    };
    on_dead_letters(&c, &outbox, query.as_deref(), answer, problem_json).await
}

/// The id asked for, or the notice that it is not a UUID.
fn message_id(raw: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(raw.trim()).map_err(|_| {
        Problem::BadInput(Notice {
            title: "Not a message id".into(),
            text: format!(
                "{raw:?} is not a message id: ids are UUIDs such as 0193a4c2-5f0e-4c1b-9d7e-2b8f6a1c3e5d (the row's id column; consumers see it as the message id)."
            ),
            links: vec![("Overview".into(), "/".into())],
        })
    })
}

/// Every outbox's row with `id`; a database that did not answer is a problem only when no
/// outbox had the row.
async fn find(c: &Console, id: Uuid) -> Result<Vec<Found>, Problem> {
    let views = c.views();
    let lookups = views.iter().map(|v| async move {
        (
            v.name.clone(),
            within(v.store.console_message(id, c.config.show_payloads)).await,
        )
    });
    let mut found = Vec::new();
    let mut failed = None;
    for (outbox, result) in futures::future::join_all(lookups).await {
        match result {
            Ok(Some(row)) => found.push(Found { outbox, row }),
            Ok(None) => {}
            Err(e) => failed = Some(Problem::database(&outbox, &e)),
        }
    }
    match (found.is_empty(), failed) {
        (false, _) => Ok(found),
        (true, Some(p)) => Err(p),
        (true, None) => Err(Problem::NotFound(Notice {
            title: "No such message".into(),
            text: format!(
                "No outbox has a row with id {id} ({} searched). Sent and expired rows are deleted after cleanup.retention, and discarded dead letters are gone.",
                render::plural(views.len() as i64, "outbox")
            ),
            links: vec![("Overview".into(), "/".into())],
        })),
    }
}

async fn message_page(State(c): State<Shared>, RawQuery(query): RawQuery) -> Response {
    let raw = query_value(query.as_deref(), "id").unwrap_or_default();
    if raw.trim().is_empty() {
        let body = "<p class=\"muted\">Enter a message id to see its status, attempts, last error, timestamps and payload.</p>";
        let layout = c.layout("Message lookup", "message", None);
        return html(
            StatusCode::OK,
            render::page(&layout, &render::message("", body)),
        );
    }
    let result = match message_id(&raw) {
        Ok(id) => find(&c, id).await.map(|f| (id, f)),
        Err(p) => Err(p),
    };
    match result {
        Ok((id, found)) => {
            let body = render::message_body(&found, c.config.show_payloads);
            let title = format!("Message {id}");
            let layout = c.layout(&title, "message", Some(format!("/api/messages/{id}")));
            html(
                StatusCode::OK,
                render::page(&layout, &render::message(&raw, &body)),
            )
        }
        Err(p) => {
            let (status, notice) = p.parts();
            let layout = c.layout(&notice.title, "message", None);
            let body = render::notice(notice);
            html(status, render::page(&layout, &render::message(&raw, &body)))
        }
    }
}

async fn message_json(State(c): State<Shared>, Path(raw): Path<String>) -> Response {
    let result = match message_id(&raw) {
        Ok(id) => find(&c, id).await,
        Err(p) => Err(p),
    };
    match result {
        Ok(found) => json_response(
            StatusCode::OK,
            &json!({ "html": render::message_body(&found, c.config.show_payloads) }),
        ),
        Err(p) => problem_json(&p),
    }
}

/// 404 for any other path: JSON under `/api/` (a script reads it), a page elsewhere.
async fn not_found(State(c): State<Shared>, uri: axum::http::Uri) -> Response {
    let path = uri.path();
    if path == "/api" || path.starts_with("/api/") {
        return problem_json(&Problem::NotFound(Notice {
            title: "No such endpoint".into(),
            text: format!(
                "The console has no endpoint at {path}: see docs/console.md for the JSON it serves."
            ),
            links: Vec::new(),
        }));
    }
    c.problem_page(&Problem::NotFound(Notice {
        title: "No such page".into(),
        text: format!("The console has no page at {path}."),
        links: vec![("Overview".into(), "/".into())],
    }))
}

/// A dead-letter action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    Retry,
    Discard,
}

impl Action {
    fn done(self) -> &'static str {
        match self {
            Self::Retry => "retried",
            Self::Discard => "discarded",
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value, the scheme's name in any case
/// (RFC 9110 §11.1), surrounding blanks trimmed.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Bytes equal in time independent of where they differ (the token is compared this way).
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Console {
    /// `None` when the request carries the console token and actions are on; else the 403
    /// answer (logged at most once a minute, never with what the request carried).
    fn authorize(&self, headers: &HeaderMap, what: &str) -> Option<Response> {
        let reason = match &self.config.actions_token {
            None => {
                "dead-letter actions are off: set console.allow_actions = true and console.token to enable them"
            }
            Some(token) => {
                let sent = headers.get(header::AUTHORIZATION);
                match sent.and_then(|v| v.to_str().ok()).and_then(bearer_token) {
                    Some(g) if same_secret(g.as_bytes(), token.0.trim().as_bytes()) => return None,
                    Some(_) => "wrong console token",
                    None if sent.is_some() => {
                        "the Authorization header is not a Bearer token (send Authorization: Bearer <console.token>)"
                    }
                    None => "no console token (send Authorization: Bearer <console.token>)",
                }
            }
        };
        let logged = self
            .refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(Instant::now());
        if let Some(unlogged) = logged {
            tracing::warn!(
                request = what,
                reason,
                refused_since_last_warning = unlogged,
                "console: refused a dead-letter action (403)"
            );
        }
        Some(json_response(
            StatusCode::FORBIDDEN,
            &json!({ "error": format!("Refused: {reason}.") }),
        ))
    }

    async fn act(
        &self,
        outbox: &str,
        target: Option<&str>,
        action: &str,
        headers: &HeaderMap,
    ) -> Response {
        let what = format!("{action} {} of outbox {outbox}", target.unwrap_or("all"));
        if let Some(refused) = self.authorize(headers, &what) {
            return refused;
        }
        let action = match (action, target) {
            ("retry", Some(_)) | ("retry-all", None) => Action::Retry,
            ("discard", Some(_)) | ("discard-all", None) => Action::Discard,
            _ => {
                return json_response(
                    StatusCode::NOT_FOUND,
                    &json!({ "error": format!("No action {action:?}: the actions are retry, discard, retry-all and discard-all.") }),
                );
            }
        };
        let Some(view) = self.view(outbox) else {
            return problem_json(&self.unknown_outbox(outbox));
        };
        let selection = match target.map(message_id).transpose() {
            Ok(Some(id)) => Selection::Ids(vec![id]),
            Ok(None) => Selection::All,
            Err(p) => return problem_json(&p),
        };
        let result = match action {
            Action::Retry => view.store.retry_dead_letters(&selection).await,
            Action::Discard => view.store.discard_dead_letters(&selection).await,
        };
        match result {
            Ok(ids) => {
                let shown: Vec<String> = ids.iter().take(20).map(ToString::to_string).collect();
                tracing::info!(
                    outbox = %view.name,
                    action = action.done(),
                    count = ids.len(),
                    ids = %shown.join(","),
                    "console: dead letters {}", action.done()
                );
                view.refresh().await;
                let message = done_message(action, &selection, &ids, &view.name);
                json_response(
                    StatusCode::OK,
                    &json!({ "message": message, "count": ids.len() }),
                )
            }
            Err(StoreError::NotDeadLetters(ids)) => json_response(
                StatusCode::CONFLICT,
                &json!({ "error": format!(
                    "{} is not a dead letter (any more): it was retried, discarded or never failed. Nothing was changed.",
                    ids.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                ) }),
            ),
            Err(e) => problem_json(&Problem::database(&view.name, &e)),
        }
    }
}

/// What the page says after `action` changed `ids` of `outbox`.
fn done_message(action: Action, selection: &Selection, ids: &[Uuid], outbox: &str) -> String {
    match (selection, ids) {
        (Selection::Ids(_), [id]) => match action {
            Action::Retry => format!("Retried {id}: it is pending again and will be published."),
            Action::Discard => format!("Discarded {id}: the row is deleted."),
        },
        _ => format!(
            "{} {} of outbox {outbox}.",
            match action {
                Action::Retry => "Retried",
                Action::Discard => "Discarded",
            },
            render::plural(ids.len() as i64, "dead letter"),
        ),
    }
}

async fn act_on_one(
    State(c): State<Shared>,
    Path((outbox, id, action)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    c.act(&outbox, Some(&id), &action, &headers).await
}

async fn act_on_all(
    State(c): State<Shared>,
    Path((outbox, action)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    c.act(&outbox, None, &action, &headers).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_admitted_once_a_minute_and_counted_between() {
        let t0 = Instant::now();
        let mut r = RateLimit::new(REFUSALS_LOGGED_EVERY);
        assert_eq!(r.admit(t0), Some(0));
        assert_eq!(r.admit(t0 + Duration::from_secs(1)), None);
        assert_eq!(r.admit(t0 + Duration::from_secs(59)), None);
        assert_eq!(r.admit(t0 + Duration::from_secs(60)), Some(2));
        assert_eq!(r.admit(t0 + Duration::from_secs(61)), None);
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_secret(b"abcdef", b"abcdef"));
        assert!(!same_secret(b"abcdef", b"abcdeg"));
        assert!(!same_secret(b"abc", b"abcdef"));
        assert!(!same_secret(b"", b"x"));
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer abc "), Some("abc"));
        assert_eq!(bearer_token("BEARER  abc"), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearerabc"), None);
    }

    #[test]
    fn page_numbers_count_from_one() {
        assert_eq!(page_number(None, "o").ok(), Some(1));
        assert_eq!(page_number(Some("page=3"), "o").ok(), Some(3));
        for bad in ["page=0", "page=-2", "page=abc", "page="] {
            let Err(Problem::BadInput(n)) = page_number(Some(bad), "o") else {
                panic!("{bad} accepted")
            };
            assert!(n.text.contains("pages are counted from 1"), "{}", n.text);
        }
    }

    #[test]
    fn ids_must_be_uuids() {
        assert!(message_id(" 0193a4c2-5f0e-4c1b-9d7e-2b8f6a1c3e5d ").is_ok());
        let Err(Problem::BadInput(n)) = message_id("42") else {
            panic!("42 accepted")
        };
        assert!(
            n.text.starts_with("\"42\" is not a message id"),
            "{}",
            n.text
        );
    }
}
