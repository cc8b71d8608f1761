SELECT last_value, is_called
FROM outbox_messages_seq
