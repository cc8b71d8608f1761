//! The README's quickstart, run exactly as written, so it cannot rot: every shell command of
//! the `## Quickstart` section's `sh` blocks, in order, from the repository root, with the
//! shipped `relay.toml`, the default table `outbox_messages` in database `test` and the
//! exchange `outbox`. The commands that do not end by themselves (`run`, `tail`) run in the
//! background; the test passes when `tail` has printed the event the `INSERT` wrote, and both
//! then exit 0 on SIGTERM.
//!
//! Leftovers from earlier runs (rows in `outbox_messages`, messages in `outbox.dev`) do not
//! matter: `tail` prints them too, and the test looks for the id of the row this run inserted.
//! The deviations from a user's terminal: `metrics.listen` is moved off 9187 (through its
//! `RELAY_*` variable, not by editing a command), because a relay a developer runs, or another
//! test's, may hold that port; and cargo runs offline (`CARGO_NET_OFFLINE`), so the test never
//! reaches beyond loopback.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{TempDir, free_port, pg_connect, repo_file, wait_until};
use tokio::process::{Child, Command};
use tokio_postgres::error::SqlState;

/// `cargo run` may have to build the binary first (the tests built it with their own features).
const BUILD_WAIT: Duration = Duration::from_secs(900);
const WAIT: Duration = Duration::from_secs(60);

/// The shell commands of the README's `## Quickstart` section, in order: `sh` blocks only,
/// comments and blank lines dropped, a command continued over lines (trailing `\` or an open
/// quote) kept whole.
fn quickstart_commands(readme: &str) -> Vec<String> {
    let start = readme.find("\n## Quickstart");
    let section = &readme[start.expect("README has a ## Quickstart section") + 1..];
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
    let readme = repo_file("README.md");
    let commands = quickstart_commands(&readme);
    assert_eq!(commands.len(), 3, "{commands:#?}");
    assert_eq!(commands[0], "cargo run -- run");
    let insert = &commands[1];
    assert!(
        insert.starts_with("psql ") && insert.contains("INSERT INTO outbox_messages"),
        "{insert}"
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

/// A command started in its own process group, its stdout and stderr going to files.
struct Background {
    command: String,
    child: Child,
    output: TempDir,
}

/// `bash -c command` from the repository root; its stdout and stderr are left to the caller
/// (`.output()` pipes them, a [`Background`] sends them to files).
fn shell(command: &str, metrics_port: u16) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(command)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    // As a new user would run it: no RELAY_* settings from the test's environment.
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("RELAY_")) {
        cmd.env_remove(k);
    }
    cmd.env("RELAY_METRICS__LISTEN", format!("127.0.0.1:{metrics_port}"));
    // Tests send traffic to loopback only: `cargo run` builds from what the test build already
    // fetched, and fails rather than reaching for the registry.
    cmd.env("CARGO_NET_OFFLINE", "true");
    cmd
}

impl Background {
    fn start(command: &str, metrics_port: u16) -> Self {
        let output = TempDir::new("quickstart");
        let file = |name| std::fs::File::create(output.path().join(name)).expect("output file");
        let child = shell(command, metrics_port)
            .stdout(file("stdout"))
            .stderr(file("stderr"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
        Self {
            command: command.to_owned(),
            child,
            output,
        }
    }

    /// What it printed so far on `stream` (`stdout`, `stderr`).
    fn printed(&self, stream: &str) -> String {
        let bytes = std::fs::read(self.output.path().join(stream));
        String::from_utf8_lossy(&bytes.expect("read the command's output file")).into_owned()
    }

    async fn wait_for_stderr(&mut self, needle: &str, timeout: Duration) {
        let what = format!("{:?} logs {needle:?}", self.command);
        wait_until(timeout, &what, async || {
            let stderr = self.printed("stderr");
            if stderr.contains(needle) {
                return Ok(());
            }
            match self.child.try_wait() {
                Ok(Some(status)) => panic!("{:?} exited with {status}:\n{stderr}", self.command),
                _ => Err(format!("stderr so far:\n{stderr}")),
            }
        })
        .await;
    }

    /// SIGTERM to its process group; asserts that it exits 0.
    async fn stop(mut self) {
        let pid = self.child.id().expect("still running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", "--", &format!("-{pid}")])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM -{pid} failed");
        let command = &self.command;
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{command:?} did not stop after SIGTERM"))
            .expect("wait");
        let stderr = self.printed("stderr");
        let why = format!("{command:?} exited with {status} after SIGTERM:\n{stderr}");
        assert!(status.success(), "{why}");
    }
}

impl Drop for Background {
    /// After a failure, shows what the command printed.
    fn drop(&mut self) {
        if std::thread::panicking() {
            let (out, err) = (self.printed("stdout"), self.printed("stderr"));
            eprintln!("--- {:?} ---\n{out}\n--- stderr ---\n{err}", self.command);
        }
    }
}

/// The complete message blocks of `tail`'s output: each from a `message N:` line through the
/// newline that ends its `  body: …` line (`tail` may write a block in two parts, so the last
/// block can be half written).
fn tail_blocks(out: &str) -> Vec<String> {
    let mut blocks: Vec<String> = Vec::new();
    for line in out.split_inclusive('\n') {
        if line.starts_with("message ") {
            blocks.push(String::new());
        }
        if let Some(b) = blocks.last_mut() {
            b.push_str(line);
        }
    }
    blocks.retain(|b| b.contains("\n  body: ") && b.ends_with('\n'));
    blocks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_quickstart_shows_the_event_arriving() {
    let commands = quickstart_commands(&repo_file("README.md"));
    let metrics_port = free_port();
    let db = pg_connect().await;
    // Rows of earlier runs have a lower seq than the one this run inserts.
    let max = db.query_one("SELECT coalesce(max(seq), 0) FROM outbox_messages", &[]);
    let before: i64 = match max.await {
        Ok(row) => row.get(0),
        // No table yet: the quickstart's `run` creates it.
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => 0,
        Err(e) => panic!("max(seq) of outbox_messages: {e}"),
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

    let sql = "SELECT id::text FROM outbox_messages WHERE seq > $1 AND aggregate_type = 'order' \
               AND aggregate_id = '42' AND event_type = 'order.created'";
    let rows = db.query(sql, &[&before]).await.unwrap();
    let ours: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert!(!ours.is_empty(), "the quickstart's INSERT wrote no row");
    let tail = background.last().expect("tail runs in the background");
    let block = wait_until(WAIT, "tail prints the inserted event", async || {
        tail_blocks(&tail.printed("stdout"))
            .into_iter()
            .find(|b| ours.iter().any(|id| b.contains(&format!("  id: {id}\n"))))
            .ok_or_else(|| format!("tail printed:\n{}", tail.printed("stdout")))
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
        b.stop().await;
    }
}
