SELECT seq
FROM outbox_messages FORCE INDEX (outbox_messages_status_idx)
WHERE status = 'pending'
AND seq < ?
FOR UPDATE NOWAIT
