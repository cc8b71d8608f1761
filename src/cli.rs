//! The operator commands other than `run`: `migrate`, `check`, `status`, `dead-letters`,
//! `tail`. `migrate`, `status` and `dead-letters` act on every configured outbox, or on the
//! one `--outbox NAME` selects.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use outbox_relay::config::{Config, OutboxConfig, PublisherConfig};
use outbox_relay::store::{DeadLetter, Selection, StatusCounts, StatusReport, Store, StoreError};

/// The outboxes a command acts on: every configured one, or the one `--outbox` names. An
/// unknown name is a usage error (the binary exits 2 with this sentence).
pub fn select<'a>(config: &'a Config, only: Option<&str>) -> Result<Vec<&'a OutboxConfig>> {
    let Some(name) = only else {
        return Ok(config.outboxes.iter().collect());
    };
    match config.outboxes.iter().find(|o| o.name == name) {
        Some(o) => Ok(vec![o]),
        None => bail!(
            "there is no outbox named {name:?} (the configured outboxes are {})",
            config
                .outboxes
                .iter()
                .map(|o| format!("{:?}", o.name))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// One selected outbox and its store; outboxes in the same database share one pool, as in
/// `run`.
struct Target<'a> {
    outbox: &'a OutboxConfig,
    store: Store,
}

impl Target<'_> {
    /// "cannot <verb> <table> on <url>", naming the outbox too when its name differs.
    fn context(&self, verb: &str) -> String {
        let table = self.outbox.database.table.to_string();
        let url = self.outbox.database.redacted_url();
        if self.outbox.name == table {
            format!("cannot {verb} {table} on {url}")
        } else {
            format!(
                "outbox {}: cannot {verb} {table} on {url}",
                self.outbox.name
            )
        }
    }
}

/// The selected outboxes with their stores (pools connect lazily: nothing is contacted here).
fn targets<'a>(config: &'a Config, only: Option<&str>) -> Result<Vec<Target<'a>>> {
    let selected = select(config, only)?;
    let stores = Store::for_outboxes(selected.iter().copied(), &config.relay.instance_id)?;
    let out: Vec<Target<'a>> = selected
        .into_iter()
        .zip(stores)
        .map(|(outbox, store)| Target { outbox, store })
        .collect();
    Ok(out)
}

/// [`targets`] whose tables exist: a missing one is an error that says to run `migrate` (what
/// `check` and `run` say), not the database's own "relation does not exist".
async fn existing_targets<'a>(config: &'a Config, only: Option<&str>) -> Result<Vec<Target<'a>>> {
    let targets = targets(config, only)?;
    for t in &targets {
        table_exists(t).await?;
    }
    Ok(targets)
}

/// `t`'s table exists, or the error `check` would give (run `migrate`).
async fn table_exists(t: &Target<'_>) -> Result<()> {
    t.store
        .plan_schema(false)
        .await
        .with_context(|| t.context("read"))?;
    Ok(())
}

/// `migrate [--print] [--outbox NAME]`.
pub async fn migrate(config: &Config, print: bool, only: Option<&str>) -> Result<()> {
    let selected = select(config, only)?;
    let several = selected.len() > 1;
    if print {
        for (i, o) in selected.iter().enumerate() {
            if several {
                if i > 0 {
                    println!();
                }
                println!("-- outbox {}: table {}\n", o.name, o.database.table);
            }
            print!("{}", Store::ddl_for(&o.database));
        }
        return Ok(());
    }
    for t in targets(config, only)? {
        let applied = t
            .store
            .migrate()
            .await
            .with_context(|| t.context("migrate"))?;
        let table = &t.outbox.database.table;
        let prefix = if several {
            format!("{}: ", t.outbox.name)
        } else {
            String::new()
        };
        if applied.is_empty() {
            println!("{prefix}{table} is up to date");
        } else {
            println!("{prefix}{table}: applied schema versions {applied:?}");
        }
        if let Some(pg) = t.store.as_postgres()
            && let Some(interval) = pg.partition_interval()
            && let Ok(Some(layout)) = pg.layout().await
        {
            let newest = layout.ranges().filter_map(|p| p.upper).max();
            println!(
                "{prefix}{table}: partitioned by created_at every {}, {} partitions{} and DEFAULT",
                humantime::format_duration(interval),
                layout.ranges().count(),
                newest.map_or(String::new(), |u| format!(" up to {u}"))
            );
        }
    }
    Ok(())
}

