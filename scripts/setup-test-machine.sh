#!/usr/bin/env bash
# Makes a fresh Debian machine ready for the tests, doing only what is missing:
# the Debian packages the tests build and run with (a C compiler, <sys/sdt.h>,
# the system CPython 3.11 with its headers, setpriv, Go's `go tool pprof` that
# reads pyprobe's pprof profiles back, Chromium that loads the HTML report
# headless), and the unprivileged user `pyprobe-test` that the tests run pyprobe
# as. Says in one line what it installs.
# As root it installs; otherwise it prints the command to run and fails.
set -euo pipefail

# package -> a file it provides that the tests use
declare -A NEED=(
    [gcc]=/usr/bin/gcc
    [g++]=/usr/bin/g++
    [libc6-dev]=/usr/include/stdio.h
    [binutils]=/usr/bin/readelf
    [systemtap-sdt-dev]=/usr/include/x86_64-linux-gnu/sys/sdt.h
    [python3.11]=/usr/bin/python3.11
    [python3.11-dev]=/usr/bin/python3.11-config
    [libpython3.11-dev]=/usr/lib/x86_64-linux-gnu/libpython3.11.so
    [util-linux]=/usr/bin/setpriv
    [passwd]=/usr/sbin/useradd
    [ca-certificates]=/etc/ssl/certs/ca-certificates.crt
    [python3-pip]=/usr/lib/python3/dist-packages/pip
    [python3.11-venv]=/usr/lib/python3.11/ensurepip/__main__.py
    [golang-go]=/usr/bin/go
    [chromium]=/usr/bin/chromium
    [fonts-liberation]=/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf
)
missing=()
for pkg in "${!NEED[@]}"; do
    [[ -e ${NEED[$pkg]} ]] || missing+=("$pkg")
done
# sys/sdt.h may live directly under /usr/include on other layouts.
if [[ " ${missing[*]} " == *" systemtap-sdt-dev "* && -e /usr/include/sys/sdt.h ]]; then
    missing=("${missing[@]/systemtap-sdt-dev/}")
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sed '/^$/d' | sort)

if ((${#missing[@]})); then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        echo "setup: the tests need these Debian packages: ${missing[*]}" >&2
        echo "setup: install them with: sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
    echo "setup: installing Debian packages the tests need: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The unprivileged tests run pyprobe as this user, with no capabilities.
if [[ $(id -u) == 0 ]] && ! id -u pyprobe-test >/dev/null 2>&1; then
    echo "setup: adding the system user pyprobe-test (the unprivileged tests run as it)"
    useradd --system --no-create-home --shell /bin/sh pyprobe-test
fi
