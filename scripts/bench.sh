#!/usr/bin/env bash
# The side-by-side overhead benchmark: builds pyprobe (release) and the C floor
# tracer, fetches the test interpreter, then runs benches/sidebyside.py.
#   scripts/bench.sh [--runs N] [--python 3.9] [--workloads fib,mixed] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-pythons.sh 3.9 >/dev/null
cargo build --release --quiet
gcc -O2 -Wall -o target/floor benches/floor/floor.c
exec python3 benches/sidebyside.py "$@"
