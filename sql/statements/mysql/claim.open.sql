SELECT seq, aggregate_type, aggregate_id
FROM outbox_messages FORCE INDEX (outbox_messages_status_idx)
WHERE status IN ('pending', 'processing', 'failed')
AND seq < ?
AND aggregate_id IS NOT NULL
LIMIT 20001
