"""Record a Chrome-trace timeline (opens in Perfetto or chrome://tracing).

Each rank buffers complete events ("ph": "X") with microsecond timestamps on a
shared clock origin; at finalize the events are gathered to rank 0, which
writes one JSON file with one track (pid) per rank, as Horovod's timeline does.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["Timeline"]


class Timeline:
    """Buffer trace events for one rank and write them as Chrome-trace JSON."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float, **args: Any) -> None:
        """Record one phase that ran from ``start`` to ``end`` (perf_counter seconds)."""
        event = {
            "name": name,
            "ph": "X",
            "pid": self.rank,
            "tid": threading.get_ident() % 1_000_000,
            "ts": (start + _EPOCH_OFFSET) * 1e6,
            "dur": max(end - start, 0.0) * 1e6,
            "args": args,
        }
        with self._lock:
            self.events.append(event)

    def write(self, per_rank: list[list[dict[str, Any]]]) -> None:
        """Write all ranks' events to ``self.path`` (called on rank 0)."""
        meta = [
            {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
            for r in range(len(per_rank))
        ]
        events = meta + [e for rank_events in per_rank for e in rank_events]
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)


# perf_counter has an arbitrary origin per process; anchor it to wall time so the
# ranks' tracks line up (to the accuracy of the hosts' clocks).
_EPOCH_OFFSET = time.time() - time.perf_counter()
