//! The relay's HTTP side as a test sees it: a plain GET, the `/metrics` text and its samples.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::wait_until;

/// `127.0.0.1:port`.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A plain HTTP/1.0 GET (the server closes the connection after the answer): (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
            .await
            .map_err(|e| format!("write to {addr}: {e}"))?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .await
            .map_err(|e| format!("read from {addr}: {e}"))?;
        let text = String::from_utf8(raw).map_err(|e| format!("non-UTF-8 answer: {e}"))?;
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| format!("no end of headers in {text:?}"))?;
        let code = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| format!("bad status line in {head:?}"))?;
        Ok((code, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("GET http://{addr}{path}: no answer within 10s"))?
}

/// The relay's `/metrics` text on `127.0.0.1:port`.
pub async fn scrape(port: u16) -> Result<String, String> {
    match http_get(local(port), "/metrics").await? {
        (200, body) => Ok(body),
        (code, body) => Err(format!("/metrics answered {code}: {body}")),
    }
}

/// The value of the sample `name{labels…}` in a Prometheus text exposition (labels not given
/// are not compared).
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find_map(|(series, value)| {
            let (n, label_text) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            if n != name {
                return None;
            }
            let have: BTreeMap<&str, &str> = label_text
                .split("\",")
                .filter(|p| !p.is_empty())
                .filter_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    Some((k.trim(), v.trim_matches('"')))
                })
                .collect();
            labels
                .iter()
                .all(|(k, v)| have.get(k) == Some(v))
                .then(|| value.parse().ok())
                .flatten()
        })
}

/// Polls `/metrics` on `port` until `sample(name, labels)` satisfies `ok`; returns the value.
/// Panics after `timeout` with the last value seen.
pub async fn wait_for_sample(
    port: u16,
    timeout: Duration,
    name: &str,
    labels: &[(&str, &str)],
    ok: impl Fn(f64) -> bool,
) -> f64 {
    let what = format!("{name}{labels:?} is as the test wants");
    wait_until(timeout, &what, async || {
        let text = scrape(port).await?;
        match sample(&text, name, labels) {
            Some(v) if ok(v) => Ok(v),
            other => Err(format!("{name}{labels:?} = {other:?}")),
        }
    })
    .await
}
