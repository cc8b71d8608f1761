SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, destination, attempts, created_at, expires_at
FROM outbox_messages
WHERE seq IN (7,8)
ORDER BY seq
