SELECT p.ready, p.waiting, (
  SELECT coalesce(extract(epoch
      FROM now() - least( (
          SELECT created_at
          FROM outbox_messages
          WHERE status = 'pending'
          ORDER BY seq
          LIMIT 1), (
          SELECT min(created_at)
          FROM outbox_messages
          WHERE status = 'processing'))), 0)::float8), (
  SELECT count(*)
  FROM outbox_messages
  WHERE status = 'failed'), (
  SELECT count(*)
  FROM (
    SELECT DISTINCT f.aggregate_type, f.aggregate_id
    FROM outbox_messages f
    WHERE f.status = 'failed'
    AND f.aggregate_id IS NOT NULL
    AND NOT EXISTS (
      SELECT 1
      FROM outbox_messages e
      WHERE e.aggregate_type = f.aggregate_type
      AND e.aggregate_id = f.aggregate_id
      AND e.status IN ('pending', 'failed')
      AND e.seq < f.seq)
    AND NOT EXISTS (
      SELECT 1
      FROM outbox_messages p
      WHERE p.status = 'processing'
      AND p.aggregate_type = f.aggregate_type
      AND p.aggregate_id = f.aggregate_id
      AND p.seq < f.seq)) b), (
  SELECT coalesce(extract(epoch
      FROM now() - min(greatest(c.created_at, c.available_at))), 0)::float8
  FROM (
    SELECT seq, status, aggregate_type, aggregate_id, created_at, available_at, expires_at
    FROM outbox_messages
    WHERE status = 'pending'
    ORDER BY seq
    LIMIT 5000) c
  WHERE c.status = 'pending'
  AND c.available_at <= now()
  AND (c.expires_at IS NULL
    OR c.expires_at > now())
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
    AND p.seq < c.seq) ), p.waiting_age
FROM (
  SELECT count(*) FILTER (
    WHERE available_at <= now()) AS ready, count(*) FILTER (
    WHERE available_at > now()) AS waiting, coalesce(extract(epoch
      FROM now() - min(created_at) FILTER (
        WHERE available_at > now())), 0)::float8 AS waiting_age
  FROM outbox_messages
  WHERE status = 'pending') p
