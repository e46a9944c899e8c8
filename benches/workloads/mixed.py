"""Mixed workload: string and dict work at around 1e5 Python calls per second."""
import sys
import time


def normalize(word):
    return word.strip(".,;").lower()


def count(text, counts):
    for word in text.split():
        w = normalize(word)
        counts[w] = counts.get(w, 0) + 1


def main(seconds):
    text = " ".join(f"Word{i % 97}, other{i % 13}; THE end." for i in range(200))
    counts = {}
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline and rounds < 400:
        count(text, counts)
        "".join(sorted(counts))
        rounds += 1
    print(rounds, len(counts))


main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
