//! Claiming: the claim by ordering mode, a suspect on its own, and the expiry sweep run with
//! them — their SQL text and their execution. One function per statement, its invariant in
//! its doc.
//!
//! Claiming is a state change (`pending` → `processing`, one attempt counted) committed
//! before anything is published, so no row lock is ever held across a call to the broker.
//! What happens to the rows afterwards is [`super::settle`]'s.

use std::time::Duration;

use tokio_postgres::types::{FromSql, Type};
use uuid::Uuid;

use super::predicates::{
    SUSPECT, blocker, no_open_row_before, no_row_in_flight_before, not_due, ready, waiting,
};
use super::{PgStore, Result, StoreError};
use crate::config::{Ordering, TableName};
use crate::message::OutboxMessage;
use crate::store::{Claim, ClaimRequest, Expired, ExpirySweep};

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
    /// The same statement answering one row, `ids`: the claimed ids as a `uuid[]` text (for a
    /// pgbench script's `\gset`: a statement that updates in a `WITH` cannot be wrapped in
    /// another).
    pub claim_aggregate_ids: String,
    /// The ordered claim on a table before schema version 7 (no `<table>_blocker_idx`), with
    /// the same parameters.
    pub claim_aggregate_probing: String,
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

/// The last `SELECT` of a claim answering one row, `ids`: the ids of its `claimed` rows as a
/// `uuid[]` text (for a pgbench script's `\gset`).
#[cfg(any(test, feature = "bench"))]
pub const CLAIMED_IDS: &str = "SELECT coalesce(array_agg(id), '{}')::text AS ids FROM claimed";

/// Renders [`HotPathSql`] for `table`.
#[cfg(any(test, feature = "bench"))]
pub fn hot_path_sql(table: &TableName) -> HotPathSql {
    let t = table.qualified();
    HotPathSql {
        claim: claim_none(&t),
        claim_aggregate: claim_aggregate(&t),
        claim_aggregate_ids: claim_aggregate_then(&t, CLAIMED_IDS),
        claim_aggregate_probing: claim_aggregate_probing(&t),
        mark_sent: super::settle::mark_sent_sql(table),
        part_key: part_key(""),
    }
}

/// The claim's SQL text, rendered once for the configured table.
#[derive(Debug, Clone)]
pub(super) struct ClaimSql {
    pub(super) claim_none: String,
    pub(super) suspects_waiting: String,
    pub(super) claim_suspect: String,
    pub(super) claim_aggregate: String,
    pub(super) claim_aggregate_probing: String,
    pub(super) expire: String,
    pub(super) expire_delete: String,
}

impl ClaimSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        Self {
            claim_none: claim_none(&t),
            suspects_waiting: suspects_waiting(&t),
            claim_suspect: claim_suspect(&t),
            claim_aggregate: claim_aggregate(&t),
            claim_aggregate_probing: claim_aggregate_probing(&t),
            expire: expire(&t),
            expire_delete: expire_delete(&t),
        }
    }
}

/// The claim with `ordering = "none"`: the oldest ready rows, skipping rows another claim
/// holds; they become `processing` in this relay's name with one more attempt counted.
/// Reclaimed rows (suspects) and rows past their deadline are never taken. `$1` batch size,
/// `$2` instance id.
fn claim_none(t: &str) -> String {
    let ready = ready("");
    format!(
        "WITH cand AS ( \
           SELECT id FROM {t} \
           WHERE status = 'pending' AND {ready} \
           ORDER BY seq LIMIT $1 \
           FOR UPDATE SKIP LOCKED) \
         UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
           locked_by = $2, locked_at = now() \
         WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
         RETURNING {RETURNING}"
    )
}

/// A ready row reclaimed from a dead relay (a suspect of the crash) that is the head of its
/// aggregate (or has none) and, with an aggregate, at or below the watermark `watermark` (a
/// parameter such as `$1`). The head check holds for a row without an aggregate (it matches no
/// row): it stands alone, outside any `OR`, so that the planner can make its probes joins.
fn suspect_where(t: &str, watermark: &str) -> String {
    let (not_due, head) = (not_due("c"), no_open_row_before(t, "c"));
    format!(
        "c.status = 'pending' AND c.available_at <= now() AND c.last_error LIKE '{SUSPECT}%' \
         AND {not_due} \
         AND (c.aggregate_id IS NULL OR c.seq <= {watermark}) AND {head}"
    )
}

