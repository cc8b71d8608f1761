//! The naive loop of the blog posts, as the baseline.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::json;
use uuid::Uuid;

use super::{cpu_text, rate};
use crate::Ctx;
use crate::util::{CpuSample, fill, pg_connect};

/// The blog-post loop: SELECT … FOR UPDATE SKIP LOCKED LIMIT 50 by created_at, publish and
/// wait for each confirm, UPDATE each row, COMMIT.
pub async fn naive(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("naive").await?;
    ctx.progress(format!("naive: filling {} rows into {table}", ctx.rows));
    fill(&ctx.pg, &table, ctx.rows, ctx.args.aggregates).await?;
    let name = ctx.new_binding("naive").await?;

    let mut pg = pg_connect(&ctx.args.database_url).await?;
    let conn = Connection::connect(&ctx.args.amqp_url, ConnectionProperties::default())
        .await
        .context("cannot connect to RabbitMQ")?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let select = pg
        .prepare(&format!(
            "SELECT id, payload::text FROM {table} WHERE status = 'pending' \
             ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED"
        ))
        .await?;
    let update = pg
        .prepare(&format!("UPDATE {table} SET status = 'sent' WHERE id = $1"))
        .await?;

    let target = ctx.naive_rows;
    let limit = Duration::from_secs(ctx.args.naive_secs);
    ctx.progress(format!(
        "naive: draining {target} of {} pending rows",
        ctx.rows
    ));
    let (mut t_select, mut t_publish, mut t_update, mut t_commit) = (
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
        Duration::ZERO,
    );
    let mut polls = 0u64;
    let mut sent = 0usize;
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    while sent < target {
        let tx = pg.transaction().await?;
        let t = Instant::now();
        let rows = tx.query(&select, &[]).await?;
        t_select += t.elapsed();
        polls += 1;
        if rows.is_empty() {
            tx.commit().await?;
            break;
        }
        for r in &rows {
            let id: Uuid = r.try_get(0)?;
            let body: String = r.try_get(1)?;
            let props = BasicProperties::default()
                .with_message_id(id.to_string().into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2);
            let t = Instant::now();
            let confirmation = ch
                .basic_publish(
                    name.as_str().into(),
                    "order.OrderPlaced".into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    props,
                )
                .await?
                .await?;
            if !confirmation.is_ack() {
                bail!("naive loop: message {id} was nacked");
            }
            t_publish += t.elapsed();
            let t = Instant::now();
            tx.execute(&update, &[&id]).await?;
            t_update += t.elapsed();
        }
        let t = Instant::now();
        tx.commit().await?;
        t_commit += t.elapsed();
        sent += rows.len();
        if started.elapsed() > limit {
            break;
        }
    }
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let _ = conn.close(200, "done".into()).await;
    ctx.check(sentinel).await?;

    let r = rate(sent, elapsed);
    let ms = |d: Duration, n: u64| d.as_secs_f64() * 1000.0 / n.max(1) as f64;
    let per_poll = ms(t_select, polls);
    ctx.progress(format!(
        "naive: {r:.0} msgs/s ({sent} rows in {elapsed:.2?}); per poll {per_poll:.1} ms, \
         per publish+confirm {:.2} ms, per UPDATE {:.2} ms, per COMMIT {:.2} ms; {}",
        ms(t_publish, sent as u64),
        ms(t_update, sent as u64),
        ms(t_commit, polls),
        cpu_text(&usage)
    ));
    if sent < ctx.rows {
        ctx.report.note(format!(
            "naive loop: drained the first {sent} of {} pending rows (stops at {target} rows or {} s; \
             a full drain at this rate would take ~{:.0} s); its figure is the rate against a backlog of {} rows",
            ctx.rows,
            ctx.args.naive_secs,
            ctx.rows as f64 / r.max(1e-9),
            ctx.rows
        ));
    }
    ctx.report.figure(
        "3 naive loop",
        "naive_rabbitmq_msgs_per_s",
        &format!(
            "SKIP LOCKED LIMIT 50 by created_at, confirm+UPDATE per row ({sent} of {} rows)",
            ctx.rows
        ),
        r,
        "msgs/s",
    );
    ctx.report.figure(
        "3 naive loop",
        "naive_poll_ms",
        "its SELECT … ORDER BY created_at LIMIT 50 (mean per poll)",
        per_poll,
        "ms",
    );
    ctx.report.detail(
        "naive",
        json!({
            "rows_in_table": ctx.rows, "rows_drained": sent, "seconds": elapsed.as_secs_f64(),
            "polls": polls, "ms_per_poll": per_poll,
            "ms_per_publish_confirm": ms(t_publish, sent as u64),
            "ms_per_update": ms(t_update, sent as u64),
            "ms_per_commit": ms(t_commit, polls),
            "share_of_time": {
                "select": t_select.as_secs_f64() / elapsed.as_secs_f64(),
                "publish_confirm": t_publish.as_secs_f64() / elapsed.as_secs_f64(),
                "update": t_update.as_secs_f64() / elapsed.as_secs_f64(),
                "commit": t_commit.as_secs_f64() / elapsed.as_secs_f64(),
            },
            "cpu": usage,
        }),
    );
    drop(pg);
    Ok(())
}
