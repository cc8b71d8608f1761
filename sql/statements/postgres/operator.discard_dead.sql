DELETE
FROM outbox_messages
WHERE status = 'failed'
AND ($2
  OR id = ANY($1))
RETURNING id
