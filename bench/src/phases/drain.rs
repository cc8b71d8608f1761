//! The relay process draining a backlog: ordering none/aggregate × RabbitMQ/Kafka; and the
//! same drain with OpenTelemetry tracing off, on (every row sampled, exported to a local OTLP
//! receiver) and on with the receiver down.

use std::cell::Cell;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use super::{cpu_per_100k, cpu_text, rate, scrape};
use crate::Ctx;
use crate::util::{CpuSample, Relay, fill, wait_drained};

/// A drain of the tracing phase: `label` names the case; tracing off without `endpoint`.
struct Trace {
    label: &'static str,
    endpoint: Option<String>,
}

/// `ordering` none/aggregate × RabbitMQ/Kafka, each on a fresh table of N rows.
pub async fn relay_runs(ctx: &mut Ctx) -> Result<()> {
    let cases = [
        ("rabbitmq", "none"),
        ("rabbitmq", "aggregate"),
        ("kafka", "none"),
        ("kafka", "aggregate"),
    ];
    let mut errors = Vec::new();
    for (broker, ordering) in cases {
        let what = format!("relay {broker}/{ordering}");
        let result = ctx
            .measured(&what, async |ctx: &mut Ctx| {
                relay_run(ctx, broker, ordering, None).await.map(drop)
            })
            .await;
        if let Err(e) = result {
            ctx.progress(format!("ERROR {what}: {e:#}"));
            errors.push(format!("{what}: {e:#}"));
        }
    }
    super::all_ok(errors)
}

/// Phase 11: for RabbitMQ and Kafka (ordering aggregate), a drain with tracing off, one with
/// every row sampled and exported to a local OTLP/HTTP receiver, and one exporting to a port
/// where nothing listens; the ratios on/off and down/off.
pub async fn tracing_runs(ctx: &mut Ctx) -> Result<()> {
    let receiver = outbox_testkit::otlp::OtlpReceiver::start_counting().await;
    let down = format!("http://127.0.0.1:{}", outbox_testkit::free_port());
    let mut errors = Vec::new();
    for broker in ["rabbitmq", "kafka"] {
        let mut rates = Vec::new();
        for (label, endpoint) in [
            ("off", None),
            ("on", Some(receiver.endpoint())),
            ("down", Some(down.clone())),
        ] {
            let what = format!("tracing {broker}/{label}");
            let rate = Cell::new(f64::NAN);
            let result = ctx
                .measured(&what, async |ctx: &mut Ctx| {
                    let endpoint = endpoint.clone();
                    let trace = Some(Trace { label, endpoint });
                    rate.set(relay_run(ctx, broker, "aggregate", trace).await?);
                    Ok(())
                })
                .await;
            if let Err(e) = result {
                ctx.progress(format!("ERROR {what}: {e:#}"));
                errors.push(format!("{what}: {e:#}"));
            }
            rates.push(rate.get());
        }
        for (i, label) in [(1, "on"), (2, "down")] {
            if rates[0].is_finite() && rates[i].is_finite() {
                ctx.report.figure(
                    "11 tracing",
                    &format!("ratio_tracing_{label}_vs_off_{broker}"),
                    &format!("relay → {broker}: msgs/s with tracing {label} ÷ off"),
                    rates[i] / rates[0],
                    "×",
                );
            }
        }
    }
    ctx.report.detail(
        "tracing_receiver",
        json!({"spans": receiver.span_count(), "requests": receiver.requests()}),
    );
    super::all_ok(errors)
}

/// One drain of a fresh table of N rows by a relay process; its rate in msgs/s.
async fn relay_run(
    ctx: &mut Ctx,
    broker: &str,
    ordering: &str,
    trace: Option<Trace>,
) -> Result<f64> {
    let short = if broker == "rabbitmq" { "rmq" } else { "kafka" };
    let ord = if ordering == "none" { "none" } else { "agg" };
    let (phase, suffix) = match &trace {
        Some(t) => ("11 tracing", format!("_trace_{}", t.label)),
        None => ("4 relay drain", String::new()),
    };
    let key = format!("relay_{broker}_{ordering}{suffix}");
    let table = ctx.new_table(&format!("{short}_{ord}")).await?;
    ctx.progress(format!(
        "relay {broker}/{ordering}: filling {} rows into {table}",
        ctx.rows
    ));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;

    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_RELAY__ORDERING".into(), ordering.into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), broker.into()));
    let queue = if broker == "rabbitmq" {
        let name = ctx.new_binding(&format!("{short}_{ord}")).await?;
        env.push(("RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(), name.clone()));
        Some(name)
    } else {
        let topic = ctx.new_topic(&format!("{short}_{ord}")).await?;
        env.push(("RELAY_PUBLISHER__KAFKA__TOPIC".into(), topic));
        None
    };
    if let Some(endpoint) = trace.as_ref().and_then(|t| t.endpoint.clone()) {
        env.push(("RELAY_TRACING__OTLP_ENDPOINT".into(), endpoint));
        env.push(("RELAY_TRACING__SAMPLE_RATIO".into(), "1.0".into()));
    }
    let metrics_port = ctx.metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());

    ctx.progress(format!("relay {broker}/{ordering}: relay process draining"));
    let log = ctx.dir.join(format!("{key}.log"));
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut relay = Relay::spawn(&key, &env, &log)?;
    super::profile_if_asked(ctx, &mut relay, &key)?;
    let waited = wait_drained(&ctx.pg, &table, ctx.timeout(), || relay.check_alive()).await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let rss = relay.peak_rss_kib();
    let metrics = scrape(metrics_port).await;
    super::stop_drained(ctx, &mut relay, sentinel, waited, &table).await?;
    let mut duplicates = serde_json::Value::Null;
    if let Some(q) = &queue {
        let queued = ctx.rabbit().await?.queue_len(q).await? as usize;
        duplicates = json!(queued as i64 - ctx.rows as i64);
        if queued != ctx.rows {
            ctx.report.note(format!(
                "{key}: queue holds {queued} messages for {} rows",
                ctx.rows
            ));
        }
    }
    let rss_mib = rss.map(|k| k as f64 / 1024.0);
    if let Some(k) = rss {
        ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
    }

    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "relay {broker}/{ordering}: {r:.0} msgs/s in {elapsed:.2?}, peak RSS {:.1} MiB; {}",
        rss_mib.unwrap_or(f64::NAN),
        cpu_text(&usage)
    ));
    let mut what = match ordering {
        "none" => format!("relay process → {broker}, ordering none"),
        _ => format!(
            "relay process → {broker}, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    if let Some(t) = &trace {
        what.push_str(&format!(", tracing {}", t.label));
        if let Some(mib) = rss_mib {
            ctx.report.figure(
                phase,
                &format!("{key}_peak_rss_mib"),
                &format!("{what}: relay peak RSS"),
                mib,
                "MiB",
            );
        }
    }
    ctx.report
        .figure(phase, &format!("{key}_msgs_per_s"), &what, r, "msgs/s");
    if let Some(cpu) = cpu_per_100k(&usage, "relay", elapsed, ctx.rows) {
        ctx.report.figure(
            phase,
            &format!("{key}_cpu_s_per_100k"),
            &format!("{what}: relay CPU (user+sys) per 100k msgs"),
            cpu,
            "s",
        );
    }
    ctx.report.detail(
        &key,
        json!({
            "rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "peak_rss_mib": rss_mib,
            "queue_surplus": duplicates, "cpu": usage, "extra_env": crate::masked_env(&ctx.extra_env),
            "relay_metrics": metrics,
        }),
    );
    Ok(r)
}
