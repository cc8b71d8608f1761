//! Database cost per message (`dbcost`, only when named in `--only`): what PostgreSQL pays for
//! the application's own inserts and for the relay's drain of them, per message, measured from
//! outside (issue #42's probe).
//!
//! Each case gets a fresh table. After a `CHECKPOINT`, the application inserts N rows, one per
//! transaction, from 4 connections with the README's INSERT (`aggregate_type`,
//! `aggregate_id`, `event_type`, `payload`; `--aggregates` aggregates). The table is then
//! analyzed and the relay binary drains it to the stdout sink (its output goes to the relay's
//! log file in the scratch directory) and is stopped. For the insert and for the drain (from
//! the relay's spawn until it has exited), per message:
//! - WAL bytes: `pg_current_wal_insert_lsn()` before and after (`pg_wal_lsn_diff`). The
//!   whole server's WAL, so anyone else's writes count too; with the full-page images among it
//!   (`pg_stat_wal.wal_fpi`, also server-wide) and a note when a checkpoint fell inside (its
//!   redo pointer moved: the pages touched afterwards are written whole once more);
//! - PostgreSQL CPU: the `postgres` process group of [`CpuSample`] (every backend and
//!   background process of the server), in µs, up to the end of the work while the sessions
//!   that did it are still open (the drain's: until the table is drained, before the relay
//!   stops);
//! - heap writes: `n_tup_ins`, `n_tup_upd`, `n_tup_hot_upd`, `n_tup_del` of
//!   `pg_stat_user_tables`, summed over the table's partitions, read once the sessions that
//!   wrote have ended (a backend flushes its statistics when it exits).
//!
//! The cases: the relay's defaults (ordering `aggregate`, retention 24h); the same on a table
//! without schema version 7's blocker index (the ordered claim probes each candidate's head,
//! as before version 7); the same on a table
//! whose fillfactor is reset to 100 (the full pages of schema version 4, before version 5 left
//! room on each page for the relay's updates); the defaults and ordering `none` with
//! retention `0s` on a table whose waiting index is replaced by schema version 5's open index
//! (version 6 keeps the rows in flight out of it); ordering `none` with
//! `cleanup.retention = "0s"` (rows deleted on confirm); the defaults on a table partitioned
//! by `database.partition_interval = "1h"` (created by `outbox-relay migrate`). Each drain is
//! also reported against the insert into the same table (`…_wal_vs_insert`).
//!
//! Before each case the bench idles 2 s and records what the server does without it (WAL
//! bytes per second, cores of its processes): other sessions on a shared server are in every
//! section's WAL and CPU, and this says how much.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::json;
use tokio_postgres::Client;

use super::insert::app_insert_sql;
use super::retention::{PARTITION_ENV, migrate};
use super::steady::{mib, sample_health};
use crate::Ctx;
use crate::util::{
    CpuSample, CpuUsage, Relay, aggregate_id, full_pages, no_blocker_index, open_index, payload,
    pg_connect, verify_sent, wait_drained,
};

/// The phase's name in the report.
const PHASE: &str = "18 dbcost";

/// The application's connections, each inserting its share of the rows.
const CONNECTIONS: usize = 4;

/// One relay configuration, drained from its own fresh table.
struct Case {
    /// In figure keys: `dbcost_relay_<key>_…`.
    key: &'static str,
    /// In the table's name (`bench_dbcost_<short>_<run id>`).
    short: &'static str,
    label: &'static str,
    /// The relay's variables besides the bench's own and the stdout sink.
    env: &'static [(&'static str, &'static str)],
    /// `database.partition_interval` of the table and the relay.
    partition_interval: Option<&'static str>,
    /// The table as an earlier schema version left it, for an A/B against the current one.
    earlier: Earlier,
}

/// Which earlier schema version a case's table is made to look like after `migrate`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Earlier {
    /// None: the current schema.
    No,
    /// The fillfactor reset to PostgreSQL's default (100): pages as schema version 4 left
    /// them, against version 5's room for updates.
    FullPages,
    /// Version 2's open index (every row neither sent nor expired, rows in flight included)
    /// in place of version 6's waiting index.
    OpenIndex,
    /// No blocker index (schema version 6): the ordered claim probes each candidate's head.
    NoBlockerIndex,
}

