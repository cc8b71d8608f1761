SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, destination, attempts, created_at, expires_at
FROM outbox_messages
WHERE status = 'pending'
AND sent_at IS NULL
AND available_at <= NOW(6)
AND (expires_at IS NULL
  OR expires_at > NOW(6))
AND (last_error IS NULL
  OR last_error NOT LIKE 'lease expired:%')
AND seq > 625
AND (aggregate_id IS NULL
  OR (aggregate_type, aggregate_id) NOT IN ((_utf8mb4 X'6f72646572', _utf8mb4 X'3432')))
ORDER BY seq
LIMIT 625
FOR UPDATE SKIP LOCKED
