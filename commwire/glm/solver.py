"""SGD and CA-SGD on the 1D block-column layout, and the distributed objective.

Both solvers run the same engine: `sgd` is one SStepGram exchange of b margins
per step (s = 1), `casgd` one exchange of s*b margins and the block-lower Gram
per s steps followed by the inner recurrence. Communication happens only inside
SStepGram.exchange (training), in objective/margins (evaluation) and, for
s="auto", in the few timed all-reduces that choose s (commwire.glm._auto).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from typing import Any

import numpy as np

from .._validate import positive_int
from ..codecs import blas_threads
from ..comm import arrays
from ..comm.runtime import default_comm
from ..schedules import SStepGram
from . import _auto, _losses
from ._auto import AutoS
from .data import ColumnBlocks
from .precision import Precision, bf16_bits_to_float32, get_precision, round_bf16_bits

__all__ = ["SolverConfig", "FitResult", "solve", "objective", "margins", "batch_indices"]

SOLVERS = ("sgd", "casgd")
KERNELS = ("auto", "numba", "xp")
# A run has diverged once a step's mean batch loss exceeds this multiple of the
# first batch's (losses are >= 0, so a stable run stays far below it).
DIVERGENCE_FACTOR = 1e4
_ROW_CHUNK = 65536  # rows per pass of setup scans and of evaluation, bounds temporaries


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SolverConfig:
    """Configure one SGD / CA-SGD run."""

    loss: str = "logistic"
    """"logistic" (labels {-1,+1} or {0,1}), "least_squares" or "poisson" (log link)."""
    solver: str = "casgd"
    """"sgd": one allreduce of b margins per step; "casgd": one Gram exchange per s steps."""
    s: int | str = 8
    """Inner steps per Gram exchange (casgd only); "auto": chosen by solve from the measured link and Gram cost."""
    batch_size: int = 64
    """Rows per inner step (b)."""
    lr: float = 0.1
    """Constant step size eta."""
    l2: float = 0.0
    """L2 coefficient lambda: the objective adds lambda/2 ||w||^2 (the intercept is not penalised)."""
    precision: Precision | str | dict = "fp64"
    """A preset ("fp64", "fp32", "mixed"), a dict of slots or a Precision."""
    max_iter: int = 100
    """Epochs (floor(m / b) steps each)."""
    max_steps: int | None = None
    """Inner steps to run, overriding max_iter (benchmarks fix H this way)."""
    tol: float | None = 1e-4
    """Stop when the epoch loss has not improved by tol for n_iter_no_change epochs; None: never."""
    n_iter_no_change: int = 5
    """Epochs without improvement before stopping."""
    fit_intercept: bool = True
    """Learn an unpenalised intercept (kept replicated on every rank, never communicated)."""
    seed: int = 0
    """Seed of the batch order, the same on every rank."""
    kernels: str = "auto"
    """"numba" (compiled, CPU), "xp" (array-module code, runs on numpy and cupy) or "auto"."""

    def __post_init__(self) -> None:
        _losses.loss_code(self.loss)
        if self.solver not in SOLVERS:
            raise ValueError(f"solver={self.solver!r} is not supported; choose one of {list(SOLVERS)}")
        if isinstance(self.s, str):
            if self.s != "auto":
                raise ValueError(f"s={self.s!r} is not supported; give a positive integer (inner steps per Gram "
                                 f"exchange) or 'auto' (chosen from the measured link and Gram cost)")
        else:
            positive_int("s", self.s, extra="or 'auto'")
        for name in ("batch_size", "max_iter", "n_iter_no_change"):
            positive_int(name, getattr(self, name))
        positive_int("max_steps", self.max_steps, allow_none=True)
        if not (_is_real(self.lr) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} must be a positive finite number, e.g. lr=0.1")
        if not (_is_real(self.l2) and math.isfinite(self.l2) and self.l2 >= 0):
            raise ValueError(f"l2={self.l2!r} must be a non-negative finite number, e.g. l2=1e-4 (0: no penalty)")
        if self.lr * self.l2 >= 1:
            raise ValueError(
                f"lr*l2={self.lr * self.l2:g} >= 1 flips the sign of the weights every step; lower lr or l2"
            )
        if self.tol is not None and not (_is_real(self.tol) and math.isfinite(self.tol) and self.tol >= 0):
            raise ValueError(f"tol={self.tol!r} must be a non-negative number (e.g. 1e-4) or None (no early stop)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be a non-negative integer")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r} is not supported; choose one of {list(KERNELS)}")
        object.__setattr__(self, "precision", get_precision(self.precision))

    @property
    def auto_s(self) -> bool:
        """Return whether solve chooses s (casgd with s="auto")."""
        return self.solver == "casgd" and self.s == "auto"

    @property
    def steps_per_exchange(self) -> int:
        """Return the inner steps folded into one allreduce (1 for sgd); s="auto" must be resolved first."""
        if self.solver == "sgd":
            return 1
        if self.s == "auto":
            raise ValueError("s='auto' is chosen when solve runs; read FitResult.s (GLM.s_) for the s used")
        return int(self.s)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FitResult:
    """Hold what one run produced on this rank."""

    coef: np.ndarray
    """This rank's slice of the weights (float64 copy)."""
    intercept: float
    loss_curve: list[float]
    """Mean batch loss (before each step's update) per completed epoch, without the L2 term."""
    n_iter: int
    """Epochs completed."""
    n_steps: int
    """Inner steps applied."""
    n_exchanges: int
    """Allreduces the run issued."""
    exchange_bytes: int
    """Bytes this rank handed to those allreduces."""
    converged: bool
    """Whether the tol criterion stopped the run."""
    time_s: float
    """Wall time of the training loop on this rank (setup, choosing s and evaluation excluded)."""
    s: int = 1
    """Inner steps per exchange the run used (1 for sgd; the chosen one for s="auto")."""
    auto: AutoS | None = None
    """How s was chosen (s="auto" only): candidates, measurements, modelled times, tuning time."""


