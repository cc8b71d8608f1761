UPDATE outbox_messages
SET status = CASE WHEN attempts >= $2 THEN 'failed' ELSE 'pending' END, last_error = 'lease expired: relay ' || coalesce(locked_by, '?') || ' stopped while holding the row', available_at = now(), locked_by = NULL, locked_at = NULL
WHERE status = 'processing'
AND (locked_at IS NULL
  OR locked_at < now() - $1::bigint * interval '1 millisecond')
RETURNING id, status
