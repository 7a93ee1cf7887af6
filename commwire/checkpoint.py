"""Save and restore all commwire state of a job in one call, consistently across ranks.

Each rank writes one file, ``{path}.rank{R}``, holding the ``state_dict()`` of
every object you pass (DistributedOptimizer — with codec residuals and GIFT
factors —, LoRDO / DiLoCo, FusionBuffer, codecs, models) plus the state of the
codecs commwire shares for string specs (``cw.allreduce(..., codec="ef+fp8")``).
Files are written atomically and stamped with one checkpoint id drawn on rank
0; ``load`` refuses files from different checkpoints, world sizes or object
sets, on every rank alike, so a job never resumes half from one save and half
from another.

File format 2 holds no pickle, so loading a file can never run code::

    magic   8 bytes   b"\\x89CWCKPT\\n"
    length  8 bytes   little-endian uint64: bytes of the JSON header
    crc     4 bytes   little-endian uint32: CRC-32 of the JSON header
    header  JSON      id, rank, size, object names, the state tree, the table of
                      arrays (kind, dtype, shape, bytes) and the CRC-32 of the data
    data              the raw bytes of every array, back to back in table order

In the state tree every JSON object is a tagged node, so what JSON cannot say
comes back exactly: tuples, dicts as key/value pairs (int and tuple keys,
insertion order, ``OrderedDict`` with torch's ``_metadata``), non-finite floats,
numpy scalars, and numpy arrays vs torch tensors (``{"$": "tensor", "a": 3}``
is row 3 of the array table). Arrays keep their exact dtype (bfloat16 and
float8 in torch and ml_dtypes alike) and come back C-contiguous; tensors come
back on the CPU (``load_state_dict`` moves them to the parameters' device).

``load`` reads and checks its whole file on every rank first (magic, CRCs,
sizes of every array, id, rank, world size, object names), then the ranks
exchange verdicts: if any file is bad, every rank raises the same ValueError
naming each bad file, and no state is touched.

Example:
    >>> cw.checkpoint.save("ckpt/step1000", {"model": model, "opt": opt})
    >>> cw.checkpoint.load("ckpt/step1000", {"model": model, "opt": opt})
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
import uuid
import zlib
from collections import OrderedDict
from typing import Any, BinaryIO

import numpy as np

from .comm.runtime import default_comm

__all__ = ["save", "load", "rank_path", "convert_pickle_checkpoint"]

_VERSION = 2  # format 1 was a pickle per rank (refused; see convert_pickle_checkpoint)
_FORMAT = "commwire-checkpoint"
_MAGIC = b"\x89CWCKPT\n"  # a non-ASCII first byte and a newline, as in PNG: text-mode copies show up
_PREFIX = struct.Struct("<8sQI")  # magic, header length, header CRC-32
_MAX_DEPTH = 200
_MAX_NDIM = 64
_NUMPY_DTYPE = re.compile(r"[<>|=][biufc]\d{1,2}")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_FIELDS = {"format": str, "version": int, "id": str, "rank": int, "size": int, "names": list,
           "arrays": list, "data_nbytes": int, "data_crc32": int, "state": dict}
_DAMAGED = "the file is damaged or its save was interrupted: resume from another checkpoint"


class _Refused(ValueError):
    """A problem found in one rank's file; its message names the file, the problem and the fix."""


def rank_path(path: str, rank: int) -> str:
    """Return the file of ``rank`` for checkpoint ``path``."""
    return f"{os.fspath(path)}.rank{rank}"


def _shared_codecs() -> dict[str, Any]:
    from .codecs.collective import shared_codecs

    return shared_codecs()


