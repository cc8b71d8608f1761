//! The web console's reads ([`crate::console`]): the status counts the backlog task does not
//! read, a page of dead letters with their payloads, and one message by id. Each is one
//! statement on a partial index or the primary key, bounded however large the table is: the
//! counts of `sent` and `expired` rows stop at a cap instead of scanning a day of retention.
//! The console's retry and discard are the operator commands' ([`Store::retry_dead_letters`],
//! [`Store::discard_dead_letters`]).

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::claim::RawBytes;
use super::operator::dead_letter;
use super::{DeadLetter, PgStore, Result};

/// The largest count the console reads exactly; past it a count shows as "at least".
pub const COUNT_CAP: i64 = 100_000;

/// The counts the backlog gauges do not carry: rows in flight, and (up to [`COUNT_CAP`]) sent
/// and expired rows still kept by retention.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsoleCounts {
    /// Claimed, not yet settled.
    pub processing: i64,
    /// Confirmed and kept (at most [`COUNT_CAP`]).
    pub sent: i64,
    /// Past their deadline and kept (at most [`COUNT_CAP`]).
    pub expired: i64,
}

/// One dead letter as the console lists it: what `dead-letters list` shows, and its payload
/// and headers.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterRow {
    /// The dead letter.
    pub letter: DeadLetter,
    /// The payload's bytes (`None` when the console hides payloads).
    pub payload: Option<Vec<u8>>,
    /// The headers' JSON text (`None` when the console hides payloads).
    pub headers: Option<Vec<u8>>,
}

/// Which page of dead letters the console asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest {
    /// The page, from 0.
    pub page: i64,
    /// Dead letters a page.
    pub per_page: i64,
    /// Whether the rows carry their payloads and headers.
    pub show_payloads: bool,
}

/// A page of dead letters and how many there are.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterPage {
    /// Dead letters in the table (at most [`COUNT_CAP`]).
    pub total: i64,
    /// The page's rows, oldest (lowest `seq`) first.
    pub rows: Vec<DeadLetterRow>,
}

/// One row of any status, as the console's lookup shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageRow {
    /// Row id.
    pub id: Uuid,
    /// Insert order.
    pub seq: i64,
    /// `pending`, `processing`, `sent`, `failed` or `expired`.
    pub status: String,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: String,
    /// Routing override.
    pub destination: Option<String>,
    /// Attempts used.
    pub attempts: i32,
    /// The last failure.
    pub last_error: Option<String>,
    /// Insert time.
    pub created_at: DateTime<Utc>,
    /// Not published before.
    pub available_at: DateTime<Utc>,
    /// When the current claim was taken (processing rows).
    pub locked_at: Option<DateTime<Utc>>,
    /// The relay instance holding the claim.
    pub locked_by: Option<String>,
    /// When the broker confirmed it.
    pub sent_at: Option<DateTime<Utc>>,
    /// Not published after.
    pub expires_at: Option<DateTime<Utc>>,
    /// The payload's bytes (`None` when the console hides payloads).
    pub payload: Option<Vec<u8>>,
    /// The headers' JSON text (`None` when the console hides payloads).
    pub headers: Option<Vec<u8>>,
}

/// The payload and headers columns, or NULLs in their place when they are hidden (they are then
/// never read from the table).
fn payload_columns(show_payloads: bool) -> &'static str {
    if show_payloads {
        "payload AS p, headers AS h"
    } else {
        "NULL::bytea AS p, NULL::bytea AS h"
    }
}

/// Rows in flight (the processing index), and sent and expired rows up to `$1` each (their
/// partial indexes; a scan that stops at the cap).
fn counts_sql(t: &str) -> String {
    format!(
        "SELECT (SELECT count(*) FROM {t} WHERE status = 'processing'), \
           (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'sent' LIMIT $1) s), \
           (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE status = 'expired' LIMIT $1) e)"
    )
}

/// The dead letters' count (up to `$1`) with the page of `$2` rows after skipping `$3`, in
/// `seq` order (the failed index). One row with NULLs after the count when the page is empty.
fn dead_letter_page_sql(t: &str, show_payloads: bool) -> String {
    let payload = payload_columns(show_payloads);
    format!(
        "SELECT n.total, d.id, d.seq, d.aggregate_type, d.aggregate_id, d.event_type, \
           d.attempts, d.last_error, d.created_at, d.available_at, d.p, d.h \
         FROM (SELECT count(*) AS total FROM (SELECT 1 FROM {t} WHERE status = 'failed' LIMIT $1) c) n \
         LEFT JOIN LATERAL ( \
           SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, \
             created_at, available_at, {payload} \
           FROM {t} WHERE status = 'failed' ORDER BY seq LIMIT $2 OFFSET $3) d ON true \
         ORDER BY d.seq"
    )
}

