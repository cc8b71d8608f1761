#!/usr/bin/env bash
# How relays sharing a MySQL/MariaDB table drain it together: ROWS ready rows over 1,000
# aggregates in a fresh table, then REPLICAS relays (stdout sink, output discarded, ordering
# aggregate) started at once; prints the seconds until no row is unsent, and how many lines
# the relays wrote (a row sent twice would show as more lines than rows). Local MariaDB only
# (127.0.0.1:3306, root, database test; `seq_1_to_N` is MariaDB's sequence engine).
#
#   bench/scripts/mysql-replicas.sh [RELAY_BIN] [REPLICAS] [ROWS]
#   e.g. for n in 1 2 3; do bench/scripts/mysql-replicas.sh target/release/outbox-relay $n 30000; done
set -euo pipefail
BIN=${1:-target/release/outbox-relay}
REPLICAS=${2:-3}
ROWS=${3:-30000}
TABLE=bench_mysql_replicas_$$
OUT=$(mktemp -d)
DB=(mariadb -h 127.0.0.1 -P 3306 -u root test)

export RELAY_DATABASE__URL=mysql://root@127.0.0.1:3306/test RELAY_DATABASE__TABLE=$TABLE \
    RELAY_PUBLISHER__KIND=stdout RELAY_METRICS__LISTEN= RELAY_RELAY__ORDERING=aggregate \
    RUST_LOG=warn
PIDS=()
cleanup() {
    kill "${PIDS[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    "${DB[@]}" -e "DROP TABLE IF EXISTS $TABLE; DELETE FROM outbox_relay_schema_version WHERE table_name = '$TABLE'"
    rm -rf "$OUT"
}
trap cleanup EXIT
"$BIN" migrate >/dev/null
"${DB[@]}" -e "INSERT INTO $TABLE (aggregate_type, aggregate_id, event_type, payload) \
    SELECT 'order', CONCAT('order-', seq % 1000), 'order.created', '{\"n\": 1}' FROM seq_1_to_$ROWS"
START=$(date +%s.%N)
for i in $(seq 1 "$REPLICAS"); do
    RELAY_RELAY__INSTANCE_ID=bench-replica-$i "$BIN" run >"$OUT/$i.jsonl" 2>"$OUT/$i.log" &
    PIDS+=($!)
done
while [ "$("${DB[@]}" -N -e "SELECT COUNT(*) FROM $TABLE WHERE status <> 'sent'")" != 0 ]; do
    sleep 0.2
done
END=$(date +%s.%N)
kill "${PIDS[@]}" 2>/dev/null || true
wait 2>/dev/null || true
echo "replicas=$REPLICAS rows=$ROWS seconds=$(echo "$END - $START" | bc) lines=$(cat "$OUT"/*.jsonl | wc -l)"
