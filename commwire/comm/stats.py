"""Count every operation: calls, bytes handed to MPI, input bytes and time.

``bytes`` is the size of the message this rank hands to MPI for the operation
(for a compressed collective: the encoded payload, scales included), so
``bytes / input_bytes`` is the wire ratio of a codec. It is deliberately not
the algorithm-dependent traffic (a ring all-reduce moves about 2(P-1)/P of it).
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Counters"]


class Counters:
    """Accumulate per-operation and per-codec counters for one process."""

    __slots__ = ("_ops", "_codecs", "_extra", "_lock")

    def __init__(self) -> None:
        self._ops: dict[str, list[float]] = {}
        self._codecs: dict[str, list[float]] = {}
        self._extra: dict[str, dict[str, float]] = {}
        # Handles may complete on a progress thread; keep updates atomic.
        self._lock = threading.Lock()

    def record(self, op: str, nbytes: int, seconds: float, input_bytes: int | None = None) -> None:
        """Add one call of ``op`` that handed ``nbytes`` to MPI and took ``seconds``."""
        with self._lock:
            row = self._ops.get(op)
            if row is None:
                row = self._ops[op] = [0, 0, 0, 0.0]
            row[0] += 1
            row[1] += nbytes
            row[2] += nbytes if input_bytes is None else input_bytes
            row[3] += seconds

    def record_codec(self, spec: str, input_bytes: int, wire_bytes: int, elements: int) -> None:
        """Add one encoded tensor: its FP input size, its wire size and element count."""
        with self._lock:
            row = self._codecs.get(spec)
            if row is None:
                row = self._codecs[spec] = [0, 0, 0, 0]
            row[0] += 1
            row[1] += input_bytes
            row[2] += wire_bytes
            row[3] += elements

    def add(self, group: str, **values: float) -> None:
        """Accumulate named values under ``group`` (e.g. per-phase seconds); counts calls."""
        with self._lock:
            row = self._extra.setdefault(group, {"calls": 0})
            row["calls"] += 1
            for key, value in values.items():
                row[key] = row.get(key, 0.0) + value

    def snapshot(self, reset: bool = False) -> dict[str, Any]:
        """Return the counters as a plain dict, optionally zeroing them."""
        with self._lock:
            out: dict[str, Any] = {
                op: {"calls": int(r[0]), "bytes": int(r[1]), "input_bytes": int(r[2]), "time_s": r[3]}
                for op, r in self._ops.items()
            }
            out["codecs"] = {
                spec: {
                    "calls": int(r[0]),
                    "input_bytes": int(r[1]),
                    "wire_bytes": int(r[2]),
                    "elements": int(r[3]),
                    "bytes_per_element": (r[2] / r[3]) if r[3] else 0.0,
                }
                for spec, r in self._codecs.items()
            }
            out.update({group: dict(row) for group, row in self._extra.items()})
            if reset:
                self._ops.clear()
                self._codecs.clear()
                self._extra.clear()
        return out
