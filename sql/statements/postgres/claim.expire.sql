WITH due AS (
  SELECT id
  FROM outbox_messages
  WHERE status = 'pending'
  AND expires_at IS NOT NULL
  AND expires_at <= now()
  ORDER BY expires_at
  LIMIT $1
  FOR UPDATE SKIP LOCKED)
UPDATE outbox_messages AS t
SET status = 'expired', locked_by = NULL, locked_at = NULL, last_error = 'expired: its deadline ' || to_char(t.expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') || ' passed before it was published (after ' || t.attempts || ' attempts)'
WHERE t.id = ANY(ARRAY(
    SELECT id
    FROM due))
RETURNING t.id, t.aggregate_type
