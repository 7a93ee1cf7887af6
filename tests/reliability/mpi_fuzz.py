"""Fuzz the collectives with random shapes, dtypes, ops, codecs and values — tier 2 (mpiexec).

Every rank runs the same hypothesis examples (derandomized, no database) and
builds its input from (case seed, rank) with ``_oracle.rank_data``, so each rank
computes the float64 reference of every rank's data itself. Every element of
every result is compared (``_oracle.check``) with the bounds documented in
``_oracle.py``: finite elements within the per-dtype / per-codec bound,
non-finite ones exactly (NaN stays NaN, ±Inf keeps its sign where the format
determines it); moves (allgather, broadcast, alltoall) must be bit-exact.
A verdict is agreed with an all-gather before asserting, so a failure is seen by
all ranks at the same example and shrinking stays in step.

The last test breaks the collectives on purpose (all NaN, or finite values off
by more than the tolerance) and requires the checker to fail.

Profiles ("ci" by default, "soak" for 10,000 cases per target; see conftest.py)::

    mpiexec -n 3 python -m pytest tests/reliability/mpi_fuzz.py --hypothesis-profile soak
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import _oracle as oracle
import commwire as cw
from commwire.codecs import collective, get

torch = pytest.importorskip("torch")
# NaN/Inf inputs make two codec paths warn (the values are right; see the fuzz report):
# error feedback's residual (feedback.py) and the generic decode-then-add (base.py).
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in add:RuntimeWarning")]

COMM = cw.init()
P = COMM.size
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


# ------------------------------------------------------------------ helpers
def _scale(dtype: str, kind: str) -> float:
    """Return the half-width of a case's values: unit, subnormal or large (no overflow on P ranks)."""
    if kind == "unit" or dtype in oracle.INT_DTYPES:
        return 3.0
    info = oracle.ml_dtypes.finfo(oracle.np_dtype(dtype))
    if kind == "subnormal":
        return 64 * float(info.smallest_subnormal)
    return float(info.max) / (4 * P)


def _inputs(seed: int, shape: tuple[int, ...], dtype: str, special: bool, scale: float) -> list[np.ndarray]:
    return [oracle.rank_data(seed, r, shape, dtype, special, scale, P) for r in range(P)]


def _to(x: np.ndarray, kind: str) -> Any:
    if kind == "numpy":
        return x
    if x.dtype == oracle.BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _back(y: Any) -> np.ndarray:
    if isinstance(y, np.ndarray):
        return y
    if y.dtype == torch.bfloat16:
        return y.view(torch.int16).numpy().view(oracle.BF16)
    return y.numpy()


def _agree(target: str, problem: str) -> None:
    """Fail on every rank when any rank found a problem (ranks stay in step)."""
    oracle.count(target, problem)
    flags = COMM.allgather_object(problem)
    bad = [(r, p) for r, p in enumerate(flags) if p]
    assert not bad, bad


def _same_everywhere(y: np.ndarray) -> str:
    digests = COMM.allgather_object(zlib.crc32(np.ascontiguousarray(y).view(np.uint8).tobytes()))
    return "" if len(set(digests)) == 1 else f"ranks hold different results: crc32 {digests}"


def _kind_dtype(got: Any, sent: Any) -> str:
    if type(got) is not type(sent) or got.dtype != sent.dtype or tuple(got.shape) != tuple(sent.shape):
        return f"returned {type(got).__name__} {got.dtype}{tuple(got.shape)} for {type(sent).__name__} " \
               f"{sent.dtype}{tuple(sent.shape)}"
    return ""


# ------------------------------------------------------------------ allreduce
allreduce_cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1), "shape": shapes, "dtype": st.sampled_from(DTYPES),
    "op": st.sampled_from(["sum", "avg", "min", "max"]), "special": st.booleans(), "inplace": st.booleans(),
    "kind": st.sampled_from(["numpy", "torch"]), "scale": st.sampled_from(["unit", "unit", "subnormal", "large"]),
})


def allreduce_case(seed, shape, dtype, op, special, inplace, kind, scale) -> str:
    """Run one all-reduce case; return "" or what went wrong."""
    if op == "avg" and dtype in oracle.INT_DTYPES:
        op = "sum"
    special = special and dtype not in oracle.INT_DTYPES
    xs = _inputs(seed, shape, dtype, special, _scale(dtype, scale))
    sent = _to(xs[COMM.rank].copy(), kind)
    got = COMM.allreduce(sent, op, out=sent if inplace else None)
    what = f"allreduce {op} {dtype} {shape} {kind}{' in place' if inplace else ''} scale={scale}"
    problem = _kind_dtype(got, sent) or oracle.check(_back(got), oracle.reduce_expect(np.stack(xs), op, dtype), what)
    if not problem and inplace:
        problem = oracle.same_bits(_back(sent), _back(got), what + " (out=x not written)")
    return problem


@given(case=allreduce_cases)
def test_allreduce_fuzz(case):
    _agree("allreduce", allreduce_case(**case))


