//! The web console's cost to a drain (`--only console`): the relay process drains N rows from
//! PostgreSQL to RabbitMQ (ordering `aggregate`, the relay's default) with its metrics server
//! and console on a loopback port, once with nobody looking ("closed") and once with a client
//! doing what an open overview page does ("open"): the page and its assets once, then the JSON
//! the page's script polls (`/api/overview`), again one second after each answer (the issue's
//! "a page refreshing every second"; the page's own script waits 3 s). Closed and open
//! alternate over [`REPETITIONS`] repetitions.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use serde_json::json;

use crate::Ctx;
use crate::util::{fill, median};

/// The figures' section.
const PHASE: &str = "17 console";

/// Closed/open pairs.
const REPETITIONS: usize = 3;

/// The wait after each answer before the next poll.
const REFRESH: Duration = Duration::from_secs(1);

/// What the page loads once, before it starts polling.
const PAGE: [&str; 3] = ["/", "/assets/console.css", "/assets/console.js"];

/// What the overview page's script polls.
const POLLED: &str = "/api/overview";

/// Closed, open, closed, open, …: each a drain of a fresh N-row table; then the medians and
/// `ratio_console_open_vs_closed`.
pub async fn console(ctx: &mut Ctx) -> Result<()> {
    let mut rates: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut errors = Vec::new();
    for rep in 1..=REPETITIONS {
        for open in [false, true] {
            let what = format!("console {} #{rep}", state(open));
            let rate = std::cell::Cell::new(f64::NAN);
            let result = ctx
                .measured(&what, async |ctx: &mut Ctx| {
                    rate.set(run(ctx, open, rep).await?);
                    Ok(())
                })
                .await;
            if let Err(e) = result {
                ctx.progress(format!("ERROR {what}: {e:#}"));
                errors.push(format!("{what}: {e:#}"));
            }
            rates[usize::from(open)].push(rate.get());
        }
    }
    let (closed, open) = (median(&rates[0]), median(&rates[1]));
    for (is_open, value) in [(false, closed), (true, open)] {
        ctx.report.figure(
            PHASE,
            &format!("console_{}_median_msgs_per_s", state(is_open)),
            &format!(
                "relay → rabbitmq, console {}: median of {REPETITIONS}",
                state(is_open)
            ),
            value,
            "msgs/s",
        );
    }
    if closed.is_finite() && open.is_finite() {
        ctx.report.figure(
            PHASE,
            "ratio_console_open_vs_closed",
            "drain with an overview page refreshing every second / without (medians)",
            open / closed,
            "×",
        );
    }
    ctx.report.detail(
        "console_rates",
        json!({"closed": rates[0], "open": rates[1], "refresh_s": REFRESH.as_secs_f64(), "polled": POLLED}),
    );
    super::all_ok(errors)
}

fn state(open: bool) -> &'static str {
    if open { "open" } else { "closed" }
}

