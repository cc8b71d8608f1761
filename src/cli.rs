//! The operator commands other than `run`: `migrate`, `check`, `status`, `dead-letters`,
//! `tail`.

use anyhow::{Context, Result, bail};
use outbox_relay::config::{Config, PublisherConfig};
use outbox_relay::message::PayloadKind;
use outbox_relay::store::{Selection, Store, schema};

/// `migrate [--print]`.
pub async fn migrate(config: &Config, print: bool) -> Result<()> {
    if print {
        print!("{}", schema::full_ddl(&config.database.table));
        return Ok(());
    }
    let store = Store::new(&config.database, &config.relay.instance_id)?;
    let applied = store.migrate().await.with_context(|| {
        format!(
            "cannot migrate {} on {}",
            config.database.table,
            config.database.redacted_url()
        )
    })?;
    if applied.is_empty() {
        println!("{} is up to date", config.database.table);
    } else {
        println!(
            "{}: applied schema versions {:?}",
            config.database.table, applied
        );
    }
    Ok(())
}

/// `check`: configuration (already validated by the time this runs), database, broker.
pub async fn check(config: &Config) -> Result<()> {
    println!(
        "config: ok (publisher {}, table {})",
        config.publisher.kind(),
        config.database.table
    );
    // The key id only: the key itself is never printed.
    match &config.signing {
        Some(s) => println!(
            "signing: on (key id {}, {} byte key)",
            s.key_id,
            s.key.len()
        ),
        None => println!("signing: off"),
    }
    let mut failed = false;
    let store = Store::new(&config.database, &config.relay.instance_id)?;
    let url = config.database.redacted_url();
    let table = &config.database.table;
    // The same decision `run` makes at start, without changing anything.
    let kind = match store.ping().await {
        Ok(()) => match outbox_relay::plan_schema(&store, config.database.auto_migrate).await {
            Ok(plan) if !plan.table_exists => {
                println!(
                    "database: ok ({url}; table {table} does not exist yet and will be created on start, database.auto_migrate = true)"
                );
                PayloadKind::Json
            }
            Ok(plan) => match store.inspect().await {
                Ok((kind, _)) => {
                    if plan.apply.is_empty() {
                        println!("database: ok ({url}, table {table} found)");
                    } else {
                        println!(
                            "database: ok ({url}, table {table} found; schema versions {:?} will be applied on start)",
                            plan.apply
                        );
                    }
                    kind
                }
                Err(e) => {
                    println!("database: reachable, but {e}");
                    failed = true;
                    PayloadKind::Json
                }
            },
            Err(e) => {
                println!("database: reachable, but {e}");
                failed = true;
                PayloadKind::Json
            }
        },
        Err(e) => {
            println!("database: FAILED ({url}): {e}");
            failed = true;
            PayloadKind::Json
        }
    };
    let _ = kind;
    let publisher = outbox_relay::build_publisher(config);
    match tokio::time::timeout(std::time::Duration::from_secs(15), publisher.connect()).await {
        Ok(Ok(())) => println!("broker: ok ({})", publisher.describe()),
        Ok(Err(e)) => {
            println!("broker: FAILED: {e}");
            failed = true;
        }
        Err(_) => {
            println!(
                "broker: FAILED: no answer within 15s ({})",
                publisher.describe()
            );
            failed = true;
        }
    }
    publisher.close().await;
    if failed {
        bail!("check failed");
    }
    Ok(())
}

fn store(config: &Config) -> Result<Store> {
    Ok(Store::new(&config.database, &config.relay.instance_id)?)
}

fn db_context(config: &Config) -> String {
    format!(
        "cannot read {} on {}",
        config.database.table,
        config.database.redacted_url()
    )
}

/// `status [--json]`.
pub async fn status(config: &Config, json: bool) -> Result<()> {
    let report = store(config)?
        .status()
        .await
        .with_context(|| db_context(config))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{:<24} {:>9} {:>9} {:>9} {:>10} {:>10} {:>7} {:>8} {:>8} {:>12}",
        "AGGREGATE TYPE",
        "PENDING",
        "READY",
        "WAITING",
        "PROCESSING",
        "SENT",
        "FAILED",
        "EXPIRED",
        "BLOCKED",
        "OLDEST (s)"
    );
    let line = |name: &str, c: &outbox_relay::store::StatusCounts| {
        println!(
            "{:<24} {:>9} {:>9} {:>9} {:>10} {:>10} {:>7} {:>8} {:>8} {:>12.1}",
            name,
            c.pending,
            c.ready,
            c.waiting,
            c.processing,
            c.sent,
            c.failed,
            c.expired,
            c.blocked_aggregates,
            c.oldest_pending_age_seconds
        );
    };
    for (ty, c) in &report.by_aggregate_type {
        line(if ty.is_empty() { "(empty)" } else { ty }, c);
    }
    line("TOTAL", &report.overall);
    Ok(())
}

/// `dead-letters list [--limit N] [--json]`.
pub async fn dead_letters_list(config: &Config, limit: i64, json: bool) -> Result<()> {
    let rows = store(config)?
        .dead_letters(limit)
        .await
        .with_context(|| db_context(config))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no dead letters in {}", config.database.table);
        return Ok(());
    }
    for r in &rows {
        println!(
            "{}  seq {}  {}/{}  {}  attempts {}  {}",
            r.id,
            r.seq,
            r.aggregate_type,
            r.aggregate_id.as_deref().unwrap_or("-"),
            r.event_type,
            r.attempts,
            r.last_error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// `dead-letters retry|discard (--id ID… | --all)`: all or nothing.
pub async fn dead_letters_apply(config: &Config, retry: bool, sel: Selection) -> Result<()> {
    let store = store(config)?;
    let changed = if retry {
        store.retry_dead_letters(&sel).await
    } else {
        store.discard_dead_letters(&sel).await
    }
    .with_context(|| {
        format!(
            "{} in {}",
            if retry { "retry" } else { "discard" },
            config.database.table
        )
    })?;
    let verb = if retry {
        "set back to pending"
    } else {
        "discarded"
    };
    println!("{} dead letter(s) {verb}", changed.len());
    Ok(())
}

/// The queue `tail` reads and the broker URL, or why there is none (a usage error).
pub fn tail_queue(config: &Config, queue: Option<&str>) -> Result<(String, String)> {
    let PublisherConfig::RabbitMq(q) = &config.publisher else {
        bail!(
            "tail reads a RabbitMQ queue, but publisher.kind is {:?}",
            config.publisher.kind()
        );
    };
    match queue.or(q.declare_queue.as_deref()) {
        Some(name) => Ok((q.url.clone(), name.to_owned())),
        None => {
            bail!("no queue to tail: pass --queue NAME or set publisher.rabbitmq.declare_queue")
        }
    }
}

/// `tail [--queue Q] [--count N]`.
pub async fn tail(
    config: &Config,
    queue: Option<&str>,
    count: Option<u64>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<()> {
    let (url, queue) = tail_queue(config, queue)?;
    let printed = outbox_relay::tail::tail(&url, &queue, count, shutdown).await?;
    if let Some(c) = count.filter(|&c| printed < c) {
        bail!("stopped after {printed} of {c} message(s)");
    }
    Ok(())
}
