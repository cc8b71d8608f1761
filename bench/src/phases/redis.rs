//! Redis Streams (runs only when named: `--only redis`): the bare client's ceiling (the
//! relay's own `XADD`s of N synthetic messages pipelined on one multiplexed connection, at most
//! 1,000 in flight, as the relay's default `max_in_flight`), then the relay process draining N
//! rows with ordering none and aggregate, each into its own stream. Ratios: relay (none) /
//! bare, aggregate / none.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use outbox_relay::message::PayloadKind;
use outbox_relay::publish::envelope::EnvelopeConfig;
use outbox_relay::template::Template;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, fill, message};

/// The local Redis.
const REDIS_URL: &str = "redis://127.0.0.1:6379";

/// `XADD`s the bare client keeps in flight (the relay's default `relay.max_in_flight`).
const IN_FLIGHT: usize = 1000;

/// The bare ceiling, then the relay with ordering none and aggregate.
pub async fn redis_runs(ctx: &mut Ctx) -> Result<()> {
    let client = ::redis::Client::open(REDIS_URL)?;
    let config = ::redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(Duration::from_secs(30)))
        .set_pipeline_buffer_size(IN_FLIGHT);
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .with_context(|| format!("cannot connect to {REDIS_URL}"))?;
    let prefix = format!("bench.{}", ctx.run_id);
    let result = async {
        let bare = bare(ctx, &mut conn, &format!("{prefix}.bare")).await?;
        let none = relay_run(ctx, &prefix, "none").await?;
        let agg = relay_run(ctx, &prefix, "aggregate").await?;
        let phase = "11 redis";
        ctx.report.figure(
            phase,
            "ratio_redis_relay_none_vs_bare",
            "relay drain (ordering none) / bare redis pipelining",
            none / bare,
            "×",
        );
        ctx.report.figure(
            phase,
            "ratio_redis_aggregate_vs_none",
            "relay drain ordering aggregate / none",
            agg / none,
            "×",
        );
        Ok(())
    }
    .await;
    // The streams go whatever happened.
    let keys: Vec<String> = ["bare", "none", "aggregate"]
        .iter()
        .map(|k| format!("{prefix}.{k}.order"))
        .chain([format!("{prefix}.bare")])
        .collect();
    let _: Result<::redis::Value, _> = ::redis::cmd("DEL").arg(&keys).query_async(&mut conn).await;
    result
}

/// N `XADD`s built by the relay's own code, ≤ [`IN_FLIGHT`] outstanding; msgs/s.
async fn bare(
    ctx: &mut Ctx,
    conn: &mut ::redis::aio::MultiplexedConnection,
    stream: &str,
) -> Result<f64> {
    let env = EnvelopeConfig {
        route: Template::parse(stream)?,
        source: "/outbox/bench/bench".to_owned(),
        payload_kind: PayloadKind::Json,
        signer: None,
    };
    let aggregates = ctx.args.aggregates as u64;
    ctx.progress(format!(
        "redis bare: {} XADDs, {IN_FLIGHT} in flight",
        ctx.rows
    ));
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut pending: FuturesUnordered<_> = FuturesUnordered::new();
    let mut failed = 0usize;
    for i in 0..ctx.rows as u64 {
        if pending.len() >= IN_FLIGHT {
            let done: Option<::redis::RedisResult<::redis::Value>> = pending.next().await;
            failed += usize::from(done.is_some_and(|r| r.is_err()));
        }
        // Built inside the timed loop, as the relay builds each message.
        let cmd = outbox_relay::publish::redis::xadd(&message(i, aggregates), &env, None);
        let mut c = conn.clone();
        pending.push(async move { cmd.query_async(&mut c).await });
    }
    while let Some(r) = pending.next().await {
        failed += usize::from(r.is_err());
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    if failed > 0 {
        bail!("{failed} bare XADDs failed");
    }
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "redis bare: {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report.figure(
        "11 redis",
        "redis_bare_msgs_per_s",
        "bare redis client: the relay's XADDs pipelined, 1000 in flight",
        r,
        "msgs/s",
    );
    let what = "bare redis client + redis-server";
    super::machine_cpu_figure(ctx, "11 redis", "redis_bare", what, (elapsed, &usage));
    Ok(r)
}

/// The relay process draining N rows into `<prefix>.<ordering>.order`; msgs/s.
async fn relay_run(ctx: &mut Ctx, prefix: &str, ordering: &str) -> Result<f64> {
    let key = format!("relay_redis_{ordering}");
    let ord = if ordering == "none" { "none" } else { "agg" };
    let table = ctx.new_table(&format!("redis_{ord}")).await?;
    ctx.progress(format!(
        "relay redis/{ordering}: filling {} rows into {table}",
        ctx.rows
    ));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__ORDERING".into(), ordering.into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), "redis".into()));
    env.push(("RELAY_PUBLISHER__REDIS__URL".into(), REDIS_URL.into()));
    env.push((
        "RELAY_PUBLISHER__REDIS__STREAM".into(),
        format!("{prefix}.{ordering}.{{aggregate_type}}"),
    ));
    env.extend(ctx.extra_env.iter().cloned());
    ctx.progress(format!("relay redis/{ordering}: relay process draining"));
    let what = match ordering {
        "none" => "relay process → redis, ordering none".to_owned(),
        _ => format!(
            "relay process → redis, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    super::drain_and_report(ctx, &key, &env, &table, ("11 redis", &what)).await
}
