//! The database ceiling: the relay's own claim + settle loop (`run_with`, in process) with a
//! no-op publisher.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use async_trait::async_trait;
use outbox_relay::PublisherFactory;
use outbox_relay::publish::{ConnectError, Outcome, Publisher};
use outbox_relay::store::OutboxMessage;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, avg_payload_bytes, fill, verify_sent, wait_drained};

/// A publisher that confirms everything at once: the relay's database path alone.
struct NoopPublisher;

#[async_trait]
impl Publisher for NoopPublisher {
    fn kind(&self) -> &'static str {
        "noop"
    }

    fn describe(&self) -> String {
        "no-op publisher (benchmark)".to_owned()
    }

    async fn connect(&self) -> Result<(), ConnectError> {
        Ok(())
    }

    fn is_connected(&self) -> bool {
        true
    }

    async fn publish(&self, _msg: &OutboxMessage) -> Outcome {
        Outcome::Confirmed
    }

    async fn close(&self) {}
}

/// The relay's own claim + settle loop (in process, `run_with`) with a no-op publisher.
pub async fn db_ceiling(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("db").await?;
    ctx.progress(format!("db: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let bytes = avg_payload_bytes(&ctx.pg, &table).await?;
    ctx.report
        .detail("payload_bytes_as_sent", json!(bytes.round()));
    let config = ctx.config(&table, |raw| raw.relay.ordering = "none".into())?;
    let batch = config.relay.batch_size;
    let token = CancellationToken::new();
    let _stop_on_drop = token.clone().drop_guard();
    let factory: PublisherFactory = Box::new(|_| Arc::new(NoopPublisher) as Arc<dyn Publisher>);

    ctx.progress("db: relay loop (in process, no-op publisher) draining");
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let handle = tokio::spawn(outbox_relay::run_with(config, Some(factory), token.clone()));
    let waited = wait_drained(&ctx.pg, &table, ctx.timeout(), || {
        if handle.is_finished() {
            Err(anyhow!("the relay loop ended before the table was drained"))
        } else {
            Ok(())
        }
    })
    .await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    token.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(30), handle).await;
    match ended {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => bail!("run_with failed: {e}"),
        Ok(Err(e)) => bail!("run_with panicked: {e}"),
        Err(_) => bail!("run_with did not stop within 30 s of cancellation"),
    }
    ctx.check(sentinel).await?;
    waited?;
    verify_sent(&ctx.pg, &table, ctx.rows).await?;

    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "db: {r:.0} rows/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    ctx.report.figure(
        "1 db ceiling",
        "db_ceiling_rows_per_s",
        &format!("claim+settle, no-op publisher, batch {batch}, ordering none"),
        r,
        "rows/s",
    );
    ctx.report.detail(
        "db_ceiling",
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage}),
    );
    Ok(())
}
