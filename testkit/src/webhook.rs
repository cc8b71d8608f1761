//! A webhook endpoint the test scripts (axum on 127.0.0.1:0, plain or TLS with a throwaway
//! CA): every request is recorded, and the test's script picks each answer — a status with
//! headers and body, after a delay, never, or a connection cut in the middle of the answer.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::Response;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One request as the endpoint received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// `POST`, `HEAD`, …
    pub method: String,
    /// Path and query, as sent.
    pub path: String,
    /// Every header, names lower-cased, in the order received.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
    /// The status the script answered (`None`: no answer, or a cut connection).
    pub status: Option<u16>,
    /// When it arrived.
    pub at: Instant,
}

impl Received {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of header `name`.
    pub fn header_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The message id: `ce-id` (binary mode) or the body's `id` (structured mode).
    pub fn id(&self) -> Option<String> {
        self.header("ce-id").map(str::to_owned).or_else(|| {
            serde_json::from_slice::<serde_json::Value>(&self.body)
                .ok()?
                .get("id")?
                .as_str()
                .map(str::to_owned)
        })
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How the endpoint answers one request.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A complete answer.
    Answer {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body text.
        body: String,
    },
    /// The inner reply after a delay.
    After(Duration, Box<Reply>),
    /// No answer at all (the request waits an hour).
    Hang,
    /// Status 200 and the first bytes of a body, then the connection is cut.
    CutMidBody,
}

impl Reply {
    /// `status` with no body.
    pub fn status(status: u16) -> Self {
        Self::Answer {
            status,
            headers: Vec::new(),
            body: String::new(),
        }
    }

    /// Adds a header (to an [`Reply::Answer`]).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        if let Self::Answer { headers, .. } = &mut self {
            headers.push((name.to_owned(), value.to_owned()));
        }
        self
    }

    /// Sets the body (of an [`Reply::Answer`]).
    pub fn body(mut self, text: &str) -> Self {
        if let Self::Answer { body, .. } = &mut self {
            text.clone_into(body);
        }
        self
    }

    /// This reply after `delay`.
    pub fn after(self, delay: Duration) -> Self {
        Self::After(delay, Box::new(self))
    }

    fn status_code(&self) -> Option<u16> {
        match self {
            Self::Answer { status, .. } => Some(*status),
            Self::After(_, inner) => inner.status_code(),
            Self::Hang | Self::CutMidBody => None,
        }
    }
}

type Script = Arc<dyn Fn(&Received) -> Reply + Send + Sync>;

#[derive(Clone)]
struct Shared {
    script: Arc<RwLock<Script>>,
    received: Arc<Mutex<Vec<Received>>>,
}

/// The scripted endpoint; stops when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    scheme: &'static str,
    shared: Shared,
    handshakes_failed: Arc<AtomicUsize>,
    server: JoinHandle<()>,
}

impl Endpoint {
    /// A plain HTTP endpoint answering with `script`.
    pub async fn start(script: impl Fn(&Received) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the webhook endpoint");
        Self::serve_on(listener, script)
    }

    /// A plain HTTP endpoint on `127.0.0.1:port` (a port picked earlier, e.g. one the relay
    /// was refused on).
    pub async fn start_on(
        port: u16,
        script: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("bind the webhook endpoint on port {port}: {e}"));
        Self::serve_on(listener, script)
    }

    fn serve_on(
        listener: TcpListener,
        script: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let addr = listener.local_addr().expect("endpoint address");
        let shared = Shared::new(script);
        let app = shared.router();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            addr,
            scheme: "http",
            shared,
            handshakes_failed: Arc::new(AtomicUsize::new(0)),
            server,
        }
    }

    /// An HTTPS endpoint whose certificate (for `127.0.0.1` and `localhost`) is signed by a
    /// fresh CA; the CA's PEM is written to `dir` and returned (for `SSL_CERT_FILE`).
    pub async fn start_tls(
        dir: &Path,
        script: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    ) -> (Self, PathBuf) {
        let (config, path) =
            crate::kafka::loopback_tls(dir, "outbox-relay webhook test CA", "webhook-ca.pem");
        let tcp = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the webhook endpoint");
        let addr = tcp.local_addr().expect("endpoint address");
        let handshakes_failed = Arc::new(AtomicUsize::new(0));
        let listener = TlsListener {
            tcp,
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            failed: Arc::clone(&handshakes_failed),
        };
        let shared = Shared::new(script);
        let app = shared.router();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let endpoint = Self {
            addr,
            scheme: "https",
            shared,
            handshakes_failed,
            server,
        };
        (endpoint, path)
    }

    /// `http(s)://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}://{}{path}", self.scheme, self.addr)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Replaces the script for the requests to come.
    pub fn script(&self, script: impl Fn(&Received) -> Reply + Send + Sync + 'static) {
        if let Ok(mut s) = self.shared.script.write() {
            *s = Arc::new(script);
        }
    }

    /// Every request so far, in arrival order (probes included).
    pub fn received(&self) -> Vec<Received> {
        self.shared
            .received
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// The requests that carried a message (not `HEAD` probes), in arrival order.
    pub fn messages(&self) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.method != "HEAD")
            .collect()
    }

    /// How many requests carried a message so far.
    pub fn message_count(&self) -> usize {
        self.shared
            .received
            .lock()
            .map(|r| r.iter().filter(|r| r.method != "HEAD").count())
            .unwrap_or(0)
    }

    /// TLS handshakes that failed (a client that did not trust the certificate).
    pub fn handshakes_failed(&self) -> usize {
        self.handshakes_failed.load(Ordering::SeqCst)
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Shared {
    fn new(script: impl Fn(&Received) -> Reply + Send + Sync + 'static) -> Self {
        Self {
            script: Arc::new(RwLock::new(Arc::new(script))),
            received: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn router(&self) -> Router {
        Router::new().fallback(handle).with_state(self.clone())
    }
}

async fn handle(
    State(shared): State<Shared>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut received = Received {
        method: method.to_string(),
        path: uri
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .unwrap_or_default(),
        headers: headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: body.to_vec(),
        status: None,
        at: Instant::now(),
    };
    let script = shared.script.read().map(|s| Arc::clone(&s)).ok();
    let reply = script.map_or(Reply::status(200), |s| s(&received));
    received.status = reply.status_code();
    if let Ok(mut all) = shared.received.lock() {
        all.push(received);
    }
    respond(reply).await
}

async fn respond(mut reply: Reply) -> Response {
    loop {
        match reply {
            Reply::After(delay, inner) => {
                tokio::time::sleep(delay).await;
                reply = *inner;
            }
            Reply::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
            Reply::CutMidBody => {
                let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
                    Ok(Bytes::from_static(b"{\"partial\":")),
                    Err(std::io::Error::other("the test cuts the connection")),
                ];
                return Response::builder()
                    .status(200)
                    .body(Body::from_stream(futures::stream::iter(chunks)))
                    .unwrap_or_default();
            }
            Reply::Answer {
                status,
                headers,
                body,
            } => {
                let mut builder = Response::builder().status(status);
                for (n, v) in headers {
                    builder = builder.header(n, v);
                }
                return builder.body(Body::from(body)).unwrap_or_default();
            }
        }
    }
}

/// TLS in front of axum: the handshake happens in `accept`; a failed one is counted and the
/// next connection accepted.
struct TlsListener {
    tcp: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    failed: Arc<AtomicUsize>,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            match tokio::time::timeout(Duration::from_secs(10), self.acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => return (tls, addr),
                _ => {
                    self.failed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}
