//! Plumbing shared by the phases: PostgreSQL helpers, the synthetic payload, the relay child
//! process, RabbitMQ fixtures, and CPU/RSS sampling from `/proc`. What the integration tests
//! need too (process spawning, topics, table removal, ports) is in `outbox-testkit`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use outbox_testkit::{Durability, RelayBuilder, RelayProcess, declare_bound_queue};
use tokio_postgres::Client;

/// `application_name` of the bench's own sessions. It must not start with `outbox-relay`:
/// the ordering guard ignores those sessions, and the latency inserters are "applications".
pub const APP_NAME: &str = "outbox-bench";

/// When the postmaster started: changes when someone restarts PostgreSQL during a phase.
pub async fn postmaster_start(pg: &Client) -> Option<String> {
    pg.query_one("SELECT pg_postmaster_start_time()::text", &[])
        .await
        .ok()
        .and_then(|r| r.try_get(0).ok())
}

/// One plain connection (not pooled) to PostgreSQL, as [`APP_NAME`].
pub async fn pg_connect(url: &str) -> Result<Client> {
    outbox_testkit::try_pg_connect(url, APP_NAME)
        .await
        .context("cannot connect to PostgreSQL (--database-url)")
}

/// The event body: an order of about 300 bytes of JSON. `%s` are filled in order with the
/// order number, the customer (aggregate), a total, and the order number twice (SKUs). The same
/// template feeds SQL `format()` (table fills) and [`payload`] (synthetic broker messages).
pub const PAYLOAD_TEMPLATE: &str = r#"{"order_id":%s,"customer_id":"customer-%s","status":"placed","currency":"EUR","total_cents":%s,"lines":[{"sku":"SKU-%s-A","qty":2,"unit_cents":1999},{"sku":"SKU-%s-B","qty":1,"unit_cents":4999}],"shipping":{"method":"standard","country":"DE","city":"Berlin","postcode":"10115","street":"Unter den Linden 1"},"channel":"web"}"#;

/// Order `i` as the relay would have claimed it (first attempt, no row headers), for the bare
/// clients that send the relay's own messages.
pub fn message(i: u64, aggregates: u64) -> outbox_relay::message::OutboxMessage {
    outbox_relay::message::OutboxMessage {
        id: uuid::Uuid::new_v4(),
        seq: i as i64,
        aggregate_type: "order".to_owned(),
        aggregate_id: Some(format!("order-{}", i % aggregates.max(1))),
        event_type: "OrderPlaced".to_owned(),
        payload: payload(i, aggregates).into_bytes(),
        headers: b"{}".to_vec(),
        destination: None,
        attempts: 1,
        created_at: chrono::Utc::now(),
        expires_at: None,
        traceparent: None,
    }
}

/// The payload of order `i` as compact JSON text.
pub fn payload(i: u64, aggregates: u64) -> String {
    let values = [
        i.to_string(),
        (i % aggregates.max(1)).to_string(),
        ((i * 7919) % 100_000).to_string(),
        i.to_string(),
        i.to_string(),
    ];
    let mut out = String::with_capacity(PAYLOAD_TEMPLATE.len() + 40);
    let mut parts = PAYLOAD_TEMPLATE.split("%s");
    if let Some(first) = parts.next() {
        out.push_str(first);
    }
    for (part, v) in parts.zip(values.iter()) {
        out.push_str(v);
        out.push_str(part);
    }
    out
}

/// The aggregate id of row `i` (round robin over `aggregates`).
pub fn aggregate_id(i: u64, aggregates: u64) -> String {
    format!("order-{}", i % aggregates.max(1))
}

/// How [`fill_range`] makes its rows.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// As applications insert: `seq` from the table's default (`<table>_next_seq()`), a payload
    /// per row.
    AsApplications,
    /// Four times faster, for the large claim table: `seq` is `g` itself (the caller sets the
    /// sequence afterwards) and every row has the same payload (same size).
    Fast,
}

