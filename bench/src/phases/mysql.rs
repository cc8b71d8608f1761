//! MySQL/MariaDB outboxes (`--only mysql`): the relay process draining N rows from MariaDB to
//! RabbitMQ, Kafka and NATS JetStream, ordering none and aggregate, each against its shared
//! ceiling measured in the same run: a bare mysql_async client running the relay's own claim
//! and mark-sent statements (`store::mysql::bench`, the texts the relay sends) from 4
//! connections, and each sink's bare client (the other phases' own); then commit → consume
//! latency at a steady insert rate with `poll_interval` 1s and 100ms.
//!
//! The bare client claims with the statement texts `store::mysql::bench` renders and settles
//! with the library's own `Store::mark_sent` (the relay's settle, text and all, on a pool of
//! its own per worker): the settle statements are not exported on their own.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder, Row, TxOpts};
use outbox_relay::config::{Ordering, TableName};
use outbox_relay::store::mysql::bench::{HotPathSql, SESSION_SETTINGS};
use outbox_relay::store::{OnConfirm, Store};
use serde_json::json;
use tokio::sync::{Mutex, Notify};
use uuid::Uuid;

use super::latency::RunEnd;
use super::{cpu_per_100k, cpu_text, rate, scrape};
use crate::Ctx;
use crate::flow::{Consumer, Flow};
use crate::util::{CpuSample, CpuUsage, Relay, aggregate_id, mysql_connect, payload};

/// The figures' section.
const PHASE: &str = "16 mysql";

/// Connections of the bare client, like pgbench's clients in phase 1.
const CLIENTS: usize = 4;

/// The relay's default batch (`relay.batch_size`).
const BATCH: usize = 500;

/// Rows per multi-row `INSERT` of the fill.
const FILL_CHUNK: usize = 1000;

/// The sinks the relay drains to, in order.
const SINKS: [&str; 3] = ["rabbitmq", "kafka", "nats"];

/// The bare MariaDB client (ordering none, aggregate), the sinks' bare clients, the six relay
/// drains, then the latency runs. Each measurement is retried after a service restart.
pub async fn mysql(ctx: &mut Ctx) -> Result<()> {
    let mut errors = Vec::new();
    let msgs = super::broker::synthetic(ctx.rows, ctx.args.aggregates);
    for ordering in [Ordering::None, Ordering::Aggregate] {
        let what = format!("mysql bare client, ordering {}", ordering_name(ordering));
        let result = ctx
            .measured(&what, async |ctx: &mut Ctx| bare_db(ctx, ordering).await)
            .await;
        note_error(ctx, &mut errors, &what, result);
    }
    for sink in SINKS {
        let what = format!("mysql: bare {sink} client");
        let result = ctx
            .measured(&what, async |ctx: &mut Ctx| match sink {
                "rabbitmq" => super::broker::raw_envelope_ceiling(ctx, &msgs).await,
                "kafka" => super::broker::kafka_bare_ceiling(ctx, &msgs).await,
                _ => super::nats::bare_ceiling(ctx).await.map(drop),
            })
            .await;
        note_error(ctx, &mut errors, &what, result);
    }
    for sink in SINKS {
        let mut rates = Vec::new();
        for ordering in [Ordering::None, Ordering::Aggregate] {
            let what = format!("mysql relay {sink}/{}", ordering_name(ordering));
            let rate = std::cell::Cell::new(f64::NAN);
            let result = ctx
                .measured(&what, async |ctx: &mut Ctx| {
                    rate.set(drain(ctx, sink, ordering).await?);
                    Ok(())
                })
                .await;
            note_error(ctx, &mut errors, &what, result);
            rates.push(rate.get());
        }
        if rates.iter().all(|r| r.is_finite()) {
            ctx.report.figure(
                PHASE,
                &format!("ratio_mysql_{sink}_aggregate_vs_none"),
                &format!("relay mysql → {sink}: aggregate / none"),
                rates[1] / rates[0],
                "×",
            );
        }
    }
    let bare = (
        ctx.report.get("mysql_bare_claim_mark_rows_per_s"),
        ctx.report.get("mysql_bare_claim_aggregate_mark_rows_per_s"),
    );
    if let (Some(none), Some(agg)) = bare {
        ctx.report.figure(
            PHASE,
            "ratio_mysql_bare_aggregate_vs_none",
            "bare MariaDB client: ordered claim / unordered claim",
            agg / none,
            "×",
        );
    }
    for poll in [Duration::from_secs(1), Duration::from_millis(100)] {
        let what = format!("mysql latency, poll {}", humantime::format_duration(poll));
        let result = ctx
            .measured(&what, async |ctx: &mut Ctx| latency_run(ctx, poll).await)
            .await;
        note_error(ctx, &mut errors, &what, result);
    }
    super::all_ok(errors)
}

