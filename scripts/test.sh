#!/usr/bin/env bash
# The test command: set the machine up for the tests where something is missing
# (Debian packages, the unprivileged test user), fetch the test interpreters
# (cached), build the C fixtures, check formatting and lints, then run every test
# against real processes.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup-test-machine.sh
scripts/fetch-pythons.sh
scripts/build-fixtures.sh

echo "== cargo fmt --check"
cargo fmt --check
echo "== cargo clippy"
cargo clippy --all-targets --quiet -- -D warnings
echo "== cargo test"
# The interpreters must be there: a missing one fails the tests instead of skipping.
export PYPROBE_REQUIRE_PYTHONS=1
# Release: the tests drive pyprobe against live programs, and the ring engine's
# consumer must keep up with them as it does for users.
# Every test binary runs even after a failure, so one run shows every failure.
cargo test --release --all-targets --no-fail-fast