/// Inserts rows `from..=to` (pending) in one statement: aggregate type `order`, event
/// `OrderPlaced`, aggregate id round robin over `aggregates`.
pub async fn fill_range(
    pg: &Client,
    table: &str,
    (from, to): (i64, i64),
    aggregates: i64,
    how: Fill,
) -> Result<u64> {
    let (seq_column, seq, body) = match how {
        Fill::AsApplications => (
            "",
            "",
            format!("format('{PAYLOAD_TEMPLATE}', g, g % $3, (g * 7919) % 100000, g, g)::jsonb"),
        ),
        Fill::Fast => ("seq, ", "g, ", "$4::text::jsonb".to_owned()),
    };
    let sql = format!(
        "INSERT INTO {table} ({seq_column}aggregate_type, aggregate_id, event_type, payload) \
         SELECT {seq}'order', 'order-' || (g % $3), 'OrderPlaced', {body} \
         FROM generate_series($1::bigint, $2::bigint) AS g"
    );
    let same_payload = payload(1_234_567, 1000);
    let inserted = match how {
        Fill::AsApplications => pg.execute(&sql, &[&from, &to, &aggregates]).await,
        Fill::Fast => {
            pg.execute(&sql, &[&from, &to, &aggregates, &same_payload])
                .await
        }
    };
    inserted.with_context(|| format!("cannot fill {table}"))
}

/// Fills `n` pending rows, then ANALYZE and CHECKPOINT so that the timed run starts from
/// fresh statistics and does not pay for the fill's dirty buffers.
pub async fn fill(pg: &Client, table: &str, n: usize, aggregates: usize) -> Result<()> {
    let n = i64::try_from(n)?;
    let aggregates = i64::try_from(aggregates.max(1))?;
    let chunk = 1_000_000i64;
    let mut from = 1;
    while from <= n {
        let to = (from + chunk - 1).min(n);
        fill_range(pg, table, (from, to), aggregates, Fill::AsApplications).await?;
        from = to + 1;
    }
    settle_db(pg, table).await
}

/// ANALYZE the table and CHECKPOINT (superuser; skipped quietly when refused).
pub async fn settle_db(pg: &Client, table: &str) -> Result<()> {
    pg.batch_execute(&format!("ANALYZE {table}")).await?;
    if let Err(e) = pg.batch_execute("CHECKPOINT").await {
        tracing::debug!(error = %e, "CHECKPOINT refused");
    }
    Ok(())
}

/// One index of a table, as it can be dropped and recreated.
pub struct IndexDef {
    name: String,
    def: String,
    constraint: Option<(String, String)>,
}

impl IndexDef {
    /// The `CREATE INDEX` text (or the constraint definition).
    pub fn definition(&self) -> &str {
        self.constraint.as_ref().map_or(&self.def, |(_, d)| d)
    }
}

/// The indexes of `table` (including the primary key's).
pub async fn table_indexes(pg: &Client, table: &str) -> Result<Vec<IndexDef>> {
    let rows = pg
        .query(
            "SELECT ic.relname::text, pg_get_indexdef(i.indexrelid), con.conname::text, pg_get_constraintdef(con.oid) \
             FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid \
             LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid \
             WHERE i.indrelid = $1::text::regclass",
            &[&table],
        )
        .await?;
    rows.iter()
        .map(|r| {
            let constraint = match (
                r.try_get::<_, Option<String>>(2)?,
                r.try_get::<_, Option<String>>(3)?,
            ) {
                (Some(n), Some(d)) => Some((n, d)),
                _ => None,
            };
            Ok(IndexDef {
                name: r.try_get(0)?,
                def: r.try_get(1)?,
                constraint,
            })
        })
        .collect()
}

/// Drops one index (or its constraint).
pub async fn drop_index(pg: &Client, table: &str, idx: &IndexDef) -> Result<()> {
    let sql = match &idx.constraint {
        Some((name, _)) => format!("ALTER TABLE {table} DROP CONSTRAINT {name}"),
        None => format!("DROP INDEX {}", idx.name),
    };
    pg.batch_execute(&sql).await?;
    Ok(())
}

/// Recreates one index (or its constraint).
pub async fn create_index(pg: &Client, table: &str, idx: &IndexDef) -> Result<()> {
    let sql = match &idx.constraint {
        Some((name, def)) => format!("ALTER TABLE {table} ADD CONSTRAINT {name} {def}"),
        None => idx.def.clone(),
    };
    pg.batch_execute(&sql)
        .await
        .with_context(|| format!("cannot recreate {}", idx.name))?;
    Ok(())
}