/// One drain with the console closed or `open`; msgs/s.
async fn run(ctx: &mut Ctx, open: bool, rep: usize) -> Result<f64> {
    let key = format!("console_{}_{rep}", state(open));
    let table = ctx.new_table(&format!("con_{}", &state(open)[..1])).await?;
    let binding = ctx
        .new_binding(&format!("con_{}", &state(open)[..1]))
        .await?;
    ctx.progress(format!("{key}: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_PUBLISHER__KIND".into(), "rabbitmq".into()));
    env.push(("RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(), binding));
    env.push(("RELAY_CONSOLE__ENABLED".into(), "true".into()));
    let port = crate::with_metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());
    let page = open.then(|| Page::start(port));
    let what = format!(
        "relay → rabbitmq, ordering aggregate, run {rep}, console {}{}",
        state(open),
        if open {
            " (overview refreshed every second)"
        } else {
            ""
        }
    );
    let drained = super::drain_and_report(ctx, &key, &env, &table, (PHASE, &what)).await;
    let Some(page) = page else {
        return drained;
    };
    let seen = page.stop().await;
    let r = drained?;
    ctx.progress(format!(
        "{key}: the page loaded {} of {} files and polled {POLLED} {} times ({} failed)",
        seen.page_ok,
        PAGE.len(),
        seen.polls_ok,
        seen.failures
    ));
    let drain_s = ctx.rows as f64 / r;
    // The page must have been open during the drain: loaded, then polling (at least half
    // the polls of one a second, after two seconds' slack for the relay's start).
    if seen.page_ok < PAGE.len() as u64 || (seen.polls_ok as f64) < (drain_s - 2.0) / 2.0 {
        bail!(
            "the console client did not keep the page open: {} of {} page files, {} polls in a {drain_s:.1} s drain, {} failures",
            seen.page_ok,
            PAGE.len(),
            seen.polls_ok,
            seen.failures
        );
    }
    ctx.report.detail(
        &format!("{key}_page"),
        json!({"page_files_ok": seen.page_ok, "polls_ok": seen.polls_ok, "failures": seen.failures,
               "mean_poll_ms": seen.poll_time.as_secs_f64() * 1000.0 / seen.polls_ok.max(1) as f64}),
    );
    Ok(r)
}

/// What the page client did.
#[derive(Default)]
struct Seen {
    page_ok: u64,
    polls_ok: u64,
    failures: u64,
    /// Time spent in the polls (request to the end of the answer).
    poll_time: Duration,
}

/// A client doing what an open overview page does, in a task of its own.
struct Page {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<Seen>>,
}

impl Page {
    /// Starts it against the relay on `port`: it waits for the relay to answer (the relay
    /// is being spawned), loads the page, then polls.
    fn start(port: u16) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(Self::browse(port, Arc::clone(&stop)));
        Self { stop, task }
    }

    async fn browse(port: u16, stop: Arc<AtomicBool>) -> Result<Seen> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()?;
        let base = format!("http://127.0.0.1:{port}");
        let mut seen = Seen::default();
        // The relay's server is up once `/` answers (refused until then).
        loop {
            if stop.load(AtomicOrdering::Relaxed) {
                return Ok(seen);
            }
            if get(&http, &format!("{base}/"), "text/html").await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen.page_ok = 1;
        for path in &PAGE[1..] {
            match get(&http, &format!("{base}{path}"), "*/*").await {
                Ok(()) => seen.page_ok += 1,
                Err(_) => seen.failures += 1,
            }
        }
        while !stop.load(AtomicOrdering::Relaxed) {
            tokio::time::sleep(REFRESH).await;
            if stop.load(AtomicOrdering::Relaxed) {
                break;
            }
            let asked = std::time::Instant::now();
            match get(&http, &format!("{base}{POLLED}"), "application/json").await {
                Ok(()) => {
                    seen.polls_ok += 1;
                    seen.poll_time += asked.elapsed();
                }
                Err(_) => seen.failures += 1,
            }
        }
        Ok(seen)
    }

    /// Stops polling; what it did.
    async fn stop(self) -> Seen {
        self.stop.store(true, AtomicOrdering::Relaxed);
        match self.task.await {
            Ok(Ok(seen)) => seen,
            Ok(Err(e)) => {
                eprintln!("console client: {e:#}");
                Seen::default()
            }
            Err(e) => {
                eprintln!("console client task: {e}");
                Seen::default()
            }
        }
    }
}

/// GET `url` accepting `accept`, the body read to its end; an error unless 200.
async fn get(http: &reqwest::Client, url: &str, accept: &str) -> Result<()> {
    let resp = http.get(url).header("Accept", accept).send().await?;
    let status = resp.status();
    let _body = resp.bytes().await?;
    if status != reqwest::StatusCode::OK {
        return Err(anyhow!("{url}: {status}"));
    }
    Ok(())
}