fn note_error(ctx: &Ctx, errors: &mut Vec<String>, what: &str, result: Result<()>) {
    if let Err(e) = result {
        ctx.progress(format!("ERROR {what}: {e:#}"));
        errors.push(format!("{what}: {e:#}"));
    }
}

fn ordering_name(ordering: Ordering) -> &'static str {
    match ordering {
        Ordering::None => "none",
        Ordering::Aggregate => "aggregate",
    }
}

/// Inserts N pending rows into `table` with multi-row `INSERT`s of [`FILL_CHUNK`] rows in one
/// transaction: the bench's ~300 B order payload, aggregate ids round robin over
/// `--aggregates`, then `ANALYZE TABLE`.
async fn fill(ctx: &Ctx, table: &str) -> Result<()> {
    ctx.progress(format!("mysql: filling {} rows into {table}", ctx.rows));
    let aggregates = ctx.args.aggregates as u64;
    let mut conn = mysql_connect(&ctx.args.mysql_url).await?;
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let n = ctx.rows as u64;
    let mut i = 1;
    while i <= n {
        let end = (i + FILL_CHUNK as u64 - 1).min(n);
        let mut sql = format!(
            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) VALUES "
        );
        for j in i..=end {
            if j > i {
                sql.push(',');
            }
            // The payload and ids are digits, letters and JSON punctuation: no quote to escape.
            sql.push_str(&format!(
                "('order','{}','OrderPlaced','{}')",
                aggregate_id(j, aggregates),
                payload(j, aggregates)
            ));
        }
        tx.query_drop(sql)
            .await
            .with_context(|| format!("cannot fill {table}"))?;
        i = end + 1;
    }
    tx.commit().await?;
    conn.query_drop(format!("ANALYZE TABLE {table}")).await?;
    Ok(())
}

/// Row counts of `table` by status.
async fn status_counts(conn: &mut Conn, table: &str) -> Result<HashMap<String, i64>> {
    let rows: Vec<(String, i64)> = conn
        .query(format!(
            "SELECT status, COUNT(*) FROM {table} GROUP BY status"
        ))
        .await?;
    Ok(rows.into_iter().collect())
}

/// Fails unless exactly N rows of `table` are `sent` and no other row is there.
async fn verify_sent(ctx: &Ctx, table: &str) -> Result<()> {
    let mut conn = mysql_connect(&ctx.args.mysql_url).await?;
    let counts = status_counts(&mut conn, table).await?;
    let sent = counts.get("sent").copied().unwrap_or(0);
    if usize::try_from(sent).ok() != Some(ctx.rows) || counts.len() != 1 {
        bail!("{table}: expected {} rows sent, found {counts:?}", ctx.rows);
    }
    Ok(())
}

/// Waits until no row of `table` is `pending` or `processing` (an index probe every 50 ms);
/// `alive` is checked on every poll and ends the wait with its error.
async fn wait_drained(
    conn: &mut Conn,
    table: &str,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let sql =
        format!("SELECT EXISTS (SELECT 1 FROM {table} WHERE status IN ('pending', 'processing'))");
    let deadline = Instant::now() + timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let open: Option<bool> = conn.query_first(sql.as_str()).await?;
        if open == Some(false) {
            return Ok(());
        }
        alive()?;
        if Instant::now() > deadline {
            let counts = status_counts(conn, table).await.unwrap_or_default();
            bail!("{table} not drained after {timeout:?} (counts by status: {counts:?})");
        }
    }
}

