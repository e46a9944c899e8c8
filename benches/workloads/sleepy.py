"""Sleep-heavy workload: mostly waiting, a little work between sleeps."""
import sys
import time


def tick(i):
    return sum(range(i % 100))


for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 100):
    tick(i)
    time.sleep(0.01)
print("done")
