SELECT aggregate_type, CAST(SUM(CASE WHEN status = 'pending'
    AND available_at <= NOW(6) THEN 1 ELSE 0 END) AS SIGNED), CAST(SUM(CASE WHEN status = 'pending'
    AND available_at > NOW(6) THEN 1 ELSE 0 END) AS SIGNED), CAST(SUM(CASE WHEN status = 'processing' THEN 1 ELSE 0 END) AS SIGNED), CAST(SUM(CASE WHEN status = 'sent' THEN 1 ELSE 0 END) AS SIGNED), CAST(SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END) AS SIGNED), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN status IN ('pending', 'processing') THEN created_at END), NOW(6)) / 1e6, 0e0), CAST(SUM(CASE WHEN status = 'expired' THEN 1 ELSE 0 END) AS SIGNED)
FROM outbox_messages
GROUP BY aggregate_type
ORDER BY aggregate_type
