"""Run a program on one rank so that any failure aborts the whole job and its output lines stay whole.

``commwire run`` starts ``python script.py`` as ``python -m commwire._rankmain
[--tag-output] [--timestamp-output] [--output-dir DIR] script.py``. An unhandled exception, or
``sys.exit`` with a non-zero status, prints this rank's number and traceback
and calls MPI_Abort, so the other ranks never wait forever in a collective the
failed rank will not join.

Output: sys.stdout and sys.stderr become streams that hand the launcher whole
lines only, with ``--tag-output`` each prefixed ``[RANK]<stdout>:`` or
``[RANK]<stderr>:`` as horovodrun prints them (``--timestamp-output`` puts the
time before it, as horovodrun's ``--prefix-output-with-timestamp`` does). Every os.write carries whole
lines and at most PIPE_BUF bytes, so the launcher, which forwards what it reads
from each rank's pipe, never joins two ranks' text on one line. Text that no
newline has ended yet is held until one comes, or until the stream is flushed
or the program ends, and then becomes a line of its own (``print(".",
end="", flush=True)`` prints a line per dot); a line longer than PIPE_BUF is
cut into several. ``--output-dir DIR`` also copies this rank's
lines, untagged, into ``DIR/rank.N/stdout`` and ``DIR/rank.N/stderr`` (N
zero-padded to the width of the largest rank, as horovodrun does) on the
rank's host. What is written below sys.stdout (C extensions, ``os.write(1,
…)``, child processes) reaches the launcher as it is.

``--exec PROGRAM ARGS`` runs a program that is not Python as a child and
treats its output the same way.
"""

from __future__ import annotations

import io
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from .comm.rankenv import launcher_ranks, torch_variables
from .comm.ranklog import env_rank, record, start_guardian
from .comm.runtime import install_abort_hook, report_and_abort

_USAGE = ("usage: python -m commwire._rankmain [--tag-output] [--timestamp-output] [--output-dir DIR] "
          "(script | -m module | -c code | --exec program) [args...]")
_LINE_MAX = select.PIPE_BUF  # a pipe write up to this size is never split or mixed with another


class _LineWriter:
    """Turn a byte stream into whole lines, each tagged, written to ``fd`` in PIPE_BUF-sized pieces."""

    def __init__(self, fd: int, tag: str, copy: BinaryIO | None = None, stamp: bool = False) -> None:
        self.fd, self.tag, self.copy, self.stamp = fd, tag.encode(), copy, stamp
        self.pending = b""
        self.broken = False  # a flush ended the last line early: the newline that ends it is already out
        self.lock = threading.RLock()  # reentrant: a signal handler may print while a write is under way
        stamp_len = len(time.asctime()) if stamp else 0  # always 24 characters
        self.room = max(_LINE_MAX - len(self.tag) - stamp_len - 1, 64)  # line bytes per piece, prefix aside
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self.lock = threading.RLock()  # another thread of the parent may have held it: never inherit it

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.broken and data:
                self.broken, data = False, data[1:] if data.startswith(b"\n") else data
            self.pending += data
            head, sep, tail = self.pending.rpartition(b"\n")
            if sep:
                self.pending = tail
                self._emit(head.split(b"\n"))
            if len(self.pending) >= self.room:
                cut = len(self.pending) - len(self.pending) % self.room
                self._emit([self.pending[:cut]])
                self.pending = self.pending[cut:]

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self._emit([self.pending])
                self.pending, self.broken = b"", True

    def _emit(self, lines: list[bytes]) -> None:
        batch, copied = b"", []
        prefix = (time.asctime().encode() if self.stamp else b"") + self.tag  # horovodrun's {time}[RANK]<stream>:
        for line in lines:
            for start in range(0, max(len(line), 1), self.room):
                piece = prefix + line[start:start + self.room] + b"\n"
                if len(batch) + len(piece) > _LINE_MAX:
                    _write_all(self.fd, batch)
                    batch = b""
                batch += piece
                copied.append(line[start:start + self.room] + b"\n")
        _write_all(self.fd, batch)
        if self.copy is not None:
            self.copy.write(b"".join(copied))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # someone made the descriptor non-blocking: wait until it drains
            select.select([], [fd], [])


class _Buffer(io.RawIOBase):
    """The ``.buffer`` of a `_LineStream`: bytes written to it join the same lines."""

    def __init__(self, lines: _LineWriter) -> None:
        super().__init__()
        self._lines = lines

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        self._lines.write(data)
        return len(data)

    def flush(self) -> None:
        self._lines.flush()

    def fileno(self) -> int:
        return self._lines.fd

    def close(self) -> None:
        self.flush()  # the descriptor belongs to the launcher: never close it


