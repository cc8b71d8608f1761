//! Claiming on MySQL: the claim by ordering mode, a suspect on its own, and the expiry sweep
//! run before them, each one short transaction that commits before anything is published.
//!
//! The ordering guard (`ordering = "aggregate"`) is one locking probe per claim: InnoDB shows a
//! row inserted by a transaction that has not committed yet as a locked index record, so a
//! `FOR UPDATE NOWAIT` read over an aggregate's open rows before a candidate fails at once
//! while such a row exists, and finds the committed ones (in flight, backing off, dead) that
//! hold the candidate back. A candidate is claimed only when the probe over its aggregate
//! found nothing before it but the candidates claimed with it: no transaction that wrote an
//! earlier row of the aggregate can still commit, whatever else is running. A transaction on
//! another table never holds an aggregate back, and the probe waits for no one.

use std::collections::HashMap;

use mysql_async::prelude::{FromValue, Queryable};
use mysql_async::{Row, Transaction, TxOpts};

use super::{MysqlStore, Result, StoreError, parse_id, seq_list, utc};
use crate::config::{Ordering, TableName};
use crate::message::OutboxMessage;
use crate::store::postgres::scan_window;
use crate::store::{Claim, Expired, ExpirySweep};

/// `last_error` prefix of rows reclaimed from a relay that died while holding them.
pub(super) const SUSPECT: &str = "lease expired:";

/// The columns a claim returns, in [`message_of`]'s order.
const COLUMNS: &str = "seq, id, aggregate_type, aggregate_id, event_type, payload, headers, \
                       destination, attempts, created_at, expires_at";

/// At most this many aggregates in flight are read before an ordered claim (the probe covers
/// any beyond them).
const BUSY_CAP: usize = 10_000;

/// The statements of claiming, rendered once for the table.
#[derive(Debug)]
pub(super) struct ClaimSql {
    t: String,
    /// The `(aggregate_type, aggregate_id, status, seq)` index's name.
    aggregate_idx: String,
    /// Ready rows in `seq` order, locked (`?` limit): ordering `none` takes them all.
    ready_rows: String,
    /// Ready rows' keys in `seq` order, locked (`?` limit): an ordered claim's candidates.
    ready_keys: String,
    /// The aggregates with a row in flight (read, not locked): their candidates wait.
    busy: String,
    /// Whether a suspect is ready.
    suspects_waiting: String,
    /// The oldest ready suspect, locked.
    suspect: String,
    /// Pending rows past their deadline, locked (`?` limit).
    due: String,
}

