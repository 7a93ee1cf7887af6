"""Record a Chrome-trace timeline (opens in Perfetto or chrome://tracing).

Each rank writes complete events ("ph": "X", microsecond timestamps on a
shared clock origin) to a file as they happen, one unbuffered write each, so
memory stays flat however long the job runs and a job that crashes, hangs or
is killed leaves every finished operation on disk. Rank 0 writes the
timeline's own path; rank r > 0 writes ``PATH.rank<r>`` beside it. The files
are in Chrome's JSON array format, whose closing bracket is optional: each
opens in Perfetto while the job runs. At ``finalize()`` (or
``stop_timeline()``) the other ranks' events are sent to rank 0, which
appends them as one track (pid) per rank, as Horovod's timeline does, closes
the array, and the per-rank files are removed.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
from typing import Any

__all__ = ["Timeline", "part_path"]

_CHUNK = 8 << 20  # bytes per message when a rank hands its events to rank 0
_TAG = 7711


def part_path(path: str, rank: int) -> str:
    """Return the file rank ``rank`` writes its events to (rank 0: ``path`` itself)."""
    return path if rank == 0 else f"{path}.rank{rank}"


class Timeline:
    """Write one rank's trace events to its file.

    Args:
        path: the timeline's path (rank 0's file; the others write ``part_path(path, rank)``).
        rank: this process's rank, the event track (pid) it writes.

    Raises:
        OSError: the file cannot be created (the message names it).
    """

    def __init__(self, path: str, rank: int) -> None:
        self.path = os.fspath(path)
        self.rank = rank
        self.file = part_path(self.path, rank)
        self._lock = threading.Lock()
        self._failed = False
        self._fd: int | None = self._create()
        meta = {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        self._write("[\n" + json.dumps(meta))

    def _create(self) -> int:
        directory = os.path.dirname(os.path.abspath(self.file))
        try:
            os.makedirs(directory, exist_ok=True)
            return os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as exc:
            if self.rank == 0:
                raise OSError(f"cannot write the timeline {self.file!r}: {exc}; pass a path in a writable "
                              f"directory (timeline=, COMMWIRE_TIMELINE or HOROVOD_TIMELINE)") from exc
        # Another rank whose host cannot write beside rank 0's path keeps its part in its temp directory.
        fd, self.file = tempfile.mkstemp(prefix=f"commwire-timeline-rank{self.rank}-", suffix=".json")
        warnings.warn(f"commwire timeline: rank {self.rank} cannot write {part_path(self.path, self.rank)!r}; "
                      f"its events go to {self.file!r} until the timeline is collected", stacklevel=4)
        return fd

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
        self._write(",\n" + json.dumps(event, separators=(",", ":"), default=str))

    def _write(self, text: str) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, text.encode("ascii"))  # json.dumps escapes non-ASCII
            except OSError as exc:
                if not self._failed:
                    self._failed = True
                    warnings.warn(f"commwire timeline: writing {self.file!r} failed ({exc}); no more events are "
                                  f"recorded on rank {self.rank}", stacklevel=4)
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    def _take(self) -> int | None:
        with self._lock:
            fd, self._fd = self._fd, None
        return fd

    def close(self) -> None:
        """Stop recording and close the file as it is (no other rank's events; nothing removed)."""
        fd = self._take()
        if fd is not None:
            try:
                if self.rank == 0:
                    os.write(fd, b"\n]\n")
                os.close(fd)
            except OSError:
                pass

    def discard(self) -> None:
        """Stop recording and remove this rank's file (a timeline that never started on every rank)."""
        self.close()
        try:
            os.remove(self.file)
        except OSError:
            pass

    def collect(self, mpi_comm: Any) -> None:
        """Merge every rank's events into rank 0's file and close the timeline (collective over ``mpi_comm``).

        Every rank's part goes to rank 0 in chunks of 8 MiB, so neither side
        holds a whole timeline in memory; the per-rank files are removed.
        """
        _collect_parts(mpi_comm, self, self._take())


def _collect_parts(mpi_comm: Any, recorder: Timeline | None, fd: int | None) -> None:
    """Send this rank's part (``recorder``'s, if any) to rank 0, which appends them all to its open ``fd``."""
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    if rank != 0:
        try:
            if fd is not None:
                os.close(fd)
                _send_part(mpi_comm, recorder.file)
        finally:
            mpi_comm.send(b"", dest=0, tag=_TAG)
        return
    for source in range(1, size):  # every rank's part is received, written or not: no sender is left waiting
        while chunk := mpi_comm.recv(source=source, tag=_TAG):
            fd = _append(fd, chunk, recorder)
    fd = _append(fd, b"\n]\n", recorder)
    if fd is not None:
        os.close(fd)


def _append(fd: int | None, data: bytes, recorder: Timeline | None) -> int | None:
    """Write ``data`` to rank 0's open timeline; on failure warn, close it and return None."""
    if fd is None:
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return fd
    except OSError as exc:
        warnings.warn(f"commwire timeline: writing {recorder.file if recorder else 'the timeline'!r} failed "
                      f"({exc}); the other ranks' events are not all in it", stacklevel=3)
        try:
            os.close(fd)
        except OSError:
            pass
        return None


def _send_part(mpi_comm: Any, file: str) -> None:
    try:
        with open(file, "rb") as part:
            head = part.read(2)  # the opening "[\n"; rank 0's file holds the array's only one
            if head != b"[\n":
                raise OSError(f"{file!r} does not start a timeline")
            prefix, chunk = b",\n", part.read(_CHUNK)
            while chunk:
                mpi_comm.send(prefix + chunk, dest=0, tag=_TAG)
                prefix, chunk = b"", part.read(_CHUNK)
        os.remove(file)
    except OSError as exc:
        warnings.warn(f"commwire timeline: rank {mpi_comm.Get_rank()}'s events in {file!r} could not be "
                      f"handed to rank 0 ({exc}); they are not in the timeline", stacklevel=3)


# perf_counter has an arbitrary origin per process; anchor it to wall time so the
# ranks' tracks line up (to the accuracy of the hosts' clocks).
_EPOCH_OFFSET = time.time() - time.perf_counter()
