//! What the relay costs the application's commits (issue 13), measured with pgbench beside the
//! real binary draining to RabbitMQ: 8 connections, one row per transaction, as fast as they
//! go, in one run: no relay; the relay on its defaults; the relay polling only; and the
//! relay on its defaults with every transaction notifying (a waiting record kept alive by
//! hand: what schema version 1's trigger cost). A measurement, so `#[ignore]`d: run it alone,
//! `cargo test --test commit_cost -- --ignored --nocapture` (`COMMIT_COST_SECS`, default 20).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{PG_URL, RelayBuilder, TempDir, drop_both, table_and_exchange};

/// `pgbench` one-row inserts from 8 connections for `secs`; returns (tps, mean latency ms).
fn pgbench(table: &str, secs: u64) -> (f64, f64) {
    let dir = TempDir::new("commit_cost");
    let insert = format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) \
         VALUES ('order', 'a' || (random() * 1000)::int, 'OrderPlaced', '{{\"n\": 1}}');\n"
    );
    let script = dir.write("insert.sql", &insert);
    let args = format!("-n -M prepared -c 8 -j 2 -T {secs} -f");
    let out = std::process::Command::new("pgbench")
        .args(args.split(' '))
        .arg(&script)
        .arg(PG_URL)
        .output()
        .expect("pgbench");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pgbench: {text}{err}");
    let num = |prefix: &str| -> f64 {
        let line = text.lines().find_map(|l| l.trim().strip_prefix(prefix));
        line.and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix:?} in pgbench output:\n{text}"))
    };
    (num("tps = "), num("latency average = "))
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after_name = stat.rsplit(')').next().unwrap();
    // utime and stime are fields 14 and 15 (1-based) of the whole line: 12 and 13 after ')'.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |i: usize| fields[i].parse::<f64>().unwrap();
    (ticks(11) + ticks(12)) / 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run alone with --ignored --nocapture"]
async fn application_commits_beside_the_relay() {
    let secs: u64 = std::env::var("COMMIT_COST_SECS").map_or(20, |v| v.parse().unwrap_or(20));
    let (table, rabbit) = table_and_exchange("commit_cost").await;
    // `$TABLE` in a statement stands for the table's name.
    let (db, t) = (&table.db, &table.name);
    let sql = async |stmt: &str| db.batch_execute(&stmt.replace("$TABLE", t)).await.unwrap();
    let left = async || table.count_where("true").await;
    let (mut lines, mut by_mode) = (Vec::new(), BTreeMap::new());
    for round in 0..2 {
        for mode in ["no relay", "default", "poll only", "notify every txn"] {
            let relay = (mode != "no relay").then(|| {
                RelayBuilder::for_test(&table, &rabbit, &format!("cost-{round}"))
                    .set("relay.notify", (mode != "poll only").to_string())
                    .set("cleanup.retention", "0s")
                    .serving_metrics()
                    .spawn()
            });
            if let Some(r) = &relay {
                r.wait_broker_connected(Duration::from_secs(30)).await;
            }
            if mode == "notify every txn" {
                sql("INSERT INTO $TABLE_waiters (relay, pid, alive_until) \
                     VALUES ('v1-like', pg_backend_pid(), now() + interval '1 hour')")
                .await;
            }
            let before = left().await;
            let cpu0 = relay.as_ref().map(|r| cpu_secs(r.pid()));
            let t0 = Instant::now();
            let (tps, lat) = pgbench(&table.name, secs);
            let cpu = relay.as_ref().map(|r| cpu_secs(r.pid()) - cpu0.unwrap());
            if let Some(r) = relay {
                // Let it drain what is left, then stop it.
                let deadline = Instant::now() + Duration::from_secs(60);
                while left().await > 0 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                r.stop().await;
            }
            sql("DELETE FROM $TABLE_waiters").await;
            let inserted = tps * t0.elapsed().as_secs_f64();
            let per_1k = cpu.map_or("-".to_owned(), |c| {
                format!("{:.0}", c * 1e6 / inserted.max(1.0))
            });
            let line = format!(
                "round {round}, {mode:>16}: {tps:>7.0} commits/s, mean commit latency {lat:.2} ms, \
                 relay CPU {per_1k} ms per 1k rows, rows left {} (of ~{:.0})",
                left().await,
                inserted + before as f64
            );
            eprintln!("{line}");
            lines.push(line);
            by_mode.entry(mode).or_insert_with(Vec::new).push(tps);
            if mode == "no relay" {
                sql("DELETE FROM $TABLE").await;
            }
        }
    }
    let best = |m: &str| by_mode[m].iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "default / poll only {:.2}; default / no relay {:.2}; poll only / no relay {:.2}; notify every txn / poll only {:.2}",
        best("default") / best("poll only"),
        best("default") / best("no relay"),
        best("poll only") / best("no relay"),
        best("notify every txn") / best("poll only"),
    );
    drop_both(table, rabbit).await;
    assert!(
        best("default") >= 0.95 * best("poll only"),
        "the default wake-up costs commits: {lines:#?}"
    );
}
