"""The agreement protocol: an error any rank finds is raised on every rank of the collective together.

Every collective validates its arguments without raising, then runs under this
protocol (``AgreementProtocol.run_collective``), so that an error any rank finds —
in its own arguments or in a mismatch with the others' — is raised on every rank
of the collective together, and the next collective pairs up:

* ``check=True``: every call starts with a descriptor exchange
  (commwire.comm.check); the job's ranks learn each other's verdict before any
  data moves. This mode also lets ranks ``join()`` (uneven data: a joined rank
  contributes zeros to the others' all-reduces), as Horovod's negotiation does.
* ``check="first"`` (default): the first call of each (operation, name) runs
  the exchange and remembers the agreed signature. Later calls carry only a
  deviation flag: every rank runs the data movement with the remembered
  signature — a rank whose arguments deviate, or are invalid, moves zeros —
  and the flag travels in the same buffer (all-reduces up to 128 KiB, so the
  latency-bound case costs one message) or in a tiny all-reduce overlapped
  with the data (a transport whose data moves outside MPI tests it while it
  waits: ``Transport.beside``). A raised flag sends every rank to the full exchange: either
  every rank changed its arguments alike (a new shape for the same name; the
  collective is redone) or every rank raises the same error.
* ``check=False``: no agreement; a bad argument raises on its rank only. An
  all-reduce whose arguments match its name's last call on this rank moves
  its data alone (no flag), without the general path's validation.

The protocol runs over MPI (the control plane) whatever transport carries the
data (commwire.comm.transport).

Writing a collective
--------------------
A collective is four pieces handed to ``run_collective``:

1. validate this rank's arguments inside ``try``, keeping the exception
   (``error``) instead of raising it;
2. a ``Signature`` of the call: what every rank must agree on;
3. ``run()``: move this rank's data and return the result;
4. ``dummy(agreed)``: move zeros in the message pattern of the agreed signature
   (a rank whose arguments deviate from the remembered ones does this, so the
   others' data movement completes and the flag tells everyone).

``commwire.codecs.collective.compressed_allreduce`` is written this way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from .check import Round, exchange, exchange_steps, resync
from .handle import Blocked, wait_requests

__all__ = ["Signature", "Agreed", "AgreementProtocol", "JOINABLE", "FUSED_BYTES", "VERIFIED_KEYS"]

FUSED_BYTES = 128 << 10
"""All-reduces up to this many (work-dtype) bytes carry their deviation flag in their own buffer.

