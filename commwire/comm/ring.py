"""A ring all-reduce over MPI point-to-point messages, for large float sums (the mpi transport's).

MPICH's default algorithms for large messages (recursive halving and doubling, or its ring
without segments) reach 72–90% of what gloo's pipelined ring gets from a 1 Gbit/s link between
hosts (docs/benchmarks.md, "Transports"). This is the bandwidth-optimal ring: a reduce-scatter in
``size - 1`` steps, each rank sending one block to its right neighbour while it adds the block
arriving from its left one, the block split in ``SEGMENTS`` messages so that adding overlaps
receiving; then an all-gather of the reduced blocks around the same ring. Every element is
summed in the same order on every rank and then copied, so all ranks get identical bits.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["RING_BYTES", "SEGMENTS", "ONE_NODE", "ring_allreduce", "uses_ring"]

RING_BYTES = 1 << 20
"""Sums of float arrays from this many bytes, on 3 ranks or more spread over nodes, take the ring."""

SEGMENTS = 4
"""Messages each block of the reduce-scatter travels in."""

_TAG = 0x5249  # "RI": apart from other point-to-point traffic on the communicator


ONE_NODE = False
"""Take the ring also when every rank shares one node's memory (MPICH's shared-memory all-reduce is
faster there: 1.2x against the ring's 1.5x of raw time at 1 MiB, 4 ranks on 2 cores); tests set it."""


def uses_ring(size: int, recv: Any, rop: Any, sum_op: Any) -> bool:
    """Return whether an all-reduce by op ``rop`` into host buffer ``recv`` over ``size`` ranks may take the ring.

    The cheap tests come first: every all-reduce of the mpi transport, the smallest included, asks.
    """
    return (type(recv) is np.ndarray and recv.nbytes >= RING_BYTES and size >= 3 and recv.dtype.kind == "f"
            and recv.flags.c_contiguous and rop == sum_op)


def ring_allreduce(mpi: Any, buf: np.ndarray, wait: Callable[[list[Any]], None]) -> None:
    """Sum ``buf`` (contiguous, the same length on every rank) over ``mpi`` in place, by the ring.

    ``wait`` waits for a list of requests (the transport's: blocking, or yielding on a lane thread).
    """
    flat = buf.reshape(-1)
    rank, size = mpi.Get_rank(), mpi.Get_size()
    bounds = [flat.shape[0] * b // size for b in range(size + 1)]
    right, left = (rank + 1) % size, (rank - 1) % size
    incoming = np.empty(bounds[1] - bounds[0] + 1, dtype=flat.dtype)
    for step in range(size - 1):  # reduce-scatter: after it, rank r holds block (r + 1) % size summed
        out_block, in_block = (rank - step) % size, (rank - step - 1) % size
        s0, s1 = bounds[out_block], bounds[out_block + 1]
        r0, r1 = bounds[in_block], bounds[in_block + 1]
        send_cuts = [s0 + (s1 - s0) * k // SEGMENTS for k in range(SEGMENTS + 1)]
        recv_cuts = [(r1 - r0) * k // SEGMENTS for k in range(SEGMENTS + 1)]
        recvs = [mpi.Irecv(incoming[recv_cuts[k]:recv_cuts[k + 1]], source=left, tag=_TAG + k)
                 for k in range(SEGMENTS)]
        sends = [mpi.Isend(flat[send_cuts[k]:send_cuts[k + 1]], dest=right, tag=_TAG + k) for k in range(SEGMENTS)]
        for k in range(SEGMENTS):
            wait([recvs[k]])
            lo, hi = recv_cuts[k], recv_cuts[k + 1]
            np.add(flat[r0 + lo:r0 + hi], incoming[lo:hi], out=flat[r0 + lo:r0 + hi])
        wait(sends)
    for step in range(size - 1):  # all-gather of the summed blocks around the same ring
        out_block, in_block = (rank + 1 - step) % size, (rank - step) % size
        wait([mpi.Irecv(flat[bounds[in_block]:bounds[in_block + 1]], source=left, tag=_TAG + SEGMENTS),
              mpi.Isend(flat[bounds[out_block]:bounds[out_block + 1]], dest=right, tag=_TAG + SEGMENTS)])
