SELECT aggregate_type, count(DISTINCT aggregate_id)
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
  AND p.seq < f.seq)
GROUP BY aggregate_type
