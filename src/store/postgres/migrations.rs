//! Every schema migration as explicit statements, each saying how `migrate` runs it (see
//! [`super::steps`]), with the names it uses spelled as placeholders: `{{table}}` the table's
//! name (schema-qualified when configured so; also the NOTIFY channel), `{{name}}` its bare
//! name (index, trigger and constraint names, which PostgreSQL does not let us qualify), and
//! `{{concurrently}}` in an index statement that runs alone (dropped for a table created in the
//! same run). Each statement keeps the comments before it, so that rendering a migration for
//! the default table gives back its file under `sql/`, which users copy as it is (a test checks
//! that it does).

use super::steps::{Runs, Statement, Step, file, steps};
use crate::config::TableName;

/// One versioned migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version recorded in `outbox_relay_schema_version` once applied.
    pub version: i32,
    /// Its file under `sql/`: the migration rendered for the default table.
    pub name: &'static str,
    /// Its statements, in order.
    pub statements: &'static [Statement],
    /// How `migrate` applies it to a partitioned table instead, when that differs: PostgreSQL
    /// builds no index `CONCURRENTLY` on a partitioned table.
    pub on_partitions: Option<IndexSwap>,
}

/// A version that adds an index, or replaces one index by another: on a partitioned table
/// `migrate` makes the new one partition by partition, then drops the old one, if any (see
/// [`super::partitioned_index`]).
#[derive(Debug, Clone, Copy)]
pub struct IndexSwap {
    /// The new index's name (a template, see [`Statement::sql`]).
    pub builds: &'static str,
    /// Its columns and predicate: `(…) WHERE …`.
    pub definition: &'static str,
    /// The old index, schema-qualified (a template); `None` when the version only adds one.
    pub drops: Option<&'static str>,
}

impl Migration {
    /// Its file rendered for `table`, comments included (what `migrate --print` shows).
    pub fn render(&self, table: &TableName) -> String {
        file(self.statements, table)
    }

    /// Its statements for `table`, each ended by `;`, in order: as `psql -f` applies the file.
    pub fn statements_for(&self, table: &TableName) -> Vec<String> {
        self.statements.iter().map(|s| s.for_table(table)).collect()
    }

    /// The steps `migrate` runs it in on `table`; `new_table` when the table is created in the
    /// same run (see [`super::steps`]).
    pub fn steps(&self, table: &TableName, new_table: bool) -> Vec<Step> {
        steps(self.statements, table, new_table)
    }
}

/// A statement run in one transaction with the statements around it, after `before` (its
/// blank lines and comments in the file).
const fn with_others(before: &'static str, sql: &'static str) -> Statement {
    Statement {
        before,
        sql,
        runs: Runs::WithOthers,
    }
}

/// A statement run in a transaction of its own (see [`Runs::OwnTransaction`]).
const fn own_transaction(before: &'static str, sql: &'static str) -> Statement {
    Statement {
        before,
        sql,
        runs: Runs::OwnTransaction,
    }
}

/// An index statement run alone, outside any transaction, building the index `builds`.
const fn alone(before: &'static str, sql: &'static str, builds: Option<&'static str>) -> Statement {
    Statement {
        before,
        sql,
        runs: Runs::Alone { builds },
    }
}

/// Every migration, in order.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "0001_outbox_messages.sql",
        statements: V1,
        on_partitions: None,
    },
    Migration {
        version: 2,
        name: "0002_expiry.sql",
        statements: V2,
        on_partitions: None,
    },
    Migration {
        version: 3,
        name: "0003_wakeup_and_storage.sql",
        statements: V3,
        on_partitions: None,
    },
    Migration {
        version: 4,
        name: "0004_bulk_wakeup.sql",
        statements: V4,
        on_partitions: None,
    },
    Migration {
        version: 5,
        name: "0005_room_for_updates.sql",
        statements: V5,
        on_partitions: None,
    },
    Migration {
        version: 6,
        name: "0006_waiting_index.sql",
        statements: V6,
        on_partitions: Some(WAITING_INDEX),
    },
    Migration {
        version: 7,
        name: "0007_blocker_index.sql",
        statements: V7,
        on_partitions: Some(BLOCKER_INDEX),
    },
];