static CASES: [Case; 7] = [
    Case {
        key: "default",
        short: "df",
        label: "relay, defaults (ordering aggregate, retention 24h)",
        env: &[],
        partition_interval: None,
        earlier: Earlier::No,
    },
    Case {
        key: "default_probing",
        short: "pr",
        label: "relay, defaults, schema version 6's probing ordered claim (no blocker index)",
        env: &[],
        partition_interval: None,
        earlier: Earlier::NoBlockerIndex,
    },
    Case {
        key: "default_full_pages",
        short: "fp",
        label: "relay, defaults, fillfactor 100 (schema version 4's full pages)",
        env: &[],
        partition_interval: None,
        earlier: Earlier::FullPages,
    },
    Case {
        key: "default_open_index",
        short: "oi",
        label: "relay, defaults, schema version 5's open index",
        env: &[],
        partition_interval: None,
        earlier: Earlier::OpenIndex,
    },
    Case {
        key: "none_0s_open_index",
        short: "o0",
        label: "relay, ordering none, retention 0s, schema version 5's open index",
        env: &[
            ("RELAY_RELAY__ORDERING", "none"),
            ("RELAY_CLEANUP__RETENTION", "0s"),
        ],
        partition_interval: None,
        earlier: Earlier::OpenIndex,
    },
    Case {
        key: "none_0s",
        short: "n0",
        label: "relay, ordering none, retention 0s",
        env: &[
            ("RELAY_RELAY__ORDERING", "none"),
            ("RELAY_CLEANUP__RETENTION", "0s"),
        ],
        partition_interval: None,
        earlier: Earlier::No,
    },
    Case {
        key: "partitioned",
        short: "pt",
        label: "relay, defaults, partitioned 1h",
        env: &[],
        partition_interval: Some("1h"),
        earlier: Earlier::No,
    },
];

/// The server's counters at the start of a section, and the table's.
struct Counters {
    /// `pg_current_wal_insert_lsn()` as text.
    lsn: String,
    wal_records: i64,
    wal_fpi: i64,
    /// The last checkpoint's redo pointer as text.
    redo: String,
    tuples: Tuples,
}

/// The table's row counters (`pg_stat_user_tables`), summed over its partitions.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
struct Tuples {
    ins: i64,
    upd: i64,
    hot_upd: i64,
    del: i64,
}

/// What one section (the insert or the drain) cost, in total.
#[derive(Debug, Clone, serde::Serialize)]
struct Cost {
    messages: usize,
    seconds: f64,
    wal_bytes: f64,
    wal_records: i64,
    wal_fpi: i64,
    /// A checkpoint began inside the section.
    checkpoint: bool,
    /// CPU seconds of the `postgres` process group.
    postgres_cpu_s: f64,
    tuples: Tuples,
    cpu: CpuUsage,
}

impl Cost {
    fn per_msg(&self, total: f64) -> f64 {
        total / self.messages.max(1) as f64
    }

    fn wal_per_msg(&self) -> f64 {
        self.per_msg(self.wal_bytes)
    }

    fn cpu_us_per_msg(&self) -> f64 {
        self.per_msg(self.postgres_cpu_s * 1e6)
    }
}

/// The insert into one case's table and the relay's drain of it.
struct CaseResult {
    case: &'static Case,
    quiet: Background,
    insert: Cost,
    relay: Cost,
    /// The table with its indexes (over its partitions) once drained, in bytes.
    table_bytes: i64,
}

/// Every case, one after the other, then the side-by-side table.
pub async fn dbcost(ctx: &mut Ctx) -> Result<()> {
    let mut done = Vec::new();
    let mut errors = Vec::new();
    let unknown: Vec<&String> = ctx
        .args
        .dbcost_cases
        .iter()
        .filter(|k| !CASES.iter().any(|c| c.key == k.as_str()))
        .collect();
    if !unknown.is_empty() {
        let known: Vec<&str> = CASES.iter().map(|c| c.key).collect();
        anyhow::bail!(
            "--dbcost-cases: no case named {unknown:?}; the cases are {}",
            known.join(", ")
        );
    }
    let chosen = |c: &&Case| {
        ctx.args.dbcost_cases.is_empty() || ctx.args.dbcost_cases.iter().any(|k| k == c.key)
    };
    let cases: Vec<&'static Case> = CASES.iter().filter(chosen).collect();
    for case in cases {
        let what = format!("dbcost {}", case.label);
        let run = async |ctx: &mut Ctx| case_run(ctx, case).await;
        done.extend(super::measure(ctx, &what, &mut errors, run, report_case).await);
    }
    report_summary(ctx, &done);
    super::all_ok(errors)
}

