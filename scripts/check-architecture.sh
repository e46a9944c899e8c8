#!/usr/bin/env bash
# Fails when a crate of the workspace depends on another that the architecture
# forbids (docs/ARCHITECTURE.md): the SDT engine and the recording crate depend on
# no other pyprobe crate, the CPython crate on the SDT engine only, and only the
# pyprobe binary joins them all. A forbidden `use` then fails to compile.
set -euo pipefail
cd "$(dirname "$0")/.."

metadata=$(cargo metadata --format-version 1 --no-deps --offline 2>/dev/null \
    || cargo metadata --format-version 1 --no-deps)

python3 - "$metadata" <<'EOF'
import json
import sys

# Each crate and the pyprobe crates it may depend on (normal and dev edges alike:
# a test must not reach around the architecture either).
ALLOWED = {
    "pyprobe-sdt": set(),
    "pyprobe-recording": set(),
    "pyprobe-cpython": {"pyprobe-sdt"},
    "pyprobe": {"pyprobe-sdt", "pyprobe-cpython", "pyprobe-recording"},
}

packages = json.loads(sys.argv[1])["packages"]
ours = {p["name"] for p in packages}
bad = []
unknown = ours - set(ALLOWED)
for name in sorted(unknown):
    bad.append(f"{name}: a crate the architecture does not name (add it to "
               f"scripts/check-architecture.sh and docs/ARCHITECTURE.md)")
for p in packages:
    allowed = ALLOWED.get(p["name"], set())
    for dep in p["dependencies"]:
        if dep["name"] in ours and dep["name"] not in allowed:
            bad.append(f"{p['name']} depends on {dep['name']} ({dep['kind'] or 'normal'}), "
                       f"which the architecture forbids")
if bad:
    print("check-architecture: " + "\ncheck-architecture: ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"check-architecture: {len(ours)} crates, every dependency allowed")
EOF
