#!/usr/bin/env bash
# The main job on the bundled demo target: build pyprobe, record fixtures/demo.py run
# by the machine's python3 into profile.svg (in the mode that interpreter supports:
# exact events where it has SDT probes, sampling where it has none), print the report
# and say where the flame graph is.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || { echo "demo: no $PYTHON on PATH (set PYTHON=...)" >&2; exit 1; }

echo "demo: building pyprobe (release)"
cargo build --release --quiet

echo "demo: recording fixtures/demo.py under $($PYTHON -c 'import sys; print(sys.executable, sys.version.split()[0])')"
target/release/pyprobe record --force -o profile.svg -- "$PYTHON" fixtures/demo.py --seconds 3
echo
target/release/pyprobe report profile.pyprobe --limit 12
echo
echo "demo: flame graph written to $(pwd)/profile.svg - open it in a web browser"
echo "      (e.g. xdg-open profile.svg); the recording is profile.pyprobe: try"
echo "      target/release/pyprobe flame profile.pyprobe --format speedscope"
