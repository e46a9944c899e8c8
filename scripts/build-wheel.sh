#!/usr/bin/env bash
# Builds the pip/pipx wheel of pyprobe into target/wheels/: the release binary, its
# man pages and its shell completions, packed by maturin's binary mode. Needs a Rust
# toolchain and a python3 (3.8+) with venv; maturin is installed into target/, pinned.
# Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."

MATURIN_VERSION=1.16.0
PYTHON=${PYTHON:-python3}
tools=target/wheel-tools
data=target/wheel-data/data/share

if [ ! -x "$tools/bin/maturin" ]; then
    echo "build-wheel: installing maturin $MATURIN_VERSION into $tools" >&2
    rm -rf "$tools"
    "$PYTHON" -m venv "$tools" || {
        echo "build-wheel: $PYTHON cannot make a virtual environment (Debian: apt-get install python3-venv; or set PYTHON=...)" >&2
        exit 1
    }
    "$tools/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION"
fi

echo "build-wheel: building the release binary" >&2
cargo build --release --locked --quiet --bin pyprobe

# Generated from the binary itself, so they describe exactly the CLI in the wheel.
rm -rf target/wheel-data
mkdir -p "$data/man/man1" "$data/bash-completion/completions" \
    "$data/zsh/site-functions" "$data/fish/vendor_completions.d"
target/release/pyprobe man --dir "$data/man/man1"
target/release/pyprobe completions bash > "$data/bash-completion/completions/pyprobe"
target/release/pyprobe completions zsh > "$data/zsh/site-functions/_pyprobe"
target/release/pyprobe completions fish > "$data/fish/vendor_completions.d/pyprobe.fish"

echo "build-wheel: packing the wheel" >&2
rm -rf target/wheels
"$tools/bin/maturin" build --release --locked --quiet --out target/wheels >&2
wheel=$(ls target/wheels/*.whl)
echo "build-wheel: $(du -h "$wheel" | cut -f1) $wheel" >&2
echo "$wheel"