/// Resets plain `table`'s fillfactor to PostgreSQL's default (100): the full pages of schema
/// version 4, for an A/B against version 5's room for the relay's updates.
pub async fn full_pages(pg: &Client, table: &str) -> Result<()> {
    let reset = format!("ALTER TABLE {table} RESET (fillfactor)");
    pg.batch_execute(&reset)
        .await
        .with_context(|| format!("cannot reset the fillfactor of {table}"))
}

/// Replaces plain `table`'s waiting index (schema version 6) with version 2's open index, as
/// version 5 left it, for an A/B against version 6 (the relay's statements read either).
pub async fn open_index(pg: &Client, table: &str) -> Result<()> {
    let swap = format!(
        "DROP INDEX {table}_waiting_idx; \
         CREATE INDEX {table}_open_idx ON {table} (aggregate_type, aggregate_id, seq) \
           WHERE status NOT IN ('sent', 'expired')"
    );
    pg.batch_execute(&swap)
        .await
        .with_context(|| format!("cannot give {table} the open index"))
}

/// Drops schema version 7's blocker index from plain `table`, as version 6 left it: the
/// relay's ordered claim then probes each candidate's head, for an A/B against version 7.
pub async fn no_blocker_index(pg: &Client, table: &str) -> Result<()> {
    pg.batch_execute(&format!("DROP INDEX {table}_blocker_idx"))
        .await
        .with_context(|| format!("cannot drop the blocker index of {table}"))
}

/// Average size in bytes of the payload as the relay sends it (jsonb's text form).
pub async fn avg_payload_bytes(pg: &Client, table: &str) -> Result<f64> {
    let row = pg
        .query_one(
            &format!("SELECT coalesce(avg(octet_length(payload::text)), 0)::float8 FROM (SELECT payload FROM {table} LIMIT 1000) s"),
            &[],
        )
        .await?;
    Ok(row.try_get(0)?)
}

/// Waits until no row is `pending` or `processing`, polling every 50 ms through the partial
/// indexes (cheap on a large table). `alive` is checked on every poll and ends the wait with
/// its error (the relay died).
pub async fn wait_drained(
    pg: &Client,
    table: &str,
    timeout: Duration,
    mut alive: impl FnMut() -> Result<()>,
) -> Result<()> {
    let sql = format!(
        "SELECT (SELECT seq FROM {table} WHERE status = 'pending' ORDER BY seq LIMIT 1) IS NULL \
            AND (SELECT id FROM {table} WHERE status = 'processing' ORDER BY locked_at LIMIT 1) IS NULL"
    );
    let stmt = pg.prepare(&sql).await?;
    let deadline = Instant::now() + timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let done: bool = pg.query_one(&stmt, &[]).await?.try_get(0)?;
        if done {
            return Ok(());
        }
        alive()?;
        if Instant::now() > deadline {
            let counts = status_counts(pg, table).await.unwrap_or_default();
            bail!("{table} not drained after {timeout:?} (counts by status: {counts:?})");
        }
    }
}

/// Row counts by status (the test kit's).
pub async fn status_counts(pg: &Client, table: &str) -> Result<BTreeMap<String, i64>> {
    Ok(outbox_testkit::status_counts_in(pg, table).await?)
}

/// Checks that exactly `n` rows are `sent` (and none failed).
pub async fn verify_sent(pg: &Client, table: &str, n: usize) -> Result<()> {
    let counts = status_counts(pg, table).await?;
    let sent = counts.get("sent").copied().unwrap_or(0);
    if usize::try_from(sent).ok() != Some(n) || counts.len() != 1 {
        bail!("{table}: expected {n} rows sent, found {counts:?}");
    }
    Ok(())
}

/// Drops an outbox table and everything its migration created.
pub async fn drop_table(pg: &Client, table: &str) -> Result<()> {
    pg.batch_execute(&outbox_testkit::drop_table_sql(table))
        .await?;
    Ok(())
}

/// One plain connection (not pooled) to MySQL/MariaDB at `url`, its session time zone UTC.
pub async fn mysql_connect(url: &str) -> Result<mysql_async::Conn> {
    use mysql_async::prelude::Queryable;
    let opts = mysql_async::Opts::from_url(url).context("--mysql-url")?;
    let mut conn = mysql_async::Conn::new(opts)
        .await
        .context("cannot connect to MySQL/MariaDB (--mysql-url)")?;
    conn.query_drop("SET time_zone = '+00:00'").await?;
    Ok(conn)
}

