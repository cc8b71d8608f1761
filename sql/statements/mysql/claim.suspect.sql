SELECT seq, id, aggregate_type, aggregate_id, event_type, payload, headers, destination, attempts, created_at, expires_at
FROM outbox_messages
WHERE status = 'pending'
AND sent_at IS NULL
AND available_at <= NOW(6)
AND (expires_at IS NULL
  OR expires_at > NOW(6))
AND last_error LIKE 'lease expired:%'
ORDER BY seq
LIMIT 1
FOR UPDATE SKIP LOCKED
