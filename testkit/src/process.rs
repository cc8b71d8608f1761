//! The `outbox-relay` binary as a child process, configured only by `RELAY_*` variables.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::{AMQP_URL, PG_URL, RabbitFixture, TestTable, hex8, slug, wait_for_count};

/// The `outbox-relay` binary: `$OUTBOX_RELAY_BIN`, else the one next to the running executable
/// (`target/<profile>/` holds the binaries, `target/<profile>/deps/` the test executables). Cargo
/// builds a package's binaries before its integration tests; `cargo build --workspace` builds
/// them beside the benchmark.
pub fn relay_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("OUTBOX_RELAY_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().unwrap_or_default();
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(format!("outbox-relay{}", std::env::consts::EXE_SUFFIX))
}

/// `path` opened for appending (created if missing): a log that several runs share.
pub(crate) fn append_to(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Creates `outbox-relay-it-<label>-<hex>`.
    pub fn new(label: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("outbox-relay-it-{}-{}", slug(label, 30), hex8()));
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `contents` to `name` inside the directory and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).expect("write temp file");
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The environment variable for a dotted config key: `publisher.rabbitmq.url` →
/// `RELAY_PUBLISHER__RABBITMQ__URL`.
pub fn env_key(key: &str) -> String {
    format!("RELAY_{}", key.to_ascii_uppercase().replace('.', "__"))
}

/// How to start the binary: configuration by environment only, run from an empty temp dir
/// (so no `relay.toml` is picked up), with an otherwise empty environment.
pub struct RelayBuilder {
    label: String,
    env: BTreeMap<String, String>,
    log_file: Option<PathBuf>,
    echo: bool,
}

/// The captured result of a short command (`check`, a failing `run`).
#[derive(Debug)]
pub struct CmdOutput {
    /// Exit status.
    pub status: ExitStatus,
    /// Everything printed on stdout.
    pub stdout: String,
    /// Everything printed on stderr.
    pub stderr: String,
}

impl CmdOutput {
    /// Asserts that stdout contains `needle` (the failure shows stdout).
    pub fn assert_stdout_has(&self, needle: &str) {
        assert!(self.stdout.contains(needle), "{}", self.stdout);
    }
}

impl RelayBuilder {
    /// No configuration at all besides plain logs.
    pub fn bare(label: &str) -> Self {
        let mut env = BTreeMap::new();
        env.insert("NO_COLOR".to_owned(), "1".to_owned());
        for pass in ["RUST_LOG", "RUST_BACKTRACE"] {
            if let Ok(v) = std::env::var(pass) {
                env.insert(pass.to_owned(), v);
            }
        }
        Self {
            label: label.to_owned(),
            env,
            log_file: None,
            echo: true,
        }
    }

    /// The binary for the operator commands (`migrate`, `check`, `status`, `dead-letters`) on
    /// `table` in the test database, nothing else configured.
    pub fn operator(table: &str) -> Self {
        Self::bare(table)
            .set("database.url", PG_URL)
            .set("database.table", table)
    }

    /// With `relay.ordering = "aggregate"` and a 200 ms poll: an ordered relay that a test
    /// need not wake for rows it inserts.
    pub fn ordered(self) -> Self {
        self.set("relay.ordering", "aggregate")
            .set("relay.poll_interval", "200ms")
    }

    /// Configured for `table` and `rabbit`, instance id `instance`, metrics server disabled.
    pub fn for_test(table: &TestTable, rabbit: &RabbitFixture, instance: &str) -> Self {
        Self::to_exchange(table, &rabbit.exchange, instance)
    }

    /// Configured for `table` and `exchange` on the local RabbitMQ, instance id `instance`,
    /// metrics server disabled (for a test without a [`RabbitFixture`]).
    pub fn to_exchange(table: &TestTable, exchange: &str, instance: &str) -> Self {
        Self::for_table(table, instance)
            .set("publisher.rabbitmq.url", AMQP_URL)
            .set("publisher.rabbitmq.exchange", exchange)
    }

    /// Configured for `table` (no migration at start), instance id `instance`, metrics server
    /// disabled; the publisher is left to the caller.
    pub fn for_table(table: &TestTable, instance: &str) -> Self {
        Self::bare(instance)
            .set("database.url", PG_URL)
            .set("database.table", &table.name)
            .set("database.auto_migrate", "false")
            .set("metrics.listen", "")
            .set("relay.instance_id", instance)
    }

