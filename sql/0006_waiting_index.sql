-- outbox-relay schema, version 6: the rows in flight leave the aggregate index, so that
-- claiming a row writes one index entry fewer.
--
-- Version 2's `outbox_messages_open_idx` held every row neither sent nor expired. The relay's
-- updates are not HOT (`status` is in the partial indexes' predicates), so each adds an entry
-- to every index whose predicate the new version meets: the claim, which turns a pending row
-- into a processing one, added one to the open index besides the primary key's and the
-- processing index's. The waiting index holds the pending and failed rows only, which the
-- claim leaves; the relay finds an aggregate's rows in flight through the small processing
-- index. About 80 bytes of WAL less per message (docs/performance.md, "Database cost per
-- message").
--
-- Built concurrently (inserts go on), then the old index dropped concurrently. PostgreSQL
-- builds no index concurrently on a partitioned table: there `outbox-relay migrate` makes it
-- on the table alone (`CREATE INDEX … ON ONLY`), builds it concurrently on each partition and
-- attaches each, then drops the old index under a moment's lock (this file fails there;
-- docs/operations.md shows the statements by hand). Upgrade every relay before the table: an
-- older relay's ordered claim reads the open index.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_waiting_idx
    ON outbox_messages (aggregate_type, aggregate_id, seq) WHERE status IN ('pending', 'failed');
DROP INDEX CONCURRENTLY IF EXISTS outbox_messages_open_idx;
