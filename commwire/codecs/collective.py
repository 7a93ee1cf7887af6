"""Compressed all-reduce: encode, exchange payloads, reduce in FP32, re-encode, gather.

MPI cannot add packed or scaled codes, so the reduction happens on decoded
values (the scheme of DeepSpeed's 1-bit Adam, Bagua and torchft's FP8 path):

1. every rank encodes chunk i of its tensor for rank i (one scale per chunk),
   except its own chunk, which it keeps in FP32;
2. Alltoallv: rank j receives every other rank's encoding of chunk j;
3. rank j decodes them and sums them with its own FP32 chunk (``avg`` divides
   here), then re-encodes its reduced chunk;
4. every rank sends its re-encoded chunk to all ranks (an all-gather done as
   direct sends); every rank decodes all of them, its own included, so all
   ranks end with bit-identical results.

Large tensors are cut into pipeline segments: while segment k's payloads are
in flight, segment k+1 is being encoded and segment k-1 decoded, so codec time
hides behind transfer time. Small tensors (below ``small_bytes``) take one
Allgather of whole encoded tensors instead (one round trip, latency-bound).

Error-feedback codecs keep one residual per (tensor name, segment, chunk) on
the sending side and one per (name, segment) on the reducing side, so both
quantisations of the two-phase scheme are compensated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..comm.arrays import adapter_for
from ..comm.communicator import Communicator, split_rows
from ..comm.handle import Handle
from ..comm.handle import wait_requests
from ..comm.lane import lane_for
from .base import Codec

__all__ = ["compressed_allreduce", "compressed_allreduce_async", "resolve_codec", "PIPELINE_BYTES", "SMALL_BYTES"]

PIPELINE_BYTES = 4 << 20
"""FP32 bytes per pipeline segment (default 4 MiB)."""
SMALL_BYTES = 64 << 10
"""Below this many FP32 bytes the single-Allgather variant is used."""
_ALIGN = 128  # chunk boundaries fall on whole quantisation blocks (NVFP4: 16, block FP8: up to 128)
_F32 = np.dtype(np.float32)
_perf = time.perf_counter

_codec_cache: dict[str, Codec] = {}
_cache_lock = threading.Lock()


def resolve_codec(codec: Any) -> Codec:
    """Return a codec object; string specs map to one shared instance per spec.

    Sharing matters for stateful codecs: an ``ef+...`` spec passed as a string
    keeps its error-feedback residuals across calls. Pass a codec object to own
    (and checkpoint) the state yourself.
    """
    if isinstance(codec, Codec):
        return codec
    if not isinstance(codec, str):
        raise TypeError(f"codec must be a spec string or a commwire.codecs codec, got {type(codec).__name__}")
    with _cache_lock:
        found = _codec_cache.get(codec)
        if found is None:
            from .registry import get

            found = _codec_cache[codec] = get(codec)
        return found


class _Segment:
    """Buffers and bookkeeping of one pipeline segment."""

    __slots__ = ("start", "counts", "wire", "offsets", "send", "recv", "mine", "gathered", "gather_counts",
                 "zeros", "req")

    def __init__(self, codec: Codec, start: int, stop: int, size: int, rank: int) -> None:
        m = stop - start
        blocks = split_rows(-(-m // _ALIGN), size)
        edges = np.minimum(np.concatenate(([0], np.cumsum(blocks) * _ALIGN)), m)
        self.start = start
        self.counts = np.diff(edges)  # whole blocks per rank; the segment's tail lands in the last non-empty chunk
        self.wire = np.array([codec.wire_nbytes(int(c)) for c in self.counts], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(self.wire)[:-1]))
        self.send = np.empty(int(self.wire.sum()), dtype=np.uint8)
        self.recv = np.empty(int(self.wire[rank]) * size, dtype=np.uint8)
        self.mine = np.empty(int(self.wire[rank]), dtype=np.uint8)
        self.gathered = np.empty(int(self.wire.sum()), dtype=np.uint8)
        self.gather_counts = np.full(size, self.wire[rank], dtype=np.int64)  # this rank's chunk to everyone
        self.zeros = np.zeros(size, dtype=np.int64)
        self.req: Any = None

    def chunk(self, i: int) -> slice:
        lo = self.start + int(self.counts[:i].sum())
        return slice(lo, lo + int(self.counts[i]))


def _segments(n: int, size: int, segment_bytes: int) -> list[tuple[int, int]]:
    step = max(_ALIGN * size, (segment_bytes // 4) // (_ALIGN * size) * (_ALIGN * size))
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


class _Plan:
    """Segments and scratch buffers of one (communicator, size, codec) combination, kept for reuse.

    Training reduces the same buckets every step; reusing the buffers avoids
    allocating (and page-faulting) a tensor's worth of memory per call.
    """

    def __init__(self, comm: Communicator, codec: Codec, n: int, segment_bytes: int) -> None:
        size, rank = comm.size, comm.rank
        self.segs = [_Segment(codec, a, b, size, rank) for a, b in _segments(n, size, segment_bytes)]
        self.acc = np.empty(int(max(s.counts[rank] for s in self.segs)), dtype=_F32)


_plans: dict[tuple[Any, ...], _Plan] = {}
_MAX_PLANS = 64


def _plan(comm: Communicator, codec: Codec, n: int, segment_bytes: int) -> _Plan:
    key = (id(comm), comm.uid, codec.spec, n, segment_bytes)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.pop(next(iter(_plans)))  # drop the oldest
        plan = _plans[key] = _Plan(comm, codec, n, segment_bytes)
    return plan


class _Run:
    """One compressed all-reduce over a flat FP32 vector."""

    def __init__(self, comm: Communicator, codec: Codec, key: Hashable, average: bool) -> None:
        self.comm, self.codec, self.key, self.average = comm, codec, key, average
        self.times = {"encode": 0.0, "transfer": 0.0, "decode": 0.0}
        self.wire_sent = 0
        self.encoded_elems = 0
        self.encoded_wire = 0
        self.inflight: list[Any] = []

    def _progress(self) -> None:
        # MPICH moves a non-blocking collective only inside MPI calls (no progress
        # thread), so poke the transfers in flight between codec kernels: this is
        # what lets encoding and decoding overlap the wire.
        for req in self.inflight:
            req.Test()

    def _encode(self, x: np.ndarray, out: np.ndarray, key: Hashable) -> None:
        t = _perf()
        self.codec.encode_into(x, out, key=key)
        self.times["encode"] += _perf() - t
        self.encoded_elems += x.size
        self.encoded_wire += out.size
        self._progress()

    def _decode(self, buf: np.ndarray, n: int, out: np.ndarray) -> None:
        t = _perf()
        self.codec.decode_from(buf, n, out=out)
        self.times["decode"] += _perf() - t
        self._progress()

    def _decode_add(self, buf: np.ndarray, n: int, out: np.ndarray) -> None:
        t = _perf()
        self.codec.decode_add(buf, n, out)
        self.times["decode"] += _perf() - t
        self._progress()

    def _start(self, req: Any) -> Any:
        self.inflight.append(req)
        return req

    def _wait(self, req: Any) -> None:
        t = _perf()
        with self.comm.watched("compressed_allreduce", self.key if isinstance(self.key, str) else None):
            wait_requests([req])
        self.inflight = [r for r in self.inflight if r is not req]  # identity: finished requests compare equal
        self.times["transfer"] += _perf() - t

    def pipelined(self, flat: np.ndarray, result: np.ndarray, segment_bytes: int) -> None:
        comm, size, rank = self.comm, self.comm.size, self.comm.rank
        plan = _plan(comm, self.codec, flat.size, segment_bytes)
        segs, acc = plan.segs, plan.acc

        def start_exchange(i: int) -> None:
            seg = segs[i]
            for r in range(size):
                if r == rank:
                    continue  # this rank reduces its own chunk from the FP32 input: nothing to encode
                o = int(seg.offsets[r])
                self._encode(flat[seg.chunk(r)], seg.send[o:o + int(seg.wire[r])], (self.key, "w", i, r))
            w = int(seg.wire[rank])
            recv_spec = [seg.recv, ([w] * size, [w * r for r in range(size)])]
            seg.req = self._start(comm.mpi.Ialltoallv([seg.send, (seg.wire, seg.offsets)], recv_spec))
            # Counted like a plain all-reduce's message: this rank's encoded tensor
            # (the re-encoded chunk of the gather phase adds 1/P of it on the wire).
            self.wire_sent += int(seg.wire.sum())

        def reduce_and_gather(i: int) -> None:
            seg = segs[i]
            self._wait(seg.req)
            m, w = int(seg.counts[rank]), int(seg.wire[rank])
            total = acc[:m]
            # The sum starts from this rank's own chunk in FP32 (the input is not yet
            # overwritten: segment i is written back in finish(i)), then adds the others
            # in rank order, each decoded and added in one pass.
            np.copyto(total, flat[seg.chunk(rank)])
            for r in range(size):
                if r != rank:
                    self._decode_add(seg.recv[r * w:(r + 1) * w], m, total)
            if self.average:
                np.multiply(total, np.float32(1.0 / size), out=total)
            self._encode(total, seg.mine, (self.key, "s", i))
            # The gather sends the chunk straight to every rank (an Alltoallv whose send
            # blocks all start at 0) rather than Iallgatherv: MPICH's ring and recursive
            # doubling forward chunks through other ranks, each of which must be inside
            # MPI to pass them on; direct sends need no forwarding (same bytes; on 4 lab
            # hosts at 1 Gbit/s, 64 MiB NVFP4 took 131-134 ms instead of 135-140 ms).
            same = (seg.gather_counts, seg.zeros)
            seg.req = self._start(comm.mpi.Ialltoallv([seg.mine, same], [seg.gathered, (seg.wire, seg.offsets)]))

        def finish(i: int) -> None:
            seg = segs[i]
            self._wait(seg.req)
            for r in range(size):
                o = int(seg.offsets[r])
                self._decode(seg.gathered[o:o + int(seg.wire[r])], int(seg.counts[r]), result[seg.chunk(r)])

        # Order matters when `result` is the input's own memory (in place): segment
        # i-1 is written back only after segments up to i+1 have been encoded.
        start_exchange(0)
        for i in range(len(segs)):
            if i + 1 < len(segs):
                start_exchange(i + 1)
            reduce_and_gather(i)
            if i > 0:
                finish(i - 1)
        finish(len(segs) - 1)

    def gathered(self, flat: np.ndarray, result: np.ndarray) -> None:
        comm, size, n = self.comm, self.comm.size, flat.size
        w = self.codec.wire_nbytes(n)
        mine = np.empty(w, dtype=np.uint8)
        every = np.empty(w * size, dtype=np.uint8)
        self._encode(flat, mine, (self.key, "g"))
        self._wait(comm.mpi.Iallgather(mine, every))
        self.wire_sent += w  # this rank's message: its encoded tensor
        t = _perf()
        result.fill(0.0)
        for r in range(size):  # same order on every rank: identical results
            self.codec.decode_add(every[r * w:(r + 1) * w], n, result)
        if self.average:
            np.multiply(result, np.float32(1.0 / size), out=result)
        self.times["decode"] += _perf() - t


def compressed_allreduce(
    comm: Communicator,
    x: Any,
    op: str = "sum",
    *,
    codec: Any,
    out: Any = None,
    name: str | None = None,
    segment_bytes: int = PIPELINE_BYTES,
    small_bytes: int = SMALL_BYTES,
) -> Any:
    """Sum or average ``x`` over ``comm`` with ``codec`` payloads on the wire.

    Args:
        comm: the communicator.
        x: float array (numpy, torch or cupy; CUDA buffers are staged through host memory).
        op: "sum" or "avg" (a lossy codec cannot compute min/max).
        codec: spec string or codec object (see ``commwire.codecs.get``).
        out: optional array for the result.
        name: stable tensor name; keys error-feedback state and labels statistics.
        segment_bytes: FP32 bytes per pipeline segment.
        small_bytes: below this size use the single-Allgather variant.

    Returns:
        The reduced array, same kind, dtype, shape and device as ``x``.

    Example:
        >>> cw.allreduce(grad, op="avg", codec="ef+fp8-e4m3", name="layer1.weight")
    """
    codec = resolve_codec(codec)
    if codec.lossless:
        return comm.allreduce(x, op, out=out, name=name)
    if op not in ("sum", "avg", "average", "mean"):
        raise ValueError(f"op={op!r} cannot run on codec {codec.spec!r} payloads; use op='sum' or 'avg', or codec=None")
    adapter = adapter_for(x)
    host = adapter.host(x)
    if host.dtype.kind != "f" and host.dtype.name != "bfloat16":
        raise TypeError(f"codec {codec.spec!r} needs a float array, got {host.dtype}; pass codec=None for integers")
    if comm.check:
        comm._verify("compressed_allreduce", name, host.shape, str(host.dtype), op, None, codec.spec)
    start = _perf()
    key = name if name is not None else ("shape", host.shape)
    flat = host.reshape(-1) if host.dtype == _F32 else host.astype(_F32).reshape(-1)
    flat = codec.tensor_forward(flat, key)
    small = flat.size * 4 < small_bytes or comm.size == 1
    # Decode straight into the caller's float32 `out` when it can take the result;
    # the pipeline only overwrites segments it has already encoded, so out=x works.
    direct = None if out is None or small else adapter_for(out).out_view(out)
    if direct is not None and (direct.dtype != _F32 or direct.size != flat.size
                               or (out is not x and np.may_share_memory(direct, flat))):
        direct = None
    result = direct.reshape(-1) if direct is not None else np.empty(flat.size, dtype=_F32)
    run = _Run(comm, codec, key, op != "sum")
    if small:
        run.gathered(flat, result)
    else:
        run.pipelined(flat, result, segment_bytes)
    codec.tensor_inverse(result, key)
    adapter.release(host)
    if direct is not None:
        value = out
    else:
        shaped = result.reshape(host.shape)
        final = shaped if host.dtype == _F32 else shaped.astype(host.dtype)
        value = adapter.write(out, final) if out is not None else adapter.wrap(final, x)
    end = _perf()
    counters = comm.counters
    counters.record("compressed_allreduce", run.wire_sent, end - start, input_bytes=host.nbytes)
    counters.record_codec(codec.spec, run.encoded_elems * 4, run.encoded_wire, run.encoded_elems)
    counters.add("compressed_allreduce_phases", **run.times)
    if comm.timeline is not None:
        comm.timeline.add(name or "compressed_allreduce", start, end, op="compressed_allreduce",
                          codec=codec.spec, bytes=run.wire_sent, **{k + "_s": v for k, v in run.times.items()})
    return value


def compressed_allreduce_async(comm: Communicator, x: Any, op: str = "sum", *, codec: Any, out: Any = None,
                               name: str | None = None, **kwargs: Any) -> Handle:
    """Start a compressed all-reduce on a background lane; ``wait()`` returns the result."""
    codec = resolve_codec(codec)
    if codec.lossless:
        return comm.allreduce_async(x, op, out=out, name=name)
    return lane_for(comm).submit(compressed_allreduce, x, op, codec=codec, out=out, name=name, **kwargs)
