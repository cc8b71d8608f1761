SELECT DISTINCT aggregate_type, aggregate_id
FROM outbox_messages
WHERE status = 'processing'
AND aggregate_id IS NOT NULL
LIMIT 10000
