-- outbox-relay schema, version 7: the rows that can hold back the rest of their aggregate for
-- longer than a claim, by aggregate: the dead letters, and the pending rows whose
-- `available_at` was moved past their `created_at` (a failed attempt's backoff, a reclaim, an
-- operator's retry, or the application's own choice).
--
-- The ordered claim reads the pending rows in `seq` order without a lock and probes this
-- small index for each candidate, instead of fetching each candidate's first waiting row
-- from the aggregate index: about half of the claim's work before. A row inserted with both
-- columns left to their defaults has them equal, so the application's insert writes no entry
-- here, and neither does the relay's claim or mark sent. (An application that sets
-- `created_at` itself, earlier than the insert, puts each of its rows here: still correct,
-- one index entry more per insert.)
--
-- Built concurrently (inserts go on). PostgreSQL builds no index concurrently on a
-- partitioned table: there `outbox-relay migrate` makes it on the table alone (`CREATE INDEX
-- … ON ONLY`), builds it concurrently on each partition and attaches each (this file fails
-- there; docs/operations.md shows the statements by hand). A relay looks for the index when
-- it starts; without it, its ordered claim probes the aggregate index as version 6's did.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_messages_blocker_idx
    ON outbox_messages (aggregate_type, aggregate_id, seq)
    WHERE status = 'failed' OR (status = 'pending' AND available_at > created_at);
