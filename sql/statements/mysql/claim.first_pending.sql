SELECT MIN(seq)
FROM outbox_messages
WHERE status = 'pending'