/// Whether a row [`claim_suspect`] would take is waiting. `$1` watermark.
fn suspects_waiting(t: &str) -> String {
    let suspect = suspect_where(t, "$1");
    format!("SELECT EXISTS (SELECT 1 FROM {t} c WHERE {suspect})")
}

/// One row that was held by a relay that died (a suspect of the crash), claimed on its own so
/// that a row which kills the relay spends only its own attempts, never those of rows that
/// happened to share its batch. `$1` instance id, `$2` watermark.
fn claim_suspect(t: &str) -> String {
    let suspect = suspect_where(t, "$2");
    format!(
        "WITH cand AS ( \
           SELECT c.id FROM {t} c WHERE {suspect} \
           ORDER BY c.seq LIMIT 1 \
           FOR UPDATE OF c SKIP LOCKED) \
         UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
           locked_by = $1, locked_at = now() \
         WHERE t.id = ANY(ARRAY(SELECT id FROM cand)) \
         RETURNING {RETURNING}"
    )
}

/// The most aggregates in flight the aggregate claim looks up by hash (see [`claim_aggregate`]):
/// low enough that the planner keeps the set hashed whatever the statistics say (at 100,000
/// PostgreSQL 15 planned a scan of the set per candidate once 150,000 rows were in flight;
/// PostgreSQL 13 and 14 give a hash half the memory).
const BUSY_CAP: u32 = 30_000;

/// The most rows past their deadline and suspects the aggregate claim looks at (see
/// [`claim_aggregate`]): the sweep removes the first within seconds, the second go out one at
/// a time. Each candidate scans them; past the cap the rows left out still stop their
/// aggregate's run in the scan window, they only take room in it.
const STUCK_CAP: u32 = 1_000;

/// The ordered claims' `busy` CTE: the aggregates with a row in flight (from the small
/// processing index), hashed once per statement, capped at [`BUSY_CAP`].
fn busy(t: &str) -> String {
    format!(
        "busy AS MATERIALIZED ( \
           SELECT DISTINCT b.aggregate_type, b.aggregate_id FROM {t} b \
           WHERE b.status = 'processing' AND b.aggregate_id IS NOT NULL \
           LIMIT {BUSY_CAP})"
    )
}

/// No row of the aggregate of the row `alias` is in flight: not in [`busy`], and, once `busy`
/// reached its cap, none before it in the processing index either (slower but exact).
fn not_busy(t: &str, alias: &str) -> String {
    let in_flight = no_row_in_flight_before(t, alias);
    format!(
        "({alias}.aggregate_type, {alias}.aggregate_id) NOT IN (SELECT * FROM busy) \
         AND ((SELECT count(*) FROM busy) < {BUSY_CAP} OR {in_flight})"
    )
}

