SELECT GET_LOCK(CONCAT('outbox-relay:claim:', LEFT(SHA2(CONCAT(COALESCE(?, DATABASE()), '.', ?), 256), 40)), ?)
