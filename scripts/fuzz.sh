#!/usr/bin/env bash
# Fuzzes the parsers of hostile input with cargo fuzz (libFuzzer): the SDT argument
# parser and evaluator, the ELF/SDT note reader, and the recording reader with the
# report behind it. The targets run side by side for SECONDS (default 60), each
# starting from the seed corpus in fuzz/seeds/TARGET; what libFuzzer adds goes to fuzz/corpus/TARGET
# (git-ignored). A crash fails the script and leaves the input in fuzz/artifacts/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# By default the targets are built optimised with AddressSanitizer (for long runs by
# hand). FUZZ_BUILD=quick builds them unoptimised and without a sanitizer: a third of
# the build time, for the bounded runs in CI.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds=${1:-60}
shift || true

if ! command -v cargo-fuzz >/dev/null; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet
fi
# cargo fuzz passes nightly-only flags (-Zsanitizer=...); the toolchain here is stable,
# and RUSTC_BOOTSTRAP lets it accept them.
export RUSTC_BOOTSTRAP=1

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list)
fi

case "${FUZZ_BUILD:-full}" in
    quick) build=(--dev -s none) ;;
    *) build=(-O) ;;
esac

echo "== cargo fuzz build ${build[*]} (${targets[*]})"
cargo fuzz build "${build[@]}"

# The targets run side by side: each is one process, and a bounded run in CI then
# takes SECONDS, not SECONDS per target.
echo "== fuzzing ${targets[*]} for ${seconds}s, side by side"
declare -A pids logs
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    logs[$t]=$(mktemp)
    cargo fuzz run "${build[@]}" "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 >"${logs[$t]}" 2>&1 &
    pids[$t]=$!
done
failed=0
for t in "${targets[@]}"; do
    log=${logs[$t]}
    status=0
    wait "${pids[$t]}" || status=$?
    if [ "$status" -ne 0 ]; then
        grep -v "^\s*\[" "$log" | tail -n 60 | cut -c1-300
        echo "fuzz target $t FAILED (exit $status); the input is in fuzz/artifacts/$t/"
        failed=1
    else
        execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
        speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
        cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
        echo "$t: ${execs:-?} executions (${speed:-?}/s), ${cov:-cov: ?}, corpus $(ls "corpus/$t" | wc -l) inputs, no crash"
    fi
    rm -f "$log"
done
exit $failed
