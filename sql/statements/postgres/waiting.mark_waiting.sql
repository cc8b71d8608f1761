INSERT INTO outbox_messages_waiters (relay, pid, alive_until)
VALUES ($1, $2, now() + $3::bigint * interval '1 millisecond')
ON CONFLICT (relay) DO
UPDATE
SET pid = EXCLUDED.pid, alive_until = EXCLUDED.alive_until
