#!/usr/bin/env bash
# Generate crates/cpython/offsets/3.X.json, the structure layouts pyprobe's frame walker reads, by
# compiling scripts/gen-offsets.c against each CPython version's own headers (with
# Py_BUILD_CORE for the internal ones) and running it.  Every number is reproducible.
#
#   scripts/gen-offsets.sh                # every version below
#   scripts/gen-offsets.sh 3.9 3.11       # only these
#
# Where the headers come from:
#   3.9               Debian bullseye libpython3.9-dev
#   3.11              Debian bookworm libpython3.11-dev (/usr/include/python3.11 when
#                     installed, else downloaded with the machine's own apt)
#   3.13              Debian trixie   libpython3.13-dev
#   3.14, 3.15        Debian sid      libpython3.X-dev
#   3.7, 3.8, 3.10, 3.12
#                     no reachable Debian suite has them (checked: bullseye, bookworm,
#                     trixie, sid, experimental): a build's include/ dir, from
#                     PYPROBE_INCLUDE_3_10=/path/include/python3.10 or else the newest
#                     $PYENV_ROOT/versions/3.10.*/include/python3.10 (pyenv's default
#                     ./configure: same release ABI as Debian's).
# The Debian packages are fetched with the private apt state of scripts/fetch-pythons.sh
# (.pythons/apt/<suite>/, created by running it for that version when missing) into
# .pythons/dev/<version>/ (git-ignored); nothing of the machine's apt setup is changed.
#
# 3.7 - 3.12 files hold offsetof/sizeof values ("kind": "offsets"); 3.13+ files say where
# in _Py_DebugOffsets each offset is ("kind": "debug_offsets"): the values themselves are
# read from the live process.
set -euo pipefail

