//! TLS to MySQL and MariaDB (`ssl-mode`, `ssl-ca` in the URL, docs/mysql.md "TLS"), against a
//! MariaDB of each test's own that speaks only TLS (`require_secure_transport`, a certificate
//! signed by a CA the test makes: testkit's `TlsMariadb`): a relay that verifies the server's
//! CA migrates, checks and relays over TLS; a server certificate from a CA the relay does not
//! trust, or a URL asking for no TLS, is an error at `check` and at start that says what is
//! wrong, never a relay that goes on.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::time::Duration;

use common::mariadb_tls::TlsMariadb;
use common::{NewRow, RelayBuilder};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

/// A relay on `url`'s table `outbox_messages` with the stdout sink and no metrics port.
fn relay(label: &str, url: &str) -> RelayBuilder {
    RelayBuilder::bare(label)
        .set("database.url", url)
        .set("database.table", "outbox_messages")
        .set("publisher.kind", "stdout")
        .set("relay.poll_interval", "100ms")
        .set("metrics.listen", "")
}

/// `(status, attempts)` of every row of `outbox_messages`, in `seq` order.
async fn row_states(db: &TlsMariadb) -> Vec<(String, i32)> {
    let mut conn = db.connect(Some("test")).await.expect("TLS connection");
    mysql_async::prelude::Queryable::query(
        &mut conn,
        "SELECT status, attempts FROM outbox_messages ORDER BY seq",
    )
    .await
    .expect("read the rows")
}

#[tokio::test]
async fn a_relay_that_verifies_the_servers_ca_migrates_checks_and_relays_over_tls() {
    let db = TlsMariadb::start().await;
    let url = db.url(&format!(
        "ssl-mode=VERIFY_CA&ssl-ca={}",
        db.ca_pem.display()
    ));
    let migrate = relay("my-tls-ok", &url).output(&["migrate"], WAIT).await;
    assert!(
        migrate.status.success(),
        "migrate over TLS: {migrate:?}\n{}",
        db.log()
    );
    let check = relay("my-tls-ok", &url).output(&["check"], WAIT).await;
    assert!(check.status.success(), "check over TLS: {check:?}");

    let mut conn = db.connect(Some("test")).await.expect("TLS connection");
    let rows: Vec<NewRow> = (0..3)
        .map(|i| NewRow::new("order", Some("42"), "order.changed", json!({ "i": i })))
        .collect();
    common::mysql::insert_in(&mut conn, "outbox_messages", &rows).await;
    let run = relay("my-tls-ok", &url).spawn();
    common::wait_until(WAIT, "every row sent over TLS", async || {
        let states = row_states(&db).await;
        if states.len() == 3 && states.iter().all(|(s, _)| s == "sent") {
            Ok(states)
        } else {
            Err(format!("rows: {states:?}"))
        }
    })
    .await;
    let out = run.stdout();
    run.stop().await;
    let states = row_states(&db).await;
    assert_eq!(
        states,
        vec![("sent".to_owned(), 1); 3],
        "each row sent once, with one attempt"
    );
    for i in 0..3 {
        assert!(
            out.contains(&format!("\"i\":{i}")),
            "message {i} on stdout:\n{out}"
        );
    }
}

#[tokio::test]
async fn a_server_certificate_from_a_ca_the_relay_does_not_trust_is_refused_naming_it() {
    let db = TlsMariadb::start().await;
    let url = db.url(&format!(
        "ssl-mode=VERIFY_CA&ssl-ca={}",
        db.unrelated_ca_pem.display()
    ));
    let check = relay("my-tls-ca", &url).output(&["check"], WAIT).await;
    let out = format!("{}\n{}", check.stdout, check.stderr);
    assert!(
        !check.status.success(),
        "check trusted an unknown CA:\n{out}"
    );
    assert!(
        out.contains("certificate is not trusted") && out.contains("ssl-ca"),
        "check's error does not name the certificate and what to set:\n{out}"
    );
    relay("my-tls-ca", &url)
        .spawn()
        .expect_start_error(WAIT, "certificate is not trusted")
        .await;
}

#[tokio::test]
async fn a_url_asking_for_no_tls_is_refused_by_a_server_that_requires_it() {
    let db = TlsMariadb::start().await;
    let url = db.url("ssl-mode=DISABLED");
    let check = relay("my-tls-off", &url).output(&["check"], WAIT).await;
    let out = format!("{}\n{}", check.stdout, check.stderr);
    assert!(
        !check.status.success(),
        "a plain-text check passed against a TLS-only server:\n{out}"
    );
    // MariaDB refuses it as "access denied"; the relay adds what else that can mean.
    assert!(
        out.contains("require_secure_transport") && out.contains("ssl-mode"),
        "check does not say that the server may require TLS:\n{out}"
    );
}