impl ClaimSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        let ready = "status = 'pending' AND sent_at IS NULL AND available_at <= NOW(6) \
                     AND (expires_at IS NULL OR expires_at > NOW(6))";
        let not_suspect = format!("(last_error IS NULL OR last_error NOT LIKE '{SUSPECT}%')");
        let suspect = format!("last_error LIKE '{SUSPECT}%'");
        Self {
            ready_rows: format!(
                "SELECT {COLUMNS} FROM {t} WHERE {ready} AND {not_suspect} \
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            ready_keys: format!(
                "SELECT seq, aggregate_type, aggregate_id FROM {t} WHERE {ready} AND {not_suspect} \
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            busy: format!(
                "SELECT DISTINCT aggregate_type, aggregate_id FROM {t} \
                 WHERE status = 'processing' AND aggregate_id IS NOT NULL LIMIT {BUSY_CAP}"
            ),
            suspects_waiting: format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE {ready} AND {suspect})"
            ),
            suspect: format!(
                "SELECT {COLUMNS} FROM {t} WHERE {ready} AND {suspect} \
                 ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED"
            ),
            due: format!(
                "SELECT seq, id, aggregate_type FROM {t} \
                 WHERE expires_at <= NOW(6) AND status = 'pending' \
                 ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            aggregate_idx: format!("{}_aggregate_idx", table.name),
            t,
        }
    }

    /// Marks `seqs` claimed in the name `by` (an SQL literal, [`literal`]), one more attempt
    /// counted. Sent as text: a statement whose list changes every call is not worth preparing.
    fn mark_claimed(&self, seqs: &[i64], by: &str) -> String {
        format!(
            "UPDATE {} SET status = 'processing', attempts = attempts + 1, locked_by = {by}, \
             locked_at = NOW(6) WHERE seq IN ({})",
            self.t,
            seq_list(seqs)
        )
    }

    /// The rows `seqs`, in `seq` order.
    fn rows(&self, seqs: &[i64]) -> String {
        format!(
            "SELECT {COLUMNS} FROM {} WHERE seq IN ({}) ORDER BY seq",
            self.t,
            seq_list(seqs)
        )
    }

    /// The ordering guard's probe: for each `(aggregate_type, aggregate_id, seq)` of `heads`,
    /// the open rows of that aggregate before that seq, locked without waiting (an error when
    /// one is locked: an uncommitted insert, or a row another relay is claiming now).
    fn probe(&self, heads: &[(&str, &str, i64)]) -> String {
        let each = heads
            .iter()
            .map(|(ty, id, seq)| {
                format!(
                    "(e.aggregate_type = {} AND e.aggregate_id = {} AND e.seq < {seq})",
                    literal(ty),
                    literal(id)
                )
            })
            .collect::<Vec<_>>()
            .join(" OR ");
        // The aggregate index, forced: a locking read locks every row it reads, so the probe
        // must read the ranges of the candidates' aggregates and nothing else.
        format!(
            "SELECT e.aggregate_type, e.aggregate_id, e.seq FROM {} e FORCE INDEX ({}) \
             WHERE e.status IN ('pending', 'processing', 'failed') AND ({each}) \
             FOR UPDATE NOWAIT",
            self.t, self.aggregate_idx
        )
    }

    /// Every statement, by name, with sample lists where a list is spliced per call
    /// (`sql/statements/mysql/`).
    #[cfg(test)]
    pub(super) fn catalog(&self) -> Vec<(String, String)> {
        let seqs = &[7, 8];
        [
            ("claim.ready_rows", self.ready_rows.clone()),
            ("claim.ready_keys", self.ready_keys.clone()),
            ("claim.busy", self.busy.clone()),
            (
                "claim.probe",
                self.probe(&[("order", "42", 8), ("invoice", "7", 9)]),
            ),
            (
                "claim.mark_claimed",
                self.mark_claimed(seqs, &literal("relay-1")),
            ),
            ("claim.rows", self.rows(seqs)),
            ("claim.suspects_waiting", self.suspects_waiting.clone()),
            ("claim.suspect", self.suspect.clone()),
            ("claim.due", self.due.clone()),
            ("claim.expire_mark", self.expire(seqs, ExpirySweep::Mark)),
            (
                "claim.expire_delete",
                self.expire(seqs, ExpirySweep::Delete),
            ),
        ]
        .map(|(n, s)| (n.to_owned(), s))
        .to_vec()
    }

    /// The expiry sweep for `seqs` (marked `expired`, or deleted with retention 0).
    fn expire(&self, seqs: &[i64], sweep: ExpirySweep) -> String {
        let list = seq_list(seqs);
        match sweep {
            ExpirySweep::Delete => format!("DELETE FROM {} WHERE seq IN ({list})", self.t),
            _ => format!(
                "UPDATE {} SET status = 'expired', locked_by = NULL, locked_at = NULL, \
                   last_error = CONCAT('expired: its deadline ', \
                     DATE_FORMAT(expires_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
                     ' passed before it was published (after ', attempts, ' attempts)') \
                 WHERE seq IN ({list})",
                self.t
            ),
        }
    }
}

/// The relay's claim statements on a MySQL outbox, as the relay sends them, for tools that
/// replay them outside the relay (the benchmark's bare MariaDB client). A claim is one
/// transaction: with ordering `none`, [`HotPathSql::claim_none`] then
/// [`HotPathSql::mark_claimed`]; with ordering `aggregate`, [`HotPathSql::candidates`], the
/// probe ([`HotPathSql::probe`], whose error [`is_locked`] tells a locked row), then
/// [`HotPathSql::mark_claimed`] and [`HotPathSql::rows`] of the candidates taken.
#[cfg(feature = "bench")]
#[derive(Debug)]
pub struct HotPathSql {
    claim: ClaimSql,
}

#[cfg(feature = "bench")]
impl HotPathSql {
    /// The statements for `table`.
    pub fn new(table: &TableName) -> Self {
        Self {
            claim: ClaimSql::new(table),
        }
    }

