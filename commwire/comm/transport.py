"""Transports: the data movements a communicator's collectives are built from.

A ``Communicator`` (commwire.comm.communicator) runs the agreement protocol
(commwire.comm.protocol), its lanes, counters and timeline over MPI — the
control plane — and hands the data itself to a *transport*:

* ``MPITransport`` (the default): the same mpi4py communicator carries the data;
* ``TorchTransport`` (commwire.comm.torch_transport): a ``torch.distributed``
  process group does — gloo for host buffers, NCCL for CUDA buffers — while MPI
  stays the control plane, as in Horovod (MPI for control, NCCL for data).

A transport moves buffers it is given; it validates nothing (the communicator
has, on every rank together, before any data moves) and never decides anything
a rank could disagree on. Buffers are contiguous numpy arrays, or device arrays
(torch CUDA tensors, cupy arrays) where ``device_buffers`` says so. Raw-byte
moves (broadcast, gathers, all-to-all) get flat uint8 views.

Every blocking method is a collective over the transport's ranks. On a lane's
transport (``lane=True``) they wait by polling and yielding the CPU
(``commwire.comm.handle.wait_requests``) instead of spinning inside MPI.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from . import ring as ring_mod
from .handle import COLLECTIVE_NAP, drive, testall, wait_requests, waitall
from .ring import ring_steps, uses_ring

__all__ = ["Transport", "MPITransport", "TRANSPORTS", "spans_nodes"]


def spans_nodes(mpi: Any) -> bool:
    """Return whether the ranks of mpi4py communicator ``mpi`` do not all share one node's memory (collective)."""
    from mpi4py import MPI

    local = mpi.Split_type(MPI.COMM_TYPE_SHARED, key=mpi.Get_rank())
    try:
        return bool(local.Get_size() < mpi.Get_size())
    finally:
        local.Free()


def _collective_wait(requests: list[Any]) -> None:
    """Wait for a whole collective started on a lane's communicator (naps up to ``COLLECTIVE_NAP``)."""
    wait_requests(requests, nap=COLLECTIVE_NAP)


TRANSPORTS = ("mpi", "torch")
"""The transports ``commwire.init(transport=...)`` and COMMWIRE_TRANSPORT accept."""


