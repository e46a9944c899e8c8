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
    # An int3 hit against the same-CPU and cross-CPU floors: about 44,000 hits, few
    # enough that the cross-CPU floor takes seconds, not minutes.
    "fib-int3": ["fib.py", "20"],
    # The default mode where it used to hurt: an audit event per id() call, and a
    # real program from PyPI (black, which calls id() some 150,000 times; docutils).
    "audit": ["audit.py", "10"],
    "black": ["black_format.py"],
    "docutils": ["docutils_html.py", "5"],
}
ONLY = {"fib-long": {"untraced", "pyprobe trace 5%", "pyprobe ring", "pyprobe ring 5%", "pyprobe sample 100",
                    "py-spy 100", "cProfile"},
        "fib-int3": {"untraced", "floor", "floor same-cpu", "floor same-cpu reads", "floor cross-cpu",
                     "pyprobe trace", "pyprobe trace unpinned"},
        "audit": {"untraced", "pyprobe auto", "pyprobe sample 100", "py-spy 100"},
        "black": {"untraced", "pyprobe auto", "pyprobe sample 100", "py-spy 100"},
        "docutils": {"untraced", "pyprobe auto", "pyprobe sample 100", "py-spy 100"}}

# Configurations whose int3 hits may each wake another CPU: on a VM whose idle
# vCPUs halt at once that is 20-140 µs per hit, minutes for the call-heavy
# workloads. They run on fib-int3 only, which holds the int3 comparisons.
CROSS_CPU_BOUND = {"floor", "floor cross-cpu", "pyprobe trace unpinned"}


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


