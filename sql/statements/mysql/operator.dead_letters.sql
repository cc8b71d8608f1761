SELECT id, seq, aggregate_type, aggregate_id, event_type, attempts, last_error, created_at, available_at
FROM outbox_messages
WHERE status = 'failed'
ORDER BY seq
LIMIT ?