/// The claim with `ordering = "aggregate"` on a table before schema version 7 (no
/// `<table>_blocker_idx`): the same parameters, rows and invariant as [`claim_aggregate`],
/// with a probe of each candidate's first waiting row in the aggregate index instead of the
/// blocker index (about twice the work).
/// Candidates that another relay holds are skipped (SKIP LOCKED), which leaves a gap and so
/// blocks every row after them.
///
/// How, step by step:
/// - `busy`: aggregates with a row in flight (from the small processing index) are skipped
///   before any probe: in a steady drain most blocked rows are behind an in-flight head, and
///   a hash lookup costs a fraction of an index probe. The set is capped at [`BUSY_CAP`] so
///   that the planner keeps it hashed; past the cap (20 replicas at the default
///   `max_in_flight`, each aggregate with a row in flight) each candidate also probes the rows
///   in flight, slower but exact: the waiting index the head probe reads holds no row in
///   flight.
/// - `cand`: up to the scan window of ready rows at or below the watermark, in this part
///   (the aggregates that hash to it, rows without one by `seq`: no two parts contend for an
///   aggregate), whose aggregate is not busy and whose head (first waiting row, see
///   [`waiting`]) is ready. The head probe is a lateral
///   join, one index probe per candidate (the generic plan does not memoize it: about a third
///   of the statement's time); the conditions on the candidate alone stand apart from the one
///   on the head so the scan is filtered before the join. A blocked
///   aggregate (head in flight elsewhere, backing off, dead, a suspect, past its deadline)
///   thus cannot fill the window and starve the others.
/// - `checked`, `chained`: a candidate is free when it is the head, or when no waiting row
///   lies between it and the previous candidate of its aggregate (a probe bounded on both
///   sides; `cand` let no aggregate with a row in flight through);
///   it is claimable when it and every earlier candidate of its aggregate are free.
/// - `picked`: the batch is filled run by run (aggregates in the order of their oldest
///   candidate, each run in `seq` order; a prefix of a run is still a run), so a backlog
///   spread over many aggregates goes out in long runs rather than one row per aggregate per
///   claim.
fn claim_aggregate_probing(t: &str) -> String {
    let part_c = part_key("c");
    let (ready_c, ready_h) = (ready("c"), ready("h"));
    let (waiting_e, waiting_h) = (waiting("e"), waiting("h"));
    let (busy, not_busy_c) = (busy(t), not_busy(t, "c"));
    format!(
        "WITH {busy}, \
         cand AS ( \
           SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id, h.head_seq FROM {t} c \
           LEFT JOIN LATERAL ( \
             SELECT CASE WHEN h.status = 'pending' AND {ready_h} THEN h.seq END AS head_seq \
             FROM {t} h \
             WHERE h.aggregate_type = c.aggregate_type AND h.aggregate_id = c.aggregate_id \
               AND {waiting_h} ORDER BY h.seq LIMIT 1) h ON true \
           WHERE c.status = 'pending' AND {ready_c} \
             AND {part_c} % $5 = $6 \
             AND (c.aggregate_id IS NULL OR (c.seq <= $3 \
               AND {not_busy_c})) \
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
                      AND {waiting_e} AND e.seq > r.prev_seq AND e.seq < r.seq) END AS free \
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
    )
}

/// The claim with `ordering = "aggregate"`. `$1` batch size, `$2` instance id, `$3`
/// watermark (the highest `seq` that is final), `$4` scan window ([`scan_window`]), `$5`
/// parts, `$6` this part.
///
/// Invariant: a row with an aggregate is claimed only together with every open row of its
/// aggregate before it, by this statement, so an aggregate's rows are held by one relay at a
/// time and published in `seq` order.
///
/// How, step by step:
/// - `busy`: aggregates with a row in flight (from the small processing index), hashed once,
///   capped at [`BUSY_CAP`] so that the planner keeps it hashed; past the cap each candidate
///   also probes the rows in flight, slower but exact.
/// - `stuck`: the pending rows past their deadline (until the sweep) and the suspects, from
///   their small partial indexes, at most [`STUCK_CAP`] of them: each holds back its
///   aggregate from its `seq` on, and neither kind has to be in the blocker index below.
/// - `cand`: up to the scan window of pending rows in `seq` order, read without a lock: rows
///   without an aggregate that are ready; rows with one at or below the watermark whose
///   aggregate is not busy, has no [`blocker`] up to them that is a dead letter or not
///   ready (one probe of the small `<table>_blocker_idx`, which has no entry for an
///   aggregate whose rows all went the ordinary way; a row backing off thus takes no room in
///   the window either) and no `stuck` row up to them; all in
///   this part (the aggregates that hash to it, rows without one by `seq`: no two parts
///   contend for an aggregate). Every waiting row of an aggregate before a candidate that is
///   not a dead letter is pending, so it is in the window itself, ready or not.
/// - `chained`: a candidate is claimable when it and every candidate of its aggregate before
///   it are ready: a row not ready that neither the blocker index nor `stuck` showed (one
///   whose `created_at` the application set ahead, or past `STUCK_CAP`) stops the run there.
/// - `picked`: the batch is filled run by run (aggregates in the order of their oldest
///   candidate, each run in `seq` order; a prefix of a run is still a run), so a backlog
///   spread over many aggregates goes out in long runs rather than one row per aggregate per
///   claim.
/// - `locked`: the picked rows are locked, skipping rows another claim holds and re-checking
///   each against its newest version (pending and due), so a row another relay claimed or
///   settled since this statement's snapshot is left out; `kept`: a run keeps its rows up to
///   the first one left out, which holds back the rest of its aggregate (a head that another
///   relay is claiming at this moment included).
/// - `claimed`: the update; the answer ([`CLAIMED_AND_LOST`]) also says how many picked rows
///   were left out. Two relays claiming at the same moment read the same window and pick the
///   same runs; the one that comes second then claims the rest of its share with
///   [`claim_aggregate_probing`], whose locked scan skips to the rows further on.
fn claim_aggregate(t: &str) -> String {
    claim_aggregate_then(t, CLAIMED_AND_LOST)
}

