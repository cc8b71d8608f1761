-- outbox-relay schema, version 1: the outbox table, its sequence, indexes and NOTIFY trigger.
--
-- Plain, idempotent PostgreSQL 13+ DDL: copy it into your own migrations, or let
-- `outbox-relay migrate` apply it (`outbox-relay migrate --print` shows it rendered for the
-- configured table name). Every object is named after the table, so one database can hold
-- several outbox tables.

-- seq is drawn only after the inserting transaction has an xid (see outbox_messages_next_seq):
-- the relay's ordering guard relies on it. Keep the sequence's CACHE at 1.
CREATE SEQUENCE IF NOT EXISTS outbox_messages_seq;

CREATE OR REPLACE FUNCTION outbox_messages_next_seq() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Force an xid before drawing the number: an IDENTITY column would draw it first and let a
    -- transaction hold an earlier seq while invisible to the relay's snapshot bookkeeping.
    PERFORM pg_current_xact_id();
    RETURN nextval('outbox_messages_seq');
END
$$;

CREATE TABLE IF NOT EXISTS outbox_messages (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    seq            bigint      NOT NULL DEFAULT outbox_messages_next_seq(),
    aggregate_type text        NOT NULL DEFAULT '',
    aggregate_id   text        NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}',
    destination    text        NULL,
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'processing', 'sent', 'failed')),
    attempts       integer     NOT NULL DEFAULT 0,
    available_at   timestamptz NOT NULL DEFAULT now(),
    locked_at      timestamptz NULL,
    locked_by      text        NULL,
    last_error     text        NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    sent_at        timestamptz NULL
);

ALTER SEQUENCE outbox_messages_seq OWNED BY outbox_messages.seq;

-- Claim in seq order among pending rows (ordering = "none", and the candidate scan of "aggregate").
CREATE INDEX IF NOT EXISTS outbox_messages_pending_idx
    ON outbox_messages (seq) WHERE status = 'pending';
-- Per-aggregate ordering: the earlier unsent rows of an aggregate.
CREATE INDEX IF NOT EXISTS outbox_messages_aggregate_idx
    ON outbox_messages (aggregate_type, aggregate_id, seq) WHERE status <> 'sent';
-- Lease reclaim of rows a dead relay left in processing.
CREATE INDEX IF NOT EXISTS outbox_messages_processing_idx
    ON outbox_messages (locked_at) WHERE status = 'processing';
-- Rows reclaimed from a relay that died holding them: claimed one at a time (see the relay).
CREATE INDEX IF NOT EXISTS outbox_messages_suspect_idx
    ON outbox_messages (seq) WHERE status = 'pending' AND last_error LIKE 'lease expired:%';
-- Dead letters.
CREATE INDEX IF NOT EXISTS outbox_messages_failed_idx
    ON outbox_messages (seq) WHERE status = 'failed';
-- Retention cleanup of sent rows.
CREATE INDEX IF NOT EXISTS outbox_messages_sent_idx
    ON outbox_messages (sent_at) WHERE status = 'sent';

-- Low-latency wake-up: one NOTIFY per inserting statement, on a channel named after the table.
CREATE OR REPLACE FUNCTION outbox_messages_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_messages', '');
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
CREATE TRIGGER outbox_messages_notify
    AFTER INSERT ON outbox_messages
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_messages_notify();
