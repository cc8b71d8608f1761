//! The operator commands with several outboxes (contract §6), end to end against the local
//! PostgreSQL: `status`, `dead-letters` and `migrate` act on every `[[outboxes]]` entry or on
//! the one `--outbox NAME` selects, and an unknown name is a usage error.
//!
//! Each test writes its own configuration file with two outboxes, `alpha` and `beta`, on
//! tables of its own (`oxa_<hex>`, `oxb_<hex>`) in the test database (so they share a pool).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use common::{CmdOutput, PG_URL, RelayBuilder, TempDir, TestTable, hex8, pg_connect};
use serde_json::Value;
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(60);

/// Two outboxes in one database, and the file that configures them.
struct Pair {
    alpha: TestTable,
    beta: TestTable,
    _dir: TempDir,
    config: PathBuf,
}

impl Pair {
    /// Writes the configuration; creates nothing in the database.
    async fn new() -> Self {
        let hex = hex8();
        let (a, b) = (format!("oxa_{hex}"), format!("oxb_{hex}"));
        let dir = TempDir::new("outboxes-cli");
        let config = dir.write(
            "relay.toml",
            &format!(
                "[publisher]\nkind = \"stdout\"\n\n\
                 [[outboxes]]\nname = \"alpha\"\ntable = \"{a}\"\n\n\
                 [[outboxes]]\nname = \"beta\"\ntable = \"{b}\"\n"
            ),
        );
        Self {
            alpha: TestTable {
                name: a,
                db: pg_connect().await,
            },
            beta: TestTable {
                name: b,
                db: pg_connect().await,
            },
            _dir: dir,
            config,
        }
    }

    /// `outbox-relay --config <file> <args>`.
    async fn run(&self, args: &[&str]) -> CmdOutput {
        let config = self.config.to_str().unwrap();
        let mut all = vec!["--config", config];
        all.extend_from_slice(args);
        RelayBuilder::bare("outboxes-cli")
            .set("database.url", PG_URL)
            .output(&all, WAIT)
            .await
    }

    async fn json(&self, args: &[&str]) -> Value {
        let out = self.run(args).await;
        assert!(out.status.success(), "{args:?}: {}", out.stderr);
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", out.stdout))
    }

    async fn drop(self) {
        for t in [self.alpha, self.beta] {
            let exists: bool =
                t.db.query_one("SELECT to_regclass($1) IS NOT NULL", &[&t.name])
                    .await
                    .unwrap()
                    .get(0);
            if exists {
                t.drop_table().await;
            }
        }
    }
}

/// Inserts a row in `status` (`failed` ones with 12 attempts and `last_error`), created
/// `secs_ago` seconds ago; returns its id.
async fn row(t: &TestTable, aggregate_type: &str, status: &str, secs_ago: f64) -> Uuid {
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts, \
           last_error, created_at, sent_at) \
         VALUES ($1, 'a-1', 'cli.event', '{{}}'::jsonb, $2, \
           CASE WHEN $2 = 'failed' THEN 12 ELSE 0 END, \
           CASE WHEN $2 = 'failed' THEN 'nack: boom' END, \
           now() - $3::float8 * interval '1 second', \
           CASE WHEN $2 = 'sent' THEN now() END) RETURNING id",
        t.name
    );
    t.db.query_one(&sql, &[&aggregate_type, &status, &secs_ago])
        .await
        .unwrap()
        .get(0)
}

async fn status_of(t: &TestTable, id: Uuid) -> Option<String> {
    t.db.query_opt(
        &format!("SELECT status FROM {} WHERE id = $1", t.name),
        &[&id],
    )
    .await
    .unwrap()
    .map(|r| r.get(0))
}

/// `(pending, ready, waiting, sent, failed)` of a `status --json` object.
fn counts(v: &Value) -> [i64; 5] {
    ["pending", "ready", "waiting", "sent", "failed"].map(|k| {
        v[k].as_i64()
            .unwrap_or_else(|| panic!("{k} is an integer in {v}"))
    })
}