/// What [`claim_aggregate`] answers: the claimed rows ([`RETURNING`]), each with `lost`, the
/// number of picked rows it left out because another claim holds or has just changed them (a
/// run cut at such a row included); when it claimed none, one row of NULLs with `lost`.
const CLAIMED_AND_LOST: &str = "SELECT c.*, l.lost \
    FROM (SELECT count(*) FILTER (WHERE NOT ok) AS lost FROM kept) l LEFT JOIN claimed c ON true";

/// [`claim_aggregate`]'s statement with `answer` as its last `SELECT`, which reads the
/// `claimed` rows (and `kept`).
fn claim_aggregate_then(t: &str, answer: &str) -> String {
    let part_c = part_key("c");
    let (ready_c, ready_h, ready_l) = (ready("c"), ready("h"), ready("l"));
    let (busy, not_busy_c) = (busy(t), not_busy(t, "c"));
    let blocker_h = blocker("h");
    format!(
        "WITH {busy}, \
         stuck AS MATERIALIZED ( \
           SELECT x.aggregate_type, x.aggregate_id, x.seq FROM {t} x \
           WHERE x.status = 'pending' AND x.expires_at IS NOT NULL AND x.expires_at <= now() \
             AND x.aggregate_id IS NOT NULL \
           UNION ALL \
           SELECT s.aggregate_type, s.aggregate_id, s.seq FROM {t} s \
           WHERE s.status = 'pending' AND s.last_error LIKE '{SUSPECT}%' \
             AND s.aggregate_id IS NOT NULL \
           LIMIT {STUCK_CAP}), \
         cand AS ( \
           SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id, ({ready_c}) AS ready FROM {t} c \
           WHERE c.status = 'pending' \
             AND {part_c} % $5 = $6 \
             AND ((c.aggregate_id IS NULL AND {ready_c}) \
               OR (c.aggregate_id IS NOT NULL AND c.seq <= $3 \
                 AND {not_busy_c} \
                 AND NOT EXISTS (SELECT 1 FROM {t} h WHERE ({blocker_h}) \
                   AND h.aggregate_type = c.aggregate_type AND h.aggregate_id = c.aggregate_id \
                   AND h.seq <= c.seq AND (h.status = 'failed' OR NOT ({ready_h}))) \
                 AND NOT EXISTS (SELECT 1 FROM stuck k WHERE k.aggregate_type = c.aggregate_type \
                   AND k.aggregate_id = c.aggregate_id AND k.seq <= c.seq))) \
           ORDER BY c.seq LIMIT $4), \
         chained AS ( \
           SELECT id, seq, aggregate_type, aggregate_id, \
             CASE WHEN aggregate_id IS NULL THEN true ELSE bool_and(ready) OVER w END AS ok, \
             CASE WHEN aggregate_id IS NULL THEN seq ELSE min(seq) OVER w END AS head \
           FROM cand \
           WINDOW w AS (PARTITION BY aggregate_type, aggregate_id ORDER BY seq)), \
         picked AS ( \
           SELECT id, seq, aggregate_type, aggregate_id FROM chained WHERE ok \
           ORDER BY head, seq LIMIT $1), \
         locked AS ( \
           SELECT l.id FROM {t} l \
           WHERE l.id = ANY(ARRAY(SELECT id FROM picked)) AND l.status = 'pending' AND {ready_l} \
           FOR UPDATE SKIP LOCKED), \
         kept AS ( \
           SELECT p.id, CASE WHEN p.aggregate_id IS NULL THEN l.id IS NOT NULL \
             ELSE bool_and(l.id IS NOT NULL) OVER ( \
               PARTITION BY p.aggregate_type, p.aggregate_id ORDER BY p.seq) END AS ok \
           FROM picked p LEFT JOIN locked l ON l.id = p.id), \
         claimed AS ( \
           UPDATE {t} AS t SET status = 'processing', attempts = t.attempts + 1, \
             locked_by = $2, locked_at = now() \
           WHERE t.id = ANY(ARRAY(SELECT id FROM kept WHERE ok)) \
           RETURNING {RETURNING}) \
         {answer}"
    )
}

