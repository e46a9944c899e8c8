"""Workload of the sampling-rate study (benches/rates.py): a fixed amount of
call-heavy work split between light() (about a quarter) and heavy(), each call
timed by the workload itself.

Prints "ready" and waits a moment (for a profiler to attach), does ROUNDS rounds,
then prints one JSON line: its own time for the work and light()'s share of it.
"""
import json
import sys
import time


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


def light():
    return fib(15)


def heavy():
    return fib(17)


def main(rounds):
    print("ready", flush=True)
    time.sleep(0.5)
    spent = {"light": 0.0, "heavy": 0.0}
    start = time.perf_counter()
    for _ in range(rounds):
        for name, fn in (("light", light), ("heavy", heavy)):
            t0 = time.perf_counter()
            fn()
            spent[name] += time.perf_counter() - t0
    own = time.perf_counter() - start
    share = spent["light"] / (spent["light"] + spent["heavy"])
    print(json.dumps({"own_s": own, "light_share": share}), flush=True)


main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
