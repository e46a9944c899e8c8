#!/usr/bin/env bash
# The side-by-side overhead benchmark: builds pyprobe (release) and the C floor
# tracer, fetches the test interpreters, then runs benches/sidebyside.py.
#   scripts/bench.sh [--runs N] [--python 3.9,3.15] [--workloads fib,mixed] [--configs ...]
# It prints the tables and rewrites docs/benchmarks.md (dated, the machine described).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-pythons.sh >/dev/null
cargo build --release --quiet
gcc -O2 -Wall -o target/floor benches/floor/floor.c
# The real-program workload: black, pure Python (no compiled wheel), installed once.
if [ ! -d target/pypi/black/black ]; then
  echo "bench: installing black (pure Python) into target/pypi/black" >&2
  python3 -m pip install --quiet --target target/pypi/black --no-compile \
    --python-version 3.9 --implementation py --only-binary=:all: \
    black==24.10.0 click mypy_extensions packaging pathspec platformdirs tomli typing_extensions
fi
if [ ! -d target/pypi/docutils/docutils ]; then
  echo "bench: installing docutils (pure Python) into target/pypi/docutils" >&2
  python3 -m pip install --quiet --target target/pypi/docutils --no-compile \
    --python-version 3.9 --implementation py --only-binary=:all: docutils==0.21.2
fi
exec python3 benches/sidebyside.py "$@"