/// Drops a MySQL outbox table and its schema version record.
pub async fn drop_mysql_table(conn: &mut mysql_async::Conn, table: &str) -> Result<()> {
    use mysql_async::prelude::Queryable;
    conn.query_drop(format!("DROP TABLE IF EXISTS {table}"))
        .await?;
    // Absent until a migration created it; nothing to forget then.
    let _ = conn
        .exec_drop(
            "DELETE FROM outbox_relay_schema_version WHERE table_name = ?",
            (table,),
        )
        .await;
    Ok(())
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Median of unsorted values.
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ fixtures

/// An admin connection for declaring and deleting the bench's exchanges and queues.
pub struct Rabbit {
    conn: Connection,
}

impl Rabbit {
    /// Connects (10 s timeout).
    pub async fn connect(url: &str) -> Result<Self> {
        let conn = tokio::time::timeout(
            Duration::from_secs(10),
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        .map_err(|_| anyhow!("timed out connecting to RabbitMQ"))?
        .context("cannot connect to RabbitMQ")?;
        Ok(Self { conn })
    }

    /// A new connection to the same broker (for consumers).
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Declares a durable topic exchange and a durable queue, both called `name`, bound with `#`.
    pub async fn binding(&self, name: &str) -> Result<()> {
        let ch = self.conn.create_channel().await?;
        declare_bound_queue(&ch, name, name, Durability::Durable, "#")
            .await
            .map_err(|e| anyhow!(e))?;
        let _ = ch.close(200, "done".into()).await;
        Ok(())
    }

    /// Messages ready in queue `name`.
    pub async fn queue_len(&self, name: &str) -> Result<u32> {
        let ch = self.conn.create_channel().await?;
        let q = ch
            .queue_declare(
                name.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let _ = ch.close(200, "done".into()).await;
        Ok(q.message_count())
    }

    /// Deletes queue and exchange `name` (best effort).
    pub async fn delete(&self, name: &str) -> Result<()> {
        let ch = self.conn.create_channel().await?;
        ch.queue_delete(name.into(), QueueDeleteOptions::default())
            .await
            .with_context(|| format!("cannot delete queue {name}"))?;
        ch.exchange_delete(name.into(), ExchangeDeleteOptions::default())
            .await
            .with_context(|| format!("cannot delete exchange {name}"))?;
        let _ = ch.close(200, "done".into()).await;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The relay as a child process

/// A running `outbox-relay run`, optionally sampled by `perf`. Killed (SIGKILL) if dropped
/// while still running, so no relay outlives the bench, whatever happens.
pub struct Relay {
    process: RelayProcess,
    perf: Option<tokio::process::Child>,
}

impl Relay {
    /// Starts `outbox-relay run` with only the given variables (the relay's default log filter:
    /// a `RUST_LOG` of the bench's own is not passed on), all its output appended to `log`.
    pub fn spawn(label: &str, env: &[(String, String)], log: &Path) -> Result<Self> {
        let builder = env
            .iter()
            .fold(RelayBuilder::bare(label).unset("RUST_LOG"), |b, (k, v)| {
                b.env(k, v.clone())
            })
            .log_file(log)
            .quiet();
        let process = builder
            .try_spawn(&["run"])
            .with_context(|| format!("cannot start {}", outbox_testkit::relay_bin().display()))?;
        OUR_RELAYS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(process.pid());
        Ok(Self {
            process,
            perf: None,
        })
    }

    /// Samples the relay with `perf record -e cpu-clock` into `out` until [`Self::stop`].
    pub fn attach_perf(&mut self, out: &Path) -> Result<()> {
        let perf = tokio::process::Command::new("perf")
            .args(["record", "-e", "cpu-clock", "-F", "999", "-g", "-p"])
            .arg(self.process.pid().to_string())
            .arg("-o")
            .arg(out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start perf")?;
        self.perf = Some(perf);
        Ok(())
    }

    /// Fails (with the end of its log) if the relay has exited.
    pub fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.process.try_wait()? {
            bail!(
                "the relay exited early ({status}); end of its log:\n{}",
                self.tail(20)
            );
        }
        Ok(())
    }

    /// Peak resident set size (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        proc_status_kib(self.process.pid(), "VmHWM:")
    }

    /// Stops `perf`, then SIGTERM and up to `grace` for a clean exit (SIGKILL after that).
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(mut perf) = self.perf.take() {
            if let Some(perf_pid) = perf.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-INT", &perf_pid.to_string()])
                    .status();
            }
            let _ = tokio::time::timeout(Duration::from_secs(30), perf.wait()).await;
        }
        self.process.try_stop(grace).await.map_err(|e| anyhow!(e))
    }

    /// The last `n` lines of its log.
    pub fn tail(&self, n: usize) -> String {
        self.process.tail(n)
    }
}

fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

// ---------------------------------------------------------------------------------------------
// CPU accounting from /proc: which process group used how many cores during a timed section.

/// `USER_HZ`: the unit of `/proc/*/stat` times (100 on every Linux architecture we run on).
const TICKS_PER_SECOND: f64 = 100.0;

/// Pids of the relay processes this bench started (other `outbox-relay` processes on the
/// machine, e.g. from someone else's tests, count as "other").
static OUR_RELAYS: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

fn is_our_relay(pid: u32) -> bool {
    OUR_RELAYS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&pid)
}

/// CPU times of every process and of the whole machine at one instant.
pub struct CpuSample {
    at: Instant,
    /// pid → (comm, start time, utime + stime)
    procs: HashMap<u32, (String, u64, u64)>,
    busy: u64,
    steal: u64,
    irq: u64,
}

/// Cores used per process group over an interval.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CpuUsage {
    /// Cores used by each group (postgres, rabbitmq, kafka, mariadb, nats, relay, bench,
    /// other).
    pub cores: BTreeMap<String, f64>,
    /// Cores busy machine-wide (all processes and the kernel).
    pub machine_busy: f64,
    /// Cores stolen by the hypervisor.
    pub steal: f64,
    /// Cores spent in interrupt and softirq handling (loopback networking), charged to no
    /// process.
    pub irq: f64,
    /// The busiest processes of group "other" (comm → cores), to see who else was running.
    pub other_top: BTreeMap<String, f64>,
    /// Machine busy minus every process seen in both samples: processes that started and
    /// ended within the interval (someone's build or tests) and kernel work. Large values
    /// mean the figure was measured under contention that the groups do not show.
    pub unattributed: f64,
}