    /// The claim with ordering `none` (prepared; `?` batch size): the ready rows, locked.
    pub fn claim_none(&self) -> &str {
        &self.claim.ready_rows
    }

    /// An ordered claim's candidates (prepared; `?` the scan window): `seq`, `aggregate_type`,
    /// `aggregate_id` of the ready rows, locked.
    pub fn candidates(&self) -> &str {
        &self.claim.ready_keys
    }

    /// The aggregates with a row in flight, read before the probe: their candidates wait.
    pub fn busy(&self) -> &str {
        &self.claim.busy
    }

    /// The ordering guard's probe over `(aggregate_type, aggregate_id, last candidate's seq)`.
    pub fn probe(&self, heads: &[(&str, &str, i64)]) -> String {
        self.claim.probe(heads)
    }

    /// Marks `seqs` claimed by `instance`.
    pub fn mark_claimed(&self, seqs: &[i64], instance: &str) -> String {
        self.claim.mark_claimed(seqs, &literal(instance))
    }

    /// The rows `seqs`, in `seq` order (an ordered claim's result).
    pub fn rows(&self, seqs: &[i64]) -> String {
        self.claim.rows(seqs)
    }
}

/// `text` as a utf8mb4 string literal written in hex: any byte is safe in it, and it takes
/// the collation of the column it is compared with or assigned to.
pub(super) fn literal(text: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(12 + text.len() * 2);
    out.push_str("_utf8mb4 X'");
    for b in text.as_bytes() {
        let _ = write!(out, "{b:02x}");
    }
    out.push('\'');
    out
}

/// Column `i` of `row` as `T`; a value that does not convert is a schema problem, never a panic.
pub(super) fn column<T: FromValue>(row: &mut Row, i: usize, name: &str) -> Result<T> {
    match row.take_opt::<T, usize>(i) {
        Some(Ok(v)) => Ok(v),
        Some(Err(e)) => Err(StoreError::Schema(format!(
            "column {name} holds a value the relay cannot read: {e}"
        ))),
        None => Err(StoreError::Schema(format!("column {name} is missing"))),
    }
}

/// A row in [`COLUMNS`] order.
fn message_of(mut r: Row) -> Result<OutboxMessage> {
    let id: String = column(&mut r, 1, "id")?;
    Ok(OutboxMessage {
        id: parse_id(&id)?,
        seq: column(&mut r, 0, "seq")?,
        aggregate_type: column(&mut r, 2, "aggregate_type")?,
        aggregate_id: column(&mut r, 3, "aggregate_id")?,
        event_type: column(&mut r, 4, "event_type")?,
        payload: column(&mut r, 5, "payload")?,
        headers: column(&mut r, 6, "headers")?,
        destination: column(&mut r, 7, "destination")?,
        attempts: column(&mut r, 8, "attempts")?,
        created_at: utc(column(&mut r, 9, "created_at")?),
        expires_at: column::<Option<chrono::NaiveDateTime>>(&mut r, 10, "expires_at")?.map(utc),
        traceparent: None,
    })
}

/// An ordered claim's candidate: its seq and aggregate.
struct Candidate {
    seq: i64,
    aggregate: Option<(String, String)>,
}

impl MysqlStore {
    /// Expires pending rows past their deadline (up to `limit`, as `sweep` says), then claims
    /// up to `limit` ready rows in one transaction; with [`Ordering::Aggregate`], only rows
    /// whose aggregate has no open row before them but rows claimed with them.
    pub async fn claim_and_expire(
        &self,
        ordering: Ordering,
        limit: usize,
        sweep: ExpirySweep,
    ) -> Result<Claim> {
        let mut conn = self.conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let expired = match sweep {
            ExpirySweep::Skip => Vec::new(),
            sweep => self.sweep(&mut tx, sweep, limit).await?,
        };
        let limit_i = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = match ordering {
            Ordering::None => {
                let rows: Vec<Row> = tx.exec(&self.q.claim.ready_rows, (limit_i,)).await?;
                let mut rows = rows
                    .into_iter()
                    .map(message_of)
                    .collect::<Result<Vec<_>>>()?;
                let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
                if !seqs.is_empty() {
                    let by = literal(&self.instance_id);
                    tx.query_drop(self.q.claim.mark_claimed(&seqs, &by)).await?;
                }
                for r in &mut rows {
                    r.attempts += 1;
                }
                rows
            }
            Ordering::Aggregate => self.claim_ordered(&mut tx, limit).await?,
        };
        tx.commit().await?;
        Ok(Claim {
            more: rows.len() >= limit,
            rows,
            expired,
            uneven: false,
            answer_lost: false,
        })
    }

