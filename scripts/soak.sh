#!/usr/bin/env bash
# The long form of the fault-injection suite (tests/faults.rs): 25 SIGKILLs of a replica under
# load, 30 s broker and database connection cuts, three real restarts each of RabbitMQ and
# PostgreSQL, the poison rows, the huge aggregate run to completion; then the failover round
# (tests/failover.rs, on a primary and synchronous standby of its own): three crashes of the
# primary mid-drain, each followed by the standby's promotion, a crash with a writer's
# transaction open, and a primary turned read-only before a switchover, each outage 15 s.
#
#   scripts/soak.sh                 everything (about 12 minutes after the build)
#   scripts/soak.sh sigkill         only the tests whose name contains "sigkill"
#   scripts/soak.sh primary         only the failover round's tests (their names say "primary")
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
# --no-fail-fast: a failure in faults still lets the failover round run.
OUTBOX_SOAK=1 cargo test --release --no-fail-fast --test faults --test failover \
  -- --nocapture --test-threads=1 "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
printf '\n== soak summary (%ss, exit %s, full log %s) ==\n' "$(( $(date +%s) - started ))" "$status" "$log"
# With --nocapture a summary can follow libtest's "test name ... " on the same line.
grep -ho 'FAULT-SUMMARY.*' "$log" || true
grep -h '^test result:' "$log" || true
# libtest lists the failed tests in the second "failures:" block of each test binary.
awk '/^failures:$/ { n++ } n > 0 && n % 2 == 0 && /^    [a-z_]+$/ { print "FAILED:" $0 }' "$log"
exit "$status"