/// Reports the CPU of MariaDB's server (process group `mariadb`) per 100k rows as
/// `<key>_mariadb_cpu_s_per_100k`.
fn mariadb_cpu_figure(ctx: &mut Ctx, key: &str, what: &str, elapsed: Duration, usage: &CpuUsage) {
    if let Some(cpu) = cpu_per_100k(usage, "mariadb", elapsed, ctx.rows) {
        ctx.report.figure(
            PHASE,
            &format!("{key}_mariadb_cpu_s_per_100k"),
            &format!("{what}: MariaDB CPU (user+sys) per 100k"),
            cpu,
            "s",
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The database ceiling: the relay's statements from a bare client

/// A session of the bare client: the relay's session settings, as its pool sets them.
async fn session(url: &str) -> Result<Conn> {
    let opts = mysql_async::Opts::from_url(url).context("--mysql-url")?;
    let opts = OptsBuilder::from_opts(opts).init(SESSION_SETTINGS.to_vec());
    Conn::new(opts)
        .await
        .context("cannot connect to MySQL/MariaDB (--mysql-url)")
}

/// [`CLIENTS`] workers drain a fresh N-row table with the relay's own statements: each makes
/// the relay's claim of [`BATCH`] rows in one transaction on its session (ordering none: ready
/// rows, mark claimed; ordering aggregate: candidates over the relay's scan window, the probe,
/// mark claimed, the rows), then the relay's mark-sent of those ids (`Store::mark_sent`). With ordering `aggregate` the
/// claims are made one at a time, as the relay's claim loop makes them (concurrent ordered
/// claims would mostly find each other's candidates locked); the mark-sents run beside them.
/// Reports `mysql_bare_claim[_aggregate]_mark_rows_per_s`, the machine's CPU per 100k (for
/// the shared ceilings) and MariaDB's.
async fn bare_db(ctx: &mut Ctx, ordering: Ordering) -> Result<()> {
    let name = ordering_name(ordering);
    let table = ctx.new_mysql_table(&format!("bare_{}", &name[..3])).await?;
    fill(ctx, &table).await?;
    let parsed = TableName::parse(&table).map_err(|e| anyhow!("table name {table}: {e}"))?;
    let sql = Arc::new(HotPathSql::new(&parsed));
    let mut conns = Vec::with_capacity(CLIENTS);
    for k in 0..CLIENTS {
        let instance = format!("outbox-bench-mysql-{k}");
        let url = ctx.args.mysql_url.clone();
        let config = ctx.config(&table, |raw| raw.database.url = url)?;
        let settle = Store::new(&config.database, &instance)?;
        // Its connection made before the clock starts.
        settle.ping().await?;
        conns.push((session(&ctx.args.mysql_url).await?, settle, instance));
    }
    let claims = Arc::new(Mutex::new(()));
    let settled = Arc::new(Notify::new());
    ctx.progress(format!(
        "mysql: bare client, {CLIENTS} connections, the relay's claim ({name}, batch {BATCH}) + mark sent"
    ));
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (conn, settle, instance) in conns {
        let worker = Worker {
            conn,
            settle,
            sql: Arc::clone(&sql),
            instance,
            claims: (ordering == Ordering::Aggregate).then(|| Arc::clone(&claims)),
            settled: Arc::clone(&settled),
            tally: Tally::default(),
        };
        tasks.spawn(worker.run());
    }
    let mut tally = Tally::default();
    while let Some(joined) = tasks.join_next().await {
        tally.add(&joined.map_err(|e| anyhow!("bare client task: {e}"))??);
    }
    let sent = tally.sent;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    if sent != ctx.rows {
        bail!(
            "bare client: {sent} rows marked sent, expected {}",
            ctx.rows
        );
    }
    verify_sent(ctx, &table).await?;
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "mysql: bare client ({name}): {r:.0} rows/s in {elapsed:.2?} ({} claims, {} held back, {} gates passed, {} probes of which {} met a locked row); {}",
        tally.claims,
        tally.held_back,
        tally.gated,
        tally.probes,
        tally.locked,
        cpu_text(&usage)
    ));
    let (key, what) = match ordering {
        Ordering::None => ("mysql_bare_claim_mark", "claim"),
        Ordering::Aggregate => ("mysql_bare_claim_aggregate_mark", "ordered claim"),
    };
    let label = format!(
        "bare mysql_async: the relay's {what} (batch {BATCH}) + mark sent, {CLIENTS} connections"
    );
    ctx.report
        .figure(PHASE, &format!("{key}_rows_per_s"), &label, r, "rows/s");
    super::machine_cpu_figure(ctx, PHASE, key, &label, (elapsed, &usage));
    mariadb_cpu_figure(ctx, key, &label, elapsed, &usage);
    ctx.report.detail(
        key,
        json!({"rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage,
               "connections": CLIENTS, "batch": BATCH, "claims": tally.claims,
               "held_back": tally.held_back, "gates_passed": tally.gated, "probes": tally.probes,
               "probes_locked": tally.locked}),
    );
    Ok(())
}

/// One connection of the bare client.
struct Worker {
    /// The claims' session.
    conn: Conn,
    /// The relay's settle (`Store::mark_sent`) as this worker's instance.
    settle: Store,
    sql: Arc<HotPathSql>,
    instance: String,
    /// With ordering `aggregate`: held while claiming (one claim at a time).
    claims: Option<Arc<Mutex<()>>>,
    /// Told after each mark-sent: an ordered claim that found only held-back candidates waits
    /// for it.
    settled: Arc<Notify>,
    tally: Tally,
}

/// What the bare client's workers did.
#[derive(Debug, Default)]
struct Tally {
    /// Rows marked sent.
    sent: usize,
    /// Claims that took rows.
    claims: usize,
    /// Ordered claims whose every candidate was held back.
    held_back: usize,
    /// Ordered claims whose gate passed (no aggregate probed).
    gated: usize,
    /// Probe statements (ordering aggregate).
    probes: usize,
    /// Probes that met a locked row (and were split, or held their aggregate back).
    locked: usize,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.sent += o.sent;
        self.claims += o.claims;
        self.held_back += o.held_back;
        self.gated += o.gated;
        self.probes += o.probes;
        self.locked += o.locked;
    }
}

