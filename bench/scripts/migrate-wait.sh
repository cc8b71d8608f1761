#!/usr/bin/env bash
# The longest wait of the application's inserts while `outbox-relay migrate` upgrades a
# ROWS-row version-1 table (one row in PENDING_EVERY pending, the rest sent, as a live outbox
# with a day of retention holds; PENDING_EVERY=1 for a table that is all backlog): WRITERS
# pgbench clients insert one row per transaction (as an application does) for DURATION
# seconds (60); after 5 s `migrate` applies every later version. Prints
# migrate's duration and output (with each step's duration: RUST_LOG defaults to debug for the
# migration runner), then the insert latencies (max, p99, count) of transactions that ended
# during `migrate`, and the same before it, for comparison.
#
#   bench/scripts/migrate-wait.sh                       # 1,000,000 rows, 4 writers
#   PENDING_EVERY=1 bench/scripts/migrate-wait.sh        # every row pending
#   ROWS=200000 WRITERS=2 RELAY_BIN=target/release/outbox-relay bench/scripts/migrate-wait.sh
#   RELAY_DATABASE__PARTITION_INTERVAL=1h bench/scripts/migrate-wait.sh   # and partition it in place
#
# Needs psql, pgbench and python3; DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test);
# RELAY_BIN (default target/debug/outbox-relay).
set -euo pipefail
ROWS=${ROWS:-1000000}
PENDING_EVERY=${PENDING_EVERY:-100}
WRITERS=${WRITERS:-4}
DB=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RELAY_BIN:-$ROOT/target/debug/outbox-relay}
unset RELAY_BIN # the relay would read it as a config key (RELAY_*)
WORK=$(mktemp -d)
TABLE=bench_migrate_$$
drop_sql() {
    echo "DROP TABLE IF EXISTS $TABLE CASCADE; DROP TABLE IF EXISTS ${TABLE}_waiters;
          DROP FUNCTION IF EXISTS ${TABLE}_wakeup(); DROP FUNCTION IF EXISTS ${TABLE}_notify();
          DROP FUNCTION IF EXISTS ${TABLE}_next_seq(); DROP SEQUENCE IF EXISTS ${TABLE}_seq;
          DELETE FROM outbox_relay_schema_version WHERE table_name = '$TABLE';"
}
trap 'psql "$DB" -qc "$(drop_sql)" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT

# A version-1 table as an earlier release's `migrate` left it, recorded at version 1.
sed "s/outbox_messages/$TABLE/g" "$ROOT/sql/0001_outbox_messages.sql" >"$WORK/v1.sql"
psql "$DB" -q -v ON_ERROR_STOP=1 -f "$WORK/v1.sql" >/dev/null 2>&1
psql "$DB" -q -v ON_ERROR_STOP=1 <<SQL
CREATE TABLE IF NOT EXISTS outbox_relay_schema_version (
    table_name text PRIMARY KEY, version integer NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
INSERT INTO outbox_relay_schema_version (table_name, version) VALUES ('$TABLE', 1);
INSERT INTO $TABLE (aggregate_type, aggregate_id, event_type, payload, status, sent_at)
SELECT 'order', 'a' || (i % 1000), 'created', jsonb_build_object('i', i),
       CASE WHEN i % $PENDING_EVERY = 0 THEN 'pending' ELSE 'sent' END,
       CASE WHEN i % $PENDING_EVERY = 0 THEN NULL ELSE now() END
FROM generate_series(1, $ROWS) i;
VACUUM ANALYZE $TABLE;
SQL
echo "table $TABLE: $ROWS rows at schema version 1, one in $PENDING_EVERY pending" >&2

cat >"$WORK/insert.sql" <<SQL
INSERT INTO $TABLE (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'w' || :client_id, 'written', '{"w": 1}');
SQL
DURATION=${DURATION:-60}
(cd "$WORK" && pgbench -n -c "$WRITERS" -j "$WRITERS" -T "$DURATION" -f insert.sql -l --log-prefix=lat "$DB" >pgbench.out 2>&1) &
PGB=$!
sleep 5
START=$(date +%s.%N)
set +e
RUST_LOG=${RUST_LOG:-info,outbox_relay::store::schema=debug} \
    RELAY_DATABASE__URL="$DB" RELAY_DATABASE__TABLE="$TABLE" "$BIN" migrate >"$WORK/migrate.out" 2>&1
CODE=$?
set -e
END=$(date +%s.%N)
wait "$PGB"
echo "migrate exit $CODE in $(echo "$END - $START" | bc)s:"
sed -e 's/\x1b\[[0-9;]*m//g' -e 's/^/  /' "$WORK/migrate.out"
python3 - "$START" "$END" "$WORK" <<'PY'
import glob, sys
start, end, work = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
during, before = [], []
for path in glob.glob(work + "/lat.*"):
    for line in open(path):
        f = line.split()
        # client, transaction, latency (us), script, epoch s, us
        lat, t = int(f[2]) / 1e6, int(f[4]) + int(f[5]) / 1e6
        if start <= t <= end + 0.5:
            during.append(lat)
        elif t < start:
            before.append(lat)
def show(name, xs):
    if not xs:
        print(f"{name}: no transactions"); return
    xs.sort()
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    print(f"{name}: {len(xs)} inserts, max {xs[-1]*1000:.0f} ms, p99 {p99*1000:.1f} ms")
show("inserts ending during migrate", during)
show("inserts before migrate", before)
PY
