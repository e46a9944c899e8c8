#!/usr/bin/env bash
# The main job on the bundled demo target: build pyprobe, start fixtures/demo.py under
# Debian's CPython 3.9 (which carries SDT probes), record it, and print the report.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian's CPython 3.9 has every function probe (3.11's entry probe is broken upstream,
# 3.12-3.14 have none); the project's script fetches it unpacked, without installing.
scripts/fetch-pythons.sh 3.9 >/dev/null
PYTHON=.pythons/bin/python3.9

echo "demo: building pyprobe"
cargo build --release --quiet

echo "demo: recording fixtures/demo.py under pyprobe (every call, GC, import and audit event)"
target/release/pyprobe record -o demo.pyprobe -- "$PYTHON" fixtures/demo.py --seconds 3
echo
target/release/pyprobe report demo.pyprobe --limit 15
echo
echo "demo: the recording is demo.pyprobe; \`target/release/pyprobe report demo.pyprobe --format json\` gives the same as JSON"
