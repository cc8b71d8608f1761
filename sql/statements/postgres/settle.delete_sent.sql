DELETE
FROM outbox_messages
WHERE id = ANY($1)
AND status = 'processing'
AND locked_by = $2