impl Worker {
    /// Claims and marks sent until nothing is left to claim; returns what it did.
    async fn run(mut self) -> Result<Tally> {
        loop {
            let settled = Arc::clone(&self.settled);
            let next_settle = settled.notified();
            tokio::pin!(next_settle);
            next_settle.as_mut().enable();
            let claimed = match self.claims.clone() {
                None => self.claim_none().await?,
                Some(lock) => {
                    let _one_at_a_time = lock.lock().await;
                    self.claim_ordered().await?
                }
            };
            let ids = match claimed {
                Claimed::Rows(ids) => ids,
                Claimed::HeldBack => {
                    self.tally.held_back += 1;
                    // Every candidate waits for a row another connection is settling.
                    let _ = tokio::time::timeout(Duration::from_millis(50), next_settle).await;
                    continue;
                }
                Claimed::Nothing => return Ok(self.tally),
            };
            self.tally.claims += 1;
            let marked = self.settle.mark_sent(&ids, OnConfirm::MarkSent).await?;
            let marked = usize::try_from(marked).unwrap_or(0);
            if marked != ids.len() {
                bail!("mark sent updated {marked} of {} rows", ids.len());
            }
            self.tally.sent += marked;
            self.settled.notify_waiters();
        }
    }

    /// The relay's claim with ordering `none`: the ready rows (prepared), then mark claimed.
    async fn claim_none(&mut self) -> Result<Claimed> {
        let mut tx = self.conn.start_transaction(TxOpts::default()).await?;
        let limit = i64::try_from(BATCH)?;
        let rows: Vec<Row> = tx.exec(self.sql.claim_none(), (limit,)).await?;
        let mut seqs = Vec::with_capacity(rows.len());
        let mut ids = Vec::with_capacity(rows.len());
        for mut r in rows {
            seqs.push(take::<i64>(&mut r, 0)?);
            ids.push(parse_id(&take::<String>(&mut r, 1)?)?);
        }
        if !seqs.is_empty() {
            tx.query_drop(self.sql.mark_claimed(&seqs, &self.instance))
                .await?;
        }
        tx.commit().await?;
        Ok(if ids.is_empty() {
            Claimed::Nothing
        } else {
            Claimed::Rows(ids)
        })
    }

