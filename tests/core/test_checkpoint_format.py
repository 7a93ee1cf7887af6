"""Checkpoint file format — tier 1 (single process, a one-rank stand-in communicator).

Round trips must be exact: same Python types (tuple vs list, int keys, OrderedDict
with torch's _metadata, numpy scalars), floats bit for bit (inf, nan, -0.0), and
arrays/tensors with the same dtype (bfloat16, float8 in numpy and torch), shape
and bytes, whatever their strides. Damaged and foreign files raise ValueError
naming the file; pickle files are never unpickled. The multi-rank agreement and
the fuzzing of files live in tests/reliability/test_checkpoint_fuzz.py.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import struct
from collections import OrderedDict
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import commwire as cw

torch = pytest.importorskip("torch")


class SoloComm:
    """The collectives save/load use, for one rank."""

    rank, size = 0, 1

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


COMM = SoloComm()


class Holder:
    """An object whose state is any tree (what load_state_dict received is kept as is)."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def same(a: Any, b: Any, where: str = "state") -> None:
    """Assert ``a`` and ``b`` are the same tree: exact types, bitwise floats and arrays."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: {a!r} vs {b!r}"
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), where
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert _tbytes(a) == _tbytes(b), where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _tbytes(t: Any) -> bytes:
    return t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def round_trip(tree: Any, tmp_path) -> Any:
    path = str(tmp_path / "ckpt")
    cw.checkpoint.save(path, {"x": Holder(tree)}, comm=COMM)
    out = Holder()
    cw.checkpoint.load(path, {"x": out}, comm=COMM)
    return out.state


def numpy_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 5))
    out = {dt: base.astype(dt) for dt in ["float16", "float32", "float64", "complex64", "int8", "int64", "uint16"]}
    out.update({name: base.astype(getattr(ml_dtypes, name)) for name in ["bfloat16", "float8_e4m3fn", "float8_e5m2"]})
    out["bool"] = base > 0
    out["zero_d"] = np.array(3.5, dtype=np.float32)
    out["zero_d_bf16"] = np.array(-0.0, dtype=ml_dtypes.bfloat16)
    out["empty"] = np.zeros((3, 0, 2), dtype=np.float32)
    out["transposed"] = base.astype(np.float32).T
    out["strided"] = base[::2, 1::2]
    out["bigendian"] = base.astype(">f8")
    out["special"] = np.array([np.inf, -np.inf, np.nan, -0.0, 5e-324], dtype=np.float64)
    return out


def torch_tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    out = {str(dt): base.to(dt) for dt in [torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
                                           torch.float8_e5m2, torch.int64, torch.uint8, torch.bool]}
    out["complex"] = torch.complex(base, -base)
    out["conj"] = out["complex"].conj()  # lazily conjugated view: stored resolved
    out["zero_d"] = torch.tensor(2.0)
    out["zero_d_bf16"] = torch.tensor(-1.5, dtype=torch.bfloat16)
    out["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    out["transposed"] = base.t()
    out["strided"] = base[::2, 1::3]
    out["nan_bits"] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.bfloat16)
    out["grad"] = torch.nn.Parameter(base.clone()).detach()
    return out


def test_python_structures_round_trip_exactly(tmp_path):
    tree = {"ints": {0: "a", -7: "b", 10**30: "c"}, "tuple_keys": {("gift", "factor", "w"): 1, ("x", 2): None},
            "nested": [(1, 2.0, ("three", [True, False, None])), [], (), {}], "str": "ünïcode \u0000 \"q\"",
            "floats": [math.inf, -math.inf, math.nan, -0.0, 0.1, 1e308, 5e-324, 1.0], "bool_key": {True: 1, 2: 2},
            "ordered": OrderedDict([("b", 1), ("a", 2)]), "$": {"$": "tuple"}, "big": 2**70, "neg": -(2**63)}
    same(round_trip(tree, tmp_path), tree)


def test_numpy_arrays_and_scalars_round_trip_bit_exactly(tmp_path):
    tree = {"arrays": numpy_arrays(), "scalars": [np.float32(1.25), np.int64(-3), np.bool_(True),
                                                  ml_dtypes.bfloat16(0.1), np.float64("nan")]}
    got = round_trip(tree, tmp_path)
    same(got, tree)
    assert all(a.flags.c_contiguous for a in got["arrays"].values())


def test_torch_tensors_round_trip_bit_exactly(tmp_path):
    tensors = torch_tensors()
    got = round_trip(tensors, tmp_path)
    assert not got["conj"].is_conj()
    same({k: v.resolve_conj() for k, v in got.items()}, {k: v.resolve_conj() for k, v in tensors.items()})


def test_module_and_optimizer_state_dicts_resume_identically(tmp_path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))

    def step(model, opt, i):
        g = torch.Generator().manual_seed(i)
        opt.zero_grad()
        model(torch.randn(16, 4, generator=g)).square().mean().backward()
        opt.step()

    model, opt = build()
    for i in range(3):
        step(model, opt, i)
    path = str(tmp_path / "ckpt")
    cw.checkpoint.save(path, {"model": model, "opt": opt}, comm=COMM)
    saved_opt = copy.deepcopy(opt.state_dict())  # state_dict() returns the live tensors
    for i in range(3, 6):
        step(model, opt, i)
    model2, opt2 = build()
    cw.checkpoint.load(path, {"model": model2, "opt": opt2}, comm=COMM)
    same(opt2.state_dict(), saved_opt)  # int keys of the state, betas tuple, 0-d step tensors
    assert model2.state_dict()._metadata == model.state_dict()._metadata
    for i in range(3, 6):
        step(model2, opt2, i)
    for (n, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert torch.equal(a, b), n


def test_codec_state_round_trips(tmp_path):
    codec = cw.codecs.get("ef+fp8-e4m3")
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    codec.decode(codec.encode(x, key=("bucket0", 7)))
    state = codec.state_dict()
    same(round_trip(state, tmp_path), state)


@pytest.mark.parametrize("value,where", [({1, 2}, "set"), ({"a": object()}, "['a']"),
                                         (np.array(["s"]), "<U1"), (torch.zeros(2).to_sparse(), "sparse")])
def test_an_unsupported_value_is_refused_at_save_naming_where(tmp_path, value, where):
    path = str(tmp_path / "ckpt")
    with pytest.raises(TypeError, match="cannot save") as info:
        cw.checkpoint.save(path, {"x": Holder(value)}, comm=COMM)
    assert where in str(info.value) or where == "set"
    assert os.listdir(tmp_path) == []  # no file, not even the temporary one


def _saved(tmp_path) -> tuple[str, bytes]:
    path = str(tmp_path / "ckpt")
    cw.checkpoint.save(path, {"x": Holder({"w": np.arange(50, dtype=np.float32), "t": torch.ones(3)})}, comm=COMM)
    with open(path + ".rank0", "rb") as fh:
        return path, fh.read()


def _damage(kind: str, data: bytes) -> bytes:
    if kind == "truncated":
        return data[: len(data) - 7]
    if kind == "header_flip":
        return data[:30] + bytes([data[30] ^ 4]) + data[31:]
    if kind == "data_flip":
        return data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    if kind == "appended":
        return data + b"\0"
    return {"empty": b"", "random": os.urandom(300), "zip": b"PK\x03\x04" + os.urandom(100),
            "magic_only": data[:8], "text": b'{"format": "commwire-checkpoint"}'}[kind]


@pytest.mark.parametrize("kind", ["truncated", "header_flip", "data_flip", "appended", "empty", "random", "zip",
                                  "magic_only", "text"])
def test_a_damaged_or_foreign_file_is_refused_and_nothing_is_loaded(tmp_path, kind):
    path, data = _saved(tmp_path)
    with open(path + ".rank0", "wb") as fh:
        fh.write(_damage(kind, data))
    holder = Holder("untouched")
    with pytest.raises(ValueError, match=r"rank 0: .*ckpt\.rank0") as info:
        cw.checkpoint.load(path, {"x": holder}, comm=COMM)
    assert "no state was loaded" in str(info.value)
    assert holder.state == "untouched"


def test_missing_file_and_other_object_names_are_refused(tmp_path):
    path, _ = _saved(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        cw.checkpoint.load(path + "x", {"x": Holder()}, comm=COMM)
    with pytest.raises(ValueError, match=r"holds objects \['x'\], load\(\) was given \['y'\]"):
        cw.checkpoint.load(path, {"y": Holder()}, comm=COMM)


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_files_are_never_unpickled_and_convert_only_when_trusted(tmp_path):
    path = str(tmp_path / "old")
    marker = tmp_path / "code-ran"
    payload = {"version": 1, "id": "abc", "rank": 0, "size": 1, "codecs": {},
               "objects": {"x": {"w": torch.arange(4.0), "evil": _Marker(str(marker))}}}
    with open(path + ".rank0", "wb") as fh:
        pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(ValueError, match=r"pickle file .*convert_pickle_checkpoint\("):
        cw.checkpoint.load(path, {"x": Holder()}, comm=COMM)
    with pytest.raises(ValueError, match="trust=True"):
        cw.checkpoint.convert_pickle_checkpoint(path)
    assert not marker.exists()
    payload["objects"]["x"].pop("evil")
    with open(path + ".rank0", "wb") as fh:
        pickle.dump(payload, fh, protocol=pickle.HIGHEST_PROTOCOL)
    assert cw.checkpoint.convert_pickle_checkpoint(path, trust=True) == "abc"
    holder = Holder()
    assert cw.checkpoint.load(path, {"x": holder}, comm=COMM) == "abc"
    assert torch.equal(holder.state["w"], torch.arange(4.0))
