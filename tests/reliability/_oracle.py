"""Independent references and error bounds for the fuzz targets; imported as ``_oracle``.

Nothing here calls commwire. A reference is float64 numpy computed from every
rank's input (each rank regenerates them all from the case seed with
:func:`rank_data`); a bound comes from the number formats as
``shared/papers/formats.md`` defines them (restated in :data:`FORMATS`); and
:func:`check` compares every element: finite ones against the bound, non-finite
ones exactly (NaN stays NaN, ±Inf keeps its sign where the sign is determined).

Plain collectives, per element i on P ranks, with S_i = sum_r |x_r,i| (avg: S_i / P):

| dtype | sum / avg | min / max / moves |
|---|---|---|
| float64 | 2P·2^-53·S_i | exact |
| float32 | 2P·2^-24·S_i + 2^-149 | exact |
| float16 | 2P·2^-24·S_i + 2^-11·\\|want_i\\| + 2^-25 | exact |
| bfloat16 | 2P·2^-24·S_i + 2^-8·\\|want_i\\| + 2^-134 | exact |
| int32 / int64 / uint8 | exact | exact |

(2P·u: P-1 additions in the accumulation type, the avg division, and the P-1
roundings of the float64 reference itself; 16-bit floats are summed in float32
and rounded once, hence the extra half-ulp of the output format and its
smallest subnormal.)

Lossy codecs. One quantisation of x, in a group (tensor, chunk or block) whose
scale is s, into a format with M mantissa bits, largest finite F and smallest
subnormal d, with r = 1/2 for round-to-nearest-even and r = 1 for stochastic
rounding (an error below one step)::

    |Q(x) - x| <= r·(2^-M·|x| + d·s) + max(|x| - F·s, 0)          (all float32 slack added)

- fp16 / bf16 casts: s = 1 (saturation beyond F is the last term);
- FP8: s = max(amax / F, 2^-126), amax of the finite values of the tensor (or
  chunk) or of the ``block``; x·(1/s) never exceeds F, so no saturation term:
  E4M3 (RNE) gives 2^-4·|x| + 2^-10·s, E5M2 2^-3·|x| + 2^-17·s;
- NVFP4: s = e4m3(block_amax / 6 / s_g)·s_g with s_g = max(amax / 2688, 2^-117); the E4M3
  rounding of the block scale (2^-4 relative, 2^-10 absolute when subnormal, a
  floor of 2^-9) bounds s <= (1+2^-4)·block_amax/6 + 2^-9·s_g, and lets a value
  reach up to 6/(1-2^-4) of the scale, so the saturation term is at most
  2^-4·|x| + 6·2^-10·s_g;
- Hadamard (orthonormal blocks of ``size``): the rotated value has |y_j| <= ||x_block||_2;
  the error in original coordinates is the inverse rotation of the rotated error,
  so |err_i| <= ||err_block||_2 <= a·||x_block||_2 + ||b_block||_2 when the inner
  codec gives |err_j| <= a·|y_j| + b_j; plus 2·size^1.5·2^-24·||x_block||_2 for
  the float32 matrix products;
- error feedback: the first call of a key is the inner codec; later calls add
  the carried residual, bounded by the previous call's error (``residual=``).

Where a block bound is needed, the block's amax is taken over the window
[i - block + 1, i + block - 1], which holds element i's block however the
collective cuts the tensor into chunks, and the tensor's amax bounds any
chunk's. The compressed all-reduce quantises each rank's chunk (phase 1), sums
in float32 and, on the pipelined path, quantises the reduced chunk again
(phase 2): the bound is the sum of the phase-1 bounds of every rank plus the
phase-2 bound of a value no larger than |want| + that sum.

Non-finite input: casts, FP8 E5M2 and ``none`` keep NaN and ±Inf element-wise;
FP8 E4M3 (no Inf) turns ±Inf into NaN; NVFP4 makes its whole 16-element block
NaN; Hadamard spreads a non-finite value over its rotation block (NaN where
the input had NaN; ±Inf or NaN elsewhere, so only non-finiteness is checked).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import ml_dtypes
import numpy as np
from scipy.ndimage import maximum_filter1d

BF16 = np.dtype(ml_dtypes.bfloat16)
INT_DTYPES = ("int32", "int64", "uint8")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Format:
    """One number format as formats.md gives it."""

    man_bits: int
    max_finite: float
    min_subnormal: float
    has_inf: bool


FORMATS = {  # formats.md, table "Low-precision formats on the wire"
    "e4m3": Format(3, 448.0, 2.0**-9, False),
    "e5m2": Format(2, 57344.0, 2.0**-16, True),
    "e2m1": Format(1, 6.0, 0.5, False),
    "fp16": Format(10, 65504.0, 2.0**-24, True),
    "bf16": Format(7, float((2 - 2.0**-7) * 2.0**127), 2.0**-133, True),
}
UNIT = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
"""Unit roundoff (half an ulp, relative) of round-to-nearest-even in each float dtype."""
TINY = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150, "float64": 0.0}
"""Half the smallest subnormal of each float dtype: the absolute rounding error near zero."""
_F32_SLACK = 2.0**-21  # a few float32 roundings per quantisation (x * (1/s), code * s)


def np_dtype(name: str) -> np.dtype:
    """Return the numpy dtype called ``name`` (bfloat16 from ml_dtypes)."""
    return BF16 if name == "bfloat16" else np.dtype(name)


# ---------------------------------------------------------------- inputs
SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 0.0)


def rank_data(seed: int, rank: int, shape: tuple[int, ...], dtype: str, special: bool = False,
              scale: float = 3.0, nranks: int = 1) -> np.ndarray:
    """Return rank ``rank``'s input of a case: any rank can rebuild every rank's input from ``seed``.

    Floats are uniform in [-scale, scale] with a few exact zeros, values at the
    dtype's smallest subnormal and (``special``) NaN/±Inf; integers stay small
    enough that a sum over ``nranks`` ranks cannot overflow.
    """
    rng = np.random.default_rng([seed, rank])
    size = int(np.prod(shape, dtype=np.int64))
    if dtype in INT_DTYPES:
        # int64 stays below 2**50 so that the float64 reference of the sum is exact
        hi = {"uint8": 255 // max(nranks, 1), "int32": 2**30 // max(nranks, 1), "int64": 2**50 // max(nranks, 1)}
        lo = 0 if dtype == "uint8" else -hi[dtype]
        return rng.integers(lo, hi[dtype], size=size, endpoint=True).astype(dtype).reshape(shape)
    x = rng.uniform(-scale, scale, size=size)
    if size:
        picks = rng.integers(size, size=rng.integers(0, 3, endpoint=True))
        tiny = float(ml_dtypes.finfo(np_dtype(dtype)).smallest_subnormal)
        x[picks] = rng.choice([0.0, -0.0, tiny, -tiny, scale])
        if special:
            bad = rng.integers(size, size=rng.integers(1, 3, endpoint=True))
            x[bad] = rng.choice(SPECIALS[:3], size=bad.size)
    return x.astype(np_dtype(dtype)).reshape(shape)


# ---------------------------------------------------------------- expectations
@dataclasses.dataclass
class Expect:
    """What one result must be, element by element."""

    value: np.ndarray
    """float64 reference; compared where ``nonfinite`` is False."""
    bound: np.ndarray
    """Largest |got - value| allowed at each finite position (0 means exact)."""
    nonfinite: np.ndarray
    """Positions that must be NaN or ±Inf; every other position must be finite."""
    nan: np.ndarray
    """Positions that must be NaN."""
    sign: np.ndarray
    """+1 / -1 where +Inf / -Inf is required, 0 elsewhere."""


def expect_from(value: np.ndarray, bound: Any, nonfinite: np.ndarray | None = None,
                inf_sign_known: bool = True, all_nan: bool = False) -> Expect:
    """Build an :class:`Expect` from a float64 reference whose non-finite entries say what must be non-finite."""
    value = np.asarray(value, dtype=np.float64)
    ref_bad = ~np.isfinite(value)
    nonfinite = ref_bad if nonfinite is None else (nonfinite | ref_bad)
    nan = np.isnan(value) | (nonfinite if all_nan else np.zeros_like(nonfinite))
    sign = np.zeros(value.shape, dtype=np.int8)
    if inf_sign_known and not all_nan:
        sign[np.isposinf(value)] = 1
        sign[np.isneginf(value)] = -1
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), value.shape)
    return Expect(value=value, bound=bound, nonfinite=nonfinite, nan=nan, sign=sign)


def check(got: Any, exp: Expect, what: str = "") -> str:
    """Return "" when ``got`` meets ``exp`` at every element, else a description of the first failures."""
    got = np.asarray(got)
    if got.shape != exp.value.shape:
        return f"{what}: shape {got.shape}, expected {exp.value.shape}"
    g = got.astype(np.float64)
    problems = []
    finite_g = np.isfinite(g)
    should_be_finite = ~exp.nonfinite
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(g - exp.value)
    rules = (
        ("non-finite where the reference is finite", should_be_finite & ~finite_g),
        ("outside the bound", should_be_finite & finite_g & ~(err <= exp.bound)),
        ("finite where the result must be NaN/Inf", exp.nonfinite & finite_g),
        ("not NaN where the result must be NaN", exp.nan & ~np.isnan(g)),
        ("not +Inf", (exp.sign > 0) & ~np.isposinf(g)),
        ("not -Inf", (exp.sign < 0) & ~np.isneginf(g)),
    )
    for label, mask in rules:
        if mask.any():
            idx = np.flatnonzero(mask)
            i = int(idx[0])
            problems.append(
                f"{idx.size} element(s) {label}, first flat index {i}: got {g.flat[i]!r}, "
                f"want {exp.value.flat[i]!r} ± {exp.bound.flat[i]:.3g}"
            )
    return f"{what}: " + "; ".join(problems) if problems else ""


def same_bits(got: Any, want: np.ndarray, what: str = "") -> str:
    """Return "" when ``got`` has the dtype, shape and bytes of ``want`` (NaN payloads included)."""
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
    a = np.ascontiguousarray(got).view(np.uint8)
    b = np.ascontiguousarray(want).view(np.uint8)
    if not np.array_equal(a, b):
        i = int(np.flatnonzero((a != b).reshape(-1))[0]) // max(want.itemsize, 1)
        return f"{what}: element {i} differs: got {got.reshape(-1)[i]!r}, want {want.reshape(-1)[i]!r}"
    return ""


# ---------------------------------------------------------------- plain reductions
def reduce_expect(stack: np.ndarray, op: str, dtype: str) -> Expect:
    """Return the expectation of a plain all-reduce of ``stack`` (ranks x ...) in ``dtype``."""
    p = stack.shape[0]
    x = stack.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        if op in ("min", "max"):
            want = x.min(0) if op == "min" else x.max(0)  # numpy min/max propagate NaN, as documented
            return expect_from(want, 0.0)
        total = x.sum(0)
        want = total / p if op == "avg" else total
        if dtype in INT_DTYPES:
            return expect_from(want, 0.0)
        magnitude = np.where(np.isfinite(x), np.abs(x), 0.0).sum(0) / (p if op == "avg" else 1)
    acc = "float32" if dtype in ("float16", "bfloat16") else dtype
    bound = 2 * p * UNIT[acc] * magnitude + TINY[acc] * 2
    if acc != dtype:
        bound = bound * (1 + UNIT[dtype]) + UNIT[dtype] * np.where(np.isfinite(want), np.abs(want), 0) + TINY[dtype]
    return expect_from(want, bound)


# ---------------------------------------------------------------- codecs
@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a codec, as the error model sees it."""

    kind: str
    """"none", "cast", "fp8", "nvfp4" (codecs), "hadamard", "ef", "gift" (wrappers)."""
    fmt: str = ""
    """Format name for cast/fp8 ("fp16", "bf16", "e4m3", "e5m2")."""
    block: int = 0
    """fp8: elements per scale (0: one per tensor); hadamard: rotation size."""
    sr: bool = False
    """Stochastic rounding."""


