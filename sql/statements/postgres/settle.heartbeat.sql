UPDATE outbox_messages
SET locked_at = now()
WHERE id = ANY($1)
AND (status = 'processing') IS TRUE
AND locked_by = $2
