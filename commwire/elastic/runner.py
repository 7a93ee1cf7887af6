"""``run``: call the training function again after a lost peer or a change of hosts.

The launcher (``commwire run`` in elastic mode, commwire.elastic.driver) tells
the ranks how the world is re-formed through COMMWIRE_ELASTIC:

* ``ulfm``: a lost peer is re-formed in process (commwire.elastic.world: revoke,
  shrink); the function is called again on the survivors;
* ``relaunch``: every rank leaves with ``RESTART_EXIT_CODE`` and the launcher
  starts the job again on the hosts now available; the committed state comes
  back from the hosts' memory (commwire.elastic.spool).

A change of hosts (``HostsUpdatedInterrupt``) is a relaunch in both modes, after
the current state is committed: nothing is rolled back.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
from typing import Any, Callable

from .. import _config
from .errors import HostsUpdatedInterrupt, is_peer_loss

__all__ = ["run", "run_fn", "mode", "RESTART_EXIT_CODE", "launch_version", "read_notice", "check_inside_run"]

RESTART_EXIT_CODE = 75
"""The exit status with which every rank of a relaunch-mode job leaves to be started again (EX_TEMPFAIL)."""
MODES = ("ulfm", "relaunch")

_inside = threading.local()


def mode() -> str | None:
    """Return how this job re-forms its world: "ulfm", "relaunch", or None outside an elastic launch."""
    value = _config.env_str("COMMWIRE_ELASTIC")
    if not value:
        return None
    if value not in MODES:
        raise ValueError(f"COMMWIRE_ELASTIC={value!r} is not valid; use one of {', '.join(MODES)} (set by "
                         "commwire run's elastic options; unset it to run without a driver)")
    return value


def launch_version() -> int:
    """Return the host-update version the job was launched at (COMMWIRE_ELASTIC_VERSION; 0 if unset)."""
    return _config.env_int("COMMWIRE_ELASTIC_VERSION", 0)


def read_notice() -> tuple[int, bool]:
    """Return (version, removed_only) of the driver's latest host notice (the launch version if none)."""
    folder = _config.env_str("COMMWIRE_ELASTIC_DIR")
    if not folder:
        return launch_version(), False
    try:
        with open(os.path.join(folder, "hosts.json"), encoding="utf-8") as fh:
            notice = json.load(fh)
        return int(notice["version"]), bool(notice.get("removed_only", False))
    except (OSError, ValueError, KeyError, TypeError):
        return launch_version(), False


def check_inside_run(what: str) -> None:
    """Raise RuntimeError if ``what`` is called outside ``run`` under an elastic launch."""
    if mode() is not None and not getattr(_inside, "depth", 0):
        raise RuntimeError(f"{what} was called outside a function decorated with elastic.run; under an elastic "
                           "launch a commit may raise HostsUpdatedInterrupt, which only run() handles: call it "
                           "from inside the decorated training function")


def _reset_core() -> None:
    """Nothing to rebuild above the world (the numpy/GLM case): commwire.comm re-formed it already."""


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function ``func(state, *args, **kwargs)`` so it survives lost and added hosts.

    Before the first call, and after every reset, the state is synchronised from the
    rank with the newest commit. A collective that fails because a peer was lost
    restores the last commit, re-forms the world and calls ``func`` again; a
    ``HostsUpdatedInterrupt`` re-forms without rolling back. Do not call collectives
    outside ``func`` in an elastic job (a relaunched process would meet them while the
    others sync).
    """
    return run_fn(func, _reset_core)


def run_fn(func: Callable[..., Any], reset: Callable[[], Any]) -> Callable[..., Any]:
    """``run`` with ``reset()`` called after the world is re-formed (the framework's rebuild)."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        _check_mode()
        _inside.depth = getattr(_inside, "depth", 0) + 1
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    if mode() is not None:
                        _leave_for_relaunch(state, commit=True)
                    skip_sync = exc.skip_sync
                except Exception as exc:  # noqa: BLE001 - only a lost peer is handled; the rest re-raise
                    if mode() is None or not is_peer_loss(exc):
                        raise
                    state.restore()
                    if mode() == "relaunch":
                        _leave_for_relaunch(state, commit=False)
                    from . import world

                    world.reform(exc)
                    skip_sync = False
                reset()
                state.on_reset()
        finally:
            _inside.depth -= 1

    return wrapper


def _check_mode() -> None:
    """Refuse (on every rank alike: the settings are the job's) a mode this job cannot re-form in."""
    if mode() != "ulfm":
        return
    from ..comm import runtime

    if runtime.is_initialized() and runtime.transport() == "torch":
        raise ValueError("--elastic-mode ulfm re-forms MPI communicators in process, but this job moves its data "
                         "over torch.distributed (COMMWIRE_TRANSPORT=torch), whose groups cannot shrink; use "
                         "--elastic-mode relaunch, or the mpi transport")


def _leave_for_relaunch(state: Any, *, commit: bool) -> None:
    """Keep the state in the host's memory and leave with RESTART_EXIT_CODE (every rank does, together)."""
    from ..comm.ranklog import record

    if commit:  # a host update: what the ranks hold now is where the relaunched job goes on from
        state._save_commit()
    record("restart", "elastic: leaving for the launcher to re-form the job")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(RESTART_EXIT_CODE)
