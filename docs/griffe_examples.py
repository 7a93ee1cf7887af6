"""Griffe extension for the API reference: read ``Example:`` as Google style's ``Examples:`` section.

commwire's docstrings head their doctest lines ``Example:``; griffe knows only
the plural as a section and would render the singular as an admonition whose
``>>>`` lines Markdown turns into nested block quotes. Read-only: the source
files are not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` heading of a docstring to ``Examples:`` before griffe parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring heading in place."""
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
