//! The hot path: claiming (the expiry sweep, the claim by ordering mode, a suspect on its
//! own), settling (sent, failed, handed back), lease renewal and reclaim, and the ordering
//! watermark's observation — the statements the claim loop and the lease task run on every
//! round, their SQL text and their execution.
//!
//! Claiming is a state change (`pending` → `processing`) committed before anything is
//! published, so no row lock is ever held across a call to the broker. Settling only touches
//! rows still locked by this instance, so a row whose lease was reclaimed by another relay is
//! never overwritten.

use std::time::Duration;

use tokio_postgres::types::{FromSql, Type};
use uuid::Uuid;

use super::{OPEN_E, OPEN_H, Result, Store};
use crate::config::{Ordering, TableName};
use crate::message::OutboxMessage;

/// Raw bytes of a `jsonb`, `json`, `bytea` or `text` column: the payload as it goes on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawBytes(pub(crate) Vec<u8>);

impl<'a> FromSql<'a> for RawBytes {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            // jsonb's binary form is a version byte (1) followed by the JSON text.
            match raw.split_first() {
                Some((1, text)) => Ok(Self(text.to_vec())),
                _ => Err("unsupported jsonb binary version".into()),
            }
        } else {
            Ok(Self(raw.to_vec()))
        }
    }

    fn accepts(ty: &Type) -> bool {
        matches!(
            *ty,
            Type::JSONB | Type::JSON | Type::BYTEA | Type::TEXT | Type::VARCHAR
        )
    }
}

/// A row that passed its deadline before it could be published (see [`Store::claim_and_expire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    /// Row id.
    pub id: Uuid,
    /// Aggregate type (for logs).
    pub aggregate_type: String,
}

/// What a claim round does with pending rows past their `expires_at`. Claims never take such
/// rows; the sweep is what marks (or deletes) them and counts them, and with ordering
/// `aggregate` what stops them holding back the rest of their aggregate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpirySweep {
    /// No sweep this round (one ran moments ago).
    Skip,
    /// Mark them `expired`.
    Mark,
    /// Delete them (retention 0).
    Delete,
}

/// What one claim round did: rows to publish, and rows that expired instead.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Claim {
    /// Claimed rows (now `processing`), in `seq` order.
    pub rows: Vec<OutboxMessage>,
    /// Rows moved to `expired` (or deleted, retention 0) by the sweep before the claim.
    pub expired: Vec<Expired>,
    /// Some part of the claim filled its share of the batch: more rows are likely ready.
    pub more: bool,
    /// Some part filled its share while another came back short: the ready rows sit in fewer
    /// aggregates than there were parts, and splitting the next claim would not pay.
    pub uneven: bool,
    /// A part of a split claim failed while other parts claimed rows: the failed part may
    /// have committed before its answer was lost (see [`Store::release_unheld`]).
    pub answer_lost: bool,
}

/// A message-level failure to record: back off, or dead-letter when out of attempts.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Row id.
    pub id: Uuid,
    /// Why it failed (stored in `last_error`).
    pub error: String,
    /// Delay before the next attempt.
    pub delay: Duration,
}

/// What [`Store::fail`] did with the failures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailOutcome {
    /// Rows scheduled for another attempt.
    pub retried: u64,
    /// Rows moved to `failed`.
    pub dead_lettered: Vec<Uuid>,
}

/// One observation for the ordering watermark (see [`crate::watermark`]).
#[derive(Debug, Clone, PartialEq)]
pub struct WriterSnapshot {
    /// Transactions (xid as text) that hold a lock on the outbox table, other than relays.
    pub writers: Vec<String>,
    /// Age in seconds of the oldest of those transactions.
    pub oldest_writer_age: Option<f64>,
}

/// The fewest candidates an ordered claim looks at beyond its batch (see [`scan_window`]).
const SCAN_SLACK: i64 = 100;

/// `limit` rows in `parts` shares as even as can be (the first ones one larger).
fn split(limit: usize, parts: usize) -> Vec<usize> {
    (0..parts)
        .map(|k| limit / parts + usize::from(k < limit % parts))
        .collect()
}

/// Which part of a split ordered claim a row belongs to, as `<key> % parts`: its aggregate's
/// hash (so one aggregate always goes to one part), or its seq without an aggregate. `alias`
/// qualifies the columns (empty for none).
fn part_key(alias: &str) -> String {
    let a = if alias.is_empty() {
        String::new()
    } else {
        format!("{alias}.")
    };
    format!(
        "(CASE WHEN {a}aggregate_id IS NULL THEN {a}seq ELSE hashtext({a}aggregate_id) & 2147483647 END)"
    )
}

