SELECT EXISTS (
  SELECT 1
  FROM outbox_messages
  WHERE status = 'pending'
  AND sent_at IS NULL
  AND available_at <= NOW(6)
  AND (expires_at IS NULL
    OR expires_at > NOW(6))
  AND last_error LIKE 'lease expired:%')
