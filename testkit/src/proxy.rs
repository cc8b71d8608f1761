//! A TCP proxy that the test controls: forward, stall (a black hole), hold answers or cut.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Forward,
    Stall,
    /// Forwards what the client sends; holds back what the server answers.
    HoldAnswers,
    Cut,
}

impl Mode {
    /// Whether bytes flow towards the server (`upstream`) or the client in this mode.
    fn flows(self, upstream: bool) -> bool {
        self == Mode::Forward || (upstream && self == Mode::HoldAnswers)
    }
}

struct ProxyShared {
    upstream: String,
    mode: watch::Sender<Mode>,
    // Cancelled by `cut()`: ends every connection opened before it.
    live: Mutex<CancellationToken>,
    accepted: AtomicUsize,
    // Bytes the client sent on the connection accepted last.
    last_upstream_bytes: AtomicUsize,
    // A connection whose client sends more than this many bytes is cut (`usize::MAX`: none).
    cut_beyond: AtomicUsize,
}

/// A TCP proxy on 127.0.0.1 in front of `upstream` that the test controls.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<ProxyShared>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port and forwards to `upstream`.
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(ProxyShared {
            upstream: upstream.to_owned(),
            mode: watch::channel(Mode::Forward).0,
            live: Mutex::new(CancellationToken::new()),
            accepted: AtomicUsize::new(0),
            last_upstream_bytes: AtomicUsize::new(0),
            cut_beyond: AtomicUsize::new(usize::MAX),
        });
        let s = Arc::clone(&shared);
        let accept = tokio::spawn(async move {
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if *s.mode.borrow() == Mode::Cut {
                    drop(inbound); // refused: closed at once
                    continue;
                }
                s.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(inbound, Arc::clone(&s)));
            }
        });
        Self {
            addr,
            shared,
            accept,
        }
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// An AMQP URL (guest/guest, vhost `/`) that goes through the proxy.
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    /// Drops every live connection (bytes held by a stall are discarded) and closes new ones
    /// as soon as they are accepted, until `heal()`.
    pub fn cut(&self) {
        self.shared.mode.send_replace(Mode::Cut);
        let old = std::mem::replace(
            &mut *self.shared.live.lock().unwrap(),
            CancellationToken::new(),
        );
        old.cancel();
    }

    /// Keeps connections open but forwards nothing in either direction (a black hole: writes
    /// succeed, answers never come) until `heal()` or `cut()`.
    pub fn stall(&self) {
        self.shared.mode.send_replace(Mode::Stall);
    }

    /// Keeps forwarding what clients send but holds back every answer until `heal()` or
    /// `cut()`: requests reach the server and take effect, their answers never arrive (cut
    /// afterwards, the client cannot know whether they did).
    pub fn hold_answers(&self) {
        self.shared.mode.send_replace(Mode::HoldAnswers);
    }

    /// Cuts each connection, old and new, as soon as its client has sent more than `bytes`
    /// in all (a server that drops the connection on what the client sends), until `heal()`.
    pub fn cut_connections_sending_more_than(&self, bytes: usize) {
        self.shared.cut_beyond.store(bytes, Ordering::SeqCst);
    }

    /// The bytes the client has sent so far on the connection that sent last.
    pub fn upstream_bytes_of_last_connection(&self) -> usize {
        self.shared.last_upstream_bytes.load(Ordering::SeqCst)
    }

    /// Forwards again (new connections; a stalled connection resumes).
    pub fn heal(&self) {
        self.shared.cut_beyond.store(usize::MAX, Ordering::SeqCst);
        self.shared.mode.send_replace(Mode::Forward);
    }

    /// Connections accepted and forwarded so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.live.lock().unwrap().cancel();
    }
}

async fn forward(inbound: TcpStream, s: Arc<ProxyShared>) {
    let token = s.live.lock().unwrap().clone();
    if *s.mode.borrow() == Mode::Cut || token.is_cancelled() {
        return;
    }
    let outbound = tokio::select! {
        r = TcpStream::connect(&s.upstream) => match r {
            Ok(o) => o,
            Err(e) => {
                eprintln!("proxy: cannot reach {}: {e}", s.upstream);
                return;
            }
        },
        () = token.cancelled() => return,
    };
    let _ = inbound.set_nodelay(true);
    let _ = outbound.set_nodelay(true);
    let (ri, wi) = inbound.into_split();
    let (ro, wo) = outbound.into_split();
    s.last_upstream_bytes.store(0, Ordering::SeqCst);
    tokio::select! {
        () = pump(ri, wo, s.mode.subscribe(), Some(&s)) => {}
        () = pump(ro, wi, s.mode.subscribe(), None) => {}
        () = token.cancelled() => {}
    }
    // Dropping the halves closes both sockets.
}

/// Copies `from` to `to` while the mode lets bytes flow that way (`counted` on the way towards
/// the server: the client's bytes are counted, and the connection cut beyond
/// [`Proxy::cut_connections_sending_more_than`]).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    counted: Option<&ProxyShared>,
) {
    let upstream = counted.is_some();
    let mut sent = 0usize;
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if mode.wait_for(|m| m.flows(upstream)).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // A stall that began during the read holds these bytes back too.
        if mode.wait_for(|m| m.flows(upstream)).await.is_err() {
            return;
        }
        if let Some(shared) = counted {
            sent += n;
            shared.last_upstream_bytes.store(sent, Ordering::SeqCst);
            if sent > shared.cut_beyond.load(Ordering::SeqCst) {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
