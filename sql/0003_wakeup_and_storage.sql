-- outbox-relay schema, version 3: a wake-up that costs the application's commits (almost)
-- nothing, and autovacuum settings for a queue table.
--
-- Version 1's trigger ran pg_notify in every inserting transaction. PostgreSQL serialises the
-- commits of notifying transactions (a database-wide lock from pre-commit to the end of the
-- commit), which cost an application 35-60% of its commits beside a busy relay. Now the trigger
-- notifies only while some relay is idle and listening (it has a row in <table>_waiters), and
-- at most once per transaction; a busy relay polls its own pace and costs the application no
-- NOTIFY at all.

-- One row per idle, LISTENing relay: written by the relay just before it sleeps, deleted when
-- it finds work. Unlogged: after a crash the relays write their rows again.
CREATE UNLOGGED TABLE IF NOT EXISTS outbox_messages_waiters (
    relay       text        PRIMARY KEY,  -- relay.instance_id
    pid         integer     NOT NULL,     -- backend pid of the relay's LISTEN session
    alive_until timestamptz NOT NULL      -- renewed while the relay waits; ignored after, so a
                                          -- relay that died waiting stops costing NOTIFYs
);

-- Fires at commit (deferred), so it sees the waiters committed up to then: a relay that
-- started waiting while the transaction ran is still woken. The transaction-local setting
-- (named after the table's oid) makes the check once per transaction however many rows it
-- inserts.
-- SECURITY DEFINER: the application's role needs no rights on the waiters table (an INSERT
-- grant on the outbox table stays all it needs); search_path is pinned so that definer rights
-- cannot be steered through the caller's search_path.
CREATE OR REPLACE FUNCTION outbox_messages_wakeup() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF current_setting('outbox.woke_' || TG_RELID, true) IS DISTINCT FROM '1' THEN
        PERFORM set_config('outbox.woke_' || TG_RELID, '1', true);
        IF EXISTS (SELECT 1 FROM outbox_messages_waiters WHERE alive_until > now()) THEN
            PERFORM pg_notify('outbox_messages', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_messages_notify ON outbox_messages;
DROP TRIGGER IF EXISTS outbox_messages_wakeup ON outbox_messages;
CREATE CONSTRAINT TRIGGER outbox_messages_wakeup
    AFTER INSERT ON outbox_messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION outbox_messages_wakeup();
DROP FUNCTION IF EXISTS outbox_messages_notify();

-- A queue table: every row is inserted, updated twice and deleted (or updated once more and
-- deleted by retention), so dead tuples pile up at the rate of the traffic while the live
-- table stays small. Autovacuum's defaults (20% of the table) wait far too long; vacuum after
-- a fixed number of dead tuples instead, without cost-based sleeping (version 5 adds a
-- fillfactor). These take effect only where autovacuum runs; the relay also vacuums the table
-- itself when autovacuum is off or falls behind (see the README).
ALTER TABLE outbox_messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);
