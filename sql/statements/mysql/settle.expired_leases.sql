SELECT seq, attempts
FROM outbox_messages
WHERE status = 'processing'
AND (locked_at IS NULL
  OR locked_at < NOW(6) - INTERVAL ? MICROSECOND)
FOR UPDATE SKIP LOCKED