    /// The relay's claim with ordering `aggregate`, as the relay runs it
    /// ([`HotPathSql::claim_ordered`]: the candidates over the relay's scan window, the
    /// ordering guard, mark claimed and the rows taken).
    async fn claim_ordered(&mut self) -> Result<Claimed> {
        let mut tx = self.conn.start_transaction(TxOpts::default()).await?;
        let (rows, guarded) = self
            .sql
            .claim_ordered(&mut tx, BATCH, &self.instance)
            .await?;
        tx.commit().await?;
        self.tally.gated += usize::from(guarded.gate_passed);
        self.tally.probes += guarded.probes;
        self.tally.locked += guarded.locked;
        Ok(if !rows.is_empty() {
            Claimed::Rows(rows.iter().map(|r| r.id).collect())
        } else if guarded.candidates > 0 {
            Claimed::HeldBack
        } else {
            Claimed::Nothing
        })
    }
}

/// What a claim of the bare client found.
enum Claimed {
    /// The ids of the rows claimed.
    Rows(Vec<Uuid>),
    /// Ready rows, all held back by rows of their aggregates in flight.
    HeldBack,
    /// No ready row.
    Nothing,
}

fn take<T: mysql_async::prelude::FromValue>(row: &mut Row, i: usize) -> Result<T> {
    match row.take_opt::<T, usize>(i) {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => bail!("column {i}: {e}"),
        None => bail!("column {i} missing"),
    }
}

fn parse_id(text: &str) -> Result<Uuid> {
    Uuid::parse_str(text).with_context(|| format!("row id {text:?}"))
}

// ---------------------------------------------------------------------------------------------
// The relay's drains

/// The relay's environment for the MySQL table `table`.
fn relay_env(ctx: &Ctx, table: &str) -> Vec<(String, String)> {
    let mut env = ctx.relay_env(table);
    env.retain(|(k, _)| k != "RELAY_DATABASE__URL");
    env.push(("RELAY_DATABASE__URL".into(), ctx.args.mysql_url.clone()));
    env
}

/// The relay process draining a fresh N-row MariaDB table to `sink` with `ordering`; msgs/s.
async fn drain(ctx: &mut Ctx, sink: &str, ordering: Ordering) -> Result<f64> {
    let name = ordering_name(ordering);
    let key = format!("relay_mysql_{sink}_{name}");
    let short = format!("{}_{}", &sink[..3], &name[..3]);
    let table = ctx.new_mysql_table(&short).await?;
    fill(ctx, &table).await?;
    let mut env = relay_env(ctx, &table);
    env.push(("RELAY_RELAY__ORDERING".into(), name.into()));
    env.push(("RELAY_PUBLISHER__KIND".into(), sink.into()));
    let mut queue = None;
    let mut stream = None;
    match sink {
        "rabbitmq" => {
            let binding = ctx.new_binding(&format!("my_{short}")).await?;
            env.push((
                "RELAY_PUBLISHER__RABBITMQ__EXCHANGE".into(),
                binding.clone(),
            ));
            queue = Some(binding);
        }
        "kafka" => {
            let topic = ctx.new_topic(&format!("my_{short}")).await?;
            env.push(("RELAY_PUBLISHER__KAFKA__TOPIC".into(), topic));
        }
        _ => {
            let url = super::nats::nats_url();
            let js = super::nats::jetstream(&url).await?;
            let (name, prefix) =
                super::nats::new_stream(&js, &format!("mysql_{short}"), &ctx.run_id).await?;
            env.push(("RELAY_PUBLISHER__NATS__URL".into(), url));
            env.push((
                "RELAY_PUBLISHER__NATS__SUBJECT".into(),
                format!("{prefix}.{{aggregate_type}}.{{event_type}}"),
            ));
            stream = Some((js, name));
        }
    }
    let drained = drain_table(ctx, &key, env, &table).await;
    if let Some((js, name)) = stream {
        let _ = js.delete_stream(&name).await;
    }
    let (elapsed, usage) = drained?;
    if let Some(q) = &queue {
        let queued = ctx.rabbit().await?.queue_len(q).await? as usize;
        if queued != ctx.rows {
            ctx.report.note(format!(
                "{key}: queue holds {queued} messages for {} rows",
                ctx.rows
            ));
        }
    }
    let r = rate(ctx.rows, elapsed);
    ctx.progress(format!(
        "{key}: {r:.0} msgs/s in {elapsed:.2?}; {}",
        cpu_text(&usage)
    ));
    let what = match ordering {
        Ordering::None => format!("relay process, MariaDB → {sink}, ordering none"),
        Ordering::Aggregate => format!(
            "relay process, MariaDB → {sink}, ordering aggregate ({} aggregates)",
            ctx.args.aggregates
        ),
    };
    ctx.report
        .figure(PHASE, &format!("{key}_msgs_per_s"), &what, r, "msgs/s");
    if let Some(cpu) = cpu_per_100k(&usage, "relay", elapsed, ctx.rows) {
        ctx.report.figure(
            PHASE,
            &format!("{key}_cpu_s_per_100k"),
            &format!("{what}: relay CPU (user+sys) per 100k msgs"),
            cpu,
            "s",
        );
    }
    mariadb_cpu_figure(ctx, &key, &what, elapsed, &usage);
    Ok(r)
}