    /// The ordered claim inside `tx`: candidates, the probe, then the rows taken.
    async fn claim_ordered(
        &self,
        tx: &mut Transaction<'_>,
        limit: usize,
    ) -> Result<Vec<OutboxMessage>> {
        let scan = scan_window(i64::try_from(limit).unwrap_or(i64::MAX));
        let keys: Vec<Row> = tx.exec(&self.q.claim.ready_keys, (scan,)).await?;
        let mut candidates = Vec::with_capacity(keys.len());
        for mut k in keys {
            let ty: String = column(&mut k, 1, "aggregate_type")?;
            let id: Option<String> = column(&mut k, 2, "aggregate_id")?;
            candidates.push(Candidate {
                seq: column(&mut k, 0, "seq")?,
                aggregate: id.map(|id| (ty, id)),
            });
        }
        let busy: Vec<(String, String)> = tx.query(&self.q.claim.busy).await?;
        let blocked = self.blocked_from(tx, &candidates, busy).await?;
        let mut taken = Vec::new();
        for c in &candidates {
            if taken.len() >= limit {
                break;
            }
            let free = match &c.aggregate {
                None => true,
                Some(key) => blocked.get(key).is_none_or(|&from| c.seq < from),
            };
            if free {
                taken.push(c.seq);
            }
        }
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        let by = literal(&self.instance_id);
        tx.query_drop(self.q.claim.mark_claimed(&taken, &by))
            .await?;
        let rows: Vec<Row> = tx.query(self.q.claim.rows(&taken)).await?;
        rows.into_iter().map(message_of).collect()
    }

