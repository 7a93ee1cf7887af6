"""Agree on a collective's arguments, so that every rank learns a verdict together.

A rank that calls allreduce on a (3,) float32 array while another passes a
(4,) float64 one makes MPI hang or return garbage, and an error that one rank
finds by itself (an unsupported dtype, an average of integers, a root that is
not a rank) leaves the others waiting in a collective it never joins. So every
rank first validates its own arguments without raising, and the ranks then
exchange a small *descriptor* — a hash of the signature (operation, name,
shape, dtype, reduction, root, codec) and a status (valid, invalid, joined) —
in one Allgather. Only when something differs do they exchange the full
signatures and error messages, and every rank raises the same exception with
each rank's value, so the next collective pairs up as it should.

A failed collective can still leave ranks at different places in the program:
a test whose assertion fails on one rank only sends that rank on to the next
test while the others run the rest of this one. ``resync`` is the way back in
step: a rank that calls it waits there (exchanging a SYNC status) until every
rank has called it, and a rank that meanwhile calls any other collective is told
(the same mismatch error, naming the waiting ranks) instead of pairing its call
with whatever the others do next. ``commwire.torch.init()``, called again on an
initialised job, is such a point (Horovod's tests call it at the start of each).

``Communicator`` decides when to run this exchange (see its ``check``); this
module holds the exchange itself and the messages.
"""

from __future__ import annotations

import zlib
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .handle import wait_yielding

__all__ = ["CollectiveMismatchError", "CollectiveError", "Round", "exchange", "exchange_steps", "resync",
           "signature_hash", "OK", "INVALID", "JOINED", "SYNC"]


class CollectiveMismatchError(ValueError, RuntimeError):
    """Ranks disagree on the operation, shape, dtype, reduction, root or codec of a collective.

    A ``ValueError`` (commwire's arguments are wrong) and a ``RuntimeError``
    (what Horovod raises for the same mistake), so either ``except`` catches it.
    """


class CollectiveError(RuntimeError):
    """A collective failed on some ranks for reasons of different kinds; raised on every rank alike."""


OK, INVALID, JOINED, SYNC = 0, 1, 2, 3
_FIELDS = ("operation", "name", "shape", "dtype", "op", "root", "codec", "device")
_ROW_COLLECTIVES = ("allgather", "alltoall")  # their first dimension may differ between ranks
# Exception types a verdict may carry to the other ranks: builtin or commwire's own,
# so every rank can raise the same type (anything else travels as CollectiveError).
_PORTABLE_MODULES = ("builtins",)


def signature_hash(sig: tuple[Any, ...]) -> int:
    """Return a 63-bit hash of ``sig`` that is the same in every process (``hash()`` is salted)."""
    raw = repr(sig).encode()
    return (zlib.crc32(raw) << 31) ^ zlib.adler32(raw)


@dataclass(slots=True)
class Round:
    """What one exchange established: which ranks have joined, and the agreed signature of the others."""

    joined: list[int] = field(default_factory=list)
    sig: tuple[Any, ...] | None = None
    joined_for: list[int] = field(default_factory=list)

    @property
    def everyone_joined(self) -> bool:
        """Whether every rank is inside ``join()``."""
        return self.sig is None


SPIN = 50e-6
"""Seconds a rank tests the agreement exchange before it starts yielding its core.

Spinning in MPI until the slowest rank arrives takes the core from ranks that share it: with 3
ranks on 2 cores and the torch transport (gloo's threads block, so they lose the core to a
spinning rank), Horovod's ``test_horovod_join_allreduce`` took 7.8 s with a blocking Allgather
and 1.8–3.3 s with yielding tests. An exchange that completes within this many seconds (ranks
that arrive together, each on its own core) costs about what the blocking one did: a small
all-reduce on 2 ranks with a core each took 17.5 µs against 15.5 µs."""


def _allgather(mpi_comm: Any, mine: np.ndarray, everyone: np.ndarray) -> None:
    # Non-blocking on every rank (MPI never matches it with a blocking Allgather), and waited
    # for without spinning: see handle.wait_yielding.
    wait_yielding([mpi_comm.Iallgather(mine, everyone)], spin=SPIN)


