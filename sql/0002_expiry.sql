-- outbox-relay schema, version 2: messages that expire.
--
-- A row whose expires_at has passed when the relay would claim it is never published: it
-- becomes 'expired' (terminal, last_error says when) and no longer holds back the later rows
-- of its aggregate. Applied in place to a version-1 table, with rows pending and in flight,
-- without holding up the application's inserts: every statement is idempotent, adding a
-- nullable column without a default rewrites nothing, the widened check is validated apart
-- from the statements that lock the table, and the indexes are built CONCURRENTLY.
--
-- CREATE/DROP INDEX CONCURRENTLY cannot run inside a transaction block: apply this file in
-- autocommit mode (`psql -f` does), not in a migration tool's one transaction. A concurrent
-- build that is interrupted leaves an INVALID index behind, which IF NOT EXISTS then skips:
-- drop it (DROP INDEX CONCURRENTLY) and apply the file again. `outbox-relay migrate` runs each
-- index statement on its own outside a transaction, the other statements in short
-- transactions, and drops such an index itself.

ALTER TABLE outbox_messages ADD COLUMN IF NOT EXISTS expires_at timestamptz NULL;

-- Widen the status check (version 1's inline CHECK, which PostgreSQL names
-- <table>_status_check). Added NOT VALID (a moment's lock, nothing read), then validated in
-- a transaction of its own: validating reads every row, under a lock that lets inserts through.
ALTER TABLE outbox_messages DROP CONSTRAINT IF EXISTS outbox_messages_status_check;
ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_status_check
    CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'expired')) NOT VALID;
ALTER TABLE outbox_messages VALIDATE CONSTRAINT outbox_messages_status_check;

-- Per-aggregate ordering looks at the earlier rows of an aggregate that are still open
-- (neither sent nor expired): this replaces version 1's aggregate index, which kept expired
-- rows and so would make every ordering check step over them.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_open_idx
    ON outbox_messages (aggregate_type, aggregate_id, seq) WHERE status NOT IN ('sent', 'expired');
DROP INDEX CONCURRENTLY IF EXISTS outbox_messages_aggregate_idx;
-- Pending rows with a deadline, by deadline: the relay's expiry sweep before each claim reads
-- only this index, empty when no row sets expires_at.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_expiry_idx
    ON outbox_messages (expires_at) WHERE status = 'pending' AND expires_at IS NOT NULL;
-- Retention cleanup of expired rows (kept for cleanup.retention after their deadline).
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_expired_idx
    ON outbox_messages (expires_at) WHERE status = 'expired';
