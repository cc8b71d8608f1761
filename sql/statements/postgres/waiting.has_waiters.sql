SELECT to_regclass('outbox_messages_waiters') IS NOT NULL
