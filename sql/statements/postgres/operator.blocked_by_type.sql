SELECT aggregate_type, count(DISTINCT aggregate_id)
FROM outbox_messages f
WHERE f.status = 'failed'
AND f.aggregate_id IS NOT NULL
AND NOT EXISTS (
  SELECT 1
  FROM outbox_messages e
  WHERE e.aggregate_type = f.aggregate_type
  AND e.aggregate_id = f.aggregate_id
  AND e.status NOT IN ('sent', 'expired')
  AND e.seq < f.seq)
GROUP BY aggregate_type
