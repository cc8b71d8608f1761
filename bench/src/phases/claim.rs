//! The claim's cost and plan on a small and a large table.

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};
use outbox_relay::config::Ordering;
use outbox_relay::store::{OnConfirm, Store};
use serde_json::json;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::Ctx;
use crate::util::{
    Fill, IndexDef, create_index, drop_index, fill_range, median, settle_db, table_indexes,
};

/// The relay's own claim, measured through the library: `Store::claim` on a pool whose
/// sessions load `auto_explain` (analyze + buffers, reported to the client as a NOTICE that
/// [`crate::plans`] captures), then `Store::mark_sent` as the relay does after publishing, so
/// consecutive claims walk the table like a draining relay. No SQL is copied from the library.
pub(super) struct ClaimRun {
    wall_ms: f64,
    exec_ms: f64,
    pages: u64,
    rows: usize,
    pub(super) plan: String,
}

pub(super) fn explain_url(url: &str) -> String {
    let options = "-c session_preload_libraries=auto_explain -c auto_explain.log_min_duration=0 \
                   -c auto_explain.log_analyze=on -c auto_explain.log_buffers=on \
                   -c auto_explain.log_level=notice -c client_min_messages=notice";
    let encoded = options.replace(' ', "%20").replace('=', "%3D");
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options={encoded}")
}

