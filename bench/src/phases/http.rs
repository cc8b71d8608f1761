//! HTTP webhooks (runs only when named: `--only http`): a local endpoint on 127.0.0.1 that
//! answers 204 at once (axum on a runtime and thread of its own, so the bench's other work
//! never delays an answer); its ceiling, a bare reqwest client sending the requests the relay
//! would send (built by the relay's own `HttpPublisher::url_for` and `request_parts`: same
//! method, URL, CloudEvents binary headers and body, and the relay's user agent) with
//! `relay.max_in_flight` requests outstanding; then the relay process draining N rows with
//! ordering none and aggregate. Ratios: relay (none) / bare, aggregate / none.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outbox_relay::config::{HttpConfig, HttpMethod, HttpMode};
use outbox_relay::message::PayloadKind;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::publish::http::HttpPublisher;
use outbox_relay::template::Template;
use serde_json::json;

use super::{cpu_per_100k, cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, fill, message};

const PHASE: &str = "11 http";

/// The relay's default `relay.max_in_flight`: requests outstanding in both the relay and the
/// bare client (a `--relay-env RELAY_RELAY__MAX_IN_FLIGHT=…` applies to both).
const IN_FLIGHT: usize = 1000;

/// Every request's timeout, as the relay's default `publisher.http.timeout`.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The bare ceiling, then the relay with ordering none and aggregate, against one endpoint.
pub async fn http_runs(ctx: &mut Ctx) -> Result<()> {
    let endpoint = Endpoint::start()?;
    let url = format!(
        "http://{}/bench/{{aggregate_type}}/{{event_type}}",
        endpoint.addr
    );
    let in_flight = in_flight(ctx)?;
    let bare = bare(ctx, &endpoint, &url, in_flight).await?;
    let none = relay_run(ctx, &endpoint, &url, "none").await?;
    let agg = relay_run(ctx, &endpoint, &url, "aggregate").await?;
    for (key, what, value) in [
        (
            "ratio_http_relay_none_vs_bare",
            "relay drain (ordering none) / bare reqwest client",
            none / bare,
        ),
        (
            "ratio_http_aggregate_vs_none",
            "relay drain ordering aggregate / none",
            agg / none,
        ),
    ] {
        ctx.report.figure(PHASE, key, what, value, "×");
    }
    Ok(())
}

/// `relay.max_in_flight` as the relay processes get it (`--relay-env` may set it).
fn in_flight(ctx: &Ctx) -> Result<usize> {
    match ctx
        .extra_env
        .iter()
        .rfind(|(k, _)| k == "RELAY_RELAY__MAX_IN_FLIGHT")
    {
        Some((_, v)) => v
            .parse()
            .with_context(|| format!("RELAY_RELAY__MAX_IN_FLIGHT={v} is not a number")),
        None => Ok(IN_FLIGHT),
    }
}

