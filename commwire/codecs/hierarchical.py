"""Hierarchical compressed all-reduce: lossless inside each node, the codec only across nodes.

A flat compressed all-reduce quantises every rank's tensor and sends most of
the payloads to ranks on other nodes, although ranks that share a node have
far faster links between them (NVLink, shared memory) than the network. This
one splits the reduction in three steps (ZeRO++'s qgZ and Horovod's
hierarchical all-reduce have the same shape):

1. a reduce-scatter in FP32 among the ranks of a node: local rank j ends with
   block j of the node's sum (blocks fall on whole quantisation blocks);
2. a compressed all-reduce of block j among the local ranks j of all nodes
   (one rank per node): the only step whose bytes cross the network, with
   ``1/L`` of the tensor per rank for ``L`` ranks per node;
3. an all-gather in FP32 among the ranks of a node.

Off-node bytes drop by the factor ``L`` against the flat scheme (each node
sends the same compressed bytes as one rank of a flat all-reduce over the
nodes), and the codec quantises ``N`` node sums instead of ``N * L`` rank
tensors. On one node no byte is quantised at all; with one rank per node the
flat scheme runs.

The groups are the ranks on one host (``commwire.comm.rankenv.host_id``: the
host name, or the emulated lab's network namespace), or blocks of a given
number of consecutive ranks; every group must hold as many ranks.
A compressed all-reduce takes the hierarchy from its ``hierarchical=``
argument, else from the process default (``COMMWIRE_HIERARCHICAL``, or
``HOROVOD_HIERARCHICAL_ALLREDUCE`` at ``hvd.init()``). The choice is part of
the call's signature, so the whole reduction runs under the communicator's
agreement protocol: ranks that disagree on it, or an error any rank finds,
raise on every rank. This module holds the settings and the two levels; the
reduction itself is ``commwire.codecs.collective``'s.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _config
from ..comm.communicator import Communicator
from ..comm.rankenv import host_id

__all__ = ["Levels", "levels_of", "hierarchy_setting", "set_default_hierarchy", "blocks"]


@dataclass(frozen=True)
class Levels:
    """The two levels of a communicator, seen from one rank."""

    inner: Communicator  # the ranks of this rank's node (or group), ordered by rank
    cross: Communicator  # one rank per node: those of this rank's local rank, ordered by node
    groups: int  # number of nodes (groups)
    per_group: int  # ranks per node (group)


# Per communicator: its Levels, or the ValueError its layout raised, per hierarchy.
_levels: weakref.WeakKeyDictionary[Communicator, dict[Any, Levels | ValueError]] = weakref.WeakKeyDictionary()
_levels_lock = threading.Lock()
_default: list[Any] = []  # the process-wide setting once resolved (set_default_hierarchy or COMMWIRE_HIERARCHICAL)
_warned: weakref.WeakSet[Communicator] = weakref.WeakSet()
_HELP = "use True or 'node' (the ranks on one host), a number of consecutive ranks per group >= 2, or False"


def _parse(value: Any, what: str) -> int | str | None:
    """Return None (flat), ``"node"`` or a group size >= 2 for a hierarchy setting."""
    if value is None or value is False:
        return None
    if value is True:
        return "node"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "false", "no", "off"):
            return None
        if text in ("1", "true", "yes", "on", "node"):
            return "node"
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{what}={value!r} is not valid; {_HELP}") from None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (value >= 2 or value == 0):
        return int(value) or None
    raise ValueError(f"{what}={value!r} is not valid; {_HELP}")


def set_default_hierarchy(value: Any) -> None:
    """Set how compressed all-reduces that pass ``hierarchical=None`` run: True/"node", a group size, False
    (flat), or None (``COMMWIRE_HIERARCHICAL`` again)."""
    _default[:] = [] if value is None else [_parse(value, "hierarchical")]


def hierarchy_setting(hierarchical: Any = None) -> tuple[int | str, bool] | None:
    """Return (the hierarchy, whether the caller chose it) for a compressed all-reduce, or None for flat.

    ``hierarchical=None`` takes the process default: ``set_default_hierarchy`` (``hvd.init()`` with
    ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``), else ``COMMWIRE_HIERARCHICAL``, else flat.
    """
    if hierarchical is not None:
        group = _parse(hierarchical, "hierarchical")
        return None if group is None else (group, True)
    if not _default:
        _default.append(_parse(_config.env_str("COMMWIRE_HIERARCHICAL"), "COMMWIRE_HIERARCHICAL"))
    return None if _default[0] is None else (_default[0], False)


def levels_of(comm: Communicator, group: int | str, explicit: bool = True) -> Levels | None:
    """Return the two levels of ``comm`` for ``group``, or None where the flat all-reduce runs.

    Collective over ``comm`` on its first call per group (every rank must call it with the same
    group; a compressed all-reduce's agreement sees to that). None when every group holds one
    rank. A layout that cannot be split evenly raises the same ValueError on every rank when
    ``explicit``; otherwise it warns once per communicator and returns None (flat).
    """
    with _levels_lock:
        found = _levels.get(comm, {}).get(group)
    if found is None:
        found = _make_levels(comm, group)
        with _levels_lock:
            _levels.setdefault(comm, {})[group] = found
    if isinstance(found, ValueError):
        if explicit:
            raise ValueError(str(found))
        if comm not in _warned:
            _warned.add(comm)
            warnings.warn(f"COMMWIRE_HIERARCHICAL: compressed all-reduces over this communicator run flat: {found}",
                          stacklevel=5)
        return None
    return found if found.per_group > 1 else None


def _make_levels(comm: Communicator, group: int | str) -> Levels | ValueError:
    mpi = comm.mpi
    even = isinstance(group, int) and comm.size % group == 0
    if group == "node":
        hosts = mpi.allgather(host_id())
        node_mpi = mpi.Split(sorted(set(hosts)).index(hosts[comm.rank]), comm.rank)
    else:
        node_mpi = mpi.Split(comm.rank // group if even else 0, comm.rank)
    per = node_mpi.Get_size()
    sizes = sorted(set(mpi.allgather(per)))
    problem = None
    if isinstance(group, int) and not even:
        problem = (f"hierarchical={group} does not divide the {comm.size} ranks into equal groups; pass a divisor "
                   f"of {comm.size}, 'node', or False for the flat all-reduce")
    elif len(sizes) > 1:
        problem = (f"the nodes hold different numbers of ranks ({sizes}); a hierarchical all-reduce needs the same "
                   "number on every node: launch as many ranks per node, pass hierarchical=<ranks per group>, "
                   "or hierarchical=False")
    if problem is not None:
        node_mpi.Free()
        return ValueError(f"hierarchical all-reduce over {comm.size} ranks: {problem}")
    cross_mpi = mpi.Split(node_mpi.Get_rank(), comm.rank)
    # The compressed all-reduce's agreement on the parent covers every step: no checks of their own.
    inner, cross = comm.derive(node_mpi, check=False), comm.derive(cross_mpi, check=False)
    # A lane's levels wait as the lane does, yielding the CPU (the caller's computation goes on beside).
    inner.transport.lane = cross.transport.lane = comm.transport.lane
    return Levels(inner, cross, comm.size // per, per)


def blocks(n: int, parts: int, align: int) -> np.ndarray:
    """Split ``n`` elements into ``parts`` blocks of whole ``align``-element units (the first ones larger)."""
    units = -(-n // align)
    base, extra = divmod(units, parts)
    counts = np.array([(base + (i < extra)) * align for i in range(parts)], dtype=np.int64)
    over = int(counts.sum()) - n  # the last non-empty block holds the partial unit
    for i in range(parts - 1, -1, -1):
        if counts[i]:
            counts[i] -= over
            break
    return counts
