VACUUM (ANALYZE, TRUNCATE false) outbox_messages