impl CpuSample {
    /// Reads `/proc` now.
    pub fn take() -> Self {
        let mut procs = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<u32>().ok())
                else {
                    continue;
                };
                if let Some(v) = proc_cpu(pid) {
                    procs.insert(pid, v);
                }
            }
        }
        let (busy, steal, irq) = machine_cpu().unwrap_or((0, 0, 0));
        Self {
            at: Instant::now(),
            procs,
            busy,
            steal,
            irq,
        }
    }

    /// Usage between `self` (earlier) and a sample taken now.
    pub fn usage(&self) -> CpuUsage {
        let now = Self::take();
        let secs = now.at.duration_since(self.at).as_secs_f64().max(1e-6);
        let me = std::process::id();
        let mut cores: BTreeMap<String, f64> = BTreeMap::new();
        let mut other: BTreeMap<String, f64> = BTreeMap::new();
        for (pid, (comm, start, ticks)) in &now.procs {
            // Same pid and same start time: the same process (comm may change, e.g. kworkers).
            let before = self
                .procs
                .get(pid)
                .filter(|(_, s, _)| s == start)
                .map_or(0, |(_, _, t)| *t);
            let delta = ticks.saturating_sub(before);
            if delta == 0 {
                continue;
            }
            let used = delta as f64 / TICKS_PER_SECOND / secs;
            let group = group_of(comm, *pid, me);
            *cores.entry(group.to_owned()).or_default() += used;
            if group == "other" {
                let name = comm
                    .split(['/', '-', ':'])
                    .next()
                    .unwrap_or(comm)
                    .to_owned();
                *other.entry(name).or_default() += used;
            }
        }
        // Four decimals: an idle relay uses well under 0.01 of a core.
        let round = |v: f64| (v * 10_000.0).round() / 10_000.0;
        for v in cores.values_mut() {
            *v = round(*v);
        }
        let mut top: Vec<(String, f64)> = other.into_iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        let other_top = top
            .into_iter()
            .take(4)
            .filter(|(_, v)| *v >= 0.05)
            .map(|(k, v)| (k, round(v)))
            .collect();
        let r = |x: u64| round(x as f64 / TICKS_PER_SECOND / secs);
        let machine_busy = r(now.busy.saturating_sub(self.busy));
        let irq = r(now.irq.saturating_sub(self.irq));
        let unattributed = round((machine_busy - irq - cores.values().sum::<f64>()).max(0.0));
        CpuUsage {
            cores,
            machine_busy,
            steal: r(now.steal.saturating_sub(self.steal)),
            irq,
            other_top,
            unattributed,
        }
    }
}

