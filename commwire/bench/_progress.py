"""Progress of long runs (the suite, fault injection, sweeps, the demo), drawn with rich.

On a terminal a rich progress bar (elapsed time, steps done, what runs now)
stays at the bottom while messages scroll above it; without one — CI logs,
pipes, ``--quiet`` runs — every start and finish is one plain line, so logs
stay clean and greppable. Thread-safe: parts' output may arrive from reader
threads.

Example:
    >>> with Steps(3, "faults") as steps:
    ...     steps.start(0, "kill9 #1")
    ...     steps.finish(0, "kill9 #1: ended in 2.1 s")
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, TextIO

__all__ = ["Steps", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Return whether ``stream`` is an interactive terminal (and not TERM=dumb)."""
    return bool(getattr(stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"


class Steps:
    """Report a run of ``total`` steps: a rich bar on a terminal, one line per event otherwise.

    Args:
        total: number of steps.
        label: prefix of every line ("suite", "faults", ...).
        quiet: hide the steps' own output lines (``line``); starts and finishes still show.
        out: where the steps' output lines go (default stdout).
        err: where progress goes (default stderr).
        tty: force the terminal mode on or off (default: ``err`` is a terminal).
    """

    def __init__(self, total: int, label: str = "run", *, quiet: bool = False, out: TextIO | None = None,
                 err: TextIO | None = None, tty: bool | None = None) -> None:
        self.total, self.label, self.quiet = total, label, quiet
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.tty = is_terminal(self.err) if tty is None else tty
        self.done = 0
        self._lock = threading.RLock()
        self._bar: Any = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            console = Console(file=self.err, force_terminal=True)
            self._bar = Progress(TextColumn(f"{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=console, transient=True)
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def _print(self, text: str, stream: TextIO) -> None:
        with self._lock:
            if self._bar is not None:
                # rich prints above the bar; a stream other than the bar's console is written plainly
                if stream is self.err:
                    self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
                    return
                self._bar.console.file.flush()
            stream.write(text + "\n")
            stream.flush()

    def start(self, index: int, what: str) -> None:
        """Announce that step number ``index`` (0-based) starts."""
        with self._lock:
            if self._bar is not None:
                self._bar.update(self._task, description=what)
            else:
                self._print(f"{self.label}: [{index + 1}/{self.total}] {what}: started", self.err)

    def finish(self, index: int, how: str) -> None:
        """Announce how step number ``index`` ended (``how`` is the whole line after the counter)."""
        with self._lock:
            self.done += 1
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done, description="")
            self._print(f"{self.label}: [{index + 1}/{self.total}] {how}", self.err)

    def line(self, prefix: str, text: str, *, stderr: bool = False) -> None:
        """Show one output line of a step, prefixed (nothing when quiet)."""
        if not self.quiet:
            self._print(f"[{prefix}] {text}", self.err if stderr else self.out)

    def note(self, text: str) -> None:
        """Show a message of the run itself."""
        self._print(f"{self.label}: {text}", self.err)

    def close(self) -> None:
        """Remove the bar (if any) and leave the terminal on a fresh line."""
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