/// One row by id (`$1`; the primary key).
fn message_sql(t: &str, show_payloads: bool) -> String {
    let payload = payload_columns(show_payloads);
    format!(
        "SELECT id, seq, status, aggregate_type, aggregate_id, event_type, destination, attempts, \
           last_error, created_at, available_at, locked_at, locked_by, sent_at, expires_at, {payload} \
         FROM {t} WHERE id = $1"
    )
}

impl PgStore {
    /// Rows in flight, and sent and expired rows (each up to [`COUNT_CAP`]): one statement on
    /// three partial indexes.
    pub async fn console_counts(&self) -> Result<ConsoleCounts> {
        let client = self.client().await?;
        let stmt = client
            .prepare_cached(&counts_sql(&self.table().qualified()))
            .await?;
        let r = client.query_one(&stmt, &[&COUNT_CAP]).await?;
        Ok(ConsoleCounts {
            processing: r.try_get(0)?,
            sent: r.try_get(1)?,
            expired: r.try_get(2)?,
        })
    }

    /// The page of dead letters `asked` for, oldest first, with the number of dead letters (up
    /// to [`COUNT_CAP`]).
    pub async fn dead_letter_page(&self, asked: PageRequest) -> Result<DeadLetterPage> {
        let client = self.client().await?;
        let sql = dead_letter_page_sql(&self.table().qualified(), asked.show_payloads);
        let stmt = client.prepare_cached(&sql).await?;
        let offset = asked.page.saturating_mul(asked.per_page);
        let rows = client
            .query(&stmt, &[&COUNT_CAP, &asked.per_page, &offset])
            .await?;
        let mut out = DeadLetterPage {
            total: 0,
            rows: Vec::with_capacity(rows.len()),
        };
        for r in rows {
            out.total = r.try_get(0)?;
            if r.try_get::<_, Option<Uuid>>(1)?.is_none() {
                continue; // the page is past the last dead letter
            }
            out.rows.push(DeadLetterRow {
                letter: dead_letter(&r, 1)?,
                payload: r.try_get::<_, Option<RawBytes>>(10)?.map(|b| b.0),
                headers: r.try_get::<_, Option<RawBytes>>(11)?.map(|b| b.0),
            });
        }
        Ok(out)
    }

    /// The row with `id`, whatever its status; `None` when the table has none.
    pub async fn console_message(
        &self,
        id: Uuid,
        show_payloads: bool,
    ) -> Result<Option<MessageRow>> {
        let client = self.client().await?;
        let sql = message_sql(&self.table().qualified(), show_payloads);
        let stmt = client.prepare_cached(&sql).await?;
        let Some(r) = client.query_opt(&stmt, &[&id]).await? else {
            return Ok(None);
        };
        Ok(Some(MessageRow {
            id: r.try_get(0)?,
            seq: r.try_get(1)?,
            status: r.try_get(2)?,
            aggregate_type: r.try_get(3)?,
            aggregate_id: r.try_get(4)?,
            event_type: r.try_get(5)?,
            destination: r.try_get(6)?,
            attempts: r.try_get(7)?,
            last_error: r.try_get(8)?,
            created_at: r.try_get(9)?,
            available_at: r.try_get(10)?,
            locked_at: r.try_get(11)?,
            locked_by: r.try_get(12)?,
            sent_at: r.try_get(13)?,
            expires_at: r.try_get(14)?,
            payload: r.try_get::<_, Option<RawBytes>>(15)?.map(|b| b.0),
            headers: r.try_get::<_, Option<RawBytes>>(16)?.map(|b| b.0),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_is_bounded_by_an_index_or_a_cap() {
        let counts = counts_sql("app.events");
        assert!(counts.contains("FROM app.events WHERE status = 'processing'"));
        assert!(counts.contains("WHERE status = 'sent' LIMIT $1"));
        assert!(counts.contains("WHERE status = 'expired' LIMIT $1"));
        let page = dead_letter_page_sql("app.events", true);
        assert!(page.contains("WHERE status = 'failed' LIMIT $1"));
        assert!(page.contains("WHERE status = 'failed' ORDER BY seq LIMIT $2 OFFSET $3"));
        assert!(message_sql("app.events", true).ends_with("FROM app.events WHERE id = $1"));
    }

    #[test]
    fn hidden_payloads_are_never_read() {
        for sql in [dead_letter_page_sql("t", false), message_sql("t", false)] {
            assert!(
                !sql.contains("payload") && !sql.contains("headers"),
                "{sql}"
            );
        }
        assert!(message_sql("t", true).contains("payload AS p, headers AS h"));
    }
}