def exchange(mpi_comm: Any, sig: tuple[Any, ...] | None, error: BaseException | None, *,
             joined_for: int = -1) -> Round:
    """Exchange descriptors; raise the same error on every active rank if any rank's arguments are bad.

    Args:
        mpi_comm: the mpi4py communicator of the collective.
        sig: this rank's signature (None on a rank inside ``join()``).
        error: the error this rank found in its own arguments, or None.
        joined_for: on a rank inside ``join()``, how many exchanges it has been joined for (else -1).

    Returns:
        The ranks that have joined and the agreed signature (None when every rank has joined).
        A rank inside ``join()`` never raises: it learns of the failure and waits for the next call.
    """
    mine, everyone = _descriptors(mpi_comm, sig, error, joined_for)
    _allgather(mpi_comm, mine, everyone)
    return _round(mpi_comm, sig, error, everyone)


def exchange_steps(mpi_comm: Any, sig: tuple[Any, ...],
                   error: BaseException | None) -> Generator[list[Any], None, Round]:
    """``exchange`` for a rank outside ``join()``, as a generator that yields the request it waits for."""
    mine, everyone = _descriptors(mpi_comm, sig, error, -1)
    yield [mpi_comm.Iallgather(mine, everyone)]
    return _round(mpi_comm, sig, error, everyone)


def _descriptors(mpi_comm: Any, sig: tuple[Any, ...] | None, error: BaseException | None,
                 joined_for: int) -> tuple[np.ndarray, np.ndarray]:
    status = JOINED if sig is None else (INVALID if error is not None else OK)
    mine = np.array([signature_hash(sig) if sig is not None else 0, status, joined_for], dtype=np.int64)
    return mine, np.empty((mpi_comm.Get_size(), 3), dtype=np.int64)


def _round(mpi_comm: Any, sig: tuple[Any, ...] | None, error: BaseException | None, everyone: np.ndarray) -> Round:
    statuses = everyone[:, 1].tolist()
    joined = [r for r, s in enumerate(statuses) if s == JOINED]
    joined_for_all = everyone[:, 2].tolist()
    if len(joined) == len(statuses):
        return Round(joined=joined, sig=None, joined_for=joined_for_all)
    if not _needs_details(everyone):
        if sig is None:  # only joined ranks and ranks waiting in resync: those raise, this one waits on
            return Round(joined=joined, sig=("failed",), joined_for=joined_for_all)
        return Round(joined=[], sig=sig, joined_for=joined_for_all)
    # Something differs: the full signatures and messages travel (rare, so pickling is fine).
    details = mpi_comm.allgather((sig, _portable(error)))
    problem = _verdict(details, mpi_comm.Get_rank(), [r for r, s in enumerate(statuses) if s == SYNC])
    if problem is not None:
        if sig is None:  # inside join(): the active ranks raise, this one waits for their next call
            return Round(joined=joined, sig=("failed",), joined_for=joined_for_all)
        raise problem
    agreed = next(s for s, _ in details if s is not None)
    return Round(joined=joined, sig=agreed, joined_for=joined_for_all)


def resync(mpi_comm: Any) -> None:
    """Wait until every rank of ``mpi_comm`` calls this; other collectives meanwhile raise on their callers.

    Each round is the same Allgather that ``exchange`` starts with, so a rank
    still running other collectives pairs each of them with one round here:
    it raises ``CollectiveMismatchError`` (naming the ranks that wait here)
    and this rank waits on. Raises RuntimeError on the ranks here if every
    other rank is inside ``join()``, which would otherwise wait forever.
    """
    mine = np.array([0, SYNC, -1], dtype=np.int64)
    everyone = np.empty((mpi_comm.Get_size(), 3), dtype=np.int64)
    while True:
        _allgather(mpi_comm, mine, everyone)
        statuses = everyone[:, 1].tolist()
        if all(s == SYNC for s in statuses):
            return
        if _needs_details(everyone):
            mpi_comm.allgather((("resync", None), None))  # the active ranks raise; wait for their next call
        elif OK not in statuses and INVALID not in statuses:
            inside = [r for r, s in enumerate(statuses) if s == JOINED]
            raise RuntimeError(
                f"rank(s) {inside} of {len(statuses)} are inside join() while this rank waits for every rank "
                "in init(); call init() before join() on every rank")