async fn migrate_both(p: &Pair) {
    let out = p.run(&["migrate"]).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_dead_letters_cover_every_outbox_or_the_chosen_one() {
    let p = Pair::new().await;
    migrate_both(&p).await;
    let (a, b) = (&p.alpha, &p.beta);
    row(a, "order", "pending", 100.0).await;
    row(a, "order", "pending", 1.0).await;
    let fa1 = row(a, "order", "failed", 50.0).await;
    let fa2 = row(a, "invoice", "failed", 50.0).await;
    row(b, "invoice", "pending", 30.0).await;
    row(b, "invoice", "sent", 30.0).await;
    let fb1 = row(b, "invoice", "failed", 20.0).await;
    let fb2 = row(b, "invoice", "failed", 20.0).await;

    // status --json: the totals in today's shape, plus by_outbox with the same keys.
    let v = p.json(&["status", "--json"]).await;
    assert_eq!(counts(&v), [3, 3, 0, 1, 4], "totals: {v}");
    let oldest = v["oldest_pending_age_seconds"].as_f64().unwrap();
    assert!(
        (100.0..160.0).contains(&oldest),
        "the oldest of both: {oldest}"
    );
    assert_eq!(counts(&v["by_aggregate_type"]["order"]), [2, 2, 0, 0, 1]);
    assert_eq!(
        counts(&v["by_aggregate_type"]["invoice"]),
        [1, 1, 0, 1, 3],
        "invoice merged over both outboxes"
    );
    let by_outbox = v["by_outbox"].as_object().expect("by_outbox");
    assert_eq!(
        by_outbox.keys().map(String::as_str).collect::<Vec<_>>(),
        ["alpha", "beta"]
    );
    assert_eq!(counts(&by_outbox["alpha"]), [2, 2, 0, 0, 2]);
    assert_eq!(counts(&by_outbox["beta"]), [1, 1, 0, 1, 2]);
    let beta_oldest = by_outbox["beta"]["oldest_pending_age_seconds"]
        .as_f64()
        .unwrap();
    assert!((30.0..90.0).contains(&beta_oldest), "{beta_oldest}");
    let top: BTreeSet<&String> = v.as_object().unwrap().keys().collect();
    let inner: BTreeSet<&String> = by_outbox["beta"].as_object().unwrap().keys().collect();
    assert_eq!(
        top.iter().filter(|k| k.as_str() != "by_outbox").count(),
        inner.len(),
        "by_outbox entries have the top level's keys"
    );
    assert!(inner.iter().all(|k| top.contains(k)));
    assert_eq!(
        counts(&by_outbox["beta"]["by_aggregate_type"]["invoice"]),
        [1, 1, 0, 1, 2]
    );

    // --outbox beta: beta alone, at the top and in by_outbox.
    let v = p.json(&["status", "--json", "--outbox", "beta"]).await;
    assert_eq!(counts(&v), [1, 1, 0, 1, 2], "{v}");
    assert_eq!(
        v["by_outbox"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["beta"]
    );
    assert!(v["by_aggregate_type"].get("order").is_none(), "{v}");

    // Text: a line per outbox, then the types and TOTAL; with --outbox, today's table.
    let out = p.run(&["status"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    let first: Vec<Vec<&str>> = out
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(first[0][0], "OUTBOX", "{}", out.stdout);
    assert_eq!(
        first[1][..6],
        ["alpha", "2", "2", "0", "0", "0"],
        "{}",
        out.stdout
    );
    assert_eq!(
        first[2][..6],
        ["beta", "1", "1", "0", "0", "1"],
        "{}",
        out.stdout
    );
    let total = first.iter().find(|l| l.first() == Some(&"TOTAL")).unwrap();
    assert_eq!(total[1..6], ["3", "3", "0", "0", "1"], "{}", out.stdout);
    let out = p.run(&["status", "--outbox", "alpha"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    assert!(out.stdout.starts_with("AGGREGATE TYPE"), "{}", out.stdout);
    assert!(!out.stdout.contains("beta"), "{}", out.stdout);

    // dead-letters list --json: every outbox's, each row naming its outbox.
    let list = p.json(&["dead-letters", "list", "--json"]).await;
    let rows: Vec<(String, String)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["outbox"].as_str().unwrap().to_owned(),
                r["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [("alpha", fa1), ("alpha", fa2), ("beta", fb1), ("beta", fb2)]
            .map(|(o, id)| (o.to_owned(), id.to_string()))
    );
    assert_eq!(list[0]["last_error"], "nack: boom");
    let out = p.run(&["dead-letters", "list"]).await;
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with(&format!("beta  {fb2}"))),
        "{}",
        out.stdout
    );
    let only_beta = p
        .json(&["dead-letters", "list", "--json", "--outbox", "beta"])
        .await;
    assert_eq!(only_beta.as_array().unwrap().len(), 2);

    // retry --id finds the row in the second outbox; nothing else moves.
    let out = p
        .run(&["dead-letters", "retry", "--id", &fb1.to_string()])
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    out.assert_stdout_has("1 dead letter(s) set back to pending");
    assert_eq!(status_of(b, fb1).await.as_deref(), Some("pending"));
    for (t, id) in [(a, fa1), (a, fa2), (b, fb2)] {
        assert_eq!(status_of(t, id).await.as_deref(), Some("failed"));
    }

    // All or nothing across outboxes: an id in none of them changes nothing and is named.
    let unknown = Uuid::new_v4();
    let out = p
        .run(&[
            "dead-letters",
            "discard",
            "--id",
            &fa1.to_string(),
            "--id",
            &unknown.to_string(),
        ])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&unknown.to_string()), "{}", out.stderr);
    assert!(!out.stderr.contains(&fa1.to_string()), "{}", out.stderr);
    assert_eq!(status_of(a, fa1).await.as_deref(), Some("failed"));
    // An id of alpha with --outbox beta is not there.
    let out = p
        .run(&[
            "dead-letters",
            "retry",
            "--id",
            &fa1.to_string(),
            "--outbox",
            "beta",
        ])
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(out.stderr.contains(&fa1.to_string()), "{}", out.stderr);
    assert_eq!(status_of(a, fa1).await.as_deref(), Some("failed"));

    // discard --all --outbox alpha: alpha's dead letters go, beta's stays.
    let out = p
        .run(&["dead-letters", "discard", "--all", "--outbox", "alpha"])
        .await;
    assert!(out.status.success(), "{}", out.stderr);
    out.assert_stdout_has("2 dead letter(s) discarded");
    assert_eq!(status_of(a, fa1).await, None);
    assert_eq!(status_of(a, fa2).await, None);
    assert_eq!(status_of(b, fb2).await.as_deref(), Some("failed"));
    let list = p.json(&["dead-letters", "list", "--json"]).await;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["outbox"], "beta");
    assert_eq!(list[0]["id"], fb2.to_string());

    p.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_only_the_chosen_outbox_and_unknown_names_are_usage_errors() {
    let p = Pair::new().await;
    let exists = async |t: &TestTable| -> bool {
        t.db.query_one("SELECT to_regclass($1) IS NOT NULL", &[&t.name])
            .await
            .unwrap()
            .get(0)
    };

    // An unknown --outbox, after any of the subcommands: exit 2, naming it and the known ones.
    for args in [
        &["status", "--outbox", "gamma"][..],
        &["status", "--json", "--outbox", "gamma"],
        &["migrate", "--outbox", "gamma"],
        &["dead-letters", "list", "--outbox", "gamma"],
        &["dead-letters", "retry", "--all", "--outbox", "gamma"],
        &[
            "dead-letters",
            "discard",
            "--id",
            &Uuid::new_v4().to_string(),
            "--outbox",
            "gamma",
        ],
    ] {
        let out = p.run(args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", out.stderr);
        let err = out.stderr.trim();
        assert_eq!(err.lines().count(), 1, "one sentence: {err}");
        for name in ["\"gamma\"", "\"alpha\"", "\"beta\""] {
            assert!(err.contains(name), "{args:?}: {err} should name {name}");
        }
    }
    assert!(!exists(&p.alpha).await && !exists(&p.beta).await);

    // --print: the DDL of the chosen table, or of each.
    let out = p.run(&["migrate", "--print", "--outbox", "beta"]).await;
    assert!(out.status.success(), "{}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("CREATE TABLE IF NOT EXISTS {}", p.beta.name))
    );
    assert!(!out.stdout.contains(&p.alpha.name), "{}", out.stdout);
    let out = p.run(&["migrate", "--print"]).await;
    for (name, t) in [("alpha", &p.alpha), ("beta", &p.beta)] {
        assert!(
            out.stdout
                .contains(&format!("-- outbox {name}: table {}", t.name)),
            "{}",
            out.stdout
        );
        assert!(
            out.stdout
                .contains(&format!("CREATE TABLE IF NOT EXISTS {}", t.name))
        );
    }
    assert!(
        !exists(&p.alpha).await && !exists(&p.beta).await,
        "--print applies nothing"
    );

    // migrate --outbox beta: beta's table only.
    let out = p.run(&["migrate", "--outbox", "beta"]).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    assert!(exists(&p.beta).await, "beta migrated");
    assert!(!exists(&p.alpha).await, "alpha left alone");

    // check: one database line per outbox (alpha's table is missing: exit 1, saying so).
    let out = p.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1), "{}\n{}", out.stdout, out.stderr);
    out.assert_stdout_has("2 outboxes: alpha, beta");
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("alpha: database: reachable, but table")
                && l.contains(&p.alpha.name)),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("beta: database: ok")),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("broker: ok"), "{}", out.stdout);

    // Without --outbox: alpha created, beta up to date, each line naming its outbox.
    let out = p.run(&["migrate"]).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);
    assert!(exists(&p.alpha).await);
    assert!(
        out.stdout.contains(&format!(
            "alpha: {}: applied schema versions [1",
            p.alpha.name
        )),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .contains(&format!("beta: {} is up to date", p.beta.name)),
        "{}",
        out.stdout
    );
    let out = p.run(&["check"]).await;
    assert!(out.status.success(), "{}\n{}", out.stdout, out.stderr);

    p.drop().await;
}