/// `last_error` prefix of rows reclaimed from a relay that died while holding them.
const SUSPECT: &str = "lease expired:";
const NOT_SUSPECT: &str = "(last_error IS NULL OR last_error NOT LIKE 'lease expired:%')";
const NOT_SUSPECT_C: &str = "(c.last_error IS NULL OR c.last_error NOT LIKE 'lease expired:%')";
const NOT_SUSPECT_H: &str = "(h.last_error IS NULL OR h.last_error NOT LIKE 'lease expired:%')";
/// Rows whose deadline has passed are never claimed, even in the moment before the expiry
/// sweep marks them (a heap filter on rows the claim reads anyway: free when no row expires).
const NOT_DUE: &str = "(expires_at IS NULL OR expires_at > now())";
const NOT_DUE_C: &str = "(c.expires_at IS NULL OR c.expires_at > now())";
const NOT_DUE_H: &str = "(h.expires_at IS NULL OR h.expires_at > now())";
// Claims update `WHERE t.id = ANY(ARRAY(SELECT id FROM <picked>))` rather than joining the
// picked ids: with a join the generic plan estimated the row count from LIMIT $1 and hashed the
// whole table (a sequential scan per claim, 46 ms at 100k rows); the array form always probes
// the primary key.
const RETURNING: &str = "t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, \
                         t.headers, t.destination, t.attempts, t.created_at, t.expires_at";

/// The relay's hot-path statements for `table`, as the relay sends them, for tools that replay
/// them outside the relay (the benchmark's pgbench ceiling): like `migrate --print` for the
/// DDL. Parameters stay `$n` placeholders, documented per statement.
#[cfg(any(test, feature = "bench"))]
#[derive(Debug, Clone)]
pub struct HotPathSql {
    /// The claim with `ordering = "none"`: `$1` batch size, `$2` instance id; returns the
    /// claimed rows.
    pub claim: String,
    /// The claim with `ordering = "aggregate"`: `$1` batch size, `$2` instance id, `$3` the
    /// watermark (highest `seq` claimable), `$4` the scan window ([`scan_window`]), `$5` the
    /// number of parts the claim is split into, `$6` this part (`0..$5`); returns the claimed
    /// rows.
    pub claim_aggregate: String,
    /// Marking confirmed rows sent: `$1` ids (`uuid[]`), `$2` instance id.
    pub mark_sent: String,
    /// The expression (on the table's unqualified columns) whose value modulo `$5` is the part
    /// of a split ordered claim a row belongs to.
    pub part_key: String,
}

/// How many candidates an ordered claim of `limit` rows looks at. Candidates beyond the batch
/// leave room for rows that turn out not claimable (behind a gap: a row another relay is
/// claiming right now). Each candidate costs a row lock and (but the first of its aggregate) a
/// gap probe, each aggregate a head probe, so the window is a quarter above the batch (at least
/// `SCAN_SLACK` above): 4× the batch, at least 1,000, made a 500-row claim over 1,000
/// aggregates take 34 ms where 625 candidates take 13–17.
pub fn scan_window(limit: i64) -> i64 {
    limit.saturating_add((limit / 4).max(SCAN_SLACK))
}

/// Renders [`HotPathSql`] for `table`.
#[cfg(any(test, feature = "bench"))]
pub fn hot_path_sql(table: &TableName) -> HotPathSql {
    let q = ClaimSql::new(table);
    HotPathSql {
        claim: q.claim_none,
        claim_aggregate: q.claim_aggregate,
        mark_sent: q.mark_sent,
        part_key: part_key(""),
    }
}

/// The hot path's SQL text, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct ClaimSql {
    pub(super) claim_none: String,
    pub(super) suspects_waiting: String,
    pub(super) claim_suspect: String,
    pub(super) claim_aggregate: String,
    pub(super) expire: String,
    pub(super) expire_delete: String,
    pub(super) mark_sent: String,
    pub(super) delete_sent: String,
    pub(super) fail: String,
    pub(super) release: String,
    pub(super) release_unheld: String,
    pub(super) heartbeat: String,
    pub(super) reclaim: String,
    pub(super) last_seq: String,
    pub(super) writers: String,
}

