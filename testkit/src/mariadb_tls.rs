//! A MariaDB server of a test's own that speaks only TLS, for the TLS tests: Debian's
//! `mariadbd` on a free loopback port, its data directory made by `mariadb-install-db` in a
//! temp dir, its certificate (for `localhost` and `127.0.0.1`) signed by a CA the test makes,
//! and `require_secure_transport` on, so a plain-text client is refused. `root` has no
//! password; the database `test` exists. The shared MariaDB of the machine has no TLS
//! (`have_ssl` is `DISABLED`), which is why this one exists.
//!
//! The server runs as root (`--user=root`), as the tests do. [`TlsMariadb`] kills it and
//! removes its files when dropped, also when a test panics; a test process that is killed takes
//! the server with it (a parent-death signal).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, OptsBuilder, SslOpts};
use rcgen::{CertificateParams, KeyPair};

use crate::kafka::test_ca;
use crate::{free_port, hex8, wait_until};

/// How long the server gets to start.
const START_WAIT: Duration = Duration::from_secs(60);

/// A running TLS-only MariaDB; see the module doc.
pub struct TlsMariadb {
    /// The loopback port it listens on.
    pub port: u16,
    /// PEM of the CA that signed the server's certificate (for `ssl-ca`).
    pub ca_pem: PathBuf,
    /// PEM of a CA that signed nothing this server presents.
    pub unrelated_ca_pem: PathBuf,
    dir: PathBuf,
    server: Child,
}

impl TlsMariadb {
    /// Makes the certificates and the data directory, starts the server and waits until it
    /// accepts a TLS connection, then creates the database `test`.
    pub async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-relay-mariadb-tls-{}", hex8()));
        std::fs::create_dir_all(&dir).expect("mariadb temp dir");
        let (ca_pem, unrelated_ca_pem) = write_certificates(&dir);
        let data = dir.join("data");
        // A temp dir of its own: servers bootstrapping side by side in one /tmp collide on
        // their temporary tables' names.
        let tmp = dir.join("tmp");
        std::fs::create_dir_all(&tmp).expect("mariadb tmpdir");
        let install = Command::new("mariadb-install-db")
            .args(["--no-defaults", "--user=root", "--skip-test-db"])
            .arg("--auth-root-authentication-method=normal")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--tmpdir={}", tmp.display()))
            .output()
            .expect("run mariadb-install-db (Debian's mariadb-server)");
        assert!(
            install.status.success(),
            "mariadb-install-db failed:\n{}\n{}",
            String::from_utf8_lossy(&install.stdout),
            String::from_utf8_lossy(&install.stderr)
        );
        let port = free_port();
        let log = std::fs::File::create(dir.join("server.log")).expect("server log");
        // setpriv (util-linux) runs mariadbd with a parent-death signal: a test process killed
        // before it could drop the server (SIGKILL, a timeout) takes the server with it.
        let server = Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "/usr/sbin/mariadbd"])
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--tmpdir={}", tmp.display()))
            .args([
                "--user=root",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
            ])
            .arg(format!("--port={port}"))
            .arg(format!("--socket={}", dir.join("sock").display()))
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .arg(format!("--ssl-ca={}", ca_pem.display()))
            .arg(format!("--ssl-cert={}", dir.join("server.pem").display()))
            .arg(format!("--ssl-key={}", dir.join("server.key").display()))
            .arg("--require-secure-transport=ON")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start mariadbd");
        let db = Self {
            port,
            ca_pem,
            unrelated_ca_pem,
            dir,
            server,
        };
        let mut conn = wait_until(
            START_WAIT,
            "the TLS MariaDB accepts a connection",
            async || db.connect(None).await.map_err(|e| format!("{e}")),
        )
        .await;
        conn.query_drop("CREATE DATABASE IF NOT EXISTS test")
            .await
            .expect("create database test");
        db
    }

    /// `mysql://root@127.0.0.1:<port>/test`, with `query` (without `?`) when not empty.
    pub fn url(&self, query: &str) -> String {
        let base = format!("mysql://root@127.0.0.1:{}/test", self.port);
        if query.is_empty() {
            base
        } else {
            format!("{base}?{query}")
        }
    }

    /// A TLS connection as root that trusts the server's CA, to database `db` (or none).
    pub async fn connect(&self, db: Option<&str>) -> Result<Conn, mysql_async::Error> {
        let ssl = SslOpts::default()
            .with_root_certs(vec![self.ca_pem.clone().into()])
            .with_danger_skip_domain_validation(true);
        let opts = OptsBuilder::default()
            .ip_or_hostname("127.0.0.1")
            .tcp_port(self.port)
            .user(Some("root"))
            .db_name(db)
            .prefer_socket(false)
            .ssl_opts(ssl);
        Conn::new(opts).await
    }

    /// The server's log so far (for a failure message).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }
}

impl Drop for TlsMariadb {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Writes `ca.pem`, `server.pem` and `server.key` (a certificate for `localhost` and
/// `127.0.0.1` signed by that CA) and `unrelated-ca.pem` into `dir`: (CA path, unrelated CA
/// path).
fn write_certificates(dir: &Path) -> (PathBuf, PathBuf) {
    let (ca, ca_text) = test_ca("outbox-relay MariaDB test CA");
    let key = KeyPair::generate().expect("server key");
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("server certificate params")
        .signed_by(&key, &ca)
        .expect("sign the server certificate");
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write a certificate file");
        path
    };
    write("server.pem", &cert.pem());
    write("server.key", &key.serialize_pem());
    let (_, unrelated) = test_ca("outbox-relay unrelated CA");
    (
        write("ca.pem", &ca_text),
        write("unrelated-ca.pem", &unrelated),
    )
}
