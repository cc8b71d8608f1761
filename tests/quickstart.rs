//! The README's quickstart, run exactly as written, so it cannot rot: every shell command of
//! the `## Quickstart` section's `sh` blocks, in order, from the repository root, with the
//! shipped `relay.toml`, the default table `outbox_messages` in database `test` and the
//! exchange `outbox`. The commands that do not end by themselves (`run`, `tail`) run in the
//! background; the test passes when `tail` has printed the event the `INSERT` wrote, and both
//! then exit 0 on SIGTERM.
//!
//! Leftovers from earlier runs (rows in `outbox_messages`, messages in `outbox.dev`) do not
//! matter: `tail` prints them too, and the test looks for the id of the row this run inserted.
//! The one deviation from a user's terminal: `metrics.listen` is moved off 9187 (through its
//! `RELAY_*` variable, not by editing a command), because a relay a developer runs, or another
//! test's, may hold that port.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{pg_connect, wait_until};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// `cargo run` may have to build the binary first (the tests built it with their own features).
const BUILD_WAIT: Duration = Duration::from_secs(900);
const WAIT: Duration = Duration::from_secs(60);

/// The shell commands of the README's `## Quickstart` section, in order: `sh` blocks only,
/// comments and blank lines dropped, a command continued over lines (trailing `\` or an open
/// quote) kept whole.
fn quickstart_commands(readme: &str) -> Vec<String> {
    let start = readme
        .find("\n## Quickstart")
        .expect("README has a ## Quickstart section");
    let section = &readme[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut commands = Vec::new();
    let mut in_sh = false;
    let mut current = String::new();
    for line in section.lines() {
        if !in_sh {
            in_sh = line.trim() == "```sh";
            continue;
        }
        if line.trim() == "```" {
            assert!(
                current.is_empty(),
                "unfinished command in README: {current}"
            );
            in_sh = false;
            continue;
        }
        if current.is_empty() && (line.trim().is_empty() || line.trim_start().starts_with('#')) {
            continue;
        }
        if !current.is_empty() {
            current.push('\n');
        }
        current.push_str(line);
        if !current.ends_with('\\') && quotes_balanced(&current) {
            commands.push(std::mem::take(&mut current));
        }
    }
    commands
}

/// Whether every single and double quote in `s` is closed (backslash escapes count inside
/// double quotes and outside quotes, as in sh).
fn quotes_balanced(s: &str) -> bool {
    let (mut single, mut double, mut escaped) = (false, false, false);
    for c in s.chars() {
        if escaped {
            escaped = false;
            continue;
        }
        match c {
            '\\' if !single => escaped = true,
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            _ => {}
        }
    }
    !single && !double
}

/// `cargo run -- run` and `cargo run -- tail` (without `--count`) run until stopped.
fn runs_until_stopped(cmd: &str) -> bool {
    cmd.contains("-- run") || (cmd.contains("-- tail") && !cmd.contains("--count"))
}

#[test]
fn the_quickstart_is_a_relay_an_insert_and_a_tail() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("read README.md");
    let commands = quickstart_commands(&readme);
    assert_eq!(commands.len(), 3, "{commands:#?}");
    assert_eq!(commands[0], "cargo run -- run");
    assert!(
        commands[1].starts_with("psql ") && commands[1].contains("INSERT INTO outbox_messages"),
        "{}",
        commands[1]
    );
    assert_eq!(commands[2], "cargo run -- tail");
    assert!(
        !readme.contains("cargo run --release"),
        "the README builds the debug binary"
    );
}

#[test]
fn commands_span_lines_while_quoted_or_continued() {
    let md = "# x\n## Quickstart\n```sh\n# a comment\necho 'a\nb' \\\n  \"c \\\" d\"\n\nls\n```\n```text\nnot run\n```\n## Next\n```sh\nnope\n```\n";
    assert_eq!(
        quickstart_commands(md),
        vec!["echo 'a\nb' \\\n  \"c \\\" d\"".to_owned(), "ls".to_owned()]
    );
}

/// A command started in its own process group, its output collected line by line.
struct Background {
    command: String,
    child: Child,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<Vec<String>>>,
}

fn collect(r: impl AsyncRead + Unpin + Send + 'static, sink: Arc<Mutex<Vec<String>>>, tag: String) {
    tokio::spawn(async move {
        let mut lines = BufReader::new(r).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("[{tag}] {line}");
            sink.lock().unwrap().push(line);
        }
    });
}