/// `check`: configuration (already validated by the time this runs), each outbox's database
/// and table, the broker.
pub async fn check(config: &Config) -> Result<()> {
    print_config_lines(config);
    let mut failed = false;
    let several = config.outboxes.len() > 1;
    for t in targets(config, None)? {
        let prefix = if several {
            format!("{}: ", t.outbox.name)
        } else {
            String::new()
        };
        if let Some(route) = &t.outbox.route {
            // The broker line shows the publisher's template; this outbox has its own.
            println!("{prefix}route: {:?} (this outbox's own)", route.as_str());
        }
        match check_database(&t, config.database.auto_migrate).await {
            Ok(line) => println!("{prefix}{line}"),
            Err(line) => {
                println!("{prefix}{line}");
                failed = true;
            }
        }
    }
    failed |= !check_broker(config).await;
    check_tracing(config).await;
    if failed {
        bail!("check failed");
    }
    Ok(())
}

/// `check`'s `config:` and `signing:` lines (the key id only: the key is never printed).
fn print_config_lines(config: &Config) {
    if let [only] = config.outboxes.as_slice() {
        println!(
            "config: ok (publisher {}, table {})",
            config.publisher.kind(),
            only.database.table
        );
    } else {
        println!(
            "config: ok (publisher {}, {} outboxes: {})",
            config.publisher.kind(),
            config.outboxes.len(),
            config
                .outboxes
                .iter()
                .map(|o| o.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    match &config.signing {
        Some(s) => println!(
            "signing: on (key id {}, {} byte key)",
            s.key_id,
            s.key.len()
        ),
        None => println!("signing: off"),
    }
}

/// `check`'s `broker:` line (and its warnings): whether the broker answered within 15 s.
async fn check_broker(config: &Config) -> bool {
    let publisher = outbox_relay::publish::build(config);
    let ok =
        match tokio::time::timeout(std::time::Duration::from_secs(15), publisher.connect()).await {
            Ok(Ok(())) => {
                println!("broker: ok ({})", publisher.describe());
                for advice in publisher.advisories() {
                    println!("broker: WARNING: {advice}");
                }
                true
            }
            Ok(Err(e)) => {
                println!("broker: FAILED: {e}");
                false
            }
            Err(_) => {
                println!(
                    "broker: FAILED: no answer within 15s ({})",
                    publisher.describe()
                );
                false
            }
        };
    publisher.close().await;
    ok
}

/// `check`'s `tracing:` line: off, or where spans go and whether the collector takes them. A
/// collector that does not is a warning, not a failure: the relay publishes without it and
/// counts the spans it drops.
async fn check_tracing(config: &Config) {
    let Some(t) = &config.tracing else {
        println!("tracing: off");
        return;
    };
    let what = format!(
        "{} to {}, service {}, sample ratio {}",
        t.protocol.as_str(),
        t.endpoint,
        t.service_name,
        t.sample_ratio
    );
    match collector_answer(t).await {
        Ok(()) => println!("tracing: ok ({what})"),
        Err(why) => println!(
            "tracing: WARNING: the collector {why}; until it does the relay drops its spans \
             (outbox_trace_spans_dropped_total) and publishes as usual ({what})"
        ),
    }
}

/// Whether the collector takes spans: over HTTP an empty export (an
/// `ExportTraceServiceRequest` of no spans is zero bytes) must be answered 2xx, which also
/// proves the path; over gRPC the endpoint must accept a connection. `Err` says what failed.
async fn collector_answer(t: &outbox_relay::config::TracingConfig) -> Result<(), String> {
    use outbox_relay::config::OtlpProtocol;
    const WITHIN: std::time::Duration = std::time::Duration::from_secs(5);
    match t.protocol {
        OtlpProtocol::HttpProtobuf => {
            let client = reqwest::Client::builder()
                .timeout(WITHIN)
                .build()
                .map_err(|e| format!("cannot be asked: {e}"))?;
            let reply = client
                .post(&t.endpoint)
                .header("content-type", "application/x-protobuf")
                .body(Vec::new())
                .send()
                .await
                .map_err(|e| {
                    format!(
                        "does not answer ({})",
                        outbox_relay::error_chain(&e.without_url())
                    )
                })?;
            let status = reply.status();
            if status.is_success() {
                Ok(())
            } else {
                Err(format!(
                    "answers {status} to an empty export (is the URL the traces endpoint?)"
                ))
            }
        }
        OtlpProtocol::Grpc => {
            let url = url::Url::parse(&t.endpoint).map_err(|e| format!("has no address: {e}"))?;
            let addrs = url
                .socket_addrs(|| Some(4317))
                .map_err(|e| format!("has no address: {e}"))?;
            match tokio::time::timeout(WITHIN, tokio::net::TcpStream::connect(&*addrs)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("does not accept a connection ({e})")),
                Err(_) => Err(format!("does not accept a connection within {WITHIN:?}")),
            }
        }
    }
}

/// The session of another relay with this relay's instance id that holds the table's instance
/// lock, as `run` would find it at start (`None`: free). The lock is taken on a session of its
/// own, let go when the session closes here.
async fn instance_lock_holder(store: &Store) -> Result<Option<String>, StoreError> {
    let session = store.bounded(store.lock_session()).await?;
    Ok(match store.bounded(session.lock(store)).await? {
        Err(Some(holder)) => Some(holder.to_string()),
        Ok(()) | Err(None) => None,
    })
}

/// One outbox's `database:` line: the same decision `run` makes at start, without changing
/// anything. `Err` carries the line of a failure.
async fn check_database(t: &Target<'_>, auto_migrate: bool) -> Result<String, String> {
    let url = t.outbox.database.redacted_url();
    let table = &t.outbox.database.table;
    if let Err(e) = t.store.ping().await {
        return Err(format!("database: FAILED ({url}): {e}"));
    }
    let plan = t
        .store
        .plan_schema(auto_migrate)
        .await
        .map_err(|e| format!("database: reachable, but {e}"))?;
    if !plan.table_exists {
        return Ok(format!(
            "database: ok ({url}; table {table} does not exist yet and will be created on start, database.auto_migrate = true)"
        ));
    }
    t.store
        .inspect()
        .await
        .map_err(|e| format!("database: reachable, but {e}"))?;
    t.store.may_write().await.map_err(|e| {
        if e.is_permission_denied() {
            format!(
                "database: reachable, but the relay's user may not update or delete rows of {table} ({e}): grant what {} lists for the relay",
                e.grants_doc()
            )
        } else {
            format!("database: reachable, but {e}")
        }
    })?;
    if let Some(holder) = instance_lock_holder(&t.store)
        .await
        .map_err(|e| format!("database: reachable, but {e}"))?
    {
        return Err(format!(
            "database: FAILED ({url}): another relay with relay.instance_id {:?} serves {table} (its session: {holder}): `run` would refuse to start; give every relay its own relay.instance_id (left unset it is the host name and pid), or stop the other relay first",
            t.store.instance_id()
        ));
    }
    let found = found_table(t, plan.partition).await;
    Ok(if !plan.behind.is_empty() {
        format!(
            "database: ok ({url}, {found}; schema versions {:?} not applied: run `outbox-relay migrate`)",
            plan.behind
        )
    } else if plan.apply.is_empty() {
        format!("database: ok ({url}, {found})")
    } else {
        format!(
            "database: ok ({url}, {found}; schema versions {:?} will be applied on start)",
            plan.apply
        )
    })
}

/// `check`'s words for a table that exists: plain or partitioned, and what `run` (or
/// `migrate`) will do about it; `partition_on_start` when `run` will partition it.
async fn found_table(t: &Target<'_>, partition_on_start: bool) -> String {
    let table = &t.outbox.database.table;
    let layout = match t.store.as_postgres() {
        Some(pg) => pg.layout().await.ok().flatten(),
        None => None,
    };
    match layout {
        Some(l) if l.partitioned => format!(
            "table {table} found, partitioned by created_at: range partitions {}, and DEFAULT",
            l.ranges().count()
        ),
        Some(_) if partition_on_start => {
            format!("table {table} found; it will be partitioned on start")
        }
        Some(_) if t.store.partition_interval().is_some() => format!(
            "table {table} found, plain although database.partition_interval is set: run `outbox-relay migrate` to partition it"
        ),
        _ => format!("table {table} found"),
    }
}

/// `status --json`: the totals in the contract's shape, plus the same per outbox.
#[derive(serde::Serialize)]
struct StatusJson {
    #[serde(flatten)]
    total: StatusReport,
    by_outbox: BTreeMap<String, StatusReport>,
}

/// The status of `t`'s table, when it exists (else what `check` would say of it).
async fn status_of(t: &Target<'_>) -> Result<StatusReport> {
    table_exists(t).await?;
    t.store.status().await.with_context(|| t.context("read"))
}

/// `status [--json] [--outbox NAME]`: every outbox it can read; one it cannot (its table
/// missing, its database down) is named on stderr and the command fails after printing the
/// others.
pub async fn status(config: &Config, json: bool, only: Option<&str>) -> Result<()> {
    let mut total = StatusReport::default();
    let mut by_outbox = Vec::new();
    let mut unread = Vec::new();
    for t in targets(config, only)? {
        let report = match status_of(&t).await {
            Ok(report) => report,
            Err(e) => {
                unread.push(outbox_relay::error_chain(e.as_ref()));
                continue;
            }
        };
        total.overall.add(&report.overall);
        for (ty, c) in &report.by_aggregate_type {
            total
                .by_aggregate_type
                .entry(ty.clone())
                .or_default()
                .add(c);
        }
        by_outbox.push((t.outbox.name.clone(), report));
    }
    if by_outbox.is_empty() && !unread.is_empty() {
        bail!("{}", unread.join("\n"));
    }
    print_status(json, total, by_outbox)?;
    if !unread.is_empty() {
        bail!(
            "the figures above leave out what could not be read:\n{}",
            unread.join("\n")
        );
    }
    Ok(())
}

/// Prints `status`'s table (or its JSON) of the outboxes read.
fn print_status(
    json: bool,
    total: StatusReport,
    by_outbox: Vec<(String, StatusReport)>,
) -> Result<()> {
    if json {
        let out = StatusJson {
            total,
            by_outbox: by_outbox.into_iter().collect(),
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if by_outbox.len() > 1 {
        counts_table(
            "OUTBOX",
            by_outbox.iter().map(|(n, r)| (n.as_str(), &r.overall)),
            None,
        );
        println!();
    }
    counts_table(
        "AGGREGATE TYPE",
        total.by_aggregate_type.iter().map(|(ty, c)| {
            (
                if ty.is_empty() {
                    "(empty)"
                } else {
                    ty.as_str()
                },
                c,
            )
        }),
        Some(&total.overall),
    );
    Ok(())
}

/// A header, one line per `(name, counts)`, then `TOTAL` when given: columns as wide as their
/// widest cell, names left-aligned, numbers right-aligned, no borders.
fn counts_table<'a>(
    first: &str,
    lines: impl Iterator<Item = (&'a str, &'a StatusCounts)>,
    total: Option<&StatusCounts>,
) {
    let mut table = comfy_table::Table::new();
    table
        .load_preset(comfy_table::presets::NOTHING)
        .set_header([
            first,
            "PENDING",
            "READY",
            "WAITING",
            "PROCESSING",
            "SENT",
            "FAILED",
            "EXPIRED",
            "BLOCKED",
            "OLDEST (s)",
        ]);
    let row = |name: &str, c: &StatusCounts| {
        let counts = [
            c.pending,
            c.ready,
            c.waiting,
            c.processing,
            c.sent,
            c.failed,
            c.expired,
            c.blocked_aggregates,
        ];
        let mut cells = vec![name.to_owned()];
        cells.extend(counts.iter().map(i64::to_string));
        cells.push(format!("{:.1}", c.oldest_pending_age_seconds));
        cells
    };
    for (name, c) in lines {
        table.add_row(row(name, c));
    }
    if let Some(c) = total {
        table.add_row(row("TOTAL", c));
    }
    for column in table.column_iter_mut() {
        column.set_padding((0, 2));
        if column.index > 0 {
            column.set_cell_alignment(comfy_table::CellAlignment::Right);
        }
    }
    println!("{}", table.trim_fmt());
}

/// One row of `dead-letters list --json`: the contract's keys plus its outbox.
#[derive(serde::Serialize)]
struct Listed<'a> {
    outbox: &'a str,
    #[serde(flatten)]
    row: DeadLetter,
}

/// `dead-letters list [--limit N] [--json] [--outbox NAME]`: outbox by outbox (in
/// configuration order), oldest first within each, at most `limit` rows in all.
pub async fn dead_letters_list(
    config: &Config,
    limit: i64,
    json: bool,
    only: Option<&str>,
) -> Result<()> {
    let targets = existing_targets(config, only).await?;
    let several = targets.len() > 1;
    let mut rows: Vec<Listed<'_>> = Vec::new();
    for t in &targets {
        let left = limit - i64::try_from(rows.len()).unwrap_or(i64::MAX);
        if left <= 0 {
            break;
        }
        let found = t
            .store
            .dead_letters(left)
            .await
            .with_context(|| t.context("read"))?;
        rows.extend(found.into_iter().map(|row| Listed {
            outbox: &t.outbox.name,
            row,
        }));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if rows.is_empty() {
        println!("no dead letters in {}", names(&targets));
        return Ok(());
    }
    for Listed { outbox, row: r } in &rows {
        let prefix = if several {
            format!("{outbox}  ")
        } else {
            String::new()
        };
        println!(
            "{prefix}{}  seq {}  {}/{}  {}  attempts {}  {}",
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

/// The selected outboxes' tables (one) or names (several), for messages.
fn names(targets: &[Target<'_>]) -> String {
    match targets {
        [one] => one.outbox.database.table.to_string(),
        several => format!(
            "outboxes {}",
            several
                .iter()
                .map(|t| t.outbox.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// What `dead-letters retry|discard` does to the dead letters it selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterAction {
    /// Back to `pending`, `attempts = 0`, `available_at = now()`.
    Retry,
    /// Deleted.
    Discard,
}

impl DeadLetterAction {
    /// The subcommand's name.
    fn verb(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Discard => "discard",
        }
    }

    /// What became of the rows, for the summary line.
    fn done(self) -> &'static str {
        match self {
            Self::Retry => "set back to pending",
            Self::Discard => "discarded",
        }
    }
}

/// `dead-letters retry|discard (--id ID… | --all) [--outbox NAME]`: all or nothing. Each id
/// is looked up in every selected outbox; when one is a dead letter in none of them, nothing
/// is changed and the error names it.
pub async fn dead_letters_apply(
    config: &Config,
    action: DeadLetterAction,
    sel: Selection,
    only: Option<&str>,
) -> Result<()> {
    let verb = action.verb();
    let targets = existing_targets(config, only).await?;
    let context = || format!("{verb} in {}", names(&targets));
    // Which outbox holds which id.
    let mut plan: Vec<(&Target<'_>, Selection)> = Vec::new();
    match &sel {
        Selection::All => plan.extend(targets.iter().map(|t| (t, Selection::All))),
        Selection::Ids(ids) if targets.len() == 1 => {
            plan.push((&targets[0], Selection::Ids(ids.clone())));
        }
        Selection::Ids(ids) => {
            let mut found = Vec::new();
            for t in &targets {
                let here = t
                    .store
                    .which_dead_letters(ids)
                    .await
                    .with_context(|| t.context("read"))?;
                found.extend_from_slice(&here);
                if !here.is_empty() {
                    plan.push((t, Selection::Ids(here)));
                }
            }
            StoreError::unless_all_dead(ids, &found)
                .map_err(anyhow::Error::from)
                .with_context(context)?;
        }
    }
    let mut changed = 0;
    for (t, sel) in plan {
        let done = match action {
            DeadLetterAction::Retry => t.store.retry_dead_letters(&sel).await,
            DeadLetterAction::Discard => t.store.discard_dead_letters(&sel).await,
        };
        changed += done
            .with_context(|| {
                if targets.len() > 1 {
                    format!("{verb} in outbox {}", t.outbox.name)
                } else {
                    context()
                }
            })?
            .len();
    }
    println!("{changed} dead letter(s) {}", action.done());
    Ok(())
}

/// What `tail` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TailSource {
    /// A RabbitMQ queue.
    RabbitMq {
        /// The broker URL.
        url: String,
        /// The queue.
        queue: String,
    },
    /// NATS subjects (a core subscription).
    Nats {
        /// The server URL.
        url: String,
        /// The subject patterns.
        subjects: Vec<String>,
    },
}

/// What `tail` reads and where, or why it cannot (a usage error): `--queue` goes with
/// RabbitMQ, `--subject` with NATS.
pub fn tail_source(
    config: &Config,
    queue: Option<&str>,
    subject: Option<&str>,
) -> Result<TailSource> {
    let kind = config.publisher.kind();
    if let PublisherConfig::Nats(n) = &config.publisher {
        if queue.is_some() {
            bail!(
                "--queue names a RabbitMQ queue, but publisher.kind is \"nats\": pass --subject PATTERN (or nothing: the subjects the relay publishes to)"
            );
        }
        let subjects = match subject {
            Some(pattern) => {
                if let Err(why) = outbox_relay::tail::nats::check_pattern(pattern) {
                    bail!("--subject {pattern:?} is not a NATS subject pattern: {why}");
                }
                vec![pattern.to_owned()]
            }
            None => outbox_relay::publish::nats::subject_filters(
                &outbox_relay::publish::nats_templates(config, n),
            ),
        };
        return Ok(TailSource::Nats {
            url: n.url.clone(),
            subjects,
        });
    }
    if subject.is_some() {
        bail!("--subject goes with publisher.kind = \"nats\", but publisher.kind is {kind:?}");
    }
    if let PublisherConfig::Redis(r) = &config.publisher {
        bail!(
            "tail reads a RabbitMQ queue or NATS subjects; with publisher.kind = \"redis\" watch the stream with `redis-cli -u <url> XREAD BLOCK 0 STREAMS <key> $` (keys from {:?}; see docs/redis.md)",
            r.stream.as_str()
        );
    }
    if let PublisherConfig::Http(_) = &config.publisher {
        bail!(
            "tail reads a RabbitMQ queue or NATS subjects; with publisher.kind = \"http\" watch the requests at the endpoint (docs/http.md shows a one-line endpoint that prints every request)"
        );
    }
    if let PublisherConfig::Kafka(k) = &config.publisher {
        bail!(
            "tail reads a RabbitMQ queue or NATS subjects; with publisher.kind = \"kafka\" watch the topic with a Kafka consumer, e.g. `kcat -C -b {} -t <topic> -f '%k %h: %s\\n'` (topics from {:?}; see docs/configuration.md#kafka)",
            outbox_relay::redact::redact_url(&k.brokers),
            k.topic.as_str()
        );
    }
    let PublisherConfig::RabbitMq(q) = &config.publisher else {
        bail!("tail reads a RabbitMQ queue or NATS subjects, but publisher.kind is {kind:?}");
    };
    match queue.or(q.declare_queue.as_deref()) {
        Some(name) => Ok(TailSource::RabbitMq {
            url: q.url.clone(),
            queue: name.to_owned(),
        }),
        None => {
            bail!("no queue to tail: pass --queue NAME or set publisher.rabbitmq.declare_queue")
        }
    }
}

/// `tail [--queue Q | --subject PATTERN] [--count N]`.
pub async fn tail(
    config: &Config,
    queue: Option<&str>,
    subject: Option<&str>,
    count: Option<u64>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<()> {
    let printed = match tail_source(config, queue, subject)? {
        TailSource::RabbitMq { url, queue } => {
            outbox_relay::tail::tail(&url, &queue, count, shutdown).await?
        }
        TailSource::Nats { url, subjects } => {
            outbox_relay::tail::tail_nats(&url, &subjects, count, shutdown).await?
        }
    };
    if let Some(c) = count.filter(|&c| printed < c) {
        bail!("stopped after {printed} of {c} message(s)");
    }
    Ok(())
}
