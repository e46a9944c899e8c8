#!/usr/bin/env python3
"""Sampling-rate study: pyprobe's default mode against py-spy and CPython 3.15's own
sampler (Tachyon, `python -m profiling.sampling`) at 100 Hz, 1 kHz and 10 kHz, each
attached with -p to the same workload (`workloads/rates_work.py`: fixed call-heavy
work, a quarter of it in light(), timed by the workload itself).

For each profiler and rate, over interleaved runs (medians):
  * slowdown: the workload's own time for its work over the untraced runs';
  * samples/s: samples recorded per second of the work (the rate achieved);
  * share error: light()'s share of the samples minus the share the workload
    measured, in points.

py-spy reads CPython up to 3.13 and Tachyon only 3.15, so run it once per
interpreter: `benches/rates.py --python .pythons/bin/python3.15` (pyprobe and
Tachyon) and `--python ~/.pyenv/versions/3.12.1/bin/python` (pyprobe and py-spy).
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
WORKLOAD = os.path.join(REPO, "benches", "workloads", "rates_work.py")


def profilers(pyprobe, python, pyspy):
    """name -> argv, with {pid}, {rate} and {out} to fill in; each writes collapsed
    stacks to {out}.txt. Every profiler runs once stopping the threads for each
    sample and once not."""
    record = [pyprobe, "record", "--force", "-p", "{pid}", "-r", "{rate}", "-o", "{out}.txt"]
    found = {"pyprobe": record, "pyprobe nb": record[:3] + ["--nonblocking"] + record[3:]}
    if pyspy:
        record = [pyspy, "record", "-p", "{pid}", "-r", "{rate}", "-f", "raw", "-o", "{out}.txt"]
        found.update({"py-spy": record, "py-spy nb": record[:2] + ["--nonblocking"] + record[2:]})
    probe = subprocess.run([python, "-c", "import profiling.sampling"], capture_output=True)
    if probe.returncode == 0:
        attach = [python, "-m", "profiling.sampling", "attach", "-r", "{rate}", "--collapsed",
                  "-o", "{out}.txt", "{pid}"]
        found.update({"tachyon": attach, "tachyon blocking": attach[:4] + ["--blocking"] + attach[4:]})
    return found


def frame_function(frame):
    """The function of one collapsed frame: pyprobe and py-spy write `name (file:line)`,
    Tachyon `file:name:line`."""
    frame = frame.strip()
    m = re.match(r"^([^ ]+) \(", frame)
    if m:
        return m.group(1).rsplit(".", 1)[-1]
    parts = frame.split(":")
    return parts[-2] if len(parts) >= 3 else frame


def light_and_heavy(path):
    """Samples whose stack holds light() and heavy()."""
    light = heavy = 0
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            functions = {frame_function(fr) for fr in stack.split(";")}
            if "light" in functions:
                light += int(count)
            elif "heavy" in functions:
                heavy += int(count)
    return light, heavy


def run_once(python, rounds, argv, rate, out):
    """Runs the workload, attaching `argv` (None: untraced) once it is ready;
    returns (own seconds, measured share, samples of light, of heavy)."""
    target = subprocess.Popen([python, WORKLOAD, str(rounds)], stdout=subprocess.PIPE, text=True)
    assert target.stdout.readline().strip() == "ready"
    profiler = None
    if argv:
        cmd = [a.format(pid=target.pid, rate=rate, out=out) for a in argv]
        profiler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    result = json.loads(target.stdout.readline())
    target.wait()
    samples = (0, 0)
    if profiler:
        try:
            _, err = profiler.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            profiler.kill()
            _, err = profiler.communicate()
        if profiler.returncode != 0 or not os.path.exists(out + ".txt"):
            first = next((l for l in err.splitlines() if "rror" in l), err.strip()[-200:])
            raise RuntimeError(f"{cmd[0]} failed: {first.strip()}")
        samples = light_and_heavy(out + ".txt")
        os.unlink(out + ".txt")
    return result["own_s"], result["light_share"], samples


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, help="the interpreter that runs the workload")
    parser.add_argument("--rates", default="100,1000,10000")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8000, help="the workload's rounds (8000: about 3 s)")
    parser.add_argument("--profilers", help="comma-separated (default: every one available)")
    parser.add_argument("--pyprobe", default=os.path.join(REPO, "target", "release", "pyprobe"))
    parser.add_argument("--markdown", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="the page whose section for this interpreter is rewritten "
                             "(default: docs/benchmarks.md); '' for none")
    args = parser.parse_args()

    available = profilers(args.pyprobe, args.python, shutil.which("py-spy"))
    wanted = args.profilers.split(",") if args.profilers else list(available)
    rates = [int(r) for r in args.rates.split(",")]
    configs = [(name, rate) for name in wanted if name in available for rate in rates]
    own = {c: [] for c in configs + [("untraced", 0)]}
    rate_achieved = {c: [] for c in configs}
    error = {c: [] for c in configs}
    failed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for config in [("untraced", 0)] + configs:
                if config in failed:
                    continue
                name, rate = config
                argv = available.get(name)
                try:
                    seconds, truth, (light, heavy) = run_once(args.python, args.rounds, argv, rate,
                                                              os.path.join(tmp, "out"))
                except (RuntimeError, AssertionError, ValueError) as e:
                    failed[config] = str(e)
                    continue
                own[config].append(seconds)
                if argv:
                    rate_achieved[config].append((light + heavy) / seconds)
                    if light + heavy:
                        error[config].append(100 * (light / (light + heavy) - truth))
            print(f"rates: run {run + 1}/{args.runs} done", file=sys.stderr)

    base = statistics.median(own[("untraced", 0)])
    version = subprocess.run([args.python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()
    label = f"CPython {version} ({'Debian' if '.pythons' in args.python else 'pyenv'})"
    rows = []
    for config in configs:
        if config in failed:
            rows.append([config[0], str(config[1]), "failed: " + failed[config][:160], "", ""])
            continue
        med = statistics.median(own[config])
        err = statistics.median(error[config]) if error[config] else float("nan")
        rows.append([config[0], str(config[1]), f"{med / base:.2f}×",
                     f"{statistics.median(rate_achieved[config]):.0f}", f"{err:+.1f}"])
    print(f"\nsampling-rate study, {label}, {args.runs} interleaved runs, "
          f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; untraced {base:.3f} s")
    print(f"{'profiler':>18} {'rate':>6} {'slowdown':>9} {'samples/s':>10} {'share error':>12}")
    for row in rows:
        print(f"{row[0]:>18} {row[1]:>6} {row[2]:>9} {row[3]:>10} {row[4]:>12}")
    if args.markdown:
        write_section(args.markdown, label, args, base, rows)


def write_section(path, label, args, base, rows):
    """Rewrites this interpreter's section of the page at `path` (kept by
    `sidebyside.py` when it rewrites the rest)."""
    heading = f"## Sampling rates: {label}"
    section = [heading, "",
               f"Generated by `benches/rates.py` on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs: "
               f"{args.runs} interleaved runs of `workloads/rates_work.py {args.rounds}` (untraced "
               f"{base:.2f} s), each profiler attached with -p at each rate. *slowdown*: the work's",
               "own time over the untraced runs'; *samples/s*: samples recorded per second of it (the",
               "rate achieved); *share error*: light()'s share of the samples minus the share the",
               "workload measured, in points. `nb`: without stopping the threads. On a 2-CPU VM,",
               "slowdowns within about 10 % of 1.00 are the noise between runs.", "",
               "| profiler | rate (Hz) | slowdown | samples/s | share error |",
               "| --- | --- | --- | --- | --- |"]
    section += ["| " + " | ".join(row) + " |" for row in rows]
    try:
        with open(path) as f:
            lines = f.read().rstrip("\n").split("\n")
    except OSError:
        lines = ["# Benchmarks"]
    if heading in lines:
        start = lines.index(heading)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = section + ([""] if end < len(lines) else [])
    else:
        lines += [""] + section
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