/// One case: a fresh table, the application's inserts into it, the relay's drain.
async fn case_run(ctx: &mut Ctx, case: &'static Case) -> Result<CaseResult> {
    let table = format!("bench_dbcost_{}_{}", case.short, ctx.run_id);
    migrate(ctx, &table, case.partition_interval).await?;
    match case.earlier {
        Earlier::No => {}
        Earlier::FullPages => full_pages(&ctx.pg, &table).await?,
        Earlier::OpenIndex => open_index(&ctx.pg, &table).await?,
        Earlier::NoBlockerIndex => no_blocker_index(&ctx.pg, &table).await?,
    }
    let sentinel = ctx.sentinel().await;
    if let Err(e) = ctx.pg.batch_execute("CHECKPOINT").await {
        ctx.progress(format!(
            "dbcost: CHECKPOINT refused ({e}); the insert may write full-page images"
        ));
    }
    let quiet = background(&ctx.pg).await?;
    ctx.progress(format!(
        "dbcost {}: before it, with nothing of the bench running, the server wrote {:.0} B/s of WAL and its processes used {:.2} cores",
        case.key, quiet.wal_bytes_per_s, quiet.postgres_cores
    ));
    ctx.progress(format!(
        "dbcost {}: the application inserts {} rows into {table}, one per transaction, from {CONNECTIONS} connections",
        case.key, ctx.rows
    ));
    let start = begin(&ctx.pg, &table).await?;
    let clients = insert_rows(ctx, &table).await?;
    let cpu = start.cpu();
    // Their sessions end now and flush their statistics.
    drop(clients);
    let insert = end(&ctx.pg, &table, (start, cpu), ctx.rows).await?;
    ctx.check(sentinel).await?;
    ctx.progress(format!(
        "dbcost {}: insert {}",
        case.key,
        cost_text(&insert)
    ));
    ctx.pg.batch_execute(&format!("ANALYZE {table}")).await?;

    let mut env = ctx.relay_env(&table);
    env.push(("RELAY_PUBLISHER__KIND".into(), "stdout".into()));
    env.extend(
        case.env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    if let Some(interval) = case.partition_interval {
        env.push((PARTITION_ENV.into(), interval.into()));
    }
    env.extend(ctx.extra_env.iter().cloned());
    let key = format!("dbcost_relay_{}", case.key);
    let log = ctx.dir.join(format!("{key}.log"));
    ctx.progress(format!(
        "dbcost {}: relay process draining to stdout ({})",
        case.key,
        log.display()
    ));
    let sentinel = ctx.sentinel().await;
    let start = begin(&ctx.pg, &table).await?;
    let mut relay = Relay::spawn(&key, &env, &log)?;
    let waited = wait_drained(&ctx.pg, &table, ctx.timeout(), || relay.check_alive()).await;
    let cpu = start.cpu();
    super::stop_checked(ctx, &mut relay, sentinel, waited).await?;
    let relay_cost = end(&ctx.pg, &table, (start, cpu), ctx.rows).await?;
    if case.env.contains(&("RELAY_CLEANUP__RETENTION", "0s")) {
        let left: i64 = ctx
            .pg
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await?
            .try_get(0)?;
        if left != 0 {
            bail!("{table}: {left} rows left after a drain that deletes on confirm");
        }
    } else {
        verify_sent(&ctx.pg, &table, ctx.rows).await?;
    }
    let table_bytes = sample_health(&ctx.pg, &table, None, 0.0).await?.total_bytes;
    Ok(CaseResult {
        case,
        quiet,
        insert,
        relay: relay_cost,
        table_bytes,
    })
}

/// Rows `0..N` into `table`, row `i` by connection `i % 4`, each its own transaction
/// (autocommit), aggregate `order-<i % aggregates>`; returns the connections, still open.
async fn insert_rows(ctx: &Ctx, table: &str) -> Result<Vec<Client>> {
    let sql = app_insert_sql(table);
    let (rows, aggregates) = (ctx.rows as u64, ctx.args.aggregates as u64);
    let mut set = tokio::task::JoinSet::new();
    for k in 0..CONNECTIONS as u64 {
        let client = pg_connect(&ctx.args.database_url).await?;
        let stmt = client.prepare(&sql).await?;
        set.spawn(async move {
            let mut i = k;
            while i < rows {
                client
                    .execute(
                        &stmt,
                        &[&aggregate_id(i, aggregates), &payload(i, aggregates)],
                    )
                    .await?;
                i += CONNECTIONS as u64;
            }
            Ok::<Client, anyhow::Error>(client)
        });
    }
    let mut clients = Vec::with_capacity(CONNECTIONS);
    while let Some(r) = set.join_next().await {
        clients.push(r??);
    }
    Ok(clients)
}

/// What the server does while the bench does nothing: other people's sessions on this shared
/// server, counted in every section's WAL and CPU too.
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Background {
    wal_bytes_per_s: f64,
    postgres_cores: f64,
}

/// The server's WAL rate and the CPU of its processes over [`BACKGROUND`] of the bench idle.
async fn background(pg: &Client) -> Result<Background> {
    let lsn: String = pg
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .try_get(0)?;
    let (cpu, at) = (CpuSample::take(), Instant::now());
    tokio::time::sleep(BACKGROUND).await;
    let usage = cpu.usage();
    let seconds = at.elapsed().as_secs_f64();
    let wal: f64 = pg
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8",
            &[&lsn],
        )
        .await?
        .try_get(0)?;
    Ok(Background {
        wal_bytes_per_s: wal / seconds,
        postgres_cores: usage.cores.get("postgres").copied().unwrap_or(0.0),
    })
}

