"""Audit-heavy workload: every id() call raises the `builtins.id` audit event.

Says on stderr how long the calls took by its own clock (`workload: S s`), start-up
and exit left out: the default mode's overhead budget is judged on it.
"""
import sys
import time


def storm(n):
    for i in range(n):
        id(i)


start = time.perf_counter()
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
    storm(100_000)
print("workload: %.6f s" % (time.perf_counter() - start), file=sys.stderr)
print("done")
