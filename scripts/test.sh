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

echo "== cargo fmt --all --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings
echo "== cargo test"
# The interpreters must be there: a missing one fails the tests instead of skipping.
export PYPROBE_REQUIRE_PYTHONS=1
# Release: the tests drive pyprobe against live programs, and the ring engine's
# consumer must keep up with them as it does for users.
# Every test runs even after a failure, so one run shows every failure.
failed=0
cargo test --release --workspace --features test-switches --lib --bins --benches --no-fail-fast || failed=1
# The examples in the API documentation compile and run as written.
cargo test --release --workspace --doc || failed=1
# Signals and the timer, in a process of its own with one thread.
cargo test --release --features test-switches --test tick || failed=1
# The pip/pipx wheel, for the integration test that installs it into fresh environments.
scripts/build-wheel.sh >/dev/null || failed=1
# The crates' dependencies are the architecture's (docs/ARCHITECTURE.md).
scripts/check-architecture.sh || failed=1
# The integration tests run two at a time, except those whose subject is timing
# (sampling shares and rates, the overhead budget, pyprobe keeping up with the ring, 50 kills
# of pyprobe, 10,000 threads, the views replayed on an idle CPU while recording): those run
# alone afterwards, as on a machine with nothing else to do. A server kept serving while
# pyprobe is stopped is timed too, against bounds made for a loaded machine: those tests
# run last, two at a time with nothing else beside them.
ALONE=(budget:: sample_accuracy:: sigkill:: ring:: nothing_lost:: native:: many_threads::
       top_live::top_samples_at_the_rate_asked_for
       stored_views::the_views_kept_at_the_end_were_replayed_while_recording)
PAIRED=(stopped::)
skip=()
for m in "${ALONE[@]}" "${PAIRED[@]}"; do skip+=(--skip "$m"); done
# Built with the switches that let tests make pyprobe fail on purpose.
cargo test --release --features test-switches --test integration -- "${skip[@]}" || failed=1
echo "== cargo test: the timing tests, one at a time"
cargo test --release --features test-switches --test integration -- --test-threads=1 "${ALONE[@]}" \
    || failed=1
echo "== cargo test: the stopped-pyprobe tests, two at a time"
cargo test --release --features test-switches --test integration -- --test-threads=2 "${PAIRED[@]}" \
    || failed=1
exit $failed