/// How long [`background`] watches.
const BACKGROUND: Duration = Duration::from_secs(2);

/// Reads the counters of the server and of `table`.
async fn counters(pg: &Client, table: &str) -> Result<Counters> {
    let server = pg
        .query_one(
            "SELECT pg_current_wal_insert_lsn()::text, w.wal_records, w.wal_fpi, \
               (SELECT redo_lsn::text FROM pg_control_checkpoint()) \
             FROM pg_stat_wal w",
            &[],
        )
        .await?;
    Ok(Counters {
        lsn: server.try_get(0)?,
        wal_records: server.try_get(1)?,
        wal_fpi: server.try_get(2)?,
        redo: server.try_get(3)?,
        tuples: tuples(pg, table).await?,
    })
}

/// `table`'s row counters, summed over its partitions (found in `pg_inherits`).
async fn tuples(pg: &Client, table: &str) -> Result<Tuples> {
    pg.batch_execute("SELECT pg_stat_clear_snapshot()").await?;
    let row = pg
        .query_one(
            "WITH RECURSIVE tree(relid) AS ( \
               SELECT $1::text::regclass::oid \
               UNION ALL SELECT i.inhrelid FROM pg_inherits i JOIN tree t ON i.inhparent = t.relid) \
             SELECT coalesce(sum(s.n_tup_ins), 0)::int8, coalesce(sum(s.n_tup_upd), 0)::int8, \
               coalesce(sum(s.n_tup_hot_upd), 0)::int8, coalesce(sum(s.n_tup_del), 0)::int8 \
             FROM tree t JOIN pg_stat_user_tables s ON s.relid = t.relid",
            &[&table],
        )
        .await?;
    Ok(Tuples {
        ins: row.try_get(0)?,
        upd: row.try_get(1)?,
        hot_upd: row.try_get(2)?,
        del: row.try_get(3)?,
    })
}

/// The start of a section: the counters, then the CPU sample and the clock.
struct Start {
    counters: Counters,
    cpu: CpuSample,
    at: Instant,
}

impl Start {
    /// Seconds since the start and the CPU used meanwhile. Taken while the sessions that did
    /// the work are still open: a process that has exited is missing from the later sample,
    /// its CPU with it.
    fn cpu(&self) -> (f64, CpuUsage) {
        (self.at.elapsed().as_secs_f64(), self.cpu.usage())
    }
}

