SELECT e.seq, e.aggregate_type, e.aggregate_id
FROM outbox_messages e FORCE INDEX (outbox_messages_aggregate_idx)
WHERE e.status IN ('pending', 'processing', 'failed')
AND ((e.aggregate_type = _utf8mb4 X'6f72646572'
    AND e.aggregate_id = _utf8mb4 X'3432'
    AND e.seq < 8))
