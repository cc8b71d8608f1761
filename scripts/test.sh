#!/usr/bin/env bash
# The whole test suite against real PostgreSQL, RabbitMQ and Kafka (tansu): starts the
# services if needed (building tansu the first time), then runs every test of every workspace
# member (the relay crate, bench/ and testkit/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
exec cargo test --workspace --all-targets "$@"
