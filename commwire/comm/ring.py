"""A ring all-reduce over MPI point-to-point messages, for large float sums (the mpi transport's).

MPICH's default algorithms for large messages (recursive halving and doubling, or its ring
without segments) reach 72–90% of what gloo's pipelined ring gets from a 1 Gbit/s link between
hosts (docs/benchmarks.md, "Transports"). This is the bandwidth-optimal ring: a reduce-scatter in
``size - 1`` steps, each rank sending one block to its right neighbour while it adds the block
arriving from its left one, the block cut into messages of about ``SEGMENT_BYTES``; then an
all-gather of the reduced blocks around the same ring. A segment moves on as soon as it has arrived (and been added), so
receiving, adding and sending overlap within a block and across the steps. Every element is
summed in the same order on every rank and then copied, so all ranks get identical bits.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

__all__ = ["RING_BYTES", "SEGMENT_BYTES", "MAX_SEGMENTS", "ONE_NODE", "ring_steps", "uses_ring"]

RING_BYTES = 1 << 20
"""Sums of float arrays from this many bytes, on 3 ranks or more spread over nodes, take the ring."""

SEGMENT_BYTES = 128 << 10
"""Bytes per message the blocks are cut into (at most ``MAX_SEGMENTS`` per block, at least one)."""

MAX_SEGMENTS = 16
"""The most messages a block is cut into (larger blocks take larger segments)."""

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


def ring_steps(mpi: Any, buf: np.ndarray) -> Iterator[list[Any]]:
    """Sum ``buf`` (contiguous, the same length on every rank) over ``mpi`` in place, by the ring.

    A generator: it yields each list of requests it must see completed before it goes on (whoever
    drives it waits for them, or tests them and resumes later; ``handle.drive``).

    The ``2 * (size - 1)`` phases run as one pipeline: the block a rank receives in one phase is
    the block it sends in the next, so each segment goes on to the right neighbour as soon as it
    has arrived (and, in the reduce-scatter, been added), without waiting for the rest of its block.
    """
    flat = buf.reshape(-1)
    rank, size = mpi.Get_rank(), mpi.Get_size()
    bounds = [flat.shape[0] * b // size for b in range(size + 1)]
    right, left = (rank + 1) % size, (rank - 1) % size
    largest = max(bounds[b + 1] - bounds[b] for b in range(size))
    segments = max(1, min(MAX_SEGMENTS, largest * flat.itemsize // SEGMENT_BYTES))

    cuts = [[bounds[b] + (bounds[b + 1] - bounds[b]) * k // segments for k in range(segments + 1)]
            for b in range(size)]  # segment boundaries of each block, in buf

    phases = 2 * (size - 1)
    # Phase p < size - 1 (reduce-scatter): send block rank - p, add block rank - p - 1 into buf.
    # Phase size - 1 + q (all-gather): send block rank + 1 - q, receive block rank - q into buf.
    recv_blocks = [(rank - p - 1) % size if p < size - 1 else (rank - p + size - 1) % size for p in range(phases)]
    incoming = [np.empty(largest // segments + 1, dtype=flat.dtype) for _ in range(2 * segments)]
    sends: dict[tuple[int, int], Any] = {}

    def post_recv(p: int, k: int) -> Generator[list[Any], None, Any]:  # returns the receive request
        lo, hi = cuts[recv_blocks[p]][k:k + 2]
        if p < size - 1:  # into a scratch segment (two per k: this phase's and the next one's)
            return mpi.Irecv(incoming[2 * k + p % 2][:hi - lo], source=left, tag=_TAG + k)
        q = p - (size - 1)  # block rank - q was sent in phase q: that send must be done before it is overwritten
        if (q, k) in sends:
            yield [sends.pop((q, k))]
        return mpi.Irecv(flat[lo:hi], source=left, tag=_TAG + k)

    first = cuts[rank]
    recvs = []
    for k in range(segments):
        recvs.append((yield from post_recv(0, k)))
    for k in range(segments):
        sends[0, k] = mpi.Isend(flat[first[k]:first[k + 1]], dest=right, tag=_TAG + k)
    for p in range(phases):
        got = cuts[recv_blocks[p]]
        for k in range(segments):
            yield [recvs[k]]
            lo, hi = got[k], got[k + 1]
            if p < size - 1:
                np.add(flat[lo:hi], incoming[2 * k + p % 2][:hi - lo], out=flat[lo:hi])
            if p + 1 < phases:  # the segment just completed is the next phase's to send
                sends[p + 1, k] = mpi.Isend(flat[lo:hi], dest=right, tag=_TAG + k)
                recvs[k] = yield from post_recv(p + 1, k)
    yield list(sends.values())