fn group_of(comm: &str, pid: u32, me: u32) -> &'static str {
    if pid == me {
        return "bench";
    }
    if is_our_relay(pid) {
        return "relay";
    }
    match comm {
        "postgres" | "postmaster" => "postgres",
        "beam.smp" | "erl_child_setup" | "inet_gethost" | "epmd" => "rabbitmq",
        "tansu" => "kafka",
        "mariadbd" | "mysqld" => "mariadb",
        "nats-server" => "nats",
        _ => "other",
    }
}

/// (comm, start time, utime + stime) of a process.
fn proc_cpu(pid: u32) -> Option<(String, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let fields: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    // Fields after ") " start at stat(5) field 3 (state): utime is 14, stime 15, starttime 22.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    let start: u64 = fields.get(19)?.parse().ok()?;
    Some((comm, start, utime + stime))
}

/// Machine-wide (busy, steal, irq + softirq) ticks from `/proc/stat`.
fn machine_cpu() -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal guest guest_nice
    let irq = v.get(5)? + v.get(6)?;
    let busy = v.first()? + v.get(1)? + v.get(2)? + irq;
    let steal = *v.get(7)?;
    Some((busy, steal, irq))
}

/// A private scratch directory under the system temp dir.
pub fn scratch_dir(run_id: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("outbox-bench-{run_id}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

// ---------------------------------------------------------------------------------------------
// The relay's own /metrics (opt-in with --metrics)

/// Fetches `http://127.0.0.1:{port}/metrics` and sums every sample by series name (labels
/// other than `le` dropped): e.g. `outbox_claim_batch_size_count`, or
/// `outbox_claim_batch_size_bucket{le=500}`.
pub async fn scrape_metrics(port: u16) -> Result<BTreeMap<String, f64>> {
    let body = outbox_testkit::scrape(port).await.map_err(|e| anyhow!(e))?;
    let mut out = BTreeMap::new();
    for line in body.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        let name = match series.split_once('{') {
            Some((name, labels)) => match labels
                .trim_end_matches('}')
                .split(',')
                .find_map(|l| l.strip_prefix("le="))
            {
                Some(le) => format!("{name}{{le={}}}", le.trim_matches('"')),
                None => name.to_owned(),
            },
            None => series.to_owned(),
        };
        *out.entry(name).or_insert(0.0) += v;
    }
    Ok(out)
}

/// The figures the bench reads from a relay's metrics.
pub fn summarize_metrics(m: &BTreeMap<String, f64>) -> serde_json::Value {
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
    let claims = get("outbox_claim_batch_size_count");
    let claimed = get("outbox_claim_batch_size_sum");
    let publishes = get("outbox_publish_duration_seconds_count");
    let buckets: BTreeMap<String, f64> = m
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("outbox_claim_batch_size_bucket{le=")
                .map(|le| (format!("le_{}", le.trim_end_matches('}')), *v))
        })
        .collect();
    serde_json::json!({
        "claims": claims,
        "rows_claimed": claimed,
        "mean_rows_per_claim": if claims > 0.0 { claimed / claims } else { 0.0 },
        "claims_by_size_cumulative": buckets,
        "publishes": publishes,
        "mean_publish_ms": if publishes > 0.0 { get("outbox_publish_duration_seconds_sum") / publishes * 1000.0 } else { 0.0 },
        "publish_failures": get("outbox_publish_failures_total"),
    })
}
