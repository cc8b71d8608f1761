//! What the table's NOTIFY trigger costs the application's one-row inserts.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;

use crate::Ctx;
use crate::util::{median, payload, pg_connect};

/// One-row insert transactions as fast as possible from `clients` connections for `secs`,
/// with the table's NOTIFY trigger enabled and disabled (alternating, twice each).
pub async fn insert_cost(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("insert").await?;
    let trigger = format!("{table}_notify");
    let secs = if ctx.args.quick { 2 } else { 3 };
    let sql = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb)"
    );
    let mut results: HashMap<(usize, bool), Vec<f64>> = HashMap::new();
    let sentinel = ctx.sentinel().await;
    for clients in [1usize, 8] {
        for round in 0..3 {
            for on in [true, false] {
                let action = if on { "ENABLE" } else { "DISABLE" };
                ctx.pg
                    .batch_execute(&format!("ALTER TABLE {table} {action} TRIGGER {trigger}"))
                    .await?;
                let r = insert_burst(
                    &ctx.args.database_url,
                    &sql,
                    clients,
                    Duration::from_secs(secs),
                )
                .await?;
                ctx.progress(format!(
                    "insert: {clients} connection(s), NOTIFY trigger {}: {r:.0} commits/s (round {})",
                    if on { "on" } else { "off" },
                    round + 1
                ));
                results.entry((clients, on)).or_default().push(r);
            }
        }
    }
    ctx.check(sentinel).await?;
    for clients in [1usize, 8] {
        for on in [true, false] {
            let v = results.get(&(clients, on)).map_or(f64::NAN, |v| median(v));
            let key = format!(
                "insert_{}_c{clients}_per_s",
                if on { "notify_trigger" } else { "no_trigger" }
            );
            let label = format!(
                "app inserts (1 row/txn), {clients} connection(s), NOTIFY trigger {}",
                if on { "on (as migrated)" } else { "disabled" }
            );
            ctx.report
                .figure("8 insert cost", &key, &label, v, "rows/s");
        }
    }
    ctx.report.detail(
        "insert_cost",
        json!(
            results
                .iter()
                .map(|((c, on), v)| (
                    format!("c{c}_{}", if *on { "trigger" } else { "no_trigger" }),
                    json!(v)
                ))
                .collect::<serde_json::Map<_, _>>()
        ),
    );
    Ok(())
}

async fn insert_burst(url: &str, sql: &str, clients: usize, secs: Duration) -> Result<f64> {
    let mut set = tokio::task::JoinSet::new();
    let start = Instant::now() + Duration::from_millis(200);
    for k in 0..clients {
        let client = pg_connect(url).await?;
        let sql = sql.to_owned();
        set.spawn(async move {
            let stmt = client.prepare(&sql).await?;
            tokio::time::sleep_until(start.into()).await;
            let end = start + secs;
            let mut n = 0u64;
            while Instant::now() < end {
                let i = n * clients as u64 + k as u64;
                let agg = crate::util::aggregate_id(i, 100);
                client.execute(&stmt, &[&agg, &payload(i, 100)]).await?;
                n += 1;
            }
            Ok::<u64, anyhow::Error>(n)
        });
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r??;
    }
    Ok(total as f64 / secs.as_secs_f64())
}
