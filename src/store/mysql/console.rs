//! MySQL: the web console's bounded reads (counts that stop at [`COUNT_CAP`], a page of dead
//! letters, one message by id), each on an index.

use mysql_async::Row;
use mysql_async::prelude::Queryable;
use uuid::Uuid;

use super::claim::{column, required_time, time_column};
use super::operator::dead_letter;
use super::{MysqlStore, Result, parse_id};
use crate::store::{
    COUNT_CAP, ConsoleCounts, DeadLetterPage, DeadLetterRow, MessageRow, PageRequest,
};

/// The payload and headers columns, or NULLs in their place when they are hidden.
fn payload_columns(show_payloads: bool) -> &'static str {
    if show_payloads {
        "payload, headers"
    } else {
        "NULL, NULL"
    }
}

impl MysqlStore {
    /// Rows in flight, and sent and expired rows (each up to [`COUNT_CAP`]), on the status index.
    pub async fn console_counts(&self) -> Result<ConsoleCounts> {
        let t = self.table.qualified();
        let count = |status: &str| {
            format!(
                "(SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE status = '{status}' LIMIT {COUNT_CAP}) x)"
            )
        };
        let sql = format!(
            "SELECT {}, {}, {}",
            count("processing"),
            count("sent"),
            count("expired")
        );
        let mut conn = self.conn().await?;
        let row: Option<(i64, i64, i64)> = conn.query_first(sql).await?;
        let (processing, sent, expired) = row.unwrap_or_default();
        Ok(ConsoleCounts {
            processing,
            sent,
            expired,
        })
    }

    /// The page of dead letters `asked` for, oldest first, with the number of dead letters (up
    /// to [`COUNT_CAP`]).
    pub async fn dead_letter_page(&self, asked: PageRequest) -> Result<DeadLetterPage> {
        let t = self.table.qualified();
        let mut conn = self.conn().await?;
        let total: Option<i64> = conn
            .query_first(format!(
                "SELECT COUNT(*) FROM (SELECT 1 FROM {t} WHERE status = 'failed' LIMIT {COUNT_CAP}) x"
            ))
            .await?;
        let offset = asked.page.saturating_mul(asked.per_page).max(0);
        let rows: Vec<Row> = conn
            .exec(
                format!(
                    "SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, \
                       last_error, created_at, available_at, {} FROM {t} \
                     WHERE status = 'failed' ORDER BY seq LIMIT ? OFFSET ?",
                    payload_columns(asked.show_payloads)
                ),
                (asked.per_page.max(0), offset),
            )
            .await?;
        let mut out = DeadLetterPage {
            total: total.unwrap_or(0),
            rows: Vec::with_capacity(rows.len()),
        };
        for mut r in rows {
            out.rows.push(DeadLetterRow {
                letter: dead_letter(&mut r)?,
                payload: column(&mut r, 9, "payload")?,
                headers: column(&mut r, 10, "headers")?,
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
        let mut conn = self.conn().await?;
        let row: Option<Row> = conn
            .exec_first(
                format!(
                    "SELECT id, seq, status, aggregate_type, aggregate_id, event_type, destination, \
                       attempts, last_error, created_at, available_at, locked_at, locked_by, \
                       sent_at, expires_at, {} FROM {} WHERE id = ?",
                    payload_columns(show_payloads),
                    self.table.qualified()
                ),
                (id.hyphenated().to_string(),),
            )
            .await?;
        let Some(mut r) = row else {
            return Ok(None);
        };
        let id: String = column(&mut r, 0, "id")?;
        Ok(Some(MessageRow {
            id: parse_id(&id)?,
            seq: column(&mut r, 1, "seq")?,
            status: column(&mut r, 2, "status")?,
            aggregate_type: column(&mut r, 3, "aggregate_type")?,
            aggregate_id: column(&mut r, 4, "aggregate_id")?,
            event_type: column::<Option<String>>(&mut r, 5, "event_type")?.unwrap_or_default(),
            destination: column(&mut r, 6, "destination")?,
            attempts: column(&mut r, 7, "attempts")?,
            last_error: column(&mut r, 8, "last_error")?,
            created_at: required_time(&mut r, 9, "created_at")?,
            available_at: required_time(&mut r, 10, "available_at")?,
            locked_at: time_column(&mut r, 11, "locked_at")?,
            locked_by: column(&mut r, 12, "locked_by")?,
            sent_at: time_column(&mut r, 13, "sent_at")?,
            expires_at: time_column(&mut r, 14, "expires_at")?,
            payload: column(&mut r, 15, "payload")?,
            headers: column(&mut r, 16, "headers")?,
        }))
    }
}
