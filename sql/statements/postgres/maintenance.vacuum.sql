VACUUM (TRUNCATE false) outbox_messages
