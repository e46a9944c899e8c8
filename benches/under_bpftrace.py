#!/usr/bin/env python3
"""Runs a command while bpftrace counts the interpreter's function probes.

    under_bpftrace.py ELF -- COMMAND [ARGS...]

bpftrace (root, eBPF uprobes on the USDT sites of ELF, the interpreter's
executable) is started first and the command only once bpftrace says its probes
are attached; the command's exit status is this script's. The counts bpftrace
kept are said on stderr as `bpftrace: N function events`. This is the kernel's
USDT path that pyprobe is measured against: every probe hit is a trap into the
kernel and a BPF program, with nothing decoded but a count.
"""
import os
import re
import signal
import subprocess
import sys
import time

ATTACH_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 20


def main():
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit(__doc__)
    elf, command = sys.argv[1], sys.argv[3:]
    # BEGIN runs once every probe is attached: the command starts after it.
    program = 'BEGIN { printf("ready\\n"); } ' + "".join(
        f"usdt:{elf}:python:{probe} {{ @{probe} = count(); }} " for probe in ("function__entry", "function__return"))
    tracer = subprocess.Popen(["bpftrace", "-e", program], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        said = []
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        # bpftrace compiles its program first (a second or more): wait for its word.
        for line in tracer.stdout:
            said.append(line)
            if line.strip() == "ready" or time.monotonic() > deadline:
                break
        if not said or said[-1].strip() != "ready":
            sys.exit("under_bpftrace: bpftrace did not attach:\n" + "".join(said))
        status = subprocess.run(command).returncode
        tracer.send_signal(signal.SIGINT)
        rest, _ = tracer.communicate(timeout=EXIT_TIMEOUT_S)
        counts = [int(n) for n in re.findall(r"^@function__\w+: (\d+)$", rest, re.M)]
        print(f"bpftrace: {sum(counts)} function events", file=sys.stderr)
        sys.exit(status)
    finally:
        # Never leave bpftrace attached: its probes would slow every run of this
        # interpreter on the machine.
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait()


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("under_bpftrace: bpftrace needs root")
    main()
