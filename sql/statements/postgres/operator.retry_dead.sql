UPDATE outbox_messages
SET status = 'pending', attempts = 0, available_at = now()
WHERE status = 'failed'
AND ($2
  OR id = ANY($1))
RETURNING id
