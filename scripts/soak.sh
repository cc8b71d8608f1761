#!/usr/bin/env bash
# The long form of the fault-injection suite (tests/faults.rs): 25 SIGKILLs of a replica under
# load, 30 s broker and database connection cuts, three real restarts each of RabbitMQ and
# PostgreSQL, the poison rows, the huge aggregate run to completion.
#
#   scripts/soak.sh                 everything (about 10 minutes after the build)
#   scripts/soak.sh sigkill         only the tests whose name contains "sigkill"
#
# Starts the services first (scripts/services.sh), runs the tests one at a time in a release
# build, keeps the whole output in target/soak-<time>.log and prints the FAULT-SUMMARY lines at
# the end. The crash-loop test's crash switch is the cargo feature `fault-injection`, which the
# tests' dev-dependency turns on in release builds too.
#
# It stops and restarts RabbitMQ and PostgreSQL on this machine: do not run it while anything
# else uses them.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
mkdir -p target
log="target/soak-$(date +%Y%m%d-%H%M%S).log"
started=$(date +%s)
set +e
OUTBOX_SOAK=1 cargo test --release --test faults -- --nocapture --test-threads=1 "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
printf '\n== soak summary (%ss, exit %s, full log %s) ==\n' "$(( $(date +%s) - started ))" "$status" "$log"
# With --nocapture a summary can follow libtest's "test name ... " on the same line.
grep -ho 'FAULT-SUMMARY.*' "$log" || true
grep -h '^test result:' "$log" || true
awk '/^failures:$/ { n++ } n == 2 && /^    [a-z_]+$/ { print "FAILED:" $0 }' "$log"
exit "$status"
