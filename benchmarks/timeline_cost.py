"""What recording a timeline costs: time per call and memory, with and without, in one job.

Each rank makes ``--calls`` small all-reduces (8-byte messages: the call's own cost is
smallest, so the timeline's share is largest) with no timeline, then as many with one
(``start_timeline``), then writes it (``stop_timeline``). Printed per rank: microseconds
per call in each arm, how much the process's resident memory grew during each arm, and
how long writing the timeline took; rank 0 also gives the file's size and events.

    commwire run -np 2 python benchmarks/timeline_cost.py --calls 200000 --path /tmp/timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import commwire as cw
from commwire.comm import runtime


def rss_mib() -> float:
    """This process's resident memory in MiB (Linux)."""
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def arm(calls: int, x: np.ndarray) -> tuple[float, float]:
    """Return (microseconds per call, MiB the resident memory grew) over ``calls`` all-reduces."""
    before, start = rss_mib(), time.perf_counter()
    for _ in range(calls):
        cw.allreduce(x, name="g")
    return (time.perf_counter() - start) / calls * 1e6, rss_mib() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="all-reduces per arm")
    parser.add_argument("--path", default="timeline_cost.json", help="where the timeline goes (rank 0's path)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        raise SystemExit("reads /proc/self/statm: run on Linux")
    cw.init()
    x = np.ones(1)
    arm(min(args.calls, 2000), x)  # warm-up: first-call agreement, allocator
    plain_us, plain_mib = arm(args.calls, x)
    runtime.start_timeline(args.path)
    timed_us, timed_mib = arm(args.calls, x)
    start = time.perf_counter()
    runtime.stop_timeline()
    write_s = time.perf_counter() - start
    line = (f"rank {cw.rank()}: {args.calls} calls; no timeline {plain_us:.1f} us/call, memory +{plain_mib:.1f} MiB; "
            f"timeline {timed_us:.1f} us/call ({timed_us / plain_us:.2f}x), memory +{timed_mib:.1f} MiB; "
            f"stop_timeline {write_s:.2f} s")
    if cw.rank() == 0:
        with open(args.path, encoding="ascii") as fh:
            events = json.load(fh)
        line += f"; {os.path.getsize(args.path) / 2**20:.1f} MiB, {len(events)} events"
    sys.stdout.write(line + "\n")
    cw.finalize()


if __name__ == "__main__":
    main()