die() { echo "gen-offsets: error: $*" >&2; exit 1; }
say() { echo "gen-offsets: $*"; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=$REPO/.pythons
OUT=$REPO/crates/cpython/offsets
ALL_VERSIONS=(3.7 3.8 3.9 3.10 3.11 3.12 3.13 3.14 3.15)
declare -A SUITE=([3.9]=bullseye [3.13]=trixie [3.14]=sid [3.15]=sid)
CC=${CC:-cc}
command -v "$CC" > /dev/null || die "no C compiler ($CC); install gcc"

apt_opts() {  # the same private apt state as scripts/fetch-pythons.sh
    local d=$CACHE/apt/$1
    printf '%s\n' \
        -o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o "Dir::State=$d" -o "Dir::State::Lists=$d/lists" -o "Dir::State::status=$d/status" \
        -o "Dir::Cache=$d/cache" -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null \
        -o Acquire::Languages=none -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
}
papt() { local n=$1; shift; local o; mapfile -t o < <(apt_opts "$n"); apt-get "${o[@]}" "$@"; }

# fetch_dev VERSION: unpack Debian's libpython3.X-dev into .pythons/dev/VERSION; prints
# the package version.
fetch_dev() {
    local v=$1 suite=${SUITE[$1]} dir=$CACHE/dev/$1 debs
    if [[ ! -f $CACHE/apt/$suite/sources.list ]]; then
        say "$v: no private apt state for $suite yet: running scripts/fetch-pythons.sh $v"
        "$REPO/scripts/fetch-pythons.sh" "$v" >&2
    fi
    if [[ ! -f $dir/.version ]]; then
        debs=$CACHE/dev/debs/$v
        rm -rf "$debs" "$dir"; mkdir -p "$debs"
        if [[ $EUID -eq 0 ]] && id _apt > /dev/null 2>&1; then chown _apt "$debs"; fi
        say "$v: apt-get download libpython$v-dev (Debian $suite)" >&2
        if ! (cd "$debs" && papt "$suite" -q download "libpython$v-dev" > "$debs/log" 2>&1); then
            # The lists may be older than the archive (sid moves): refresh them once.
            say "$v: download failed; refreshing the $suite lists" >&2
            papt "$suite" -q update > "$debs/log" 2>&1 || { cat "$debs/log" >&2; die "apt-get update ($suite) failed"; }
            (cd "$debs" && papt "$suite" -q download "libpython$v-dev" > "$debs/log" 2>&1) \
                || { cat "$debs/log" >&2; die "cannot download libpython$v-dev from Debian $suite"; }
        fi
        mkdir -p "$dir"
        dpkg -x "$debs"/libpython"$v"-dev_*.deb "$dir"
        dpkg-deb -f "$debs"/libpython"$v"-dev_*.deb Version > "$dir/.version"
        rm -rf "$debs"
    fi
    cat "$dir/.version"
}

# pyenv-style build include dir for VERSION (newest patch release), or $PYPROBE_INCLUDE_3_X.
build_include() {
    local v=$1 var="PYPROBE_INCLUDE_${1//./_}" root d best=
    if [[ -n ${!var:-} ]]; then echo "${!var}"; return 0; fi
    root=${PYENV_ROOT:-$HOME/.pyenv}
    for d in "$root"/versions/"$v".*/include/python"$v"*; do
        [[ -f $d/Python.h ]] && best=$d
    done
    [[ -n $best ]] && echo "$best"
}

generate() {
    local v=$1 incs=() source pkgver inc
    case $v in
        3.11)
            if [[ -f /usr/include/python3.11/Python.h ]]; then
                pkgver=$(dpkg-query -W -f '${Version}' libpython3.11-dev 2> /dev/null || echo '?')
                incs=(-I/usr/include/python3.11 -I/usr/include)
            else
                local dir=$CACHE/dev/3.11
                if [[ ! -f $dir/.version ]]; then
                    mkdir -p "$dir/debs"
                    say "3.11: apt-get download libpython3.11-dev (the machine's own apt)"
                    (cd "$dir/debs" && apt-get -q download libpython3.11-dev > /dev/null) \
                        || die "cannot download libpython3.11-dev"
                    dpkg -x "$dir"/debs/*.deb "$dir"
                    dpkg-deb -f "$dir"/debs/*.deb Version > "$dir/.version"
                    rm -rf "$dir/debs"
                fi
                pkgver=$(cat "$dir/.version")
                incs=(-I"$dir/usr/include/python3.11" -I"$dir/usr/include")
            fi
            source="Debian bookworm libpython3.11-dev $pkgver"
            ;;
        3.9 | 3.13 | 3.14 | 3.15)
            pkgver=$(fetch_dev "$v")
            local r=$CACHE/dev/$v/usr/include
            incs=(-I"$r/python$v" -I"$r")
            source="Debian ${SUITE[$v]} libpython$v-dev $pkgver"
            ;;
        *)
            inc=$(build_include "$v") || true
            [[ -n ${inc:-} ]] || die "$v: no Debian suite reachable here has libpython$v-dev; set PYPROBE_INCLUDE_${v//./_}=/path/to/include/python$v (a build's include dir)"
            incs=(-I"$inc")
            # Name the build and the include folder, not where this machine keeps it.
            source="headers of a pyenv build of $(basename "$(dirname "$(dirname "$inc")")") (include/$(basename "$inc"))"
            ;;
    esac
    local bin
    bin=$(mktemp)
    "$CC" -O0 -w "${incs[@]}" -DSOURCE="\"$source\"" -o "$bin" "$REPO/scripts/gen-offsets.c" \
        || { rm -f "$bin"; die "$v: compiling gen-offsets.c against $source failed"; }
    mkdir -p "$OUT"
    "$bin" > "$OUT/$v.json.tmp" || { rm -f "$bin"; die "$v: gen-offsets failed"; }
    rm -f "$bin"
    grep -q "\"python\": \"$v\"" "$OUT/$v.json.tmp" || die "$v: headers are of another version: $(head -3 "$OUT/$v.json.tmp")"
    mv "$OUT/$v.json.tmp" "$OUT/$v.json"
    say "$v: crates/cpython/offsets/$v.json from $source"
}

versions=("$@")
((${#versions[@]})) || versions=("${ALL_VERSIONS[@]}")
for v in "${versions[@]}"; do
    [[ " ${ALL_VERSIONS[*]} " == *" $v "* ]] || die "unknown version '$v' (choose from: ${ALL_VERSIONS[*]})"
done
for v in "${versions[@]}"; do generate "$v"; done
