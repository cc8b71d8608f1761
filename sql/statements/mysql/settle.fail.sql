UPDATE outbox_messages
SET status = CASE WHEN attempts >= ? THEN 'failed' ELSE 'pending' END, available_at = CASE WHEN attempts >= ? THEN available_at ELSE NOW(6) + INTERVAL ? MICROSECOND END, last_error = ?, locked_by = NULL, locked_at = NULL
WHERE id = ?
AND status = 'processing'
AND locked_by = ?
