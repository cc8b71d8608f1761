-- outbox-relay schema, version 4: a wake-up that fires once per transaction, however many rows
-- it inserts (a bulk COPY or INSERT ... SELECT included).
--
-- Version 3's deferred trigger was FOR EACH ROW: a 1M-row COPY queued a million trigger events
-- until commit, each one a call of the function, even though only the first could notify. A
-- constraint trigger must be FOR EACH ROW, but its WHEN condition is evaluated as each row is
-- inserted, before anything is queued: the condition below is true for the first row of the
-- transaction only (it sets a transaction-local flag named after the table's oid, which a
-- rolled-back savepoint resets along with the event it queued), so one event is queued per
-- transaction and the function runs once, at commit.
--
-- SECURITY DEFINER: the application's role needs no rights on the waiters table (INSERT on the
-- outbox table and USAGE on its sequence stay all it needs). search_path is pinned to the one
-- the function was created with; `outbox-relay migrate` creates it with the table's schema then
-- pg_temp (pg_catalog is searched first), so neither the caller's search_path nor its temporary
-- tables can steer what the function reads. When applying this file by hand, run it with
-- `SET search_path = <the table's schema>, pg_temp`.
CREATE OR REPLACE FUNCTION outbox_messages_wakeup() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_messages_waiters WHERE alive_until > now()) THEN
        PERFORM pg_notify('outbox_messages', '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_messages_wakeup ON outbox_messages;
CREATE CONSTRAINT TRIGGER outbox_messages_wakeup
    AFTER INSERT ON outbox_messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (current_setting('outbox.woke_' || 'outbox_messages'::regclass::oid::text, true) IS DISTINCT FROM '1'
          AND set_config('outbox.woke_' || 'outbox_messages'::regclass::oid::text, '1', true) = '1')
    EXECUTE FUNCTION outbox_messages_wakeup();
