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
    http_request(addr, "GET", path, &[]).await
}

/// A plain HTTP/1.0 POST without a body, with `headers`: (status, body).
pub async fn http_post(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(u16, String), String> {
    http_request(addr, "POST", path, headers).await
}

/// One HTTP/1.0 request without a body: (status, body).
async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(u16, String), String> {
    let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if method != "GET" {
        head.push_str("Content-Length: 0\r\n");
    }
    head.push_str("\r\n");
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream
            .write_all(head.as_bytes())
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
        .map_err(|_| format!("{method} http://{addr}{path}: no answer within 10s"))?
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

/// The local addresses of the TCP sockets process `pid` listens on, read from its file
/// descriptors and `/proc/net/tcp` and `/proc/net/tcp6`: where a server is bound, learned
/// without sending a packet anywhere.
pub fn listening_addrs(pid: u32) -> Vec<SocketAddr> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("read the process's fds");
    let inodes: Vec<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode …
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            if *state == "0A" && inodes.iter().any(|i| i == inode) {
                found.push(parse_proc_addr(local).expect("a /proc/net/tcp address"));
            }
        }
    }
    found
}

/// A `/proc/net/tcp{,6}` address (`0100007F:23E3`): the IP as 32-bit words in host byte
/// order (little-endian here), then the port in hex.
fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for word in (0..ip.len()).step_by(8) {
        let w = u32::from_str_radix(ip.get(word..word + 8)?, 16).ok()?;
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_addresses_parse() {
        assert_eq!(parse_proc_addr("0100007F:23E3"), Some(local(9187)));
        assert_eq!(
            parse_proc_addr("00000000:0016"),
            Some("0.0.0.0:22".parse().unwrap())
        );
        let v6 = parse_proc_addr("00000000000000000000000001000000:1F90").unwrap();
        assert_eq!(v6, "[::1]:8080".parse().unwrap());
    }

    #[test]
    fn a_listener_of_this_process_is_found_where_it_is_bound() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(listening_addrs(std::process::id()).contains(&addr));
    }
}
