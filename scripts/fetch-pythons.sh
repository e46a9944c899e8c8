#!/usr/bin/env bash
# Fetch Debian's CPython builds (which carry the SystemTap SDT probes pyprobe uses) and
# unpack them, without installing anything, into the git-ignored cache .pythons/ at the
# repo root.  Launchers end up in .pythons/bin/python3.X.  (Which suite gives which version: SUITE below.)
#
#   scripts/fetch-pythons.sh              # all of 3.9 3.11 3.13 3.14 3.15
#   scripts/fetch-pythons.sh 3.9 3.15     # only these
#
# Idempotent: a version whose stamp file matches its recipe is not fetched again; the
# launchers are rewritten (cheap) and every requested launcher is checked at the end.
#
# Environment (optional): DEBIAN_MIRROR overrides the archive URI taken from the machine's
# apt sources (e.g. when bullseye has moved to archive.debian.org); DEBIAN_KEYRING
# overrides the keyring taken from their Signed-By.
set -euo pipefail

die() { echo "fetch-pythons: error: $*" >&2; exit 1; }
say() { echo "fetch-pythons: $*"; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=$REPO/.pythons
ARCH_LIBDIR=x86_64-linux-gnu
ALL_VERSIONS=(3.9 3.11 3.13 3.14 3.15)
# Modules that must import in every test interpreter; the rest are only reported.
REQUIRED_MODULES="json gc threading ctypes hashlib socket subprocess"
OPTIONAL_MODULES="ssl _hashlib decimal sqlite3 lzma bz2 zlib readline"

[[ $(uname -m) == x86_64 ]] || die "only x86_64 is supported (Debian amd64 packages)"
for tool in apt-get apt-cache dpkg dpkg-deb ldconfig flock; do
    command -v "$tool" > /dev/null || die "$tool not found: this script needs a Debian system"
done

# Which suite each version comes from (3.11 is the machine's own bookworm python3.11).
declare -A SUITE=([3.9]=bullseye [3.13]=trixie [3.14]=sid [3.15]=sid)

# ---------------------------------------------------------------------------------------
# The archive's address and keyring, read from the machine's own apt sources (deb822
# *.sources first, then one-line *.list), so no mirror is written into the project.  We
# pick the entry that serves the machine's own codename (e.g. "bookworm"), not -security.
# ---------------------------------------------------------------------------------------
machine_archive() {
    local codename f
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    [[ -n $codename ]] || die "cannot read VERSION_CODENAME from /etc/os-release"
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -e $f ]] || continue
        # Stanzas are separated by blank lines; print "URI KEYRING" for a matching one.
        awk -v want="$codename" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && enabled != "no" && (" " suites " ") ~ (" " want " "))
                    { split(uris, u, " "); print u[1], (signed == "" ? "-" : signed); found = 1; exit }
                types = uris = suites = signed = enabled = ""
            }
            /^[ \t]*$/ { flush(); next }
            /^[ \t]*#/ { next }
            /^Types:/     { sub(/^Types:[ \t]*/, "");     types = $0 }
            /^URIs:/      { sub(/^URIs:[ \t]*/, "");      uris = $0 }
            /^Suites:/    { sub(/^Suites:[ \t]*/, "");    suites = $0 }
            /^Signed-By:/ { sub(/^Signed-By:[ \t]*/, ""); signed = $0 }
            /^Enabled:/   { sub(/^Enabled:[ \t]*/, "");   enabled = tolower($0) }
            END { if (!found) flush() }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -e $f ]] || continue
        # deb [opt=val ...] URI SUITE COMPONENTS...
        awk -v want="$codename" '
            $1 != "deb" { next }
            { opts = ""; i = 2
              if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) { opts = opts " " $i; i++ } opts = opts " " $i; i++ } }
            $(i + 1) == want {
                key = "-"; n = split(opts, o, /[][ ]+/)
                for (j = 1; j <= n; j++) if (o[j] ~ /^signed-by=/) { key = o[j]; sub(/^signed-by=/, "", key) }
                print $i, key; exit }' "$f"
    done
}

