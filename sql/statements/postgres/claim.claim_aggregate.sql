WITH busy AS MATERIALIZED (
  SELECT DISTINCT b.aggregate_type, b.aggregate_id
  FROM outbox_messages b
  WHERE b.status = 'processing'
  AND b.aggregate_id IS NOT NULL
  LIMIT 30000), stuck AS MATERIALIZED (
  SELECT x.aggregate_type, x.aggregate_id, x.seq
  FROM outbox_messages x
  WHERE x.status = 'pending'
  AND x.expires_at IS NOT NULL
  AND x.expires_at <= now()
  AND x.aggregate_id IS NOT NULL
  UNION ALL
  SELECT s.aggregate_type, s.aggregate_id, s.seq
  FROM outbox_messages s
  WHERE s.status = 'pending'
  AND s.last_error LIKE 'lease expired:%'
  AND s.aggregate_id IS NOT NULL
  LIMIT 1000), cand AS (
  SELECT c.id, c.seq, c.aggregate_type, c.aggregate_id, (c.available_at <= now()
    AND (c.last_error IS NULL
      OR c.last_error NOT LIKE 'lease expired:%')
    AND (c.expires_at IS NULL
      OR c.expires_at > now())) AS ready
  FROM outbox_messages c
  WHERE c.status = 'pending'
  AND (CASE WHEN c.aggregate_id IS NULL THEN c.seq ELSE hashtext(c.aggregate_id) & 2147483647 END) % $5 = $6
  AND ((c.aggregate_id IS NULL
      AND c.available_at <= now()
      AND (c.last_error IS NULL
        OR c.last_error NOT LIKE 'lease expired:%')
      AND (c.expires_at IS NULL
        OR c.expires_at > now()))
    OR (c.aggregate_id IS NOT NULL
      AND c.seq <= $3
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
          AND p.seq < c.seq))
      AND NOT EXISTS (
        SELECT 1
        FROM outbox_messages h
        WHERE (h.status = 'failed'
          OR (h.status = 'pending'
            AND h.available_at > h.created_at))
        AND h.aggregate_type = c.aggregate_type
        AND h.aggregate_id = c.aggregate_id
        AND h.seq <= c.seq
        AND (h.status = 'failed'
          OR NOT (h.available_at <= now()
            AND (h.last_error IS NULL
              OR h.last_error NOT LIKE 'lease expired:%')
            AND (h.expires_at IS NULL
              OR h.expires_at > now()))))
      AND NOT EXISTS (
        SELECT 1
        FROM stuck k
        WHERE k.aggregate_type = c.aggregate_type
        AND k.aggregate_id = c.aggregate_id
        AND k.seq <= c.seq)))
  ORDER BY c.seq
  LIMIT $4), chained AS (
  SELECT id, seq, aggregate_type, aggregate_id, CASE WHEN aggregate_id IS NULL THEN true ELSE bool_and(ready) OVER w END AS ok, CASE WHEN aggregate_id IS NULL THEN seq ELSE min(seq) OVER w END AS head
  FROM cand WINDOW w AS (PARTITION BY aggregate_type, aggregate_id
    ORDER BY seq)), picked AS (
  SELECT id, seq, aggregate_type, aggregate_id
  FROM chained
  WHERE ok
  ORDER BY head, seq
  LIMIT $1), locked AS (
  SELECT l.id
  FROM outbox_messages l
  WHERE l.id = ANY(ARRAY(
      SELECT id
      FROM picked))
  AND l.status = 'pending'
  AND l.available_at <= now()
  AND (l.last_error IS NULL
    OR l.last_error NOT LIKE 'lease expired:%')
  AND (l.expires_at IS NULL
    OR l.expires_at > now())
  FOR UPDATE SKIP LOCKED), kept AS (
  SELECT p.id, CASE WHEN p.aggregate_id IS NULL THEN l.id IS NOT NULL ELSE bool_and(l.id IS NOT NULL) OVER ( PARTITION BY p.aggregate_type, p.aggregate_id
    ORDER BY p.seq) END AS ok
  FROM picked p
  LEFT JOIN locked l ON l.id = p.id), claimed AS (
  UPDATE outbox_messages AS t
  SET status = 'processing', attempts = t.attempts + 1, locked_by = $2, locked_at = now()
  WHERE t.id = ANY(ARRAY(
      SELECT id
      FROM kept
      WHERE ok))
  RETURNING t.id, t.seq, t.aggregate_type, t.aggregate_id, t.event_type, t.payload, t.headers, t.destination, t.attempts, t.created_at, t.expires_at)
SELECT c.*, l.lost
FROM (
  SELECT count(*) FILTER (
    WHERE NOT ok) AS lost
  FROM kept) l
LEFT JOIN claimed c ON true
