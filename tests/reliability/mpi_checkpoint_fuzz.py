"""Fuzz checkpoint files: every damaged, foreign or mismatched file makes every rank raise — tier 2 (mpiexec).

Run on 2 ranks by test_checkpoint_fuzz.py, or by hand for the full campaign:

    mpiexec -n 2 python tests/reliability/mpi_checkpoint_fuzz.py --variants 1000 --workdir /tmp/ckfuzz

The job saves real checkpoints (a model, a DistributedOptimizer with
compression="ef+fp8-e4m3", an "ef+nvfp4" codec object and a shared string-spec
codec), then rank 0 writes variants of the rank files: truncations, bit flips
in header and data, headers rewritten with a valid CRC (other rank count, rank,
id, version, dtypes, shapes, sizes, tags, references, nesting), files of another
checkpoint, of another object set or of a one-rank job, swapped or missing rank
files, pickles that would run code or allocate a terabyte, old format-1 pickles,
torch.save / npz / random / empty files. For each variant every rank calls
``load`` and the job checks: every rank raised ValueError with the same message
naming the checkpoint, no state changed, the marker file that the pickles would
create does not exist. A hang aborts the job through commwire's stall watchdog.
Unchanged checkpoints (controls) must load, and a save that fails on one rank
must raise TypeError on every rank and leave the old files. Rank 0 prints one
JSON summary line.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import time
import zipfile
from collections import Counter
from typing import Any, Callable

import numpy as np
import torch

import commwire as cw
import commwire.torch as hvd

PREFIX = struct.Struct("<8sQI")  # the layout documented in commwire.checkpoint, written here independently
NAMES = ("model", "opt", "codec")


# ----------------------------------------------------------------------------- the job's state
def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                   named_parameters=model.named_parameters(), compression="ef+fp8-e4m3")
    return {"model": model, "opt": opt, "codec": cw.codecs.get("ef+nvfp4")}


def train(objs: dict[str, Any], steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + cw.rank())
        x = torch.randn(8, 8, generator=g)
        objs["opt"].zero_grad()
        torch.nn.functional.mse_loss(objs["model"](x), x.sum(1, keepdim=True).sin()).backward()
        objs["opt"].step()
        side = torch.randn(300, generator=g).numpy()
        cw.allreduce(side, codec=objs["codec"], name="side")
        cw.allreduce(side.copy(), codec="ef+fp8-e4m3", name="shared")  # shared codec state, saved too


def digest(objs: dict[str, Any]) -> str:
    """Hash every byte of state: parameters, optimizer and codec state, shared codecs."""
    from commwire.codecs.collective import shared_codecs

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype.name}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk({name: obj.state_dict() for name, obj in objs.items()})
    walk({spec: codec.state_dict() for spec, codec in shared_codecs().items()})
    return h.hexdigest()


# ----------------------------------------------------------------------------- making variants
def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    _, length, _ = PREFIX.unpack(data[:PREFIX.size])
    return json.loads(data[PREFIX.size:PREFIX.size + length]), data[PREFIX.size + length:]


def compact(header: Any) -> bytes:
    """Return the header as save() writes it (no spaces), so byte-level rewrites find their fields."""
    return json.dumps(header, separators=(",", ":")).encode()


def join(header: Any, data: bytes, text: bytes | None = None) -> bytes:
    """Re-serialise a (mutated) header with a valid CRC: only deeper checks can refuse it."""
    import zlib

    text = compact(header) if text is None else text
    return PREFIX.pack(b"\x89CWCKPT\n", len(text), zlib.crc32(text)) + text + data


def flip(data: bytes, lo: int, hi: int, rng: random.Random) -> bytes:
    out = bytearray(data)
    for bit in rng.sample(range(lo * 8, hi * 8), rng.randint(1, 3)):  # distinct bits: no flip undoes another
        out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


class Evil:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class Bomb:
    """Unpickling this asks for a terabyte."""

    def __reduce__(self) -> Any:
        return (bytearray, (1 << 40,))


def _nodes(tree: Any, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(tree, dict):
        out.append(tree)
        for v in tree.values():
            _nodes(v, out)
    elif isinstance(tree, list):
        for v in tree:
            _nodes(v, out)
    return out


def header_mutations() -> dict[str, Callable[[dict[str, Any], random.Random, int], Any]]:
    """Return the header rewrites: each returns the new header (or raw header text as bytes)."""
    def setter(key: str, value: Any) -> Callable:
        return lambda h, rng, rank: {**h, key: value}

    def row(change: Callable) -> Callable:
        def mutate(h: dict[str, Any], rng: random.Random, rank: int) -> dict[str, Any]:
            r = rng.choice([r for r in h["arrays"] if r["nbytes"] > 0])  # an empty one could take any shape
            change(r, rng)
            return h
        return mutate

    def node(change: Callable) -> Callable:
        def mutate(h: dict[str, Any], rng: random.Random, rank: int) -> dict[str, Any]:
            tagged = [n for n in _nodes(h["state"], []) if "$" in n]
            change(rng.choice(tagged), rng)
            return h
        return mutate

    def ref(change: Callable) -> Callable:
        def mutate(h: dict[str, Any], rng: random.Random, rank: int) -> dict[str, Any]:
            refs = [n for n in _nodes(h["state"], []) if "a" in n]
            change(rng.choice(refs), rng)
            return h
        return mutate

    def drop(h: dict[str, Any], rng: random.Random, rank: int) -> dict[str, Any]:
        key = rng.choice(sorted(h))
        return {k: v for k, v in h.items() if k != key}

    def retype(h: dict[str, Any], rng: random.Random, rank: int) -> dict[str, Any]:
        key = rng.choice(sorted(h))
        return {**h, key: rng.choice([v for v in ["x", 1.5, None, [], True, {}] if type(v) is not type(h[key])])}

    def deep(h: dict[str, Any], rng: random.Random, rank: int) -> bytes:
        text = compact(h)
        depth = rng.choice([300, 5000, 100_000])
        return text.replace(b'"state":', b'"state":' + b"[" * depth + b"0" + b"]" * depth + b',"x":', 1)

    return {
        "size3": setter("size", 3),
        "size1": setter("size", 1),
        "rank_other": lambda h, rng, rank: {**h, "rank": 1 - rank},
        "rank_negative": setter("rank", -1),
        "id_other": lambda h, rng, rank: {**h, "id": rng.randbytes(16).hex()},
        "version_next": setter("version", 3),
        "version_pickle": setter("version", 1),
        "format_other": setter("format", "torch"),
        "names_fewer": setter("names", ["model"]),
        "names_unsorted": lambda h, rng, rank: {**h, "names": h["names"][::-1]},
        "field_dropped": drop,
        "field_retyped": retype,
        "nbytes_plus": row(lambda r, rng: r.update(nbytes=r["nbytes"] + rng.choice([1, 4, -1]))),
        "shape_grown": row(lambda r, rng: r.update(shape=r["shape"] + [2])),
        "shape_negative": row(lambda r, rng: r.update(shape=[-1], nbytes=-4)),
        "shape_huge": row(lambda r, rng: r.update(shape=[2**40, 2**40])),
        "shape_zero_huge": row(lambda r, rng: r.update(shape=[0, 2**70], nbytes=0)),
        "shape_ndim": row(lambda r, rng: r.update(shape=[1] * 100)),
        "dtype_foreign": row(lambda r, rng: r.update(dtype=rng.choice(
            ["|O8", "<U4", "object", "ml_dtypes:finfo", "<V2", ">M8", "__class__", "Tensor", "float32 ", 7, None]))),
        "dtype_kind_swapped": row(lambda r, rng: r.update(dtype=">f4" if r["kind"] == "torch" else "float32")),
        "kind_foreign": row(lambda r, rng: r.update(kind=rng.choice(["cupy", "pickle", None]))),
        "row_extra_key": row(lambda r, rng: r.update(offset=0)),
        "data_nbytes": lambda h, rng, rank: {**h, "data_nbytes": h["data_nbytes"] + 8},
        "data_crc": lambda h, rng, rank: {**h, "data_crc32": h["data_crc32"] ^ 1},
        "tag_unknown": node(lambda n, rng: n.update({"$": rng.choice(["pickle", "evil", "", None, 3])})),
        "tag_dropped": node(lambda n, rng: n.pop("$")),
        "tag_kind_swapped": ref(lambda n, rng: n.update({"$": "ndarray" if n["$"] == "tensor" else "tensor"})),
        "ref_out_of_range": ref(lambda n, rng: n.update(a=rng.choice([10**9, -1, "0", True, None, 1.0]))),
        "items_not_list": node(lambda n, rng: n.update(items={"k": 1}) if "items" in n else n.update({"$": "x"})),
        "float_foreign": node(lambda n, rng: n.clear() or n.update({"$": "float", "v": "1e999"})),
        "state_list": setter("state", {"$": "dict", "items": [["objects", 1]]}),
        "state_deep": deep,
        "header_list": lambda h, rng, rank: [h],
        "header_not_utf8": lambda h, rng, rank: b"\xff\xfe" + compact(h),
        "header_nan": lambda h, rng, rank: compact(h).replace(b'"version":2', b'"version":NaN'),
        "header_bigint": lambda h, rng, rank: compact(h).replace(b'"rank":', b'"rank":' + b"9" * 5000, 1),
        "header_garbage": lambda h, rng, rank: rng.randbytes(rng.randint(0, 200)),
    }


class Variants:
    """Draw corrupted or crafted rank files from the real ones (on rank 0)."""

    def __init__(self, files: dict[str, list[bytes]], size: int, marker: str, seed: int) -> None:
        self.files, self.size, self.marker = files, size, marker
        self.rng = random.Random(seed)
        self.headers = header_mutations()
        self.kinds = ["truncate", "flip_header", "flip_data", "flip_prefix", "trailing", "random", "empty",
                      "missing", "directory", "pickle_exec", "pickle_bomb", "pickle_legacy", "torch_save", "npz",
                      "zip_foreign", "other_checkpoint", "other_objects", "one_rank_job", "swapped", "duplicated",
                      "length_huge", "magic_only", "prefix_only"] + [f"header:{k}" for k in self.headers]

    def draw(self) -> tuple[str, list[Any]]:
        """Return (kind, per-rank contents: bytes, None for missing, "DIR" for a directory)."""
        kind = self.rng.choice(self.kinds)
        base = list(self.files["a"])
        if kind == "other_checkpoint":  # one rank only: both files of the other save are a valid checkpoint
            r = self.rng.randrange(self.size)
            base[r] = self.files["b"][r]
            return kind, base
        if kind == "swapped":
            return kind, base[::-1] if self.size == 2 else base[1:] + base[:1]
        targets = self.rng.choice([[r] for r in range(self.size)] + [list(range(self.size))])
        for r in targets:
            base[r] = self.mutate(kind, r, base[r])
        return kind, base

    def mutate(self, kind: str, rank: int, data: bytes) -> Any:
        """Return one damaged/foreign version of ``data`` (the file of ``rank``)."""
        rng = self.rng
        header, payload = split(data)
        head_end = len(data) - len(payload)
        if kind.startswith("header:"):
            new = self.headers[kind[7:]](json.loads(json.dumps(header)), rng, rank)
            return join(None, payload, new) if isinstance(new, bytes) else join(new, payload)
        simple = {
            "truncate": lambda: data[:rng.randrange(len(data))],
            "flip_header": lambda: flip(data, 0, head_end, rng),
            "flip_data": lambda: flip(data, head_end, len(data), rng),
            "flip_prefix": lambda: flip(data, 0, PREFIX.size, rng),
            "trailing": lambda: data + rng.randbytes(rng.randint(1, 64)),
            "random": lambda: rng.randbytes(rng.randint(1, 4096)),
            "empty": lambda: b"",
            "missing": lambda: None,
            "directory": lambda: "DIR",
            "pickle_exec": lambda: pickle.dumps({"version": 2, "evil": Evil(self.marker)}, protocol=rng.randint(2, 5)),
            "pickle_bomb": lambda: pickle.dumps([Bomb()], protocol=5),
            "pickle_legacy": lambda: self.legacy(rank),
            "torch_save": lambda: self.torch_save(),
            "npz": lambda: self.npz(),
            "zip_foreign": lambda: self.zip_foreign(),
            "other_objects": lambda: self.files["c"][rank],
            "one_rank_job": lambda: self.files["d"][0],
            "duplicated": lambda: self.files["a"][(rank + 1) % self.size],
            "length_huge": lambda: PREFIX.pack(b"\x89CWCKPT\n", 2**63, 0) + data[PREFIX.size:],
            "magic_only": lambda: data[:rng.randint(1, 8)],
            "prefix_only": lambda: data[:PREFIX.size + rng.randint(0, 3)],
        }
        return simple[kind]()

    def legacy(self, rank: int) -> bytes:
        header, _ = split(self.files["a"][rank])
        return pickle.dumps({"version": 1, "id": header["id"], "rank": rank, "size": self.size,
                             "objects": {"model": {"w": torch.ones(3)}, "evil": Evil(self.marker)}, "codecs": {}},
                            protocol=pickle.HIGHEST_PROTOCOL)

    def torch_save(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "evil": Evil(self.marker)}, buf)
        return buf.getvalue()

    def npz(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, w=np.ones(4), names=np.array(list(NAMES)))
        return buf.getvalue()

    def zip_foreign(self) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("data.pkl", pickle.dumps(Evil(self.marker)))
            z.writestr("header.json", json.dumps({"format": "commwire-checkpoint", "version": 2}))
        return buf.getvalue()


def self_test_payloads(marker: str) -> None:
    """Prove the crafted pickles are live (unpickling them does create the marker), then remove it."""
    pickle.loads(pickle.dumps(Evil(marker)))
    assert os.path.exists(marker), "the code-running pickle did not run: the fuzz would prove nothing"
    os.remove(marker)


def place(path: str, size: int, contents: list[Any]) -> None:
    for r, content in enumerate(contents):
        target = cw.checkpoint.rank_path(path, r)
        if content == "DIR":
            os.makedirs(target)
        elif content is not None:
            with open(target, "wb") as fh:
                fh.write(content)


# ----------------------------------------------------------------------------- the campaign
def read_files(path: str, size: int) -> list[bytes]:
    out = []
    for r in range(size):
        with open(cw.checkpoint.rank_path(path, r), "rb") as fh:
            out.append(fh.read())
    return out


def attempt(path: str, objs: dict[str, Any]) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        ckpt = cw.checkpoint.load(path, objs)
        return "ok", ckpt, time.perf_counter() - start
    except Exception as exc:  # the verdict is what we check: its type and message
        return type(exc).__name__, str(exc), time.perf_counter() - start


def judge(kind: str, path: str, results: list[tuple[str, str, float, bool]], marker: str) -> str:
    """Return "" if every rank refused the variant alike without side effects, else what went wrong."""
    types = {r[0] for r in results}
    if types != {"ValueError"}:
        return f"exception types per rank {[r[0] for r in results]}"
    if len({r[1] for r in results}) != 1:
        return "ranks raised different messages"
    if path not in results[0][1]:
        return "the message does not name the checkpoint"
    if not all(r[3] for r in results):
        return "state changed on a rank"
    if os.path.exists(marker):
        return "CODE RAN: the marker file exists"
    return ""


class Unsaveable:
    """State that only one rank cannot store: save() must raise on every rank, not hang the others."""

    def __init__(self, bad: bool) -> None:
        self.bad = bad

    def state_dict(self) -> dict[str, Any]:
        return {"x": {1, 2} if self.bad else [1, 2]}


def save_refused_everywhere(comm: Any, work: str) -> bool:
    """Return True if a save that fails on the last rank raises TypeError on every rank and keeps the old files."""
    before = read_files(f"{work}/a", comm.size)
    try:
        cw.checkpoint.save(f"{work}/a", {"model": torch.nn.Linear(2, 2), "x": Unsaveable(comm.rank == comm.size - 1)})
        outcome = "saved"
    except TypeError as exc:
        outcome = "TypeError" if f"rank {comm.size - 1}: TypeError: cannot save builtins.set" in str(exc) else str(exc)
    everyone = comm.allgather_object(outcome)
    return everyone == ["TypeError"] * comm.size and read_files(f"{work}/a", comm.size) == before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = cw.init(timeout=30)  # a hang aborts the job with the stall report instead of waiting forever
    rank, size = comm.rank, comm.size
    work = args.workdir
    marker = os.path.join(work, "CODE-RAN")
    objs = build()
    train(objs, range(3))
    cw.checkpoint.save(f"{work}/a", objs)
    train(objs, range(3, 4))
    cw.checkpoint.save(f"{work}/b", objs)
    cw.checkpoint.save(f"{work}/c", {"model": objs["model"]})
    solo = comm.split(rank)
    cw.checkpoint.save(f"{work}/d{rank}", objs, comm=solo)
    comm.barrier()
    variants = None
    if rank == 0:
        self_test_payloads(marker)
        files = {k: read_files(f"{work}/{k}", size) for k in "abc"}
        files["d"] = [read_files(f"{work}/d{r}", 1)[0] for r in range(size)]
        variants = Variants(files, size, marker, args.seed)
    controls = []
    ckpt_a = cw.checkpoint.load(f"{work}/a", objs)  # control: the real checkpoint loads
    controls.append(ckpt_a == comm.broadcast_object(ckpt_a, 0))
    before = digest(objs)
    counts: Counter[str] = Counter()
    failures: list[tuple[int, str, str]] = []
    slowest = 0.0
    for i in range(args.variants):
        path = f"{work}/v{i}"
        if rank == 0:
            kind, contents = variants.draw()
            place(path, size, contents)
        comm.barrier()
        status, message, seconds = attempt(path, objs)
        results = comm.allgather_object((status, message, seconds, digest(objs) == before))
        if rank == 0:
            counts[kind] += 1
            slowest = max(slowest, *(r[2] for r in results))
            verdict = judge(kind, path, results, marker)
            if verdict:
                failures.append((i, kind, f"{verdict}: {results[0][1][:300]}"))
            for r in range(size):
                target = cw.checkpoint.rank_path(path, r)
                if os.path.isdir(target):
                    shutil.rmtree(target)
                elif os.path.exists(target):
                    os.remove(target)
    controls.append(cw.checkpoint.load(f"{work}/b", objs) != ckpt_a)  # control: another real one loads too
    save_refused = save_refused_everywhere(comm, work)
    if rank == 0:
        summary = {"variants": args.variants, "ranks": size, "refused_on_every_rank": args.variants - len(failures),
                   "failures": failures[:20], "code_ran": os.path.exists(marker), "hangs": 0,
                   "slowest_load_s": round(slowest, 4), "controls_loaded": all(controls),
                   "save_refused_on_every_rank": save_refused, "kinds": len(counts),
                   "per_kind": dict(sorted(counts.items()))}
        print("FUZZ-SUMMARY " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
