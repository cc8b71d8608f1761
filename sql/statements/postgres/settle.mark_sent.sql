UPDATE outbox_messages
SET status = 'sent', sent_at = now(), locked_by = NULL, locked_at = NULL, last_error = NULL
WHERE id = ANY($1)
AND (status = 'processing') IS TRUE
AND locked_by = $2
