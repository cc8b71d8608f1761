UPDATE outbox_messages AS t
SET status = CASE WHEN t.attempts >= $5 THEN 'failed' ELSE 'pending' END, available_at = CASE WHEN t.attempts >= $5 THEN t.available_at ELSE now() + f.delay_ms * interval '1 millisecond' END, last_error = f.error, locked_by = NULL, locked_at = NULL
FROM unnest($1::uuid[], $2::text[], $3::bigint[]) AS f(id, error, delay_ms)
WHERE t.id = f.id
AND (t.status = 'processing') IS TRUE
AND t.locked_by = $4
RETURNING t.id, t.status