read -r MACHINE_URI MACHINE_KEYRING < <(machine_archive | head -n1) || true
ARCHIVE_URI=${DEBIAN_MIRROR:-${MACHINE_URI:-}}
[[ -n $ARCHIVE_URI ]] || die "no Debian archive found in /etc/apt/sources* (set DEBIAN_MIRROR=http://.../debian)"
KEYRING=${DEBIAN_KEYRING:-${MACHINE_KEYRING:--}}
# Signed-By may also be an inline key block or absent: fall back to the archive keyring.
[[ $KEYRING == /* && -r $KEYRING ]] || KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r $KEYRING ]] || die "no keyring $KEYRING (install debian-archive-keyring or set DEBIAN_KEYRING)"

# ---------------------------------------------------------------------------------------
# Private apt state per suite under .pythons/apt/<name>/: its own sources, lists, cache and
# an empty dpkg status, so the machine's apt setup (and its installed packages / pins) is
# neither used for resolution nor modified.  Proxy settings in apt.conf.d still apply.  The
# binary package caches are re-enabled here (Docker images turn them off) since apt-cache
# is called several times per suite and would otherwise reparse sid's lists every time.
# ---------------------------------------------------------------------------------------
declare -A UPDATED=()

apt_opts() {  # apt_opts NAME -> options for apt-get/apt-cache on that private state
    local d=$CACHE/apt/$1
    printf '%s\n' \
        -o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o "Dir::State=$d" -o "Dir::State::Lists=$d/lists" -o "Dir::State::status=$d/status" \
        -o "Dir::Cache=$d/cache" -o Dir::Cache::pkgcache=pkgcache.bin -o Dir::Cache::srcpkgcache=srcpkgcache.bin \
        -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null \
        -o Acquire::Languages=none -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
}
papt()  { local n=$1; shift; local o; mapfile -t o < <(apt_opts "$n"); apt-get   "${o[@]}" "$@"; }
pcache(){ local n=$1; shift; local o; mapfile -t o < <(apt_opts "$n"); apt-cache "${o[@]}" "$@"; }

# apt_update NAME KEYRING SUITE... : write the sources file and refresh the lists once per run.
apt_update() {
    local name=$1 keyring=$2; shift 2
    local d=$CACHE/apt/$name s
    [[ -n ${UPDATED[$name]:-} ]] && return 0
    mkdir -p "$d/lists/partial" "$d/cache/archives/partial" "$d/debs"
    [[ -e $d/status ]] || : > "$d/status"
    for s in "$@"; do echo "deb [signed-by=$keyring] $ARCHIVE_URI $s main"; done > "$d/sources.list"
    say "apt-get update ($*) from $ARCHIVE_URI"
    # apt-get update only warns about some failures (e.g. a mirror that cannot be reached).
    if ! papt "$name" -q update > "$d/update.log" 2>&1 || grep -qE '^(E: |W: (Failed to fetch|GPG error))' "$d/update.log"; then
        return 1
    fi
    UPDATED[$name]=1
}

apt_writable() {  # let apt's download sandbox user (_apt) write DIR, as apt itself does
    if [[ $EUID -eq 0 ]] && id _apt > /dev/null 2>&1; then chown _apt "$1"; fi
}

# A suite newer than the installed debian-archive-keyring may be signed by keys it lacks.
# Then fetch debian-archive-keyring from the machine's own suite (verified by the installed
# keyring; stable updates ship the next releases' keys) and use the keyring inside it.
# Sets NEWER_KEYRING (not echoed: a die inside $(...) would not stop the script).
newer_keyring() {
    local codename k=$CACHE/apt/keyring
    codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
    if [[ ! -r $k/usr/share/keyrings/debian-archive-keyring.gpg ]]; then
        apt_update keyring "$KEYRING" "$codename" \
            || { cat "$k/update.log" >&2; die "cannot update $codename to fetch a newer keyring"; }
        rm -f "$k/debs/"debian-archive-keyring_*.deb
        apt_writable "$k/debs"
        (cd "$k/debs" && papt keyring -q download debian-archive-keyring > /dev/null) \
            || die "cannot download debian-archive-keyring"
        dpkg -x "$k"/debs/debian-archive-keyring_*.deb "$k"
    fi
    NEWER_KEYRING=$k/usr/share/keyrings/debian-archive-keyring.gpg
}

update_suite() {  # update_suite NAME SUITE... (with the keyring fallback)
    local name=$1; shift
    local log=$CACHE/apt/$name/update.log
    apt_update "$name" "$KEYRING" "$@" && return 0
    grep -q NO_PUBKEY "$log" || { cat "$log" >&2; die "apt-get update failed for $* (log above)"; }
    say "$KEYRING lacks the keys signing $* ($(grep -o 'NO_PUBKEY [0-9A-F]*' "$log" | sort -u | paste -sd' ' -));"
    say "retrying with a newer debian-archive-keyring"
    newer_keyring
    apt_update "$name" "$NEWER_KEYRING" "$@" || { cat "$log" >&2; die "apt-get update failed for $* (log above)"; }
}

has_pkg() { [[ -z $(missing_pkgs "$1" "$2") ]]; }

missing_pkgs() {  # missing_pkgs NAME PKG... : those of PKG... with no candidate version
    local name=$1; shift
    pcache "$name" policy "$@" 2>/dev/null | awk -v all="$*" '
        /^[^ ].*:$/ { p = substr($0, 1, length($0) - 1) }
        /^ +Candidate:/ && $2 != "(none)" { ok[p] = 1 }
        END { n = split(all, a, " "); for (i = 1; i <= n; i++) if (!(a[i] in ok)) print a[i] }'
}

# lib_closure NAME PKG... : the packages' Depends/Pre-Depends that are shared libraries
# (named lib*, plus zlib1g), followed recursively through those only (so tzdata -> debconf ->
# perl etc. is not dragged in).  Of an "a | b" alternative only the first is taken.
lib_closure() {
    local name=$1; shift
    local -A seen=(); local todo=("$@") next p
    while ((${#todo[@]})); do
        next=()
        while read -r p; do
            [[ -n $p && -z ${seen[$p]:-} ]] || continue
            seen[$p]=1; next+=("$p")
        done < <(pcache "$name" depends --no-recommends --no-suggests --no-conflicts --no-breaks \
                        --no-replaces --no-enhances "${todo[@]}" 2>/dev/null | awk '
            /^[^ ]/ { alt = 0; next }
            /^ +\|?(Pre)?Depends:/ { if (!alt && $2 ~ /^(lib|zlib1g$)/) print $2; alt = ($1 ~ /^\|/); next }
            { alt = 0 }')
        todo=("${next[@]}")
    done
    printf '%s\n' "${!seen[@]}" | sort
}

# ---------------------------------------------------------------------------------------
# Per-version recipes.  A version's stamp records the recipe it was built from; a changed
# recipe refetches that version (bump the "vN" when changing what gets fetched).
# ---------------------------------------------------------------------------------------
python_pkgs() { echo "python$1-minimal libpython$1-minimal libpython$1-stdlib"; }

# 3.9 runs directly on the machine's (bookworm) glibc.  Only libraries whose sonames
# bookworm lacks (or a fresh bookworm image lacks) go on its LD_LIBRARY_PATH:
# libffi.so.7 (ctypes), libssl/libcrypto.so.1.1 (hashlib's OpenSSL, ssl), libmpdec.so.3 (decimal).
EXTRA_3_9="libffi7 libssl1.1 libmpdec3"

recipe() {
    case $1 in
        3.9) echo "v2 ${SUITE[3.9]}: $(python_pkgs 3.9) $EXTRA_3_9" ;;
        *)   echo "v2 ${SUITE[$1]}: $(python_pkgs "$1") + suite libc6 and lib* dependency closure" ;;
    esac
}

fetch_version() {
    local v=$1 suite=${SUITE[$1]} root=$CACHE/$1 name pkgs extra=()
    local stamp=$root/.stamp want
    want=$(recipe "$v")
    if [[ -f $stamp && $(head -n1 "$stamp") == "$want" ]]; then
        say "$v: up to date ($(sed -n 2p "$stamp" | wc -w) packages, $(sed -n 2p "$stamp" | tr ' ' '\n' | grep "^python$v-minimal="))"
        return 0
    fi
    say "$v: fetching from Debian $suite"
    name=$suite
    update_suite "$name" "$suite"
    if ! has_pkg "$name" "python$v-minimal"; then
        # Not (yet) in sid: take the interpreter from experimental and the libraries from
        # sid.  With both suites in one sources file apt does exactly that, since sid's
        # priority (500) beats experimental's (1) wherever a package exists in both.
        [[ $suite == sid ]] || die "python$v-minimal not found in Debian $suite"
        say "$v: python$v-minimal is not in sid; using experimental for it (libs from sid)"
        name=sid+experimental
        update_suite "$name" sid experimental
        has_pkg "$name" "python$v-minimal" || die "python$v-minimal not found in sid nor experimental"
    fi
    read -ra pkgs <<< "$(python_pkgs "$v")"
    if [[ $v == 3.9 ]]; then
        read -ra extra <<< "$EXTRA_3_9"
    else
        # Newer suites need their own glibc (run through their own loader) and the shared
        # libraries the binary and its extension modules link, e.g. libssl3t64 >= 3.4.
        mapfile -t extra < <(lib_closure "$name" "${pkgs[@]}" libc6 | grep -vxF -f <(printf '%s\n' "${pkgs[@]}"))
    fi
    local missing
    missing=$(missing_pkgs "$name" "${pkgs[@]}" "${extra[@]}" | paste -sd' ' -)
    [[ -z $missing ]] || die "$v: package(s) not found in Debian ${name//+/ + }: $missing"

    local debs=$CACHE/apt/$name/debs/$v
    rm -rf "$debs"; mkdir -p "$debs"; apt_writable "$debs"
    say "$v: apt-get download ${pkgs[*]} ${extra[*]}"
    (cd "$debs" && papt "$name" -q download "${pkgs[@]}" "${extra[@]}" > "$debs/download.log" 2>&1) \
        || { cat "$debs/download.log" >&2; die "apt-get download failed for $v"; }
    rm -f "$debs/download.log"

    # Unpack into a fresh tree and move it into place only when complete.
    local tmp=$root.tmp deb
    rm -rf "$tmp"; mkdir -p "$tmp"
    for deb in "$debs"/*.deb; do dpkg -x "$deb" "$tmp"; done
    [[ -x $tmp/usr/bin/python$v ]] || die "$v: usr/bin/python$v missing after unpacking"
    {
        echo "$want"
        for deb in "$debs"/*.deb; do dpkg-deb --show --showformat='${Package}=${Version}\n' "$deb"; done | paste -sd' ' -
    } > "$tmp/.stamp.new"
    rm -rf "$root"; mv "$tmp" "$root"; mv "$root/.stamp.new" "$stamp"
    say "$v: unpacked $(ls "$debs"/*.deb | wc -l) packages ($(du -ch "$debs"/*.deb | tail -n1 | cut -f1) of .debs, $(du -sh "$root" | cut -f1) unpacked)"
    rm -rf "$debs"  # the stamp lists what was unpacked; a refetch downloads afresh anyway
}

# The machine's own Debian python3.11 (bookworm), installed with the machine's apt if missing.
ensure_system_311() {
    if [[ -x /usr/bin/python3.11 ]]; then say "3.11: using /usr/bin/python3.11"; return 0; fi
    [[ $EUID -eq 0 ]] || die "/usr/bin/python3.11 is missing; run as root (apt-get install python3.11)"
    say "3.11: installing python3.11 with apt-get"
    apt-get -q update > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3.11 > /dev/null \
        || die "apt-get install python3.11 failed"
    [[ -x /usr/bin/python3.11 ]] || die "/usr/bin/python3.11 still missing after install"
}

# ---------------------------------------------------------------------------------------
# Launchers (rewritten each run, so they follow the repo if it moves; absolute paths keep
# them cheap: one exec, no readlink).
# ---------------------------------------------------------------------------------------
libdirs() {  # the unpacked tree's library directories, ':'-joined
    local root=$1 d out=()
    for d in "$root/lib/$ARCH_LIBDIR" "$root/usr/lib/$ARCH_LIBDIR"; do [[ -d $d ]] && out+=("$d"); done
    (IFS=:; echo "${out[*]}")
}

loader_of() {  # the unpacked glibc's dynamic loader (usr-merged suites ship it in usr/lib64)
    local l
    for l in "$1/usr/lib64/ld-linux-x86-64.so.2" "$1/lib64/ld-linux-x86-64.so.2" \
             "$1/usr/lib/$ARCH_LIBDIR/ld-linux-x86-64.so.2" "$1/lib/$ARCH_LIBDIR/ld-linux-x86-64.so.2"; do
        [[ -e $l ]] && { echo "$l"; return 0; }
    done
    die "no ld-linux-x86-64.so.2 under $1"
}

write_if_changed() {  # write_if_changed FILE < content
    local new; new=$(cat)
    [[ -f $1 && $(cat "$1") == "$new" ]] || { printf '%s\n' "$new" > "$1"; chmod 755 "$1"; }
}

write_launcher() {
    local v=$1 root=$CACHE/$1 out=$CACHE/bin/python$1
    mkdir -p "$CACHE/bin"
    case $v in
        3.11) write_if_changed "$out" <<EOF
#!/bin/sh
# Generated by scripts/fetch-pythons.sh: the machine's own Debian python3.11 (absolute path,
# so a pyenv shim on PATH is never picked up).
exec /usr/bin/python3.11 "\$@"
EOF
        ;;
        3.9) write_if_changed "$out" <<EOF
#!/bin/sh
# Generated by scripts/fetch-pythons.sh: Debian bullseye's python3.9, unpacked, run directly
# on this machine's glibc; only sonames the machine lacks are on LD_LIBRARY_PATH.
export PYTHONHOME='$root/usr'
export LD_LIBRARY_PATH='$(libdirs "$root")'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec '$root/usr/bin/python3.9' "\$@"
EOF
        ;;
        *) write_if_changed "$out" <<EOF
#!/bin/sh
# Generated by scripts/fetch-pythons.sh: Debian ${SUITE[$v]}'s python$v, unpacked, run through
# that suite's own glibc loader (so /proc/PID/exe is the loader, not python$v).  --argv0 makes
# sys.executable this launcher, so subprocess/multiprocessing children also get the loader.
export PYTHONHOME='$root/usr'
exec '$(loader_of "$root")' --argv0 '$out' --library-path '$(libdirs "$root")' '$root/usr/bin/python$v' "\$@"
EOF
        ;;
    esac
}

# ---------------------------------------------------------------------------------------
# Checks: the version line, required/optional imports, libraries a module links that the
# unpacked tree does not provide, and the SDT notes in the binary.
# ---------------------------------------------------------------------------------------
IMPORT_CHECK='
import importlib, sys
bad = []
for m in sys.argv[1:]:
    try: importlib.import_module(m)
    except Exception: bad.append(m)
print(" ".join(bad))'

binary_of() { [[ $1 == 3.11 ]] && echo /usr/bin/python3.11 || echo "$CACHE/$1/usr/bin/python$1"; }

check_version() {
    local v=$1 py=$CACHE/bin/python$1 bin ver m bad=() opt_bad=() notes names
    bin=$(binary_of "$v")
    ver=$("$py" -c 'import sys; print(sys.version.replace("\n", " "))') || die "$v: launcher $py does not run"
    # One interpreter run tries all imports and prints the ones that fail.
    read -ra bad <<< "$("$py" -c "$IMPORT_CHECK" $REQUIRED_MODULES)"
    ((${#bad[@]} == 0)) || { "$py" -c "import ${bad[0]}" || true; die "$v: cannot import: ${bad[*]}"; }
    read -ra opt_bad <<< "$("$py" -c "$IMPORT_CHECK" $OPTIONAL_MODULES)"
    notes=$(readelf -n "$bin" | grep -c NT_STAPSDT || true)
    ((notes > 0)) || die "$v: no stapsdt notes in $bin"
    names=$(readelf -n "$bin" | awk '/Name:/ && prev ~ /Provider: python/ {print $2} {prev = $0}' | sort -u | paste -sd, -)
    echo "  python$v: $ver"
    echo "      binary $bin: $notes stapsdt notes ($names)"
    ((${#opt_bad[@]} == 0)) || echo "      optional modules not importable: ${opt_bad[*]}"
    [[ $v == 3.11 ]] || report_host_libs "$v"
}

# Sonames that the binary or an extension module needs but the unpacked tree lacks: these
# come from the machine (fine if present, reported so surprises are visible).
report_host_libs() {
    local v=$1 root=$CACHE/$1 f so dirs host=() missing=()
    [[ -n ${HOST_SONAMES:-} ]] || HOST_SONAMES=$(ldconfig -p | awk 'NR > 1 {print $1}')
    IFS=: read -ra dirs <<< "$(libdirs "$root")"
    local -A seen=()
    while read -r so; do
        [[ -n $so && -z ${seen[$so]:-} ]] || continue; seen[$so]=1
        local d found=
        for d in "${dirs[@]}"; do [[ -e $d/$so ]] && found=1; done
        [[ -n $found ]] && continue
        if [[ $'\n'$HOST_SONAMES$'\n' == *$'\n'$so$'\n'* ]]; then host+=("$so"); else missing+=("$so"); fi
    done < <(readelf -d "$root/usr/bin/python$v" "$root/usr/lib/python$v/lib-dynload/"*.so \
                 | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u)
    # 3.9 runs on the machine's glibc by design: only the missing ones are news there.
    [[ $v == 3.9 || ${#host[@]} -eq 0 ]] || echo "      from the machine: ${host[*]}"
    ((${#missing[@]} == 0)) || echo "      not found anywhere (some module will not load): ${missing[*]}"
}

# ---------------------------------------------------------------------------------------
# readelf (binutils; not in a bare Debian image) checks the SDT notes and linked libraries.
if ! command -v readelf > /dev/null; then
    [[ $EUID -eq 0 ]] || die "readelf not found: install binutils"
    say "installing binutils (readelf) with apt-get"
    { apt-get -q update && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends binutils; } \
        > /dev/null || die "apt-get install binutils failed"
fi

versions=("$@")
((${#versions[@]})) || versions=("${ALL_VERSIONS[@]}")
for v in "${versions[@]}"; do
    [[ " ${ALL_VERSIONS[*]} " == *" $v "* ]] || die "unknown version '$v' (choose from: ${ALL_VERSIONS[*]})"
done

mkdir -p "$CACHE"
# Serialise concurrent runs (e.g. parallel test jobs) on the same cache.
exec 9> "$CACHE/.lock"
flock 9

for v in "${versions[@]}"; do
    if [[ $v == 3.11 ]]; then ensure_system_311; else fetch_version "$v"; fi
    write_launcher "$v"
done

# apt's binary caches (~40 MB per suite) only speed up this run's apt-cache calls.
rm -f "$CACHE"/apt/*/cache/*.bin

say "checking launchers in $CACHE/bin"
for v in "${versions[@]}"; do check_version "$v"; done
