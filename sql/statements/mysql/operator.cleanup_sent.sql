DELETE
FROM outbox_messages
WHERE status = 'sent'
AND sent_at < NOW(6) - INTERVAL ? MICROSECOND
ORDER BY sent_at
LIMIT ?
