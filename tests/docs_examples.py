"""Run the code blocks of the docs pages, so that a page and its tested example cannot drift apart."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_block(page: str, containing: str) -> str:
    """Return the one ```python block of ``docs/PAGE`` whose text contains ``containing``."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    found = [b for b in blocks if containing in b]
    if len(found) != 1:
        raise LookupError(f"docs/{page} has {len(found)} python blocks containing {containing!r}; expected 1")
    return found[0]


@functools.cache
def run_block(page: str, containing: str) -> dict[str, Any]:
    """Execute that block as a module would, once per process (it may register names), and return its namespace."""
    namespace: dict[str, Any] = {"__name__": f"docs_{Path(page).stem}"}
    exec(compile(python_block(page, containing), f"docs/{page}", "exec"), namespace)  # noqa: S102
    return namespace
