"""GIL-contended Python threads: THREADS threads share OPS small steps of work.

Usage: python bench/gil_workload.py OPS [THREADS]. Waits for a line on stdin (so the harness
can make sure the daemon watches it first), then prints the wall-clock ns per step. The switch
interval is cut to 100 us so the GIL changes hands often: each hand-off is a futex wait and
wake, which is what a watching probe pays for.
"""

from __future__ import annotations

import sys
import threading
import time


def work(steps: int, out: list[int]) -> None:
    acc = 0
    for i in range(steps):
        acc += (i * 7) & 15
    out.append(acc)


def main() -> int:
    ops = int(sys.argv[1])
    nthreads = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    sys.setswitchinterval(1e-4)
    if not sys.stdin.readline():
        return 1
    out: list[int] = []
    threads = [threading.Thread(target=work, args=(ops // nthreads, out)) for _ in range(nthreads)]
    t0 = time.perf_counter_ns()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter_ns() - t0
    print(f"{dt / (ops // nthreads * nthreads):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
