DELETE
FROM outbox_messages_waiters w
WHERE w.alive_until < now() - interval '1 minute'
OR NOT EXISTS (
  SELECT 1
  FROM pg_stat_activity a
  WHERE a.pid = w.pid)
