//! A PostgreSQL primary and a synchronous streaming standby of its own, for failover tests: two
//! servers from Debian's PostgreSQL 15 binaries ([`PG_BIN`]) in a temp dir, on free loopback
//! ports, trust authentication on 127.0.0.1 only, the standby made with `pg_basebackup -R` and
//! named in the primary's `synchronous_standby_names` (a commit returns once the standby has
//! it). The test then crashes the primary, promotes the standby or turns a server read-only.
//!
//! The servers run as the `postgres` OS user when the tests run as root (`initdb` refuses
//! root). [`PgPair`] stops both servers (`pg_ctl stop -m immediate`) and removes their files
//! when dropped, also when a test panics; a pair whose test process was killed outright is
//! removed by the next [`PgPair::start`] of any test process.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio_postgres::Client;

use crate::{free_port, hex8, slug, try_pg_connect, wait_until};

/// Debian's PostgreSQL 15 server binaries.
pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// What every temp dir of a pair is called: `<prefix><label>-<hex>`.
const DIR_PREFIX: &str = "outbox-relay-pgpair-";

/// The file in a pair's dir naming the test process that made it.
const OWNER_FILE: &str = "owner.pid";

/// How long a server gets to start, stop or promote, and the pair to replicate.
const SERVER_WAIT: Duration = Duration::from_secs(60);

/// One server of a [`PgPair`]: its data directory, port and log.
#[derive(Debug, Clone)]
pub struct PgServer {
    /// `primary` or `standby` (the role it was made for; a promoted standby keeps its name).
    pub name: &'static str,
    /// The data directory.
    pub data: PathBuf,
    /// The loopback port it listens on.
    pub port: u16,
    /// The server's log (`pg_ctl -l`).
    pub log: PathBuf,
}

impl PgServer {
    /// `postgres://postgres@127.0.0.1:<port>/<database>`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// A plain connection to database `test` on this server alone.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        try_pg_connect(&self.url("test"), "outbox-testkit-pgpair").await
    }

    /// Whether the server's postmaster is running (its `postmaster.pid` exists).
    pub fn is_running(&self) -> bool {
        self.data.join("postmaster.pid").exists()
    }

    /// The last `n` lines of the server's log (for failure messages).
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// `pg_ctl <args> -D <data>` as the server's user, panicking with the output and the
    /// log's tail when it fails.
    async fn pg_ctl(&self, args: &[&str]) {
        let data = self.data.to_string_lossy().into_owned();
        let mut all = args.to_vec();
        all.extend(["-D", &data]);
        let out = as_postgres("pg_ctl", &all).await;
        assert!(
            out.status.success(),
            "pg_ctl {all:?} failed: {}\n{}\n--- {} log ---\n{}",
            out.status,
            describe(&out),
            self.name,
            self.log_tail(30)
        );
    }
}

/// A primary and its synchronous streaming standby, both on loopback, with database `test`.
/// Dropping it stops both servers and removes their files.
pub struct PgPair {
    dir: PathBuf,
    /// The server that was the primary at start.
    pub primary: PgServer,
    /// The server that was the standby at start.
    pub standby: PgServer,
}

impl PgPair {
    /// `initdb` a primary (trust on 127.0.0.1, `synchronous_standby_names = '*'` once the
    /// standby streams), create database `test`, `pg_basebackup -R` the standby and start it;
    /// returns once the primary reports the standby as `sync`. Panics naming the step that
    /// failed.
    pub async fn start(label: &str) -> Self {
        remove_abandoned_pairs();
        let dir = std::env::temp_dir().join(format!("{DIR_PREFIX}{}-{}", slug(label, 30), hex8()));
        std::fs::create_dir_all(&dir).expect("create the pair's dir");
        std::fs::write(dir.join(OWNER_FILE), std::process::id().to_string())
            .expect("write the pair's owner file");
        let (p1, mut p2) = (free_port(), free_port());
        while p2 == p1 {
            p2 = free_port();
        }
        let server = |name, port| PgServer {
            name,
            data: dir.join(name),
            port,
            log: dir.join(format!("{name}.log")),
        };
        let pair = Self {
            primary: server("primary", p1),
            standby: server("standby", p2),
            dir,
        };
        give_to_postgres(&pair.dir).await;
        pair.init_primary().await;
        pair.clone_standby().await;
        pair.make_replication_synchronous().await;
        pair
    }

