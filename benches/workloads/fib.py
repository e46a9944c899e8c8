"""Call-heavy workload: recursive fib (242,785 calls for fib(25)).

Says on stderr how long the calls took by its own clock (`workload: S s`): the
benchmark's per-event costs are computed from it, start-up and exit left out.
"""
import sys
import time


def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)


n = int(sys.argv[1]) if len(sys.argv) > 1 else 25
start = time.perf_counter()
result = fib(n)
print("workload: %.6f s" % (time.perf_counter() - start), file=sys.stderr)
print(result)
