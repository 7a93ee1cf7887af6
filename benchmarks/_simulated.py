"""The compressed all-reduce of R data-parallel ranks, simulated in one process with one codec.

:class:`SimulatedAllreduce` reproduces what ``compressed_allreduce``
(:mod:`commwire.codecs.collective`) computes on R ranks, call for call through
the same codec methods, so a benchmark can train a data-parallel model on one
core with bit-identical gradients (tests/gift/mpi_gift.py checks this against
the real collective on 2 ranks):

- tensors of at least ``small_bytes`` take the two-phase pipelined scheme with
  a fixed segment size (``peer_bytes`` of payload per peer; the real collective
  tunes it on the first calls, which would make runs depend on timing): in
  each segment, rank j owns chunk j; every other rank encodes its chunk j
  (key ``Span((name, "w"), ...)``), rank j adds the decoded chunks to its own
  FP32 chunk in rank order, averages, re-encodes the result (``Span((name, "s"), ...)``)
  and every rank decodes all chunks;
- smaller tensors take the Allgather scheme: every rank encodes its whole tensor
  (key ``(name, "g")``) and every rank decodes and adds them in rank order.

Rank r's codec state is keyed by ``(name, r)``: one codec instance holds the
state of all R ranks (error-feedback residuals apart, GIFT factors shared as a
refresh makes them identical). GIFT's forward map runs per rank and its
inverse once (it is identical on every rank). It can also count the range hits
of every payload (:func:`commwire.codecs.gift.range_hits`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from commwire.codecs.base import Codec, Span
from commwire.codecs.collective import ALIGN, FIRST_PEER_BYTES, SMALL_BYTES, segment_bytes_for, segments
from commwire.codecs.gift import range_hits
from commwire.comm.buffers import split_rows

__all__ = ["SimulatedAllreduce"]

_F32 = np.float32


class SimulatedAllreduce:
    """Average R ranks' float32 vectors through ``codec`` as R ranks' ``compressed_allreduce`` would.

    Args:
        codec: the codec (one instance for all simulated ranks).
        ranks: the number of simulated ranks R.
        peer_bytes: payload bytes per peer and pipeline segment (one of ``PEER_CHOICES``).
        small_bytes: FP32 bytes below which the Allgather scheme is used.
    """

    def __init__(self, codec: Codec, ranks: int, *, peer_bytes: int = 64 << 10, small_bytes: int = SMALL_BYTES) -> None:
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks={ranks!r}; use an int >= 1")
        self.codec, self.ranks = codec, ranks
        self.peer_bytes, self.small_bytes = int(peer_bytes), int(small_bytes)
        self.counting = False
        self.hits = {"flushed": 0, "top": 0, "total": 0}
        """Range hits of the payloads encoded while ``counting`` (values, not codes, in ``total``)."""

    def bind_layout(self, key: Hashable, layout: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """Tell the codec which named tensors the fused buffer ``key`` holds, for every simulated rank."""
        for r in range(self.ranks):
            self.codec.bind_layout((key, r), layout)

    def __call__(self, key: Hashable, parts: Sequence[np.ndarray]) -> np.ndarray:
        """Return the average of ``parts`` (one flat float32 vector per rank) after the codec round trips."""
        if len(parts) != self.ranks:
            raise ValueError(f"expected {self.ranks} parts (one per rank), got {len(parts)}")
        n = int(parts[0].shape[0])
        flats = [self.codec.tensor_forward(np.ascontiguousarray(p, dtype=_F32), (key, r)) for r, p in enumerate(parts)]
        if n * 4 < self.small_bytes or self.ranks == 1:
            result = self._gathered(key, flats)
        else:
            result = self._pipelined(key, flats)
        self.codec.tensor_inverse(result, (key, 0))  # every rank's inverse gives this same result
        return result

    # ------------------------------------------------------------------ the two schemes
    def _encode(self, x: np.ndarray, key: Hashable) -> np.ndarray:
        wire = np.empty(self.codec.wire_nbytes(int(x.shape[0])), np.uint8)
        self.codec.encode_into(x, wire, key=key)
        if self.counting:
            found = range_hits(self.codec, wire, x)
            if found is not None:
                self.hits["flushed"] += int(np.count_nonzero(found[0]))
                self.hits["top"] += int(np.count_nonzero(found[1]))
                self.hits["total"] += int(np.count_nonzero(x))
        return wire

    def _gathered(self, key: Hashable, flats: list[np.ndarray]) -> np.ndarray:
        n = int(flats[0].shape[0])
        wires = [self._encode(f, ((key, r), "g")) for r, f in enumerate(flats)]
        result = np.zeros(n, _F32)
        for wire in wires:  # rank order, as every rank adds them
            self.codec.decode_add(wire, n, result)
        np.multiply(result, _F32(1.0 / self.ranks), out=result)
        return result

    def _pipelined(self, key: Hashable, flats: list[np.ndarray]) -> np.ndarray:
        size, n = self.ranks, int(flats[0].shape[0])
        result = np.empty(n, _F32)
        seg_bytes = segment_bytes_for(self.codec, size, self.peer_bytes)
        first = segment_bytes_for(self.codec, size, FIRST_PEER_BYTES)
        for start, stop in segments(n, size, seg_bytes, first):
            chunks = _chunks(start, stop, size)
            sent = {(r, j): self._encode(flats[r][chunks[j]], Span(((key, r), "w"), chunks[j].start, n))
                    for r in range(size) for j in range(size) if r != j}
            for j, c in enumerate(chunks):
                m = c.stop - c.start
                total = flats[j][c].copy()  # the owner's own chunk stays FP32
                for r in range(size):
                    if r != j:
                        self.codec.decode_add(sent[r, j], m, total)
                np.multiply(total, _F32(1.0 / size), out=total)
                wire = self._encode(total, Span(((key, j), "s"), c.start, n))
                self.codec.decode_from(wire, m, out=result[c])
        return result


def _chunks(start: int, stop: int, size: int) -> list[slice]:
    """Return the ranks' chunks of one segment: whole ``ALIGN`` blocks each, as the collective cuts them."""
    m = stop - start
    edges = np.minimum(np.concatenate(([0], np.cumsum(split_rows(-(-m // ALIGN), size)) * ALIGN)), m)
    return [slice(start + int(a), start + int(b)) for a, b in zip(edges[:-1], edges[1:])]
