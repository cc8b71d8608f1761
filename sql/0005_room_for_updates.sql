-- outbox-relay schema, version 5: room on each page for its rows' next versions, so that the
-- relay's updates cost the WAL of what they change, not of the whole row.
--
-- The relay updates each row twice (claimed, then sent or back to pending). The updates cannot
-- be HOT (`status` is in the partial indexes' predicates), but PostgreSQL logs an update whose
-- new version stays on the old one's page as only the bytes that changed (the payload and
-- headers, which come before them, are left out). With the default fillfactor (100) inserts
-- fill each page and every new version lands on another page, logged whole. At 50 a page keeps
-- room for one more version of each row on it: the claim updates a page's rows in one
-- statement, and by the next update the claim's old versions are pruned. The relay's WAL per
-- message halves, the application's insert writes the same WAL, and the table is about a fifth
-- larger (docs/performance.md, "Database cost per message").
--
-- A moment's lock that lets inserts through (SHARE UPDATE EXCLUSIVE); nothing is rewritten,
-- pages written from now on keep the room. A partitioned table holds no storage settings: each
-- of its partitions gets the setting, and the relay gives it to the partitions it creates.
DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN
        SELECT c.oid::regclass FROM pg_class c
         WHERE c.oid = 'outbox_messages'::regclass AND c.relkind = 'r'
        UNION ALL
        SELECT i.inhrelid::regclass FROM pg_inherits i
         WHERE i.inhparent = 'outbox_messages'::regclass
    LOOP
        EXECUTE format('ALTER TABLE %s SET (fillfactor = 50)', part);
    END LOOP;
END
$$;
