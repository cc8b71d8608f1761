ANALYZE (SKIP_LOCKED) outbox_messages
