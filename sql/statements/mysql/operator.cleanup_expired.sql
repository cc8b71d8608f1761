DELETE
FROM outbox_messages
WHERE expires_at < NOW(6) - INTERVAL ? MICROSECOND
AND status = 'expired'
ORDER BY expires_at
LIMIT ?