/// Spawns the relay with `env`, waits until `table` is drained, stops it and checks the run
/// (clean exit, exactly N rows sent); returns the time from spawn to drained and the CPU used.
async fn drain_table(
    ctx: &mut Ctx,
    key: &str,
    mut env: Vec<(String, String)>,
    table: &str,
) -> Result<(Duration, CpuUsage)> {
    let metrics_port = ctx.metrics_port(&mut env)?;
    env.extend(ctx.extra_env.iter().cloned());
    let mut poll = mysql_connect(&ctx.args.mysql_url).await?;
    ctx.progress(format!("{key}: relay process draining"));
    let log = ctx.dir.join(format!("{key}.log"));
    let sentinel = ctx.sentinel().await;
    let cpu = CpuSample::take();
    let started = Instant::now();
    let mut relay = Relay::spawn(key, &env, &log)?;
    super::profile_if_asked(ctx, &mut relay, key)?;
    let waited = wait_drained(&mut poll, table, ctx.timeout(), || relay.check_alive()).await;
    let elapsed = started.elapsed();
    let usage = cpu.usage();
    let rss = relay.peak_rss_kib();
    let metrics = scrape(metrics_port).await;
    super::stop_checked(ctx, &mut relay, sentinel, waited).await?;
    verify_sent(ctx, table).await?;
    if let Some(k) = rss {
        ctx.peak_rss_kib = ctx.peak_rss_kib.max(k);
    }
    ctx.report.detail(
        key,
        json!({
            "rows": ctx.rows, "seconds": elapsed.as_secs_f64(), "cpu": usage,
            "peak_rss_mib": rss.map(|k| k as f64 / 1024.0),
            "extra_env": crate::masked_env(&ctx.extra_env), "relay_metrics": metrics,
        }),
    );
    Ok((elapsed, usage))
}

// ---------------------------------------------------------------------------------------------
// Latency