    /// Configured for the MySQL `table` (no migration at start), instance id `instance`,
    /// metrics server disabled; the publisher is left to the caller.
    pub fn for_mysql(table: &crate::mysql::MysqlTable, instance: &str) -> Self {
        Self::bare(instance)
            .set("database.url", crate::mysql::MYSQL_URL)
            .set("database.table", &table.name)
            .set("database.auto_migrate", "false")
            .set("metrics.listen", "")
            .set("relay.instance_id", instance)
    }

    /// Sets a raw environment variable (e.g. `RUST_LOG`).
    pub fn env(mut self, name: &str, value: impl Into<String>) -> Self {
        self.env.insert(name.to_owned(), value.into());
        self
    }

    /// Removes a variable set so far (e.g. the `RUST_LOG` passed through from the caller).
    pub fn unset(mut self, name: &str) -> Self {
        self.env.remove(name);
        self
    }

    /// Also appends every line the process prints (stdout and stderr) to `path`.
    pub fn log_file(mut self, path: &Path) -> Self {
        self.log_file = Some(path.to_owned());
        self
    }

    /// Does not echo the process's lines on stderr (the echo is for the test harness, which
    /// shows it only when a test fails).
    pub fn quiet(mut self) -> Self {
        self.echo = false;
        self
    }

    /// Serves `/metrics` on a free loopback port, so that the test can wait on the relay's state
    /// ([`RelayProcess::wait_broker_connected`]) rather than on its log lines.
    pub fn serving_metrics(self) -> Self {
        self.set(
            "metrics.listen",
            format!("127.0.0.1:{}", crate::free_port()),
        )
    }

    /// Sets a config key (dotted, e.g. `relay.ordering`) through its `RELAY_*` variable.
    pub fn set(self, key: &str, value: impl Into<String>) -> Self {
        self.env(&env_key(key), value)
    }

    /// Starts `outbox-relay run`.
    pub fn spawn(self) -> RelayProcess {
        self.spawn_with(&["run"])
    }

    /// Starts the binary with `args`, capturing its output line by line.
    pub fn spawn_with(self, args: &[&str]) -> RelayProcess {
        self.try_spawn(args)
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", relay_bin().display()))
    }

    /// [`RelayBuilder::spawn_with`], returning the error instead of panicking.
    pub fn try_spawn(self, args: &[&str]) -> std::io::Result<RelayProcess> {
        let dir = TempDir::new(&self.label);
        let log = match &self.log_file {
            Some(path) => Some(Arc::new(Mutex::new(append_to(path)?))),
            None => None,
        };
        let mut child = Command::new(relay_bin())
            .args(args)
            .current_dir(dir.path())
            .env_clear()
            .envs(&self.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let pid = child
            .id()
            .ok_or_else(|| std::io::Error::other("the child exited before its pid was read"))?;
        let metrics_port = self
            .env
            .get(&env_key("metrics.listen"))
            .and_then(|listen| listen.parse::<std::net::SocketAddr>().ok())
            .map(|addr| addr.port());
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            let label = self.echo.then(|| format!("{} out", self.label));
            readers.push(spawn_reader(out, Arc::clone(&stdout), label, log.clone()));
        }
        if let Some(err) = child.stderr.take() {
            let label = self.echo.then(|| format!("{} err", self.label));
            readers.push(spawn_reader(err, Arc::clone(&stderr), label, log));
        }
        Ok(RelayProcess {
            label: self.label,
            child,
            pid,
            stdout,
            stderr,
            readers,
            metrics_port,
            _dir: dir,
        })
    }

    /// Runs the binary with `args` to completion (killed and reported after `timeout`).
    pub async fn output(self, args: &[&str], timeout: Duration) -> CmdOutput {
        let mut p = self.spawn_with(args);
        let status = p.wait_exit(timeout).await;
        CmdOutput {
            status,
            stdout: p.stdout(),
            stderr: p.stderr(),
        }
    }
}

/// Collects the lines of `r` into `sink`, echoing them on stderr under `label` (if any) and
/// appending them to `log` (if any).
fn spawn_reader(
    r: impl AsyncRead + Unpin + Send + 'static,
    sink: Arc<Mutex<Vec<String>>>,
    label: Option<String>,
    log: Option<Arc<Mutex<std::fs::File>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(label) = &label {
                // Captured by the test harness: shown only when the test fails.
                eprintln!("[{label}] {line}");
            }
            if let Some(log) = &log {
                let _ = writeln!(log.lock().unwrap_or_else(|p| p.into_inner()), "{line}");
            }
            sink.lock().unwrap().push(line);
        }
    })
}

