SELECT seq, aggregate_type, aggregate_id
FROM outbox_messages
WHERE status = 'pending'
AND sent_at IS NULL
AND available_at <= NOW(6)
AND (expires_at IS NULL
  OR expires_at > NOW(6))
AND (last_error IS NULL
  OR last_error NOT LIKE 'lease expired:%')
ORDER BY seq
LIMIT ?
FOR UPDATE SKIP LOCKED
