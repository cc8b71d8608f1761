UPDATE outbox_messages
SET status = 'processing', attempts = attempts + 1, locked_by = _utf8mb4 X'72656c61792d31', locked_at = NOW(6)
WHERE seq IN (7,8)