def _is_real(value: Any) -> bool:
    """Return whether ``value`` is a real number (Python or numpy), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def batch_indices(m: int, b: int, n_steps: int, seed: int) -> np.ndarray:
    """Return the (n_steps, b) row indices the solvers visit: per epoch a seeded permutation, cut in batches."""
    stream = _BatchStream(m, b, seed, np)
    return np.stack([stream.take(b).copy() for _ in range(n_steps)]) if n_steps else np.zeros((0, b), np.int64)


class _BatchStream:
    """Serve consecutive row indices; epoch e is permutation(seed, e) cut to floor(m/b)*b rows."""

    def __init__(self, m: int, b: int, seed: int, xp: Any) -> None:
        self.m, self.seed, self.xp = m, seed, xp
        self.epoch_rows = (m // b) * b
        # Two epochs resident: a group that crosses an epoch end is one contiguous slice.
        self.buf = xp.empty(2 * self.epoch_rows, dtype=np.int64)
        self.buf[:self.epoch_rows] = xp.asarray(self._perm(0))
        self.buf[self.epoch_rows:] = xp.asarray(self._perm(1))
        self.next_epoch, self.pos = 2, 0

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.m)[:self.epoch_rows]

    def take(self, n: int) -> Any:
        """Return the next n indices (n <= one epoch) as a view."""
        e = self.epoch_rows
        if self.pos >= e:
            self.buf[:e] = self.buf[e:]
            self.buf[e:] = self.xp.asarray(self._perm(self.next_epoch))
            self.next_epoch += 1
            self.pos -= e
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view


def check_targets(code: int, y: Any) -> np.ndarray:
    """Return the labels as the kernels use them (logistic: +-1), or raise naming the bad values and the fix."""
    y = np.asarray(y.get() if hasattr(y, "get") else y)
    if y.ndim != 1:
        hint = "; pass y.ravel() for a column vector" if y.ndim == 2 and 1 in y.shape else ""
        raise ValueError(f"y must be a 1-D array of labels, got shape {y.shape}{hint}")
    if y.dtype.kind not in "biuf":
        hint = (" (encode the two classes as 0/1, e.g. with sklearn.preprocessing.LabelEncoder)"
                if code == _losses.LOGISTIC else "")
        raise ValueError(f"y has dtype {y.dtype}; numeric labels are needed{hint}")
    if code == _losses.POISSON and y.size:
        wide = y.astype(np.float64)
        negative = wide < 0  # NaN compares False: _losses.check_labels reports it below
        if negative.any():
            i = int(np.nanargmin(wide))
            raise ValueError(f"Poisson labels must be non-negative counts, got min(y)={wide[i]:g} at index {i} "
                             f"({int(negative.sum())} negative values); use loss='least_squares' for signed targets")
    return _losses.check_labels(code, y)


def _first_nonfinite(X: Any) -> tuple[int, int, float] | None:
    """Return (row, local column, value) of the first NaN/Inf in row order, or None."""
    for lo in range(0, X.shape[0], _ROW_CHUNK):
        part = X[lo:lo + _ROW_CHUNK]
        finite = np.isfinite(part)
        finite = finite.get() if hasattr(finite, "get") else finite
        if not finite.all():
            row, col = np.unravel_index(int(np.argmin(finite)), finite.shape)
            value = part[row, col]
            return lo + int(row), int(col), float(value.get() if hasattr(value, "get") else value)
    return None


def _check_blocks(blocks: ColumnBlocks, cfg: SolverConfig, comm: Any) -> np.ndarray:
    """Validate the distributed data collectively (every rank raises the same error); return labels."""
    X = blocks.X
    kind = np.dtype(X.dtype).kind
    bad = _first_nonfinite(X) if kind in "biuf" else None
    info = comm.allgather_object((int(X.shape[0]), str(X.dtype), kind in "biuf", bad, int(blocks.start)))
    rows = [r for r, *_ in info]
    if len(set(rows)) > 1:
        raise ValueError(f"ranks' column blocks have different row counts {rows} (rank order); "
                         f"every block needs all m rows")
    for rank, (_, dtype, numeric, _, _) in enumerate(info):
        if not numeric:
            raise ValueError(f"X has dtype {dtype} (rank {rank}'s block); GLM needs real numbers: convert with "
                             f"X.astype(float) or encode categorical columns (sklearn.preprocessing.OneHotEncoder)")
    for rank, (_, _, _, found, start) in enumerate(info):
        if found is not None:
            row, col, value = found
            raise ValueError(f"X holds NaN/Inf: rank {rank}'s block, row {row}, column {start + col} (value "
                             f"{value!r}); remove or impute non-finite values first (sklearn.impute.SimpleImputer)")
    m, b = rows[0], cfg.batch_size
    if cfg.auto_s:  # s >= 1 is chosen to fit the rows; only the batch itself must
        if m == 0:
            raise ValueError(f"X has 0 rows; fitting needs at least batch_size={b} samples")
        y = check_targets(_losses.loss_code(cfg.loss), blocks.y)
        if b > m:
            raise ValueError(f"batch_size={b} exceeds the {m} rows; lower batch_size")
        return y
    s = cfg.steps_per_exchange
    if m == 0:
        raise ValueError(f"X has 0 rows; fitting needs at least s*batch_size={s}*{b}={s * b} samples")
    y = check_targets(_losses.loss_code(cfg.loss), blocks.y)
    if s * b > m:
        raise ValueError(f"s*batch_size={s}*{b}={s * b} exceeds the {m} rows; lower s or batch_size")
    return y


def _store(X: Any, prec: Precision, xp: Any) -> Any:
    """Return X as the solver keeps it: storage dtype, values rounded to the Gram input precision."""
    if prec.storage == "bfloat16":
        return round_bf16_bits(xp.asarray(X, dtype=xp.float32), xp)
    store = xp.asarray(X, dtype=prec.storage)
    if prec.gram_inputs == "bfloat16":
        # Rounding once here equals rounding each gathered row: same values, no per-step cost.
        return bf16_bits_to_float32(round_bf16_bits(store, xp), xp).astype(store.dtype)
    if prec.gram_inputs == "float32" and prec.storage == "float64":
        return store.astype(np.float32).astype(np.float64)
    return store


class _Engine:
    """Hold every buffer of one run (allocated once) and run outer iterations."""

    def __init__(self, blocks: ColumnBlocks, y: np.ndarray, cfg: SolverConfig, comm: Any,
                 store: Any = None, check: bool = True) -> None:
        """Allocate a run's buffers; ``store``: X as _store keeps it (shared), ``check``: stop on divergence."""
        xp, xp_name = arrays.array_module(blocks.X), arrays.kind_of(blocks.X)
        self.check = check
        prec = cfg.precision
        self.xp, self.cfg = xp, cfg
        self.code = _losses.loss_code(cfg.loss)
        s, b, n = cfg.steps_per_exchange, cfg.batch_size, int(blocks.X.shape[1])
        self.s, self.b = s, b
        acc, rec, upd = prec.dtype("accumulation"), prec.dtype("recurrence"), prec.dtype("update")
        self.rec, self.T_upd = rec, upd.type
        self.store = _store(blocks.X, prec, xp) if store is None else store
        self.y = xp.asarray(y, dtype=rec)
        const = _losses.label_constant(self.code, y)
        self.const = xp.asarray(const, dtype=rec)
        self.gram = SStepGram(s=s, b=b, n_local=n, dtype=acc, comm_dtype=prec.dtype("communication"),
                              comm=comm, xp=xp_name)
        self.w = self.gram.weights if upd == acc else xp.zeros(n, dtype=upd)
        self.g = xp.empty(n, dtype=acc)
        self.r = xp.empty(s * b, dtype=rec)
        self.rs = xp.empty(s * b, dtype=acc)
        self.icpt_hist = xp.empty(s, dtype=rec)
        self.losses = np.zeros(s)
        self.step = cfg.lr / b
        self.cpow64 = (1.0 - cfg.lr * cfg.l2) ** np.arange(s + 1, dtype=np.float64)
        self.cpow = xp.asarray(self.cpow64, dtype=rec)
        self.cpow_upd = xp.asarray(self.cpow64, dtype=upd)
        self.params = xp.asarray([self.step, 0.0], dtype=rec)  # [step, intercept] for the kernel
        self.intercept = _losses.initial_intercept(self.code, y) if cfg.fit_intercept else 0.0
        self.rows_t = self.gram.rows.T  # (n x s*b) view: Y^T for the update GEMV
        # The recurrence reads the payload in its own dtype; a wider wire is narrowed once.
        wire = prec.dtype("communication")
        self.narrow = None if wire == rec else xp.empty(self.gram.words(s, b), dtype=rec)
        use_numba = cfg.kernels == "numba" or (cfg.kernels == "auto" and xp is np)
        if use_numba and xp is not np:
            raise ValueError("kernels='numba' runs on numpy arrays only; use kernels='xp' or 'auto' for cupy")
        if use_numba:
            from . import _kernels

            self._k = _kernels
            self.scratch = np.empty(n, dtype=np.uint32)
            self.u = np.empty(s * b, dtype=rec)
            self.gather, self.recur, self.update = self._gather_numba, self._recur_numba, self._update_numba
        else:
            # c^(j-1-t) for block t < j, laid out per row j, so row j times r is the scaled residual stack.
            scales = np.zeros((s, s * b))
            for j in range(s):
                for t in range(j):
                    scales[j, t * b:(t + 1) * b] = self.cpow64[j - 1 - t]
            self.scales = xp.asarray(scales, dtype=rec)
            self.gather, self.recur, self.update = self._gather_xp, self._recur_xp, self._update_xp

    # ------------------------------------------------------------- numba (CPU)
    def _gather_numba(self, idx: Any, out: Any) -> None:
        if self.store.dtype == np.uint16:
            self._k.gather_bf16(self.store, idx, out, self.scratch)
        else:
            self._k.gather_float(self.store, idx, out)

    def _recur_numba(self, payload: Any, idx: Any, k: int) -> float:
        if self.narrow is not None:
            narrowed = self.narrow[:payload.size]
            np.copyto(narrowed, payload, casting="same_kind")
            payload = narrowed
        self.params[1] = self.intercept
        return self._k.recurrence(payload, self.y, self.const, idx, self.b, k, self.code, self.params,
                                  self.cfg.fit_intercept, self.cpow, self.r, self.u, self.rs,
                                  self.icpt_hist, self.losses)

    def _update_numba(self, kb: int) -> None:
        if kb == self.s * self.b:
            np.dot(self.rows_t, self.rs, out=self.g)
        else:
            np.dot(self.rows_t[:, :kb], self.rs[:kb], out=self.g)
        self._k.scale_add(self.w, self.g, self.cpow_upd, kb // self.b, self.gram.weights)

    # ------------------------------------------------------ array module (numpy, cupy)
    def _gather_xp(self, idx: Any, out: Any) -> None:
        rows = self.xp.take(self.store, idx, axis=0)
        if self.store.dtype == np.uint16:
            rows = bf16_bits_to_float32(rows, self.xp)
        out[...] = rows

    def _recur_xp(self, payload: Any, idx: Any, k: int) -> float:
        xp, b, rec = self.xp, self.b, self.rec
        icpt = xp.asarray(self.intercept, dtype=rec)
        losses = xp.empty(k, dtype=np.float64)
        for j in range(k):
            chunk = self.gram.chunk(payload, j)
            z = self.cpow[j] * chunk[:, 0].astype(rec) + icpt
            if j:
                z = z - rec.type(self.step) * (chunk[:, 1:].astype(rec) @ (self.scales[j, :j * b] * self.r[:j * b]))
            sel = idx[j * b:(j + 1) * b]
            const = self.const[sel] if self.const.size else None
            loss, res = _losses.pointwise(xp, self.code, z, self.y[sel], const)
            self.r[j * b:(j + 1) * b] = res
            if self.cfg.fit_intercept:
                icpt = icpt - rec.type(self.step) * res.sum()
            self.icpt_hist[j] = icpt
            losses[j] = loss.mean()
        self._fill_rs(k, k)
        self.losses[:k] = losses.get() if hasattr(losses, "get") else losses
        return float(self.losses[:k].sum())

    def _update_xp(self, kb: int) -> None:
        xp = self.xp
        xp.matmul(self.rows_t[:, :kb], self.rs[:kb], out=self.g)
        self.w *= self.T_upd(self.cpow64[kb // self.b])
        self.w += self.g.astype(self.w.dtype, copy=False)
        if self.w is not self.gram.weights:
            self.gram.weights[...] = self.w

    def _fill_rs(self, k: int, used: int) -> None:
        """Set rs = -step c^(used-1-t) r_t for the first `used` of k steps (xp arithmetic)."""
        b = self.b
        factors = -self.step * self.cpow64[used - 1 - np.arange(used)]
        scale = self.xp.asarray(np.repeat(factors, b), dtype=self.rec)
        self.rs[:used * b] = scale * self.r[:used * b]

    # --------------------------------------------------------------- the loop
    def run(self, m: int, stream: _BatchStream | None = None) -> FitResult:
        """Run the configured steps (batches from ``stream``, default a new one); return this rank's result."""
        cfg, s, b = self.cfg, self.s, self.b
        spe = m // b
        total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.max_iter * spe
        stream = _BatchStream(m, b, cfg.seed, self.xp) if stream is None else stream
        rows = self.gram.rows
        done, in_epoch, epoch_sum = 0, 0, 0.0
        curve: list[float] = []
        best, stale, converged = math.inf, 0, False
        limit = None
        exchanges = nbytes = 0
        start = time.perf_counter()
        while done < total_steps:
            k = min(s, total_steps - done)
            idx = stream.take(k * b)
            self.gather(idx, rows if k == s else rows[:k * b])
            payload = self.gram.exchange(k)
            exchanges += 1
            nbytes += self.gram.nbytes(k)
            total = self.recur(payload, idx, k)
            if limit is None:
                limit = DIVERGENCE_FACTOR * max(float(self.losses[0]), float(np.finfo(self.rec).tiny))
            if not total <= limit * k and self.check:  # also catches NaN
                self._diverged(done, k, limit)
            used, stop = k, False
            if in_epoch + k < spe:
                epoch_sum += total
                in_epoch += k
            else:
                # At most one epoch ends in a group, because k <= s <= floor(m/b).
                end = spe - in_epoch
                mean = (epoch_sum + float(self.losses[:end].sum())) / spe
                curve.append(mean)
                if cfg.tol is not None:
                    stale = stale + 1 if mean > best - cfg.tol else 0
                    best = min(best, mean)
                    if stale >= cfg.n_iter_no_change:
                        stop = converged = True
                        used = end  # drop the steps after the epoch end: SGD would not take them
                epoch_sum = float(self.losses[end:k].sum())
                in_epoch = k - end
            if used < k:
                self._fill_rs(k, used)
            self.update(used * b)
            self.intercept = float(self.icpt_hist[used - 1])
            done += used
            if stop:
                break
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()  # device work is asynchronous
        elapsed = time.perf_counter() - start
        coef = self.w.get() if hasattr(self.w, "get") else np.array(self.w, dtype=np.float64)
        return FitResult(coef=np.asarray(coef, dtype=np.float64), intercept=float(self.intercept),
                         loss_curve=curve, n_iter=len(curve), n_steps=done, n_exchanges=exchanges,
                         exchange_bytes=nbytes, converged=converged, time_s=elapsed, s=s)

    def _diverged(self, done: int, k: int, limit: float) -> None:
        losses = self.losses[:k]
        bad = int(np.argmax(np.where(np.isfinite(losses), losses, np.inf)))
        raise ValueError(
            f"lr={self.cfg.lr:g} diverged: mean batch loss {float(losses[bad]):.3g} at step {done + bad} "
            f"(limit {limit:.3g}: {DIVERGENCE_FACTOR:g}x the first batch's); lower lr, e.g. lr={self.cfg.lr / 10:g}"
        )


def _local_work(blocks: ColumnBlocks, y: np.ndarray, cfg: SolverConfig, store: Any) -> Any:
    """Return work(s, k): seconds per exchange of k exchanges of the training loop at s, with no allreduce.

    It runs the same engine and loop as training, over a communicator that sends
    nothing (so the Gram, recurrence, update and the loop's own overhead are all in
    it); engines are kept per s and their weights zeroed before each timing.
    """
    m = int(blocks.X.shape[0])
    stream = _BatchStream(m, cfg.batch_size, cfg.seed, arrays.array_module(blocks.X))
    engines: dict[int, tuple[_Engine, float]] = {}

    def work(s: int, exchanges: int) -> float:
        trial = dataclasses.replace(cfg, s=s, max_steps=exchanges * s, tol=None)
        if s not in engines:
            engine = _Engine(blocks, y, trial, _auto.NO_COMM, store=store, check=False)
            engines[s] = (engine, engine.intercept)
        engine, intercept = engines[s]
        engine.cfg, engine.intercept = trial, intercept
        engine.w[...] = 0
        engine.gram.weights[...] = 0
        return engine.run(m, stream).time_s / exchanges

    return work


def solve(blocks: ColumnBlocks, config: SolverConfig | None = None, *, comm: Any = None,
          coef_init: Any = None, intercept_init: float | None = None, **params: Any) -> FitResult:
    """Train on this rank's column block; every rank of comm calls this with its block.

    Args:
        blocks: this rank's ColumnBlocks (see commwire.glm.data).
        config: the run's settings; keyword params override or replace it.
        comm: the Communicator (None: the world, initialising commwire if needed).
        coef_init: start from these weights of this rank's columns (default zeros), e.g. to
            go on from a commit of an elastic run.
        intercept_init: start from this intercept (default: the loss's optimal constant).
    """
    cfg = config if config is not None else SolverConfig(**params)
    if config is not None and params:
        cfg = dataclasses.replace(config, **params)
    comm = default_comm(comm, init_if_needed=True)
    y = _check_blocks(blocks, cfg, comm)
    m = int(blocks.X.shape[0])
    with blas_threads():  # this rank's share of the cores, not one BLAS thread per core per rank
        store = _store(blocks.X, cfg.precision, arrays.array_module(blocks.X))
        auto = None
        if cfg.auto_s:
            auto = _auto.choose(comm, cfg.batch_size, m, cfg.precision.dtype("communication"),
                                _local_work(blocks, y, cfg, store), xp=arrays.array_module(blocks.X))
            cfg = dataclasses.replace(cfg, s=auto.s)
        engine = _Engine(blocks, y, cfg, comm, store=store)
        if coef_init is not None:
            start = np.asarray(coef_init, dtype=np.float64).ravel()
            if start.shape != (int(blocks.X.shape[1]),) or not np.all(np.isfinite(start)):
                raise ValueError(f"coef_init has shape {start.shape} (finite: {bool(np.all(np.isfinite(start)))}); "
                                 f"give {int(blocks.X.shape[1])} finite weights, this rank's columns")
            engine.w[...] = engine.xp.asarray(start, dtype=engine.w.dtype)
            if engine.w is not engine.gram.weights:
                engine.gram.weights[...] = engine.w
        if intercept_init is not None:
            engine.intercept = float(intercept_init)
        if comm.size > 1:
            # Ranks finish the setup (a BF16 copy of X takes a few hundred ms) at different
            # times; start the clocks together so time_s is the training loop, not that skew.
            comm.barrier()
        result = engine.run(m)
    return result if auto is None else dataclasses.replace(result, auto=auto)


def margins(blocks: ColumnBlocks, coef: Any, intercept: float = 0.0, *, comm: Any = None,
            extra: float | None = None) -> tuple[np.ndarray, float | None]:
    """Return X w + intercept (all m rows, every rank) and the sum over ranks of `extra`, in one allreduce."""
    comm = default_comm(comm, init_if_needed=True)
    X, m = blocks.X, blocks.X.shape[0]
    w = np.asarray(coef.get() if hasattr(coef, "get") else coef, dtype=np.float64)
    buf = np.zeros(m + 1)
    for lo in range(0, m, _ROW_CHUNK):
        part = X[lo:lo + _ROW_CHUNK]
        part = part.get() if hasattr(part, "get") else part
        buf[lo:lo + part.shape[0]] = np.asarray(part, dtype=np.float64) @ w
    buf[m] = 0.0 if extra is None else extra
    comm.allreduce(buf, op="sum", out=buf)
    return buf[:m] + intercept, (None if extra is None else float(buf[m]))


def objective(blocks: ColumnBlocks, coef: Any, intercept: float = 0.0, *, loss: str = "logistic",
              l2: float = 0.0, comm: Any = None) -> float:
    """Return mean loss + l2/2 ||w||^2 over all rows in float64 (one allreduce of m+1 numbers)."""
    code = _losses.loss_code(loss)
    y = check_targets(code, blocks.y)
    w = np.asarray(coef.get() if hasattr(coef, "get") else coef, dtype=np.float64)
    z, sq = margins(blocks, w, intercept, comm=comm, extra=float(w @ w))
    const = _losses.label_constant(code, y)
    values, _ = _losses.pointwise(np, code, z, y, const)
    return float(np.mean(values) + 0.5 * l2 * sq)
