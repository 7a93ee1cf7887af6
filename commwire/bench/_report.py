"""Print a benchmark's table on rank 0 and optionally save its rows as JSON."""

from __future__ import annotations

import json
from typing import Any


def emit(table: str, rows: Any, json_path: str | None, *, rank: int = 0) -> None:
    """Print ``table`` and write ``rows`` to ``json_path`` (if given), on rank 0 only."""
    if rank != 0:
        return
    print(table, flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
