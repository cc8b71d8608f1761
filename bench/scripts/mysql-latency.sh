#!/usr/bin/env bash
# End-to-end latency of a MySQL/MariaDB outbox at a steady insert rate: a writer commits one
# row per transaction at RATE rows/s for SECONDS into a fresh table while the relay (stdout
# sink, output discarded) drains it; then p50/p90/p99/max of sent_at - created_at from the table
# itself (MariaDB's PERCENTILE_CONT). Local MariaDB only (127.0.0.1:3306, root, database test).
#
#   bench/scripts/mysql-latency.sh [RELAY_BIN] [RATE] [SECONDS] [POLL_INTERVAL]
#   e.g. bench/scripts/mysql-latency.sh target/release/outbox-relay 1000 30 1s
set -euo pipefail
BIN=${1:-target/release/outbox-relay}
RATE=${2:-1000}
SECONDS_=${3:-30}
POLL=${4:-1s}
TABLE=bench_mysql_latency_$$
URL=mysql://root@127.0.0.1:3306/test
DB=(mariadb -h 127.0.0.1 -P 3306 -u root test)

export RELAY_DATABASE__URL=$URL RELAY_DATABASE__TABLE=$TABLE RELAY_PUBLISHER__KIND=stdout \
    RELAY_METRICS__LISTEN= RELAY_RELAY__POLL_INTERVAL=$POLL RELAY_CLEANUP__RETENTION=1h
"$BIN" migrate >/dev/null
"$BIN" run >/dev/null 2>/tmp/$TABLE.log &
RELAY=$!
trap 'kill $RELAY 2>/dev/null || true; "${DB[@]}" -e "DROP TABLE IF EXISTS $TABLE; DELETE FROM outbox_relay_schema_version WHERE table_name = '"'$TABLE'"'"' EXIT
sleep 2
python3 - "$RATE" "$SECONDS_" "$TABLE" <<'PY' | "${DB[@]}"
import sys, time
rate, seconds, table = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
start, n = time.monotonic(), 0
while True:
    now = time.monotonic() - start
    if now >= seconds:
        break
    due = int(now * rate)
    while n < due:
        print(f"INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) "
              f"VALUES ('order', 'k{n % 1000}', 'created', '{{\"n\": {n}}}');")
        n += 1
    sys.stdout.flush()
    time.sleep(0.002)
PY
sleep 3
"${DB[@]}" -e "
SELECT COUNT(*) AS rows_, SUM(status = 'sent') AS sent,
  ROUND(MAX(p50) / 1000, 1) AS p50_ms, ROUND(MAX(p90) / 1000, 1) AS p90_ms,
  ROUND(MAX(p99) / 1000, 1) AS p99_ms, ROUND(MAX(lat) / 1000, 1) AS max_ms
FROM (SELECT status, TIMESTAMPDIFF(MICROSECOND, created_at, sent_at) AS lat,
        PERCENTILE_CONT(0.5) WITHIN GROUP (ORDER BY TIMESTAMPDIFF(MICROSECOND, created_at, sent_at)) OVER () AS p50,
        PERCENTILE_CONT(0.9) WITHIN GROUP (ORDER BY TIMESTAMPDIFF(MICROSECOND, created_at, sent_at)) OVER () AS p90,
        PERCENTILE_CONT(0.99) WITHIN GROUP (ORDER BY TIMESTAMPDIFF(MICROSECOND, created_at, sent_at)) OVER () AS p99
      FROM $TABLE) x;"