impl ClaimSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let seq = table.prefixed("_seq");
        let part_c = part_key("c");
        // A ready row reclaimed from a dead relay that is the head of its aggregate (or has
        // none) and at or below the watermark (`$W`).
        let suspect_where = format!(
            "c.status = 'pending' AND c.available_at <= now() AND c.last_error LIKE '{SUSPECT}%' \
             AND {NOT_DUE_C} \
             AND (c.aggregate_id IS NULL OR (c.seq <= $W AND NOT EXISTS ( \
               SELECT 1 FROM {t} e WHERE e.aggregate_type = c.aggregate_type \
                 AND e.aggregate_id = c.aggregate_id AND {OPEN_E} AND e.seq < c.seq)))"
        );
        let suspect = suspect_where.replace("$W", "$1");
        let suspect_2 = suspect_where.replace("$W", "$2");
        Self {
            // $1 batch size, $2 instance id.
            claim_none: format!(
                "WITH cand AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND available_at <= now() AND {NOT_SUSPECT} AND {NOT_DUE} \
                   ORDER BY seq LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $2, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
                 RETURNING {RETURNING}"
            ),
            // $1 watermark. The same rows claim_suspect would take.
            suspects_waiting: format!("SELECT EXISTS (SELECT 1 FROM {t} c WHERE {suspect})"),
            // One row that was held by a relay that died (a suspect of the crash), claimed on its
            // own so that a row which kills the relay spends only its own attempts, never those
            // of rows that happened to share its batch. $1 instance id, $2 watermark.
            claim_suspect: format!(
                "WITH cand AS ( \
                   SELECT c.id FROM {t} c WHERE {suspect_2} \
                   ORDER BY c.seq LIMIT 1 \
                   FOR UPDATE OF c SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $1, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
                 RETURNING {RETURNING}"
            ),
            // $1 batch size, $2 instance id, $3 watermark (highest seq that is final), $4 scan
            // window, $5 parts, $6 this part: of a claim split into parts run at once, this one
            // takes only the aggregates that hash to it (rows without one by seq), so no two
            // parts ever contend for one aggregate.
            //
            // Candidates skip aggregates whose head (first unsent row) is not ready (in flight
            // elsewhere, backing off, dead, a reclaimed row that goes out on its own, or past
            // its deadline until the sweep), so a long blocked aggregate cannot fill the scan
            // window and starve the others. Aggregates with a row in flight (`busy`, from the
            // small processing index, hashed) are skipped before that head probe: in a
            // steady drain most blocked rows are behind an in-flight head, and a hash lookup
            // costs a fraction of an index probe. `busy` is capped so that it stays hashable;
            // aggregates left out of it fall through to the head probe, which decides alone.
            // The head probe is a lateral join on the aggregate, which the planner memoizes:
            // the candidates of one aggregate share one probe, so one aggregate's backlog does
            // not make every candidate walk the index entries of its rows already sent (the gap
            // probe below is bounded on both sides for the same reason). The conditions on the
            // candidate alone (watermark, `busy`) stand apart from the one on the head, so the
            // planner filters the scan with them before the join (in one OR with the head's,
            // every row of an aggregate in flight would be joined first).
            // A candidate is claimable when every unsent row of its aggregate with a smaller seq
            // is itself a candidate locked by this statement (so the whole run goes to one
            // relay, published in seq order) — the first candidate of its aggregate when it is
            // the head, each later one when no open row lies between it and the previous one
            // (both bounds in the index) — then required along the whole chain.
            // Candidates that another relay holds are skipped (SKIP LOCKED), which leaves a gap
            // and so blocks everything after them: no two relays ever hold one aggregate.
            // The batch is filled run by run: aggregates in the order of their oldest
            // candidate, each with its claimable rows in seq order (a prefix of a run is still
            // a run). Filled row by row in seq order instead, a backlog spread round robin over
            // many aggregates gave each aggregate one row per claim → publish → settle round
            // trip, and the claims stalled on aggregates in flight (Kafka, 1,000 aggregates:
            // 18k → 22k msgs/s, median of 4 runs).
            claim_aggregate: format!(
                "WITH busy AS MATERIALIZED ( \
                   SELECT DISTINCT b.aggregate_type, b.aggregate_id FROM {t} b \
                   WHERE b.status = 'processing' AND b.aggregate_id IS NOT NULL \
                   LIMIT 10000), \
                 cand AS ( \
                   SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id, h.head_seq FROM {t} c \
                   LEFT JOIN LATERAL ( \
                     SELECT CASE WHEN h.status = 'pending' AND h.available_at <= now() \
                         AND {NOT_SUSPECT_H} AND {NOT_DUE_H} THEN h.seq END AS head_seq \
                     FROM {t} h \
                     WHERE h.aggregate_type = c.aggregate_type AND h.aggregate_id = c.aggregate_id \
                       AND {OPEN_H} ORDER BY h.seq LIMIT 1) h ON true \
                   WHERE c.status = 'pending' AND c.available_at <= now() AND {NOT_SUSPECT_C} \
                     AND {NOT_DUE_C} \
                     AND {part_c} % $5 = $6 \
                     AND (c.aggregate_id IS NULL OR (c.seq <= $3 \
                       AND (c.aggregate_type, c.aggregate_id) NOT IN (SELECT * FROM busy))) \
                     AND (c.aggregate_id IS NULL OR h.head_seq IS NOT NULL) \
                   ORDER BY c.seq LIMIT $4 \
                   FOR UPDATE OF c SKIP LOCKED), \
                 ranked AS ( \
                   SELECT c.*, lag(c.seq) OVER (PARTITION BY c.aggregate_type, c.aggregate_id ORDER BY c.seq) AS prev_seq \
                   FROM cand c), \
                 checked AS ( \
                   SELECT r.id, r.seq, r.aggregate_type, r.aggregate_id, \
                     CASE WHEN r.aggregate_id IS NULL THEN true \
                          WHEN r.prev_seq IS NULL THEN r.head_seq = r.seq \
                          ELSE NOT EXISTS ( \
                            SELECT 1 FROM {t} e \
                            WHERE e.aggregate_type = r.aggregate_type AND e.aggregate_id = r.aggregate_id \
                              AND {OPEN_E} AND e.seq > r.prev_seq AND e.seq < r.seq) END AS free \
                   FROM ranked r), \
                 chained AS ( \
                   SELECT id, seq, bool_and(free) OVER w AS ok, \
                     CASE WHEN aggregate_id IS NULL THEN seq ELSE min(seq) OVER w END AS head \
                   FROM checked \
                   WINDOW w AS (PARTITION BY aggregate_type, aggregate_id ORDER BY seq)), \
                 picked AS ( \
                   SELECT id FROM chained WHERE ok ORDER BY head, seq LIMIT $1) \
                 UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
                   locked_by = $2, locked_at = now() \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM picked)) \
                 RETURNING {RETURNING}"
            ),
            // Pending rows past their deadline become `expired` (or are deleted, retention 0),
            // oldest deadline first, through the small `<table>_expiry_idx`. Rows in flight
            // are not touched: a row claimed before its deadline is published. $1 batch size.
            expire: format!(
                "WITH due AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= now() \
                   ORDER BY expires_at LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 UPDATE {t} AS t SET status = 'expired', locked_by = NULL, locked_at = NULL, \
                   last_error = 'expired: its deadline ' \
                     || to_char(t.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') \
                     || ' passed before it was published (after ' || t.attempts || ' attempts)' \
                 WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
                 RETURNING t.id, t.aggregate_type"
            ),
            expire_delete: format!(
                "WITH due AS ( \
                   SELECT id FROM {t} \
                   WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= now() \
                   ORDER BY expires_at LIMIT $1 \
                   FOR UPDATE SKIP LOCKED) \
                 DELETE FROM {t} AS t WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
                 RETURNING t.id, t.aggregate_type"
            ),
            // $1 ids, $2 instance id.
            mark_sent: format!(
                "UPDATE {t} SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL, last_error = NULL \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            delete_sent: format!(
                "DELETE FROM {t} WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // $1 ids, $2 errors, $3 delays (ms), $4 instance id, $5 max attempts.
            fail: format!(
                "UPDATE {t} AS t SET \
                   status = CASE WHEN t.attempts >= $5 THEN 'failed' ELSE 'pending' END, \
                   available_at = CASE WHEN t.attempts >= $5 THEN t.available_at \
                                  ELSE now() + f.delay_ms * interval '1 millisecond' END, \
                   last_error = f.error, locked_by = NULL, locked_at = NULL \
                 FROM unnest($1::uuid[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms) \
                 WHERE t.id = f.id AND t.status = 'processing' AND t.locked_by = $4 \
                 RETURNING t.id, t.status"
            ),
            // Hand back without spending the attempt the claim counted. $1 ids, $2 instance id.
            release: format!(
                "UPDATE {t} SET status = 'pending', attempts = greatest(attempts - 1, 0), \
                   locked_by = NULL, locked_at = NULL \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // Rows claimed in this relay's name that it does not hold: a claim committed whose
            // answer the connection lost, so they were never published. Handed back unspent.
            // $1 the ids the relay holds, $2 instance id.
            release_unheld: format!(
                "UPDATE {t} SET status = 'pending', attempts = greatest(attempts - 1, 0), \
                   locked_by = NULL, locked_at = NULL \
                 WHERE status = 'processing' AND locked_by = $2 AND NOT (id = ANY($1))"
            ),
            // Keeps this relay's leases alive while it waits for a slow broker, so only a relay
            // that stopped ever has its rows reclaimed. Only the ids the relay tracks: a row
            // claimed in its name whose answer was lost is released ([`Store::release_unheld`])
            // or, if this relay stops first, expires. $1 ids, $2 instance id.
            heartbeat: format!(
                "UPDATE {t} SET locked_at = now() \
                 WHERE id = ANY($1) AND status = 'processing' AND locked_by = $2"
            ),
            // Rows whose lease expired: the claim already spent their attempt. $1 lease (ms), $2 max attempts.
            reclaim: format!(
                "UPDATE {t} SET \
                   status = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, \
                   last_error = '{SUSPECT} relay ' || coalesce(locked_by, '?') || ' stopped while holding the row', \
                   available_at = now(), locked_by = NULL, locked_at = NULL \
                 WHERE status = 'processing' AND locked_at < now() - $1::bigint * interval '1 millisecond' \
                 RETURNING id, status"
            ),
            last_seq: format!("SELECT last_value, is_called FROM {seq}"),
            // $1 the table's oid. Transactions that hold a lock on the table and may still commit
            // rows; the relay's own sessions (application_name outbox-relay…) never insert.
            writers:
                "SELECT a.backend_xid::text, extract(epoch FROM now() - a.xact_start)::float8 \
                      FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
                      WHERE l.locktype = 'relation' AND l.relation = $1 AND l.granted \
                        AND a.backend_xid IS NOT NULL AND a.pid <> pg_backend_pid() \
                        AND a.application_name NOT LIKE 'outbox-relay%'"
                    .to_owned(),
        }
    }
}

