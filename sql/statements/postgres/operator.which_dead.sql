SELECT id
FROM outbox_messages
WHERE status = 'failed'
AND id = ANY($1)