class _LineStream(io.TextIOBase):
    """A text stream (sys.stdout or sys.stderr) that writes through a `_LineWriter`."""

    def __init__(self, original: Any, lines: _LineWriter) -> None:
        super().__init__()
        self._original, self._lines = original, lines
        self._encoding = getattr(original, "encoding", None) or "utf-8"
        self._errors = getattr(original, "errors", None) or "strict"
        self.buffer = _Buffer(lines)

    encoding = property(lambda self: self._encoding)  # type: ignore[assignment]
    errors = property(lambda self: self._errors)  # type: ignore[assignment]
    line_buffering = property(lambda self: True)
    name = property(lambda self: getattr(self._original, "name", "<commwire>"))

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._lines.write(text.encode(self._encoding, self._errors))
        return len(text)

    def flush(self) -> None:
        self._lines.flush()

    def fileno(self) -> int:
        return self._lines.fd

    def isatty(self) -> bool:
        return bool(getattr(self._original, "isatty", lambda: False)())

    def reconfigure(self, *, encoding: str | None = None, errors: str | None = None, **_ignored: Any) -> None:
        """Change the encoding or error handler; buffering options have no effect (lines are always whole)."""
        self._encoding, self._errors = encoding or self._encoding, errors or self._errors

    def close(self) -> None:
        self.flush()  # the descriptor belongs to the launcher: never close it


def _copy_file(output_dir: str | None, stream: str) -> BinaryIO | None:
    if output_dir is None:
        return None
    rank, size = env_rank(), launcher_ranks().size
    width = len(str(size - 1)) if size is not None and size > 1 else 1
    folder = os.path.join(output_dir, f"rank.{rank.zfill(width)}")
    os.makedirs(folder, exist_ok=True)
    # Unbuffered: each batch of lines is in the file at once, even if the rank is killed next.
    return open(os.path.join(folder, stream), "wb", buffering=0)  # noqa: SIM115 - open for the rank's life


def _line_writers(tag: bool, output_dir: str | None, stamp: bool = False) -> dict[str, _LineWriter]:
    rank = env_rank()
    return {name: _LineWriter(fd, f"[{rank}]<{name}>:" if tag else "", _copy_file(output_dir, name), stamp)
            for name, fd in (("stdout", 1), ("stderr", 2))}


def _install(writers: dict[str, _LineWriter]) -> None:
    if sys.stdout is None or sys.stderr is None:
        return  # no standard streams (a daemon, pythonw): nothing to keep in lines
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout = _LineStream(sys.stdout, writers["stdout"])
    sys.stderr = _LineStream(sys.stderr, writers["stderr"])


def _exec(argv: list[str], writers: dict[str, _LineWriter]) -> int:
    """Run ``argv`` as a child, pass its output through ``writers``, and return its exit status."""
    # close_fds=False: the child is the MPI process and needs the launcher's PMI descriptor.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=False,
                            preexec_fn=_die_with_parent)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: proc.send_signal(s))
    assert proc.stdout is not None and proc.stderr is not None  # for the type checker: both are pipes
    pipes = {proc.stdout.fileno(): writers["stdout"], proc.stderr.fileno(): writers["stderr"]}
    while pipes:
        ready, _, _ = select.select(list(pipes), [], [])
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                pipes[fd].write(data)
            else:
                pipes.pop(fd).flush()
    status = proc.wait()
    return status if status >= 0 else 128 - status


def _die_with_parent() -> None:
    # Linux: the child gets SIGKILL when this wrapper dies (the launcher may SIGKILL only us).
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(_USAGE)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        if len(argv) < 2:
            raise SystemExit("-c needs a code string")
        sys.argv = ["-c"] + argv[2:]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - this is `python -c`
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


def _options(argv: list[str]) -> tuple[bool, bool, str | None, bool, list[str]]:
    """Split the wrapper's own leading options from the program's command line."""
    tag, stamp, output_dir, i = False, False, None, 0
    while i < len(argv) and argv[i] in ("--tag-output", "--timestamp-output", "--output-dir"):
        if argv[i] == "--tag-output":
            tag, i = True, i + 1
        elif argv[i] == "--timestamp-output":
            stamp, i = True, i + 1
        elif i + 1 < len(argv):
            output_dir, i = argv[i + 1], i + 2
        else:
            raise SystemExit(_USAGE)
    is_exec = i < len(argv) and argv[i] == "--exec"
    return tag, stamp, output_dir, is_exec, argv[i + is_exec:]


def main() -> None:
    """Run the program named on the command line under the abort hook, its output in whole lines."""
    tag, stamp, output_dir, is_exec, argv = _options(sys.argv[1:])
    os.environ.update(torch_variables())  # a script written for torchrun finds its rank where it looks
    record("running")
    start_guardian()  # before MPI and threads: forking is safe now
    writers = _line_writers(tag, output_dir, stamp)
    if is_exec:
        if not argv:
            raise SystemExit(_USAGE)
        status = _exec(argv, writers)
        record("exited" if status == 0 else "failed", f"{argv[0]} exited with status {status}")
        raise SystemExit(status)
    _install(writers)
    install_abort_hook()
    try:
        _run(argv)
    except SystemExit as exc:
        code = exc.code
        if code not in (None, 0):
            if not isinstance(code, int):
                sys.stderr.write(f"{code}\n")
            report_and_abort(f"SystemExit({code!r})\n")
        record("exited")
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must abort the job
        report_and_abort("".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__))))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    record("exited")


def _user_frames(tb):  # type: ignore[no-untyped-def]
    # Drop this wrapper's and runpy's frames so the traceback starts in user code.
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__,)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
