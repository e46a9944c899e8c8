"""Audit-heavy workload: every id() call raises the `builtins.id` audit event."""
import sys


def storm(n):
    for i in range(n):
        id(i)


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
    storm(100_000)
print("done")
