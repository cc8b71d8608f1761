-- outbox-relay schema version 1 for MySQL 8.0.13+ and MariaDB 10.6+ (InnoDB).
-- Plain, idempotent DDL: copy it into your own migrations, or let `outbox-relay migrate`
-- apply it (it records the version in outbox_relay_schema_version).
--
-- The application's whole integration is one statement in its own transaction:
--   INSERT INTO outbox_messages (aggregate_type, aggregate_id, event_type, payload)
--   VALUES ('order', '42', 'order.created', '{"total": 10}');
-- Timestamps are TIMESTAMP(6): stored in UTC whatever the session's time_zone.
CREATE TABLE IF NOT EXISTS outbox_messages (
    seq            BIGINT        NOT NULL AUTO_INCREMENT,          -- insert order
    id             CHAR(36)      CHARACTER SET ascii NOT NULL DEFAULT (uuid()),  -- message id, for dedup downstream
    aggregate_type VARCHAR(255)  NOT NULL DEFAULT '',
    aggregate_id   VARCHAR(255)  NULL,                             -- NULL: no ordering constraint
    event_type     VARCHAR(255)  NOT NULL,
    payload        JSON          NOT NULL,                         -- LONGBLOB/VARBINARY also accepted (binary formats)
    headers        JSON          NOT NULL DEFAULT ('{}'),          -- copied to message headers
    destination    VARCHAR(1024) NULL,                             -- per-row override of the routing key / topic
    status         VARCHAR(16)   CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    attempts       INT           NOT NULL DEFAULT 0,
    available_at   TIMESTAMP(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    locked_at      TIMESTAMP(6)  NULL DEFAULT NULL,
    locked_by      VARCHAR(255)  NULL,
    last_error     TEXT          NULL,
    created_at     TIMESTAMP(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    sent_at        TIMESTAMP(6)  NULL DEFAULT NULL,
    expires_at     TIMESTAMP(6)  NULL DEFAULT NULL,                -- not published after it
    PRIMARY KEY (seq),
    UNIQUE KEY outbox_messages_id_idx (id),
    -- The claim (pending rows in seq order), retention and the gauges: InnoDB appends the
    -- primary key, so this is (status, seq).
    KEY outbox_messages_status_idx (status),
    -- Ordering: an aggregate's open rows before a given seq, read with a locking probe.
    KEY outbox_messages_aggregate_idx (aggregate_type, aggregate_id, status, seq),
    CONSTRAINT outbox_messages_status_check
        CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'expired')),
    CONSTRAINT outbox_messages_id_check
        CHECK (id REGEXP '^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$')
) ENGINE = InnoDB;
