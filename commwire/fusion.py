"""Tensor fusion: pack many small tensors into few buckets, one collective each.

Buckets are filled in reverse registration order (gradients of the last layers
are ready first during backward), hold one dtype and device each, and close at
a byte threshold; the first bucket is small so communication starts early, as
in DDP. Bucket ids derive from the names of their members, so they are stable
across processes and restarts, and codec state (error-feedback residuals) keyed
by them is found again after the buckets are rebuilt with the same layout.

Buckets are launched strictly in index order — a bucket that fills early waits
for its predecessors — because every rank must issue the same collectives in
the same order. With ``overlap=True`` they move while the caller keeps computing:
an uncompressed bucket of host memory on the mpi transport is moved on by the
caller's own thread, a test of its MPI requests each time a tensor is added
(``Communicator.start``: no thread wakes up to poll MPI, which on ranks sharing
cores took the CPU from backward); every other bucket, and every bucket with
``overlap="lane"``, runs on the communicator's background lane (a worker thread).

Buckets live on their members' device (torch CUDA tensors: ``cuda:N``), so the
reduction takes the core's device path: device buffers straight to a
CUDA-aware MPI, or staged through host memory, and compressed buckets are
encoded on the device. A launched bucket's device work is ordered after the
work queued on the launching thread's current stream (the stream backward
wrote the gradients on), and ``wait()`` makes the waiting thread's current
stream wait for the reduction (``commwire.comm.arrays.StreamOrder``).

Example:
    >>> fb = FusionBuffer([("w1", w1), ("b1", b1), ("w2", w2)], op="avg")
    >>> for name, grad in grads.items():
    ...     fb.add(name, grad)          # buckets start as they fill
    >>> reduced = fb.wait()             # {name: averaged view}
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .comm import arrays
from .comm.communicator import Communicator
from .comm.handle import Handle
from .comm.runtime import default_comm

__all__ = ["FusionBuffer", "Bucket", "DEFAULT_THRESHOLD_BYTES", "DEFAULT_FIRST_BUCKET_BYTES", "check_unique_names"]

DEFAULT_THRESHOLD_BYTES = 25 << 20
"""Bucket size limit (DDP's default, 25 MiB)."""
DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
"""Limit of the first bucket, so the first collective starts early (1 MiB)."""


def check_unique_names(names: Sequence[str], what: str = "tensor names") -> None:
    """Raise ValueError if ``names`` repeats a name: names key buckets, codec state and checkpoints."""
    dupes = sorted(name for name, count in Counter(names).items() if count > 1)
    if dupes:
        more = f" and {len(dupes) - 5} more" if len(dupes) > 5 else ""
        raise ValueError(f"{what} must be unique; duplicate names: {dupes[:5]}{more}")


def _flat(x: Any) -> Any:
    return x.reshape(-1)


def _group_key(x: Any) -> tuple[str, str]:
    if isinstance(x, np.ndarray):
        return (str(x.dtype), "cpu")
    return (str(x.dtype), str(x.device))


@dataclass(slots=True)
class Bucket:
    """Tensors fused into one flat buffer that travels in one collective."""

    index: int
    id: str
    names: list[str]
    offsets: list[int]
    numels: list[int]
    shapes: list[tuple[int, ...]]
    buffer: Any
    filled: list[bool]
    handle: Handle | None = None
    launched_at: float = 0.0

    @property
    def nbytes(self) -> int:
        """Return the size of the bucket's buffer in bytes."""
        return arrays.nbytes(self.buffer)

    def view(self, slot: int) -> Any:
        """Return member ``slot`` as a view into the bucket buffer, in its own shape."""
        off = self.offsets[slot]
        return self.buffer[off:off + self.numels[slot]].reshape(self.shapes[slot])


class FusionBuffer:
    """Fuse named tensors into buckets and reduce each bucket with one collective.

    Args:
        tensors: ``(name, tensor)`` pairs in registration order (numpy arrays
            or torch tensors); only shapes, dtypes and devices are used.
        comm: communicator (default: the world).
        op: "sum" or "avg" (also "min"/"max" without a codec).
        codec: optional codec spec or object for the wire.
        threshold_bytes: bucket size limit; 0 puts every tensor in its own bucket.
        first_bucket_bytes: limit of the first bucket.
        overlap: True: collectives move while the caller computes (see the module docstring);
            "lane": always on the background lane's thread; False: run when waited for.
        postscale: factor applied to every reduced bucket (e.g. for predivision).
        groups: explicit groups of tensor names; each group travels in buckets of its
            own (one per dtype and device, whatever the threshold) and every other tensor
            alone (Horovod's ``groups=``).
        compressor: a Horovod-style object with ``compress(t) -> (t, ctx)`` and
            ``decompress(t, ctx)``, applied around each bucket's all-reduce (not with ``codec``).
    """

    def __init__(
        self,
        tensors: Sequence[tuple[str, Any]],
        *,
        comm: Communicator | None = None,
        op: str = "avg",
        codec: Any = None,
        threshold_bytes: int = DEFAULT_THRESHOLD_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        overlap: bool | str = True,
        postscale: float = 1.0,
        groups: Sequence[Sequence[str]] | None = None,
        compressor: Any = None,
    ) -> None:
        if threshold_bytes < 0 or first_bucket_bytes < 0:
            raise ValueError(f"bucket sizes must be >= 0, got threshold_bytes={threshold_bytes}, "
                             f"first_bucket_bytes={first_bucket_bytes}")
        check_unique_names([name for name, _ in tensors])
        self.comm = default_comm(comm)
        self.op = op
        self.codec = None
        if codec is not None and codec != "none":
            from .codecs.collective import resolve_codec

            self.codec = resolve_codec(codec)
        if overlap not in (True, False, "lane"):
            raise ValueError(f"overlap={overlap!r} is not valid; use True, 'lane' or False")
        self.overlap = overlap
        self.postscale = postscale
        if compressor is not None and self.codec is not None:
            raise ValueError("pass either codec= or compressor= to FusionBuffer, not both")
        self.compressor = compressor
        if groups is not None:
            self.buckets = self._build_groups(list(tensors), groups)
        else:
            self.buckets = self._build(list(tensors), threshold_bytes, first_bucket_bytes)
        if self.codec is not None:
            for b in self.buckets:  # transforms that act per weight matrix need the layout
                self.codec.bind_layout(b.id, [(n, o, s) for n, o, s in zip(b.names, b.offsets, b.shapes)])
        self._where = {name: (b, slot) for b in self.buckets for slot, name in enumerate(b.names)}
        # Slot views are made once: callers fill them in place every step (no per-step view objects).
        self._views = {name: b.view(slot) for name, (b, slot) in self._where.items()}
        self._next = 0
        self.comm_seconds = 0.0
        self.exposed_seconds = 0.0

    def _build(self, tensors: list[tuple[str, Any]], threshold: int, first: int) -> list[Bucket]:
        open_groups: dict[tuple[str, str], list[tuple[str, Any]]] = {}
        sizes: dict[tuple[str, str], int] = {}
        closed: list[list[tuple[str, Any]]] = []
        limit = first if first else threshold
        for name, t in reversed(tensors):
            key = _group_key(t)
            group = open_groups.setdefault(key, [])
            nbytes = arrays.nbytes(t)
            if group and sizes[key] + nbytes > limit:
                closed.append(group)
                group = open_groups[key] = []
                sizes[key] = 0
                limit = threshold
            group.append((name, t))
            sizes[key] = sizes.get(key, 0) + nbytes
            if threshold == 0:
                closed.append(group)
                open_groups[key] = []
                sizes[key] = 0
        closed += [g for g in open_groups.values() if g]
        return [self._bucket(i, g) for i, g in enumerate(closed)]

    def _build_groups(self, tensors: list[tuple[str, Any]], groups: Sequence[Sequence[str]]) -> list[Bucket]:
        known = {name for name, _ in tensors}
        group_of: dict[str, int] = {}
        for g, members in enumerate(groups):
            for name in members:
                if name not in known:
                    raise KeyError(f"groups names tensor {name!r}, which was not registered with this FusionBuffer")
                if name in group_of:
                    raise ValueError(f"tensor {name!r} appears in more than one group; each may appear once")
                group_of[name] = g
        closed: dict[tuple[Any, ...], list[tuple[str, Any]]] = {}
        for name, t in reversed(tensors):  # bucket order: when the group's first gradient is ready
            key = (group_of.get(name, ("alone", name)), _group_key(t))
            closed.setdefault(key, []).append((name, t))
        return [self._bucket(i, g) for i, g in enumerate(closed.values())]

    @staticmethod
    def _bucket(index: int, members: list[tuple[str, Any]]) -> Bucket:
        names = [n for n, _ in members]
        numels = [int(np.prod(tuple(t.shape), dtype=np.int64)) for _, t in members]
        offsets = np.concatenate(([0], np.cumsum(numels)[:-1])).astype(int).tolist()
        digest = zlib.crc32("\0".join(names).encode())
        bucket_id = f"bucket{index}:{names[0]}..{names[-1]}:{len(names)}:{digest:08x}"
        return Bucket(index=index, id=bucket_id, names=names, offsets=offsets, numels=numels,
                      shapes=[tuple(t.shape) for _, t in members], buffer=arrays.zeros(members[0][1], sum(numels)),
                      filled=[False] * len(names))

    # ------------------------------------------------------------------ filling
    def _slot(self, name: str) -> tuple[Bucket, int]:
        where = self._where.get(name)
        if where is None:
            raise KeyError(f"tensor {name!r} was not registered with this FusionBuffer")
        bucket, slot = where
        if bucket.handle is not None:
            raise RuntimeError(f"tensor {name!r} was added again after its bucket {bucket.id} was sent; "
                               "call wait() before adding the next step's values")
        return bucket, slot

    def view(self, name: str) -> Any:
        """Return the slot of ``name``: a view into its bucket that a caller may fill in place."""
        return self._views[name]

    def add(self, name: str, value: Any, scale: float = 1.0) -> None:
        """Copy ``value`` into its bucket slot (times ``scale``); launch buckets that are complete."""
        bucket, slot = self._slot(name)
        target = self._views[name]
        if scale == 1.0:
            target[...] = value
        else:
            target[...] = value * scale
        bucket.filled[slot] = True
        self._launch_ready()
        self.comm.progress()  # buckets the caller moves on (overlap=True)

    def mark(self, name: str, scale: float = 1.0) -> None:
        """Declare the slot of ``name`` filled in place (see :meth:`view`); launch complete buckets."""
        bucket, slot = self._slot(name)
        if scale != 1.0:
            self._views[name][...] *= scale
        bucket.filled[slot] = True
        self._launch_ready()
        self.comm.progress()

    def zero_(self) -> None:
        """Zero every bucket buffer (the slots handed out by :meth:`view` included)."""
        for b in self.buckets:
            b.buffer[...] = 0

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and all(self.buckets[self._next].filled):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched_at = time.perf_counter()
        if self.overlap is True and self.codec is None and self.compressor is None:
            bucket.handle = self.comm.start(self._reduce_steps, self._reduce, bucket, bucket.buffer, label=bucket.id)
        elif self.overlap:
            # Through the communicator, which orders a CUDA buffer's work with this thread's stream.
            bucket.handle = self.comm.submit(self._reduce, bucket, bucket.buffer, label=bucket.id)
        else:
            bucket.handle = _Deferred(lambda: self._reduce(self.comm, bucket, bucket.buffer))

    def _reduce(self, comm: Communicator, bucket: Bucket, buffer: Any) -> float:
        start = time.perf_counter()
        if self.compressor is not None:
            sent, ctx = self.compressor.compress(buffer)
            reduced = comm.allreduce(sent, self.op, name=bucket.id)
            buffer[...] = self.compressor.decompress(reduced, ctx)
        elif self.codec is None:
            # on the lane, the wait inside yields the CPU to backward (see Communicator._move)
            comm.allreduce(buffer, self.op, out=buffer, name=bucket.id)
        else:
            from .codecs.collective import compressed_allreduce

            compressed_allreduce(comm, buffer, self.op, codec=self.codec, out=buffer, name=bucket.id)
        if self.postscale != 1.0:
            buffer *= self.postscale
        return time.perf_counter() - start

    def _reduce_steps(self, comm: Communicator, bucket: Bucket,
                      buffer: Any) -> Generator[list[Any], None, float] | None:
        """``_reduce`` of an uncompressed host bucket in steps (``Communicator.allreduce_steps``), or None."""
        if arrays.is_device_array(buffer):
            return None
        host = arrays.host_view(buffer)
        steps = comm.allreduce_steps(host, self.op, out=host, name=bucket.id)
        return None if steps is None else self._timed(steps, host)

    def _timed(self, steps: Generator[list[Any], None, Any], host: np.ndarray) -> Generator[list[Any], None, float]:
        start = time.perf_counter()
        yield from steps
        if self.postscale != 1.0:
            host *= self.postscale
        return time.perf_counter() - start

    def missing(self) -> list[str]:
        """Return the names not yet added in this round."""
        return [n for b in self.buckets for n, f in zip(b.names, b.filled) if not f]

    def in_flight(self) -> int:
        """Return how many buckets were launched and not yet waited for."""
        return sum(b.handle is not None for b in self.buckets)

    def flush(self) -> list[str]:
        """Zero-fill the slots nobody added and launch every remaining bucket; return those names."""
        missing = self.missing()
        for b in self.buckets:
            for slot, f in enumerate(b.filled):
                if not f:
                    self._views[b.names[slot]][...] = 0
                    b.filled[slot] = True
        self._launch_ready()
        return missing

    def wait(self) -> dict[str, Any]:
        """Flush, wait for every bucket and return ``{name: reduced view}``; reset for the next round."""
        self.flush()
        start = time.perf_counter()
        for b in self.buckets:
            self.comm_seconds += b.handle.wait()  # type: ignore[union-attr] # flush launched every bucket
        self.exposed_seconds += time.perf_counter() - start
        for b in self.buckets:
            b.handle = None
            b.filled = [False] * len(b.names)
        self._next = 0
        return dict(self._views)

    def discard(self) -> None:
        """Forget the buckets in flight without waiting (their communicator failed); reset for a new round."""
        for b in self.buckets:
            b.handle = None
            b.filled = [False] * len(b.names)
        self._next = 0

    def state_dict(self) -> dict[str, Any]:
        """Return the codec state (keyed by the stable bucket ids) for checkpoints."""
        return {"codec": self.codec.state_dict() if self.codec is not None else None,
                "bucket_ids": [b.id for b in self.buckets]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore codec state saved by :meth:`state_dict`."""
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])


class _Deferred(Handle):
    """A handle that runs its work when waited for (``overlap=False``)."""

    __slots__ = ()

    def __init__(self, work: Any) -> None:
        super().__init__([], work, None)

    def test(self) -> bool:
        self.wait()
        return True

    def wait(self) -> Any:
        if not self._done:
            self._complete()
        return self._result