def _window_max(m: np.ndarray, block: int) -> np.ndarray:
    if block <= 1 or m.size == 0:
        return m
    return maximum_filter1d(m, size=min(2 * block - 1, 2 * m.size + 1), mode="constant", cval=0.0)


def _base_bound(stage: Stage, m: np.ndarray) -> tuple[float, np.ndarray]:
    """Return (a, b) with |err_j| <= a·m_j + b_j for one quantisation of values |x_j| <= m_j."""
    r = 1.0 if stage.sr else 0.5
    if stage.kind == "none":
        return 2.0**-24, np.full(m.shape, 2.0**-149)
    if stage.kind == "cast":
        f = FORMATS[stage.fmt]
        return r * 2.0**-f.man_bits + 2.0**-24, r * f.min_subnormal + np.maximum(m - f.max_finite, 0.0) + 2.0**-149
    amax_all = float(m.max()) if m.size else 0.0
    if stage.kind == "fp8":
        f = FORMATS[stage.fmt]
        group = _window_max(m, stage.block) if stage.block else np.full(m.shape, amax_all)
        s = np.maximum(group / f.max_finite, 2.0**-126) * (1 + 2.0**-20)
        return r * 2.0**-f.man_bits + _F32_SLACK, r * f.min_subnormal * s + 2.0**-149
    if stage.kind == "nvfp4":
        sg = max(amax_all / 2688.0, 2.0**-117) * (1 + 2.0**-20)
        s_hi = (1 + 2.0**-4) * _window_max(m, 16) / 6.0 * (1 + 2.0**-20) + 2.0**-9 * sg
        return r * 0.5 + 2.0**-4 + _F32_SLACK, r * 0.5 * s_hi + 6 * 2.0**-10 * sg + 2.0**-149
    raise ValueError(f"not a codec stage: {stage}")


