SELECT EXISTS (
  SELECT 1
  FROM outbox_messages
  WHERE status = 'pending')
