//! What the table's wake-up trigger costs the application's one-row inserts, in the three
//! states it can be in: disabled, enabled while no relay waits (a busy relay: no NOTIFY), and
//! enabled while a relay waits (an idle relay: every transaction notifies, as every
//! transaction did with schema version 1's trigger).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;

use crate::Ctx;
use crate::util::{median, payload, pg_connect};

/// The trigger's states, as measured.
const VARIANTS: [(&str, &str); 3] = [
    ("no_trigger", "trigger disabled"),
    (
        "wakeup_busy",
        "wake-up trigger, no relay waiting (relay busy)",
    ),
    (
        "wakeup_idle",
        "wake-up trigger, a relay waiting (every txn NOTIFYs, like v1)",
    ),
];

/// One-row insert transactions as fast as possible from `clients` connections for `secs`,
/// in each trigger state (rotating, three rounds).
pub async fn insert_cost(ctx: &mut Ctx) -> Result<()> {
    let table = ctx.new_table("insert").await?;
    let trigger = format!("{table}_wakeup");
    let secs = if ctx.args.quick { 2 } else { 3 };
    let sql = app_insert_sql(&table);
    let mut results: HashMap<(usize, &str), Vec<f64>> = HashMap::new();
    let sentinel = ctx.sentinel().await;
    for clients in [1usize, 8] {
        for round in 0..3 {
            for (variant, what) in VARIANTS {
                let action = if variant == "no_trigger" {
                    "DISABLE"
                } else {
                    "ENABLE"
                };
                // A waiting record as an idle relay writes it (alive for the whole burst).
                let waiter = if variant == "wakeup_idle" {
                    format!(
                        "INSERT INTO {table}_waiters (relay, pid, alive_until) \
                         VALUES ('bench', pg_backend_pid(), now() + interval '1 hour')"
                    )
                } else {
                    format!("DELETE FROM {table}_waiters")
                };
                ctx.pg
                    .batch_execute(&format!(
                        "ALTER TABLE {table} {action} TRIGGER {trigger}; {waiter}"
                    ))
                    .await?;
                let r = insert_burst(
                    &ctx.args.database_url,
                    &sql,
                    clients,
                    Duration::from_secs(secs),
                )
                .await?;
                ctx.pg
                    .batch_execute(&format!("DELETE FROM {table}_waiters"))
                    .await?;
                ctx.progress(format!(
                    "insert: {clients} connection(s), {what}: {r:.0} commits/s (round {})",
                    round + 1
                ));
                results.entry((clients, variant)).or_default().push(r);
            }
        }
    }
    ctx.check(sentinel).await?;
    for clients in [1usize, 8] {
        for (variant, what) in VARIANTS {
            let v = results
                .get(&(clients, variant))
                .map_or(f64::NAN, |v| median(v));
            let key = format!("insert_{variant}_c{clients}_per_s");
            let label = format!("app inserts (1 row/txn), {clients} connection(s), {what}");
            ctx.report
                .figure("8 insert cost", &key, &label, v, "rows/s");
        }
    }
    ctx.report.detail(
        "insert_cost",
        json!(
            results
                .iter()
                .map(|((c, variant), v)| (format!("c{c}_{variant}"), json!(v)))
                .collect::<serde_json::Map<_, _>>()
        ),
    );
    Ok(())
}

/// The application's one-row INSERT into `table`, as the README writes it: `$1` the aggregate
/// id, `$2` the payload as JSON text.
pub(super) fn app_insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb)"
    )
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