    /// The multi-host URL of database `test` that only accepts a read-write session:
    /// `postgres://postgres@127.0.0.1:<primary>,127.0.0.1:<standby>/test?target_session_attrs=read-write`.
    pub fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/test?target_session_attrs=read-write",
            self.primary.port, self.standby.port
        )
    }

    /// A plain connection through [`PgPair::url`]: to whichever server takes writes now.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        try_pg_connect(&self.url(), "outbox-testkit-pgpair").await
    }

    /// Waits (up to `timeout`) until [`PgPair::url`] gives a session that can write, and
    /// returns it.
    pub async fn wait_for_writable(&self, timeout: Duration) -> Client {
        wait_until(
            timeout,
            "a read-write server answers the pair's URL",
            async || {
                let client = self.connect().await.map_err(|e| e.to_string())?;
                let row = client.query_one("SHOW transaction_read_only", &[]).await;
                match row.map_err(|e| e.to_string())?.get::<_, String>(0).as_str() {
                    "off" => Ok(client),
                    other => Err(format!("transaction_read_only = {other}")),
                }
            },
        )
        .await
    }

    /// Kills the primary as a crash would (`pg_ctl stop -m immediate`: no shutdown
    /// checkpoint, no goodbye to its clients or its standby).
    pub async fn crash_primary(&self) {
        self.primary
            .pg_ctl(&["stop", "-m", "immediate", "-w"])
            .await;
    }

    /// Promotes the standby (`pg_ctl promote`) and waits until it takes writes.
    pub async fn promote_standby(&self) {
        self.standby.pg_ctl(&["promote", "-w"]).await;
        let url = self.standby.url("test");
        wait_until(
            SERVER_WAIT,
            "the promoted standby is out of recovery",
            async || {
                let client = try_pg_connect(&url, "outbox-testkit-pgpair").await;
                let client = client.map_err(|e| e.to_string())?;
                let row = client.query_one("SELECT pg_is_in_recovery()", &[]).await;
                match row.map_err(|e| e.to_string())?.get::<_, bool>(0) {
                    false => Ok(()),
                    true => Err("still in recovery".to_owned()),
                }
            },
        )
        .await;
    }

    /// Turns `server` read-only while it keeps running: `default_transaction_read_only = on`
    /// (`ALTER SYSTEM` and a reload), so every write fails with SQLSTATE 25006 and
    /// `target_session_attrs=read-write` refuses it. Returns once a new session sees it.
    pub async fn make_read_only(&self, server: &PgServer) {
        let client = server
            .connect()
            .await
            .expect("connect to make the server read-only");
        alter_system(&client, "default_transaction_read_only = on").await;
        wait_until(SERVER_WAIT, "new sessions are read-only", async || {
            let client = server.connect().await.map_err(|e| e.to_string())?;
            let row = client
                .query_one("SHOW default_transaction_read_only", &[])
                .await;
            match row.map_err(|e| e.to_string())?.get::<_, String>(0).as_str() {
                "on" => Ok(()),
                other => Err(format!("default_transaction_read_only = {other}")),
            }
        })
        .await;
    }

    /// Waits until the standby has replayed every WAL record the primary wrote so far (a
    /// planned switchover promotes only then).
    pub async fn wait_for_standby_caught_up(&self) {
        let primary = self
            .primary
            .connect()
            .await
            .expect("connect to the primary");
        let row = primary
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await;
        let target: String = row.expect("the primary's WAL position").get(0);
        let what = format!("the standby replayed the primary's WAL up to {target}");
        wait_until(SERVER_WAIT, &what, async || {
            let standby = self.standby.connect().await.map_err(|e| e.to_string())?;
            let sql = "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn, \
                       pg_last_wal_replay_lsn()::text";
            let row = standby.query_one(sql, &[&target]).await;
            let row = row.map_err(|e| e.to_string())?;
            match row.get::<_, Option<bool>>(0) {
                Some(true) => Ok(()),
                _ => Err(format!(
                    "replayed up to {:?}",
                    row.get::<_, Option<String>>(1)
                )),
            }
        })
        .await;
    }

    /// The primary's view of its standby: `(state, sync_state)` of each WAL sender.
    pub async fn replication(&self) -> Result<Vec<(String, String)>, tokio_postgres::Error> {
        let client = self.primary.connect().await?;
        let sql = "SELECT state, sync_state FROM pg_stat_replication";
        let rows = client.query(sql, &[]).await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// `initdb`, the configuration, start, database `test`.
    async fn init_primary(&self) {
        let data = self.primary.data.to_string_lossy().into_owned();
        let args = [
            "-D",
            &data,
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            // No fsync of the new files: only a process crash is ever simulated, never the
            // machine's.
            "--no-sync",
        ];
        let out = as_postgres("initdb", &args).await;
        assert!(out.status.success(), "initdb failed: {}", describe(&out));
        // Loopback and the pair's own socket dir only; small, as two extra servers on a
        // shared test machine should be. fsync off for the same reason as --no-sync.
        let conf = format!(
            "\n# outbox-testkit PgPair\nport = {}\nlisten_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\nshared_buffers = 32MB\nmax_connections = 60\n\
             fsync = off\nlogging_collector = off\n",
            self.primary.port,
            self.dir.display()
        );
        append(&self.primary.data.join("postgresql.conf"), &conf);
        let hba = "local all all trust\nlocal replication all trust\n\
                   host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";
        std::fs::write(self.primary.data.join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        self.start_server(&self.primary).await;
        let admin = try_pg_connect(&self.primary.url("postgres"), "outbox-testkit-pgpair")
            .await
            .unwrap_or_else(|e| panic!("connect to the new primary: {e}"));
        admin
            .batch_execute("CREATE DATABASE test")
            .await
            .expect("CREATE DATABASE test on the primary");
    }

    /// `pg_basebackup -R` from the primary, its own port, start.
    async fn clone_standby(&self) {
        let data = self.standby.data.to_string_lossy().into_owned();
        let port = self.primary.port.to_string();
        let args = [
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-U",
            "postgres",
            "-D",
            &data,
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        ];
        let out = as_postgres("pg_basebackup", &args).await;
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            describe(&out)
        );
        // The copied configuration still names the primary's port; the last line wins.
        let conf = format!("port = {}\n", self.standby.port);
        append(&self.standby.data.join("postgresql.conf"), &conf);
        self.start_server(&self.standby).await;
    }

    /// Names the standby synchronous on the primary (after the copy, so the standby, once
    /// promoted, does not wait for a standby of its own), and waits until it is `sync`.
    async fn make_replication_synchronous(&self) {
        let client = self
            .primary
            .connect()
            .await
            .expect("connect to the primary");
        alter_system(&client, "synchronous_standby_names = '*'").await;
        wait_until(
            SERVER_WAIT,
            "the standby streams synchronously",
            async || {
                let senders = self.replication().await.map_err(|e| e.to_string())?;
                if senders
                    .iter()
                    .any(|(state, sync)| state == "streaming" && sync == "sync")
                {
                    Ok(())
                } else {
                    Err(format!("pg_stat_replication: {senders:?}"))
                }
            },
        )
        .await;
    }

    async fn start_server(&self, server: &PgServer) {
        let log = server.log.to_string_lossy().into_owned();
        let timeout = SERVER_WAIT.as_secs().to_string();
        server
            .pg_ctl(&["start", "-w", "-t", &timeout, "-l", &log])
            .await;
    }
}

