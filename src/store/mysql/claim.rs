//! Claiming on MySQL: the claim by ordering mode, a suspect on its own, and the expiry sweep
//! run before them, each one short transaction that commits before anything is published.
//!
//! The ordering guard (`ordering = "aggregate"`) rests on one fact of InnoDB: a row inserted by
//! a transaction that has not committed yet is a locked index record, so a locking read that
//! meets it with `NOWAIT` fails at once instead of passing it by. A candidate is claimed only
//! when no row of its aggregate before it is open (pending, in flight or dead) or uncommitted,
//! whatever else is running; a transaction on another table never holds an aggregate back, and
//! the guard waits for no one. It takes two reads after the candidates are locked:
//! - the gate: every pending row before the last candidate, locked with `NOWAIT`. When it
//!   passes, no uncommitted insert lies before any candidate;
//! - the open rows before the last candidate (read, not locked): each aggregate is held back
//!   from its first open row that is not a candidate.
//!
//! Where the gate meets a locked row (an insert still open, another relay claiming, a settle
//! writing), the guard falls back to probing each candidate aggregate's own open rows before
//! its last candidate, halving the set around locked rows so that only the aggregates whose
//! rows are locked wait.

use std::collections::{HashMap, HashSet};

use mysql_async::prelude::{FromValue, Queryable};
use mysql_async::{Conn, Row, Transaction, TxOpts};

use super::claim_lock::ClaimLockSql;
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

/// At most this many aggregates in flight are read before an ordered claim's probe (the probe
/// covers any beyond them).
const BUSY_CAP: usize = 10_000;

/// At most this many open rows before an ordered claim's last candidate are read after the
/// gate; past it the claim probes its aggregates instead.
const OPEN_CAP: usize = 20_000;

/// The expiry sweep looks this many scan windows past the first pending row: a row further on
/// is expired once the queue reaches it (no claim publishes it past its deadline either way).
/// The table has no index on the deadline (one more for every insert to write), so a sweep
/// over every pending row would read a whole backlog every two seconds.
const SWEEP_WINDOWS: i64 = 16;

/// At most this many windows of ready rows are read in one ordered claim.
const MAX_WINDOWS: usize = 4;

/// At most this many held-back aggregates are left out of each window after the first.
const SKIP_CAP: usize = 16;

/// The statements of claiming, rendered once for the table.
#[derive(Debug)]
pub(super) struct ClaimSql {
    t: String,
    /// The `(aggregate_type, aggregate_id, status, seq)` index's name.
    aggregate_idx: String,
    /// Ready rows in `seq` order, locked (`?` limit): ordering `none` takes them all.
    ready_rows: String,
    /// `ready_rows` up to its `ORDER BY`, for an ordered claim's windows after the first.
    rows_from: String,
    /// The gate: pending rows before `?`, locked without waiting.
    gate: String,
    /// The open rows before `?` (read, not locked), at most [`OPEN_CAP`] + 1.
    open: String,
    /// The aggregates with a row in flight (read, not locked): their candidates wait unprobed.
    busy: String,
    /// Whether a suspect is ready.
    suspects_waiting: String,
    /// The oldest ready suspect, locked.
    suspect: String,
    /// The first pending row's seq (an index dive): where the expiry sweep starts.
    first_pending: String,
    /// Pending rows past their deadline before `?` in `seq` order, locked (`?` limit).
    due: String,
}

