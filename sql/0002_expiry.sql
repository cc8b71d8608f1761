-- outbox-relay schema, version 2: messages that expire.
--
-- A row whose expires_at has passed when the relay would claim it is never published: it
-- becomes 'expired' (terminal, last_error says when) and no longer holds back the later rows
-- of its aggregate. Applied in place to a version-1 table, with rows pending and in flight:
-- every statement is idempotent, adding a nullable column without a default rewrites nothing,
-- and the index builds read only the rows their predicates keep.

ALTER TABLE outbox_messages ADD COLUMN IF NOT EXISTS expires_at timestamptz NULL;

-- Widen the status check (version 1's inline CHECK, which PostgreSQL names
-- <table>_status_check). Added NOT VALID, then validated: validating re-reads the table but
-- only every row's status, which the narrower version-1 check already vouched for.
ALTER TABLE outbox_messages DROP CONSTRAINT IF EXISTS outbox_messages_status_check;
ALTER TABLE outbox_messages ADD CONSTRAINT outbox_messages_status_check
    CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'expired')) NOT VALID;
ALTER TABLE outbox_messages VALIDATE CONSTRAINT outbox_messages_status_check;

-- Per-aggregate ordering looks at the earlier rows of an aggregate that are still open
-- (neither sent nor expired): this replaces version 1's aggregate index, which kept expired
-- rows and so would make every ordering check step over them.
CREATE INDEX IF NOT EXISTS outbox_messages_open_idx
    ON outbox_messages (aggregate_type, aggregate_id, seq) WHERE status NOT IN ('sent', 'expired');
DROP INDEX IF EXISTS outbox_messages_aggregate_idx;
-- Pending rows with a deadline, by deadline: the relay's expiry sweep before each claim reads
-- only this index, empty when no row sets expires_at.
CREATE INDEX IF NOT EXISTS outbox_messages_expiry_idx
    ON outbox_messages (expires_at) WHERE status = 'pending' AND expires_at IS NOT NULL;
-- Retention cleanup of expired rows (kept for cleanup.retention after their deadline).
CREATE INDEX IF NOT EXISTS outbox_messages_expired_idx
    ON outbox_messages (expires_at) WHERE status = 'expired';
