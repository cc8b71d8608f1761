//! NATS JetStream (`--only nats`): the relay process draining N rows into a stream, ordering
//! none and aggregate, beside its ceiling: a bare async-nats client publishing the same
//! messages (same subject, body and headers) with the same number of acks outstanding
//! (`relay.max_in_flight`, 1000).

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};
use async_nats::HeaderMap;
use async_nats::jetstream::context::ContextBuilder;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config, StorageType};
use futures::StreamExt;
use futures::stream::FuturesUnordered;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, fill, payload};

/// The relay's default window: acks outstanding in both the relay and the bare client.
const IN_FLIGHT: usize = 1000;

/// `BENCH_NATS_URL`, or the local server.
pub(super) fn nats_url() -> String {
    std::env::var("BENCH_NATS_URL").unwrap_or_else(|_| outbox_testkit::nats::NATS_URL.to_owned())
}

/// A JetStream context on `url` with room for the relay's acks outstanding.
pub(super) async fn jetstream(url: &str) -> Result<async_nats::jetstream::Context> {
    let client = async_nats::connect(url)
        .await
        .with_context(|| format!("cannot connect to NATS at {url}"))?;
    Ok(ContextBuilder::new()
        .timeout(Duration::from_secs(30))
        .max_ack_inflight(IN_FLIGHT * 4)
        .build(client))
}

/// Creates the file stream `BENCH_NATS_<case>_<run id>` over subjects `<prefix>.>`; returns
/// (stream, prefix), the prefix `bench.<run id>.<case>`.
pub(super) async fn new_stream(
    js: &async_nats::jetstream::Context,
    case: &str,
    run_id: &str,
) -> Result<(String, String)> {
    let stream = format!("BENCH_NATS_{case}_{run_id}").to_uppercase();
    let prefix = format!("bench.{run_id}.{case}");
    js.create_stream(Config {
        name: stream.clone(),
        subjects: vec![format!("{prefix}.>")],
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Config::default()
    })
    .await
    .map_err(|e| anyhow!("cannot create stream {stream}: {e}"))?;
    Ok((stream, prefix))
}

/// The bare client alone into a fresh stream, deleted afterwards (`nats_bare_*`, with the
/// machine's CPU per 100k for the shared ceilings).
pub(super) async fn bare_ceiling(ctx: &mut Ctx) -> Result<f64> {
    let js = jetstream(&nats_url()).await?;
    let (stream, prefix) = new_stream(&js, "bare", &ctx.run_id).await?;
    let run = bare(ctx, &js, &prefix).await;
    let _ = js.delete_stream(&stream).await;
    run
}

/// The bare client, then the relay with ordering none and aggregate, each into a fresh stream.
pub async fn nats(ctx: &mut Ctx) -> Result<()> {
    let url = nats_url();
    let js = jetstream(&url).await?;
    let mut rates = Vec::new();
    for case in ["bare", "none", "aggregate"] {
        let (stream, prefix) = new_stream(&js, case, &ctx.run_id).await?;
        let run = if case == "bare" {
            bare(ctx, &js, &prefix).await
        } else {
            relay(ctx, &url, &prefix, case).await
        };
        let _ = js.delete_stream(&stream).await;
        rates.push(run?);
    }
    let (bare, none, agg) = (rates[0], rates[1], rates[2]);
    for (key, what, value) in [
        (
            "ratio_nats_relay_none_vs_bare",
            "relay nats none / bare async-nats client",
            none / bare,
        ),
        (
            "ratio_nats_aggregate_vs_none",
            "relay nats aggregate / relay nats none",
            agg / none,
        ),
    ] {
        ctx.report.figure("11 nats", key, what, value, "×");
    }
    Ok(())
}

/// A bare client publishing what the relay would for N rows (the fill's bodies, one subject,
/// the CloudEvents headers and `Nats-Msg-Id`), `IN_FLIGHT` acks outstanding.
async fn bare(ctx: &mut Ctx, js: &async_nats::jetstream::Context, prefix: &str) -> Result<f64> {
    let aggregates = ctx.args.aggregates as u64;
    let subject = format!("{prefix}.order.OrderPlaced");
    ctx.progress(format!("nats bare client: {} messages", ctx.rows));
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut acks = FuturesUnordered::new();
    for i in 1..=ctx.rows as u64 {
        let id = uuid::Uuid::new_v4().to_string();
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("ce-id", id.as_str()),
            ("ce-source", "/outbox/test/bench"),
            ("ce-specversion", "1.0"),
            ("ce-type", "OrderPlaced"),
            ("ce-subject", &format!("order-{}", i % aggregates.max(1))),
            (
                "ce-time",
                &chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
            ("ce-aggregatetype", "order"),
            ("Content-Type", "application/json"),
            ("Nats-Msg-Id", id.as_str()),
        ] {
            h.insert(k, v);
        }
        let body = payload(i, aggregates);
        let msg = PublishMessage::build()
            .payload(body.into_bytes().into())
            .headers(h);
        let ack = js.send_publish(subject.clone(), msg).await?;
        acks.push(ack.into_future());
        if acks.len() >= IN_FLIGHT
            && let Some(done) = acks.next().await
        {
            done?;
        }
    }
    while let Some(done) = acks.next().await {
        done?;
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "nats bare client: {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report.figure(
        "11 nats",
        "nats_bare_msgs_per_s",
        &format!("bare async-nats client, {IN_FLIGHT} acks outstanding"),
        r,
        "msgs/s",
    );
    let what = "bare async-nats client + nats-server";
    super::machine_cpu_figure(ctx, "11 nats", "nats_bare", what, (elapsed, &usage));
    Ok(r)
}

/// The relay process draining N rows into the stream under `prefix`.
async fn relay(ctx: &mut Ctx, url: &str, prefix: &str, ordering: &str) -> Result<f64> {
    let key = format!("relay_nats_{ordering}");
    let table = ctx.new_table(&format!("nats_{}", &ordering[..3])).await?;
    ctx.progress(format!("{key}: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let mut env = ctx.relay_env(&table);
    env.extend([
        ("RELAY_RELAY__ORDERING".to_owned(), ordering.to_owned()),
        ("RELAY_PUBLISHER__KIND".to_owned(), "nats".to_owned()),
        ("RELAY_PUBLISHER__NATS__URL".to_owned(), url.to_owned()),
        (
            "RELAY_PUBLISHER__NATS__SUBJECT".to_owned(),
            format!("{prefix}.{{aggregate_type}}.{{event_type}}"),
        ),
    ]);
    env.extend(ctx.extra_env.iter().cloned());
    let what = match ordering {
        "none" => "relay process → nats, ordering none".to_owned(),
        _ => format!(
            "relay process → nats, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    super::drain_and_report(ctx, &key, &env, &table, ("11 nats", &what)).await
}
