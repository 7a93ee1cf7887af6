"""Compressed all-reduce: encode, exchange payloads, reduce in FP32, re-encode, gather.

MPI cannot add packed or scaled codes, so the reduction happens on decoded
values (the scheme of DeepSpeed's 1-bit Adam, Bagua and torchft's FP8 path):

1. every rank encodes chunk i of its tensor for rank i (one scale per chunk),
   except its own chunk, which it keeps in FP32;
2. exchange (point to point, receives posted ahead): rank j receives every
   other rank's encoding of chunk j;
3. rank j decodes them and sums them with its own FP32 chunk (``avg`` divides
   here), then re-encodes its reduced chunk;
4. every rank sends its re-encoded chunk to all ranks (an all-gather done as
   direct sends); every rank decodes all of them, its own included, so all
   ranks end with bit-identical results.

Large tensors are cut into pipeline segments: while segment k's payloads are
in flight, segment k+1 is being encoded and segment k-1 decoded, so codec time
hides behind transfer time. The segment size is tuned per tensor size on the
first calls (``PEER_CHOICES``). Small tensors (below ``small_bytes``) take one
Allgather of whole encoded tensors instead (one round trip, latency-bound).

Error-feedback codecs keep one residual as long as the tensor per tensor name
on the sending side and one on the reducing side (each chunk uses its slice,
``codecs.base.Span``), so both quantisations of the two-phase scheme are
compensated, and the residuals survive the tuner's change of segment size.

Device arrays (torch CUDA tensors, cupy arrays through torch) whose codec has
device kernels (casts, FP8, NVFP4, error feedback, Hadamard) stay on the
device: the codec kernels (``_torch_kernels``, bit-exact with the CPU ones),
the segment buffers and the FP32 accumulator live there, and MPI gets the
device buffers (``cuda_aware``) or pinned host mirrors of the payloads only
(staged: a quarter of the FP32 bytes cross PCIe for FP8). The current stream is
synchronised before MPI reads a buffer the kernels wrote, and before receives
are posted into buffers that earlier kernels may still read. Other codecs
(GIFT) reduce device arrays through a host copy. Every mode sends the same
messages, so ranks may differ in mode, and their results are bit-identical.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

import numpy as np

from ..comm import arrays
from ..comm.arrays import adapter_for
from ..comm.buffers import check_out, describe, device_of, op_label, split_rows
from ..comm.communicator import Communicator, Signature
from ..comm.handle import Done, Handle
from .base import Codec, Span
from .hierarchical import blocks, hierarchy_setting, levels_of

__all__ = ["compressed_allreduce", "compressed_allreduce_async", "resolve_codec", "shared_codecs", "PEER_CHOICES",
           "TUNE_CALLS", "FIRST_PEER_BYTES", "SMALL_BYTES", "ALIGN", "last_wire_bytes", "segments", "segment_bytes_for",
           "segment_bytes_at", "tuned_segment_bytes", "has_device_kernels", "device_space"]

PEER_CHOICES = (32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10)
"""Payload bytes one rank sends one peer per pipeline segment, tried by the segment tuner.

The best segment depends on the network: on a 1 Gbit/s link (MPICH over libfabric
tcp) per-peer messages above ~64 KiB cost several ms more per call, while at
10 Gbit/s the per-segment overhead dominates and MiB-sized segments are fastest.
So the first calls of each tensor size try these and keep the fastest (see
``_Tuner``); ``segment_bytes=`` fixes a size instead. Fixing the message, not the
FP32 segment, keeps it the same at any rank count."""
TUNE_ROUNDS = 5
"""Consecutive calls per candidate segment size; the mean of all but the first two counts."""
TUNE_CALLS = TUNE_ROUNDS * len(PEER_CHOICES)
"""The most calls of one tensor size before the tuner has decided (warm up this many)."""
FIRST_PEER_BYTES = 32 << 10
"""Payload bytes per peer of a call's first segment, below libfabric tcp's 64 KiB limit for
messages that arrive before their receive is posted."""
TUNE_MARGIN = 0.05
"""A larger segment is chosen only when it is this much faster than every smaller one."""
SMALL_BYTES = 64 << 10
"""Below this many FP32 bytes the single-Allgather variant is used."""
LEVEL_CHUNK_BYTES = 16 << 20
"""FP32 bytes per chunk of a hierarchical all-reduce (``_reduce_levels``): each chunk's across-group step
overlaps the next chunk's reduce-scatter and the previous one's all-gather inside the group. Lab, 2 hosts x
2 ranks at 1 Gbit/s, 64 MiB FP8: 213 ms per call with 16 MiB chunks, 228 with 8, 325 with 4, 320 whole."""
ALIGN = 128
"""Elements per alignment unit: chunk and segment boundaries fall on whole quantisation blocks
(NVFP4: 16, block FP8: up to 128), so every block is encoded by one rank with one scale."""
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


def shared_codecs() -> dict[str, Codec]:
    """Return the codecs that string specs resolved to so far (spec -> instance), e.g. to checkpoint their state."""
    with _cache_lock:
        return dict(_codec_cache)


class _HostSpace:
    """Where a compressed all-reduce's buffers live: host memory, which MPI reads and writes directly."""

    key: tuple[Any, ...] = ("host",)

    def empty_u8(self, n: int) -> Any:
        return np.empty(n, dtype=np.uint8)

    def empty_f32(self, n: int) -> Any:
        return np.empty(n, dtype=_F32)

    def mirror(self, n: int) -> Any:
        """Return the host copy MPI uses in place of a buffer of ``n`` bytes (None: MPI uses the buffer)."""
        return None

    def copy(self, dst: Any, src: Any) -> None:
        np.copyto(dst, src)

    def scale(self, x: Any, factor: float) -> None:
        np.multiply(x, np.float32(factor), out=x)

    def zero(self, x: Any) -> None:
        x.fill(0.0)

    def ready(self) -> None:
        """Wait until the kernels queued so far are done (device buffers MPI touches directly)."""

    def outgoing(self, buf: Any, mirror: Any, lo: int, hi: int) -> Any:
        """Return what MPI sends for bytes [lo, hi) of ``buf`` (after ``ready()`` for device buffers)."""
        return buf[lo:hi]

    def incoming(self, buf: Any, mirror: Any, lo: int, hi: int) -> Any:
        """Return where MPI receives bytes [lo, hi) of ``buf``."""
        return buf[lo:hi]

    def arrived(self, buf: Any, mirror: Any, lo: int, hi: int) -> None:
        """Make received bytes [lo, hi) visible in ``buf`` (staged: copy them from the host mirror)."""


