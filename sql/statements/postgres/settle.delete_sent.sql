DELETE
FROM outbox_messages
WHERE id = ANY($1)
AND (status = 'processing') IS TRUE
AND locked_by = $2