    /// For each aggregate among `candidates`, the seq from which its candidates are held back:
    /// its first candidate when it is `busy` (a row of it in flight) or when the probe could
    /// not read its rows (one of them is locked), else the first open row before its last
    /// candidate that is not a candidate itself. An aggregate absent from the map holds nothing
    /// back. Only the aggregates not busy are probed: fewer ranges, and no row a concurrent
    /// settle is writing to make the probe fail.
    async fn blocked_from(
        &self,
        tx: &mut Transaction<'_>,
        candidates: &[Candidate],
        busy: Vec<(String, String)>,
    ) -> Result<HashMap<(String, String), i64>> {
        // Each aggregate's first and last candidate.
        let mut span: HashMap<(&str, &str), (i64, i64)> = HashMap::new();
        for c in candidates {
            if let Some((ty, id)) = &c.aggregate {
                let e = span.entry((ty, id)).or_insert((c.seq, c.seq));
                e.1 = c.seq;
            }
        }
        let mine: std::collections::HashSet<i64> = candidates.iter().map(|c| c.seq).collect();
        let mut blocked = HashMap::new();
        let busy: std::collections::HashSet<(String, String)> = busy.into_iter().collect();
        for ((ty, id), (first, _)) in &span {
            let key = ((*ty).to_owned(), (*id).to_owned());
            if busy.contains(&key) {
                blocked.insert(key, *first);
            }
        }
        let mut heads: Vec<(&str, &str, i64)> = span
            .iter()
            .filter(|((ty, id), _)| !blocked.contains_key(&((*ty).to_owned(), (*id).to_owned())))
            .map(|((ty, id), (_, last))| (*ty, *id, *last))
            .collect();
        heads.sort_unstable_by_key(|h| h.2);
        // Probe all aggregates at once; where that meets a locked row, halve the set until
        // each locked aggregate stands alone (and is held back from its first candidate).
        let mut work = vec![heads.as_slice()];
        while let Some(part) = work.pop() {
            if part.is_empty() {
                continue;
            }
            match tx.query::<Row, _>(self.q.claim.probe(part)).await {
                Ok(rows) => {
                    for mut r in rows {
                        let seq: i64 = column(&mut r, 2, "seq")?;
                        if mine.contains(&seq) {
                            continue;
                        }
                        let key = (
                            column::<String>(&mut r, 0, "aggregate_type")?,
                            column::<String>(&mut r, 1, "aggregate_id")?,
                        );
                        let e = blocked.entry(key).or_insert(seq);
                        *e = (*e).min(seq);
                    }
                }
                Err(e) if is_locked(&e) => {
                    if let [(ty, id, _)] = part {
                        let first = span.get(&(*ty, *id)).map_or(i64::MIN, |s| s.0);
                        blocked.insert(((*ty).to_owned(), (*id).to_owned()), first);
                    } else {
                        let (a, b) = part.split_at(part.len() / 2);
                        work.push(a);
                        work.push(b);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(blocked)
    }

    /// The expiry sweep inside `tx`: rows past their deadline become `expired` (or are
    /// deleted), and are returned for the metrics.
    async fn sweep(
        &self,
        tx: &mut Transaction<'_>,
        sweep: ExpirySweep,
        limit: usize,
    ) -> Result<Vec<Expired>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows: Vec<Row> = tx.exec(&self.q.claim.due, (limit,)).await?;
        let mut seqs = Vec::with_capacity(rows.len());
        let mut expired = Vec::with_capacity(rows.len());
        for mut r in rows {
            seqs.push(column::<i64>(&mut r, 0, "seq")?);
            let id: String = column(&mut r, 1, "id")?;
            expired.push(Expired {
                id: parse_id(&id)?,
                aggregate_type: column(&mut r, 2, "aggregate_type")?,
            });
        }
        if !seqs.is_empty() {
            tx.query_drop(self.q.claim.expire(&seqs, sweep)).await?;
        }
        Ok(expired)
    }

    /// Whether a row reclaimed from a dead relay is ready to be claimed.
    pub async fn suspects_waiting(&self) -> Result<bool> {
        let mut conn = self.conn().await?;
        let found: Option<bool> = conn.query_first(&self.q.claim.suspects_waiting).await?;
        Ok(found.unwrap_or(false))
    }

    /// Claims one row that a dead relay held, if any is ready and (ordering aside) nothing of
    /// its aggregate before it is open; it is then published alone.
    pub async fn claim_suspect(&self) -> Result<Option<OutboxMessage>> {
        let mut conn = self.conn().await?;
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let row: Option<Row> = tx.query_first(&self.q.claim.suspect).await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let mut msg = message_of(row)?;
        if let Some(id) = &msg.aggregate_id {
            let probe = self
                .q
                .claim
                .probe(&[(msg.aggregate_type.as_str(), id.as_str(), msg.seq)]);
            match tx.query::<Row, _>(probe).await {
                Ok(rows) if rows.is_empty() => {}
                Ok(_) => return Ok(None),
                Err(e) if is_locked(&e) => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        let by = literal(&self.instance_id);
        tx.query_drop(self.q.claim.mark_claimed(&[msg.seq], &by))
            .await?;
        tx.commit().await?;
        msg.attempts += 1;
        Ok(Some(msg))
    }
}

/// Whether `e` is `NOWAIT` meeting a locked row (MySQL 3572, MariaDB 1205).
pub fn is_locked(e: &mysql_async::Error) -> bool {
    matches!(e, mysql_async::Error::Server(s) if s.code == 3572 || s.code == 1205)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_hex() {
        assert_eq!(literal("a'b"), "_utf8mb4 X'612762'");
        assert_eq!(literal(""), "_utf8mb4 X''");
    }

    #[test]
    fn the_probe_reads_each_aggregate_before_its_last_candidate() {
        let q = ClaimSql::new(&TableName::parse("app.events").unwrap_or_else(|e| panic!("{e}")));
        let sql = q.probe(&[("order", "1", 10), ("order", "2", 12)]);
        assert!(
            sql.contains("FROM app.events e FORCE INDEX (events_aggregate_idx)"),
            "{sql}"
        );
        assert!(
            sql.contains("(e.aggregate_type = _utf8mb4 X'6f72646572' AND e.aggregate_id = _utf8mb4 X'32' AND e.seq < 12)"),
            "{sql}"
        );
        assert!(sql.ends_with("FOR UPDATE NOWAIT"), "{sql}");
    }
}