impl Store {
    /// Expires the pending rows whose deadline has passed (marked `expired`, never published),
    /// then claims up to `limit` ready rows as [`Store::claim_and_expire`] does with expired
    /// rows kept; returns the claimed rows only.
    pub async fn claim(
        &self,
        ordering: Ordering,
        limit: usize,
        watermark: i64,
    ) -> Result<Vec<OutboxMessage>> {
        Ok(self
            .claim_and_expire(ordering, limit, watermark, ExpirySweep::Mark, 1)
            .await?
            .rows)
    }

    /// Expires pending rows past their deadline (up to `limit`, as `sweep` says), then claims
    /// up to `limit` ready rows. With
    /// [`Ordering::Aggregate`], only rows at or below `watermark` (for rows with an aggregate
    /// id) whose earlier open rows all come along.
    ///
    /// The sweep and the (first part of the) claim are pipelined on one connection and run in
    /// the order sent, so that claim already sees the rows just expired as no longer holding
    /// back their aggregates; with no deadline in the table the sweep is one probe of an empty
    /// partial index, in the claim's round trip.
    ///
    /// With `parts` above 1 the claim is split into up to that many statements run at once,
    /// each on its own connection (as many as the pool has free right now) and for its share
    /// of `limit`: one claim statement keeps one server process busy, and a backlog drains
    /// faster when the server's other cores help. With ordering `none` the parts simply skip
    /// each other's locked rows; with `aggregate` each takes the aggregates that hash to it.
    /// The rows come back in `seq` order either way.
    pub async fn claim_and_expire(
        &self,
        ordering: Ordering,
        limit: usize,
        watermark: i64,
        sweep: ExpirySweep,
        parts: usize,
    ) -> Result<Claim> {
        let client = self.client().await?;
        // The other parts only on connections free right now, taken before any part starts:
        // a claim never waits for a connection (with outboxes sharing a small pool, waiting
        // ones could hold each other up) while rows it already claimed wait unpublished.
        let mut extra = Vec::new();
        while extra.len() + 1 < parts.clamp(1, limit.max(1)) {
            match self.client_if_free().await {
                Some(c) => extra.push(c),
                None => break,
            }
        }
        let shares = split(limit, 1 + extra.len());
        let sweep_limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let expire = match sweep {
            ExpirySweep::Skip => None,
            ExpirySweep::Mark => Some(client.prepare_cached(&self.q.claim.expire).await?),
            ExpirySweep::Delete => Some(client.prepare_cached(&self.q.claim.expire_delete).await?),
        };
        let expire_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&sweep_limit];
        let expire = async {
            match &expire {
                Some(stmt) => client.query(stmt, &expire_params).await,
                None => Ok(Vec::new()),
            }
        };
        let shares = &shares;
        let first = self.claim_part(&client, ordering, watermark, (0, shares));
        // Every part runs to its end, even when another fails: a part's rows are claimed once
        // its statement commits, and an answer dropped on the way would leave them to the lease.
        let others = futures::future::join_all(
            extra
                .iter()
                .enumerate()
                .map(|(k, client)| self.claim_part(client, ordering, watermark, (k + 1, shares))),
        );
        let (expired, first, others) = tokio::join!(expire, first, others);
        let (mut more, mut short) = (false, false);
        let mut rows = Vec::with_capacity(limit);
        let mut failed = None;
        for (got, share) in std::iter::once(first).chain(others).zip(shares) {
            let got = got.and_then(|got| {
                let n = got.len();
                let messages = got.iter().map(message_of).collect::<Result<Vec<_>, _>>();
                Ok((n, messages?))
            });
            match got {
                Ok((n, messages)) => {
                    more |= n >= *share;
                    short |= n < *share;
                    rows.extend(messages);
                }
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        // A part (or the sweep) that failed while another part claimed rows is a warning:
        // those rows are this relay's now and go out; the next round retries the rest.
        let answer_lost = match failed {
            Some(e) if rows.is_empty() => return Err(e),
            Some(e) => {
                tracing::warn!(error = %e, claimed = rows.len(), "part of a split claim failed; publishing what the other parts claimed");
                true
            }
            None => false,
        };
        let expired = expired.and_then(|expired| {
            expired
                .iter()
                .map(|r| {
                    Ok(Expired {
                        id: r.try_get(0)?,
                        aggregate_type: r.try_get(1)?,
                    })
                })
                .collect::<Result<Vec<_>, tokio_postgres::Error>>()
        });
        let expired = match expired {
            Ok(expired) => expired,
            Err(e) if rows.is_empty() => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "the expiry sweep failed; publishing the rows claimed beside it");
                Vec::new()
            }
        };
        rows.sort_unstable_by_key(|m| m.seq);
        Ok(Claim {
            rows,
            expired,
            more,
            uneven: more && short,
            answer_lost,
        })
    }

    /// A pooled connection if one is free now (idle, or a slot to open one), without waiting.
    async fn client_if_free(&self) -> Option<deadpool_postgres::Object> {
        let mut timeouts = self.pool.timeouts();
        timeouts.wait = Some(Duration::ZERO);
        self.pool.timeout_get(&timeouts).await.ok()
    }

    /// One part of a claim (see [`Store::claim_and_expire`]): `part` of `shares.len()`, for
    /// `shares[part]` rows, on `client`.
    async fn claim_part(
        &self,
        client: &deadpool_postgres::Object,
        ordering: Ordering,
        watermark: i64,
        (part, shares): (usize, &[usize]),
    ) -> Result<Vec<tokio_postgres::Row>> {
        let limit = i64::try_from(shares[part]).unwrap_or(i64::MAX);
        let rows = match ordering {
            Ordering::None => {
                let stmt = client.prepare_cached(&self.q.claim.claim_none).await?;
                client.query(&stmt, &[&limit, &self.instance_id]).await?
            }
            Ordering::Aggregate => {
                let stmt = client.prepare_cached(&self.q.claim.claim_aggregate).await?;
                let scan = scan_window(limit);
                let parts = i64::try_from(shares.len()).unwrap_or(1);
                let this = i64::try_from(part).unwrap_or(0);
                client
                    .query(
                        &stmt,
                        &[&limit, &self.instance_id, &watermark, &scan, &parts, &this],
                    )
                    .await?
            }
        };
        Ok(rows)
    }

    /// Whether a row reclaimed from a dead relay is ready to be claimed (see `SUSPECT`).
    pub async fn suspects_waiting(&self, watermark: i64) -> Result<bool> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&self.q.claim.suspects_waiting)
            .await?;
        Ok(client.query_one(&stmt, &[&watermark]).await?.try_get(0)?)
    }

    /// Claims one row that a dead relay held (see `SUSPECT`), if any is ready; it is then
    /// published in a batch of its own.
    pub async fn claim_suspect(&self, watermark: i64) -> Result<Option<OutboxMessage>> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.claim_suspect).await?;
        let row = client
            .query_opt(&stmt, &[&self.instance_id, &watermark])
            .await?;
        Ok(row.as_ref().map(message_of).transpose()?)
    }

    /// Marks confirmed rows `sent`, or deletes them when `delete` (retention 0).
    pub async fn mark_sent(&self, ids: &[Uuid], delete: bool) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let sql = if delete {
            &self.q.claim.delete_sent
        } else {
            &self.q.claim.mark_sent
        };
        let stmt = client.prepare_cached(sql).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Records message-level failures: back to `pending` after `delay`, or `failed` once the
    /// row has used `max_attempts`.
    pub async fn fail(&self, failures: &[Failure], max_attempts: u32) -> Result<FailOutcome> {
        if failures.is_empty() {
            return Ok(FailOutcome::default());
        }
        let ids: Vec<Uuid> = failures.iter().map(|f| f.id).collect();
        let errors: Vec<&str> = failures.iter().map(|f| f.error.as_str()).collect();
        let delays: Vec<i64> = failures
            .iter()
            .map(|f| i64::try_from(f.delay.as_millis()).unwrap_or(i64::MAX))
            .collect();
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.fail).await?;
        let rows = client
            .query(&stmt, &[&ids, &errors, &delays, &self.instance_id, &max])
            .await?;
        let mut out = FailOutcome::default();
        for r in rows {
            let status: &str = r.try_get(1)?;
            if status == "failed" {
                out.dead_lettered.push(r.try_get(0)?);
            } else {
                out.retried += 1;
            }
        }
        Ok(out)
    }

    /// Hands rows back to `pending` without spending an attempt (connection-level failure,
    /// shutdown, or rows never published because an earlier row of their aggregate failed).
    pub async fn release(&self, ids: &[Uuid]) -> Result<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.release).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Hands back, unspent, the `processing` rows locked in this instance's name that are not
    /// in `held`: rows of a claim that committed while its answer was lost with the
    /// connection, which this relay therefore never published. Without this they would wait
    /// out `relay.lease_timeout`, holding back the rest of their aggregates. Call only while
    /// no claim is running, with every id a batch still holds in `held`.
    pub async fn release_unheld(&self, held: &[Uuid]) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.release_unheld).await?;
        Ok(client.execute(&stmt, &[&held, &self.instance_id]).await?)
    }

    /// Renews the leases of `ids` where this instance still holds them; returns how many.
    pub async fn heartbeat(&self, ids: &[Uuid]) -> Result<u64> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.heartbeat).await?;
        Ok(client.execute(&stmt, &[&ids, &self.instance_id]).await?)
    }

    /// Returns `processing` rows whose lease expired to `pending` (or `failed` when out of
    /// attempts). Returns (reclaimed, dead-lettered).
    pub async fn reclaim_expired(&self, lease: Duration, max_attempts: u32) -> Result<(u64, u64)> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(&self.q.claim.reclaim).await?;
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let max = i32::try_from(max_attempts).unwrap_or(i32::MAX);
        let rows = client.query(&stmt, &[&lease_ms, &max]).await?;
        let failed = rows
            .iter()
            .filter(|r| r.get::<_, &str>(1) == "failed")
            .count() as u64;
        Ok((rows.len() as u64 - failed, failed))
    }

    /// One observation for the ordering guard: the highest `seq` drawn so far (committed or
    /// not), then the transactions that hold a lock on the outbox table and might still commit
    /// rows. The two statements are pipelined on one connection, which the server runs in the
    /// order sent: the sequence is read strictly before the locks (see [`crate::watermark`]).
    pub async fn observe(&self, table_oid: u32) -> Result<(i64, WriterSnapshot)> {
        let client = self.client().await?;
        let seq_stmt = client.prepare_cached(&self.q.claim.last_seq).await?;
        let writers_stmt = client.prepare_cached(&self.q.claim.writers).await?;
        let oid_param: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&table_oid];
        let (seq_row, rows) = tokio::join!(
            client.query_one(&seq_stmt, &[]),
            client.query(&writers_stmt, &oid_param)
        );
        let seq_row = seq_row?;
        let last: i64 = seq_row.try_get(0)?;
        let called: bool = seq_row.try_get(1)?;
        let last = if called { last } else { last - 1 };
        let rows = rows?;
        let mut writers = Vec::with_capacity(rows.len());
        let mut oldest: Option<f64> = None;
        for r in rows {
            writers.push(r.try_get::<_, String>(0)?);
            let age: Option<f64> = r.try_get(1)?;
            if let Some(age) = age {
                oldest = Some(oldest.map_or(age, |o| o.max(age)));
            }
        }
        writers.sort_unstable();
        writers.dedup();
        Ok((
            last,
            WriterSnapshot {
                writers,
                oldest_writer_age: oldest,
            },
        ))
    }
}