class _DeviceSpace(_HostSpace):
    """Buffers on a torch device; MPI reads them directly (CUDA-aware) or pinned host mirrors (staged)."""

    def __init__(self, like: Any, staged: bool) -> None:
        import torch

        self.torch, self.device, self.staged = torch, like.device, staged
        self.cuda = like.device.type == "cuda"
        self.key = (str(like.device), "staged" if staged else "direct")

    def empty_u8(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.uint8, device=self.device)

    def empty_f32(self, n: int) -> Any:
        return self.torch.empty(n, dtype=self.torch.float32, device=self.device)

    def mirror(self, n: int) -> Any:
        if not self.staged:
            return None
        return self.torch.empty(n, dtype=self.torch.uint8, pin_memory=self.cuda).numpy()  # keeps its tensor alive

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def scale(self, x: Any, factor: float) -> None:
        x.mul_(float(np.float32(factor)))  # the float32 factor the host path multiplies by: identical results

    def zero(self, x: Any) -> None:
        x.zero_()

    def ready(self) -> None:
        if self.cuda and not self.staged:  # staged copies are themselves ordered on the stream
            self.torch.cuda.current_stream(self.device).synchronize()

    def outgoing(self, buf: Any, mirror: Any, lo: int, hi: int) -> Any:
        if mirror is None:
            return buf[lo:hi]
        self.torch.from_numpy(mirror[lo:hi]).copy_(buf[lo:hi])  # synchronous: after the kernels that wrote buf
        return mirror[lo:hi]

    def incoming(self, buf: Any, mirror: Any, lo: int, hi: int) -> Any:
        return buf[lo:hi] if mirror is None else mirror[lo:hi]

    def arrived(self, buf: Any, mirror: Any, lo: int, hi: int) -> None:
        if mirror is not None:
            buf[lo:hi].copy_(self.torch.from_numpy(mirror[lo:hi]))


_HOST = _HostSpace()


