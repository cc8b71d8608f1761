UPDATE outbox_messages
SET status = 'pending', attempts = GREATEST(attempts - 1, 0), locked_by = NULL, locked_at = NULL
WHERE id IN ('00000000-0000-0000-0000-000000000000','ffffffff-ffff-ffff-ffff-ffffffffffff')
AND status = 'processing'
AND locked_by = _utf8mb4 X'72656c61792d31'
