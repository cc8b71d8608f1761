SELECT seq, id, aggregate_type
FROM outbox_messages FORCE INDEX (outbox_messages_status_idx)
WHERE status = 'pending'
AND seq < ?
AND expires_at <= NOW(6)
ORDER BY seq
LIMIT ?
FOR UPDATE SKIP LOCKED
