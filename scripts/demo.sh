#!/usr/bin/env bash
# The main job on the bundled demo target: build pyprobe, start fixtures/demo.py under
# Debian's python3.11 (which carries SDT probes) and list the probes of the live process.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=/usr/bin/python3.11
if [[ ! -x $PYTHON ]]; then
    echo "demo: installing Debian's python3.11 (it carries the SDT probes pyprobe reads)"
    apt-get update -qq && apt-get install -y -qq python3.11 >/dev/null
fi

echo "demo: building pyprobe"
cargo build --release --quiet

"$PYTHON" fixtures/demo.py --seconds 3 &
demo_pid=$!
trap 'kill $demo_pid 2>/dev/null || true' EXIT
sleep 0.5

echo "demo: probes of the running demo (pid $demo_pid):"
target/release/pyprobe probes -p "$demo_pid"
wait "$demo_pid"