/// Version 1 (`sql/0001_outbox_messages.sql`): the table, its sequence, indexes and NOTIFY
/// trigger.
const V1: &[Statement] = &[
    with_others(
        r#"-- outbox-relay schema, version 1: the outbox table, its sequence, indexes and NOTIFY trigger.
--
-- Plain, idempotent PostgreSQL 13+ DDL: copy it into your own migrations, or let
-- `outbox-relay migrate` apply it (`outbox-relay migrate --print` shows it rendered for the
-- configured table name). Every object is named after the table, so one database can hold
-- several outbox tables.

-- seq is drawn only after the inserting transaction has an xid (see {{table}}_next_seq):
-- the relay's ordering guard relies on it. Keep the sequence's CACHE at 1.
"#,
        "CREATE SEQUENCE IF NOT EXISTS {{table}}_seq",
    ),
    with_others(
        "\n\n",
        r#"CREATE OR REPLACE FUNCTION {{table}}_next_seq() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- Force an xid before drawing the number: an IDENTITY column would draw it first and let a
    -- transaction hold an earlier seq while invisible to the relay's snapshot bookkeeping.
    PERFORM pg_current_xact_id();
    RETURN nextval('{{table}}_seq');
END
$$"#,
    ),
    with_others(
        "\n\n",
        r#"CREATE TABLE IF NOT EXISTS {{table}} (
    id             uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    seq            bigint      NOT NULL DEFAULT {{table}}_next_seq(),
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
)"#,
    ),
    with_others(
        "\n\n",
        "ALTER SEQUENCE {{table}}_seq OWNED BY {{table}}.seq",
    ),
    with_others(
        r#"

-- Claim in seq order among pending rows (ordering = "none", and the candidate scan of "aggregate").
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_pending_idx
    ON {{table}} (seq) WHERE status = 'pending'"#,
    ),
    with_others(
        r#"
-- Per-aggregate ordering: the earlier unsent rows of an aggregate.
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_aggregate_idx
    ON {{table}} (aggregate_type, aggregate_id, seq) WHERE status <> 'sent'"#,
    ),
    with_others(
        r#"
-- Lease reclaim of rows a dead relay left in processing.
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_processing_idx
    ON {{table}} (locked_at) WHERE status = 'processing'"#,
    ),
    with_others(
        r#"
-- Rows reclaimed from a relay that died holding them: claimed one at a time (see the relay).
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_suspect_idx
    ON {{table}} (seq) WHERE status = 'pending' AND last_error LIKE 'lease expired:%'"#,
    ),
    with_others(
        r#"
-- Dead letters.
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_failed_idx
    ON {{table}} (seq) WHERE status = 'failed'"#,
    ),
    with_others(
        r#"
-- Retention cleanup of sent rows.
"#,
        r#"CREATE INDEX IF NOT EXISTS {{name}}_sent_idx
    ON {{table}} (sent_at) WHERE status = 'sent'"#,
    ),
    with_others(
        r#"

-- Low-latency wake-up: one NOTIFY per inserting statement, on a channel named after the table.
"#,
        r#"CREATE OR REPLACE FUNCTION {{table}}_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{{table}}', '');
    RETURN NULL;
END
$$"#,
    ),
    DROP_NOTIFY_TRIGGER,
    with_others(
        "\n",
        r#"CREATE TRIGGER {{name}}_notify
    AFTER INSERT ON {{table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{table}}_notify()"#,
    ),
];
/// Version 2 (`sql/0002_expiry.sql`): messages that expire, applied in place (the check
/// widened and validated apart, the indexes built concurrently).
const V2: &[Statement] = &[
    with_others(
        r#"-- outbox-relay schema, version 2: messages that expire.
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

"#,
        "ALTER TABLE {{table}} ADD COLUMN IF NOT EXISTS expires_at timestamptz NULL",
    ),
    with_others(
        r#"

-- Widen the status check (version 1's inline CHECK, which PostgreSQL names
-- <table>_status_check). Added NOT VALID (a moment's lock, nothing read), then validated in
-- a transaction of its own: validating reads every row, under a lock that lets inserts through.
"#,
        "ALTER TABLE {{table}} DROP CONSTRAINT IF EXISTS {{name}}_status_check",
    ),
    with_others(
        "\n",
        r#"ALTER TABLE {{table}} ADD CONSTRAINT {{name}}_status_check
    CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'expired')) NOT VALID"#,
    ),
    own_transaction(
        "\n",
        "ALTER TABLE {{table}} VALIDATE CONSTRAINT {{name}}_status_check",
    ),
    alone(
        r#"

-- Per-aggregate ordering looks at the earlier rows of an aggregate that are still open
-- (neither sent nor expired): this replaces version 1's aggregate index, which kept expired
-- rows and so would make every ordering check step over them.
"#,
        r#"CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_open_idx
    ON {{table}} (aggregate_type, aggregate_id, seq) WHERE status NOT IN ('sent', 'expired')"#,
        Some("{{name}}_open_idx"),
    ),
    alone(
        "\n",
        "DROP INDEX {{concurrently}} IF EXISTS {{table}}_aggregate_idx",
        None,
    ),
    alone(
        r#"
-- Pending rows with a deadline, by deadline: the relay's expiry sweep before each claim reads
-- only this index, empty when no row sets expires_at.
"#,
        r#"CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_expiry_idx
    ON {{table}} (expires_at) WHERE status = 'pending' AND expires_at IS NOT NULL"#,
        Some("{{name}}_expiry_idx"),
    ),
    alone(
        r#"
-- Retention cleanup of expired rows (kept for cleanup.retention after their deadline).
"#,
        r#"CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_expired_idx
    ON {{table}} (expires_at) WHERE status = 'expired'"#,
        Some("{{name}}_expired_idx"),
    ),
];
/// Version 3 (`sql/0003_wakeup_and_storage.sql`): the wake-up record, its trigger, and a queue
/// table's autovacuum settings.
const V3: &[Statement] = &[
    with_others(
        r#"-- outbox-relay schema, version 3: a wake-up that costs the application's commits (almost)
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
"#,
        r#"CREATE UNLOGGED TABLE IF NOT EXISTS {{table}}_waiters (
    relay       text        PRIMARY KEY,  -- relay.instance_id
    pid         integer     NOT NULL,     -- backend pid of the relay's LISTEN session
    alive_until timestamptz NOT NULL      -- renewed while the relay waits; ignored after, so a
                                          -- relay that died waiting stops costing NOTIFYs
)"#,
    ),
    with_others(
        r#"

-- Fires at commit (deferred), so it sees the waiters committed up to then: a relay that
-- started waiting while the transaction ran is still woken. The transaction-local setting
-- (named after the table's oid) makes the check once per transaction however many rows it
-- inserts.
-- SECURITY DEFINER: the application's role needs no rights on the waiters table (an INSERT
-- grant on the outbox table stays all it needs); search_path is pinned so that definer rights
-- cannot be steered through the caller's search_path.
"#,
        r#"CREATE OR REPLACE FUNCTION {{table}}_wakeup() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF current_setting('outbox.woke_' || TG_RELID, true) IS DISTINCT FROM '1' THEN
        PERFORM set_config('outbox.woke_' || TG_RELID, '1', true);
        IF EXISTS (SELECT 1 FROM {{table}}_waiters WHERE alive_until > now()) THEN
            PERFORM pg_notify('{{table}}', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$"#,
    ),
    DROP_NOTIFY_TRIGGER,
    with_others("\n", "DROP TRIGGER IF EXISTS {{name}}_wakeup ON {{table}}"),
    with_others(
        "\n",
        r#"CREATE CONSTRAINT TRIGGER {{name}}_wakeup
    AFTER INSERT ON {{table}}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION {{table}}_wakeup()"#,
    ),
    with_others("\n", "DROP FUNCTION IF EXISTS {{table}}_notify()"),
    STORAGE_SETTINGS,
];
/// Version 4 (`sql/0004_bulk_wakeup.sql`): the wake-up trigger once per transaction.
const V4: &[Statement] = &[
    with_others(
        r#"-- outbox-relay schema, version 4: a wake-up that fires once per transaction, however many rows
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
"#,
        r#"CREATE OR REPLACE FUNCTION {{table}}_wakeup() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM {{table}}_waiters WHERE alive_until > now()) THEN
        PERFORM pg_notify('{{table}}', '');
    END IF;
    RETURN NULL;
END
$$"#,
    ),
    DROP_WAKEUP_TRIGGER,
    WAKEUP_TRIGGER,
];