Measured on 4 ranks over shared memory: the flag in the buffer (one copy in) costs 1-5 us at 8 B-64 KiB;
the concurrent flag all-reduce costs 15-30 us, lost in the transfer from about 1 MiB on."""
VERIFIED_KEYS = 4096
"""Agreed signatures remembered per communicator (oldest forgotten first: names made per step cost an exchange)."""
JOINABLE = frozenset(("sum", "avg", "min", "max", "prod"))
"""Reductions a rank inside ``join()`` takes part in (with zeros)."""


class Signature(NamedTuple):
    """What every rank of a collective must agree on (None where a field does not apply)."""

    operation: str
    name: Any = None
    shape: Any = None  # the whole shape; the trailing shape for gathers and all-to-all (rows may differ)
    dtype: Any = None  # dtype name
    op: Any = None  # reduction
    root: Any = None
    codec: Any = None  # codec spec and its settings
    device: Any = None  # "cpu" or "cuda": decides the message pattern of some reductions
    counts: Any = None  # reduce-scatter's rows per rank


@dataclass(slots=True)
class Agreed:
    """A signature every rank agreed on, and what the all-reduce fast path needs of it."""

    sig: Signature
    fused: tuple[Any, ...] | None = None  # (n, work dtype, transport op, valid flag, deviating flag, average)
    shape: tuple[int, ...] | None = None  # shape, dtype, op, (transport op, average): the numpy fast path's test
    dtype: np.dtype | None = None
    op: Any = None
    plain: tuple[Any, bool] | None = None
    pad: np.ndarray | None = None  # the fused fast path's buffer (n + 1 elements), and its first n as x's shape
    head: np.ndarray | None = None


class AgreementProtocol:
    """The agreement state of one communicator and the template every collective runs under.

    Subclasses provide ``mpi`` (the control plane's mpi4py communicator), ``size``,
    ``watched(opname, name)`` and ``_agreed_entry(sig)`` (what later calls need of
    an agreed signature).
    """

    mpi: Any
    size: int
    check: bool | str

    def _init_protocol(self, check: bool | str) -> None:
        from mpi4py import MPI

        if check not in (False, True, "first"):
            raise ValueError(f"check={check!r} is not valid; use False, 'first' or True")
        self._MPI = MPI
        self.check = check
        self._agreed: OrderedDict[tuple[Any, ...], Agreed] = OrderedDict()
        # check=False: the signature of each (operation, name)'s last call on this rank alone (never
        # agreed), so that the all-reduce's fast path can skip the general path's validation
        self._known: OrderedDict[tuple[Any, ...], Agreed] = OrderedDict()

    def watched(self, opname: str, name: str | None = None) -> Any:  # pragma: no cover - the communicator's
        raise NotImplementedError

    def _agreed_entry(self, sig: Signature) -> Agreed:  # pragma: no cover - the communicator's
        raise NotImplementedError

    def run_collective(self, sig: Signature, error: BaseException | None, run: Callable[[], Any],
                       dummy: Callable[[Signature], Any],
                       fused: Callable[[Agreed, bool], tuple[Any, bool]] | None = None, *,
                       flag_in_data: bool = False) -> Any:
        """Run one collective under the agreement protocol (see the module docstring) and return ``run()``'s result.

        Args:
            sig: this rank's signature of the call; ``(sig.operation, sig.name)`` keys what is remembered.
            error: the exception this rank's validation found, or None.
            run: moves this rank's data and returns the result.
            dummy: moves zeros shaped by an agreed signature (this rank's arguments deviate).
            fused: optional; moves the data with the flag in the same buffer and returns (result, flagged).
            flag_in_data: ``fused`` works for every agreed signature (a collective whose every rank
                receives every other rank's message, so one byte per message carries the flag);
                otherwise it is used where the agreed entry has a fused plan (small all-reduces).
        """
        check = self.check
        if check is False:
            if error is not None:
                raise error
            return run()
        key = (sig[0], sig[1])
        agreed = self._agreed.get(key) if check == "first" else None
        if agreed is None:
            self._agree(sig, error)
            if check == "first":
                self._remember(key, sig)
            return run()
        deviates = error is not None or sig != agreed.sig
        if fused is not None and (flag_in_data or agreed.fused is not None):
            result, flagged = fused(agreed, deviates)
        else:
            flag = self._flag_start(deviates)
            try:
                with self._flag_beside(flag):
                    result = dummy(agreed.sig) if deviates else run()
            finally:
                flagged = self._flag_wait(flag, sig)
        if not flagged:
            return result
        # Some rank deviated: every rank is here. Either all changed alike (agree, remember, redo)
        # or the exchange raises the same error on every rank. Nobody's buffers were written:
        # deviating ranks moved zeros, and a redo happens only when every rank deviated.
        self._agree(sig, error)
        self._remember(key, sig)
        return run()

    def _agree(self, sig: Signature, error: BaseException | None) -> Round:
        with self.watched("check " + str(sig[0]), sig[1]):
            rnd = exchange(self.mpi, sig, error)
        return self._joinable(sig, rnd)

    def _agree_steps(self, sig: Signature, error: BaseException | None) -> Generator[list[Any], None, Round]:
        """``_agree`` as a generator that yields the exchange's request (``Communicator.allreduce_steps``)."""
        with self.watched("check " + str(sig[0]), sig[1]):
            rnd = yield from exchange_steps(self.mpi, sig, error)
        return self._joinable(sig, rnd)

    def _joinable(self, sig: Signature, rnd: Round) -> Round:
        """Return ``rnd``; raise if ranks inside ``join()`` cannot take part in this collective."""
        if rnd.joined and not (sig[0] == "allreduce" and sig[4] in JOINABLE):
            raise RuntimeError(
                f"{sig[0]} {sig[1]!r}: rank(s) {rnd.joined} of {self.size} have called join() and take part only "
                "in all-reduces (sum, avg, min, max, prod); call this collective before join() on every rank")
        return rnd

    def _remember(self, key: tuple[Any, ...], sig: Signature) -> None:
        # Every rank remembers (and forgets) the same keys in the same order, so they
        # always agree on which calls are first calls.
        self._store(self._agreed, key, sig)

    def _know(self, key: tuple[Any, ...], sig: Signature) -> None:
        """Remember ``sig``, valid on this rank, as ``key``'s last call on a communicator that does not agree."""
        known = self._known.get(key)
        if known is None or known.sig != sig:
            self._store(self._known, key, sig)

    def _store(self, table: OrderedDict[tuple[Any, ...], Agreed], key: tuple[Any, ...], sig: Signature) -> None:
        """Put ``sig``'s entry in ``table`` as its newest, forgetting the oldest past ``VERIFIED_KEYS``."""
        table.pop(key, None)
        if len(table) >= VERIFIED_KEYS:
            table.popitem(last=False)
        table[key] = self._agreed_entry(sig)

    def _flag_start(self, deviates: bool) -> tuple[Any, np.ndarray, np.ndarray]:
        mine = np.array([int(deviates)], dtype=np.int32)
        everyone = np.empty(1, dtype=np.int32)
        return self.mpi.Iallreduce(mine, everyone, self._MPI.MAX), mine, everyone

    def _flag_beside(self, flag: tuple[Any, np.ndarray, np.ndarray]) -> _Beside:
        """Let the transport move the flag's all-reduce on while it waits for the data (``Transport.beside``)."""
        return _Beside(self.transport, flag[0])

    def _flag_wait(self, flag: tuple[Any, np.ndarray, np.ndarray], sig: Signature) -> bool:
        with self.watched("check " + str(sig[0]), sig[1]):
            wait_requests([flag[0]])
        return bool(flag[2][0])

    def resync(self) -> None:
        """Wait here until every rank calls ``resync``; a rank's other collectives meanwhile raise (see check).

        Brings ranks that an earlier failure left at different places of the
        program back in step. Needs ``check=True`` (every collective starts with
        the exchange that tells a rank the others are waiting here).
        """
        if self.check is not True:
            raise RuntimeError("resync() needs a communicator that agrees on every collective: create it with "
                               "check=True (commwire.torch's process sets are)")
        with self.watched("resync"), Blocked():
            resync(self.mpi)


class _Beside:
    """Hand a collective's flag request to its transport for the data move (a class: this is on the fast path)."""

    __slots__ = ("transport", "request")

    def __init__(self, transport: Any, request: Any) -> None:
        self.transport, self.request = transport, request

    def __enter__(self) -> None:
        self.transport.beside = self.request

    def __exit__(self, *exc: Any) -> None:
        self.transport.beside = None