def _block_norms(m: np.ndarray, size: int) -> tuple[np.ndarray, int]:
    full = m.size // size * size
    norms = np.sqrt(np.square(m[:full].reshape(-1, size)).sum(1)) if full else np.zeros(0)
    return norms, full


def chain_bound(stages: list[Stage], m: np.ndarray) -> tuple[float, np.ndarray]:
    """Return (a, b) with |err_i| <= a·m_i + b_i for one encode/decode of a vector with |x_i| <= m_i."""
    if not stages:
        raise ValueError("a codec needs a last stage")
    head, rest = stages[0], stages[1:]
    if head.kind in ("ef", "gift"):  # first call of a key: the inner codec's error (gift: no factors yet)
        return chain_bound(rest, m)
    if head.kind != "hadamard":
        return _base_bound(head, m)
    size = head.block
    norms, full = _block_norms(m, size)
    u = m.copy()
    u[:full] = np.repeat(norms, size)  # |y_j| <= ||x_block||_2 (orthonormal rows)
    a, b = chain_bound(rest, u)
    out = b.copy()
    if full:
        b_norm = np.sqrt(np.square(b[:full].reshape(-1, size)).sum(1))
        slack = (2 * size**1.5 * 2.0**-24 + 2.0**-22) * norms
        per_block = a * norms + b_norm + slack
        out[:full] = np.repeat(per_block, size) - a * m[:full]  # rewritten as a·m_i + b_i
    return a, np.maximum(out, 0.0)