/// Version 5 (`sql/0005_room_for_updates.sql`): room on each page for the next version of its
/// rows, so that the relay's updates are logged as the bytes they change.
const V5: &[Statement] = &[ROOM_FOR_UPDATES];

/// Version 5's fillfactor, on a plain table or on each partition of a partitioned table (a
/// partition the relay creates gets it with [`STORAGE_SETTINGS`]).
pub const ROOM_FOR_UPDATES: Statement = with_others(
    r#"-- outbox-relay schema, version 5: room on each page for its rows' next versions, so that the
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
"#,
    r#"DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN
        SELECT c.oid::regclass FROM pg_class c
         WHERE c.oid = '{{table}}'::regclass AND c.relkind = 'r'
        UNION ALL
        SELECT i.inhrelid::regclass FROM pg_inherits i
         WHERE i.inhparent = '{{table}}'::regclass
    LOOP
        EXECUTE format('ALTER TABLE %s SET (fillfactor = 50)', part);
    END LOOP;
END
$$"#,
);

/// Version 6 (`sql/0006_waiting_index.sql`): the aggregate index holds the waiting rows only,
/// so claiming a row adds no entry to it.
const V6: &[Statement] = &[
    alone(
        r#"-- outbox-relay schema, version 6: the rows in flight leave the aggregate index, so that
-- claiming a row writes one index entry fewer.
--
-- Version 2's `{{name}}_open_idx` held every row neither sent nor expired. The relay's
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
"#,
        r#"CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_waiting_idx
    ON {{table}} (aggregate_type, aggregate_id, seq) WHERE status IN ('pending', 'failed')"#,
        Some("{{name}}_waiting_idx"),
    ),
    alone(
        "\n",
        "DROP INDEX {{concurrently}} IF EXISTS {{table}}_open_idx",
        None,
    ),
];

