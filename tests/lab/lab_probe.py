"""Run on every rank: check an allreduce, then time small and large ones; rank 0 prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI


def _timed(comm: MPI.Comm, x: np.ndarray, repeats: int) -> float:
    """Return the slowest rank's mean seconds per Allreduce of *x* over *repeats* calls."""
    y = np.empty_like(x)
    comm.Allreduce(x, y)  # warm up: connections are set up lazily
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        comm.Allreduce(x, y)
    return comm.allreduce((time.perf_counter() - start) / repeats, op=MPI.MAX)


def main() -> None:
    """Parse the sizes, measure and report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--small-repeats", type=int, default=1000)
    parser.add_argument("--large-mb", type=float, default=0.0)
    parser.add_argument("--large-repeats", type=int, default=3)
    ns = parser.parse_args()
    comm = MPI.COMM_WORLD
    ones = np.full(16, comm.rank + 1, dtype=np.float32)
    total = np.empty_like(ones)
    comm.Allreduce(ones, total)
    report = {
        "size": comm.size,
        "sum": float(total[0]),
        "expected": comm.size * (comm.size + 1) / 2,
        # Lab hosts share one hostname; the network namespace tells them apart.
        "netns": comm.allgather(os.readlink("/proc/self/ns/net")),
        "small_us": _timed(comm, ones, ns.small_repeats) * 1e6,
    }
    if ns.large_mb:
        big = np.ones(int(ns.large_mb * 2**20) // 4, dtype=np.float32)
        seconds = _timed(comm, big, ns.large_repeats)
        # A bandwidth-optimal allreduce moves 2(P-1)/P of the buffer through each link.
        wire = big.nbytes * 2 * (comm.size - 1) / comm.size
        report.update(large_bytes=big.nbytes, large_s=seconds, effective_gbit=wire * 8 / seconds / 1e9)
    if comm.rank == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
