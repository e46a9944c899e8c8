#!/usr/bin/env python3
"""Runs a script with the interpreter's own probes enabled and no tracer at all.

    python probes_on.py SEM[,SEM...] SCRIPT [ARGS...]

Each SEM is the address of an SDT semaphore in the interpreter's executable (as
`pyprobe probes --format json` lists it). Raising a semaphore is what any USDT
tracer does first: the interpreter then computes the probe's arguments (file,
function, line) at every call, whether or not anything reads them. The time this
costs is the floor under every tracer of those probes (pyprobe, bpftrace,
SystemTap); the benchmark reports it as `probes on`.
"""
import ctypes
import os
import runpy
import struct
import sys


def executable_base():
    """Where the interpreter's executable is mapped, and whether addresses in it
    are relative to that (a PIE) or absolute."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) < 6 or int(fields[2], 16) != 0:
                continue
            path = fields[5].strip()
            if os.path.basename(path).startswith("python"):
                with open(path, "rb") as f:
                    header = f.read(18)
                if header[:4] != b"\x7fELF":
                    continue
                e_type = struct.unpack_from("<H", header, 16)[0]
                return int(fields[0].split("-")[0], 16) if e_type == 3 else 0
    sys.exit("probes_on: the interpreter's executable is not in /proc/self/maps")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    base = executable_base()
    for text in filter(None, sys.argv[1].split(",")):
        semaphore = ctypes.c_uint16.from_address(base + int(text, 0))
        semaphore.value += 1
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


main()