class _Segment:
    """Buffers and bookkeeping of one pipeline segment."""

    __slots__ = ("start", "counts", "wire", "offsets", "total", "chunks", "send", "recv", "gathered", "h_send",
                 "h_recv", "h_gathered")

    def __init__(self, codec: Codec, start: int, stop: int, size: int, rank: int, space: _HostSpace) -> None:
        # Plain ints and slices, worked out once: a call walks every segment, and numpy scalar
        # arithmetic per segment and peer cost more than the small segments' kernels.
        m = stop - start
        blocks = split_rows(-(-m // ALIGN), size)
        edges = [min(int(e), m) for e in np.concatenate(([0], np.cumsum(blocks) * ALIGN))]
        self.start = start
        self.counts = [b - a for a, b in zip(edges, edges[1:])]  # whole blocks per rank; the tail: last non-empty
        self.chunks = [slice(start + a, start + b) for a, b in zip(edges, edges[1:])]
        self.wire = [int(codec.wire_nbytes(c)) for c in self.counts]
        self.offsets = [int(o) for o in np.concatenate(([0], np.cumsum(self.wire)[:-1]))]
        self.total = sum(self.wire)
        mine = self.wire[rank] * size
        self.send, self.h_send = space.empty_u8(self.total), space.mirror(self.total)
        self.recv, self.h_recv = space.empty_u8(mine), space.mirror(mine)
        self.gathered, self.h_gathered = space.empty_u8(self.total), space.mirror(self.total)


def segment_bytes_at(wire_ratio: float, size: int, peer_bytes: int) -> int:
    """Return the FP32 bytes per pipeline segment that send ``peer_bytes`` to each of ``size`` ranks
    when the payload is ``wire_ratio`` bytes per FP32 byte (at least one aligned chunk per rank)."""
    return max(ALIGN * size * 4, int(peer_bytes * size / wire_ratio / 4) * 4)


def segment_bytes_for(codec: Codec, size: int, peer_bytes: int) -> int:
    """Return the FP32 bytes per pipeline segment that send ``peer_bytes`` of ``codec`` payload to each peer."""
    return segment_bytes_at(codec.wire_nbytes(1 << 20) / (4 << 20), size, peer_bytes)


def segments(n: int, size: int, segment_bytes: int, first_bytes: int | None = None) -> list[tuple[int, int]]:
    """Cut ``n`` elements into pipeline segments of ``segment_bytes``, the first one at most ``first_bytes``.

    Returns (start, stop) element ranges; every boundary but ``n`` is a multiple of ``ALIGN * size``, so
    each rank's chunk of a segment is whole quantisation blocks. ``n == 0`` gives one empty segment.
    """
    unit = ALIGN * size

    def elems(nbytes: int) -> int:
        return max(unit, (nbytes // 4) // unit * unit)

    step = elems(segment_bytes)
    first = min(step, elems(first_bytes)) if first_bytes else step
    cuts = [0, *range(first, n, step)] if first < n else [0]
    if len(cuts) > 2 and n - cuts[-1] < step // 2:
        cuts.pop()  # a short remainder joins the segment before it: it would cost as many messages as a whole one
    return [(a, min(b, n)) for a, b in zip(cuts, [*cuts[1:], n])] if n else [(0, 0)]


class _Plan:
    """Segments and scratch buffers of one (communicator, size, codec) combination, kept for reuse.

    Training reduces the same buckets every step; reusing the buffers avoids
    allocating (and page-faulting) a tensor's worth of memory per call.
    """

    def __init__(self, comm: Communicator, codec: Codec, n: int, segment_bytes: int, space: _HostSpace) -> None:
        size, rank = comm.size, comm.rank
        # The first segment's messages may reach a peer still busy with its previous call,
        # before it has posted their receives: kept within FIRST_PEER_BYTES they are
        # buffered on arrival instead of stalling the connection (see PEER_CHOICES).
        first = segment_bytes_for(codec, size, FIRST_PEER_BYTES)
        self.segs = [_Segment(codec, a, b, size, rank, space) for a, b in segments(n, size, segment_bytes, first)]
        self.acc = space.empty_f32(int(max(s.counts[rank] for s in self.segs)))


class _Gathered:
    """Buffers of the single-Allgather variant for one (communicator, codec, size, space), kept for reuse."""

    def __init__(self, wire: int, size: int, space: _HostSpace) -> None:
        self.mine, self.h_mine = space.empty_u8(wire), space.mirror(wire)
        self.every, self.h_every = space.empty_u8(wire * size), space.mirror(wire * size)


_plans: dict[tuple[Any, ...], _Plan] = {}
_MAX_PLANS = 64


def _comm_key(comm: Communicator) -> tuple[int, int]:
    return (id(comm), comm.uid)


def _cached(store: dict[tuple[Any, ...], Any], key: tuple[Any, ...], make: Any) -> Any:
    """Return ``store[key]``, made by ``make()`` on first use; the oldest entry goes past ``_MAX_PLANS``."""
    found = store.get(key)
    if found is None:
        if len(store) >= _MAX_PLANS:
            store.pop(next(iter(store)))
        found = store[key] = make()
    return found


class _Tuner:
    """Choose the pipeline segment of one (communicator, codec, size) by timing its first calls.

    Each candidate (one per ``PEER_CHOICES`` entry, capped at the whole tensor) runs
    ``TUNE_ROUNDS`` consecutive calls (steady state, as in training, not a pattern
    alternating with the other candidates); then one all-reduce of the candidates' mean
    times (the slowest rank's) picks the same segment on every rank. Every rank makes the
    same sequence of calls, so they decide on the same call; until then results are
    as correct as ever, only the speed varies.
    """

    def __init__(self, codec: Codec, size: int, n: int) -> None:
        self.codec_spec, self.n = codec.spec, n
        whole = max(ALIGN * size, n) * 4
        options: dict[int, int] = {}  # segment count -> the first candidate giving it
        for peer in PEER_CHOICES:
            seg = min(segment_bytes_for(codec, size, peer), whole)
            options.setdefault(len(segments(n, size, seg)), seg)
        self.options = sorted(options.values())
        self.times: dict[int, list[float]] = {opt: [] for opt in self.options}
        self.chosen: int | None = self.options[0] if len(self.options) == 1 else None
        self.calls = 0

    def next(self) -> int:
        """Return the segment bytes to use for the next call."""
        if self.chosen is not None:
            return self.chosen
        return self.options[self.calls // TUNE_ROUNDS]

    def record(self, comm: Communicator, segment_bytes: int, seconds: float) -> None:
        """Record one call's time; after the last exploring call, decide (a collective call)."""
        if self.chosen is not None:
            return
        self.times[segment_bytes].append(seconds)
        self.calls += 1
        if self.calls < TUNE_ROUNDS * len(self.options):
            return
        from mpi4py import MPI

        # The first calls of a block pay for the switch (new buffers, a different message
        # pattern, a token bucket still full): the steady state is what training sees, and
        # its mean, not median, so that an option that stalls now and then is charged for it.
        mine = np.array([float(np.mean(self.times[opt][2:] or self.times[opt])) for opt in self.options])
        slowest = np.empty_like(mine)
        comm.mpi.Allreduce(mine, slowest, op=MPI.MAX)
        # The smallest segment within TUNE_MARGIN of the fastest: longer messages are the
        # ones that stall on a busy receiver (see PEER_CHOICES), so only a clear gain pays.
        self.chosen = next(opt for opt, t in zip(self.options, slowest) if t <= slowest.min() * (1 + TUNE_MARGIN))
        for opt in self.options:  # free the scratch buffers of the sizes not chosen (in every space)
            if opt != self.chosen:
                prefix = (*_comm_key(comm), self.codec_spec, self.n, opt)
                for key in [k for k in _plans if k[:len(prefix)] == prefix]:
                    _plans.pop(key, None)


_tuners: dict[tuple[Any, ...], _Tuner] = {}


def _tuner(comm: Communicator, codec: Codec, n: int) -> _Tuner:
    return _cached(_tuners, (*_comm_key(comm), codec.spec, n), lambda: _Tuner(codec, comm.size, n))


def tuned_segment_bytes(comm: Communicator, codec: Any, n: int) -> int | None:
    """Return the segment bytes the tuner chose for ``n`` float32 elements of ``codec``, or None while tuning."""
    tuner = _tuners.get((*_comm_key(comm), resolve_codec(codec).spec, int(n)))
    return tuner.chosen if tuner is not None else None


def _plan(comm: Communicator, codec: Codec, n: int, segment_bytes: int, space: _HostSpace) -> _Plan:
    return _cached(_plans, (*_comm_key(comm), codec.spec, n, segment_bytes, space.key),
                   lambda: _Plan(comm, codec, n, segment_bytes, space))


_TAGS = 32000  # MPI guarantees tags up to 32767; segments this far apart are never in flight together


def _pipe(comm: Communicator) -> Any:
    """Return the transport of the pipeline's messages: a private one of ``comm``'s (``Transport.private``).

    Over MPI, a duplicate communicator whose own context keeps the pipeline's tags apart from
    the application's messages. The first compressed all-reduce on ``comm`` creates it (a
    collective call, made by every rank at the same point, like the all-reduce itself); the
    transport keeps it, and frees it when ``comm`` is freed.
    """
    return comm.transport.private()


def _tag(segment: int, phase: int) -> int:
    """Return the tag of one segment's phase: the phases have tags of opposite parity (over gloo the
    torch transport moves each parity on groups of its own: ``TorchTransport.private``)."""
    return (2 * segment + phase) % _TAGS


class _Run:
    """One compressed all-reduce over a flat FP32 vector."""

    def __init__(self, comm: Communicator, codec: Codec, key: Hashable, average: bool, dry: bool = False,
                 space: _HostSpace = _HOST) -> None:
        self.comm, self.codec, self.key, self.average, self.dry, self.space = comm, codec, key, average, dry, space
        self.times = {"encode": 0.0, "transfer": 0.0, "decode": 0.0}
        self.wire_sent = 0
        self.encoded_elems = 0
        self.encoded_wire = 0
        self.inflight: list[Any] = []
        self.pipe = comm.transport

    def _progress(self) -> None:
        # MPICH moves a non-blocking collective only inside MPI calls (no progress
        # thread), so poke the transfers in flight between codec kernels: this is
        # what lets encoding and decoding overlap the wire. One test is enough: each
        # MPI call runs the progress engine once over every connection, so testing
        # each request would only repeat that poll, at a cost.
        if self.inflight:
            self.pipe.progress(self.inflight[-1])

    def _encode(self, x: np.ndarray, out: np.ndarray, key: Hashable) -> None:
        if self.dry:  # a rank whose arguments deviate sends zeros in the agreed pattern (Communicator.run_collective)
            out[...] = 0  # dry runs use host buffers
            return
        t = _perf()
        # The codec's kernel entry points, not encode_into / decode_from / decode_add: the plan
        # made every slice and buffer (flat contiguous float32, exact wire sizes), and their
        # checks cost tens of µs a call, several calls per segment.
        self.codec._encode(x, out, key)
        self.times["encode"] += _perf() - t
        self.encoded_elems += int(x.shape[0])
        self.encoded_wire += int(out.shape[0])
        self._progress()

    def _decode(self, buf: np.ndarray, n: int, out: np.ndarray) -> None:
        if self.dry:
            return
        t = _perf()
        self.codec._decode(buf, n, out)
        self.times["decode"] += _perf() - t
        self._progress()

    def _decode_add(self, buf: np.ndarray, n: int, out: np.ndarray) -> None:
        if self.dry:
            return
        t = _perf()
        self.codec._decode_add(buf, n, out)
        self.times["decode"] += _perf() - t
        self._progress()

    def _start(self, reqs: list[Any]) -> list[Any]:
        self.inflight.extend(reqs)
        return reqs

    def _wait(self, reqs: list[Any]) -> None:
        t = _perf()
        with self.comm.watched("compressed_allreduce", self.key if isinstance(self.key, str) else None):
            self.pipe.wait(reqs)
        done = {id(r) for r in reqs}
        self.inflight = [r for r in self.inflight if id(r) not in done]  # identity: finished requests compare equal
        self.times["transfer"] += _perf() - t

    def pipelined(self, flat: Any, result: Any, segment_bytes: int) -> None:
        comm, size, rank, sp = self.comm, self.comm.size, self.comm.rank, self.space
        n = int(flat.shape[0])
        plan = _plan(comm, self.codec, n, segment_bytes, sp)
        segs, acc = plan.segs, plan.acc
        pipe = self.pipe = _pipe(comm)
        # Point to point (MPI): receives posted ahead, chunks sent peer by peer. Otherwise (NCCL,
        # gloo) one all-to-all per segment for the chunks and one all-gather for the reduced ones.
        p2p = pipe.point_to_point
        peers = [r for r in range(size) if r != rank]
        recvs: dict[tuple[int, int], list[Any]] = {}  # (segment, phase) -> receive requests
        sends: dict[tuple[int, int], list[Any]] = {}
        # Device buffers: the previous call's decoding kernels may still read the buffers
        # the receives below write into (and the input must be complete).
        sp.ready()

        def post_receives(i: int) -> None:
            # Receives go up before the peers' sends leave: a message that finds no posted
            # receive is an "unexpected" one, which libfabric's tcp provider holds only up
            # to 64 KiB (max_saved_size); a longer one stalls its connection until the
            # receive is posted, costing ms per call when the receiver is busy encoding.
            if not p2p:
                recvs[i, 0], recvs[i, 1] = [], []
                return
            seg = segs[i]
            w = seg.wire[rank]
            recvs[i, 0] = self._start([pipe.irecv(sp.incoming(seg.recv, seg.h_recv, r * w, (r + 1) * w), r,
                                                  _tag(i, 0)) for r in peers])
            recvs[i, 1] = self._start([pipe.irecv(sp.incoming(seg.gathered, seg.h_gathered, seg.offsets[r],
                                                              seg.offsets[r] + seg.wire[r]), r, _tag(i, 1))
                                       for r in peers])

        def start_exchange(i: int) -> None:
            seg = segs[i]
            for r in peers:  # this rank reduces its own chunk from the FP32 input: nothing to encode
                o, part = seg.offsets[r], seg.chunks[r]
                self._encode(flat[part], seg.send[o:o + seg.wire[r]], Span((self.key, "w"), part.start, n))
            sp.ready()
            if p2p:
                reqs = []
                for r in peers:
                    o = seg.offsets[r]
                    reqs += self._start([pipe.isend(sp.outgoing(seg.send, seg.h_send, o, o + seg.wire[r]), r,
                                                    _tag(i, 0))])
                sends[i, 0] = reqs
            else:  # the own chunk's slot travels too (a local copy, ignored): the splits stay contiguous
                w = seg.wire[rank]
                sends[i, 0] = self._start([pipe.ialltoallv(sp.outgoing(seg.send, seg.h_send, 0, seg.total),
                                                           seg.wire, sp.incoming(seg.recv, seg.h_recv, 0, w * size),
                                                           [w] * size)])
            # Counted like a plain all-reduce's message: this rank's encoded tensor
            # (the re-encoded chunk of the gather phase adds 1/P of it on the wire).
            self.wire_sent += seg.total

        def reduce_and_gather(i: int) -> None:
            seg = segs[i]
            self._wait(recvs.pop((i, 0)) + sends.pop((i, 0)))
            m, w = seg.counts[rank], seg.wire[rank]
            sp.arrived(seg.recv, seg.h_recv, 0, w * size)
            total = acc[:m]
            # The sum starts from this rank's own chunk in FP32 (the input is not yet
            # overwritten: segment i is written back in finish(i)), then adds the others
            # in rank order, each decoded and added in one pass.
            sp.copy(total, flat[seg.chunks[rank]])
            for r in range(size):
                if r != rank:
                    self._decode_add(seg.recv[r * w:(r + 1) * w], m, total)
            if self.average:
                sp.scale(total, 1.0 / size)
            o = seg.offsets[rank]
            self._encode(total, seg.gathered[o:o + w], Span((self.key, "s"), seg.chunks[rank].start, n))
            # The gather sends the chunk straight to every rank rather than by an
            # all-gather: MPICH's ring and recursive doubling forward chunks through
            # other ranks, each of which must be inside MPI to pass them on.
            sp.ready()
            chunk = sp.outgoing(seg.gathered, seg.h_gathered, o, o + w)
            if p2p:
                sends[i, 1] = self._start([pipe.isend(chunk, r, _tag(i, 1)) for r in peers])
            else:
                sends[i, 1] = self._start([pipe.iallgatherv(
                    chunk, sp.incoming(seg.gathered, seg.h_gathered, 0, seg.total), seg.wire)])

        def finish(i: int) -> None:
            seg = segs[i]
            self._wait(recvs.pop((i, 1)) + sends.pop((i, 1)))
            sp.arrived(seg.gathered, seg.h_gathered, 0, seg.total)
            for r in range(size):
                o = seg.offsets[r]
                self._decode(seg.gathered[o:o + seg.wire[r]], seg.counts[r], result[seg.chunks[r]])

        # Order matters when `result` is the input's own memory (in place): segment
        # i-1 is written back only after segments up to i+1 have been encoded.
        # Receives are posted two segments ahead: no peer gets further ahead than that.
        for i in range(min(2, len(segs))):
            post_receives(i)
        start_exchange(0)
        for i in range(len(segs)):
            if i + 2 < len(segs):
                post_receives(i + 2)
            if i + 1 < len(segs):
                start_exchange(i + 1)
            reduce_and_gather(i)
            if i > 0:
                finish(i - 1)
        finish(len(segs) - 1)

    def gathered(self, flat: Any, result: Any) -> None:
        comm, size, n, sp = self.comm, self.comm.size, int(flat.shape[0]), self.space
        w = self.codec.wire_nbytes(n)
        bufs = _cached(_plans, (*_comm_key(comm), self.codec.spec, n, "gathered", sp.key),
                       lambda: _Gathered(w, size, sp))
        self._encode(flat, bufs.mine, (self.key, "g"))
        sp.ready()  # the encoding is done, and so are the previous call's kernels reading `every`
        self._wait([comm.transport.iallgather(sp.outgoing(bufs.mine, bufs.h_mine, 0, w),
                                              sp.incoming(bufs.every, bufs.h_every, 0, w * size))])
        self.wire_sent += w  # this rank's message: its encoded tensor
        if self.dry:
            return
        sp.arrived(bufs.every, bufs.h_every, 0, w * size)
        t = _perf()
        sp.zero(result)
        for r in range(size):  # same order on every rank: identical results
            self.codec.decode_add(bufs.every[r * w:(r + 1) * w], n, result)
        if self.average:
            sp.scale(result, 1.0 / size)
        self.times["decode"] += _perf() - t


def compressed_allreduce(
    comm: Communicator,
    x: Any,
    op: str = "sum",
    *,
    codec: Any,
    out: Any = None,
    name: str | None = None,
    segment_bytes: int | None = None,
    small_bytes: int = SMALL_BYTES,
    hierarchical: Any = None,
) -> Any:
    """Sum or average ``x`` over ``comm`` with ``codec`` payloads on the wire.

    Args:
        comm: the communicator.
        x: float array (numpy, torch or cupy). Device arrays are encoded and decoded on their
            device when the codec has device kernels, with device buffers handed to a CUDA-aware
            MPI or payloads staged through pinned host memory; otherwise through a host copy.
        op: "sum" or "avg" (a lossy codec cannot compute min/max).
        codec: spec string or codec object (see ``commwire.codecs.get``).
        out: optional array of x's shape and dtype for the result.
        name: stable tensor name; keys error-feedback state and labels statistics.
        segment_bytes: FP32 bytes per pipeline segment; default: tuned on the first calls of each
            size among ``PEER_CHOICES`` payload bytes per peer (see ``_Tuner``).
        small_bytes: below this size use the single-Allgather variant.
        hierarchical: True or "node": reduce losslessly inside each node and run the codec only
            across nodes (``commwire.codecs.hierarchical``); an int: groups of that many
            consecutive ranks instead of nodes; False: flat; None (default): the process
            default (``COMMWIRE_HIERARCHICAL``, off unless set).

    Returns:
        The reduced array, same kind, dtype, shape and device as ``x``.

    Example:
        >>> cw.allreduce(grad, op="avg", codec="ef+fp8-e4m3", name="layer1.weight")
    """
    codec = resolve_codec(codec)
    if codec.lossless:
        return comm.allreduce(x, op, out=out, name=name)
    error = adapter = host = space = dtype = None
    try:
        if op_label(op) not in ("sum", "avg"):
            raise ValueError(f"op={op!r} cannot run on codec {codec.spec!r} payloads; use op='sum' or 'avg', "
                             "or codec=None")
        adapter = adapter_for(x)
        space = device_space(comm, codec, x)
        if space is None:
            host = adapter.host(x)
            dtype = host.dtype
        else:
            dtype = arrays.device_ops(x).numpy_dtype(x)  # no copy: the data stays on the device
        if dtype.kind != "f" and dtype.name != "bfloat16":
            raise TypeError(f"codec {codec.spec!r} needs a float array, got {dtype}; pass codec=None for "
                            "integers")
        check_out(x, out, "compressed allreduce")
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (Communicator.run_collective)
        error = exc
    shape = tuple(int(d) for d in x.shape) if dtype is not None else None
    shape, dtype_label = (shape, str(dtype)) if dtype is not None else describe(x)
    try:
        hierarchy = hierarchy_setting(hierarchical)
    except ValueError as exc:
        hierarchy, error = None, error or exc
    sig = Signature("compressed_allreduce", name, shape, dtype_label, op_label(op),
                    codec=(codec.spec, segment_bytes, small_bytes, hierarchy), device=device_of(x))
    average = sig.op != "sum"
    key = name if name is not None else ("shape", shape)

    def run_host() -> Any:
        assert host is not None and adapter is not None
        start = _perf()
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
        run = _reduce_flat(comm, codec, key, flat, result, average, segment_bytes, small_bytes, hierarchy=hierarchy)
        codec.tensor_inverse(result, key)
        adapter.release(host)
        if direct is not None:
            value = out
        else:
            shaped = result.reshape(host.shape)
            final = shaped if host.dtype == _F32 else shaped.astype(host.dtype)
            value = adapter.write(out, final) if out is not None else adapter.wrap(final, x)
        _account(comm, codec, name, run, start, host.nbytes)
        return value

    def run_device() -> Any:
        assert space is not None and dtype is not None
        start = _perf()
        kind = arrays.kind_of(x)
        t = arrays.to_torch(x).detach()
        flat = t.reshape(-1)
        if flat.dtype != space.torch.float32 or not flat.is_contiguous():
            flat = flat.to(space.torch.float32).contiguous()
        flat = codec.tensor_forward(flat, key)
        target = None if out is None else arrays.to_torch(out).detach()
        # Decode straight into a float32 `out` (out=x included: the pipeline overwrites only
        # segments it has encoded, and the kernels run in stream order).
        into_out = (target is not None and target.dtype == space.torch.float32 and target.is_contiguous()
                    and (out is x or not _overlaps(target, flat)))
        result = target.reshape(-1) if into_out else space.empty_f32(int(flat.shape[0]))
        run = _reduce_flat(comm, codec, key, flat, result, average, segment_bytes, small_bytes, space=space,
                           hierarchy=hierarchy)
        codec.tensor_inverse(result, key)
        if into_out:
            value = out
        else:
            final = result.reshape(t.shape).to(t.dtype)
            if target is not None:
                target.copy_(final)
                value = out
            else:
                value = arrays.from_torch(final, kind)
        _account(comm, codec, name, run, start, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        return value

    def dummy(agreed_sig: tuple[Any, ...]) -> None:
        n = int(np.prod(agreed_sig.shape, dtype=np.int64))
        flat = np.zeros(n, dtype=_F32)
        _reduce_flat(comm, codec, None, flat, np.empty_like(flat), average, segment_bytes, small_bytes, dry=True,
                     hierarchy=agreed_sig.codec[3])

    return comm.run_collective(sig, error, run_host if space is None else run_device, dummy)


_last_call = threading.local()


def last_wire_bytes() -> int:
    """Return the bytes the calling thread's latest compressed all-reduce handed to MPI (0 before any).

    Per thread: the counters are shared by every communicator and thread of the process, so a
    difference of two counter snapshots also counts calls other threads made meanwhile.
    """
    return int(getattr(_last_call, "wire_sent", 0))


def _account(comm: Communicator, codec: Codec, name: str | None, run: _Run, start: float, input_bytes: int) -> None:
    """Record one compressed all-reduce in the counters and the timeline."""
    end = _perf()
    _last_call.wire_sent = run.wire_sent
    counters = comm.counters
    counters.record("compressed_allreduce", run.wire_sent, end - start, input_bytes=input_bytes)
    counters.record_codec(codec.spec, run.encoded_elems * 4, run.encoded_wire, run.encoded_elems)
    counters.add("compressed_allreduce_phases", **run.times)
    if comm.timeline is not None:
        comm.timeline.add(name or "compressed_allreduce", start, end, op="compressed_allreduce",
                          codec=codec.spec, bytes=run.wire_sent, **{k + "_s": v for k, v in run.times.items()})


def has_device_kernels(codec: Codec) -> bool:
    """Return whether every stage of ``codec`` declares that it runs on torch tensors on their device.

    Each stage says so itself (``Codec.device_capable``); one that does not makes the whole codec
    reduce device arrays through a host copy.
    """
    return all(stage.device_capable for stage in codec.stages)


def device_space(comm: Communicator, codec: Codec, x: Any) -> _DeviceSpace | None:
    """Return where a compressed all-reduce of ``x`` keeps its buffers: on x's device, or None for host memory.

    On the device when ``x`` is a device array (or stands in for one: ``arrays.cpu_standin``) and the
    codec has device kernels; MPI then gets the device buffers if ``comm.cuda_aware``, else pinned
    host mirrors. Each rank decides alone: every choice sends the same messages.
    """
    if not arrays.is_device_array(x) or not has_device_kernels(codec):
        return None
    try:
        like = arrays.to_torch(x)  # cupy arrays run through torch (DLPack, zero copy)
    except ImportError:
        return None
    return _DeviceSpace(like, staged=not comm.transport.device_buffers(x))


def _overlaps(a: Any, b: Any) -> bool:
    """Return whether two torch tensors' memory ranges overlap."""
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return lo_a < lo_b + b.numel() * b.element_size() and lo_b < lo_a + a.numel() * a.element_size()


def _reduce_flat(comm: Communicator, codec: Codec, key: Hashable, flat: Any, result: Any, average: bool,
                 segment_bytes: int | None, small_bytes: int, dry: bool = False, space: _HostSpace = _HOST,
                 hierarchy: tuple[int | str, bool] | None = None) -> _Run:
    """Reduce one flat FP32 vector into ``result`` (a dry run moves zeros in the same message pattern)."""
    if hierarchy is not None and comm.size > 1:
        levels = levels_of(comm, *hierarchy)
        if levels is not None:
            return _reduce_levels(comm, levels, codec, key, flat, result, average, segment_bytes, small_bytes, dry,
                                  space)
    run = _Run(comm, codec, key, average, dry=dry, space=space)
    n = int(flat.shape[0])
    if n * 4 < small_bytes or comm.size == 1:
        run.gathered(flat, result)
    elif segment_bytes:
        run.pipelined(flat, result, segment_bytes)
    else:
        tuner = _tuner(comm, codec, n)
        seg = tuner.next()
        t0 = _perf()
        run.pipelined(flat, result, seg)
        tuner.record(comm, seg, _perf() - t0)
    return run


def _reduce_levels(comm: Communicator, levels: Any, codec: Codec, key: Hashable, flat: Any, result: Any,
                   average: bool, segment_bytes: int | None, small_bytes: int, dry: bool, space: _HostSpace) -> _Run:
    """Reduce ``flat`` in FP32 inside each group and with ``codec`` across groups (``commwire.codecs.hierarchical``).

    Tensors above ``LEVEL_CHUNK_BYTES`` go in chunks: while one chunk crosses the network on this
    thread, the next chunk's reduce-scatter and the previous one's all-gather run on the group's
    lane. Returns one run totalling the across-group steps: their bytes are the ones that leave a node.
    """
    inner, cross = levels.inner, levels.cross
    total = _Run(cross, codec, key, average, dry=dry, space=space)
    if levels.groups == 1:  # one node: exact, no byte is encoded
        space.copy(result, inner.allreduce(flat, "avg" if average else "sum"))
        return total
    n = int(flat.shape[0])
    if n == 0:
        return total
    unit = ALIGN * levels.per_group
    step = max(unit, LEVEL_CHUNK_BYTES // 4 // unit * unit)
    spans = [(a, min(a + step, n)) for a in range(0, n, step)]
    if n - spans[-1][0] < step // 2 and len(spans) > 1:  # no short last chunk
        spans[-2:] = [(spans[-2][0], n)]

    counts_of = [blocks(b - a, levels.per_group, ALIGN) for a, b in spans]

    def scatter(lane: Communicator, k: int) -> Any:
        a, b = spans[k]
        return lane.reduce_scatter(flat[a:b], "sum", counts=counts_of[k])

    def now(method: Any, *args: Any) -> Handle:
        return Done(method(inner, *args), None)

    # One chunk has nothing to overlap: its steps run on this thread, waiting as this thread's
    # communicator does (a lane's yield the CPU); several go through the group's lane.
    submit = inner.submit if len(spans) > 1 else now
    gathers = []
    pending = submit(scatter, 0)
    for k, (a, b) in enumerate(spans):
        following = submit(scatter, k + 1) if k + 1 < len(spans) else None
        block = pending.wait()
        counts = counts_of[k]
        lo = a + int(counts[:inner.rank].sum())
        mine = result[lo:lo + int(counts[inner.rank])]
        if mine.shape[0]:  # every rank of this cross group has a block of the same size
            run = _reduce_flat(cross, codec, (key, "cross", k), block, mine, False, segment_bytes, small_bytes,
                               dry=dry, space=space)
            if average and not dry:
                space.scale(mine, 1.0 / comm.size)
            total.wire_sent += run.wire_sent
            total.encoded_elems += run.encoded_elems
            total.encoded_wire += run.encoded_wire
            for phase, seconds in run.times.items():
                total.times[phase] += seconds
        gathers.append((a, b, submit(Communicator.allgather, mine)))
        pending = following
    for a, b, gathered in gathers:
        space.copy(result[a:b], gathered.wait())
    return total


def compressed_allreduce_async(comm: Communicator, x: Any, op: str = "sum", *, codec: Any, out: Any = None,
                               name: str | None = None, **kwargs: Any) -> Handle:
    """Start a compressed all-reduce on a background lane; ``wait()`` returns the result."""
    codec = resolve_codec(codec)
    if codec.lossless:
        return comm.allreduce_async(x, op, out=out, name=name)
    # Through the communicator: CUDA tensors' device work is ordered with the caller's stream.
    return comm.submit(compressed_allreduce, x, op, codec=codec, out=out, name=name, **kwargs)
