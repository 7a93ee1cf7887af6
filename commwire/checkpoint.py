"""Save and restore all commwire state of a job in one call, consistently across ranks.

Each rank writes one file, ``{path}.rank{R}``, holding the ``state_dict()`` of
every object you pass (DistributedOptimizer — with codec residuals and GIFT
factors —, LoRDO / DiLoCo, FusionBuffer, codecs, models) plus the state of the
codecs commwire shares for string specs (``cw.allreduce(..., codec="ef+fp8")``).
Files are written atomically and stamped with one checkpoint id drawn on rank
0; ``load`` refuses files from different checkpoints, world sizes or object
sets, on every rank alike, so a job never resumes half from one save and half
from another.

Example:
    >>> cw.checkpoint.save("ckpt/step1000", {"model": model, "opt": opt})
    >>> cw.checkpoint.load("ckpt/step1000", {"model": model, "opt": opt})
"""

from __future__ import annotations

import os
import pickle
import uuid
from typing import Any

from .comm.runtime import world

__all__ = ["save", "load", "rank_path"]

_VERSION = 1


def rank_path(path: str, rank: int) -> str:
    """Return the file of ``rank`` for checkpoint ``path``."""
    return f"{os.fspath(path)}.rank{rank}"


def _shared_codecs() -> dict[str, Any]:
    from .codecs.collective import _codec_cache

    return dict(_codec_cache)


def save(path: str, objects: dict[str, Any], *, comm: Any = None) -> str:
    """Write every object's ``state_dict()`` (and commwire's shared codec state); return the checkpoint id.

    Collective: every rank calls it with the same object names.
    """
    comm = comm if comm is not None else world()
    missing = [name for name, obj in objects.items() if not hasattr(obj, "state_dict")]
    if missing:
        raise TypeError(f"objects {missing} have no state_dict(); pass models, optimizers, codecs or buffers")
    names = sorted(objects)
    everyone = comm.allgather_object(names)
    if any(n != names for n in everyone):
        raise ValueError(f"ranks pass different objects to save(): {everyone}; pass the same names everywhere")
    ckpt_id = comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None, 0)
    payload = {
        "version": _VERSION,
        "id": ckpt_id,
        "rank": comm.rank,
        "size": comm.size,
        "objects": {name: objects[name].state_dict() for name in names},
        "codecs": {spec: codec.state_dict() for spec, codec in _shared_codecs().items()},
    }
    target = rank_path(path, comm.rank)
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, target)
    comm.barrier()  # the checkpoint exists only once every rank has written its part
    return ckpt_id


def load(path: str, objects: dict[str, Any], *, comm: Any = None) -> str:
    """Restore what :func:`save` wrote into ``objects`` (same names); return the checkpoint id.

    Collective. Raises on every rank if any rank's file is missing, from
    another checkpoint, or was written by a job of another size.
    """
    comm = comm if comm is not None else world()
    target = rank_path(path, comm.rank)
    payload: dict[str, Any] | None = None
    problem = ""
    try:
        with open(target, "rb") as fh:
            payload = pickle.load(fh)
        if payload.get("version") != _VERSION:
            problem = f"{target} has format version {payload.get('version')!r}, expected {_VERSION}"
        elif payload["size"] != comm.size or payload["rank"] != comm.rank:
            problem = (f"{target} was written by rank {payload['rank']} of {payload['size']}; this is rank "
                       f"{comm.rank} of {comm.size}: resume with the same number of ranks")
        elif sorted(payload["objects"]) != sorted(objects):
            problem = f"{target} holds objects {sorted(payload['objects'])}, load() was given {sorted(objects)}"
    except (OSError, pickle.UnpicklingError, EOFError, KeyError) as exc:
        problem = f"cannot read {target}: {exc}"
    reports = comm.allgather_object((problem, payload["id"] if payload and not problem else None))
    errors = [f"rank {r}: {p}" for r, (p, _) in enumerate(reports) if p]
    ids = {i for _, i in reports}
    if errors or len(ids) != 1:
        detail = "; ".join(errors) if errors else f"files come from different checkpoints {sorted(map(str, ids))}"
        raise ValueError(f"cannot resume from {path!r}: {detail}")
    objects_state = payload["objects"] if payload is not None else {}
    for name, obj in objects.items():
        obj.load_state_dict(objects_state[name])
    shared = _shared_codecs()
    for spec, state in (payload or {}).get("codecs", {}).items():
        if spec not in shared:
            from .codecs.collective import resolve_codec

            shared[spec] = resolve_codec(spec)
        shared[spec].load_state_dict(state)
    return str(payload["id"])