def codec_error(stages: list[Stage], m: np.ndarray) -> np.ndarray:
    """Return the per-element bound of one encode/decode of values with |x_i| <= m_i (m finite)."""
    a, b = chain_bound(stages, m)
    return a * m + b


def spread(stages: list[Stage], bad: np.ndarray) -> np.ndarray:
    """Return the positions that decode non-finite when ``bad`` marks the non-finite inputs."""
    out = bad.copy()
    order = [s for s in stages if s.kind in ("hadamard", "nvfp4")]
    for stage in order + [s for s in reversed(order) if s.kind == "hadamard"]:
        size = stage.block if stage.kind == "hadamard" else 16
        full = out.size // size * size if stage.kind == "hadamard" else -(-out.size // size) * size
        padded = np.zeros(full, dtype=bool)
        padded[:min(full, out.size)] = out[:full]
        hit = np.repeat(padded.reshape(-1, size).any(1), size)[:min(full, out.size)] if full else padded
        out[:hit.size] |= hit
    return out


def keeps_inf(stages: list[Stage]) -> bool:
    """Return whether ±Inf inputs decode as the same ±Inf (element-wise codecs whose format has Inf)."""
    last = stages[-1]
    if any(s.kind == "hadamard" for s in stages):
        return False
    return last.kind == "none" or (last.kind in ("cast", "fp8") and FORMATS[last.fmt].has_inf)


def loses_inf(stages: list[Stage]) -> bool:
    """Return whether every non-finite position decodes as NaN (formats without Inf)."""
    last = stages[-1]
    return last.kind == "nvfp4" or (last.kind == "fp8" and not FORMATS[last.fmt].has_inf)


