#!/usr/bin/env bash
# Local Kafka-protocol broker for development and tests: tansu (crates.io, Apache-2.0).
#
#   scripts/tansu.sh install            build tansu once into the cache (about 15 min on 2 cores)
#   scripts/tansu.sh start                 start it on 127.0.0.1:9092 (memory storage)
#   scripts/tansu.sh stop | status
#   scripts/tansu.sh topic NAME [PARTITIONS]   create a topic (tansu does not auto-create)
#   scripts/tansu.sh path               print the tansu binary's path
#
# Environment: OUTBOX_RELAY_CACHE (default /var/cache/outbox-relay) holds the build, the log and
# the pid file; TANSU_PORT (default 9092). Memory storage only: tansu's postgres engine needs a
# schema that its crate does not ship, so a broker restart loses what it held.
set -euo pipefail

TANSU_VERSION=0.6.0
CACHE=${OUTBOX_RELAY_CACHE:-/var/cache/outbox-relay}
BIN="$CACHE/tansu/bin/tansu"
PORT=${TANSU_PORT:-9092}
PIDFILE="$CACHE/tansu-$PORT.pid"
LOG="$CACHE/tansu-$PORT.log"

say() { printf 'tansu.sh: %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

install() {
    if [ -x "$BIN" ] && "$BIN" --version 2>/dev/null | grep -q "$TANSU_VERSION"; then
        return 0
    fi
    say "building tansu $TANSU_VERSION into $CACHE/tansu (once per machine, ~15 minutes)"
    mkdir -p "$CACHE"
    cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,postgres \
        --root "$CACHE/tansu"
}

start() {
    install
    if port_open; then
        say "something already listens on 127.0.0.1:$PORT; assuming it is tansu"
        return 0
    fi
    mkdir -p "$CACHE"
    nohup "$BIN" broker --listener-url "tcp://127.0.0.1:$PORT" \
        --advertised-listener-url "tcp://127.0.0.1:$PORT" \
        --storage-engine "memory://tansu/" >"$LOG" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 100); do
        port_open && { say "tansu listening on 127.0.0.1:$PORT (log $LOG)"; return 0; }
        sleep 0.1
    done
    say "tansu did not start; last log lines:"; tail -20 "$LOG" >&2; return 1
}

stop() {
    if [ -f "$PIDFILE" ]; then
        kill "$(cat "$PIDFILE")" 2>/dev/null || true
        rm -f "$PIDFILE"
    fi
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) port_open && echo "tansu up on 127.0.0.1:$PORT" || { echo "tansu down"; exit 1; } ;;
    topic) "$BIN" topic create "$2" --partitions "${3:-3}" --broker "tcp://127.0.0.1:$PORT" ;;
    path) echo "$BIN" ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
esac