# ------------------------------------------------------------------ moves and reduce_scatter
moves_cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1), "rows": st.integers(0, 5), "tail": shapes.map(lambda s: s[:2]),
    "dtype": st.sampled_from(DTYPES), "special": st.booleans(), "kind": st.sampled_from(["numpy", "torch"]),
    "move": st.sampled_from(["allgather", "broadcast", "alltoall", "reduce_scatter"]),
    "op": st.sampled_from(["sum", "avg", "min", "max"]),
})


def _rows(exp: oracle.Expect, lo: int, hi: int) -> oracle.Expect:
    return oracle.Expect(exp.value[lo:hi], exp.bound[lo:hi], exp.nonfinite[lo:hi], exp.nan[lo:hi], exp.sign[lo:hi])


def moves_case(seed, rows, tail, dtype, special, kind, move, op) -> str:
    """Run one allgather / broadcast / alltoall / reduce_scatter case; return "" or what went wrong."""
    special = special and dtype not in oracle.INT_DTYPES
    rank = COMM.rank
    what = f"{move} {dtype} rows={rows} tail={tail} {kind}"

    def data(r: int, n_rows: int) -> np.ndarray:
        return oracle.rank_data(seed, r, (n_rows,) + tail, dtype, special, 3.0, P)

    if move == "allgather":
        sent = _to(data(rank, rows + rank), kind)
        got = COMM.allgather(sent)
        want = np.concatenate([data(r, rows + r) for r in range(P)])
    elif move == "broadcast":
        root = seed % P
        sent = _to(data(rank, rows), kind)
        got = COMM.broadcast(sent, root)
        want = data(root, rows)
    elif move == "alltoall":
        sent = _to(data(rank, rows * P), kind)
        got = COMM.alltoall(sent)
        want = np.concatenate([data(r, rows * P)[rank * rows:(rank + 1) * rows] for r in range(P)])
    else:
        if op == "avg" and dtype in oracle.INT_DTYPES:
            op = "sum"
        sent = _to(data(rank, rows), kind)
        got = COMM.reduce_scatter(sent, op)
        counts = [len(c) for c in np.array_split(np.arange(rows), P)]
        lo = sum(counts[:rank])
        exp = oracle.reduce_expect(np.stack([data(r, rows) for r in range(P)]), op, dtype)
        if type(got) is not type(sent) or got.dtype != sent.dtype:
            return f"{what}: returned {type(got).__name__} {got.dtype} for {type(sent).__name__} {sent.dtype}"
        return oracle.check(_back(got), _rows(exp, lo, lo + counts[rank]), f"{what} {op}")
    if type(got) is not type(sent):
        return f"{what}: returned {type(got).__name__} for {type(sent).__name__}"
    return oracle.same_bits(_back(got), want, what)


@given(case=moves_cases)
def test_moves_fuzz(case):
    _agree("moves", moves_case(**case))


# ------------------------------------------------------------------ compressed all-reduce
BASES = ["none", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "nvfp4"]
codec_specs = st.builds(
    lambda ef, size, base, block, sr, seed: "+".join(
        (["ef"] if ef else [])
        + ([f"hadamard:size={size},seed={seed}"] if size else [])
        + [base + ":" + ",".join(([f"block={block}"] if base.startswith("fp8") and block else [])
                                 + (["sr", f"seed={seed}"] if sr and base.startswith(("fp8", "nvfp4")) else []))]
    ).rstrip(":"),
    ef=st.booleans(), size=st.sampled_from([0, 0, 0, 2, 4, 16, 32, 128]), base=st.sampled_from(BASES),
    block=st.sampled_from([0, 0, 1, 5, 16, 100, 128, 1000]), sr=st.booleans(), seed=st.integers(0, 2**32 - 1),
)
compressed_cases = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32 - 1), "n": st.one_of(st.integers(0, 3000), st.integers(3000, 40_000)),
    "spec": codec_specs, "op": st.sampled_from(["sum", "avg", "avg", "max"]), "special": st.booleans(),
    "path": st.sampled_from(["default", "gathered", "pipelined"]),
    "segment": st.sampled_from([None, 1, 2048, 8192, 65536]),
    "dtype": st.sampled_from(["float32", "float32", "float64", "float16", "bfloat16"]),
    "inplace": st.booleans(), "kind": st.sampled_from(["numpy", "numpy", "torch"]),
})


def _compressed_call(path: str, x: Any, op: str, codec: Any, name: str, segment: int | None, out: Any) -> Any:
    if path == "default":
        return cw.allreduce(x, op, codec=codec, name=name, out=out)
    if path == "gathered":
        return collective.compressed_allreduce(COMM, x, op, codec=codec, name=name, out=out, small_bytes=1 << 62)
    return collective.compressed_allreduce(COMM, x, op, codec=codec, name=name, out=out, small_bytes=0,
                                           segment_bytes=segment)