pub(super) async fn measure_claims(
    store: &Store,
    ordering: Ordering,
    runs: usize,
) -> Result<Vec<ClaimRun>> {
    let mut out = Vec::new();
    for _ in 0..runs {
        crate::plans::take();
        let started = Instant::now();
        let rows = store
            .claim(ordering, 500, i64::MAX)
            .await
            .context("Store::claim failed")?;
        let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        store
            .mark_sent(&ids, OnConfirm::MarkSent)
            .await
            .context("Store::mark_sent failed")?;
        // The NOTICE precedes the statement's result on the connection; allow for scheduling.
        let mut plan = None;
        for _ in 0..50 {
            plan = crate::plans::take()
                .into_iter()
                .find(|p| p.contains("'processing'") || p.contains("processing"));
            if plan.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let plan = plan.ok_or_else(|| {
            anyhow!("auto_explain reported no plan for the claim (is auto_explain installed?)")
        })?;
        let exec_ms = plan
            .split("duration:")
            .nth(1)
            .and_then(|rest| rest.trim_start().split(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN);
        let lines: Vec<String> = plan.lines().map(str::to_owned).collect();
        out.push(ClaimRun {
            wall_ms,
            exec_ms,
            pages: root_pages(&lines).unwrap_or(0),
            rows: rows.len(),
            plan,
        });
    }
    Ok(out)
}

/// The plan text without the (long, one-line) query text, which is printed once separately.
fn plan_body(plan: &str) -> String {
    plan.lines()
        .filter(|l| !l.starts_with("Query Text:"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(super) fn query_text(plan: &str) -> Option<String> {
    plan.lines()
        .find_map(|l| l.strip_prefix("Query Text:"))
        .map(|q| q.trim().to_owned())
}

pub(super) struct Explained {
    pub(super) times_ms: Vec<f64>,
    /// Shared buffers hit + read by the whole statement (the root node), per run: unlike the
    /// time, this does not depend on what else the machine is doing.
    pub(super) pages: Vec<u64>,
    plan: String,
}

/// `hit + read` of the first `Buffers: shared …` line (the root node's).
fn root_pages(lines: &[String]) -> Option<u64> {
    let line = lines
        .iter()
        .find(|l| l.trim_start().starts_with("Buffers: shared"))?;
    let mut total = 0;
    for part in line.split([' ', ',']) {
        for key in ["hit=", "read="] {
            if let Some(v) = part.strip_prefix(key) {
                total += v.parse::<u64>().ok()?;
            }
        }
    }
    Some(total)
}

/// Runs `setup`, then `EXPLAIN (ANALYZE, BUFFERS) <stmt>`, `runs` times, each in a transaction
/// rolled back.
pub(super) async fn explain(
    pg: &Client,
    (setup, stmt): (&str, &str),
    runs: usize,
) -> Result<Explained> {
    let mut times_ms = Vec::new();
    let mut pages = Vec::new();
    let mut plan = String::new();
    for _ in 0..runs {
        pg.batch_execute(&format!("BEGIN; {setup}")).await?;
        let res = pg
            .simple_query(&format!("EXPLAIN (ANALYZE, BUFFERS) {stmt}"))
            .await;
        let _ = pg.batch_execute("ROLLBACK").await;
        let lines: Vec<String> = res?
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .collect();
        let exec = lines
            .iter()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("Execution Time:")
                    .and_then(|v| v.trim().trim_end_matches("ms").trim().parse::<f64>().ok())
            })
            .ok_or_else(|| anyhow!("no Execution Time in the plan"))?;
        times_ms.push(exec);
        pages.push(root_pages(&lines).unwrap_or(0));
        plan = lines.join("\n");
    }
    Ok(Explained {
        times_ms,
        pages,
        plan,
    })
}

/// Small table (all pending) and large table (99 % sent), claim timings and plans.
pub async fn claim(ctx: &mut Ctx) -> Result<()> {
    let sentinel = ctx.sentinel().await;
    claim_table(ctx, "claim_small", 10_000, false, "small").await?;
    ctx.cleanup().await;
    if ctx.rows != 10_000 {
        // The backlog the drain phases start from.
        claim_table(ctx, "claim_backlog", ctx.rows, false, "backlog").await?;
        ctx.cleanup().await;
    }
    ctx.check(sentinel).await?;
    let sentinel = ctx.sentinel().await;
    claim_table(ctx, "claim_large", ctx.args.claim_rows, true, "large").await?;
    ctx.check(sentinel).await
}

fn median_u64(v: &[u64]) -> f64 {
    median(&v.iter().map(|x| *x as f64).collect::<Vec<_>>())
}

/// Adds the figures, plan and details of one series of claims.
fn report_claims(ctx: &mut Ctx, key: &str, label: &str, runs: &[ClaimRun]) {
    if runs.iter().any(|r| r.rows < 500) {
        ctx.report.note(format!(
            "{label}: some claims returned fewer than 500 rows ({:?})",
            runs.iter().map(|r| r.rows).collect::<Vec<_>>()
        ));
    }
    let exec: Vec<f64> = runs.iter().map(|r| r.exec_ms).collect();
    let wall: Vec<f64> = runs.iter().map(|r| r.wall_ms).collect();
    let pages: Vec<u64> = runs.iter().map(|r| r.pages).collect();
    let rows: Vec<usize> = runs.iter().map(|r| r.rows).collect();
    ctx.report.figure(
        "7 claim cost",
        &format!("{key}_ms"),
        &format!("{label}: execution, median of {}", runs.len()),
        median(&exec),
        "ms",
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("{key}_pages"),
        &format!("{label}: buffers touched, median"),
        median_u64(&pages),
        "pages",
    );
    if let Some(last) = runs.last() {
        ctx.report.plan(
            &format!("{label}, last of {} consecutive claims", runs.len()),
            &plan_body(&last.plan),
        );
    }
    ctx.report.detail(
        key,
        json!({"exec_ms": exec, "wall_ms": wall, "pages": pages, "rows": rows}),
    );
}

async fn claim_table(
    ctx: &mut Ctx,
    tag: &str,
    n: usize,
    mostly_sent: bool,
    which: &str,
) -> Result<()> {
    let table = ctx.new_table(tag).await?;
    let label = if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    };
    let n64 = i64::try_from(n)?;
    let aggregates = i64::try_from(ctx.args.aggregates)?;
    // The large table is built fast: without indexes, with explicit seq values. The partial
    // indexes over unsent rows (the ones the claims read) are rebuilt before the 99 % UPDATE,
    // so they carry the dead entries that a real table has until VACUUM; the others (primary
    // key, processing, failed, sent), which the UPDATE would only slow down, after it.
    let indexes = if mostly_sent {
        let all = table_indexes(&ctx.pg, &table).await?;
        for idx in &all {
            drop_index(&ctx.pg, &table, idx).await?;
        }
        all
    } else {
        Vec::new()
    };
    let chunk = 1_000_000i64;
    let mut from = 1;
    while from <= n64 {
        let to = (from + chunk - 1).min(n64);
        let how = if mostly_sent {
            Fill::Fast
        } else {
            Fill::AsApplications
        };
        fill_range(&ctx.pg, &table, (from, to), aggregates, how).await?;
        ctx.progress(format!("claim: {table}: {to} of {n} rows inserted"));
        from = to + 1;
    }
    let config = ctx.config(&table, |raw| {
        raw.database.url = explain_url(&raw.database.url);
    })?;
    let store = Store::new(&config.database, "outbox-bench-claim")?;
    let runs = 7;
    let naive_poll = format!(
        "SELECT id, payload::text FROM {table} WHERE status = 'pending' ORDER BY created_at LIMIT 50 FOR UPDATE SKIP LOCKED"
    );

    if mostly_sent {
        ctx.pg
            .execute(&format!("SELECT setval('{table}_seq', $1)"), &[&n64])
            .await?;
        let (unsent, rest): (Vec<&IndexDef>, Vec<&IndexDef>) = indexes.iter().partition(|i| {
            i.definition().contains("'pending'") || i.definition().contains("<> 'sent'")
        });
        for idx in &unsent {
            create_index(&ctx.pg, &table, idx).await?;
        }
        let keep_pending = (n64 / 100).max(1);
        let cut = n64 - keep_pending;
        ctx.progress(format!("claim: {table}: marking {cut} rows sent"));
        ctx.pg
            .execute(
                &format!(
                    "UPDATE {table} SET status = 'sent', sent_at = now(), attempts = 1 WHERE seq <= $1"
                ),
                &[&cut],
            )
            .await?;
        ctx.progress(format!("claim: {table}: rebuilding the other indexes"));
        for idx in &rest {
            create_index(&ctx.pg, &table, idx).await?;
        }
        // Before VACUUM: what the table looks like while vacuum lags (autovacuum is off on
        // this machine's PostgreSQL).
        ctx.pg.batch_execute(&format!("ANALYZE {table}")).await?;
        let before = measure_claims(&store, Ordering::None, runs).await?;
        ctx.progress(format!(
            "claim: {label} rows 99% sent, before VACUUM: claim_none execution {:?} ms, buffers {:?}",
            before.iter().map(|r| r.exec_ms.round()).collect::<Vec<_>>(),
            before.iter().map(|r| r.pages).collect::<Vec<_>>()
        ));
        ctx.report.figure(
            "7 claim cost",
            "claim_none_large_unvacuumed_first_ms",
            &format!("claim_none, {label} rows 99% sent, before VACUUM: first claim"),
            before.first().map_or(f64::NAN, |r| r.exec_ms),
            "ms",
        );
        report_claims(
            ctx,
            "claim_none_large_unvacuumed",
            &format!("claim_none, {label} rows 99% sent, before VACUUM"),
            &before,
        );
        ctx.progress(format!("claim: {table}: VACUUM ANALYZE"));
        ctx.pg
            .batch_execute(&format!("VACUUM ANALYZE {table}"))
            .await?;
    } else {
        settle_db(&ctx.pg, &table).await?;
    }
    if let Err(e) = ctx.pg.batch_execute("CHECKPOINT").await {
        tracing::debug!(error = %e, "CHECKPOINT refused");
    }
    let size: String = ctx
        .pg
        .query_one(
            "SELECT pg_size_pretty(pg_total_relation_size($1::text::regclass))",
            &[&table],
        )
        .await?
        .try_get(0)?;

    let c_none = measure_claims(&store, Ordering::None, runs).await?;
    let c_agg = measure_claims(&store, Ordering::Aggregate, runs).await?;
    let c_naive = explain(&ctx.pg, ("", &naive_poll), 3).await?;
    if which == "small" {
        if let Some(q) = c_none.last().and_then(|r| query_text(&r.plan)) {
            ctx.report
                .plan("claim_none statement (as the relay sends it)", &q);
        }
        if let Some(q) = c_agg.last().and_then(|r| query_text(&r.plan)) {
            ctx.report
                .plan("claim_aggregate statement (as the relay sends it)", &q);
        }
    }

    let desc = if mostly_sent {
        format!("{label} rows, 99% sent, vacuumed ({size})")
    } else {
        format!("{label} rows, all pending ({size})")
    };
    let med = |v: &[ClaimRun]| median(&v.iter().map(|r| r.exec_ms).collect::<Vec<_>>());
    ctx.progress(format!(
        "claim: {desc}: claim_none median {:.2} ms, claim_aggregate median {:.2} ms, naive poll median {:.1} ms",
        med(&c_none),
        med(&c_agg),
        median(&c_naive.times_ms)
    ));
    report_claims(
        ctx,
        &format!("claim_none_{which}"),
        &format!("claim_none (batch 500), {desc}"),
        &c_none,
    );
    report_claims(
        ctx,
        &format!("claim_aggregate_{which}"),
        &format!("claim_aggregate (batch 500), {desc}"),
        &c_agg,
    );
    ctx.report.figure(
        "7 claim cost",
        &format!("naive_poll_{which}_ms"),
        &format!("naive SELECT … ORDER BY created_at LIMIT 50, {desc}"),
        median(&c_naive.times_ms),
        "ms",
    );
    ctx.report
        .plan(&format!("naive poll on {desc}"), &c_naive.plan);
    ctx.report.detail(
        &format!("naive_poll_{which}"),
        json!({"rows": n, "size": size, "ms": c_naive.times_ms, "pages": c_naive.pages}),
    );
    Ok(())
}
