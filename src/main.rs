//! The `outbox-relay` binary: parse the command line, load the configuration, set up logging
//! and signals, and hand over to the library.

// No function of the relay over 60 lines (clippy.toml sets the threshold).
#![warn(clippy::too_many_lines)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use outbox_relay::config::{Config, ConfigSource};
use tokio_util::sync::CancellationToken;

mod cli;

use cli::DeadLetterAction;

/// Transactional outbox relay: PostgreSQL outbox table → RabbitMQ, Kafka, NATS, Redis or HTTP.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about)]
struct Cli {
    /// Configuration file (default ./relay.toml if present; env RELAY_CONFIG).
    #[arg(long, global = true, env = "RELAY_CONFIG")]
    config: Option<PathBuf>,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "RELAY_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the relay daemon until SIGTERM/SIGINT.
    Run,
    /// Apply the schema in sql/ to each outbox's table (idempotent).
    Migrate {
        /// Print the DDL of each outbox's table instead of applying it.
        #[arg(long)]
        print: bool,
        #[command(flatten)]
        outbox: OutboxArg,
    },
    /// Validate the configuration, then connect to the database and the broker.
    Check,
    /// Show row counts by status, the lag and dead letters, overall and per aggregate type.
    Status {
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        outbox: OutboxArg,
    },
    /// Print every message arriving: on a RabbitMQ queue (development; consumes them), or on
    /// NATS subjects (a core subscription; takes nothing from the stream).
    Tail {
        /// RabbitMQ: the queue to consume (default: publisher.rabbitmq.declare_queue).
        #[arg(long, conflicts_with = "subject")]
        queue: Option<String>,
        /// NATS: the subject pattern to subscribe to (default: the subjects the relay
        /// publishes to, e.g. `outbox.>`).
        #[arg(long, value_name = "PATTERN")]
        subject: Option<String>,
        /// Stop after this many messages (default: until Ctrl-C).
        #[arg(long)]
        count: Option<u64>,
    },
    /// Inspect, retry or discard dead letters (rows in status `failed`).
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLetters),
}

#[derive(Debug, Subcommand)]
enum DeadLetters {
    /// List dead letters, oldest first.
    List {
        /// At most this many rows in all (outbox by outbox, in configuration order); at least 1.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        outbox: OutboxArg,
    },
    /// Set dead letters back to pending with attempts reset (unblocks their aggregate).
    Retry {
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        outbox: OutboxArg,
    },
    /// Delete dead letters for good (unblocks their aggregate).
    Discard {
        #[command(flatten)]
        which: Which,
        #[command(flatten)]
        outbox: OutboxArg,
    },
}

/// `--outbox NAME`: act on one outbox instead of all of them.
#[derive(Debug, clap::Args)]
struct OutboxArg {
    /// Act on this outbox only (a name from [[outboxes]]; default: every outbox).
    #[arg(long = "outbox", value_name = "NAME")]
    name: Option<String>,
}

#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct Which {
    /// Row ids.
    #[arg(long = "id", num_args = 1..)]
    ids: Vec<uuid::Uuid>,
    /// Every dead letter (of every selected outbox).
    #[arg(long)]
    all: bool,
}

impl Which {
    fn selection(self) -> outbox_relay::store::Selection {
        if self.all {
            outbox_relay::store::Selection::All
        } else {
            outbox_relay::store::Selection::Ids(self.ids)
        }
    }
}

/// Logs to stderr; `RUST_LOG` when set, else info. lapin is off by default: every error it
/// meets reaches the relay as an error value, logged with what the relay does about it,
/// while lapin's own lines ("aborting recovery") would say otherwise.
fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,lapin=off,rdkafka=warn,tokio_postgres=warn")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> ExitCode {
    let args = Cli::parse();
    init_tracing(args.log_format);
    let source = match args.config {
        Some(path) => ConfigSource::Explicit(path),
        None => ConfigSource::Default,
    };
    let config = match Config::load(&source) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let only = match usage_errors(&config, &args.command) {
        Ok(only) => only,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(execute(args.command, config, only.as_deref())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-relay: {}", outbox_relay::error_chain(e.as_ref()));
            ExitCode::from(1)
        }
    }
}

/// The usage errors (exit 2) found before connecting: a tail with nothing to read, an
/// unknown `--outbox`. Returns the `--outbox` given, if any.
fn usage_errors(config: &Config, command: &Command) -> anyhow::Result<Option<String>> {
    if let Command::Tail { queue, subject, .. } = command {
        cli::tail_source(config, queue.as_deref(), subject.as_deref())?;
    }
    // Only the commands that serve the console (or vouch for `run`) need its token.
    if matches!(command, Command::Run | Command::Check) {
        config.console.ready_to_serve()?;
        outbox_relay::publish::check_settings(config)?;
    }
    let only = match command {
        Command::Migrate { outbox, .. }
        | Command::Status { outbox, .. }
        | Command::DeadLetters(
            DeadLetters::List { outbox, .. }
            | DeadLetters::Retry { outbox, .. }
            | DeadLetters::Discard { outbox, .. },
        ) => outbox.name.clone(),
        _ => None,
    };
    cli::select(config, only.as_deref())?;
    Ok(only)
}

/// Runs `command` (on the outbox `only`, when given) to its end.
async fn execute(command: Command, config: Config, only: Option<&str>) -> anyhow::Result<()> {
    match command {
        Command::Run => {
            let shutdown = CancellationToken::new();
            spawn_signal_handler(shutdown.clone());
            outbox_relay::run(config, shutdown)
                .await
                .map_err(anyhow::Error::from)
        }
        Command::Tail {
            queue,
            subject,
            count,
        } => {
            let shutdown = CancellationToken::new();
            spawn_signal_handler(shutdown.clone());
            cli::tail(
                &config,
                queue.as_deref(),
                subject.as_deref(),
                count,
                shutdown,
            )
            .await
        }
        Command::Migrate { print, .. } => cli::migrate(&config, print, only).await,
        Command::Check => cli::check(&config).await,
        Command::Status { json, .. } => cli::status(&config, json, only).await,
        Command::DeadLetters(DeadLetters::List { limit, json, .. }) => {
            cli::dead_letters_list(&config, limit, json, only).await
        }
        Command::DeadLetters(DeadLetters::Retry { which, .. }) => {
            cli::dead_letters_apply(&config, DeadLetterAction::Retry, which.selection(), only).await
        }
        Command::DeadLetters(DeadLetters::Discard { which, .. }) => {
            cli::dead_letters_apply(&config, DeadLetterAction::Discard, which.selection(), only)
                .await
        }
    }
}

/// Cancels `token` on the first SIGTERM or SIGINT.
fn spawn_signal_handler(token: CancellationToken) {
    tokio::spawn(async move {
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch SIGTERM");
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
            () = terminate => tracing::info!("SIGTERM: stopping"),
        }
        token.cancel();
    });
}