# ----------------------------------------------------------------------------- public API
def save(path: str, objects: dict[str, Any], *, comm: Any = None) -> str:
    """Write every object's ``state_dict()`` (and commwire's shared codec state); return the checkpoint id.

    Collective: every rank calls it with the same object names. A problem on
    any rank (a value that cannot be stored, a full disk) raises on every rank
    and leaves the previous files at ``path`` in place.
    """
    comm = default_comm(comm)
    names = sorted(objects)
    lacking = sorted(n for n, obj in objects.items() if not hasattr(obj, "state_dict"))
    everyone = comm.allgather_object((names, lacking))
    _check_save_objects(everyone)
    ckpt_id = comm.broadcast_object(uuid.uuid4().hex if comm.rank == 0 else None, 0)
    target = rank_path(path, comm.rank)
    tmp = f"{target}.tmp{os.getpid()}"
    problem = _attempt(lambda: _write_rank_file(tmp, _payload(ckpt_id, comm, names, objects)))
    failures = _failures(comm.allgather_object(problem))
    if failures:
        _remove_quietly(tmp)
        raise _combined(failures, f"cannot save checkpoint {os.fspath(path)!r} (the files already there "
                                  "are unchanged)")
    os.replace(tmp, target)  # only now that every rank holds a complete temporary file
    comm.barrier()  # the checkpoint exists only once every rank has written its part
    return str(ckpt_id)


def load(path: str, objects: dict[str, Any], *, comm: Any = None) -> str:
    """Restore what :func:`save` wrote into ``objects`` (same names); return the checkpoint id.

    Collective. Every rank checks its whole file first; if any rank's file is
    missing, damaged, not a commwire checkpoint, from another checkpoint or
    written by a job of another size, every rank raises the same ValueError
    and no state is changed.
    """
    comm = default_comm(comm)
    names = sorted(objects)
    found: dict[str, Any] = {}
    problem = _attempt(lambda: found.update(_read_rank_file(path, comm.rank, comm.size, names)))
    reports = comm.allgather_object((problem, found.get("id")))
    failures = _failures([p for p, _ in reports])
    headline = f"cannot resume from checkpoint {os.fspath(path)!r}; no state was loaded on any rank"
    if failures:
        raise _combined(failures, headline, cls=ValueError)
    ids = [i for _, i in reports]
    if len(set(ids)) != 1:
        owners = ", ".join(f"rank {r}: id {i}" for r, i in enumerate(ids))
        raise ValueError(f"{headline}: the files come from different checkpoints ({owners}); a save was "
                         "interrupted or files of several saves were mixed: use the files of one save")
    _apply(found, objects)
    return str(found["id"])


def convert_pickle_checkpoint(path: str, *, trust: bool = False) -> str:
    """Rewrite a format-1 (pickle) checkpoint in the current format, in place; return its id.

    Unpickling runs whatever code a file names, so only convert files you
    wrote yourself, and say so with ``trust=True``. Not collective: run it
    once, in one process, before resuming (``load`` refuses pickle files).

    Example:
        >>> cw.checkpoint.convert_pickle_checkpoint("ckpt/step1000", trust=True)
    """
    if trust is not True:
        raise ValueError("convert_pickle_checkpoint unpickles the files, which runs any code they name; "
                         "pass trust=True only for checkpoints you wrote yourself")
    import pickle

    first = _unpickle_legacy(pickle, rank_path(path, 0))
    payloads = [first] + [_unpickle_legacy(pickle, rank_path(path, r)) for r in range(1, int(first["size"]))]
    for rank, payload in enumerate(payloads):
        if payload["id"] != first["id"] or payload["rank"] != rank or payload["size"] != first["size"]:
            raise ValueError(f"{rank_path(path, rank)} is rank {payload['rank']} of {payload['size']} of checkpoint "
                             f"{payload['id']}, expected rank {rank} of {first['size']} of {first['id']}")
    for rank, payload in enumerate(payloads):
        target = rank_path(path, rank)
        tmp = f"{target}.tmp{os.getpid()}"
        state = {"objects": payload["objects"], "codecs": payload.get("codecs", {})}
        _write_rank_file(tmp, _encode_file(str(first["id"]), rank, len(payloads), sorted(payload["objects"]),
                                             state))
        os.replace(tmp, target)
    return str(first["id"])


# ----------------------------------------------------------------------------- agreeing across ranks
def _attempt(work: Any) -> tuple[str, str] | None:
    """Run ``work()``; return None, or (kind of problem, message) of what it raised."""
    try:
        work()
    # Any failure must reach the other ranks, or they would wait forever in the
    # next collective: nothing is re-raised here, the verdicts are exchanged.
    except _Refused as exc:
        return ("ValueError", str(exc))
    except Exception as exc:
        kind = next((c.__name__ for c in (TypeError, OSError) if isinstance(exc, c)), "ValueError")
        return (kind, f"{type(exc).__name__}: {exc}")
    return None