def _needs_details(everyone: np.ndarray) -> bool:
    """Whether a round's descriptors differ so that every rank exchanges full signatures (same verdict on all)."""
    statuses = everyone[:, 1].tolist()
    if OK not in statuses and INVALID not in statuses:
        return False  # only ranks in join() or resync
    return any(s != OK for s in statuses) or len(set(everyone[:, 0].tolist())) > 1


def _portable(error: BaseException | None) -> tuple[type, str] | None:
    if error is None:
        return None
    cls = type(error)
    if cls.__module__ not in _PORTABLE_MODULES and not cls.__module__.startswith("commwire"):
        cls = CollectiveError
    return cls, str(error)


def _verdict(details: list[tuple[Any, Any]], rank: int, waiting: list[int] = ()) -> BaseException | None:
    """Return the exception every active rank raises for these signatures and errors, or None.

    ``waiting`` are the ranks inside ``resync``: the others are behind them, whatever they call.
    """
    size = len(details)
    sigs = [s for s, _ in details]
    where = f"(this is rank {rank} of {size})"
    if waiting:
        calling = [r for r in range(size) if sigs[r] is not None and r not in waiting]
        calls = ", ".join(f"rank {r}: {_label(sigs[r])}" for r in calling)
        return CollectiveMismatchError(
            f"ranks are out of step {where}: rank(s) {list(waiting)} wait in resync (commwire.torch.init() "
            f"called again) for every rank, while the others call collectives -> {calls}\n"
            "the calling ranks are behind (an earlier failure on some ranks only?): each of their collectives "
            "raises this until they reach init() too")
    active = [r for r in range(size) if sigs[r] is not None]
    failed = [(r, details[r][1]) for r in active if details[r][1] is not None]
    label = _label(sigs[active[0]])
    differing = _differences([sigs[r] for r in active], active)
    if failed and not any(line.startswith(("  operation ", "  name ")) for line in differing):
        kinds = {cls for _, (cls, _) in failed}
        cls = kinds.pop() if len(kinds) == 1 else CollectiveError
        lines = [f"{label} failed {where}:"]
        lines += [f"  rank {r}: {message}" for r, (_, message) in failed]
        fine = [r for r in active if details[r][1] is None]
        if fine:
            lines.append(f"  ranks {fine} passed valid arguments; every rank raises this error")
        return _make(cls, "\n".join(lines))
    if differing:
        # Ranks at different collectives (operation or name differ) are out of step: that is the
        # error to report, with any rank's own complaint about its arguments after it.
        return CollectiveMismatchError(
            f"ranks disagree on {label} {where}:\n" + "\n".join(differing)
            + "".join(f"\n  rank {r} also failed: {message}" for r, (_, message) in failed)
            + "\nmake every rank pass the same arguments (and call the same collectives in the same order)")
    return None


def _label(sig: tuple[Any, ...]) -> str:
    op, name = sig[0], sig[1] if len(sig) > 1 else None
    return f"collective {op!r}" + (f" (name {name!r})" if name is not None else "")


def _differences(sigs: list[tuple[Any, ...]], ranks: list[int]) -> list[str]:
    lines = []
    width = max(len(s) for s in sigs)
    for i in range(width):
        values = [s[i] if i < len(s) else None for s in sigs]
        if any(v != values[0] for v in values):
            field_name = _FIELDS[i] if i < len(_FIELDS) else f"argument {i}"
            if i == 2 and sigs[0][0] in _ROW_COLLECTIVES:
                field_name = "trailing shape (all dimensions but the first)"
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
            lines.append(f"  {field_name} differs -> {per_rank}")
    return lines


def _make(cls: type, message: str) -> BaseException:
    try:
        return cls(message)
    except Exception:  # noqa: BLE001 - an exception type that does not take one message
        return CollectiveError(message)