async fn begin(pg: &Client, table: &str) -> Result<Start> {
    let counters = counters(pg, table).await?;
    Ok(Start {
        counters,
        cpu: CpuSample::take(),
        at: Instant::now(),
    })
}

/// The end of a section that moved `messages`, its CPU already taken ([`Start::cpu`]): the
/// WAL at once, the statistics a second later (the writers' sessions have ended; their last
/// flush lands by then).
async fn end(
    pg: &Client,
    table: &str,
    (start, (seconds, cpu)): (Start, (f64, CpuUsage)),
    messages: usize,
) -> Result<Cost> {
    let wal_bytes: f64 = pg
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::float8",
            &[&start.counters.lsn],
        )
        .await?
        .try_get(0)?;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after = counters(pg, table).await?;
    let before = start.counters;
    let postgres_cpu_s = cpu.cores.get("postgres").copied().unwrap_or(0.0) * seconds;
    Ok(Cost {
        messages,
        seconds,
        wal_bytes,
        wal_records: after.wal_records - before.wal_records,
        wal_fpi: after.wal_fpi - before.wal_fpi,
        checkpoint: after.redo != before.redo,
        postgres_cpu_s,
        tuples: Tuples {
            ins: after.tuples.ins - before.tuples.ins,
            upd: after.tuples.upd - before.tuples.upd,
            hot_upd: after.tuples.hot_upd - before.tuples.hot_upd,
            del: after.tuples.del - before.tuples.del,
        },
        cpu,
    })
}

fn cost_text(c: &Cost) -> String {
    let t = &c.tuples;
    let per = |n: i64| c.per_msg(n as f64);
    format!(
        "{:.0} B WAL/msg ({:.2} full-page images/msg{}), PostgreSQL {:.1} µs/msg, \
         per msg {:.2} ins, {:.2} upd ({:.2} HOT), {:.2} del; {:.1} s; {}",
        c.wal_per_msg(),
        per(c.wal_fpi),
        if c.checkpoint {
            ", a checkpoint began inside"
        } else {
            ""
        },
        c.cpu_us_per_msg(),
        per(t.ins),
        per(t.upd),
        per(t.hot_upd),
        per(t.del),
        c.seconds,
        super::cpu_text(&c.cpu)
    )
}

/// The figures of one section under `prefix` (`dbcost_insert`, `dbcost_relay_default`, …).
fn report_cost(ctx: &mut Ctx, prefix: &str, what: &str, c: &Cost) {
    let t = &c.tuples;
    let per = |n: i64| c.per_msg(n as f64);
    let figures = [
        ("wal_bytes_per_msg", "WAL per message", c.wal_per_msg(), "B"),
        (
            "pg_cpu_us_per_msg",
            "PostgreSQL CPU per message",
            c.cpu_us_per_msg(),
            "µs",
        ),
        (
            "tup_ins_per_msg",
            "heap inserts per message",
            per(t.ins),
            "/msg",
        ),
        (
            "tup_upd_per_msg",
            "heap updates per message",
            per(t.upd),
            "/msg",
        ),
        (
            "tup_hot_upd_per_msg",
            "HOT updates per message",
            per(t.hot_upd),
            "/msg",
        ),
        (
            "tup_del_per_msg",
            "heap deletes per message",
            per(t.del),
            "/msg",
        ),
        (
            "wal_fpi_per_msg",
            "full-page images per message",
            per(c.wal_fpi),
            "/msg",
        ),
    ];
    for (key, label, value, unit) in figures {
        ctx.report.figure(
            PHASE,
            &format!("{prefix}_{key}"),
            &format!("{what}: {label}"),
            value,
            unit,
        );
    }
    if c.checkpoint {
        ctx.report.note(format!(
            "{prefix}: a checkpoint began during the section, so its WAL holds full-page images \
             of the pages touched after it"
        ));
    }
}

