#!/usr/bin/env bash
# Build the SDT / embedded-Python test fixtures into fixtures/build/ (git-ignored).
#
#   sdt_fixture_pie     -fPIE -pie, probes in the executable
#   sdt_fixture_nopie   -fno-pie -no-pie, probes in the executable
#   libsdt_fixture.so   the probes (sdt_lib.c + sdt_sema.c) as a shared library
#   sdt_fixture_lib     main only; loads libsdt_fixture.so via rpath $ORIGIN
#   sdt_threads         one probe fired by the main thread alone, then by threads at once
#   embed_python3.11    embeds Debian's libpython3.11.so.1.0 (python SDT probes in a .so)
#   libnative_calls.so  C functions called from Python through ctypes (--native tests)
#   libnative_calls_stripped.so  the same without .symtab (named by .eh_frame)
#
# Idempotent: a target is rebuilt only if missing or older than one of its
# sources (or this script). Works from any cwd. Env: CC (default gcc).
# Fixture usage/output format: see fixtures/sdt/sdt_fixture.c and sdt_lib.c.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/fixtures/sdt"
EMBED="$ROOT/fixtures/embed"
OUT="$ROOT/fixtures/build"
SELF="$ROOT/scripts/build-fixtures.sh"
CC="${CC:-gcc}"
# -O2 so gcc emits varied operand forms in the notes; -g only for debugging.
CFLAGS=(-O2 -g -Wall -Wextra)
# Debian's config, not a pyenv shim: we want the system libpython with SDT notes.
PYCONFIG=/usr/bin/python3.11-config

mkdir -p "$OUT"

# stale TARGET DEP... -> true if TARGET is missing or older than any DEP.
stale() {
    local t="$1"; shift
    [[ -e "$t" ]] || return 0
    local d
    for d in "$@"; do [[ "$d" -nt "$t" ]] && return 0; done
    return 1
}

# build TARGET "DEP..." CC-ARGS... -> runs `$CC CC-ARGS... -o TMP` when stale, then
# renames TMP into place so an interrupted build never leaves a fresh-looking target.
build() {
    local t="$1" deps="$2"; shift 2
    # shellcheck disable=SC2086
    if stale "$t" $deps "$SELF"; then
        echo "build-fixtures: building ${t#"$ROOT"/}"
        "$CC" "$@" -o "$t.tmp.$$"
        mv -f "$t.tmp.$$" "$t"
    else
        echo "build-fixtures: up to date ${t#"$ROOT"/}"
    fi
}

if ! echo '#include <sys/sdt.h>' | "$CC" -E -x c - >/dev/null 2>&1; then
    echo "build-fixtures: <sys/sdt.h> not found; apt-get install systemtap-sdt-dev" >&2
    exit 1
fi

LIB_DEPS="$SRC/sdt_lib.c $SRC/sdt_sema.c $SRC/sdt_fixture.h"
SDT_DEPS="$SRC/sdt_fixture.c $LIB_DEPS"
LIB_SRCS=("$SRC/sdt_lib.c" "$SRC/sdt_sema.c")

build "$OUT/sdt_fixture_pie" "$SDT_DEPS" \
    "${CFLAGS[@]}" -fPIE -pie "$SRC/sdt_fixture.c" "${LIB_SRCS[@]}"
build "$OUT/sdt_fixture_nopie" "$SDT_DEPS" \
    "${CFLAGS[@]}" -fno-pie -no-pie "$SRC/sdt_fixture.c" "${LIB_SRCS[@]}"
build "$OUT/libsdt_fixture.so" "$LIB_DEPS" \
    "${CFLAGS[@]}" -fPIC -shared -Wl,-soname,libsdt_fixture.so "${LIB_SRCS[@]}"
build "$OUT/sdt_fixture_lib" "$SRC/sdt_fixture.c $SRC/sdt_fixture.h $OUT/libsdt_fixture.so" \
    "${CFLAGS[@]}" -fPIE -pie "$SRC/sdt_fixture.c" \
        -L"$OUT" -lsdt_fixture '-Wl,-rpath,$ORIGIN'

build "$OUT/sdt_threads" "$SRC/sdt_threads.c" \
    "${CFLAGS[@]}" -pthread "$SRC/sdt_threads.c"

# No frame pointers and no sibling calls: the unwinder must follow .eh_frame, and
# every C frame of the chain must be on the stack.
build "$OUT/libnative_calls.so" "$ROOT/fixtures/native/native_calls.c" \
    "${CFLAGS[@]}" -fPIC -shared -fomit-frame-pointer -fno-optimize-sibling-calls \
        "$ROOT/fixtures/native/native_calls.c"
# The same, stripped of .symtab: its static functions keep only their unwind entries.
if stale "$OUT/libnative_calls_stripped.so" "$OUT/libnative_calls.so"; then
    echo "build-fixtures: building fixtures/build/libnative_calls_stripped.so"
    strip --strip-all -o "$OUT/libnative_calls_stripped.so.tmp.$$" "$OUT/libnative_calls.so"
    mv -f "$OUT/libnative_calls_stripped.so.tmp.$$" "$OUT/libnative_calls_stripped.so"
fi

if [[ -x "$PYCONFIG" ]]; then
    # shellcheck disable=SC2046
    build "$OUT/embed_python3.11" "$EMBED/embed.c" \
        "${CFLAGS[@]}" $("$PYCONFIG" --includes) "$EMBED/embed.c" \
            $("$PYCONFIG" --embed --ldflags)
else
    echo "build-fixtures: $PYCONFIG missing (apt-get install libpython3.11-dev); skipping embed_python3.11" >&2
fi

# The decoder tests rely on gcc having produced these operand forms; warn if a
# different compiler/version did not (the fixture still works, coverage shrinks).
notes="$(readelf -n "$OUT/sdt_fixture_pie")"
for form in '[0-9]@\$' '[0-9]@%[a-z]' '@-\?[0-9]*(%rsp)' '@[a-z0-9_]*(%rip)' '(%r[a-z0-9]*,%r[a-z0-9]*,[1248])'; do
    grep -q -- "$form" <<<"$notes" || echo "build-fixtures: warning: no SDT argument matching /$form/ in sdt_fixture_pie" >&2
done