/// The pending rows past their deadline, oldest deadline first, through the small
/// `<table>_expiry_idx`, skipping rows another sweep holds. Rows in flight are not touched:
/// a row claimed before its deadline is published. `$1` batch size.
fn due(t: &str) -> String {
    format!(
        "WITH due AS ( \
           SELECT id FROM {t} \
           WHERE status = 'pending' AND expires_at IS NOT NULL AND expires_at <= now() \
           ORDER BY expires_at LIMIT $1 \
           FOR UPDATE SKIP LOCKED)"
    )
}

/// The expiry sweep: [`due`] rows become `expired` (terminal), with a `last_error` naming
/// the deadline. `$1` batch size.
fn expire(t: &str) -> String {
    let due = due(t);
    format!(
        "{due} \
         UPDATE {t} AS t SET status = 'expired', locked_by = NULL, locked_at = NULL, \
           last_error = 'expired: its deadline ' \
             || to_char(t.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') \
             || ' passed before it was published (after ' || t.attempts || ' attempts)' \
         WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
         RETURNING t.id, t.aggregate_type"
    )
}

/// The expiry sweep with retention 0: [`due`] rows are deleted. `$1` batch size.
fn expire_delete(t: &str) -> String {
    let due = due(t);
    format!(
        "{due} \
         DELETE FROM {t} AS t WHERE t.id = ANY(ARRAY(SELECT id FROM due)) \
         RETURNING t.id, t.aggregate_type"
    )
}

/// The claim the parts of a split claim and the expiry sweep beside them add up to. A part
/// (or the sweep) that failed while another part claimed rows is a warning: those rows are
/// this relay's now and go out; the next round retries the rest.
fn claim_of(
    parts: Parts,
    expired: std::result::Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
) -> Result<Claim> {
    let Parts {
        mut rows,
        more,
        short,
        failed,
    } = parts;
    let answer_lost = match failed {
        Some(e) if rows.is_empty() => return Err(e),
        Some(e) => {
            tracing::warn!(error = %e, claimed = rows.len(), "part of a split claim failed; publishing what the other parts claimed");
            e.answer_may_be_lost()
        }
        None => false,
    };
    let expired = match expired.and_then(|rows| rows.iter().map(expired_of).collect()) {
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
        unreadable: 0,
        contended: false,
    })
}

impl PgStore {
    /// Expires pending rows past their deadline (up to `limit`, as `sweep` says), then claims
    /// up to `limit` ready rows (see [`ClaimRequest`]). With [`Ordering::Aggregate`], only rows
    /// at or below `watermark` (for rows with an aggregate id) whose earlier open rows all
    /// come along.
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
    pub async fn claim_and_expire(&self, request: ClaimRequest) -> Result<Claim> {
        let ClaimRequest {
            ordering,
            limit,
            watermark,
            sweep,
            parts,
        } = request;
        let client = self.client().await?;
        // The other parts only on connections free right now, taken before any part starts:
        // a claim never waits for a connection (with outboxes sharing a small pool, waiting
        // ones could hold each other up) while rows it already claimed wait unpublished.
        let extra = self.clients_if_free(parts.clamp(1, limit.max(1)) - 1).await;
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
        let parts = Parts::gather(std::iter::once(first).chain(others), shares);
        claim_of(parts, expired)
    }