/// Version 6 on a partitioned table: the same index, made partition by partition.
pub const WAITING_INDEX: IndexSwap = IndexSwap {
    builds: "{{name}}_waiting_idx",
    definition: "(aggregate_type, aggregate_id, seq) WHERE status IN ('pending', 'failed')",
    drops: Some("{{table}}_open_idx"),
};

/// Version 7 (`sql/0007_blocker_index.sql`): the rows that can hold back their aggregate for
/// longer than a claim, by aggregate, so that the ordered claim probes a small index for each
/// candidate instead of its aggregate's first waiting row.
const V7: &[Statement] = &[alone(
    r#"-- outbox-relay schema, version 7: the rows that can hold back the rest of their aggregate for
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
"#,
    r#"CREATE INDEX {{concurrently}} IF NOT EXISTS {{name}}_blocker_idx
    ON {{table}} (aggregate_type, aggregate_id, seq)
    WHERE status = 'failed' OR (status = 'pending' AND available_at > created_at)"#,
    Some("{{name}}_blocker_idx"),
)];

/// Version 7 on a partitioned table: the same index, made partition by partition.
pub const BLOCKER_INDEX: IndexSwap = IndexSwap {
    builds: "{{name}}_blocker_idx",
    definition: "(aggregate_type, aggregate_id, seq)\n    WHERE status = 'failed' OR (status = 'pending' AND available_at > created_at)",
    drops: None,
};

/// Version 1's NOTIFY trigger, dropped to be created again (version 1) or for good (version 3).
const DROP_NOTIFY_TRIGGER: Statement = with_others(
    "\n\n",
    "DROP TRIGGER IF EXISTS {{name}}_notify ON {{table}}",
);

/// Version 3's autovacuum settings of a queue table: partitioning gives each partition them
/// (a partitioned table holds none), and version 5's fillfactor ([`ROOM_FOR_UPDATES`]).
pub const STORAGE_SETTINGS: Statement = with_others(
    r#"

-- A queue table: every row is inserted, updated twice and deleted (or updated once more and
-- deleted by retention), so dead tuples pile up at the rate of the traffic while the live
-- table stays small. Autovacuum's defaults (20% of the table) wait far too long; vacuum after
-- a fixed number of dead tuples instead, without cost-based sleeping (version 5 adds a
-- fillfactor). These take effect only where autovacuum runs; the relay also vacuums the table
-- itself when autovacuum is off or falls behind (see the README).
"#,
    r#"ALTER TABLE {{table}} SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
)"#,
);

/// Version 4's wake-up trigger, dropped to be created again (also on a partitioned table,
/// which PostgreSQL clones it from onto every partition).
pub const DROP_WAKEUP_TRIGGER: Statement = with_others(
    "\n\n",
    "DROP TRIGGER IF EXISTS {{name}}_wakeup ON {{table}}",
);

/// Version 4's wake-up trigger: once per transaction, at commit.
pub const WAKEUP_TRIGGER: Statement = with_others(
    "\n",
    r#"CREATE CONSTRAINT TRIGGER {{name}}_wakeup
    AFTER INSERT ON {{table}}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (current_setting('outbox.woke_' || '{{table}}'::regclass::oid::text, true) IS DISTINCT FROM '1'
          AND set_config('outbox.woke_' || '{{table}}'::regclass::oid::text, '1', true) = '1')
    EXECUTE FUNCTION {{table}}_wakeup()"#,
);
