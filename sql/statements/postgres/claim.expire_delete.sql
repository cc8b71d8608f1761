WITH due AS (
  SELECT id
  FROM outbox_messages
  WHERE status = 'pending'
  AND expires_at IS NOT NULL
  AND expires_at <= now()
  ORDER BY expires_at
  LIMIT $1
  FOR UPDATE SKIP LOCKED)
DELETE
FROM outbox_messages AS t
WHERE t.id = ANY(ARRAY(
    SELECT id
    FROM due))
RETURNING t.id, t.aggregate_type
