//! The wake-up listener: a dedicated connection LISTENs on the table's channel and wakes the
//! claim loop on every NOTIFY (the insert trigger sends one while a relay waits, see
//! [`crate::wakeup`]). The loop also polls, so a lost session only costs latency. An idle
//! session sends nothing, so it checks every `database.query_timeout` that the database still
//! answers (a peer that stops answering would otherwise leave it listening to nothing). When
//! the server refuses the relay's writes as read-only ([`crate::store::StaleSessions`]) the
//! session starts over too, so that it follows the pool to the server that takes writes
//! (NOTIFYs are sent there).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, sleep_or_cancel};
use crate::store::{self, StaleSessions, StoreError};
use crate::wakeup::ListenerPid;

/// LISTENs on `channel` and wakes the loop on every NOTIFY; after a lost connection (or one
/// that did not answer within `timeout`) it reconnects, re-LISTENs and wakes the loop once so
/// that nothing inserted meanwhile waits for the poll. `listener` holds the session's backend
/// pid while it listens (0 otherwise): the relay's waiting record names it. A session made
/// before `stale` is marked again ends.
pub async fn listen_loop(
    url: String,
    channel: String,
    timeout: Duration,
    wake: Arc<Notify>,
    listener: ListenerPid,
    stale: StaleSessions,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::session();
    while !shutdown.is_cancelled() {
        // Only a mark made after this session starts ends it.
        let mut marked = stale.subscribe();
        let session = async {
            let pg = store::pg_config(&url)?;
            let session = Session {
                channel: &channel,
                timeout,
                wake: &wake,
                listener: &listener,
                shutdown: &shutdown,
            };
            if store::tls_required(&pg) {
                session.run(&pg, store::make_tls()?, &mut marked).await
            } else {
                session.run(&pg, tokio_postgres::NoTls, &mut marked).await
            }
        }
        .await;
        listener.store(0, Ordering::Release);
        let delay = backoff.next_delay();
        match session {
            Ok(None) => return,
            Ok(Some(err)) => {
                tracing::warn!(error = ?err, retry_in = ?delay, "LISTEN connection lost; polling until it is back");
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot LISTEN for notifications; polling meanwhile");
            }
        }
        sleep_or_cancel(delay, &shutdown).await;
    }
}

/// One LISTEN connection's settings.
struct Session<'a> {
    channel: &'a str,
    /// How long connecting, LISTEN and each liveness check may take, and how often the check
    /// runs.
    timeout: Duration,
    wake: &'a Arc<Notify>,
    listener: &'a ListenerPid,
    shutdown: &'a CancellationToken,
}

impl Session<'_> {
    /// One LISTEN connection: `Ok(None)` on shutdown, `Ok(Some(reason))` when it was lost or
    /// stopped answering.
    async fn run<T>(
        &self,
        pg: &tokio_postgres::Config,
        tls: T,
        marked: &mut tokio::sync::watch::Receiver<Option<std::time::Instant>>,
    ) -> Result<Option<String>, StoreError>
    where
        T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
        T::Stream: Send + 'static,
    {
        let timeout = self.timeout;
        let bounded = StoreError::Timeout;
        let connected = tokio::time::timeout(timeout, pg.connect(tls)).await;
        let (client, conn) = connected.map_err(|_| bounded(timeout))??;
        let mut closed = forward_notifications(conn, Arc::clone(self.wake));
        let listening = async {
            client
                .batch_execute(&store::listen_sql(self.channel))
                .await?;
            let pid: i32 = client
                .query_one(store::BACKEND_PID_SQL, &[])
                .await?
                .try_get(0)?;
            Ok::<i32, StoreError>(pid)
        };
        let pid = tokio::time::timeout(timeout, listening)
            .await
            .map_err(|_| bounded(timeout))??;
        self.listener.store(pid, Ordering::Release);
        tracing::debug!(channel = %self.channel, pid, "listening for NOTIFY");
        self.wake.notify_one();
        let ended = self.watch(&client, &mut closed, marked).await;
        drop(client);
        Ok(ended)
    }

    /// Until the LISTEN connection is lost (`Some(reason)`), stops answering within the
    /// timeout, or is given up after a read-only refusal; `None` on shutdown.
    async fn watch(
        &self,
        client: &tokio_postgres::Client,
        closed: &mut tokio::sync::oneshot::Receiver<String>,
        marked: &mut tokio::sync::watch::Receiver<Option<std::time::Instant>>,
    ) -> Option<String> {
        let timeout = self.timeout;
        let bounded = StoreError::Timeout;
        loop {
            // After `timeout` of listening, whether the database still answers: `None` if so.
            let check = async {
                tokio::time::sleep(timeout).await;
                let ping = tokio::time::timeout(timeout, client.simple_query("SELECT 1"));
                match ping.await {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(bounded(timeout).to_string()),
                }
            };
            tokio::select! {
                r = &mut *closed => {
                    break Some(r.unwrap_or_else(|_| "connection task ended".to_owned()));
                }
                () = self.shutdown.cancelled() => break None,
                Ok(()) = marked.changed() => {
                    break Some("the server refused a write as read-only; reconnecting".to_owned());
                }
                lost = check => {
                    if lost.is_some() {
                        break lost;
                    }
                }
            }
        }
    }
}

/// Drives the LISTEN connection `conn` on a task of its own, waking the loop on each
/// notification; the receiver gets why the connection ended.
fn forward_notifications<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    wake: Arc<Notify>,
) -> tokio::sync::oneshot::Receiver<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use futures::StreamExt;
    use tokio_postgres::AsyncMessage;

    let (tx, closed) = tokio::sync::oneshot::channel::<String>();
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        let mut reason = "connection closed".to_owned();
        while let Some(msg) = messages.next().await {
            match msg {
                Ok(AsyncMessage::Notification(_)) => wake.notify_one(),
                Ok(_) => {}
                Err(e) => {
                    reason = e.to_string();
                    break;
                }
            }
        }
        let _ = tx.send(reason);
    });
    closed
}