def function_probe_addresses(pyprobe, binary, version):
    """The function probes' sites (where the floor tracer can follow the command:
    not through a launcher) and semaphores of the interpreter that `binary` runs,
    and the path of its executable (None without function probes)."""
    elf = os.path.join(REPO, ".pythons", version, "usr", "bin", "python" + version)
    if not os.path.exists(elf):
        elf = binary
    launched = binary == os.path.join(REPO, ".pythons", "bin", "python" + version)
    out = subprocess.run([pyprobe, "probes", elf, "--format", "json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"bench: no probes in {binary}: the floor and `probes on` are not measured", file=sys.stderr)
        return [], [], None
    sites, sems = [], []
    for probe in json.loads(out.stdout)["objects"][0]["probes"]:
        if probe["name"] in ("function__entry", "function__return"):
            sites += [(s["address"], string_registers(s)) for s in probe["sites"]]
            if probe["semaphore"]:
                sems.append(probe["semaphore"])
    if launched:
        # A launcher script: the floor tracer cannot follow it through the loader.
        print(f"bench: {binary} is a launcher: the floor is not measured", file=sys.stderr)
        sites = []
    return sites, sems, elf if sems else None


def string_registers(site):
    """The registers holding a site's string arguments (`char* in %r13`), for the
    floor's reads; none where one is held in memory (`8@16(%rsp)`), which the floor
    does not evaluate: it then reads no strings at that site."""
    regs = []
    for arg in site.get("decoded", []):
        m = re.fullmatch(r"char\* in %(r\w+)", arg.get("description", ""))
        if arg.get("description", "").startswith("char*") and not m:
            return []
        if m:
            regs.append(m.group(1))
    return regs


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


def configurations(pyprobe, floor, pyspy, sites, sems, elf, tmp):
    rec = os.path.join(tmp, "bench.pyprobe")
    configs = {"untraced": lambda cmd: cmd}
    if floor and sites:
        args = [floor] + sum([["--site", hex(a) + (":" + ",".join(regs) if regs else "")] for a, regs in sites], []) \
            + sum([["--sem", hex(a)] for a in sems], [])
        configs["floor"] = lambda cmd: args + ["--"] + cmd
        if (os.cpu_count() or 1) >= 2:
            # The two floors an int3 hit can cost: tracer and target pinned to one CPU
            # (a context switch each way), or to two (a wake-up of the other CPU each way).
            configs["floor same-cpu"] = lambda cmd: args + ["--tracer-cpu", "0", "--target-cpu", "0", "--"] + cmd
            configs["floor cross-cpu"] = lambda cmd: args + ["--tracer-cpu", "0", "--target-cpu", "1", "--"] + cmd
            # The same-CPU floor plus the two reads a tracer that trusts nothing makes
            # per hit: the signal's origin (GETSIGINFO) and the string arguments.
            configs["floor same-cpu reads"] = lambda cmd: args + [
                "--reads", "1", "--tracer-cpu", "0", "--target-cpu", "0", "--"] + cmd
    configs["pyprobe trace"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "int3", "-o", rec, "--"] + cmd
    # pyprobe's tracing thread left where the scheduler puts it: not following the
    # CPU of the thread that hits, nor yielding it (see crates/sdt/src/tracer/engine/affinity.rs).
    configs["pyprobe trace unpinned"] = lambda cmd: [
        "env", "PYPROBE_FOLLOW_CPU=0", pyprobe, "record", "--force", "--mode", "trace", "--engine", "int3", "-o", rec,
        "--"] + cmd
    configs["pyprobe ring"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "ring", "-o", rec, "--"] + cmd
    # The injected hook (CPython 3.7+: sys.monitoring from 3.12, a profile function
    # before), exact without function probes.
    configs["pyprobe hook"] = lambda cmd: [
        pyprobe, "record", "--force", "--mode", "trace", "--engine", "hook", "-o", rec, "--"] + cmd
    configs["pyprobe auto"] = lambda cmd: [pyprobe, "record", "--force", "--mode", "auto", "-o", rec, "--"] + cmd
    # The interpreter's own exact profiler, in the process: what exact tracing from
    # outside is measured against.
    configs["cProfile"] = lambda cmd: cmd[:1] + ["-m", "cProfile", "-o", os.path.join(tmp, "cprofile.out")] + cmd[1:]
    # A hook that does nothing, set where the hook engine sets its own: what the
    # interpreter spends calling it, the floor under any exact tracer inside it.
    hook_floor = os.path.join(REPO, "benches", "hook_floor.py")
    configs["hook floor"] = lambda cmd: cmd[:1] + [hook_floor] + cmd[1:]
    if sems:
        # The interpreter's own probes enabled, no tracer: what computing the probes'
        # arguments costs, the floor under every tracer of them.
        probes_on = os.path.join(REPO, "benches", "probes_on.py")
        configs["probes on"] = lambda cmd: cmd[:1] + [probes_on, ",".join(hex(a) for a in sems)] + cmd[1:]
    if elf and os.geteuid() == 0 and shutil.which("bpftrace"):
        # The kernel's USDT path (root, eBPF): a trap and a BPF program per hit,
        # counting only. Probes attach to the executable machine-wide.
        under = os.path.join(REPO, "benches", "under_bpftrace.py")
        # The helper runs on the interpreter under test (whose environment it needs).
        configs["bpftrace"] = lambda cmd: cmd[:1] + [under, elf, "--"] + cmd
    # -v: the budget's closing line (the share traced exactly) is said on every run.
    configs["pyprobe trace 5%"] = lambda cmd: [
        pyprobe, "record", "-v", "--force", "--mode", "trace", "--engine", "int3", "--max-overhead", "5", "-o", rec,
        "--"] + cmd
    configs["pyprobe ring 5%"] = lambda cmd: [
        pyprobe, "record", "-v", "--force", "--mode", "trace", "--engine", "ring", "--max-overhead", "5", "-o", rec,
        "--"] + cmd
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
    # The size of the recording per event written (pyprobe's closing line).
    size = re.search(r"(\d+) events written to .* \((\d+) bytes\)", proc.stderr)
    per_event = int(size.group(2)) / int(size.group(1)) if size and int(size.group(1)) else None
    # The workload's own clock around its work (fib.py says it), start-up and exit left out.
    own = re.search(r"^workload: ([\d.]+) s$", proc.stderr, re.M)
    own = float(own.group(1)) if own else None
    return elapsed, proc.returncode, hits, exact, dropped, per_event, own, proc.stderr


def measure(args, version):
    """Every configuration on every workload, interleaved, on one interpreter: the rows
    of its table and what could not run."""
    binary, env = interpreter(version)
    pyspy = find_peer("py-spy")
    if not pyspy:
        print("bench: py-spy is not available: its columns are missing", file=sys.stderr)
    sites, sems, elf = function_probe_addresses(args.pyprobe, binary, version)
    tmp = tempfile.mkdtemp(prefix="pyprobe-bench-")
    configs = configurations(args.pyprobe, args.floor if os.path.exists(args.floor) else None, pyspy, sites, sems,
                             elf, tmp)
    if args.configs:
        wanted = set(args.configs.split(",")) | {"untraced"}
        # The floor, `probes on` and bpftrace are left out (and said so above)
        # where the binary has no function probes (bpftrace: or without root).
        unknown = wanted - set(configs) - {"floor", "probes on", "bpftrace"}
        if unknown:
            sys.exit(f"bench: unknown configurations {sorted(unknown)}; known: {sorted(configs)}")
        configs = {k: v for k, v in configs.items() if k in wanted}
    workloads = [w for w in args.workloads.split(",") if w in WORKLOADS]
    times = {(w, c): [] for w in workloads for c in configs}
    hits = {}
    own_times = {}
    exact = {}
    size = {}
    lost_pct = {}
    unavailable = {}
    for run in range(args.runs):
        for w in workloads:
            cmd = [binary, os.path.join(REPO, "benches", "workloads", WORKLOADS[w][0])] + WORKLOADS[w][1:]
            for name, make in configs.items():
                # The floors follow no threads.
                floor = name.startswith("floor") or name == "hook floor"
                if (w, name) in unavailable or (floor and w == "threaded"):
                    continue
                if name != "untraced" and (w, "untraced") in unavailable:
                    continue  # nothing to compare with
                if w in ONLY and name not in ONLY[w]:
                    continue
                if name in CROSS_CPU_BOUND and w != "fib-int3":
                    continue
                elapsed, code, h, ex, dropped, per_event, own, err = run_once(make(cmd), env)
                if code != 0:
                    lines = err.strip().splitlines()
                    # The line that says why: a panic's or an error's, else the last.
                    why = next((l for l in lines if "panicked" in l or "rror" in l), lines[-1] if lines else "")
                    unavailable[(w, name)] = why.strip() or f"exit {code}"
                    continue
                times[(w, name)].append(elapsed)
                if own is not None:
                    own_times.setdefault((w, name), []).append(own)
                if h is not None:
                    hits[(w, name)] = h
                if ex is not None:
                    exact.setdefault((w, name), []).append(ex)
                if per_event is not None:
                    size.setdefault((w, name), []).append(per_event)
                if dropped is not None and h:
                    lost_pct.setdefault((w, name), []).append(100.0 * dropped / h)
            print(f"bench: python {version}: run {run + 1}/{args.runs} of {w} done", file=sys.stderr)

    results = []
    for w in workloads:
        if not times[(w, "untraced")]:
            continue
        base = statistics.median(times[(w, "untraced")])
        for name in configs:
            t = times[(w, name)]
            if not t:
                continue
            med = statistics.median(t)
            row = {"workload": w, "config": name, "median_s": round(med, 4), "slowdown": round(med / base, 2)}
            if (w, name) in exact:
                row["exact_pct"] = round(statistics.median(exact[(w, name)]), 1)
            if (w, name) in size:
                row["bytes_per_event"] = round(statistics.median(size[(w, name)]), 2)
            if (w, name) in lost_pct and name == "pyprobe ring":
                row["lost_pct"] = round(statistics.median(lost_pct[(w, name)]), 1)
            # Per event only where every call is an event: under a budget or in the
            # default mode most of the time goes to sampling, not to events.
            if (w, name) in hits and hits[(w, name)] and name in PER_EVENT:
                row["hits"] = hits[(w, name)]
                row["ns_per_hit"] = round((med - base) * 1e9 / hits[(w, name)])
            # By the workload's own clock: the cost of an event itself, every
            # configuration's start-up and exit left out. The events are those an
            # exact pyprobe run of the same workload counted, the most of them: on
            # 3.11 the probes' runs see the returns alone (its entry probes do not
            # fire), the hook's every call and return.
            events = max((hits[(w, c)] for c in ("pyprobe ring", "pyprobe trace", "pyprobe hook") if hits.get((w, c))),
                         default=None)
            own_base = own_times.get((w, "untraced"))
            # The slowdown of the work itself, start-up and exit left out (where a
            # workload says its own time): what a long-running program pays.
            if own_base and own_times.get((w, name)):
                row["own_slowdown"] = round(statistics.median(own_times[(w, name)]) / statistics.median(own_base), 2)
            if (name in PER_EVENT or name in OWN_ONLY) and events and own_base and own_times.get((w, name)):
                own_med = statistics.median(own_times[(w, name)])
                row["own_s"] = round(own_med, 4)
                row["own_ns_per_event"] = round((own_med - statistics.median(own_base)) * 1e9 / events)
            results.append(row)
    for w in workloads:
        per = {r["config"]: r for r in results if r["workload"] == w}
        floor = per.get("floor", {}).get("ns_per_hit")
        trace = per.get("pyprobe trace", {}).get("ns_per_hit")
        for name in ("pyprobe trace", "pyprobe trace unpinned"):
            ns = per.get(name, {}).get("ns_per_hit")
            if floor and ns:
                per[name]["vs_floor"] = round(ns / floor, 2)
        # An int3 hit against both floors measured in this same invocation.
        same = per.get("floor same-cpu", {}).get("ns_per_hit")
        cross = per.get("floor cross-cpu", {}).get("ns_per_hit")
        reads = per.get("floor same-cpu reads", {}).get("ns_per_hit")
        for name in ("pyprobe trace", "pyprobe trace unpinned", "floor", "floor same-cpu reads"):
            ns = per.get(name, {}).get("ns_per_hit")
            if ns and same:
                per[name]["vs_same_cpu"] = round(ns / same, 2)
            if ns and cross:
                per[name]["vs_cross_cpu"] = round(ns / cross, 2)
            if ns and reads and name.startswith("pyprobe"):
                per[name]["vs_same_cpu_reads"] = round(ns / reads, 2)
        ring = per.get("pyprobe ring", {}).get("ns_per_hit")
        if floor and ring:
            per["pyprobe ring"]["vs_floor"] = round(ring / floor, 4)
        for rate in (100, 1000):
            for nb in ("", " nb"):
                ours, peer = per.get(f"pyprobe sample {rate}{nb}"), per.get(f"py-spy {rate}{nb}")
                if ours and peer:
                    ours["vs_py_spy"] = round(ours["median_s"] / peer["median_s"], 2)
    return results, unavailable


PER_EVENT = ("floor", "floor same-cpu", "floor same-cpu reads", "floor cross-cpu", "pyprobe trace", "pyprobe trace unpinned", "pyprobe ring")
# Exact in the process, or no tracer at all: their cost per event by the workload's clock.
OWN_ONLY = ("cProfile", "probes on", "hook floor", "pyprobe hook", "bpftrace")
COLUMNS = [("workload", "workload"), ("configuration", "config"), ("median", "median_s"),
           ("slowdown", "slowdown"), ("own slowdown", "own_slowdown"), ("ns/event", "ns_per_hit"), ("own ns/event", "own_ns_per_event"), ("vs floor", "vs_floor"),
           ("vs same-CPU", "vs_same_cpu"), ("vs same-CPU + reads", "vs_same_cpu_reads"),
           ("vs cross-CPU", "vs_cross_cpu"),
           ("vs py-spy", "vs_py_spy"), ("exact %", "exact_pct"), ("lost %", "lost_pct"),
           ("B/event", "bytes_per_event")]


def cell(row, key):
    value = row.get(key, "")
    if key == "median_s":
        return f"{value:.3f} s"
    if key == "slowdown":
        return f"{value:.2f}×"
    return str(value)


def print_table(version, runs, results, unavailable):
    print(f"\npyprobe side-by-side, python {version}, {runs} interleaved runs, "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs\n")
    widths = [9, 22, 9, 9, 8, 12, 9, 11, 12, 10, 8, 7, 8]
    print(" ".join(f"{title:>{w}}" for (title, _), w in zip(COLUMNS, widths)))
    for r in results:
        print(" ".join(f"{cell(r, key):>{w}}" for (_, key), w in zip(COLUMNS, widths)))
    for (w, name), why in unavailable.items():
        print(f"unavailable: {w}, {name}: {why}")


def machine():
    """What the numbers were measured on, in a few words."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    memory = ""
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            memory = f", {kib / 1024 / 1024:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{model}, {os.cpu_count()} CPUs{memory}, Linux {os.uname().release}"


def commit():
    out = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


DRAIN_BENCHES = [
    ("call_return_records", "ring records of fib to a recording: repeats known in the ring, the rest copied out and named; encoded, written"),
    ("ring_reader", "the ring's side alone: copied out, strings measured, handed on (what frees the ring)"),
    ("memcpy_floor", "the same ring's bytes moved by `memcpy`"),
]


def measure_drain():
    """Runs the consumer's criterion benchmark (`benches/drain.rs`) once; returns
    {bench: (records per second, ns per record)} and its bytes per event, or None
    when it cannot run."""
    argv = ["cargo", "bench", "--quiet", "--bench", "drain", "--", "--warm-up-time", "1",
            "--measurement-time", "5", "--noplot"]
    try:
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"bench: the drain benchmark did not run: {e}", file=sys.stderr)
        return None
    rates, name, per_event = {}, None, None
    for line in (out.stdout + out.stderr).splitlines():
        m = re.match(r"drain/(\w+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"thrpt:\s*\[\S+ \S+ (\S+) (\S?)elem/s", line)
        if m and name:
            scale = {"K": 1e3, "M": 1e6, "G": 1e9, "": 1.0}[m.group(2)]
            rate = float(m.group(1)) * scale
            rates[name] = (rate, 1e9 / rate)
            name = None
        m = re.search(r"([\d.]+) bytes per event", line)
        if m:
            per_event = float(m.group(1))
    if out.returncode != 0 or not rates:
        print(f"bench: the drain benchmark failed (exit {out.returncode})", file=sys.stderr)
        return None
    return rates, per_event


def drain_lines(drain):
    """The consumer's table, as markdown lines."""
    rates, per_event = drain
    floor = rates.get("memcpy_floor", (0, 0))[1]
    lines = ["| benchmark | what it times | records/s | ns/record | vs memcpy |",
             "| --- | --- | --- | --- | --- |"]
    for name, what in DRAIN_BENCHES:
        if name in rates:
            rate, ns = rates[name]
            ratio = f"{ns / floor:.1f}×" if floor else ""
            lines.append(f"| `{name}` | {what} | {rate / 1e6:.1f} M | {ns:.0f} | {ratio} |")
    if per_event is not None:
        lines += ["", f"The recording it writes: {per_event:.2f} bytes per event."]
    return lines


def write_markdown(path, args, tables, load_before, load_after, drain=None):
    lines = [
        "# Benchmarks",
        "",
        "Generated by `scripts/bench.sh` (`benches/sidebyside.py`); do not edit by hand.",
        "",
        f"* Date: {time.strftime('%Y-%m-%d %H:%M %Z')}; commit {commit()}.",
        f"* Machine: {machine()}; load average {load_before:.2f} before and {load_after:.2f} after.",
        f"* Method: {args.runs} runs of each configuration, interleaved (A B C A B C ...) so that the",
        "  machine's noise hits every configuration alike; medians of the wall-clock time of the",
        "  whole command, start-up included, and for `fib` also of the time its calls took by its",
        "  own clock. Ratios within one table are what to compare; absolute times move with the",
        "  machine.",
        "",
        "Columns: *slowdown* is the median over the untraced run's; *own slowdown* the same by the",
        "workload's own clock around its work (where it says it), start-up and exit left out;",
        "*ns/event* the added time",
        "divided by the probe events the target produced (recorded plus lost); *own ns/event* the",
        "same by the workload's own clock around its work (`fib.py` says it), so start-up, attach",
        "and exit are left out: the cost of an event itself, for pyprobe and for `cProfile` alike",
        "(divided by the events an exact pyprobe run counted); *vs floor* that",
        "cost over the raw ptrace floor's (`benches/floor/floor.c`: one waitpid, GETREGS and CONT",
        "per hit, nothing decoded, neither pinned); *vs same-CPU* and *vs cross-CPU* an int3 hit's",
        "cost over that floor's with tracer and target pinned to one CPU (`floor same-cpu`) or to",
        "two (`floor cross-cpu`), measured in the same invocation; *vs same-CPU + reads* over the",
        "same-CPU floor that also makes the two reads a tracer that trusts nothing needs per hit",
        "(`floor same-cpu reads`: PTRACE_GETSIGINFO, since a `kill` of SIGTRAP can land just",
        "after a site, and one `process_vm_readv` of the string arguments); *vs py-spy* pyprobe's time over",
        "py-spy's at the same rate and",
        "blocking mode; *exact %* the share of the run traced exactly under a 5 % budget;",
        "*lost %* the share of ring events dropped; *B/event* the size of pyprobe's recording",
        "per event written.",
        "",
        "Configurations: `pyprobe trace` is `--mode trace --engine int3` (a ptrace stop per",
        "event); `pyprobe ring` is `--mode trace --engine ring` (events written by trampolines",
        "in the target); `pyprobe auto` is the default mode; `5%` adds `--max-overhead 5`;",
        "`sample N` is `--mode sample -r N`, `nb` adds `--nonblocking`; `pyprobe trace unpinned`",
        "is `pyprobe trace` with `PYPROBE_FOLLOW_CPU=0` (by default pyprobe's tracing thread",
        "follows the CPU of a thread that hits often and yields it to that thread where it may:",
        "see `crates/sdt/src/tracer/engine/affinity.rs`; unpinned, it stays where the scheduler puts it; it, `floor`",
        "and `floor cross-cpu` run on `fib-int3` only: a wake-up of the other CPU per hit makes",
        "the call-heavy workloads take minutes under them); `cProfile` is",
        "`python -m cProfile` (the interpreter's own exact profiler, inside the process);",
        "`probes on` runs the workload with the interpreter's function probes enabled (their",
        "semaphores raised, `benches/probes_on.py`) and no tracer at all: what the interpreter",
        "itself spends computing the probes' arguments, the floor under any tracer of them (its",
        "wall time includes the wrapper's own start-up: read its *own ns/event*); `hook floor` runs",
        "it with a hook that does nothing where the hook engine puts its own (`benches/hook_floor.py`:",
        "on 3.12+ `sys.monitoring` callbacks that return at once, before a C profile function of",
        "three bytes) and no tracer: what the interpreter spends calling a hook per call and",
        "return, the floor under the hook engine and cProfile alike; `bpftrace` counts",
        "the same probes through the kernel (eBPF uprobes, root; `benches/under_bpftrace.py`), its",
        "wall time including bpftrace's compiling its program; it runs where bpftrace is installed",
        "and the benchmark runs as root.",
        "",
        "Workloads (`benches/workloads/`): " + ", ".join(
            f"`{name}` ({' '.join(argv)})" for name, argv in WORKLOADS.items()) + ".",
    ]
    for version, (results, unavailable) in tables.items():
        lines += ["", f"## CPython {version}", ""]
        lines.append("| " + " | ".join(title for title, _ in COLUMNS) + " |")
        lines.append("|" + " --- |" * len(COLUMNS))
        for r in results:
            lines.append("| " + " | ".join(cell(r, key) for _, key in COLUMNS) + " |")
        for (w, name), why in unavailable.items():
            # Paths relative to the repository: the page is the project's, not a machine's.
            why = why.replace(REPO + "/", "")
            lines += ["", f"Not measured: {w}, {name}: {why}"]
    if drain is not None:
        lines += ["", "## The consumer", "",
                  "`cargo bench --bench drain` (criterion; the draining thread's CPU time, a full ring",
                  "of 32,768 fib call and return records per run, the recording written by its own",
                  "thread as in a real run):", ""]
        lines += drain_lines(drain)
    lines += kept_sections(path, "## Sampling rates")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def kept_sections(path, prefix):
    """The sections of the page at `path` whose heading starts with `prefix`
    (written by another script, `benches/rates.py`), kept as they are."""
    try:
        with open(path) as f:
            old = f.read().split("\n")
    except OSError:
        return []
    kept, keeping = [], False
    for line in old:
        if line.startswith("## "):
            keeping = line.startswith(prefix)
            if keeping:
                kept.append("")
        if keeping:
            kept.append(line)
    while kept and kept[-1] == "":
        kept.pop()
    return kept


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", default="3.9", help="one or more versions, comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", default="bench-results.json")
    parser.add_argument("--markdown", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="the dated page of results (default: docs/benchmarks.md); '' for none")
    parser.add_argument("--configs", help="comma-separated configurations to run (default: all); untraced always runs")
    parser.add_argument("--no-drain", action="store_true",
                        help="leave out the consumer's criterion benchmark (run with the markdown page)")
    parser.add_argument("--pyprobe", default=os.path.join(REPO, "target", "release", "pyprobe"))
    parser.add_argument("--floor", default=os.path.join(REPO, "target", "floor"))
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    tables = {}
    for version in args.python.split(","):
        results, unavailable = measure(args, version)
        print_table(version, args.runs, results, unavailable)
        tables[version] = (results, unavailable)
    load_after = os.getloadavg()[0]
    drain = None
    if args.markdown and not args.no_drain:
        print("bench: the consumer's drain benchmark (cargo bench --bench drain)", file=sys.stderr)
        drain = measure_drain()
        if drain is not None:
            print("\n".join(["", "consumer:"] + drain_lines(drain)))
    with open(args.json, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "runs": args.runs, "machine": machine(), "commit": commit(),
                   "pythons": {v: {"results": r, "unavailable": {f"{w} {c}": why for (w, c), why in u.items()}}
                               for v, (r, u) in tables.items()}}, f, indent=1)
    print(f"\nwritten: {args.json}")
    if args.markdown:
        write_markdown(args.markdown, args, tables, load_before, load_after, drain)
        print(f"written: {args.markdown}")


if __name__ == "__main__":
    main()
