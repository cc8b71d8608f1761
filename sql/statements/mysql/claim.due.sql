SELECT seq, id, aggregate_type
FROM outbox_messages
WHERE expires_at <= NOW(6)
AND status = 'pending'
ORDER BY expires_at
LIMIT ?
FOR UPDATE SKIP LOCKED
