//! One claim round, as the relay loop asks for it and as every store answers it: the request
//! (ordering, limit, watermark, expiry sweep, parts) and what came back (rows, expired rows,
//! and what the loop does next). The statements are each store's own (`postgres::claim`,
//! `mysql::claim`).

use uuid::Uuid;

use crate::config::Ordering;
use crate::message::OutboxMessage;

/// A row that passed its deadline before it could be published (see [`super::Store::claim_and_expire`]).
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

/// What one claim round asks of the store.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest {
    /// `relay.ordering`.
    pub ordering: Ordering,
    /// At most this many rows.
    pub limit: usize,
    /// With ordering `aggregate` on PostgreSQL, the highest `seq` of a row with an aggregate
    /// that may be claimed (the ordering guard's watermark); a MySQL claim checks each
    /// aggregate's earlier rows itself.
    pub watermark: i64,
    /// Whether pending rows past their deadline are expired first.
    pub sweep: ExpirySweep,
    /// Into how many parts run at once the claim may be split (PostgreSQL).
    pub parts: usize,
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
    /// A part of a split claim (or an ordered claim's second statement, after a lost race)
    /// failed while other statements claimed rows: the failed one may have committed before
    /// its answer was lost (see [`super::Store::hand_back_unheld`]).
    pub answer_lost: bool,
    /// MySQL: rows the claim read but could not (a value no transport could carry), made
    /// dead letters at once. Always 0 on PostgreSQL, whose column types the schema check
    /// holds to.
    pub unreadable: usize,
    /// MySQL: another relay's claims held the table's claim lock for as long as this claim
    /// waited, so it neither claimed nor swept; the loop claims again at once. Always false
    /// on PostgreSQL.
    pub contended: bool,
}
