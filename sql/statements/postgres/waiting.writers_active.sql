SELECT EXISTS (
  SELECT 1
  FROM pg_locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE l.locktype = 'relation'
  AND l.relation IN ($1::oid, to_regclass('outbox_messages')::oid)
  AND l.granted
  AND a.backend_xid IS NOT NULL
  AND a.pid <> pg_backend_pid()
  AND a.application_name NOT LIKE 'outbox-relay%')
