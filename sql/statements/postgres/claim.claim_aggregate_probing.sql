WITH busy AS MATERIALIZED (
  SELECT DISTINCT b.aggregate_type, b.aggregate_id
  FROM outbox_messages b
  WHERE b.status = 'processing'
  AND b.aggregate_id IS NOT NULL
  LIMIT 30000), cand AS (
  SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id, h.head_seq
  FROM outbox_messages c
  LEFT JOIN LATERAL (
    SELECT CASE WHEN h.status = 'pending'
    AND h.available_at <= now()
    AND (h.last_error IS NULL
      OR h.last_error NOT LIKE 'lease expired:%')
    AND (h.expires_at IS NULL
      OR h.expires_at > now()) THEN h.seq END AS head_seq
    FROM outbox_messages h
    WHERE h.aggregate_type = c.aggregate_type
    AND h.aggregate_id = c.aggregate_id
    AND h.status IN ('pending', 'failed')
    ORDER BY h.seq
    LIMIT 1) h ON true
  WHERE c.status = 'pending'
  AND c.available_at <= now()
  AND (c.last_error IS NULL
    OR c.last_error NOT LIKE 'lease expired:%')
  AND (c.expires_at IS NULL
    OR c.expires_at > now())
  AND (CASE WHEN c.aggregate_id IS NULL THEN c.seq ELSE hashtext(c.aggregate_id) & 2147483647 END) % $5 = $6
  AND (c.aggregate_id IS NULL
    OR (c.seq <= $3
      AND (c.aggregate_type, c.aggregate_id) NOT IN (
        SELECT *
        FROM busy)
      AND ((
          SELECT count(*)
          FROM busy) < 30000
        OR NOT EXISTS (
          SELECT 1
          FROM outbox_messages p
          WHERE p.status = 'processing'
          AND p.aggregate_type = c.aggregate_type
          AND p.aggregate_id = c.aggregate_id
          AND p.seq < c.seq))))
  AND (c.aggregate_id IS NULL
    OR h.head_seq IS NOT NULL)
  ORDER BY c.seq
  LIMIT $4
  FOR UPDATE OF c SKIP LOCKED), ranked AS (
  SELECT c.*, lag(c.seq) OVER (PARTITION BY c.aggregate_type, c.aggregate_id
    ORDER BY c.seq) AS prev_seq
  FROM cand c), checked AS (
  SELECT r.id, r.seq, r.aggregate_type, r.aggregate_id, CASE WHEN r.aggregate_id IS NULL THEN true WHEN r.prev_seq IS NULL THEN r.head_seq = r.seq ELSE NOT EXISTS (
    SELECT 1
    FROM outbox_messages e
    WHERE e.aggregate_type = r.aggregate_type
    AND e.aggregate_id = r.aggregate_id
    AND e.status IN ('pending', 'failed')
    AND e.seq > r.prev_seq
    AND e.seq < r.seq) END AS free
  FROM ranked r), chained AS (
  SELECT id, seq, bool_and(free) OVER w AS ok, CASE WHEN aggregate_id IS NULL THEN seq ELSE min(seq) OVER w END AS head
  FROM checked WINDOW w AS (PARTITION BY aggregate_type, aggregate_id
    ORDER BY seq)), picked AS (
  SELECT id
  FROM chained
  WHERE ok
  ORDER BY head, seq
  LIMIT $1)
UPDATE outbox_messages AS t
SET status = 'processing', attempts = t.attempts + 1, locked_by = $2, locked_at = now()
WHERE t.id = ANY(ARRAY(
    SELECT id
    FROM picked))
RETURNING t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, t.headers, t.destination, t.attempts, t.created_at, t.expires_at