    /// Up to `n` pooled connections that are free now (idle, or a slot to open one), without
    /// waiting.
    async fn clients_if_free(&self, n: usize) -> Vec<deadpool_postgres::Object> {
        let mut timeouts = self.pool.timeouts();
        timeouts.wait = Some(Duration::ZERO);
        let mut free = Vec::with_capacity(n);
        while free.len() < n {
            match self.pool.timeout_get(&timeouts).await {
                Ok(c) => free.push(c),
                Err(_) => break,
            }
        }
        free
    }

    /// One part of a claim (see [`PgStore::claim_and_expire`]): `part` of `shares.len()`, for
    /// `shares[part]` rows, on `client`.
    async fn claim_part(
        &self,
        client: &deadpool_postgres::Object,
        ordering: Ordering,
        watermark: i64,
        (part, shares): (usize, &[usize]),
    ) -> PartAnswer {
        let limit = i64::try_from(shares[part]).unwrap_or(i64::MAX);
        let parts = i64::try_from(shares.len()).unwrap_or(1);
        let this = i64::try_from(part).unwrap_or(0);
        let ordered = |sql, limit: i64| async move {
            let stmt = client.prepare_cached(sql).await?;
            let scan = scan_window(limit);
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
                [&limit, &self.instance_id, &watermark, &scan, &parts, &this];
            Ok::<_, StoreError>(client.query(&stmt, &params).await?)
        };
        let probing = &self.q.claim.claim_aggregate_probing;
        let first = async {
            match ordering {
                Ordering::None => {
                    let stmt = client.prepare_cached(&self.q.claim.claim_none).await?;
                    let rows = client.query(&stmt, &[&limit, &self.instance_id]).await?;
                    Ok((rows, 0))
                }
                Ordering::Aggregate if !self.has_blocker_index(client).await? => {
                    Ok((ordered(probing, limit).await?, 0))
                }
                Ordering::Aggregate => {
                    let mut rows = ordered(&self.q.claim.claim_aggregate, limit).await?;
                    let lost = rows
                        .first()
                        .map(|r| r.try_get::<_, i64>("lost"))
                        .transpose()?
                        .unwrap_or(0);
                    // The row of NULLs a claim that took nothing answers.
                    rows.retain(|r| matches!(r.try_get::<_, Option<Uuid>>(0), Ok(Some(_))));
                    Ok((rows, lost))
                }
            }
        };
        let (mut rows, lost) = match first.await {
            Ok(answer) => answer,
            Err(e) => return PartAnswer::failed(e),
        };
        let short = limit - i64::try_from(rows.len()).unwrap_or(limit);
        if lost > 0 && short > 0 {
            // Another relay claimed the same runs at the same moment: the probing claim's
            // locked scan skips its rows and takes the ones further on. The rows claimed
            // already are this relay's whatever that claim answers.
            match ordered(probing, short).await {
                Ok(more) => rows.extend(more),
                Err(e) => {
                    return PartAnswer {
                        rows,
                        failed: Some(e),
                    };
                }
            }
        }
        PartAnswer { rows, failed: None }
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
}

/// What the parts of a split claim brought back together.
struct Parts {
    /// Every part's rows, in no particular order.
    rows: Vec<OutboxMessage>,
    /// Some part filled its share.
    more: bool,
    /// Some part came back short of its share.
    short: bool,
    /// The first error of a part that failed.
    failed: Option<StoreError>,
}

/// What one part of a claim answered: the rows it claimed, and the error of a statement that
/// failed (after others of the part claimed `rows`, or with `rows` empty).
struct PartAnswer {
    rows: Vec<tokio_postgres::Row>,
    failed: Option<StoreError>,
}

impl PartAnswer {
    fn failed(e: StoreError) -> Self {
        Self {
            rows: Vec::new(),
            failed: Some(e),
        }
    }
}

impl Parts {
    /// Gathers each part's answer with its share of the batch.
    fn gather(answers: impl Iterator<Item = PartAnswer>, shares: &[usize]) -> Self {
        let mut parts = Self {
            rows: Vec::with_capacity(shares.iter().sum()),
            more: false,
            short: false,
            failed: None,
        };
        for (answer, share) in answers.zip(shares) {
            let n = answer.rows.len();
            let messages = answer
                .rows
                .iter()
                .map(message_of)
                .collect::<Result<Vec<_>, _>>();
            let failed = match messages {
                Ok(messages) => {
                    parts.more |= n >= *share;
                    parts.short |= n < *share;
                    parts.rows.extend(messages);
                    answer.failed
                }
                Err(e) => Some(e.into()),
            };
            if let Some(e) = failed {
                parts.failed = parts.failed.take().or(Some(e));
            }
        }
        parts
    }
}

/// A row the expiry sweep returned.
fn expired_of(r: &tokio_postgres::Row) -> Result<Expired, tokio_postgres::Error> {
    Ok(Expired {
        id: r.try_get(0)?,
        aggregate_type: r.try_get(1)?,
    })
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
        traceparent: None,
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
        assert!(sql.claim.contains("app.events") && sql.claim.contains("FOR UPDATE SKIP LOCKED"));
        assert!(
            sql.mark_sent
                .starts_with("UPDATE app.events SET status = 'sent'")
        );
        assert!(sql.mark_sent.contains("id = ANY($1)"));
        assert_eq!(sql.claim_aggregate, q.claim_aggregate);
        // The claim splits by the same key the tools are given.
        let split_by = format!("{} % $5 = $6", part_key("c"));
        assert!(q.claim_aggregate.contains(&split_by));
        assert_eq!(sql.part_key, part_key(""));
        assert!(!sql.part_key.contains("c."));
    }