/// N requests as the relay builds them (binary mode, no signing: the relay's defaults), at most
/// `in_flight` outstanding, each answer read to its end; msgs/s.
async fn bare(ctx: &mut Ctx, endpoint: &Endpoint, url: &str, in_flight: usize) -> Result<f64> {
    let publisher = HttpPublisher::new(HttpConfig {
        url: Template::parse(url)?,
        origin: format!("http://{}/", endpoint.addr),
        method: HttpMethod::Post,
        mode: HttpMode::Binary,
        headers: Vec::new(),
        timeout: TIMEOUT,
    });
    // The relay's CloudEvents source for a table of the same name length.
    let env = EnvelopeConfig {
        route: Template::parse("unused")?,
        source: format!("/outbox/test/bench_http_bare_{}", ctx.run_id),
        payload_kind: PayloadKind::Json,
        signer: None,
    };
    // A bare client: the relay's user agent (a header it sends), no redirects, its timeout.
    let client = reqwest::Client::builder()
        .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
        .redirect(reqwest::redirect::Policy::none())
        .timeout(TIMEOUT)
        .build()?;
    let aggregates = ctx.args.aggregates as u64;
    ctx.progress(format!(
        "http bare: {} requests, {in_flight} in flight",
        ctx.rows
    ));
    let before = endpoint.requests();
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut pending = FuturesUnordered::new();
    let mut failed = Vec::new();
    for i in 1..=ctx.rows as u64 {
        if pending.len() >= in_flight
            && let Some(Err(e)) = pending.next().await
        {
            failed.push(e);
        }
        // Built inside the timed loop, as the relay builds each request.
        let msg = message(i, aggregates);
        let url = publisher.url_for(&msg).map_err(anyhow::Error::msg)?;
        let (headers, body) = publisher
            .request_parts(&msg, &env, &url)
            .map_err(anyhow::Error::msg)?;
        let request = client.post(url).headers(headers).body(body);
        pending.push(async move {
            let response = request.send().await.map_err(|e| e.to_string())?;
            let status = response.status();
            response.bytes().await.map_err(|e| e.to_string())?;
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("HTTP {status}"))
            }
        });
    }
    while let Some(done) = pending.next().await {
        if let Err(e) = done {
            failed.push(e);
        }
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    if let Some(first) = failed.first() {
        bail!("{} bare requests failed, the first: {first}", failed.len());
    }
    let received = endpoint.requests() - before;
    if received != ctx.rows as u64 {
        bail!(
            "the endpoint received {received} requests for {} sent",
            ctx.rows
        );
    }
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "http bare: {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report.figure(
        PHASE,
        "http_bare_msgs_per_s",
        &format!("bare reqwest client: the relay's requests, {in_flight} in flight"),
        r,
        "msgs/s",
    );
    if let Some(cpu) = cpu_per_100k(&usage, "bench", elapsed, ctx.rows) {
        ctx.report.figure(
            PHASE,
            "http_bare_bench_cpu_s_per_100k",
            "bare client + endpoint (the bench process): CPU (user+sys) per 100k requests",
            cpu,
            "s",
        );
    }
    let what = "bare reqwest client + endpoint";
    super::machine_cpu_figure(ctx, PHASE, "http_bare", what, (elapsed, &usage));
    ctx.report.detail(
        "http_bare",
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "in_flight": in_flight, "cpu": usage}),
    );
    Ok(r)
}

/// The relay process draining N rows to the endpoint; msgs/s.
async fn relay_run(ctx: &mut Ctx, endpoint: &Endpoint, url: &str, ordering: &str) -> Result<f64> {
    let key = format!("relay_http_{ordering}");
    let ord = if ordering == "none" { "none" } else { "agg" };
    let table = ctx.new_table(&format!("http_{ord}")).await?;
    ctx.progress(format!(
        "relay http/{ordering}: filling {} rows into {table}",
        ctx.rows
    ));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__ORDERING".into(), ordering.into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), "http".into()));
    env.push(("RELAY_PUBLISHER__HTTP__URL".into(), url.into()));
    env.extend(ctx.extra_env.iter().cloned());
    ctx.progress(format!("relay http/{ordering}: relay process draining"));
    let what = match ordering {
        "none" => "relay process → http, ordering none".to_owned(),
        _ => format!(
            "relay process → http, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    let before = endpoint.requests();
    let r = super::drain_and_report(ctx, &key, &env, &table, (PHASE, &what)).await?;
    // Every row sent was answered 204 once at least; more means a request was sent again.
    let received = endpoint.requests() - before;
    if received < ctx.rows as u64 {
        bail!(
            "{key}: the endpoint received {received} requests for {} rows sent",
            ctx.rows
        );
    }
    if received > ctx.rows as u64 {
        ctx.report.note(format!(
            "{key}: the endpoint received {received} requests for {} rows",
            ctx.rows
        ));
    }
    Ok(r)
}

/// An HTTP/1.1 endpoint on 127.0.0.1 answering every request 204 at once (after reading its
/// body) on a current-thread runtime of its own; counts the requests that carry a message (any
/// method but `HEAD`, which the relay's probe sends). Stops when dropped.
struct Endpoint {
    addr: SocketAddr,
    count: Arc<AtomicU64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Endpoint {
    fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let count = Arc::new(AtomicU64::new(0));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let router = axum::Router::new()
            .fallback(accept)
            .with_state(Arc::clone(&count));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("bench-http-endpoint".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => return eprintln!("http endpoint: {e}"),
                    };
                    tokio::select! {
                        served = axum::serve(listener, router) => {
                            if let Err(e) = served {
                                eprintln!("http endpoint: {e}");
                            }
                        }
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            count,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Requests answered so far (`HEAD` probes left out).
    fn requests(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn accept(State(count): State<Arc<AtomicU64>>, method: Method, _body: Bytes) -> StatusCode {
    if method != Method::HEAD {
        count.fetch_add(1, Ordering::Relaxed);
    }
    StatusCode::NO_CONTENT
}