/// A running `outbox-relay` child process (killed when dropped).
pub struct RelayProcess {
    /// Label used in captured output (the instance id for relays).
    pub label: String,
    child: Child,
    pid: u32,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
    readers: Vec<JoinHandle<()>>,
    /// Where `/metrics` is served, when the test set `metrics.listen`.
    metrics_port: Option<u16>,
    _dir: TempDir,
}

impl RelayProcess {
    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Everything printed on stderr so far (the logs).
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Everything printed on stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    /// The last `n` lines printed on stderr.
    pub fn tail(&self, n: usize) -> String {
        let lines = self.stderr.lock().unwrap();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Log lines containing `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    /// Waits until at least `n` log lines contain `needle`.
    pub async fn wait_for_log(&self, needle: &str, n: usize, timeout: Duration) {
        let what = format!("relay {} logs {needle:?} {n} time(s)", self.label);
        wait_for_count(timeout, &what, n, || self.log_count(needle)).await;
    }

    /// Waits until the relay's `outbox_broker_connected` gauge is 1: it has connected to the
    /// broker. Needs `metrics.listen` ([`RelayBuilder::serving_metrics`]).
    pub async fn wait_broker_connected(&self, timeout: Duration) {
        let Some(port) = self.metrics_port else {
            panic!(
                "relay {}: wait_broker_connected reads /metrics; start it with serving_metrics()",
                self.label
            );
        };
        crate::wait_for_sample(port, timeout, "outbox_broker_connected", &[], |v| v == 1.0).await;
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.try_wait().expect("try_wait").is_none()
    }

    /// The exit status if the process has exited (without waiting).
    pub fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Sends SIGTERM (with the `kill` command: the crates forbid unsafe code and have no `nix`).
    pub fn sigterm(&self) {
        let status = self.try_sigterm().expect("run kill");
        assert!(status.success(), "kill -TERM {} failed: {status}", self.pid);
    }

    fn try_sigterm(&self) -> std::io::Result<ExitStatus> {
        self.try_signal("TERM")
    }

    /// `kill -<name>` of the process.
    fn try_signal(&self, name: &str) -> std::io::Result<ExitStatus> {
        std::process::Command::new("kill")
            .args([&format!("-{name}"), &self.pid.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
    }

    /// SIGTERM, then waits up to `grace` for the exit; after that SIGKILL and an error.
    pub async fn try_stop(&mut self, grace: Duration) -> Result<ExitStatus, String> {
        self.try_sigterm()
            .map_err(|e| format!("cannot run kill -TERM {}: {e}", self.pid))?;
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => status.map_err(|e| format!("cannot wait for {}: {e}", self.label)),
            Err(_) => {
                let _ = self.child.kill().await;
                Err(format!(
                    "{} did not stop within {grace:?} of SIGTERM; killed",
                    self.label
                ))
            }
        }
    }

    /// Sends the signal `name` (`"STOP"`, `"CONT"`, …) with `kill`.
    pub fn signal(&self, name: &str) {
        let status = self.try_signal(name).expect("run kill");
        assert!(
            status.success(),
            "kill -{name} {} failed: {status}",
            self.pid
        );
    }

    /// Sends SIGKILL.
    pub fn sigkill(&mut self) {
        self.child.start_kill().expect("SIGKILL");
    }

    /// Waits for the process to exit and for its output to be fully read; on timeout kills it
    /// and panics with its logs.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let status = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => status.expect("wait for child"),
            Err(_) => {
                let _ = self.child.start_kill();
                panic!(
                    "{} did not exit within {timeout:?}\n--- stderr ---\n{}",
                    self.label,
                    self.stderr()
                );
            }
        };
        for r in self.readers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), r).await;
        }
        status
    }

    /// Waits for the process to exit, and asserts that it failed with `needle` in its logs: a
    /// start-up error that names its cause, where an outage would have been waited out.
    pub async fn expect_start_error(mut self, timeout: Duration, needle: &str) {
        let status = self.wait_exit(timeout).await;
        let stderr = self.stderr();
        assert!(
            !status.success(),
            "{} did not fail ({status}):\n{stderr}",
            self.label
        );
        assert!(
            stderr.contains(needle),
            "{}'s error does not say {needle:?}:\n{stderr}",
            self.label
        );
    }

    /// SIGTERM, then asserts a clean exit (status 0) within 20 s.
    pub async fn stop(mut self) {
        self.sigterm();
        let status = self.wait_exit(Duration::from_secs(20)).await;
        assert!(
            status.success(),
            "{} exited with {status} after SIGTERM\n--- stderr ---\n{}",
            self.label,
            self.stderr()
        );
    }
}
