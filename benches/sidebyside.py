#!/usr/bin/env python3
"""Side-by-side overhead benchmark: each workload untraced and under pyprobe, its
peers and the raw ptrace floor, interleaved (A B C A B C ...) in one invocation, so
machine noise hits every configuration alike. Prints medians and ratios as a table
and writes them as JSON. Run through scripts/bench.sh, which builds what it needs.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {
    "fib": ["fib.py", "25"],
    "mixed": ["mixed.py", "2"],
    "gc": ["gc_heavy.py", "40"],
    "threaded": ["threaded.py", "20000"],
    "sleepy": ["sleepy.py", "100"],
    # Long enough (about 2 s untraced) for the overhead budget to settle; full
    # tracing of it would take minutes, so only these configurations run on it.
    "fib-long": ["fib.py", "34"],
    # The default mode where it used to hurt: an audit event per id() call, and a
    # real program from PyPI (black, which calls id() some 150,000 times).
    "audit": ["audit.py", "10"],
    "black": ["black_format.py"],
}
ONLY = {"fib-long": {"untraced", "pyprobe trace 5%", "pyprobe ring", "pyprobe ring 5%", "pyprobe sample 100",
                    "py-spy 100"},
        "audit": {"untraced", "pyprobe auto", "pyprobe sample 100", "py-spy 100"},
        "black": {"untraced", "pyprobe auto", "pyprobe sample 100", "py-spy 100"}}


def interpreter(version):
    """The unpacked Debian interpreter and the environment its launcher sets."""
    root = os.path.join(REPO, ".pythons", version, "usr")
    binary = os.path.join(root, "bin", "python" + version)
    launcher = os.path.join(REPO, ".pythons", "bin", "python" + version)
    if os.path.exists(os.path.join(root, "lib64", "ld-linux-x86-64.so.2")) and os.path.exists(launcher):
        # Needs its suite's own glibc: run through the launcher (and its loader).
        return launcher, dict(os.environ)
    if not os.path.exists(binary):
        binary = "/usr/bin/python" + version
        return binary, dict(os.environ)
    env = dict(os.environ, PYTHONHOME=root, LD_LIBRARY_PATH=os.path.join(root, "lib", "x86_64-linux-gnu"))
    return binary, env


def function_probe_addresses(pyprobe, binary):
    out = subprocess.run([pyprobe, "probes", binary, "--format", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        # A launcher script: the floor tracer cannot follow it through the loader.
        print(f"bench: no probes in {binary}: the floor is not measured", file=sys.stderr)
        return [], []
    sites, sems = [], []
    for probe in json.loads(out.stdout)["objects"][0]["probes"]:
        if probe["name"] in ("function__entry", "function__return"):
            sites += [s["address"] for s in probe["sites"]]
            if probe["semaphore"]:
                sems.append(probe["semaphore"])
    return sites, sems


def find_peer(name):
    path = shutil.which(name)
    if path:
        return path
    print(f"bench: {name} missing, installing it from PyPI", file=sys.stderr)
    pip = [sys.executable, "-m", "pip", "install", "-q", name]
    if subprocess.run(pip).returncode != 0:
        return None
    return shutil.which(name) or next(
        (p for p in [os.path.join(os.path.dirname(sys.executable), name)] if os.path.exists(p)), None
    )


def configurations(pyprobe, floor, pyspy, sites, sems, tmp):
    rec = os.path.join(tmp, "bench.pyprobe")
    configs = {"untraced": lambda cmd: cmd}
    if floor and sites:
        args = [floor] + sum([["--site", hex(a)] for a in sites], []) + sum([["--sem", hex(a)] for a in sems], [])
        configs["floor"] = lambda cmd: args + ["--"] + cmd
    configs["pyprobe trace"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "int3", "-o", rec, "--"] + cmd
    configs["pyprobe ring"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "ring", "-o", rec, "--"] + cmd
    configs["pyprobe auto"] = lambda cmd: [pyprobe, "record", "--force", "--mode", "auto", "-o", rec, "--"] + cmd
    configs["pyprobe trace 5%"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "int3", "--max-overhead", "5", "-o", rec, "--"] + cmd
    configs["pyprobe ring 5%"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "ring", "--max-overhead", "5", "-o", rec, "--"] + cmd
    for rate in (100, 1000):
        configs[f"pyprobe sample {rate}"] = lambda cmd, r=rate: [
            pyprobe, "record", "--force", "--mode", "sample", "-r", str(r), "-o", rec, "--"] + cmd
        configs[f"pyprobe sample {rate} nb"] = lambda cmd, r=rate: [
            pyprobe, "record", "--force", "--mode", "sample", "--nonblocking", "-r", str(r), "-o", rec, "--"] + cmd
        if pyspy:
            configs[f"py-spy {rate}"] = lambda cmd, r=rate: [
                pyspy, "record", "-r", str(r), "-f", "raw", "-o", os.path.join(tmp, "spy.txt"), "--"] + cmd
            configs[f"py-spy {rate} nb"] = lambda cmd, r=rate: [
                pyspy, "record", "--nonblocking", "-r", str(r), "-f", "raw", "-o", os.path.join(tmp, "spy.txt"), "--"] + cmd
    return configs


def run_once(argv, env):
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    hits = None
    dropped = None
    m = re.search(r"(\d+) probe hits", proc.stderr) or re.search(r"^hits (\d+)", proc.stderr, re.M)
    if m:
        hits = int(m.group(1))
        lost = re.search(r"\((\d+) more lost", proc.stderr)
        dropped = 0
        if lost:
            # Events the target produced: recorded plus dropped.
            dropped = int(lost.group(1))
            hits += dropped
    exact = re.search(r"calls traced exactly ([\d.]+)%", proc.stderr)
    exact = float(exact.group(1)) if exact else None
    return elapsed, proc.returncode, hits, exact, dropped, proc.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", default="3.9")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", default="bench-results.json")
    parser.add_argument("--configs", help="comma-separated configurations to run (default: all); untraced always runs")
    parser.add_argument("--pyprobe", default=os.path.join(REPO, "target", "release", "pyprobe"))
    parser.add_argument("--floor", default=os.path.join(REPO, "target", "floor"))
    args = parser.parse_args()

    binary, env = interpreter(args.python)
    pyspy = find_peer("py-spy")
    if not pyspy:
        print("bench: py-spy is not available: its columns are missing", file=sys.stderr)
    sites, sems = function_probe_addresses(args.pyprobe, binary)
    tmp = tempfile.mkdtemp(prefix="pyprobe-bench-")
    configs = configurations(args.pyprobe, args.floor if os.path.exists(args.floor) else None, pyspy, sites, sems, tmp)
    if args.configs:
        wanted = set(args.configs.split(",")) | {"untraced"}
        # The floor is left out (and said so above) where the binary has no probes.
        unknown = wanted - set(configs) - {"floor"}
        if unknown:
            sys.exit(f"bench: unknown configurations {sorted(unknown)}; known: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in wanted}
    workloads = [w for w in args.workloads.split(",") if w in WORKLOADS]
    times = {(w, c): [] for w in workloads for c in configs}
    hits = {}
    exact = {}
    lost_pct = {}
    unavailable = {}
    for run in range(args.runs):
        for w in workloads:
            cmd = [binary, os.path.join(REPO, "benches", "workloads", WORKLOADS[w][0])] + WORKLOADS[w][1:]
            for name, make in configs.items():
                if name in unavailable or (name == "floor" and w == "threaded"):  # the floor follows no threads
                    continue
                if w in ONLY and name not in ONLY[w]:
                    continue
                elapsed, code, h, ex, dropped, err = run_once(make(cmd), env)
                if code != 0:
                    unavailable[name] = err.strip().splitlines()[-1] if err.strip() else f"exit {code}"
                    continue
                times[(w, name)].append(elapsed)
                if h is not None:
                    hits[(w, name)] = h
                if ex is not None:
                    exact.setdefault((w, name), []).append(ex)
                if dropped is not None and h:
                    lost_pct.setdefault((w, name), []).append(100.0 * dropped / h)
            print(f"bench: run {run + 1}/{args.runs} of {w} done", file=sys.stderr)

    results = []
    for w in workloads:
        base = statistics.median(times[(w, "untraced")])
        for name in configs:
            t = times[(w, name)]
            if not t:
                continue
            med = statistics.median(t)
            row = {"workload": w, "config": name, "median_s": round(med, 4), "slowdown": round(med / base, 2)}
            if (w, name) in exact:
                row["exact_pct"] = round(statistics.median(exact[(w, name)]), 1)
            if (w, name) in lost_pct and name == "pyprobe ring":
                row["lost_pct"] = round(statistics.median(lost_pct[(w, name)]), 1)
            if (w, name) in hits and hits[(w, name)]:
                row["hits"] = hits[(w, name)]
                row["ns_per_hit"] = round((med - base) * 1e9 / hits[(w, name)])
            results.append(row)
    for w in workloads:
        per = {r["config"]: r for r in results if r["workload"] == w}
        floor = per.get("floor", {}).get("ns_per_hit")
        trace = per.get("pyprobe trace", {}).get("ns_per_hit")
        if floor and trace:
            per["pyprobe trace"]["vs_floor"] = round(trace / floor, 2)
        ring = per.get("pyprobe ring", {}).get("ns_per_hit")
        if floor and ring:
            per["pyprobe ring"]["vs_floor"] = round(ring / floor, 4)
        for rate in (100, 1000):
            for nb in ("", " nb"):
                ours, peer = per.get(f"pyprobe sample {rate}{nb}"), per.get(f"py-spy {rate}{nb}")
                if ours and peer:
                    ours["vs_py_spy"] = round(ours["median_s"] / peer["median_s"], 2)

    print(f"\npyprobe side-by-side, python {args.python}, {args.runs} interleaved runs, "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs\n")
    print(f"{'workload':<9} {'configuration':<22} {'median':>9} {'slowdown':>9} {'ns/hit':>8} {'vs floor':>9} "
          f"{'vs py-spy':>10} {'exact %':>8} {'lost %':>7}")
    for r in results:
        ns = r.get('ns_per_hit', '') if not r['config'].endswith("5%") else ''
        print(f"{r['workload']:<9} {r['config']:<22} {r['median_s']:>8.3f}s {r['slowdown']:>8.2f}x "
              f"{ns:>8} {r.get('vs_floor', ''):>9} {r.get('vs_py_spy', ''):>10} {r.get('exact_pct', ''):>8} "
              f"{r.get('lost_pct', ''):>7}")
    for name, why in unavailable.items():
        print(f"unavailable: {name}: {why}")
    with open(args.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "python": args.python, "runs": args.runs,
                   "results": results, "unavailable": unavailable}, f, indent=1)
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
