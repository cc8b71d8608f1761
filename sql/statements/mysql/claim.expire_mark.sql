UPDATE outbox_messages
SET status = 'expired', locked_by = NULL, locked_at = NULL, last_error = CONCAT('expired: its deadline ', DATE_FORMAT(expires_at, '%Y-%m-%dT%H:%i:%s.%fZ'), ' passed before it was published (after ', attempts, ' attempts)')
WHERE seq IN (7,8)