/// Commit → consumer receive on RabbitMQ, ordering aggregate over 100 aggregates, with
/// `poll_interval` `poll` (MySQL outboxes have no wake-up: the relay polls): as phase 5, 8
/// connections inserting one row per autocommit transaction at the latency rate.
async fn latency_run(ctx: &mut Ctx, poll: Duration) -> Result<()> {
    let poll_text = humantime::format_duration(poll).to_string();
    let key = format!("latency_mysql_poll_{poll_text}");
    let table = ctx.new_mysql_table(&format!("lat_{poll_text}")).await?;
    let name = ctx.new_binding(&format!("my_lat_{poll_text}")).await?;
    const AGGREGATES: u64 = 100;
    let sentinel = ctx.sentinel().await;
    let flow = Flow::new();
    let consumer = Consumer::rabbitmq(&ctx.args.amqp_url, &name, Arc::clone(&flow)).await?;
    let mut env = relay_env(ctx, &table);
    env.push(("RELAY_RELAY__POLL_INTERVAL".into(), poll_text.clone()));
    let (mut relay, metrics_port) = super::latency::spawn_relay(ctx, &key, env, &name)?;

    let insert_sql = format!(
        "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (?, 'order', ?, 'OrderPlaced', ?)"
    );
    let mut warm = mysql_connect(&ctx.args.mysql_url).await?;
    let id = Uuid::new_v4();
    warm.exec_drop(
        insert_sql.as_str(),
        (
            id.hyphenated().to_string(),
            "warmup",
            payload(0, AGGREGATES),
        ),
    )
    .await?;
    flow.warm_up(&[id], &mut relay).await?;

    let (rate_per_s, total, period, workers) = super::latency::pace(ctx);
    ctx.progress(format!(
        "mysql latency, poll {poll_text}: inserting {total} rows at {rate_per_s}/s over {AGGREGATES} aggregates ({workers} connections)"
    ));
    let mut conns = Vec::new();
    for _ in 0..workers {
        conns.push(mysql_connect(&ctx.args.mysql_url).await?);
    }
    let cpu = CpuSample::take();
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut tasks = tokio::task::JoinSet::new();
    for (k, conn) in conns.into_iter().enumerate() {
        tasks.spawn(insert_worker(
            conn,
            insert_sql.clone(),
            (k as u64, workers, total),
            (start, period),
            AGGREGATES,
            Arc::clone(&flow),
        ));
    }
    let commits = super::latency::join_inserters(tasks, &mut relay).await?;
    let window = super::latency::since(start, commits.iter().copied());
    let end = RunEnd {
        key: &key,
        sentinel,
        commits: commits.len(),
        metrics_port,
        cpu,
    };
    let e = end.finish(ctx, &flow, relay, consumer).await?;
    let (p50, p95, p99, max) = (e.p50, e.p95, e.p99, e.max);
    let achieved = commits.len() as f64 / window.as_secs_f64().max(1e-9);
    ctx.progress(format!(
        "mysql latency, poll {poll_text}: p50 {p50:.1} ms, p95 {p95:.1} ms, p99 {p99:.1} ms, max {max:.1} ms \
         ({} msgs, achieved {achieved:.0} inserts/s); {}",
        e.lat.len(),
        cpu_text(&e.usage)
    ));
    let label = format!("MariaDB → RabbitMQ commit → consume, poll_interval {poll_text}");
    ctx.report.figure(
        PHASE,
        &format!("{key}_achieved_inserts_per_s"),
        &format!("{label}: insert rate achieved (target {rate_per_s}/s)"),
        achieved,
        "rows/s",
    );
    for (p, v) in [("p50", p50), ("p95", p95), ("p99", p99)] {
        ctx.report.figure(
            PHASE,
            &format!("{key}_{p}_ms"),
            &format!("{label}, {p}"),
            v,
            "ms",
        );
    }
    ctx.report.detail(
        &key,
        json!({
            "rate_per_s": rate_per_s, "seconds": ctx.lat_secs, "messages": e.lat.len(),
            "achieved_inserts_per_s": achieved, "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "max_ms": max, "cpu": e.usage, "relay_metrics": e.metrics,
        }),
    );
    Ok(())
}

/// Inserts rows `k, k+workers, …` below `total`, each at `start + i·period`, one row per
/// autocommit transaction (its id made here, so the insert is one statement), reporting each
/// commit to `flow`; returns the commit instants.
async fn insert_worker(
    mut conn: Conn,
    sql: String,
    (k, workers, total): (u64, u64, u64),
    (start, period): (tokio::time::Instant, Duration),
    aggregates: u64,
    flow: Arc<Flow>,
) -> Result<Vec<Instant>> {
    let stmt = conn.prep(sql.as_str()).await?;
    let mut out = Vec::with_capacity((total / workers.max(1) + 1) as usize);
    let mut i = k;
    while i < total {
        tokio::time::sleep_until(start + period.mul_f64(i as f64)).await;
        let id = Uuid::new_v4();
        let params = (
            id.hyphenated().to_string(),
            aggregate_id(i, aggregates),
            payload(i + 1, aggregates),
        );
        conn.exec_drop(&stmt, params).await?;
        let at = Instant::now();
        flow.committed(&[id], at);
        out.push(at);
        i += workers;
    }
    Ok(out)
}