def _failures(verdicts: list[tuple[str, str] | None]) -> list[tuple[int, str, str]]:
    """Return (rank, exception type, message) of every rank that failed."""
    return [(rank, v[0], v[1]) for rank, v in enumerate(verdicts) if v is not None]


def _combined(failures: list[tuple[int, str, str]], headline: str, cls: type | None = None) -> Exception:
    """Return one exception naming every failing rank (the same on every rank)."""
    if cls is None:  # the lowest failing rank's kind of problem
        cls = {"TypeError": TypeError, "OSError": OSError}.get(failures[0][1], ValueError)
    detail = "; ".join(f"rank {rank}: {message}" for rank, _, message in failures)
    return cls(f"{headline}: {detail}")


def _check_save_objects(everyone: list[tuple[list[str], list[str]]]) -> None:
    """Raise (on every rank alike) unless every rank passes the same names, all with state_dict()."""
    names = everyone[0][0]
    if any(n != names for n, _ in everyone):
        raise ValueError(f"ranks pass different objects to save(): {[n for n, _ in everyone]}; "
                         "pass the same names everywhere")
    lacking = sorted({name for _, missing in everyone for name in missing})
    if lacking:
        raise TypeError(f"objects {lacking} have no state_dict(); pass models, optimizers, codecs or buffers")


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


# ----------------------------------------------------------------------------- saving
def _payload(ckpt_id: str, comm: Any, names: list[str], objects: dict[str, Any]) -> list[Any]:
    """Collect this rank's state and return the buffers of its file."""
    state = {"objects": {name: objects[name].state_dict() for name in names},
             "codecs": {spec: codec.state_dict() for spec, codec in _shared_codecs().items()}}
    return _encode_file(ckpt_id, comm.rank, comm.size, names, state)


def _encode_file(ckpt_id: str, rank: int, size: int, names: list[str], state: dict[str, Any]) -> list[Any]:
    """Return the buffers of a whole file: prefix and JSON header, then the bytes of every array."""
    packer = _Packer()
    tree = packer.node(state, "state")
    crc = 0
    for blob in packer.blobs:
        crc = zlib.crc32(blob, crc)
    header = {"format": _FORMAT, "version": _VERSION, "id": ckpt_id, "rank": rank, "size": size,
              "names": names, "arrays": packer.table, "data_nbytes": sum(b.nbytes for b in packer.blobs),
              "data_crc32": crc, "state": tree}
    text = json.dumps(header, allow_nan=False, separators=(",", ":")).encode("utf-8")
    return [_PREFIX.pack(_MAGIC, len(text), zlib.crc32(text)) + text, *packer.blobs]


def _write_rank_file(tmp: str, buffers: list[Any]) -> None:
    """Write ``buffers`` to ``tmp`` and flush it to disk (the caller renames it into place)."""
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
    with open(tmp, "wb") as fh:
        for buffer in buffers:  # arrays go out as views of their memory, without a copy
            fh.write(buffer)
        fh.flush()
        os.fsync(fh.fileno())  # a rename after a power loss must not expose an empty file


