#!/usr/bin/env bash
# Cost of the wake-up trigger on a bulk load: a ROWS-row COPY into a fresh outbox table, in one
# transaction, with the wake-up trigger of the current schema, without any trigger, and with
# schema version 3's per-row trigger (for reference). Variants alternate, REPS runs each;
# prints each run and the median per variant, and the ratio wake-up / none.
#
#   bench/scripts/bulk-copy.sh                 # 1,000,000 rows, 3 runs per variant
#   ROWS=100000 REPS=5 bench/scripts/bulk-copy.sh
#
# Needs psql and python3; DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test). The
# DDL is sql/*.sql rendered for the table by name substitution, as a user copying it would.
set -euo pipefail
ROWS=${ROWS:-1000000}
REPS=${REPS:-3}
DB=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
TABLE=bench_bulk_$$
trap 'psql "$DB" -qc "$(drop_sql)" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT

drop_sql() {
    echo "DROP TABLE IF EXISTS $TABLE CASCADE; DROP TABLE IF EXISTS ${TABLE}_waiters;
          DROP FUNCTION IF EXISTS ${TABLE}_wakeup(); DROP FUNCTION IF EXISTS ${TABLE}_notify();
          DROP FUNCTION IF EXISTS ${TABLE}_next_seq(); DROP SEQUENCE IF EXISTS ${TABLE}_seq;"
}

python3 - "$ROWS" >"$WORK/rows.tsv" <<'PY'
import sys
out = sys.stdout
for i in range(int(sys.argv[1])):
    out.write('order\ta%d\tcreated\t{"i": %d, "note": "bulk load row"}\n' % (i % 1000, i))
PY

# $1: the last schema version to apply; $2: "drop" to remove the wake-up trigger afterwards.
create() {
    psql "$DB" -qc "$(drop_sql)" >/dev/null 2>&1
    for f in "$ROOT"/sql/0*.sql; do
        v=$((10#$(basename "$f" | cut -c1-4)))
        [ "$v" -le "$1" ] && sed "s/outbox_messages/$TABLE/g" "$f"
    done >"$WORK/ddl.sql"
    psql "$DB" -q -v ON_ERROR_STOP=1 -f "$WORK/ddl.sql" >/dev/null 2>&1
    if [ "${2:-}" = drop ]; then psql "$DB" -qc "DROP TRIGGER ${TABLE}_wakeup ON $TABLE"; fi
    psql "$DB" -qc "CHECKPOINT" >/dev/null 2>&1 || true
}

copy_secs() {
    local start end
    start=$(date +%s.%N)
    psql "$DB" -q -v ON_ERROR_STOP=1 \
        -c "\\copy $TABLE (aggregate_type, aggregate_id, event_type, payload) FROM '$WORK/rows.tsv'"
    end=$(date +%s.%N)
    echo "$end - $start" | bc
}

LATEST=$(ls "$ROOT"/sql/0*.sql | tail -1 | xargs basename | cut -c1-4)
LATEST=$((10#$LATEST))
declare -A runs
for rep in $(seq 1 "$REPS"); do
    for variant in wakeup none v3; do
        case $variant in
            wakeup) create "$LATEST" ;;
            none) create "$LATEST" drop ;;
            v3) create 3 ;;
        esac
        s=$(copy_secs)
        echo "run $rep $variant: $ROWS rows in ${s}s" >&2
        runs[$variant]="${runs[$variant]:-} $s"
    done
done
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for variant in wakeup none v3; do
    m=$(echo "${runs[$variant]}" | median)
    printf '%-7s median %ss  %.0f rows/s  runs:%s\n' "$variant" "$m" "$(echo "$ROWS / $m" | bc -l)" "${runs[$variant]}"
    eval "med_$variant=$m"
done
printf 'throughput wakeup/none = %.3f   v3/none = %.3f\n' \
    "$(echo "$med_none / $med_wakeup" | bc -l)" "$(echo "$med_none / $med_v3" | bc -l)"
