//! The operator commands other than `run`: `migrate` and `check`.

use anyhow::{Context, Result, bail};
use outbox_relay::config::Config;
use outbox_relay::store::{PayloadKind, Store, schema};

/// `migrate [--print]`.
pub async fn migrate(config: &Config, print: bool) -> Result<()> {
    if print {
        print!("{}", schema::full_ddl(&config.database.table));
        return Ok(());
    }
    let store = Store::new(&config.database, &config.relay.instance_id)?;
    let applied = store.migrate().await.with_context(|| {
        format!("cannot migrate {} on {}", config.database.table, config.database.redacted_url())
    })?;
    if applied.is_empty() {
        println!("{} is up to date", config.database.table);
    } else {
        println!("{}: applied schema versions {:?}", config.database.table, applied);
    }
    Ok(())
}

/// `check`: configuration (already validated by the time this runs), database, broker.
pub async fn check(config: &Config) -> Result<()> {
    println!("config: ok (publisher {}, table {})", config.publisher.kind(), config.database.table);
    let mut failed = false;
    let store = Store::new(&config.database, &config.relay.instance_id)?;
    let kind = match store.ping().await {
        Ok(()) => match store.inspect().await {
            Ok((kind, _)) => {
                println!("database: ok ({}, table {} found)", config.database.redacted_url(), config.database.table);
                kind
            }
            Err(e) => {
                println!("database: reachable, but {e}");
                failed = true;
                PayloadKind::Json
            }
        },
        Err(e) => {
            println!("database: FAILED ({}): {e}", config.database.redacted_url());
            failed = true;
            PayloadKind::Json
        }
    };
    let publisher = outbox_relay::build_publisher(config, kind)?;
    match tokio::time::timeout(std::time::Duration::from_secs(15), publisher.connect()).await {
        Ok(Ok(())) => println!("broker: ok ({})", publisher.describe()),
        Ok(Err(e)) => {
            println!("broker: FAILED: {e}");
            failed = true;
        }
        Err(_) => {
            println!("broker: FAILED: no answer within 15s ({})", publisher.describe());
            failed = true;
        }
    }
    publisher.close().await;
    if failed {
        bail!("check failed");
    }
    Ok(())
}
