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
        AND e.seq < f.seq)) b) AS SIGNED), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN available_at <= NOW(6)
      AND (expires_at IS NULL
        OR expires_at > NOW(6)) THEN GREATEST(created_at, available_at) END), NOW(6)) / 1e6, 0e0), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN available_at > NOW(6) THEN created_at END), NOW(6)) / 1e6, 0e0)
FROM outbox_messages
WHERE status = 'pending'