class Transport:
    """The primitive data movements of a group of ranks (see the module docstring).

    Reductions take an opaque op made by ``reduce_op(op, dtype)`` (made once per
    agreed signature and reused, so a call pays no lookup). ``send=None`` means
    in place: the reduction reads and writes ``recv``.
    """

    name = "?"
    rank: int
    size: int
    lane = False
    point_to_point = True
    """Whether the codec pipeline moves its payloads by ``isend``/``irecv`` (else by ``ialltoallv``/``iallgatherv``)."""

    def reduce_op(self, op: str, dtype: np.dtype) -> Any:
        """Return this transport's op that reduces buffers of ``dtype`` with canonical ``op`` (sum, min, ...)."""
        raise NotImplementedError

    def device_buffers(self, x: Any) -> bool:
        """Return whether device array ``x`` may be handed to this transport as it is (else stage it on the host)."""
        raise NotImplementedError

    def allreduce(self, send: Any, recv: Any, rop: Any) -> None:
        """Reduce every rank's ``send`` (or ``recv`` when ``send`` is None) into every rank's ``recv``."""
        raise NotImplementedError

    def allreduce_small(self, buf: Any, rop: Any) -> None:
        """Reduce host buffer ``buf`` in place, ``buf`` under ``ring.RING_BYTES`` (the fused fast path's all-reduce)."""
        self.allreduce(None, buf, rop)

    steps = False
    """Whether ``allreduce_steps`` really moves data in steps a caller can drive (else it runs whole)."""

    beside: Any = None
    """The MPI request of the agreement flag of the collective whose data this transport is moving, or
    None; set by the protocol around the data move. MPI moves the flag only inside MPI calls: a transport
    whose data travels outside them tests it while it waits for its own work (``TorchTransport.wait``)."""

    def allreduce_steps(self, send: Any, recv: Any, rop: Any) -> Iterator[list[Any]]:
        """``allreduce`` as a generator that yields each list of requests it waits for.

        Whoever drives it either waits for each list (``wait``) or tests it (``test``) and resumes
        the generator later, so a caller's thread can move a collective forward between its own
        work (``Lane.start``). This default runs ``allreduce`` whole and yields nothing.
        """
        self.allreduce(send, recv, rop)
        yield from ()

    def test(self, requests: list[Any]) -> bool:
        """Return whether every request is complete (making progress where the library needs calls for it)."""
        raise NotImplementedError

    def wait_collective(self, requests: list[Any]) -> None:
        """Wait for the requests of a whole collective (``allreduce_steps``'); by default as ``wait``."""
        self.wait(requests)

    def allgather(self, send: Any, recv: Any) -> None:
        """Gather equal blocks: ``recv`` holds ``size`` copies of ``send``'s size, in rank order."""
        raise NotImplementedError

    def allgatherv(self, send: Any, recv: Any, counts: np.ndarray) -> None:
        """Gather bytes: rank r contributes ``counts[r]`` bytes; ``recv`` holds them in rank order."""
        raise NotImplementedError

    def broadcast(self, buf: Any, root: int) -> None:
        """Copy root's bytes ``buf`` into every rank's ``buf``."""
        raise NotImplementedError

    def reduce_scatter(self, send: Any, recv: Any, counts: np.ndarray, rop: Any) -> None:
        """Reduce ``send`` over ranks; rank r gets elements of its block (``counts[r]`` elements) in ``recv``."""
        raise NotImplementedError

    def alltoallv(self, send: Any, send_counts: np.ndarray, recv: Any, recv_counts: np.ndarray) -> None:
        """Send ``send_counts[r]`` bytes (in order) to each rank r; receive ``recv_counts[r]`` from each."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait until every rank is here."""
        raise NotImplementedError

    # Non-blocking moves of the codec pipeline (commwire.codecs.collective): each returns a request.
    def isend(self, buf: Any, dest: int, tag: int) -> Any:
        """Start sending ``buf`` to ``dest`` with ``tag``; return the request."""
        raise NotImplementedError

    def irecv(self, buf: Any, source: int, tag: int) -> Any:
        """Start receiving into ``buf`` from ``source`` with ``tag``; return the request."""
        raise NotImplementedError

    def iallgather(self, send: Any, recv: Any) -> Any:
        """Start gathering equal blocks (``allgather``); return the request."""
        raise NotImplementedError

    def ialltoallv(self, send: Any, send_counts: Any, recv: Any, recv_counts: Any) -> Any:
        """Start an ``alltoallv`` of elements (not bytes) of ``send``/``recv``; return the request."""
        raise NotImplementedError

    def iallgatherv(self, send: Any, recv: Any, counts: Any) -> Any:
        """Start gathering ``counts[r]`` elements from each rank r into ``recv`` in rank order; return the request."""
        raise NotImplementedError

    def alltoall_counts(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Exchange one int64 per rank pair (the row counts an ``alltoallv`` needs)."""
        raise NotImplementedError

    def check_buffer(self, x: Any, device: bool) -> None:
        """Raise a clear error if this transport cannot move ``x`` (a device array if ``device``)."""

    def private(self) -> Transport:
        """Return a transport whose messages never match this one's, for the codec pipeline.

        Collective on the first call, which makes it; later calls return the same one, and
        ``free`` releases it with this transport.
        """
        raise NotImplementedError

    def wait(self, requests: list[Any]) -> None:
        """Wait for requests this transport started (yielding the CPU on a lane thread)."""
        raise NotImplementedError

    def progress(self, request: Any) -> None:
        """Let requests in flight make progress (where the library needs calls for that)."""

    def derive(self, mpi_comm: Any, ranks: list[int], uid: str = "") -> Transport:
        """Return the transport of a communicator derived from this one (collective over its members).

        ``mpi_comm`` is the derived MPI communicator; ``ranks`` its members, in its rank order, as ranks
        of this transport; ``uid`` the derived communicator's name (the same on every member).
        """
        raise NotImplementedError

    def free(self) -> None:
        """Release what this transport holds (its communicator or process group)."""


class MPITransport(Transport):
    """Data over an mpi4py communicator (the control plane's own, or a duplicate of it).

    Args:
        mpi_comm: the mpi4py communicator.
        cuda_aware: hand device buffers to MPI directly (a CUDA-aware MPI); else they are staged.
    """

    name = "mpi"

    def __init__(self, mpi_comm: Any, *, cuda_aware: bool = False) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.cuda_aware = cuda_aware
        self.owned = False  # a private duplicate (``private``): freed with the transport
        self._private: MPITransport | None = None  # made by ``private``; freed with this transport
        self._in_place = MPI.IN_PLACE
        self._spans: bool | None = None  # whether the ranks span nodes (asked at the first large float sum)

    def __repr__(self) -> str:
        return f"<MPITransport rank {self.rank} of {self.size}>"

    def reduce_op(self, op: str, dtype: np.dtype) -> Any:
        from .reduce import mpi_op

        return mpi_op(op, dtype)

    def device_buffers(self, x: Any) -> bool:
        return self.cuda_aware

    def _run(self, blocking: Any, nonblocking: Any, *args: Any) -> None:
        # A lane's communicator runs collectives on its worker thread and, when the lane is idle,
        # on the caller's: always the non-blocking variant there, since MPI never matches a
        # blocking collective on one rank with a non-blocking one on another (that hangs).
        if self.lane:
            _collective_wait([nonblocking(*args)])
        else:
            blocking(*args)

    steps = True

    def allreduce(self, send: Any, recv: Any, rop: Any) -> None:
        drive(self.allreduce_steps(send, recv, rop), self.wait_collective)

    def allreduce_steps(self, send: Any, recv: Any, rop: Any) -> Iterator[list[Any]]:
        mpi = self.mpi
        if uses_ring(self.size, recv, rop, self._MPI.SUM) and self._ring_here():  # see commwire.comm.ring
            if send is not None:
                np.copyto(recv.reshape(-1), np.asarray(send).reshape(-1))
            yield from ring_steps(mpi, recv)
        elif self.lane:  # the non-blocking variant on a lane's communicator (see _run)
            yield [mpi.Iallreduce(self._in_place if send is None else send, recv, rop)]
        else:
            mpi.Allreduce(self._in_place if send is None else send, recv, rop)

    def test(self, requests: list[Any]) -> bool:
        return testall(requests)

    def wait_collective(self, requests: list[Any]) -> None:
        if self.lane:
            _collective_wait(requests)
        else:
            waitall(requests)

    def allreduce_small(self, buf: Any, rop: Any) -> None:
        # No ring test and no hand-off: at 8 bytes these calls cost as much as the Allreduce (~1.5 us).
        if self.lane:
            _collective_wait([self.mpi.Iallreduce(self._in_place, buf, rop)])
        else:
            self.mpi.Allreduce(self._in_place, buf, rop)

    def _ring_here(self) -> bool:
        # Asked by every rank in the same all-reduce (a collective on the first call), then remembered.
        if self._spans is None:
            self._spans = spans_nodes(self.mpi)
        return self._spans or ring_mod.ONE_NODE

    def allgather(self, send: Any, recv: Any) -> None:
        self._run(self.mpi.Allgather, self.mpi.Iallgather, send, recv)

    def allgatherv(self, send: Any, recv: Any, counts: np.ndarray) -> None:
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self._run(self.mpi.Allgatherv, self.mpi.Iallgatherv, send, [recv, (counts, displs), self._MPI.BYTE])

    def broadcast(self, buf: Any, root: int) -> None:
        self._run(self.mpi.Bcast, self.mpi.Ibcast, buf, root)

    def reduce_scatter(self, send: Any, recv: Any, counts: np.ndarray, rop: Any) -> None:
        self._run(self.mpi.Reduce_scatter, self.mpi.Ireduce_scatter, send, recv, counts, rop)

    def alltoallv(self, send: Any, send_counts: np.ndarray, recv: Any, recv_counts: np.ndarray) -> None:
        sd = np.concatenate(([0], np.cumsum(send_counts)[:-1]))
        rd = np.concatenate(([0], np.cumsum(recv_counts)[:-1]))
        self._run(self.mpi.Alltoallv, self.mpi.Ialltoallv, [send, (send_counts, sd), self._MPI.BYTE],
                  [recv, (recv_counts, rd), self._MPI.BYTE])

    def alltoall_counts(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run(self.mpi.Alltoall, self.mpi.Ialltoall, send, recv)

    def barrier(self) -> None:
        self._run(self.mpi.Barrier, self.mpi.Ibarrier)

    def isend(self, buf: Any, dest: int, tag: int) -> Any:
        return self.mpi.Isend(buf, dest=dest, tag=tag)

    def irecv(self, buf: Any, source: int, tag: int) -> Any:
        return self.mpi.Irecv(buf, source=source, tag=tag)

    def iallgather(self, send: Any, recv: Any) -> Any:
        return self.mpi.Iallgather(send, recv)

    def iallgatherv(self, send: Any, recv: Any, counts: Any) -> Any:
        counts = np.asarray(counts, dtype=np.int64)
        displs = np.concatenate(([0], np.cumsum(counts)[:-1]))
        return self.mpi.Iallgatherv(send, [recv, (counts, displs), self._MPI.BYTE])

    def ialltoallv(self, send: Any, send_counts: Any, recv: Any, recv_counts: Any) -> Any:
        sc, rc = np.asarray(send_counts, dtype=np.int64), np.asarray(recv_counts, dtype=np.int64)
        sd, rd = np.concatenate(([0], np.cumsum(sc)[:-1])), np.concatenate(([0], np.cumsum(rc)[:-1]))
        return self.mpi.Ialltoallv([send, (sc, sd), self._MPI.BYTE], [recv, (rc, rd), self._MPI.BYTE])

    def wait(self, requests: list[Any]) -> None:
        wait_requests(requests)

    def progress(self, request: Any) -> None:
        # MPICH moves a non-blocking operation only inside MPI calls (no progress thread): one test
        # runs the progress engine once over every connection.
        if request:
            request.Test()

    def derive(self, mpi_comm: Any, ranks: list[int], uid: str = "") -> Transport:
        return MPITransport(mpi_comm, cuda_aware=self.cuda_aware)

    def private(self) -> MPITransport:
        """Return a transport over a duplicate communicator, whose messages never match this one's.

        Made by the first call (collective), the same one afterwards; ``free`` frees it.
        """
        if self._private is None:
            self._private = MPITransport(self.mpi.Dup(), cuda_aware=self.cuda_aware)
            self._private.owned = True
        return self._private

    def free(self) -> None:
        if self._private is not None:
            self._private.free()
            self._private = None
        # The communicator owns (and frees) the MPI communicator it shares with its transport.
        if self.owned:
            self.mpi.Free()
            self.owned = False