class _Packer:
    """Turn a state tree into JSON nodes plus a table of raw array bytes."""

    def __init__(self) -> None:
        self.table: list[dict[str, Any]] = []
        self.blobs: list[np.ndarray] = []  # flat uint8 views, in table order

    def node(self, value: Any, where: str) -> Any:
        """Return the JSON node of ``value`` (``where`` names it in errors)."""
        kind = type(value)
        if value is None or kind in (str, int, bool):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$": "float", "v": repr(value)}
        if kind is list:
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if kind is tuple:
            return {"$": "tuple", "items": [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if kind is dict or kind is OrderedDict:
            return self._mapping(value, where)
        if isinstance(value, np.ndarray):
            return self._array("ndarray", "numpy", *_numpy_bytes(value, where))
        if isinstance(value, np.generic):
            return self._array("npscalar", "numpy", *_numpy_bytes(np.asarray(value), where))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            return self._array("tensor", "torch", *_torch_bytes(value, where))
        raise TypeError(f"cannot save {kind.__module__}.{kind.__qualname__} at {where}: checkpoints hold dicts, "
                        "lists, tuples, str, int, float, bool, None, numpy arrays and scalars and torch tensors; "
                        "return one of those from its state_dict()")

    def _mapping(self, value: dict[Any, Any], where: str) -> dict[str, Any]:
        items = [[self.node(k, f"{where} key {k!r}"), self.node(v, f"{where}[{k!r}]")] for k, v in value.items()]
        if type(value) is dict:
            return {"$": "dict", "items": items}
        node: dict[str, Any] = {"$": "odict", "items": items}
        meta = getattr(value, "_metadata", None)  # torch's module versions, read by load_state_dict
        if meta is not None:
            node["meta"] = self.node(meta, f"{where}._metadata")
        return node

    def _array(self, tag: str, kind: str, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> dict[str, Any]:
        self.table.append({"kind": kind, "dtype": dtype, "shape": [int(d) for d in shape], "nbytes": int(raw.nbytes)})
        self.blobs.append(raw)
        return {"$": tag, "a": len(self.table) - 1}


def _numpy_bytes(value: np.ndarray, where: str) -> tuple[str, tuple[int, ...], np.ndarray]:
    """Return (dtype name, shape, flat uint8 view of a C-contiguous copy) of a numpy array."""
    a = np.array(value, order="C", copy=None)  # ascontiguousarray would make 0-d arrays 1-d
    if a.dtype.type.__module__ == "ml_dtypes":
        name = f"ml_dtypes:{a.dtype.name}"
    elif _NUMPY_DTYPE.fullmatch(a.dtype.str):
        name = a.dtype.str
    else:
        raise TypeError(f"cannot save the {a.dtype} array at {where}: only bool, integer, float and complex "
                        "arrays (and ml_dtypes formats) are stored; convert it in state_dict()")
    return name, a.shape, a.reshape(-1).view(np.uint8)


def _torch_bytes(value: Any, where: str) -> tuple[str, tuple[int, ...], np.ndarray]:
    """Return (dtype name, shape, flat uint8 view of a contiguous CPU copy) of a torch tensor."""
    import torch

    if value.layout != torch.strided or value.is_quantized:
        raise TypeError(f"cannot save the {value.layout} tensor at {where}: only dense tensors are stored; "
                        "convert it with .to_dense() / .dequantize() in state_dict()")
    t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


# ----------------------------------------------------------------------------- loading
def _read_rank_file(path: str, rank: int, size: int, names: list[str]) -> dict[str, Any]:
    """Read and check this rank's whole file; return {"id", "state"} or raise naming the problem."""
    target = rank_path(path, rank)
    try:
        with open(target, "rb") as fh:
            header, arrays = _read_file(fh, target, path)
    except FileNotFoundError:
        raise _Refused(f"{target} does not exist: check the path (without the .rankN suffix) and that "
                       "every rank sees the checkpoint directory") from None
    except OSError as exc:
        raise _Refused(f"cannot read {target}: {exc}") from None
    except _Refused:
        raise
    except Exception as exc:  # anything a damaged file can make a parser raise
        raise _Refused(f"{target} is damaged ({type(exc).__name__}: {exc}): {_DAMAGED}") from exc
    _check_identity(header, target, rank, size, names)
    try:
        state = _Unpacker(arrays, header["arrays"]).value(header["state"], "state", 0)
    except _Refused as exc:
        raise _Refused(f"{target} has an invalid state tree ({exc}): {_DAMAGED}") from None
    _check_state(state, target, names)
    return {"id": header["id"], "state": state}


def _read_file(fh: BinaryIO, target: str, path: str) -> tuple[dict[str, Any], list[Any]]:
    """Parse prefix and header and read every array, checking sizes and CRCs."""
    total = os.fstat(fh.fileno()).st_size
    prefix = fh.read(_PREFIX.size)
    _check_magic(prefix, total, target, path)
    _, length, crc = _PREFIX.unpack(prefix)
    if length > total - _PREFIX.size:
        raise _Refused(f"{target} is truncated: {total} bytes, its header alone claims {length}: {_DAMAGED}")
    text = fh.read(length)
    if zlib.crc32(text) != crc:
        raise _Refused(f"{target} has a damaged header (CRC-32 mismatch): {_DAMAGED}")
    header = _parse_header(text, target)
    expected = _PREFIX.size + length + header["data_nbytes"]
    if total != expected:
        what = "truncated" if total < expected else f"followed by {total - expected} unexpected bytes"
        raise _Refused(f"{target} is {what} ({total} bytes, its header says {expected}): {_DAMAGED}")
    arrays = [_read_array(fh, row) for row in header["arrays"]]
    crc = 0
    for _, raw in arrays:
        crc = zlib.crc32(raw, crc)
    if crc != header["data_crc32"]:
        raise _Refused(f"{target} has damaged array data (CRC-32 mismatch): {_DAMAGED}")
    return header, [a for a, _ in arrays]


def _check_magic(prefix: bytes, total: int, target: str, path: str) -> None:
    """Raise naming what the file is when it does not start like a commwire checkpoint."""
    if prefix[:8] == _MAGIC and len(prefix) == _PREFIX.size:
        return
    if total == 0:
        raise _Refused(f"{target} is empty (0 bytes): {_DAMAGED}")
    if prefix[:8] == _MAGIC or _MAGIC.startswith(prefix):
        raise _Refused(f"{target} is truncated ({total} bytes): {_DAMAGED}")
    if prefix[:1] == b"\x80" and prefix[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise _Refused(f"{target} is a pickle file (checkpoint format 1 of older commwire, or not ours). It is "
                       "not loaded: unpickling can run arbitrary code. If you wrote it yourself, convert it once "
                       f"with commwire.checkpoint.convert_pickle_checkpoint({os.fspath(path)!r}, trust=True)")
    what = "a zip archive (.npz, torch.save?)" if prefix[:4] == b"PK\x03\x04" else f"starts with {prefix[:8]!r}"
    raise _Refused(f"{target} is not a commwire checkpoint ({what}): pass the path given to "
                   "commwire.checkpoint.save(), without the .rankN suffix")


def _parse_header(text: bytes, target: str) -> dict[str, Any]:
    """Decode the JSON header and check its fields, the array table and the data size."""
    header = json.loads(text.decode("utf-8"), parse_constant=_reject_constant)
    if not isinstance(header, dict):
        raise _Refused(f"{target} has a header of type {type(header).__name__}, not an object: {_DAMAGED}")
    for field, kind in _FIELDS.items():
        value = header.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise _Refused(f"{target} has header field {field!r} = {str(value)[:60]!r}, expected "
                           f"{getattr(kind, '__name__', 'object')}: {_DAMAGED}")
    if header["format"] != _FORMAT:
        raise _Refused(f"{target} is a {header['format'][:40]!r} file, not a commwire checkpoint")
    if header["version"] != _VERSION:
        newer = "a newer commwire: upgrade commwire" if header["version"] > _VERSION else "an unsupported commwire"
        raise _Refused(f"{target} has checkpoint format {header['version']}, this commwire reads {_VERSION}; "
                       f"it was written by {newer} to load it")
    for i, row in enumerate(header["arrays"]):
        _check_row(row, f"{target} array {i}")
    if sum(row["nbytes"] for row in header["arrays"]) != header["data_nbytes"]:
        raise _Refused(f"{target}: its arrays hold a different number of bytes than data_nbytes: {_DAMAGED}")
    return header


def _reject_constant(name: str) -> float:
    raise _Refused(f"the header holds the non-standard JSON constant {name}")


def _check_row(row: Any, where: str) -> None:
    """Check one row of the array table: kind, dtype, shape and a byte count that matches them."""
    if not isinstance(row, dict) or set(row) != {"kind", "dtype", "shape", "nbytes"}:
        raise _Refused(f"{where} is not a table row of kind/dtype/shape/nbytes: {_DAMAGED}")
    shape, nbytes = row["shape"], row["nbytes"]
    if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
            or any(type(d) is not int or d < 0 for d in shape) or type(nbytes) is not int):
        raise _Refused(f"{where} has shape {str(shape)[:60]} / nbytes {nbytes!r}: {_DAMAGED}")
    itemsize = _itemsize(row["kind"], row["dtype"], where)
    if math.prod(shape) * itemsize != nbytes:
        raise _Refused(f"{where} has {nbytes} bytes for shape {shape} of {row['dtype']}: {_DAMAGED}")


def _itemsize(kind: Any, dtype: Any, where: str) -> int:
    """Return the bytes per element of a table dtype (resolving it checks that it is allowed)."""
    if kind == "numpy":
        return _numpy_dtype(dtype, where).itemsize
    if kind == "torch":
        return _torch_dtype(dtype, where).itemsize
    raise _Refused(f"{where} has array kind {str(kind)[:40]!r}, expected 'numpy' or 'torch': {_DAMAGED}")


def _numpy_dtype(name: Any, where: str) -> np.dtype:
    """Resolve a numpy dtype name of the table: a bool/int/float/complex type string or an ml_dtypes name."""
    if isinstance(name, str) and _NUMPY_DTYPE.fullmatch(name):
        return np.dtype(name)
    if isinstance(name, str) and name.startswith("ml_dtypes:") and _NAME.fullmatch(name[10:]):
        import ml_dtypes

        found = getattr(ml_dtypes, name[10:], None)
        if isinstance(found, type) and found.__module__ == "ml_dtypes" and issubclass(found, np.generic):
            return np.dtype(found)
    raise _Refused(f"{where} has dtype {str(name)[:40]!r}, which checkpoints do not store: {_DAMAGED}")


def _torch_dtype(name: Any, where: str) -> Any:
    """Resolve a torch dtype name of the table (``float32``, ``bfloat16`` ...)."""
    try:
        import torch
    except ImportError:
        raise _Refused(f"{where} is a torch tensor but torch is not installed: pip install torch") from None
    found = getattr(torch, name, None) if isinstance(name, str) and _NAME.fullmatch(name) else None
    if not isinstance(found, torch.dtype):
        raise _Refused(f"{where} has torch dtype {str(name)[:40]!r}, which is not one: {_DAMAGED}")
    return found


def _read_array(fh: BinaryIO, row: dict[str, Any]) -> tuple[Any, np.ndarray]:
    """Read one array's bytes straight into a new array; return (array, its flat uint8 view)."""
    if row["kind"] == "numpy":
        array: Any = np.empty(row["shape"], dtype=_numpy_dtype(row["dtype"], ""))
        raw = array.reshape(-1).view(np.uint8)
    else:
        import torch

        array = torch.empty(row["shape"], dtype=_torch_dtype(row["dtype"], ""))
        raw = array.reshape(-1).view(torch.uint8).numpy()
    view = memoryview(raw)
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise _Refused(f"the file ended inside an array (it changed while being read?): {_DAMAGED}")
        done += got
    return array, raw


def _check_identity(header: dict[str, Any], target: str, rank: int, size: int, names: list[str]) -> None:
    """Raise unless the file was written by this rank of a job of this size, for these object names."""
    if header["size"] != size or header["rank"] != rank:
        raise _Refused(f"{target} was written by rank {header['rank']} of {header['size']}; this is rank {rank} "
                       f"of {size}: resume with {header['size']} ranks, each reading the file of its own rank")
    if header["names"] != names:
        raise _Refused(f"{target} holds objects {str(header['names'])[:200]}, load() was given {names}: pass "
                       "the names that were passed to save()")


def _check_state(state: Any, target: str, names: list[str]) -> None:
    """Raise unless the decoded state is {"objects": {name: ...}, "codecs": {spec: dict}}."""
    ok = (isinstance(state, dict) and set(state) == {"objects", "codecs"} and isinstance(state["objects"], dict)
          and sorted(state["objects"], key=str) == names and isinstance(state["codecs"], dict)
          and all(isinstance(k, str) and isinstance(v, dict) for k, v in state["codecs"].items()))
    if not ok:
        raise _Refused(f"{target} has a state tree without the objects {names} and shared codecs: {_DAMAGED}")
    from .codecs.collective import resolve_codec

    for spec in state["codecs"]:  # resolve now, so an unknown spec is refused before any state is applied
        try:
            resolve_codec(spec)
        except Exception as exc:
            raise _Refused(f"{target} holds state of shared codec {spec[:60]!r}, which this commwire cannot "
                           f"build ({exc}): load it with the commwire version that saved it") from None


class _Unpacker:
    """Turn JSON nodes back into the saved values, with the arrays read from the file."""

    def __init__(self, arrays: list[Any], table: list[dict[str, Any]]) -> None:
        self.arrays, self.table = arrays, table

    def value(self, node: Any, where: str, depth: int) -> Any:
        """Return the value of ``node``; raise _Refused on anything save() does not write."""
        if depth > _MAX_DEPTH:
            raise _Refused(f"nesting deeper than {_MAX_DEPTH} at {where}")
        if node is None or type(node) in (str, int, bool, float):
            return node
        if type(node) is list:
            return [self.value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node)]
        tag = node.get("$") if type(node) is dict else None
        decode = _TAGS.get(tag) if isinstance(tag, str) else None
        if decode is None:
            raise _Refused(f"unknown node {str(node)[:60]} at {where}")
        return decode(self, node, where, depth + 1)

    def items(self, node: dict[str, Any], where: str, depth: int) -> list[Any]:
        """Return the decoded "items" list of a container node."""
        items = node.get("items")
        if type(items) is not list:
            raise _Refused(f"container without an items list at {where}")
        return [self.value(v, f"{where}[{i}]", depth) for i, v in enumerate(items)]

    def mapping(self, node: dict[str, Any], where: str, depth: int, kind: type) -> Any:
        """Return the dict (or OrderedDict) of a key/value pair list."""
        out = kind()
        for pair in self.items(node, where, depth):
            if type(pair) is not list or len(pair) != 2:
                raise _Refused(f"dict entry that is not a [key, value] pair at {where}")
            try:
                out[pair[0]] = pair[1]
            except TypeError:
                raise _Refused(f"unhashable dict key at {where}") from None
        return out

    def array(self, node: dict[str, Any], where: str, kind: str) -> Any:
        """Return the array of a table reference, checking that it is of the expected kind."""
        index = node.get("a")
        if type(index) is not int or not 0 <= index < len(self.arrays) or self.table[index]["kind"] != kind:
            raise _Refused(f"reference {str(index)[:20]} to no {kind} array of the table at {where}")
        return self.arrays[index]


def _decode_float(u: _Unpacker, node: dict[str, Any], where: str, depth: int) -> float:
    if node.get("v") not in ("inf", "-inf", "nan"):
        raise _Refused(f"float node {str(node)[:60]} at {where}")
    return float(node["v"])


def _decode_odict(u: _Unpacker, node: dict[str, Any], where: str, depth: int) -> OrderedDict:
    out = u.mapping(node, where, depth, OrderedDict)
    if "meta" in node:
        meta = u.value(node["meta"], f"{where}._metadata", depth)
        if not isinstance(meta, dict) or not all(isinstance(v, dict) for v in meta.values()):
            raise _Refused(f"_metadata that is not a dict of dicts at {where}")
        out._metadata = meta  # type: ignore[attr-defined]
    return out


def _decode_npscalar(u: _Unpacker, node: dict[str, Any], where: str, depth: int) -> Any:
    value = u.array(node, where, "numpy")
    if value.shape != ():
        raise _Refused(f"numpy scalar of shape {value.shape} at {where}")
    return value[()]


_TAGS: dict[str, Any] = {
    "float": _decode_float,
    "tuple": lambda u, node, where, depth: tuple(u.items(node, where, depth)),
    "dict": lambda u, node, where, depth: u.mapping(node, where, depth, dict),
    "odict": _decode_odict,
    "ndarray": lambda u, node, where, depth: u.array(node, where, "numpy"),
    "npscalar": _decode_npscalar,
    "tensor": lambda u, node, where, depth: u.array(node, where, "torch"),
}


def _apply(found: dict[str, Any], objects: dict[str, Any]) -> None:
    """Load the checked state into ``objects`` and the shared codecs."""
    state = found["state"]
    for name, obj in objects.items():
        obj.load_state_dict(state["objects"][name])
    from .codecs.collective import resolve_codec

    for spec, codec_state in state["codecs"].items():
        resolve_codec(spec).load_state_dict(codec_state)


def _unpickle_legacy(pickle: Any, target: str) -> dict[str, Any]:
    """Unpickle one format-1 rank file (trusted by the caller) and check its fields."""
    with open(target, "rb") as fh:
        payload = pickle.load(fh)
    if not isinstance(payload, dict) or payload.get("version") != 1 or not {"id", "rank", "size", "objects"} <= set(
            payload):
        raise ValueError(f"{target} is not a format-1 commwire checkpoint (a pickled dict of version 1)")
    return payload
