UPDATE outbox_messages
SET status = 'pending', attempts = greatest(attempts - 1, 0), locked_by = NULL, locked_at = NULL
WHERE status = 'processing'
AND locked_by = $2
AND NOT (id = ANY($1))
AND locked_at >= now() - $3::bigint * interval '1 millisecond'
