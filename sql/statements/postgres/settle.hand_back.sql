UPDATE outbox_messages
SET status = 'pending', attempts = greatest(attempts - 1, 0), locked_by = NULL, locked_at = NULL
WHERE id = ANY($1)
AND (status = 'processing') IS TRUE
AND locked_by = $2
