DELETE
FROM outbox_messages
WHERE id IN ( (
    SELECT id
    FROM outbox_messages
    WHERE status = 'sent'
    AND sent_at < now() - $1::bigint * interval '1 millisecond'
    ORDER BY sent_at
    LIMIT $2)
  UNION ALL (
    SELECT id
    FROM outbox_messages
    WHERE status = 'expired'
    AND expires_at < now() - $1::bigint * interval '1 millisecond'
    ORDER BY expires_at
    LIMIT $2)
  LIMIT $2)
