#!/usr/bin/env bash
# Starts what the relay and its tests need on a development machine, idempotently:
# PostgreSQL (127.0.0.1:5432), MariaDB (127.0.0.1:3306, root without a password, database
# `test`), RabbitMQ (127.0.0.1:5672), tansu, a Kafka-protocol broker
# (127.0.0.1:9092; built once into the cache by scripts/tansu.sh, ~15 minutes the first time),
# NATS with JetStream (127.0.0.1:4222, store in /var/lib/nats-server), Redis (127.0.0.1:6379,
# no persistence: a test server), Prometheus's promtool for the deploy/ checks, OpenSSL's
# headers for rdkafka, and Chromium with its WebDriver for the console's browser tests.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'services.sh: %s\n' "$*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {
    for _ in $(seq 1 "${3:-600}"); do port_open "$1" && return 0; sleep 0.1; done
    say "$2 did not come up on 127.0.0.1:$1"; return 1
}

if ! port_open 5432; then
    say "starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
    wait_port 5432 PostgreSQL
fi
psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" | grep -q 1 \
    || psql -h 127.0.0.1 -U postgres -d postgres -qc "CREATE DATABASE test"

# MariaDB (MySQL outboxes, tests/mysql.rs): Debian's mariadb-server, root over TCP without a
# password, database `test`.
if ! port_open 3306; then
    if ! command -v mariadbd >/dev/null && [ ! -x /usr/sbin/mariadbd ]; then
        say "installing mariadb-server from Debian's packages"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mariadb-server mariadb-client >/dev/null
    fi
    say "starting MariaDB"
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
    if [ ! -d /var/lib/mysql/mysql ]; then
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
    fi
    (cd / && nohup mariadbd-safe --user=mysql --bind-address=127.0.0.1 --port=3306 >/dev/null 2>&1 &)
    wait_port 3306 MariaDB 600
fi
if ! mariadb -h 127.0.0.1 -P 3306 -u root -e "SELECT 1" >/dev/null 2>&1; then
    say "letting root connect to MariaDB over 127.0.0.1 without a password (test server)"
    mariadb -u root -e "ALTER USER root@localhost IDENTIFIED VIA unix_socket OR mysql_native_password USING PASSWORD('')"
fi
mariadb -h 127.0.0.1 -P 3306 -u root -e "CREATE DATABASE IF NOT EXISTS test"

if ! port_open 5672; then
    say "starting RabbitMQ"
    rabbitmq-server -detached
    wait_port 5672 RabbitMQ 1200
fi

# NATS JetStream (publisher.kind = "nats", tests/nats.rs): Debian's `nats-server`, JetStream on.
if ! port_open 4222; then
    if ! command -v nats-server >/dev/null && [ ! -x /usr/sbin/nats-server ]; then
        say "installing nats-server from Debian's packages"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nats-server >/dev/null
    fi
    say "starting nats-server with JetStream"
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server || echo /usr/sbin/nats-server)" -- \
        -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
    wait_port 4222 nats-server
fi

# Redis Streams (publisher.kind = "redis"; tests/redis.rs): Debian's redis-server, in memory only.
if ! port_open 6379; then
    if ! command -v redis-server >/dev/null; then
        say "installing redis-server from Debian's packages"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    fi
    say "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_port 6379 Redis
fi

# rdkafka's Kafka TLS/SASL links the system OpenSSL: its headers must be there to build.
if ! pkg-config --exists openssl 2>/dev/null; then
    say "installing libssl-dev and pkg-config from Debian's packages (Kafka TLS/SASL)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libssl-dev pkg-config >/dev/null
fi

# tests/deploy.rs runs promtool and tests/ops.rs a real Prometheus (Debian's `prometheus`).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    say "installing prometheus (promtool) from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# tests/console.rs drives the web console in a headless Chromium through chromedriver.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    say "installing chromium and chromium-driver from Debian's packages (console browser tests)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation >/dev/null
fi

scripts/tansu.sh start
