WITH cand AS (
  SELECT id
  FROM outbox_messages
  WHERE status = 'pending'
  AND available_at <= now()
  AND (last_error IS NULL
    OR last_error NOT LIKE 'lease expired:%')
  AND (expires_at IS NULL
    OR expires_at > now())
  ORDER BY seq
  LIMIT $1
  FOR UPDATE SKIP LOCKED)
UPDATE outbox_messages AS t
SET status = 'processing', attempts = t.attempts + 1, locked_by = $2, locked_at = now()
WHERE t.id = ANY(ARRAY(
    SELECT id
    FROM cand))
RETURNING t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, t.headers, t.destination, t.attempts, t.created_at, t.expires_at
