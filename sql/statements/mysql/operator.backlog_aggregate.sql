SELECT CAST(COALESCE(SUM(available_at <= NOW(6)), 0) AS SIGNED), CAST(COALESCE(SUM(available_at > NOW(6)), 0) AS SIGNED), COALESCE(TIMESTAMPDIFF(MICROSECOND, LEAST(COALESCE((
          SELECT created_at
          FROM outbox_messages
          WHERE status = 'pending'
          AND sent_at IS NULL
          ORDER BY seq
          LIMIT 1), NOW(6)), COALESCE((
          SELECT MIN(created_at)
          FROM outbox_messages
          WHERE status = 'processing'), NOW(6))), NOW(6)) / 1e6, 0e0), CAST((
    SELECT COUNT(*)
    FROM outbox_messages
    WHERE status = 'failed') AS SIGNED), CAST((
    SELECT COUNT(*)
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
        AND e.status IN ('pending', 'processing', 'failed')
        AND e.seq < f.seq)) b) AS SIGNED), COALESCE(TIMESTAMPDIFF(MICROSECOND, (
      SELECT MIN(GREATEST(c.created_at, c.available_at))
      FROM (
        SELECT seq, aggregate_type, aggregate_id, created_at, available_at, expires_at
        FROM outbox_messages
        WHERE status = 'pending'
        ORDER BY seq
        LIMIT 5000) c
      WHERE c.available_at <= NOW(6)
      AND (c.expires_at IS NULL
        OR c.expires_at > NOW(6))
      AND (c.aggregate_id IS NULL
        OR NOT EXISTS (
          SELECT 1
          FROM outbox_messages e
          WHERE e.aggregate_type = c.aggregate_type
          AND e.aggregate_id = c.aggregate_id
          AND e.status IN ('pending', 'processing', 'failed')
          AND e.seq < c.seq))), NOW(6)) / 1e6, 0e0), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN available_at > NOW(6) THEN created_at END), NOW(6)) / 1e6, 0e0)
FROM outbox_messages
WHERE status = 'pending'