/// The figures of one case: its insert (as `dbcost_insert_…` for the first plain table and
/// `dbcost_insert_partitioned_…` for the partitioned one; the others in the details), its
/// drain, and the drain's WAL against the insert's.
fn report_case(ctx: &mut Ctx, r: &CaseResult) {
    let case = r.case;
    ctx.progress(format!(
        "dbcost {}: drain {}",
        case.key,
        cost_text(&r.relay)
    ));
    let insert_key = match case.key {
        "default" => Some(("dbcost_insert", "the application's INSERT (+ commit)")),
        "default_full_pages" => Some((
            "dbcost_insert_full_pages",
            "the application's INSERT (+ commit), fillfactor 100",
        )),
        "partitioned" => Some((
            "dbcost_insert_partitioned",
            "the application's INSERT (+ commit), partitioned 1h",
        )),
        _ => None,
    };
    if let Some((prefix, what)) = insert_key {
        report_cost(ctx, prefix, what, &r.insert);
    }
    let prefix = format!("dbcost_relay_{}", case.key);
    report_cost(ctx, &prefix, case.label, &r.relay);
    ctx.report.figure(
        PHASE,
        &format!("{prefix}_table_bytes"),
        &format!("{}: table and indexes once drained", case.label),
        r.table_bytes as f64,
        "B",
    );
    ctx.report.figure(
        PHASE,
        &format!("{prefix}_wal_vs_insert"),
        &format!(
            "{}: WAL per message / the application's insert into the same table",
            case.label
        ),
        r.relay.wal_per_msg() / r.insert.wal_per_msg(),
        "×",
    );
    ctx.report.figure(
        PHASE,
        &format!("{prefix}_cpu_vs_insert"),
        &format!(
            "{}: PostgreSQL CPU per message / the application's insert into the same table",
            case.label
        ),
        r.relay.cpu_us_per_msg() / r.insert.cpu_us_per_msg(),
        "×",
    );
    ctx.report.detail(
        &format!("dbcost_{}", case.key),
        json!({"background": r.quiet, "insert": r.insert, "relay": r.relay}),
    );
}

/// The side-by-side table, in the progress output and as a section of the report.
fn report_summary(ctx: &mut Ctx, done: &[CaseResult]) {
    if done.is_empty() {
        return;
    }
    let rows: Vec<(String, &Cost, Option<f64>)> = done
        .iter()
        .flat_map(|r| {
            let table = if r.case.partition_interval.is_some() {
                "partitioned 1h"
            } else {
                "plain"
            };
            [
                (
                    format!("app INSERT (+ commit), {table} [{}]", r.case.key),
                    &r.insert,
                    None,
                ),
                (
                    r.case.label.to_owned(),
                    &r.relay,
                    Some(r.relay.wal_per_msg() / r.insert.wal_per_msg()),
                ),
            ]
        })
        .collect();
    let w = super::label_width(rows.iter().map(|(l, _, _)| l.as_str()));
    let mut text = format!(
        "per message, {} rows, {CONNECTIONS} app connections, stdout sink\n\
         {:<w$} {:>7} {:>8} {:>6} {:>9} {:>5} {:>5} {:>5} {:>5}\n",
        ctx.rows, "", "WAL B", "× insert", "FPI", "PG CPU µs", "ins", "upd", "HOT", "del"
    );
    for (label, c, vs) in &rows {
        let t = &c.tuples;
        let per = |n: i64| c.per_msg(n as f64);
        text.push_str(&format!(
            "{label:<w$} {:>7.0} {:>8} {:>6.2} {:>9.1} {:>5.2} {:>5.2} {:>5.2} {:>5.2}{}\n",
            c.wal_per_msg(),
            vs.map_or("-".to_owned(), |v| format!("{v:.2}")),
            per(c.wal_fpi),
            c.cpu_us_per_msg(),
            per(t.ins),
            per(t.upd),
            per(t.hot_upd),
            per(t.del),
            if c.checkpoint {
                "  (checkpoint inside)"
            } else {
                ""
            }
        ));
    }
    for r in done {
        text.push_str(&format!(
            "after [{}]: table and indexes {:.1} MiB\n",
            r.case.key,
            mib(r.table_bytes)
        ));
    }
    for r in done {
        text.push_str(&format!(
            "before [{}]: the server alone wrote {:.0} B/s of WAL, its processes used {:.2} cores \
             (in the figures above too)\n",
            r.case.key, r.quiet.wal_bytes_per_s, r.quiet.postgres_cores
        ));
    }
    for line in text.lines() {
        ctx.progress(format!("dbcost: {line}"));
    }
    ctx.report.section("database cost per message", &text);
}
