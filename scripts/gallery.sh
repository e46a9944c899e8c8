#!/usr/bin/env bash
# Regenerates flamegraphs/: example flame graphs of the bundled demo (fixtures/demo.py),
# each from a real recording made by pyprobe, so the pictures in the README are what
# pyprobe draws today.
#
#   scripts/gallery.sh
#
# Trace mode: Debian's CPython 3.9 (every function probe), fetched unpacked by
# scripts/fetch-pythons.sh. Sample mode: CPython 3.13 (no function probes), where
# `record --mode sample` is available (skipped with a note otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "gallery: $*"; }

scripts/fetch-pythons.sh 3.9 3.13 > /dev/null
say "building pyprobe"
cargo build --release --quiet
PYPROBE=target/release/pyprobe
OUT=flamegraphs
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

say "recording fixtures/demo.py under CPython 3.9, trace mode"
"$PYPROBE" record --mode trace -o "$TMP/demo-3.9.pyprobe" -- \
    .pythons/bin/python3.9 fixtures/demo.py --seconds 4 > /dev/null
"$PYPROBE" flame "$TMP/demo-3.9.pyprobe" -o "$OUT/demo-trace-3.9.svg" --force \
    --title "fixtures/demo.py, CPython 3.9, traced: own time per stack"
"$PYPROBE" flame "$TMP/demo-3.9.pyprobe" -o "$OUT/demo-trace-3.9-calls.svg" --force --by calls \
    --title "fixtures/demo.py, CPython 3.9, traced: calls per stack"

say "recording fixtures/demo.py under CPython 3.13, sample mode"
if "$PYPROBE" record --mode sample -o "$TMP/demo-3.13.pyprobe" -- \
    .pythons/bin/python3.13 fixtures/demo.py --seconds 4 > /dev/null 2> "$TMP/sample.err"; then
    "$PYPROBE" flame "$TMP/demo-3.13.pyprobe" -o "$OUT/demo-sample-3.13.svg" --force \
        --title "fixtures/demo.py, CPython 3.13, sampled"
else
    say "skipped the sample-mode graph: $(tail -n 1 "$TMP/sample.err")"
fi

say "done:"
ls -l "$OUT"