fn message_of(r: &tokio_postgres::Row) -> Result<OutboxMessage, tokio_postgres::Error> {
    Ok(OutboxMessage {
        id: r.try_get(0)?,
        seq: r.try_get(1)?,
        aggregate_type: r.try_get(2)?,
        aggregate_id: r.try_get(3)?,
        event_type: r.try_get(4)?,
        payload: r.try_get::<_, RawBytes>(5)?.0,
        headers: r.try_get::<_, RawBytes>(6)?.0,
        destination: r.try_get(7)?,
        attempts: r.try_get(8)?,
        created_at: r.try_get(9)?,
        expires_at: r.try_get(10)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_claim_shares_its_batch_evenly() {
        for (limit, parts, want) in [
            (500, 1, vec![500]),
            (500, 2, vec![250, 250]),
            (501, 2, vec![251, 250]),
            (7, 3, vec![3, 2, 2]),
        ] {
            assert_eq!(split(limit, parts), want, "{limit} rows in {parts} parts");
        }
    }

    #[test]
    fn hot_path_sql_is_the_relays_own_for_the_table() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let sql = hot_path_sql(&table);
        let q = ClaimSql::new(&table);
        assert_eq!(sql.claim, q.claim_none);
        assert_eq!(sql.mark_sent, q.mark_sent);
        assert!(sql.claim.contains("app.events") && sql.claim.contains("FOR UPDATE SKIP LOCKED"));
        assert!(sql.mark_sent.contains("id = ANY($1)"));
        assert_eq!(sql.claim_aggregate, q.claim_aggregate);
        // The claim splits by the same key the tools are given.
        let split_by = format!("{} % $5 = $6", part_key("c"));
        assert!(q.claim_aggregate.contains(&split_by));
        assert_eq!(sql.part_key, part_key(""));
        assert!(!sql.part_key.contains("c."));
    }

    #[test]
    fn statements_name_the_schema_qualified_table() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let q = ClaimSql::new(&table);
        assert_eq!(
            q.last_seq,
            "SELECT last_value, is_called FROM app.events_seq"
        );
        for (name, sql) in [
            ("claim_none", &q.claim_none),
            ("claim_aggregate", &q.claim_aggregate),
            ("claim_suspect", &q.claim_suspect),
            ("expire", &q.expire),
            ("mark_sent", &q.mark_sent),
            ("fail", &q.fail),
            ("release", &q.release),
            ("release_unheld", &q.release_unheld),
            ("reclaim", &q.reclaim),
        ] {
            assert!(sql.contains("app.events "), "{name}: {sql}");
            assert!(!sql.contains("outbox_messages"), "{name}: {sql}");
        }
    }

    #[test]
    fn claims_skip_locked_rows_and_settles_touch_only_our_own() {
        let q = ClaimSql::new(&TableName::parse("outbox").unwrap_or_else(|e| panic!("{e}")));
        for sql in [
            &q.claim_none,
            &q.claim_aggregate,
            &q.claim_suspect,
            &q.expire,
        ] {
            assert!(sql.contains("SKIP LOCKED"), "{sql}");
        }
        for sql in [
            &q.mark_sent,
            &q.delete_sent,
            &q.release,
            &q.release_unheld,
            &q.heartbeat,
        ] {
            assert!(
                sql.contains("status = 'processing' AND locked_by = $2"),
                "{sql}"
            );
        }
        assert!(q.fail.contains("t.locked_by = $4"), "{}", q.fail);
        // Suspects are claimed alone, and never by the ordinary claims.
        assert!(
            q.claim_suspect.contains("LIMIT 1")
                && q.claim_suspect.contains("LIKE 'lease expired:%'")
        );
        assert!(q.claim_none.contains("NOT LIKE 'lease expired:%'"));
        assert!(q.claim_aggregate.contains("NOT LIKE 'lease expired:%'"));
        assert!(
            q.reclaim.contains("'lease expired: relay '"),
            "{}",
            q.reclaim
        );
    }
}
