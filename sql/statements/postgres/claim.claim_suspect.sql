WITH cand AS (
  SELECT c.id
  FROM outbox_messages c
  WHERE c.status = 'pending'
  AND c.available_at <= now()
  AND c.last_error LIKE 'lease expired:%'
  AND (c.expires_at IS NULL
    OR c.expires_at > now())
  AND (c.aggregate_id IS NULL
    OR c.seq <= $2)
  AND NOT EXISTS (
    SELECT 1
    FROM outbox_messages e
    WHERE e.aggregate_type = c.aggregate_type
    AND e.aggregate_id = c.aggregate_id
    AND e.status IN ('pending', 'failed')
    AND e.seq < c.seq)
  AND NOT EXISTS (
    SELECT 1
    FROM outbox_messages p
    WHERE p.status = 'processing'
    AND p.aggregate_type = c.aggregate_type
    AND p.aggregate_id = c.aggregate_id
    AND p.seq < c.seq)
  ORDER BY c.seq
  LIMIT 1
  FOR UPDATE OF c SKIP LOCKED)
UPDATE outbox_messages AS t
SET status = 'processing', attempts = t.attempts + 1, locked_by = $1, locked_at = now()
WHERE t.id = ANY(ARRAY(
    SELECT id
    FROM cand))
RETURNING t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, t.headers, t.destination, t.attempts, t.created_at, t.expires_at