    #[test]
    fn claims_name_the_schema_qualified_table_and_skip_locked_rows() {
        let table = TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}"));
        let q = ClaimSql::new(&table);
        for (name, sql) in [
            ("claim_none", &q.claim_none),
            ("claim_aggregate", &q.claim_aggregate),
            ("claim_suspect", &q.claim_suspect),
            ("expire", &q.expire),
            ("expire_delete", &q.expire_delete),
        ] {
            assert!(sql.contains("app.events "), "{name}: {sql}");
            assert!(!sql.contains("outbox_messages"), "{name}: {sql}");
            assert!(sql.contains("SKIP LOCKED"), "{name}: {sql}");
        }
        assert!(q.suspects_waiting.contains("FROM app.events c"));
    }

    #[test]
    fn suspects_are_claimed_alone_and_never_by_the_ordinary_claims() {
        let q = ClaimSql::new(&TableName::parse("outbox").unwrap_or_else(|e| panic!("{e}")));
        assert!(
            q.claim_suspect.contains("LIMIT 1")
                && q.claim_suspect.contains("LIKE 'lease expired:%'")
        );
        assert!(q.claim_none.contains("NOT LIKE 'lease expired:%'"));
        assert!(q.claim_aggregate.contains("NOT LIKE 'lease expired:%'"));
        // The check looks for what the claim takes: the same condition, at the watermark.
        let condition = |sql: &str, from: &str| {
            let at = sql.find(from).unwrap_or_else(|| panic!("{sql}"));
            sql[at + from.len()..].to_owned()
        };
        let waiting = condition(&q.suspects_waiting, "c WHERE ");
        let claimed = condition(&q.claim_suspect, "c WHERE ");
        let waiting = waiting.trim_end_matches(')').replace("$1", "$W");
        assert!(
            claimed.starts_with(&waiting.replace("$W", "$2")),
            "{waiting}\n{claimed}"
        );
    }
}