def _finite_abs(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), np.abs(x), 0.0)


def compressed_expect(inputs: list[np.ndarray], op: str, stages: list[Stage], two_phase: bool,
                      out_dtype: str = "float32", calls: int = 1, ef_stages: int = 0) -> list[Expect]:
    """Return the expectations of ``calls`` consecutive compressed all-reduces of the same inputs.

    ``inputs`` are every rank's flat float64 values (after rounding to the input
    dtype); ``ef_stages`` error-feedback stages outermost carry each call's
    error into the next (residual bounds from the previous call's bound).
    """
    p = len(inputs)
    avg = op in ("avg", "mean", "average")
    div = p if avg else 1
    with np.errstate(invalid="ignore"):
        want = np.sum(inputs, axis=0) / div
    mags = [_finite_abs(x) for x in inputs]
    bad = np.zeros(want.shape, dtype=bool)
    for x in inputs:
        bad |= spread(stages, ~np.isfinite(x))
    res1 = [np.zeros_like(want) for _ in inputs]
    res2 = np.zeros_like(want)
    out = []
    for _ in range(calls):
        e1 = [codec_error(stages, m + ef_stages * r) + ef_stages * r for m, r in zip(mags, res1)]
        total1 = np.sum(e1, axis=0) / div
        bound = total1
        if two_phase:
            m2 = _finite_abs(want) + total1
            e2 = codec_error(stages, m2 + ef_stages * res2) + ef_stages * res2
            bound = bound + e2
            res2 = np.where(bad, 0.0, codec_error(stages, m2 + ef_stages * res2))
        res1 = [np.where(bad, 0.0, codec_error(stages, m + ef_stages * r)) for m, r in zip(mags, res1)]
        bound = bound + (p + 2) * 2.0**-24 * (np.sum(mags, axis=0) / div + total1) + p * 2.0**-149
        if out_dtype in ("float16", "bfloat16"):
            bound = bound + UNIT[out_dtype] * (_finite_abs(want) + bound) + TINY[out_dtype]
        out.append(expect_from(np.where(bad, np.nan if loses_inf(stages) else want, want), bound,
                               nonfinite=bad, inf_sign_known=keeps_inf(stages), all_nan=loses_inf(stages)))
    return out


def parse_stages(spec: str) -> list[Stage]:
    """Return the error-model stages of a canonical spec such as ``"ef+hadamard:size=8+fp8-e4m3:block=16,sr"``."""
    stages = []
    for part in spec.lower().split("+"):
        name, _, opts = part.partition(":")
        options = dict(o.partition("=")[::2] for o in opts.split(",") if o)
        sr = "sr" in options
        if name in ("none", "identity"):
            stages.append(Stage("none"))
        elif name in ("fp16", "bf16"):
            stages.append(Stage("cast", fmt=name))
        elif name.startswith("fp8-"):
            stages.append(Stage("fp8", fmt=name[4:], block=int(options.get("block") or 0), sr=sr))
        elif name == "nvfp4":
            stages.append(Stage("nvfp4", sr=sr))
        elif name == "hadamard":
            stages.append(Stage("hadamard", block=int(options.get("size") or 16)))
        elif name in ("ef", "gift"):
            stages.append(Stage(name))
        else:
            raise ValueError(f"no error model for stage {name!r} of {spec!r}")
    return stages


# ---------------------------------------------------------------- bookkeeping
CASES: dict[str, int] = {}
"""Cases run per fuzz target in this process (printed by conftest.py)."""
FAILED: dict[str, int] = {}
"""Failing cases per target (a failing target also fails its test)."""


def count(target: str, problem: str = "") -> str:
    """Count one case of ``target`` (and its failure when ``problem``); return ``problem``."""
    CASES[target] = CASES.get(target, 0) + 1
    if problem:
        FAILED[target] = FAILED.get(target, 0) + 1
    return problem


def rank_label() -> str:
    """Return " (rank R of P)" under MPI, "" otherwise (without initialising MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.COMM_WORLD.Get_size() == 1:
        return ""
    return f" (rank {mpi.COMM_WORLD.Get_rank()} of {mpi.COMM_WORLD.Get_size()})"