def compressed_case(seed, n, spec, op, special, path, segment, dtype, inplace, kind) -> str:
    """Run one compressed all-reduce case (two calls for error feedback); return "" or what went wrong."""
    stages = oracle.parse_stages(spec)
    lossless = all(s.kind in ("none", "ef") for s in stages)
    ef = stages[0].kind == "ef"
    xs = _inputs(seed, (n,), dtype, special, 3.0)
    what = f"{spec} {op} n={n} {dtype} path={path} segment={segment} special={special}"
    codec = get(spec) if ef else spec  # a fresh object: its residuals start at zero and go with it
    if op == "max" and not lossless:
        try:
            _compressed_call(path, _to(xs[COMM.rank].copy(), kind), op, codec, "fuzz", segment, None)
        except ValueError as exc:
            return "" if "max" in str(exc) else f"{what}: ValueError does not name the op: {exc}"
        return f"{what}: op='max' on a lossy codec did not raise ValueError"
    if lossless:
        expects = [oracle.reduce_expect(np.stack(xs), op, dtype)] * 2
    else:
        two_phase = P > 1 and (path == "pipelined" or (path == "default" and n * 4 >= collective.SMALL_BYTES))
        flat = [x.astype(np.float64) for x in xs]
        expects = oracle.compressed_expect(flat, op, stages, two_phase, dtype, calls=2, ef_stages=int(ef))
    for call in range(2 if ef else 1):
        sent = _to(xs[COMM.rank].copy(), kind)
        got = _compressed_call(path, sent, op, codec, "fuzz", segment, sent if inplace else None)
        label = f"{what} call {call + 1}"
        problem = (_kind_dtype(got, sent) or oracle.check(_back(got), expects[call], label)
                   or (oracle.same_bits(_back(sent), _back(got), label + " (out=x)") if inplace else ""))
        problem = problem or _same_everywhere(_back(got))
        if problem:
            return problem
    return ""


@given(case=compressed_cases)
def test_compressed_allreduce_fuzz(case):
    _agree("compressed_allreduce", compressed_case(**case))


# ------------------------------------------------------------------ the checker catches broken collectives
_PERTURB = {"float64": 2.0**-40, "float32": 2.0**-14, "float16": 2.0**-7, "bfloat16": 2.0**-4}
"""Relative error a broken plain collective adds: at least 16x each dtype's bound (oracle docstring)."""


def _like(values: np.ndarray, y: Any) -> Any:
    """Return ``values`` as the same array kind as ``y`` (a broken collective keeps the kind)."""
    return values if isinstance(y, np.ndarray) else _to(values, "torch")


def _nan_like(y: Any) -> Any:
    values = _back(y).copy()
    if values.dtype.kind in "iu":
        values ^= 1
    else:
        values[...] = np.nan
    return _like(values, y)


def _off_by(y: Any, relative: float) -> Any:
    values = _back(y)
    if values.dtype.kind in "iu":
        return _like(values ^ 1, y)
    wide = values.astype(np.float64)
    return _like((wide + np.where(wide < 0, -1, 1) * (relative * np.abs(wide) + 1e-30)).astype(values.dtype), y)


def _broken(kind: str, original: Any, plain: bool) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        y = original(*args, **kwargs)
        if kind == "nan":
            return _nan_like(y)
        if plain:
            return _off_by(y, _PERTURB.get(str(_back(y).dtype), 0.0))
        codec = kwargs["codec"]
        a, _ = oracle.chain_bound(oracle.parse_stages(codec if isinstance(codec, str) else codec.spec), np.ones(1))
        return _off_by(y, 8 * P * a + 2.0**-8)  # beyond P ranks' quantisation errors, both phases
    return run


PROBES = {
    "allreduce": (allreduce_cases.filter(lambda c: c["dtype"] in ("float32", "float16", "bfloat16", "float64")
                                         and c["op"] in ("sum", "avg") and not c["inplace"]), allreduce_case),
    "compressed_allreduce": (compressed_cases.filter(lambda c: c["op"] != "max" and not c["inplace"]
                                                     and not c["spec"].startswith(("none", "ef+none"))),
                             compressed_case),
}


@pytest.mark.parametrize("breakage", ["nan", "off"])
@pytest.mark.parametrize("target", list(PROBES))
def test_checker_catches_broken_collectives(target, breakage, monkeypatch):
    strategy, case_fn = PROBES[target]
    if target == "allreduce":
        monkeypatch.setattr(type(COMM), "allreduce", _broken(breakage, type(COMM).allreduce, True))
    else:
        monkeypatch.setattr(collective, "compressed_allreduce",
                            _broken(breakage, collective.compressed_allreduce, False))

    @settings(max_examples=40, phases=[Phase.generate], derandomize=True, database=None, deadline=None)
    @given(case=strategy)
    def probe(case):
        problem = case_fn(**case)
        flags = COMM.allgather_object(problem)
        assert not any(flags), flags

    with pytest.raises(AssertionError):
        probe()
