//! The wake-up listener: a dedicated connection LISTENs on the table's channel and wakes the
//! claim loop on every NOTIFY (the insert trigger sends one while a relay waits, see
//! [`crate::wakeup`]). The loop also polls, so a lost session only costs latency. When the
//! server refuses the relay's writes as read-only ([`crate::store::StaleSessions`]) the session
//! starts over too, so that it follows the pool to the server that takes writes (NOTIFYs are
//! sent there).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, sleep_or_cancel};
use crate::store::{self, StaleSessions, StoreError};
use crate::wakeup::ListenerPid;

/// LISTENs on `channel` and wakes the loop on every NOTIFY; after a lost connection it
/// reconnects, re-LISTENs and wakes the loop once so that nothing inserted meanwhile waits for
/// the poll. `listener` holds the session's backend pid while it listens (0 otherwise): the
/// relay's waiting record names it. A session made before `stale` is marked again ends.
pub async fn listen_loop(
    url: String,
    channel: String,
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
            let ends = Ends {
                marked: &mut marked,
                shutdown: &shutdown,
            };
            if store::tls_required(&pg) {
                let tls = store::make_tls()?;
                listen_session(&pg, tls, &channel, &wake, &listener, ends).await
            } else {
                let tls = tokio_postgres::NoTls;
                listen_session(&pg, tls, &channel, &wake, &listener, ends).await
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

/// What ends a LISTEN session besides its connection: the shutdown, or the relay's sessions
/// marked stale (the server refused a write as read-only).
struct Ends<'a> {
    marked: &'a mut tokio::sync::watch::Receiver<Option<std::time::Instant>>,
    shutdown: &'a CancellationToken,
}

/// One LISTEN connection: `Ok(None)` on shutdown, `Ok(Some(reason))` when it was lost or
/// given up.
async fn listen_session<T>(
    pg: &tokio_postgres::Config,
    tls: T,
    channel: &str,
    wake: &Arc<Notify>,
    listener: &ListenerPid,
    ends: Ends<'_>,
) -> Result<Option<String>, StoreError>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    use futures::StreamExt;
    use tokio_postgres::AsyncMessage;

    let (client, mut conn) = pg.connect(tls).await?;
    let (tx, mut closed) = tokio::sync::oneshot::channel::<String>();
    let wake_on_notify = Arc::clone(wake);
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        let mut reason = "connection closed".to_owned();
        while let Some(msg) = messages.next().await {
            match msg {
                Ok(AsyncMessage::Notification(_)) => wake_on_notify.notify_one(),
                Ok(_) => {}
                Err(e) => {
                    reason = e.to_string();
                    break;
                }
            }
        }
        let _ = tx.send(reason);
    });
    client.batch_execute(&store::listen_sql(channel)).await?;
    let pid: i32 = client
        .query_one(store::BACKEND_PID_SQL, &[])
        .await?
        .try_get(0)?;
    listener.store(pid, Ordering::Release);
    tracing::debug!(%channel, pid, "listening for NOTIFY");
    wake.notify_one();
    let ended = tokio::select! {
        r = &mut closed => Some(r.unwrap_or_else(|_| "connection task ended".to_owned())),
        Ok(()) = ends.marked.changed() => Some("the server refused a write as read-only; reconnecting".to_owned()),
        () = ends.shutdown.cancelled() => None,
    };
    drop(client);
    Ok(ended)
}
