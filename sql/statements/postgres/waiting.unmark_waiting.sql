DELETE
FROM outbox_messages_waiters
WHERE relay = $1
