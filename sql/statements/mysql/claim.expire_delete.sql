DELETE
FROM outbox_messages
WHERE seq IN (7,8)
