"""GC-heavy workload: reference cycles that only the collector frees."""
import sys


class Node:
    def __init__(self):
        self.other = None


def make_cycles(n):
    for _ in range(n):
        a, b = Node(), Node()
        a.other, b.other = b, a


for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 40):
    make_cycles(5000)
print("done")
