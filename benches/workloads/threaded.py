"""Threaded workload: 4 threads doing calls."""
import sys
import threading


def work(n):
    total = 0
    for i in range(n):
        total += square(i)
    return total


def square(x):
    return x * x


n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
threads = [threading.Thread(target=work, args=(n,)) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("done")