impl ClaimSql {
    pub(super) fn new(table: &TableName) -> Self {
        let t = table.qualified();
        // Forced: a locking read locks every row it reads, and the gate must read the pending
        // rows before the candidates and nothing else.
        let status_idx = format!("{}_status_idx", table.name);
        let ready = "status = 'pending' AND sent_at IS NULL AND available_at <= NOW(6) \
                     AND (expires_at IS NULL OR expires_at > NOW(6))";
        let not_suspect = format!("(last_error IS NULL OR last_error NOT LIKE '{SUSPECT}%')");
        let suspect = format!("last_error LIKE '{SUSPECT}%'");
        Self {
            ready_rows: format!(
                "SELECT {COLUMNS} FROM {t} WHERE {ready} AND {not_suspect} \
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            rows_from: format!("SELECT {COLUMNS} FROM {t} WHERE {ready} AND {not_suspect}"),
            gate: format!(
                "SELECT seq FROM {t} FORCE INDEX ({status_idx}) \
                 WHERE status = 'pending' AND seq < ? FOR UPDATE NOWAIT"
            ),
            open: format!(
                "SELECT seq, aggregate_type, aggregate_id FROM {t} FORCE INDEX ({status_idx}) \
                 WHERE status IN ('pending', 'processing', 'failed') AND seq < ? \
                 AND aggregate_id IS NOT NULL LIMIT {}",
                OPEN_CAP + 1
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
            first_pending: format!("SELECT MIN(seq) FROM {t} WHERE status = 'pending'"),
            due: format!(
                "SELECT seq, id, aggregate_type FROM {t} FORCE INDEX ({status_idx}) \
                 WHERE status = 'pending' AND seq < ? AND expires_at <= NOW(6) \
                 ORDER BY seq LIMIT ? FOR UPDATE SKIP LOCKED"
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

    /// Makes each `(seq, why)` of `unreadable` (rows this claim read and locked, but cannot
    /// read) a dead letter at once, `last_error` saying why: no attempt could ever publish
    /// it, and it must not stop the rows around it. A dead letter holds back the rest of its
    /// aggregate, as any does. Returns how many.
    async fn dead_letter(
        &self,
        tx: &mut Transaction<'_>,
        unreadable: &[(i64, String)],
    ) -> Result<usize> {
        for (seq, why) in unreadable {
            tracing::warn!(seq, error = %why, "a row the relay cannot read is dead-lettered; fix or delete it, then `outbox-relay dead-letters retry`");
            tx.query_drop(self.unreadable(*seq, why)).await?;
        }
        Ok(unreadable.len())
    }

    /// The statement [`ClaimSql::dead_letter`] runs for one row.
    fn unreadable(&self, seq: i64, why: &str) -> String {
        let error = literal(&format!("the relay cannot read this row: {why}"));
        format!(
            "UPDATE {} SET status = 'failed', locked_by = NULL, locked_at = NULL, \
             last_error = {error} WHERE seq = {seq}",
            self.t
        )
    }

    /// The next window of an ordered claim: up to `scan` ready rows after `after`,
    /// leaving out the aggregates `skip` (held back in the windows before), locked.
    fn rows_after(&self, after: i64, skip: &[(String, String)], scan: i64) -> String {
        let skip = if skip.is_empty() {
            String::new()
        } else {
            let pairs = skip
                .iter()
                .map(|(ty, id)| format!("({}, {})", literal(ty), literal(id)))
                .collect::<Vec<_>>()
                .join(", ");
            format!(
                " AND (aggregate_id IS NULL OR (aggregate_type, aggregate_id) NOT IN ({pairs}))"
            )
        };
        format!(
            "{} AND seq > {after}{skip} ORDER BY seq LIMIT {scan} FOR UPDATE SKIP LOCKED",
            self.rows_from
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
            "SELECT e.seq, e.aggregate_type, e.aggregate_id FROM {} e FORCE INDEX ({}) \
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
            (
                "claim.rows_after",
                self.rows_after(625, &[("order".to_owned(), "42".to_owned())], 625),
            ),
            ("claim.gate", self.gate.clone()),
            ("claim.open", self.open.clone()),
            ("claim.busy", self.busy.clone()),
            (
                "claim.probe",
                self.probe(&[("order", "42", 8), ("invoice", "7", 9)]),
            ),
            (
                "claim.unreadable",
                self.unreadable(7, "column headers is NULL"),
            ),
            (
                "claim.mark_claimed",
                self.mark_claimed(seqs, &literal("relay-1")),
            ),
            ("claim.suspects_waiting", self.suspects_waiting.clone()),
            ("claim.suspect", self.suspect.clone()),
            ("claim.first_pending", self.first_pending.clone()),
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

/// The relay's claim on a MySQL outbox, as the relay runs it, for tools that replay it outside
/// the relay (the benchmark's bare MariaDB client). A claim is one transaction: with ordering
/// `none`, [`HotPathSql::claim_none`] then [`HotPathSql::mark_claimed`]; with ordering
/// `aggregate`, [`HotPathSql::claim_ordered`] (the candidates, the guard, mark claimed and the
/// rows taken, as the relay's own claim runs them).
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

    /// Marks `seqs` claimed by `instance`.
    pub fn mark_claimed(&self, seqs: &[i64], instance: &str) -> String {
        self.claim.mark_claimed(seqs, &literal(instance))
    }

    /// The relay's ordered claim of up to `limit` rows inside `tx`, marked claimed by
    /// `instance`: the rows taken, and how the ordering guard decided.
    pub async fn claim_ordered(
        &self,
        tx: &mut Transaction<'_>,
        limit: usize,
        instance: &str,
    ) -> Result<(Vec<OutboxMessage>, Guarded)> {
        self.claim.take_ordered(tx, limit, &literal(instance)).await
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

/// Column `i` of `row` as a point in time (UTC), or `None` for NULL. MySQL's zero date
/// (`0000-00-00`, which a server without `NO_ZERO_DATE` stores as written) is no date: it reads
/// as the Unix epoch, the earliest time there is, as the server's comparisons order it.
pub(super) fn time_column(
    row: &mut Row,
    i: usize,
    name: &str,
) -> Result<Option<chrono::DateTime<chrono::Utc>>> {
    match column::<mysql_async::Value>(row, i, name)? {
        mysql_async::Value::NULL => Ok(None),
        mysql_async::Value::Date(_, 0, ..) | mysql_async::Value::Date(_, _, 0, ..) => {
            Ok(Some(chrono::DateTime::UNIX_EPOCH))
        }
        // The same from a statement sent as text: `YYYY-MM-DD…` with a zero month or day.
        mysql_async::Value::Bytes(text)
            if text.get(4) == Some(&b'-')
                && (text.get(5..7) == Some(b"00") || text.get(8..10) == Some(b"00")) =>
        {
            Ok(Some(chrono::DateTime::UNIX_EPOCH))
        }
        value => chrono::NaiveDateTime::from_value_opt(value)
            .map(|t| Some(utc(t)))
            .map_err(|e| {
                StoreError::Schema(format!(
                    "column {name} holds a value the relay cannot read: {e}"
                ))
            }),
    }
}

/// Column `i` of `row` as a point in time that may not be NULL (see [`time_column`]).
pub(super) fn required_time(
    row: &mut Row,
    i: usize,
    name: &str,
) -> Result<chrono::DateTime<chrono::Utc>> {
    time_column(row, i, name)?.ok_or_else(|| StoreError::Schema(format!("column {name} is NULL")))
}

/// A row in [`COLUMNS`] order. NULL `headers` (a table that lets them be) are no headers.
fn message_of(mut r: Row) -> Result<OutboxMessage> {
    let id: String = column(&mut r, 1, "id")?;
    Ok(OutboxMessage {
        id: parse_id(&id)?,
        seq: column(&mut r, 0, "seq")?,
        aggregate_type: column(&mut r, 2, "aggregate_type")?,
        aggregate_id: column(&mut r, 3, "aggregate_id")?,
        event_type: column(&mut r, 4, "event_type")?,
        payload: column(&mut r, 5, "payload")?,
        headers: column::<Option<Vec<u8>>>(&mut r, 6, "headers")?.unwrap_or_else(|| b"{}".to_vec()),
        destination: column(&mut r, 7, "destination")?,
        attempts: column(&mut r, 8, "attempts")?,
        created_at: required_time(&mut r, 9, "created_at")?,
        expires_at: time_column(&mut r, 10, "expires_at")?,
        traceparent: None,
    })
}

/// Rows a claim read but cannot take: each one's `seq`, and why.
type Unreadable = Vec<(i64, String)>;

/// The rows of a claim's read (in [`COLUMNS`] order) the relay can read, and for each one it
/// cannot (a value no transport could carry, or a NULL where it needs a value) its `seq` and
/// why. Only an unreadable `seq` fails the whole read.
fn readable(rows: Vec<Row>) -> Result<(Vec<OutboxMessage>, Unreadable)> {
    let mut ok = Vec::with_capacity(rows.len());
    let mut bad = Vec::new();
    for r in rows {
        // Read, not taken: `message_of` takes it again.
        let seq: i64 = match r.get_opt::<i64, usize>(0) {
            Some(Ok(seq)) => seq,
            _ => return Err(StoreError::Schema("column seq is unreadable".into())),
        };
        match message_of(r) {
            Ok(m) => ok.push(m),
            Err(e) => bad.push((seq, e.to_string())),
        }
    }
    Ok((ok, bad))
}

/// An ordered claim's candidate: the row, and its aggregate as a key.
struct Candidate {
    aggregate: Option<(String, String)>,
    row: OutboxMessage,
}

/// A ready row as a candidate.
fn candidate_of(row: OutboxMessage) -> Candidate {
    Candidate {
        aggregate: row
            .aggregate_id
            .as_ref()
            .map(|id| (row.aggregate_type.clone(), id.clone())),
        row,
    }
}

/// Each aggregate that holds candidates back, and the seq from which it does.
type HeldBack = HashMap<(String, String), i64>;

/// How an ordered claim's guard decided, for the benchmark's tally.
#[derive(Debug, Default, Clone, Copy)]
pub struct Guarded {
    /// Candidates read (ready rows in the scan windows).
    pub candidates: usize,
    /// Scan windows read.
    pub windows: usize,
    /// Whether the last guard passed the gate (else it probed the candidates' aggregates).
    pub gate_passed: bool,
    /// Probe statements run.
    pub probes: usize,
    /// Probes that met a locked row.
    pub locked: usize,
    /// Rows read that the relay cannot read, made dead letters ([`ClaimSql::dead_letter`]).
    pub unreadable: usize,
}

/// Open rows as the gate's open read and the probe return them: seq, aggregate type, id.
fn open_rows(rows: Vec<Row>) -> Result<Vec<(i64, String, String)>> {
    rows.into_iter()
        .map(|mut r| {
            Ok((
                column(&mut r, 0, "seq")?,
                column(&mut r, 1, "aggregate_type")?,
                column(&mut r, 2, "aggregate_id")?,
            ))
        })
        .collect()
}

/// Holds each aggregate of `open` back from its first row that is not one of the candidates
/// (`mine`).
fn hold_back(
    held: &mut HeldBack,
    mine: &HashSet<i64>,
    open: impl IntoIterator<Item = (i64, String, String)>,
) {
    for (seq, ty, id) in open {
        if !mine.contains(&seq) {
            let from = held.entry((ty, id)).or_insert(seq);
            *from = (*from).min(seq);
        }
    }
}

/// Each aggregate's first and last candidate.
fn spans(candidates: &[Candidate]) -> HashMap<&(String, String), (i64, i64)> {
    let mut span: HashMap<&(String, String), (i64, i64)> = HashMap::new();
    for c in candidates {
        if let Some(key) = &c.aggregate {
            span.entry(key).or_insert((c.row.seq, c.row.seq)).1 = c.row.seq;
        }
    }
    span
}

/// Up to `cap` aggregates held back in `held` and not yet `skipped`, those with the most
/// `candidates` first.
fn most_held<'c>(
    candidates: &'c [Candidate],
    held: &HeldBack,
    skipped: &[(String, String)],
    cap: usize,
) -> Vec<&'c (String, String)> {
    let mut count: HashMap<&(String, String), usize> = HashMap::new();
    for c in candidates {
        if let Some(key) = &c.aggregate
            && held.contains_key(key)
            && !skipped.contains(key)
        {
            *count.entry(key).or_default() += 1;
        }
    }
    let mut most: Vec<_> = count.into_iter().collect();
    most.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    most.into_iter().take(cap).map(|(key, _)| key).collect()
}

/// The candidates an ordered claim takes: in `seq` order, up to `limit`, each whose aggregate
/// is not held back at or before it.
fn free_of(candidates: &[Candidate], held: &HeldBack, limit: usize) -> Vec<i64> {
    candidates
        .iter()
        .filter(|c| match &c.aggregate {
            None => true,
            Some(key) => held.get(key).is_none_or(|&from| c.row.seq < from),
        })
        .map(|c| c.row.seq)
        .take(limit)
        .collect()
}

impl ClaimSql {
    /// The ordered claim inside `tx`: the candidates, window by window, each followed by the
    /// guard over all of them, until `limit` of them are free, the ready rows run out or
    /// [`MAX_WINDOWS`] were read; then the free ones marked claimed in the name `by` (an SQL
    /// literal, [`literal`]) and read; with how the guard decided.
    ///
    /// A window after the first starts after the last and leaves out the aggregates held back
    /// with the most candidates, so rows behind a head that cannot go out yet (backing off,
    /// reclaimed, in flight) hold back no other aggregate's rows further on.
    async fn take_ordered(
        &self,
        tx: &mut Transaction<'_>,
        limit: usize,
        by: &str,
    ) -> Result<(Vec<OutboxMessage>, Guarded)> {
        let scan = scan_window(i64::try_from(limit).unwrap_or(i64::MAX));
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut guarded = Guarded::default();
        let mut skip: Vec<(String, String)> = Vec::new();
        let taken = loop {
            let window: Vec<Row> = match candidates.last() {
                None => tx.exec(&self.ready_rows, (scan,)).await?,
                Some(last) => tx.query(self.rows_after(last.row.seq, &skip, scan)).await?,
            };
            let full = i64::try_from(window.len()).unwrap_or(i64::MAX) >= scan;
            let (window, unreadable) = readable(window)?;
            guarded.unreadable += self.dead_letter(tx, &unreadable).await?;
            candidates.extend(window.into_iter().map(candidate_of));
            guarded.windows += 1;
            let held = self.guard(tx, &candidates, &mut guarded).await?;
            let taken = free_of(&candidates, &held, limit);
            if taken.len() >= limit || !full || guarded.windows >= MAX_WINDOWS {
                break taken;
            }
            let more = most_held(&candidates, &held, &skip, SKIP_CAP);
            let more: Vec<(String, String)> = more.into_iter().cloned().collect();
            skip.extend(more);
        };
        guarded.candidates = candidates.len();
        if taken.is_empty() {
            return Ok((Vec::new(), guarded));
        }
        tx.query_drop(self.mark_claimed(&taken, by)).await?;
        let taken: HashSet<i64> = taken.into_iter().collect();
        let rows = candidates
            .into_iter()
            .filter(|c| taken.contains(&c.row.seq))
            .map(|c| OutboxMessage {
                attempts: c.row.attempts + 1,
                ..c.row
            })
            .collect();
        Ok((rows, guarded))
    }

    /// The ordering guard over `candidates`: which aggregates hold which of them back, by the
    /// gate where it passes, else by the probe.
    async fn guard(
        &self,
        tx: &mut Transaction<'_>,
        candidates: &[Candidate],
        guarded: &mut Guarded,
    ) -> Result<HeldBack> {
        let last = candidates
            .iter()
            .filter(|c| c.aggregate.is_some())
            .map(|c| c.row.seq)
            .max();
        let Some(last) = last else {
            return Ok(HeldBack::new());
        };
        let mine: HashSet<i64> = candidates.iter().map(|c| c.row.seq).collect();
        match self.gated(tx, &mine, last).await? {
            Some(held) => {
                guarded.gate_passed = true;
                Ok(held)
            }
            None => {
                guarded.gate_passed = false;
                self.probed(tx, candidates, &mine, guarded).await
            }
        }
    }

    /// The guard by gate: the pending rows before `last` locked without waiting, then the
    /// open rows before it read. `None` when the gate met a locked row or the open rows passed
    /// [`OPEN_CAP`]: the aggregates must be probed.
    ///
    /// The open rows are read after the gate, so a row before a candidate that changes state
    /// between the two (claimed, handed back, dead-lettered) is seen open either way; one that
    /// was sent is no longer in the way.
    async fn gated(
        &self,
        tx: &mut Transaction<'_>,
        mine: &HashSet<i64>,
        last: i64,
    ) -> Result<Option<HeldBack>> {
        match tx.exec_drop(&self.gate, (last,)).await {
            Ok(()) => {}
            Err(e) if is_locked(&e) => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let rows: Vec<Row> = tx.exec(&self.open, (last,)).await?;
        if rows.len() > OPEN_CAP {
            return Ok(None);
        }
        let mut held = HeldBack::new();
        hold_back(&mut held, mine, open_rows(rows)?);
        Ok(Some(held))
    }

    /// The aggregates with a row in flight (read, not locked).
    async fn busy(&self, tx: &mut Transaction<'_>) -> Result<HashSet<(String, String)>> {
        let rows: Vec<Row> = tx.query(&self.busy).await?;
        let mut busy = HashSet::with_capacity(rows.len());
        for mut r in rows {
            busy.insert((
                column::<String>(&mut r, 0, "aggregate_type")?,
                column::<String>(&mut r, 1, "aggregate_id")?,
            ));
        }
        Ok(busy)
    }

    /// The guard by probe: each aggregate among `candidates` held back from its first
    /// candidate when it is busy (a row of it in flight) or when the probe could not read its
    /// rows (one of them is locked), else from its first open row before its last candidate
    /// that is not a candidate itself. Only the aggregates not busy are probed: fewer ranges,
    /// and no row a concurrent settle is writing to make the probe fail.
    async fn probed(
        &self,
        tx: &mut Transaction<'_>,
        candidates: &[Candidate],
        mine: &HashSet<i64>,
        guarded: &mut Guarded,
    ) -> Result<HeldBack> {
        let busy_keys = self.busy(tx).await?;
        // The busy aggregates are held back from their first candidate, unprobed.
        let span = spans(candidates);
        let mut held = HeldBack::new();
        let mut heads = Vec::with_capacity(span.len());
        for (key, &(first, last)) in &span {
            if busy_keys.contains(*key) {
                held.insert((*key).clone(), first);
            } else {
                heads.push((key.0.as_str(), key.1.as_str(), last));
            }
        }
        heads.sort_unstable_by_key(|h| h.2);
        // Probe all aggregates at once; where that meets a locked row, halve the set until
        // each locked aggregate stands alone (and is held back from its first candidate).
        let mut work = vec![heads.as_slice()];
        while let Some(part) = work.pop() {
            if part.is_empty() {
                continue;
            }
            guarded.probes += 1;
            match tx.query::<Row, _>(self.probe(part)).await {
                Ok(rows) => hold_back(&mut held, mine, open_rows(rows)?),
                Err(e) if is_locked(&e) => {
                    guarded.locked += 1;
                    if let [(ty, id, _)] = part {
                        let key = ((*ty).to_owned(), (*id).to_owned());
                        let first = span.get(&key).map_or(i64::MIN, |s| s.0);
                        held.insert(key, first);
                    } else {
                        let (a, b) = part.split_at(part.len() / 2);
                        work.push(a);
                        work.push(b);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(held)
    }
}

impl MysqlStore {
    /// Expires pending rows past their deadline (up to `limit`, as `sweep` says), then claims
    /// up to `limit` ready rows in one transaction; with [`Ordering::Aggregate`], only rows
    /// whose aggregate has no open row before them but rows claimed with them, under the
    /// table's claim lock (see `claim_lock`): nothing is claimed this round when another
    /// relay's claims kept it too long ([`Claim::contended`]).
    pub async fn claim_and_expire(
        &self,
        ordering: Ordering,
        limit: usize,
        sweep: ExpirySweep,
    ) -> Result<Claim> {
        let mut conn = self.conn().await?;
        if ordering == Ordering::None {
            return self.claim_on(&mut conn, ordering, limit, sweep).await;
        }
        let Some(mut lock) = self.q.claim_lock.take(conn, self.query_timeout).await? else {
            tracing::debug!(table = %self.table, "another relay's claims held the table's claim lock; nothing claimed this round");
            // Claiming again at once is the point only after a wait: without one (a
            // `query_timeout` under 2 s) the loop would ask again without a pause.
            let waited = ClaimLockSql::wait_secs(self.query_timeout) > 0;
            return Ok(Claim {
                contended: waited,
                ..Claim::default()
            });
        };
        let claim = match lock.conn() {
            Some(conn) => self.claim_on(conn, ordering, limit, sweep).await,
            None => Ok(Claim::default()),
        };
        lock.give_back().await;
        claim
    }

    /// [`MysqlStore::claim_and_expire`]'s transaction, on `conn`.
    async fn claim_on(
        &self,
        conn: &mut Conn,
        ordering: Ordering,
        limit: usize,
        sweep: ExpirySweep,
    ) -> Result<Claim> {
        let mut tx = conn.start_transaction(TxOpts::default()).await?;
        let expired = match sweep {
            ExpirySweep::Skip => Vec::new(),
            sweep => self.sweep(&mut tx, sweep, limit).await?,
        };
        let limit_i = i64::try_from(limit).unwrap_or(i64::MAX);
        let (rows, unreadable) = match ordering {
            Ordering::None => {
                let rows: Vec<Row> = tx.exec(&self.q.claim.ready_rows, (limit_i,)).await?;
                let (mut rows, unreadable) = readable(rows)?;
                let unreadable = self.q.claim.dead_letter(&mut tx, &unreadable).await?;
                let seqs: Vec<i64> = rows.iter().map(|r| r.seq).collect();
                if !seqs.is_empty() {
                    let by = literal(&self.instance_id);
                    tx.query_drop(self.q.claim.mark_claimed(&seqs, &by)).await?;
                }
                for r in &mut rows {
                    r.attempts += 1;
                }
                (rows, unreadable)
            }
            Ordering::Aggregate => self.claim_ordered(&mut tx, limit).await?,
        };
        tx.commit().await?;
        Ok(Claim {
            more: rows.len() + unreadable >= limit,
            rows,
            expired,
            uneven: false,
            answer_lost: false,
            unreadable,
            contended: false,
        })
    }

    /// The ordered claim inside `tx` (see [`ClaimSql::take_ordered`]): the rows, and how many
    /// it made dead letters because it could not read them.
    async fn claim_ordered(
        &self,
        tx: &mut Transaction<'_>,
        limit: usize,
    ) -> Result<(Vec<OutboxMessage>, usize)> {
        let by = literal(&self.instance_id);
        let (rows, g) = self.q.claim.take_ordered(tx, limit, &by).await?;
        tracing::debug!(
            candidates = g.candidates,
            windows = g.windows,
            taken = rows.len(),
            gate_passed = g.gate_passed,
            probes = g.probes,
            probes_locked = g.locked,
            "ordered claim"
        );
        Ok((rows, g.unreadable))
    }

    /// The expiry sweep inside `tx`: rows past their deadline among the first pending ones
    /// ([`SWEEP_WINDOWS`]) become `expired` (or are deleted), and are returned for the metrics.
    async fn sweep(
        &self,
        tx: &mut Transaction<'_>,
        sweep: ExpirySweep,
        limit: usize,
    ) -> Result<Vec<Expired>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let first: Option<Option<i64>> = tx.query_first(&self.q.claim.first_pending).await?;
        let Some(first) = first.flatten() else {
            return Ok(Vec::new());
        };
        let reach = first.saturating_add(scan_window(limit).saturating_mul(SWEEP_WINDOWS));
        let rows: Vec<Row> = tx.exec(&self.q.claim.due, (reach, limit)).await?;
        let mut seqs = Vec::with_capacity(rows.len());
        let mut expired = Vec::with_capacity(rows.len());
        for mut r in rows {
            seqs.push(column::<i64>(&mut r, 0, "seq")?);
            let id: String = column(&mut r, 1, "id")?;
            expired.push(Expired {
                // For the log only: an id that is no UUID (a table without the shipped
                // CHECK) must not stop the sweep.
                id: parse_id(&id).unwrap_or_default(),
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
        let (read, unreadable) = readable(vec![row])?;
        let Some(mut msg) = read.into_iter().next() else {
            self.q.claim.dead_letter(&mut tx, &unreadable).await?;
            tx.commit().await?;
            return Ok(None);
        };
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

    fn candidate(seq: i64, aggregate: Option<&str>) -> Candidate {
        Candidate {
            aggregate: aggregate.map(|id| ("order".to_owned(), id.to_owned())),
            row: OutboxMessage {
                id: uuid::Uuid::nil(),
                seq,
                aggregate_type: "order".to_owned(),
                aggregate_id: aggregate.map(str::to_owned),
                event_type: "order.changed".to_owned(),
                payload: b"{}".to_vec(),
                headers: b"{}".to_vec(),
                destination: None,
                attempts: 0,
                created_at: chrono::Utc::now(),
                expires_at: None,
                traceparent: None,
            },
        }
    }

    fn open(rows: &[(i64, &str)]) -> Vec<(i64, String, String)> {
        rows.iter()
            .map(|&(seq, id)| (seq, "order".to_owned(), id.to_owned()))
            .collect()
    }

    #[test]
    fn an_aggregate_is_held_back_from_its_first_open_row_that_is_not_a_candidate() {
        let candidates = [
            candidate(10, Some("a")),
            candidate(11, Some("b")),
            candidate(12, Some("a")),
            candidate(13, None),
            candidate(16, Some("b")),
        ];
        let mine = candidates.iter().map(|c| c.row.seq).collect();
        let mut held = HeldBack::new();
        // a: nothing open but its candidates; b: 15 is open and not a candidate (backing off,
        // say), 20 is in flight.
        hold_back(
            &mut held,
            &mine,
            open(&[
                (10, "a"),
                (12, "a"),
                (11, "b"),
                (15, "b"),
                (16, "b"),
                (20, "b"),
            ]),
        );
        assert_eq!(held.get(&("order".into(), "b".into())), Some(&15));
        assert_eq!(held.get(&("order".into(), "a".into())), None);
        assert_eq!(free_of(&candidates, &held, 10), vec![10, 11, 12, 13]);
        assert_eq!(free_of(&candidates, &held, 2), vec![10, 11]);
    }

    #[test]
    fn a_held_aggregate_keeps_every_candidate_from_its_seq_on() {
        let candidates = [candidate(5, Some("a")), candidate(6, Some("a"))];
        let mut held = HeldBack::new();
        held.insert(("order".into(), "a".into()), 5);
        assert!(free_of(&candidates, &held, 10).is_empty());
        held.insert(("order".into(), "a".into()), 6);
        assert_eq!(free_of(&candidates, &held, 10), vec![5]);
    }

    #[test]
    fn each_further_window_leaves_out_the_most_held_aggregates_not_left_out_yet() {
        let candidates = [
            candidate(1, Some("a")),
            candidate(2, Some("a")),
            candidate(3, Some("a")),
            candidate(4, Some("b")),
            candidate(5, Some("b")),
            candidate(6, Some("c")),
            candidate(7, Some("free")),
        ];
        let held: HeldBack = ["a", "b", "c"]
            .iter()
            .map(|id| (("order".to_owned(), (*id).to_owned()), 0))
            .collect();
        let key = |id: &str| ("order".to_owned(), id.to_owned());
        let most = most_held(&candidates, &held, &[], 2);
        assert_eq!(most, vec![&key("a"), &key("b")]);
        let next = most_held(&candidates, &held, &[key("a"), key("b")], 2);
        assert_eq!(
            next,
            vec![&key("c")],
            "a and b are left out already; free is not held"
        );
    }
}
