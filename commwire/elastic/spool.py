"""Where an elastic job keeps what survives a relaunch: the newest commit in each host's memory.

``commwire run`` (elastic) gives the job a directory (COMMWIRE_ELASTIC_DIR, on
``/dev/shm`` where it exists: memory, not disk). On every commit one rank per
host writes the committed state to ``spool/<host>/commit.pkl`` (atomically:
a reader sees the old commit or the new one, never half of one). When the
launcher starts the job again, the rank whose host holds the newest commit
loads it and every rank syncs from it. In data-parallel training every host's
commit is a full replica, so losing a host loses no committed step while one
survives. The driver removes a lost host's folder: a host that died mid-step
never supplies state.

The host is named by ``commwire.comm.rankenv.host_id`` (COMMWIRE_HOST, the
network namespace of a lab host, or the hostname).
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from .. import _config
from ..comm.rankenv import host_id

__all__ = ["host_id", "elastic_dir", "host_dir", "write", "newest", "SpoolError"]

_FILE = "commit.pkl"


class SpoolError(RuntimeError):
    """The committed state cannot be written to (or read from) the host's memory."""


def elastic_dir() -> str | None:
    """Return the job's elastic directory (COMMWIRE_ELASTIC_DIR), or None outside an elastic launch."""
    return _config.env_str("COMMWIRE_ELASTIC_DIR") or None


def host_dir(root: str, host: str) -> str:
    """Return the folder that holds ``host``'s commits under the job's elastic directory ``root``."""
    return os.path.join(root, "spool", host.replace(os.sep, "_"))


def write(commit_id: int, payload: Any) -> None:
    """Write ``payload`` as commit ``commit_id`` of this host (atomically); no-op outside an elastic launch.

    Raises:
        SpoolError: the payload cannot be pickled (naming the part that cannot) or the folder
            cannot be written.
    """
    root = elastic_dir()
    if root is None:
        return
    try:
        data = pickle.dumps({"commit": int(commit_id), "payload": payload}, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise SpoolError(f"the committed state cannot be kept for a relaunch: {exc}; keep only picklable "
                         "objects (tensors, numbers, lists, dicts, state_dicts) in the elastic State, or "
                         "rebuild the others in a reset callback") from exc
    folder = host_dir(root, host_id())
    path = os.path.join(folder, _FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        raise SpoolError(f"cannot write the committed state to {path!r} ({exc.strerror}); give the job a "
                         "writable COMMWIRE_ELASTIC_DIR with room for one copy of the state per host") from exc


def newest() -> tuple[int, Any] | None:
    """Return (commit id, payload) of the commit this host holds, or None (none, or outside an elastic launch)."""
    root = elastic_dir()
    if root is None:
        return None
    path = os.path.join(host_dir(root, host_id()), _FILE)
    try:
        with open(path, "rb") as fh:
            entry = pickle.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, pickle.UnpicklingError, EOFError) as exc:
        raise SpoolError(f"the commit kept in {path!r} cannot be read ({exc}); remove the file to start from "
                         "the other hosts' commits") from exc
    return int(entry["commit"]), entry["payload"]
