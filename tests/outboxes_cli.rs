//! The operator commands with several outboxes (docs/operations.md), end to end against the local
//! PostgreSQL: `status`, `dead-letters` and `migrate` act on every `[[outboxes]]` entry or on
//! the one `--outbox NAME` selects, an unknown name is a usage error, and `status` prints the
//! outboxes it can read when another's table is missing.
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
use tokio_postgres::types::ToSql;
use uuid::Uuid;

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
        let table = async |name| TestTable {
            name,
            db: pg_connect().await,
        };
        Self {
            alpha: table(a).await,
            beta: table(b).await,
            _dir: dir,
            config,
        }
    }

    /// `outbox-relay --config <file> <args>`, which must exit with `code`.
    async fn exits(&self, args: &[&str], code: i32) -> CmdOutput {
        let config = self.config.to_str().unwrap();
        let all = [&["--config", config][..], args].concat();
        let out = RelayBuilder::bare("outboxes-cli")
            .set("database.url", PG_URL)
            .output(&all, Duration::from_secs(60))
            .await;
        let printed = format!(
            "--- stdout ---\n{}\n--- stderr ---\n{}",
            out.stdout, out.stderr
        );
        assert_eq!(out.status.code(), Some(code), "{args:?}\n{printed}");
        out
    }

    /// [`Pair::exits`] with 0: success.
    async fn ok(&self, args: &[&str]) -> CmdOutput {
        self.exits(args, 0).await
    }

    /// [`Pair::ok`], stdout parsed as JSON.
    async fn json(&self, args: &[&str]) -> Value {
        let out = self.ok(args).await;
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", out.stdout))
    }

    async fn drop(self) {
        for t in [self.alpha, self.beta] {
            if t.exists().await {
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
    let args: [&(dyn ToSql + Sync); 3] = [&aggregate_type, &status, &secs_ago];
    t.db.query_one(&sql, &args).await.unwrap().get(0)
}

/// Asserts the status of each row (`None`: the row is gone).
async fn assert_statuses(rows: &[(&TestTable, Uuid, Option<&str>)]) {
    for (t, id, want) in rows {
        let sql = format!("SELECT status FROM {} WHERE id = $1", t.name);
        let got: Option<String> = t.db.query_opt(&sql, &[id]).await.unwrap().map(|r| r.get(0));
        assert_eq!(got.as_deref(), *want, "status of {id} in {}", t.name);
    }
}

/// The keys of a JSON object.
fn keys(v: &Value) -> BTreeSet<&str> {
    let obj = v.as_object().expect("a JSON object");
    obj.keys().map(String::as_str).collect()
}

/// `(pending, ready, waiting, sent, failed)` of a `status --json` object.
fn counts(v: &Value) -> [i64; 5] {
    ["pending", "ready", "waiting", "sent", "failed"].map(|k| {
        v[k].as_i64()
            .unwrap_or_else(|| panic!("{k} is an integer in {v}"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_dead_letters_cover_every_outbox_or_the_chosen_one() {
    let p = Pair::new().await;
    p.ok(&["migrate"]).await;
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
    // The counts at the top, by aggregate type (invoice merged over both outboxes), by outbox.
    for (at, want) in [
        ("", [3, 3, 0, 1, 4]),
        ("/by_aggregate_type/order", [2, 2, 0, 0, 1]),
        ("/by_aggregate_type/invoice", [1, 1, 0, 1, 3]),
        ("/by_outbox/alpha", [2, 2, 0, 0, 2]),
        ("/by_outbox/beta", [1, 1, 0, 1, 2]),
        ("/by_outbox/beta/by_aggregate_type/invoice", [1, 1, 0, 1, 2]),
    ] {
        let counted = v.pointer(at).unwrap_or_else(|| panic!("no {at} in {v}"));
        assert_eq!(counts(counted), want, "{at}: {v}");
    }
    // The oldest pending row: of both outboxes at the top, of its own in by_outbox.
    for (at, range) in [("", 100.0..160.0), ("/by_outbox/beta", 30.0..90.0)] {
        let oldest = v.pointer(&format!("{at}/oldest_pending_age_seconds"));
        let oldest = oldest.and_then(Value::as_f64).unwrap();
        assert!(range.contains(&oldest), "{at}: {oldest}");
    }
    assert_eq!(keys(&v["by_outbox"]), ["alpha", "beta"].into());
    let mut top = keys(&v);
    top.remove("by_outbox");
    let inner = keys(&v["by_outbox"]["beta"]);
    assert_eq!(inner, top, "by_outbox entries have the top level's keys");

    // --outbox beta: beta alone, at the top and in by_outbox.
    let v = p.json(&["status", "--json", "--outbox", "beta"]).await;
    assert_eq!(counts(&v), [1, 1, 0, 1, 2], "{v}");
    assert_eq!(keys(&v["by_outbox"]), ["beta"].into());
    assert!(v["by_aggregate_type"].get("order").is_none(), "{v}");

    // Text: a line per outbox, then the types and TOTAL; with --outbox, today's table.
    let text = p.ok(&["status"]).await.stdout;
    let first: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(first[0][0], "OUTBOX", "{text}");
    assert_eq!(first[1][..6], ["alpha", "2", "2", "0", "0", "0"], "{text}");
    assert_eq!(first[2][..6], ["beta", "1", "1", "0", "0", "1"], "{text}");
    let total = first.iter().find(|l| l.first() == Some(&"TOTAL")).unwrap();
    assert_eq!(total[1..6], ["3", "3", "0", "0", "1"], "{text}");
    let text = p.ok(&["status", "--outbox", "alpha"]).await.stdout;
    assert!(text.starts_with("AGGREGATE TYPE"), "{text}");
    assert!(!text.contains("beta"), "{text}");

    // dead-letters list --json: every outbox's, each row naming its outbox.
    let list = p.json(&["dead-letters", "list", "--json"]).await;
    let text = |v: &Value| v.as_str().unwrap().to_owned();
    let rows = list.as_array().unwrap().iter();
    let rows: Vec<(String, String)> = rows.map(|r| (text(&r["outbox"]), text(&r["id"]))).collect();
    let want = [("alpha", fa1), ("alpha", fa2), ("beta", fb1), ("beta", fb2)];
    let want: Vec<(String, String)> = want.map(|(o, id)| (o.to_owned(), id.to_string())).into();
    assert_eq!(rows, want);
    assert_eq!(list[0]["last_error"], "nack: boom");
    let listing = p.ok(&["dead-letters", "list"]).await.stdout;
    let beta_line = format!("beta  {fb2}");
    assert!(
        listing.lines().any(|l| l.starts_with(&beta_line)),
        "{listing}"
    );
    let only_beta = p
        .json(&["dead-letters", "list", "--json", "--outbox", "beta"])
        .await;
    assert_eq!(only_beta.as_array().unwrap().len(), 2);

    // retry --id finds the row in the second outbox; nothing else moves.
    p.ok(&["dead-letters", "retry", "--id", &fb1.to_string()])
        .await
        .assert_stdout_has("1 dead letter(s) set back to pending");
    let failed = Some("failed");
    assert_statuses(&[
        (b, fb1, Some("pending")),
        (a, fa1, failed),
        (a, fa2, failed),
        (b, fb2, failed),
    ])
    .await;

    // All or nothing across outboxes: an id in none of them changes nothing and is named.
    // fa1's id, and one in no outbox.
    let (id, unknown) = (fa1.to_string(), Uuid::new_v4().to_string());
    let discard = ["dead-letters", "discard", "--id", &id, "--id", &unknown];
    let err = p.exits(&discard, 1).await.stderr;
    assert!(err.contains(&unknown), "{err}");
    assert!(!err.contains(&id), "{err}");
    assert_statuses(&[(a, fa1, failed)]).await;
    // An id of alpha with --outbox beta is not there.
    let retry = ["dead-letters", "retry", "--id", &id, "--outbox", "beta"];
    let err = p.exits(&retry, 1).await.stderr;
    assert!(err.contains(&id), "{err}");
    assert_statuses(&[(a, fa1, failed)]).await;

    // discard --all --outbox alpha: alpha's dead letters go, beta's stays.
    p.ok(&["dead-letters", "discard", "--all", "--outbox", "alpha"])
        .await
        .assert_stdout_has("2 dead letter(s) discarded");
    assert_statuses(&[(a, fa1, None), (a, fa2, None), (b, fb2, failed)]).await;
    let list = p.json(&["dead-letters", "list", "--json"]).await;
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["outbox"], "beta");
    assert_eq!(list[0]["id"], fb2.to_string());

    p.drop().await;
}

/// One outbox's table missing: `status` prints the other's figures, names the missing one on
/// stderr with what to do, and fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_prints_the_outboxes_it_can_read_and_fails_naming_the_others() {
    let p = Pair::new().await;
    p.ok(&["migrate", "--outbox", "alpha"]).await;
    row(&p.alpha, "order", "pending", 10.0).await;
    let out = p.exits(&["status"], 1).await;
    assert!(
        out.stdout.contains("order"),
        "alpha's figures: {}",
        out.stdout
    );
    let missing = format!(
        "table {} does not exist: run `outbox-relay migrate`",
        p.beta.name
    );
    assert!(out.stderr.contains(&missing), "{}", out.stderr);
    let out = p.exits(&["status", "--json"], 1).await;
    let v: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(keys(&v["by_outbox"]), BTreeSet::from(["alpha"]), "{v}");
    assert_eq!(v["pending"], 1, "{v}");
    p.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_creates_only_the_chosen_outbox_and_unknown_names_are_usage_errors() {
    let p = Pair::new().await;
    let neither = async || !p.alpha.exists().await && !p.beta.exists().await;

    // An unknown --outbox, after any of the subcommands: exit 2, naming it and the known ones.
    let id = Uuid::new_v4().to_string();
    for args in [
        &["status", "--outbox", "gamma"][..],
        &["status", "--json", "--outbox", "gamma"],
        &["migrate", "--outbox", "gamma"],
        &["dead-letters", "list", "--outbox", "gamma"],
        &["dead-letters", "retry", "--all", "--outbox", "gamma"],
        &["dead-letters", "discard", "--id", &id, "--outbox", "gamma"],
    ] {
        let out = p.exits(args, 2).await;
        let err = out.stderr.trim();
        assert_eq!(err.lines().count(), 1, "one sentence: {err}");
        for name in ["\"gamma\"", "\"alpha\"", "\"beta\""] {
            assert!(err.contains(name), "{args:?}: {err} should name {name}");
        }
    }
    assert!(neither().await);

    // --print: the DDL of the chosen table, or of each.
    let create = |t: &TestTable| format!("CREATE TABLE IF NOT EXISTS {}", t.name);
    let text = p
        .ok(&["migrate", "--print", "--outbox", "beta"])
        .await
        .stdout;
    assert!(text.contains(&create(&p.beta)), "{text}");
    assert!(!text.contains(&p.alpha.name), "{text}");
    let text = p.ok(&["migrate", "--print"]).await.stdout;
    for (name, t) in [("alpha", &p.alpha), ("beta", &p.beta)] {
        let header = format!("-- outbox {name}: table {}", t.name);
        assert!(text.contains(&header), "{text}");
        assert!(text.contains(&create(t)), "{text}");
    }
    assert!(neither().await, "--print applies nothing");

    // migrate --outbox beta: beta's table only.
    p.ok(&["migrate", "--outbox", "beta"]).await;
    assert!(p.beta.exists().await, "beta migrated");
    assert!(!p.alpha.exists().await, "alpha left alone");

    // check: one database line per outbox (alpha's table is missing: exit 1, saying so).
    let out = p.exits(&["check"], 1).await;
    let text = &out.stdout;
    out.assert_stdout_has("2 outboxes: alpha, beta");
    let missing = "alpha: database: reachable, but table";
    assert!(
        text.lines()
            .any(|l| l.starts_with(missing) && l.contains(&p.alpha.name)),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("beta: database: ok")),
        "{text}"
    );
    out.assert_stdout_has("broker: ok");

    // Without --outbox: alpha created, beta up to date, each line naming its outbox.
    let text = p.ok(&["migrate"]).await.stdout;
    assert!(p.alpha.exists().await);
    let applied = format!("alpha: {}: applied schema versions [1", p.alpha.name);
    assert!(text.contains(&applied), "{text}");
    let up_to_date = format!("beta: {} is up to date", p.beta.name);
    assert!(text.contains(&up_to_date), "{text}");
    p.ok(&["check"]).await;

    p.drop().await;
}