fn shell(command: &str, metrics_port: u16) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(command)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // As a new user would run it: no RELAY_* settings from the test's environment.
    for (k, _) in std::env::vars() {
        if k.starts_with("RELAY_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("RELAY_METRICS__LISTEN", format!("127.0.0.1:{metrics_port}"));
    cmd
}

impl Background {
    fn start(command: &str, metrics_port: u16) -> Self {
        let mut child = shell(command, metrics_port)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        let (stdout, stderr) = (Arc::default(), Arc::default());
        let tag: String = command.chars().take(24).collect();
        collect(
            child.stdout.take().unwrap(),
            Arc::clone(&stdout),
            format!("{tag} out"),
        );
        collect(
            child.stderr.take().unwrap(),
            Arc::clone(&stderr),
            format!("{tag} err"),
        );
        Self {
            command: command.to_owned(),
            child,
            stdout,
            stderr,
        }
    }

    fn stdout(&self) -> String {
        self.stdout.lock().unwrap().join("\n")
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    async fn wait_for_stderr(&mut self, needle: &str, timeout: Duration) {
        let what = format!("{:?} logs {needle:?}", self.command);
        let (stderr, command) = (Arc::clone(&self.stderr), self.command.clone());
        let child = &mut self.child;
        wait_until(timeout, &what, async || {
            if stderr.lock().unwrap().iter().any(|l| l.contains(needle)) {
                return Ok(());
            }
            match child.try_wait() {
                Ok(Some(status)) => panic!(
                    "{command:?} exited with {status}:\n{}",
                    stderr.lock().unwrap().join("\n")
                ),
                _ => Err("not yet".to_owned()),
            }
        })
        .await;
    }

    /// SIGTERM to its process group; its exit status.
    async fn stop(mut self) -> (ExitStatus, String) {
        let pid = self.child.id().expect("still running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", "--", &format!("-{pid}")])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM -{pid} failed");
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{:?} did not stop after SIGTERM", self.command))
            .expect("wait");
        (status, self.stderr())
    }
}

/// A message block of `tail`'s output: from `message N:` to the next one.
fn tail_blocks(out: &str) -> Vec<String> {
    let mut blocks: Vec<String> = Vec::new();
    for line in out.lines() {
        if line.starts_with("message ") {
            blocks.push(String::new());
        }
        if let Some(b) = blocks.last_mut() {
            b.push_str(line);
            b.push('\n');
        }
    }
    blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_quickstart_shows_the_event_arriving() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("read README.md");
    let commands = quickstart_commands(&readme);
    let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let db = pg_connect().await;
    // Rows of earlier runs have a lower seq than the one this run inserts.
    let exists: bool = db
        .query_one("SELECT to_regclass('outbox_messages') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    let before: i64 = if exists {
        db.query_one("SELECT coalesce(max(seq), 0) FROM outbox_messages", &[])
            .await
            .unwrap()
            .get(0)
    } else {
        0
    };

    let mut background: Vec<Background> = Vec::new();
    for command in &commands {
        if runs_until_stopped(command) {
            let mut b = Background::start(command, metrics_port);
            if command.contains("-- run") {
                // Started: schema, exchange and queue are in place.
                b.wait_for_stderr("outbox-relay starting", BUILD_WAIT).await;
                b.wait_for_stderr("connected to the broker", WAIT).await;
            } else {
                b.wait_for_stderr("waiting for messages", BUILD_WAIT).await;
            }
            background.push(b);
        } else {
            let out = tokio::time::timeout(BUILD_WAIT, shell(command, metrics_port).output())
                .await
                .unwrap_or_else(|_| panic!("{command:?} did not finish"))
                .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
            assert!(
                out.status.success(),
                "{command:?} failed with {}:\n{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    let ours: Vec<String> = db
        .query(
            "SELECT id::text FROM outbox_messages WHERE seq > $1 \
             AND aggregate_type = 'order' AND aggregate_id = '42' AND event_type = 'order.created'",
            &[&before],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!ours.is_empty(), "the quickstart's INSERT wrote no row");
    let tail = background.last().expect("tail runs in the background");
    let block = wait_until(WAIT, "tail prints the inserted event", async || {
        tail_blocks(&tail.stdout())
            .into_iter()
            .find(|b| ours.iter().any(|id| b.contains(&format!("  id: {id}\n"))))
            .ok_or_else(|| format!("tail printed:\n{}", tail.stdout()))
    })
    .await;
    for want in [
        "exchange \"outbox\", routing key \"order.order.created\"",
        "  type: order.created\n",
        "  content_type: application/json\n",
        "  header cloudEvents:subject: 42\n",
        "  header cloudEvents:source: /outbox/test/outbox_messages\n",
        "  body: {\"total\": 99}\n",
    ] {
        assert!(block.contains(want), "{want:?} not in\n{block}");
    }

    while let Some(b) = background.pop() {
        let command = b.command.clone();
        let (status, stderr) = b.stop().await;
        assert!(
            status.success(),
            "{command:?} exited with {status} after SIGTERM:\n{stderr}"
        );
    }
}