impl Drop for PgPair {
    fn drop(&mut self) {
        remove_pair(&self.dir);
    }
}

/// Stops the servers of the pair in `dir` that are still running and removes `dir`.
fn remove_pair(dir: &Path) {
    for name in ["primary", "standby"] {
        let data = dir.join(name);
        if data.join("postmaster.pid").exists() {
            let data = data.to_string_lossy().into_owned();
            let args = ["stop", "-m", "immediate", "-w", "-D", &data];
            let stopped = as_postgres_command("pg_ctl", &args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            if !stopped.is_ok_and(|s| s.success()) {
                eprintln!("PgPair: could not stop the server in {data}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes the pairs whose test process is gone (killed before its `Drop` ran).
fn remove_abandoned_pairs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let is_pair = entry.file_name().to_string_lossy().starts_with(DIR_PREFIX);
        let path = entry.path();
        let owner = std::fs::read_to_string(path.join(OWNER_FILE)).unwrap_or_default();
        let owner_alive = owner
            .trim()
            .parse::<u32>()
            .is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if is_pair && !owner.is_empty() && !owner_alive {
            eprintln!(
                "PgPair: removing {} (its test process is gone)",
                path.display()
            );
            remove_pair(&path);
        }
    }
}

/// Whether this process runs as root (the owner of `/proc/self` is the process's user).
fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// `program` (in [`PG_BIN`]) with `args`, as the `postgres` user when this process is root.
fn as_postgres_command(program: &str, args: &[&str]) -> std::process::Command {
    let path = Path::new(PG_BIN).join(program);
    let mut cmd = if running_as_root() {
        let mut c = std::process::Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        std::process::Command::new(path)
    };
    cmd.args(args).stdin(Stdio::null());
    cmd
}

/// [`as_postgres_command`] run to completion with its output captured. `pg_ctl start` leaves
/// the server running detached, with its output in its log, so the pipes close when pg_ctl
/// exits.
async fn as_postgres(program: &str, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::from(as_postgres_command(program, args));
    cmd.output()
        .await
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

/// Hands `dir` to the `postgres` user (when this process is root), so the servers can make
/// their data directories, logs and sockets in it.
async fn give_to_postgres(dir: &Path) {
    if !running_as_root() {
        return;
    }
    let out = tokio::process::Command::new("chown")
        .arg("postgres:postgres")
        .arg(dir)
        .output()
        .await
        .expect("run chown");
    assert!(
        out.status.success(),
        "chown postgres {}: {}",
        dir.display(),
        describe(&out)
    );
}

/// `ALTER SYSTEM SET <setting>`, then a reload (two statements: `ALTER SYSTEM` refuses to run
/// in the implicit transaction of a multi-statement query).
async fn alter_system(client: &Client, setting: &str) {
    let alter = format!("ALTER SYSTEM SET {setting}");
    let done = client.batch_execute(&alter).await;
    done.unwrap_or_else(|e| panic!("{alter}: {e}"));
    let reload = client.batch_execute("SELECT pg_reload_conf()").await;
    reload.unwrap_or_else(|e| panic!("pg_reload_conf() after {alter}: {e}"));
}

/// Appends `text` to the file at `path`.
fn append(path: &Path, text: &str) {
    use std::io::Write as _;
    let mut f =
        crate::process::append_to(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(text.as_bytes())
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// A command's status, stdout and stderr, for a failure message.
fn describe(out: &Output) -> String {
    format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
