#!/usr/bin/env python3
"""Traced own-time shares against sampled ones: each workload is recorded twice,
traced (`--mode trace`, whose times leave out tracing's cost per event) and sampled
at 1 kHz (`--mode sample -r 1000`), and the own-time shares of the functions with the
most own time are compared. A sampled run is the truth here: it does not slow code in
proportion to its calls. Prints each function's two shares and the largest gap in
points; `--runs N` repeats and gives the median gap.

    python3 benches/shares.py [--python 3.13,3.11] [--workloads fib,docutils] [--top 8]

Run `scripts/bench.sh` once first (it builds pyprobe, fetches the interpreters and
installs docutils). The sympy workload runs where sympy imports (`--python` also
takes an interpreter's path).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "fib": ["fib.py", "32"],
    "docutils": ["docutils_html.py", "3"],
    "sympy": ["sympy_fixed.py", "6"],
}


def interpreter(version):
    """The launcher of a fetched Debian interpreter, or a path as given."""
    if os.path.sep in version:
        return version
    return os.path.join(REPO, ".pythons", "bin", "python" + version)


def record(pyprobe, py, argv, mode, out):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "target", "pypi", "docutils"))
    subprocess.run([pyprobe, "record", "--force", *mode, "-o", out, "--", py, *argv],
                   env=env, capture_output=True, check=True)
    report = subprocess.run([pyprobe, "report", "--format", "json", out],
                            capture_output=True, check=True).stdout
    return json.loads(report)


def shares(report):
    """Own-time share (percent) of each function, pyprobe's own frames left out."""
    rows = [f for f in report["functions"] if not f["function"].startswith("[")]
    total = sum(f["exclusive_ns"] for f in rows) or 1
    return {(f["qualname"], f["file"], f["line"]): 100.0 * f["exclusive_ns"] / total for f in rows}


def compare(pyprobe, py, argv, top, tmp):
    traced = record(pyprobe, py, argv, ["--mode", "trace"], os.path.join(tmp, "t.pyprobe"))
    sampled = record(pyprobe, py, argv, ["--mode", "sample", "-r", "1000"], os.path.join(tmp, "s.pyprobe"))
    t, s = shares(traced), shares(sampled)
    keys = sorted(set(t) | set(s), key=lambda k: -max(t.get(k, 0.0), s.get(k, 0.0)))[:top]
    rows = [(k, t.get(k, 0.0), s.get(k, 0.0)) for k in keys]
    process = traced["processes"][0]
    return rows, max(abs(a - b) for _, a, b in rows), process["event_cost_ns"], process["tracing_cost_ns"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.13", help="versions or interpreter paths, comma-separated")
    parser.add_argument("--workloads", default="fib,docutils,sympy")
    parser.add_argument("--top", type=int, default=8, help="functions compared (most own time, either run)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--pyprobe", default=os.path.join(REPO, "target", "release", "pyprobe"))
    args = parser.parse_args()
    for version in args.python.split(","):
        py = interpreter(version)
        for name in args.workloads.split(","):
            script, *rest = WORKLOADS[name]
            argv = [os.path.join(REPO, "benches", "workloads", script), *rest]
            if name == "sympy" and subprocess.run([py, "-c", "import sympy"], capture_output=True).returncode:
                print(f"{name} on {version}: skipped (sympy does not import)")
                continue
            # Once untraced first: imports compile once, into the byte-code cache,
            # rather than in whichever of the two runs comes first.
            env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "target", "pypi", "docutils"))
            subprocess.run([py, *argv], env=env, capture_output=True, check=True)
            gaps = []
            with tempfile.TemporaryDirectory() as tmp:
                for _ in range(args.runs):
                    rows, gap, cost, subtracted = compare(args.pyprobe, py, argv, args.top, tmp)
                    gaps.append(gap)
            print(f"{name} on {version}: tracing cost {cost} ns/event, {subtracted / 1e6:.1f} ms left out; "
                  f"largest gap in the top {args.top}: {statistics.median(gaps):.1f} points"
                  + (f" (median of {args.runs}: {', '.join(f'{g:.1f}' for g in gaps)})" if args.runs > 1 else ""))
            for (qualname, file, line), a, b in rows:
                print(f"  traced {a:5.1f}%  sampled {b:5.1f}%  {qualname} ({os.path.basename(file)}:{line})")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
