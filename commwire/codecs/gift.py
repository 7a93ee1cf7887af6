"""GIFT: send weight gradients in input-whitened coordinates (``gift+fp8-e4m3``).

For a linear layer with weight gradient W (d_out × d_in) and input second
moment A = E[a aᵀ] (d_in × d_in), GIFT (Wang et al. 2026, see
``shared/papers/gift.md``) communicates W̃ = c · W S⁻ᵀ instead of W, where
S Sᵀ = Â, a damped model of A, and maps the decoded sum back with
W = W̃ Sᵀ / c. The transform is linear, so if every rank holds the *same* S and
c it commutes with the sum: Σ_r (W_r S⁻ᵀ) = (Σ_r W_r) S⁻ᵀ. S is the symmetric
square root of a low-rank plus isotropic model of A::

    Â = U diag(λ) Uᵀ + σ (I − U Uᵀ) + δ I      (top-r eigenpairs, σ = mean of the rest,
                                                δ = damping · trace(A) / d_in)

so W S⁻¹ = σ'^(-1/2) W + (W U) diag(λ'^(-1/2) − σ'^(-1/2)) Uᵀ costs O(d_out · d_in · r).
``rank=0`` keeps every eigenpair (the full factor).

Why S⁻¹: a gradient is a dual object. Its natural (Fisher-inverse) norm is
||W L_A⁻ᵀ||_F, the norm of exactly the whitened coordinates, so a
relative-precision format whose error is spread evenly over W̃ spreads it
evenly in that norm. Sending W S instead would even the error out in the primal
A-norm, but mapped back through S⁻¹ that error is amplified in the weak input
directions.

Scale normalisation: c = sqrt(trace(A) / trace(A Â⁻¹)). For a gradient
W = δ aᵀ with a ~ A, E||c W S⁻¹||² = E||W||², so the whitened tensor keeps
the magnitude the direct one had, and a scale shared with other tensors (a
fused bucket under one FP8 scale) treats it as it treated W. Without c a layer
whose inputs are large (λ ≫ 1) shrinks by ~1/√λ and can flush to zero beside a
larger tensor (relative error 1.00 where direct FP8 gave 0.03). c comes from
the factor alone, so it is identical on every rank and keeps the map linear.

Lifecycle (the torch adapter, :mod:`commwire.torch.gift`, drives it):

1. :meth:`Gift.declare` the candidate layers (weight name → d_in) and feed input
   statistics with :meth:`Gift.observe` (sums of a aᵀ and row counts);
2. :meth:`Gift.refresh` on the schedule (``profile`` steps, then every
   ``refresh``) — a collective: the statistics are all-reduced, each layer's
   eigendecomposition runs on one rank and the factors are all-gathered, so
   every rank holds bit-identical factors; a digest of them is then compared
   across ranks and a mismatch raises on every rank (:meth:`Gift.verify`);
3. collectives call :meth:`tensor_forward` on whole tensors or fused buckets
   (the layout from :meth:`bind_layout` says where each weight lies), encode
   chunks with the inner codec, and call :meth:`tensor_inverse` on the result.

Tensors that are not selected weight matrices (biases, norms, embeddings, or
any layer before its first factor) pass through unchanged. Layer selection, as
in the paper: a fragility profile (``profile=N``): for the first N steps
nothing is transformed and every declared layer's wire codes are counted —
how many sit at the top code of the format or were flushed to zero from a
non-zero value (:func:`range_hits`); the ``top`` most fragile layers are then
selected (``top=0``: every layer whose hit fraction exceeds the mean over the
declared layers by more than one standard deviation). Or an explicit ``layers``
list. Without either, every declared layer is transformed.

Error feedback (``ef``, on by default) runs in transformed coordinates on the
transformed weights only, on the sending side: the residual of the rank's own
encoding is kept per tensor key, and mapped to the new coordinates at each
refresh (R̃_new = R̃_old T_old⁻¹ T_new) so no carried error is lost or
distorted. The reduce-side re-encoding of the compressed all-reduce is not
compensated. Factors, statistics, profile counts, selection and residuals live
in ``codec.state`` and are saved by ``codec.state_dict()``; after
``load_state_dict`` the stage refuses to transform until :meth:`verify` has
confirmed that every rank loaded the same factors.

Devices: the transform, the residuals and the range-hit counts live on the
device of the tensor they are applied to; each factor keeps one copy of its
terms per device and dtype (made on first use after a refresh), so a step
moves nothing between host and device. Refreshes (eigendecompositions) run on
the host. commwire's compressed all-reduce stages device buffers through host
memory before any codec runs, so there the transform runs on the host copy.

Spec options (``gift:rank=16,profile=100,top=2+fp8-e4m3``): ``rank`` (0 = full),
``refresh``, ``ef`` (0/1), ``profile`` (steps, 0 = off), ``top``. ``damping``,
``normalise`` and an explicit ``layers`` list are set through
:class:`GiftConfig` only and do not appear in the spec.

Example:
    >>> codec = codecs.get("gift+fp8-e4m3")
    >>> codec.declare("fc.weight", 64)
    >>> codec.observe("fc.weight", acts.T @ acts, len(acts))
    >>> codec.refresh()                       # pass the communicator on several ranks
    >>> y = codec.tensor_forward(grad.ravel(), "fc.weight")
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
import zlib
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np

from .._validate import positive_int
from ..comm import arrays
from .base import Codec, CodecState, Span, Wrapper
from .casts import CastCodec
from .formats import FloatFormat
from .fp8 import Fp8Codec
from .nvfp4 import Nvfp4Codec

__all__ = ["Gift", "GiftConfig", "GiftFactor", "factor_from_gram", "range_hits", "Collective"]

_META = ("gift", "meta")
SPEC_OPTIONS = ("rank", "refresh", "ef", "profile", "top")
"""GiftConfig fields that a spec string may set."""


class Collective(Protocol):
    """What :meth:`Gift.refresh` needs from a communicator (``commwire.Communicator`` fits)."""

    rank: int
    size: int

    def allreduce(self, x: Any, op: str = "sum") -> Any: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GiftConfig:
    """Settings of the GIFT stage."""

    rank: int = 32
    """Eigendirections whitened exactly; the rest are treated as isotropic. 0 = full factor."""
    refresh: int = 50
    """Steps between factor refreshes (read by the framework adapter that calls refresh())."""
    damping: float = 1e-3
    """Damping δ relative to the mean eigenvalue: A + δ · trace(A)/d_in · I."""
    ef: bool = True
    """Error feedback in transformed coordinates, on the transformed weights only."""
    profile: int = 0
    """Steps of fragility profiling (no transform) before selecting layers; 0 = off."""
    top: int = 0
    """With profiling: keep this many most fragile layers (0 = those above the mean + 1 sd of the hit fractions)."""
    layers: tuple[str, ...] | None = None
    """Explicit weight names to transform (overrides profiling); None = automatic."""
    normalise: bool = True
    """Scale the whitened tensor by c = sqrt(tr A / tr(A Â⁻¹)) so that it keeps the gradient's magnitude."""

    def __post_init__(self) -> None:
        for name in ("rank", "profile", "top"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"GiftConfig.{name}={value!r}; use a non-negative int")
        positive_int("GiftConfig.refresh", self.refresh, extra="(steps between refreshes)")
        if not isinstance(self.damping, (int, float)) or not 0.0 < float(self.damping) < 1.0:
            raise ValueError(f"GiftConfig.damping={self.damping!r}; use a float in (0, 1), e.g. 1e-3")
        for name in ("ef", "normalise"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GiftConfig.{name}={getattr(self, name)!r}; use True or False")
        if self.layers is not None:
            if isinstance(self.layers, str) or not all(isinstance(n, str) and n for n in self.layers):
                raise ValueError(f"GiftConfig.layers={self.layers!r}; use a tuple of weight names")
            if self.profile:
                raise ValueError(f"GiftConfig: layers={self.layers!r} and profile={self.profile} both select "
                                 "layers; give one of them")


@dataclasses.dataclass(frozen=True, slots=True)
class GiftFactor:
    """One layer's transform: W ↦ c · W S⁻¹ on the wire, S = U diag(√λ) Uᵀ + √σ (I − U Uᵀ)."""

    u: np.ndarray
    """Top eigenvectors, d_in × r, orthonormal columns (float64)."""
    lam: np.ndarray
    """Their damped eigenvalues, r (float64)."""
    sigma: float
    """Damped eigenvalue of the isotropic remainder."""
    scale: float = 1.0
    """The normalisation c (1.0: none)."""
    _terms: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """(array kind, device, dtype, power) -> (scalar, U, coefficients) on that device."""

    @property
    def d(self) -> int:
        """Return the input width d_in."""
        return int(self.u.shape[0])

    def _device_terms(self, w: Any, power: float) -> tuple[float, Any, Any]:
        key = (type(w).__module__, str(getattr(w, "device", "cpu")), str(w.dtype), power)
        found = self._terms.get(key)
        if found is None:
            c = self.scale ** (-2.0 * power)  # forward (power -1/2) multiplies by c, inverse divides
            scalar = float(c * self.sigma**power)
            coeff = c * (self.lam**power - self.sigma**power)
            if isinstance(w, np.ndarray):
                u, coeff = self.u.astype(w.dtype), coeff.astype(w.dtype)
            else:  # a torch tensor: keep the terms on its device, made once
                import torch

                u = torch.as_tensor(self.u, dtype=w.dtype, device=w.device)
                coeff = torch.as_tensor(coeff, dtype=w.dtype, device=w.device)
            found = self._terms[key] = (scalar, u, coeff)
        return found

    def _apply(self, w: Any, power: float) -> Any:
        scalar, u, coeff = self._device_terms(w, power)
        return w * scalar + ((w @ u) * coeff) @ u.T

    def forward(self, w: Any) -> Any:
        """Return c · W S⁻¹ (= c · W S⁻ᵀ) for W of shape (..., d_in), in W's dtype and on its device."""
        return self._apply(w, -0.5)

    def inverse(self, w: Any) -> Any:
        """Return W S / c: the map back from wire coordinates."""
        return self._apply(w, 0.5)

    def matrix(self) -> np.ndarray:
        """Return S, the symmetric square root of the modelled A, as a dense float64 matrix."""
        return self.inverse(np.eye(self.d)) * self.scale

    def wire_matrix(self) -> np.ndarray:
        """Return T = c S⁻¹ (dense float64): the wire carries W T."""
        return self.forward(np.eye(self.d))

    def arrays(self) -> dict[str, Any]:
        """Return the factor as state-dict values."""
        return {"u": self.u, "lam": self.lam, "sigma": float(self.sigma), "scale": float(self.scale)}


def factor_from_gram(gram: np.ndarray, *, rank: int, damping: float, name: str = "layer",
                     warn_singular: bool = True, normalise: bool = True) -> GiftFactor | None:
    """Return the damped low-rank + isotropic factor of the second moment ``gram`` (None if unusable).

    Non-finite or all-zero statistics give None with a RuntimeWarning (the
    caller keeps the previous factor or none); singular statistics are damped,
    with a warning unless ``warn_singular`` is False. With ``normalise`` the
    factor's scale is c = sqrt(tr A / tr(A Â⁻¹)) (see the module docstring).
    """
    a = np.asarray(gram, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"statistics of layer {name!r} must be a square d_in x d_in matrix, got shape {a.shape}")
    d = a.shape[0]
    if rank > d:
        raise ValueError(f"GIFT rank={rank} is larger than the input width {d} of layer {name!r}; "
                         f"use rank <= {d} (rank=0 for the full factor)")
    if not np.all(np.isfinite(a)):
        warnings.warn(f"GIFT: statistics of layer {name!r} hold {int(np.sum(~np.isfinite(a)))} non-finite "
                      "values (overflowing activations?); keeping the previous transform", RuntimeWarning,
                      stacklevel=2)
        return None
    a = (a + a.T) * 0.5
    trace = float(np.trace(a))
    if not trace > 0.0:
        warnings.warn(f"GIFT: statistics of layer {name!r} are all zero (trace {trace:g}); keeping the "
                      "previous transform", RuntimeWarning, stacklevel=2)
        return None
    evals, evecs = np.linalg.eigh(a)
    evals = np.clip(evals[::-1], 0.0, None)
    delta = damping * trace / d
    if warn_singular and evals[-1] <= 1e-7 * evals[0]:
        numerical_rank = int(np.sum(evals > 1e-7 * evals[0]))
        warnings.warn(f"GIFT: statistics of layer {name!r} are singular (numerical rank {numerical_rank} of {d}); "
                      f"damped by {delta:.3g} (damping={damping:g} x mean eigenvalue)", RuntimeWarning,
                      stacklevel=2)
    r = d if rank == 0 else rank
    top = evals[:r]
    rest = max(trace - float(top.sum()), 0.0)
    lam, sigma = top + delta, (rest / (d - r) if r < d else 0.0) + delta
    # tr(A Â⁻¹): the top directions exactly, the remainder through its trace (Â⁻¹ = 1/σ there)
    whitened = float(np.sum(top / lam)) + (rest / sigma if r < d else 0.0)
    scale = float(np.sqrt(trace / whitened)) if normalise and whitened > 0.0 else 1.0
    return GiftFactor(u=np.ascontiguousarray(evecs[:, ::-1][:, :r]), lam=lam, sigma=sigma, scale=scale)


# ---------------------------------------------------------------------- range hits
def _wire_codes(last: Codec, wire: Any, n: int) -> tuple[Any, FloatFormat] | None:
    """Return the element codes of the first ``n`` encoded values (integers) and their format."""
    if isinstance(last, Fp8Codec):
        return wire[:n], last.format
    if isinstance(last, Nvfp4Codec):  # two E2M1 codes per byte, the even element in the low nibble
        packed = wire[:-(-n // 2)]
        pair = (packed & 15, packed >> 4)
        both = np.stack(pair, axis=1) if isinstance(packed, np.ndarray) else _torch_stack(pair)
        return both.reshape(-1)[:n], last.elem
    if isinstance(last, CastCodec):  # little-endian 16-bit codes
        lo, hi = wire[0:2 * n:2], wire[1:2 * n:2]
        if isinstance(wire, np.ndarray):
            return lo.astype(np.int32) | (hi.astype(np.int32) << 8), last.format
        import torch

        return lo.to(torch.int32) | (hi.to(torch.int32) << 8), last.format
    return None


def _torch_stack(pair: tuple[Any, Any]) -> Any:
    import torch

    return torch.stack(pair, dim=1)


def has_codes(codec: Codec) -> bool:
    """Return whether ``codec``'s wire carries number-format codes that :func:`range_hits` can read."""
    return isinstance(codec.stages[-1], (Fp8Codec, Nvfp4Codec, CastCodec))


def range_hits(codec: Codec, wire: Any, x: Any) -> tuple[Any, Any] | None:
    """Return boolean masks (flushed, top) over the elements of ``x`` encoded in the bytes ``wire``.

    ``flushed``: the code is ±0 although the value was not; ``top``: the code is
    the format's largest finite magnitude (saturated, or the amax of its scale
    group). The codes are those of ``codec``'s innermost format (FP8, NVFP4's
    E2M1, fp16/bf16); None for a wire without codes (``none``). With a
    transform between (``hadamard+``) ``x`` is the untransformed input, so
    "flushed" counts the transformed codes at zero where ``x`` is non-zero.
    Arrays of ``x``'s kind and device.
    """
    n = int(x.shape[0])
    found = _wire_codes(codec.stages[-1], wire, n)
    if found is None:
        return None
    codes, fmt = found
    magnitude = codes & (fmt.sign_mask - 1)
    return (magnitude == 0) & (x != 0), magnitude == fmt.max_code


def _fragile(score: dict[str, float], top: int) -> list[str]:
    """Return the selected layers: the ``top`` highest scores, or (top=0) those above mean + 1 sd; none at 0."""
    hit = sorted((n for n in score if score[n] > 0.0), key=lambda n: (-score[n], n))
    if top:
        return sorted(hit[:top])
    values = np.array(list(score.values()), dtype=np.float64)
    bar = float(values.mean() + values.std()) if values.size else 0.0
    return sorted(n for n in hit if score[n] > bar)


# ---------------------------------------------------------------------- the stage
class _GiftState(CodecState):
    """CodecState that tells its stage when a checkpoint replaced it."""

    def __init__(self, on_load: Any) -> None:
        super().__init__()
        self._on_load = on_load

    def load_state_dict(self, state: dict[Hashable, dict[str, Any]]) -> None:
        """Replace the state and invalidate the stage's caches (it must be verified again)."""
        super().load_state_dict(state)
        self._on_load()


@dataclasses.dataclass(slots=True)
class _Live:
    """A tensor between tensor_forward and tensor_inverse: the buffer we own and its plan."""

    buffer: Any
    plan: list[tuple[str, int, int, int]]  # (name, offset, rows, d_in)
    factors: dict[str, GiftFactor]
    mask: Any  # float32 1 where transformed (x's kind and device), or None
    members: list[tuple[str, int, int]]  # profiled weights: (name, offset, numel)


class Gift(Wrapper):
    """Whiten weight gradients by their layer's input statistics, then encode with ``codec``."""

    def __init__(self, codec: Codec, config: GiftConfig | None = None, **settings: Any) -> None:
        super().__init__()
        if not isinstance(codec, Codec):
            raise TypeError(f"Gift wraps a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.config = config if config is not None else GiftConfig(**settings)
        self.lossless = codec.lossless
        self.state = _GiftState(self._invalidate)
        self._lock = threading.RLock()
        self._layouts: dict[Hashable, list[tuple[str, int, tuple[int, ...]]]] = {}
        self._declared: dict[str, int] = {}
        self._live: dict[Hashable, _Live] = {}
        self._factors: dict[str, GiftFactor] | None = None
        self._masks: dict[tuple[Hashable, int, str], Any] = {}
        self._verified = True
        self._warned: set[str] = set()
        self.timings = {"transform_s": 0.0, "feedback_s": 0.0, "refresh_s": 0.0, "refreshes": 0}
        if self.config.profile and not has_codes(codec):
            raise ValueError(f"GIFT profile={self.config.profile} counts the range hits of the inner codec's "
                             f"number format; {codec.spec!r} has none (use profile=0 or explicit layers)")

    @classmethod
    def from_spec(cls, codec: Codec, **options: int) -> Gift:
        """Build the stage from spec options (``ef`` given as 0/1); the registry's ``gift`` factory."""
        options = dict(options)
        unknown = sorted(set(options) - set(SPEC_OPTIONS))
        if unknown:
            raise ValueError(f"gift options {unknown} are not spec options (those are {', '.join(SPEC_OPTIONS)}); "
                             "damping, normalise and layers are set with GiftConfig")
        if "ef" in options:
            if options["ef"] not in (0, 1):
                raise ValueError(f"gift option ef={options['ef']!r}; use ef=0 or ef=1")
            options["ef"] = bool(options["ef"])
        return cls(codec, **options)

    # ------------------------------------------------------------------ codec contract
    @property
    def spec(self) -> str:
        """Return ``"gift[:options]+<inner spec>"`` (defaults omitted)."""
        c, default = self.config, GiftConfig()
        opts = [f"{k}={int(getattr(c, k))}" for k in SPEC_OPTIONS if getattr(c, k) != getattr(default, k)]
        return "gift" + (":" + ",".join(opts) if opts else "") + "+" + self.codec.spec

    def bind_layout(self, key: Hashable, layout: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """Record which named tensors (name, offset, shape) the fused buffer ``key`` holds."""
        with self._lock:
            self._layouts[key] = [(str(n), int(o), tuple(int(s) for s in shape)) for n, o, shape in layout]
            self._masks = {k: v for k, v in self._masks.items() if k[0] != key}
        self.codec.bind_layout(key, layout)

    # ------------------------------------------------------------------ statistics
    def declare(self, name: str, d_in: int) -> None:
        """Declare the weight ``name`` (input width ``d_in``) as a candidate for the transform."""
        positive_int("d_in", d_in, extra=f"(the input width of layer {name!r})")
        candidate = self.config.layers is None or name in self.config.layers
        if candidate and self.config.rank > d_in:
            raise ValueError(f"GIFT rank={self.config.rank} is larger than the input width {d_in} of layer "
                             f"{name!r}; use rank <= {d_in} (rank=0 for the full factor)")
        with self._lock:
            if self._declared.get(name, d_in) != d_in:
                raise ValueError(f"layer {name!r} was declared with d_in={self._declared[name]}, now {d_in}")
            self._declared[name] = int(d_in)

    def check_layers(self) -> None:
        """Raise ValueError if the explicit ``layers`` list names layers that were never declared."""
        if self.config.layers is None:
            return
        unknown = sorted(set(self.config.layers) - set(self._declared))
        if unknown:
            known = ", ".join(sorted(self._declared)) or "none declared"
            raise ValueError(f"GIFT layers {unknown} are not known weight matrices (declared: {known}); "
                             "name nn.Linear weights as in named_parameters(), e.g. 'blocks.0.down.weight'")

    def observe(self, name: str, gram: Any, count: int) -> None:
        """Add the sum of a aᵀ over ``count`` input rows of layer ``name`` to its pending statistics."""
        g = np.asarray(gram, dtype=np.float64)
        if g.ndim != 2 or g.shape[0] != g.shape[1]:
            raise ValueError(f"gram of layer {name!r} must be square (d_in x d_in), got shape {g.shape}")
        positive_int("count", count, extra=f"(the input rows summed for layer {name!r})")
        self.declare(name, g.shape[0])
        with self._lock:
            slot = self.state.slot(("gift", "stats", name))
            if "gram" in slot:
                slot["gram"] = slot["gram"] + g
                slot["count"] = int(slot["count"]) + int(count)
            else:
                slot["gram"], slot["count"] = g.copy(), int(count)

    def wants_statistics(self, name: str) -> bool:
        """Return whether layer ``name`` may still be transformed (else its statistics are not needed)."""
        selection = self.selection
        return selection is None or name in selection

    # ------------------------------------------------------------------ selection and factors
    @property
    def version(self) -> int:
        """Return how many refreshes produced the current factors."""
        return int(self.state.slot(_META).get("version", 0))

    @property
    def selection(self) -> tuple[str, ...] | None:
        """Return the selected weight names (None while undecided: profiling, or no refresh yet)."""
        text = self.state.slot(_META).get("selection")
        return None if text is None else tuple(filter(None, str(text).split("\n")))

    def select(self, names: Sequence[str]) -> None:
        """Fix the selection to ``names`` (each must be declared); applies from the next refresh."""
        names = [str(n) for n in names]
        unknown = sorted(set(names) - set(self._declared))
        if unknown:
            raise ValueError(f"cannot select unknown layers {unknown}; declared: {sorted(self._declared)}")
        with self._lock:
            meta = self.state.slot(_META)
            meta["selection"], meta["auto"] = "\n".join(sorted(set(names))), 0

    def profile_counts(self) -> dict[str, dict[str, float]]:
        """Return this rank's profile counts per layer: ``flushed``, ``top`` and ``total`` (non-zero values)."""
        return {key[2]: {k: float(self.state.slot(key).get(k, 0.0)) for k in ("flushed", "top", "total")}
                for key in self.state.keys() if isinstance(key, tuple) and key[:2] == ("gift", "profile")}

    def fragility(self) -> dict[str, float]:
        """Return the profiled fraction of values at the top code or flushed to zero, per layer (this rank)."""
        return {name: (c["flushed"] + c["top"]) / max(c["total"], 1.0) for name, c in self.profile_counts().items()}

    def factors(self) -> dict[str, GiftFactor]:
        """Return the current factors by weight name."""
        with self._lock:
            if self._factors is None:
                self._factors = {key[2]: GiftFactor(u=np.asarray(s["u"]), lam=np.asarray(s["lam"]),
                                                    sigma=float(s["sigma"]), scale=float(s.get("scale", 1.0)))
                                 for key in self.state.keys() if isinstance(key, tuple) and key[:2] == ("gift", "factor")
                                 for s in (self.state.slot(key),) if "u" in s}
            return self._factors

    def digest(self) -> int:
        """Return a CRC32 of the version, the selection and every factor's bytes."""
        crc = zlib.crc32(f"{self.version}|{self.selection}".encode())
        for name, f in sorted(self.factors().items()):
            crc = zlib.crc32(name.encode(), crc)
            for arr in (f.u, f.lam, np.float64(f.sigma), np.float64(f.scale)):
                crc = zlib.crc32(np.ascontiguousarray(arr, dtype=np.float64).tobytes(), crc)
        return crc

    def verify(self, comm: Collective | None = None) -> None:
        """Raise RuntimeError on every rank unless all ranks hold the same transforms (a collective)."""
        mine = self.digest()
        everyone = comm.allgather_object(mine) if comm is not None and comm.size > 1 else [mine]
        if len(set(everyone)) > 1:
            differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
            raise RuntimeError(f"GIFT transforms differ between ranks: ranks {differ} hold factors other than "
                               f"rank 0's (digests {[f'{d:08x}' for d in everyone]}); summing gradients in "
                               "different coordinates would be silently wrong. Refresh on all ranks together, "
                               "or load the same checkpoint on every rank")
        self._verified = True

    def refresh(self, comm: Collective | None = None) -> dict[str, Any]:
        """Recompute the factors from the pending statistics, identically on every rank (a collective).

        Returns:
            ``{"layers": names refreshed, "selection": ..., "version": ...}``.
        """
        start = time.perf_counter()
        size = comm.size if comm is not None else 1
        with self._lock:
            names = sorted(k[2] for k in self.state.keys()
                           if isinstance(k, tuple) and k[:2] == ("gift", "stats") and "gram" in self.state.slot(k))
            if size > 1:
                listed = comm.allgather_object(names)
                if any(other != names for other in listed):
                    raise RuntimeError(f"GIFT refresh: ranks observed different layers: {listed}; every rank "
                                       "must run the same model")
            self._decide_selection(comm, size)
            selection = self.selection
            grams = {}
            for name in names:
                slot = self.state.slot(("gift", "stats", name))
                packed = np.append(np.asarray(slot["gram"], np.float64).ravel(), float(slot["count"]))
                if size > 1:
                    packed = np.asarray(comm.allreduce(packed, "sum"))
                slot.clear()
                if selection is not None and name in selection:
                    d = int(round(np.sqrt(packed.size - 1)))
                    grams[name] = packed[:-1].reshape(d, d) / max(packed[-1], 1.0)
            # Each layer's eigendecomposition runs on one rank; all-gathering the results
            # makes the factors bit-identical everywhere, whatever each rank's LAPACK does.
            me = comm.rank if size > 1 else 0
            # Singular statistics are the rule after LayerNorm (rank d_in - 1): warn once per layer.
            mine = {name: factor_from_gram(g, rank=self.config.rank, damping=float(self.config.damping), name=name,
                                           warn_singular=name not in self._warned, normalise=self.config.normalise)
                    for i, (name, g) in enumerate(sorted(grams.items())) if i % size == me}
            self._warned.update(mine)
            computed: dict[str, GiftFactor | None] = {}
            for part in (comm.allgather_object(mine) if size > 1 else [mine]):
                computed.update(part)
            old = dict(self.factors())
            new = {n: f for n, f in old.items() if selection is not None and n in selection}
            new.update({n: f for n, f in computed.items() if f is not None})
            self._remap_residuals(old, new)
            for name in old:
                self.state.slot(("gift", "factor", name)).clear()
            for name, f in new.items():
                self.state.slot(("gift", "factor", name)).update(f.arrays())
            meta = self.state.slot(_META)
            meta["version"] = int(meta.get("version", 0)) + 1
            self._factors, self._masks = None, {}
        self.verify(comm)
        self.timings["refresh_s"] += time.perf_counter() - start
        self.timings["refreshes"] += 1
        return {"layers": sorted(n for n, f in computed.items() if f is not None), "selection": selection,
                "version": self.version}

    def _decide_selection(self, comm: Collective | None, size: int) -> None:
        meta = self.state.slot(_META)
        if self.config.layers is not None:
            self.check_layers()
            meta["selection"] = "\n".join(sorted(self.config.layers))
            return
        if not self.config.profile:
            if meta.get("auto", 1 if "selection" not in meta else 0):  # default: every declared layer
                meta["selection"], meta["auto"] = "\n".join(sorted(self._declared)), 1
            return
        if "selection" in meta:
            return
        names = sorted(self._declared)
        # A profiling step is one tensor_forward of every key: the least-called key counts.
        calls = [int(self.state.slot(k)["calls"]) for k in self.state.keys() if "calls" in self.state.slot(k)]
        counts = self.profile_counts()
        zero = {"flushed": 0.0, "top": 0.0, "total": 0.0}
        packed = np.array([counts.get(n, zero)[k] for n in names for k in ("flushed", "top", "total")]
                          + [float(min(calls, default=0))])
        if size > 1:
            steps = np.asarray(comm.allreduce(packed[-1:].copy(), "min"))[0]
            packed = np.asarray(comm.allreduce(packed, "sum"))
        else:
            steps = packed[-1]
        if steps < self.config.profile:
            return
        score = {n: (packed[3 * i] + packed[3 * i + 1]) / max(packed[3 * i + 2], 1.0) for i, n in enumerate(names)}
        meta["selection"] = "\n".join(_fragile(score, self.config.top))
        meta["auto"] = 0

    def _remap_residuals(self, old: dict[str, GiftFactor], new: dict[str, GiftFactor]) -> None:
        for key in list(self.state.keys()):
            slot = self.state.slot(key)
            if "residual" not in slot:
                continue
            r = slot["residual"]
            for name, off, rows, d in self._plan(key, int(r.shape[0]), old):
                seg = r[off:off + rows * d].reshape(rows, d)
                back = old[name].inverse(seg.astype(np.float64) if isinstance(seg, np.ndarray) else seg.double())
                seg[...] = new[name].forward(back) if name in new and new[name].d == d else back

    # ------------------------------------------------------------------ whole-tensor mapping
    def _layout(self, key: Hashable, n: int, factors: dict[str, GiftFactor]) -> list[tuple[str, int, tuple]]:
        if key in self._layouts:
            return self._layouts[key]
        if isinstance(key, str) and (key in factors or key in self._declared):
            d = factors[key].d if key in factors else self._declared[key]
            if n % d:
                raise ValueError(f"tensor {key!r} has {n} elements, not a multiple of its layer's d_in={d}")
            return [(key, 0, (n // d, d))]
        return []

    def _plan(self, key: Hashable, n: int, factors: dict[str, GiftFactor]) -> list[tuple[str, int, int, int]]:
        plan = []
        for name, off, shape in self._layout(key, n, factors):
            f = factors.get(name)
            if f is None:
                continue
            if len(shape) != 2 or shape[1] != f.d:
                raise ValueError(f"weight {name!r} has shape {shape} but its GIFT factor expects d_in={f.d}; "
                                 "was the model changed after the factors were computed?")
            plan.append((name, off, shape[0], shape[1]))
        return plan

    def _mask(self, key: Hashable, n: int, plan: list[tuple[str, int, int, int]], like: Any) -> Any:
        where = str(getattr(like, "device", "numpy"))
        cached = self._masks.get((key, n, where))
        if cached is None:
            cached = np.zeros(n, np.float32)
            for _, off, rows, d in plan:
                cached[off:off + rows * d] = 1.0
            cached = self._masks[(key, n, where)] = _like(cached, like)
        return cached

    def _check_verified(self) -> None:
        if not self._verified:
            raise RuntimeError("GIFT state was loaded from a checkpoint but not verified across ranks; call "
                               "codec.verify(comm) on every rank (DistributedOptimizer.load_state_dict does this)")

    def tensor_forward(self, x: Any, key: Hashable = None) -> Any:
        """Return the flat tensor ``x`` with each selected weight W replaced by c · W S⁻ᵀ (a copy; ``x`` if none)."""
        start = time.perf_counter()
        with self._lock:
            factors = self.factors()
            if factors:
                self._check_verified()
            n = int(x.shape[0])
            plan = self._plan(key, n, factors)
            members = []
            if self._profiling():
                slot = self.state.slot(key)
                slot["calls"] = int(slot.get("calls", 0)) + 1
                members = [(name, off, int(np.prod(shape))) for name, off, shape in self._layout(key, n, factors)
                           if name in self._declared and len(shape) == 2]
            if not plan and not members:
                self._live.pop(key, None)
                return x
            y = x
            if plan:  # a copy that we own: the caller's tensor is never modified
                y = x.copy() if isinstance(x, np.ndarray) else x.clone()
                for name, off, rows, d in plan:
                    seg = y[off:off + rows * d].reshape(rows, d)
                    seg[...] = factors[name].forward(seg)
            mask = self._mask(key, n, plan, x) if plan and self.config.ef else None
            self._live[key] = _Live(buffer=y, plan=plan, factors=factors, mask=mask, members=members)
        self.timings["transform_s"] += time.perf_counter() - start
        return y

    def tensor_inverse(self, y: Any, key: Hashable = None) -> None:
        """Map the reduced tensor ``y`` back in place: each transformed weight W̃ becomes W̃ Sᵀ / c."""
        start = time.perf_counter()
        with self._lock:
            live = self._live.pop(key, None)
        if live is None:
            return
        for name, off, rows, d in live.plan:
            seg = y[off:off + rows * d].reshape(rows, d)
            seg[...] = live.factors[name].inverse(seg)
        self.timings["transform_s"] += time.perf_counter() - start

    # ------------------------------------------------------------------ profiling and error feedback
    def _profiling(self) -> bool:
        return bool(self.config.profile) and self.config.layers is None and self.selection is None

    def _locate(self, x: Any, key: Hashable) -> tuple[_Live, Hashable, int] | None:
        # The compressed all-reduce encodes chunks under derived keys: (name, "g") whole,
        # Span((name, "w"), start, total) per pipeline chunk; the live tensor is ``name``.
        base = key.base if isinstance(key, Span) else key
        for k in (base, base[0] if isinstance(base, tuple) and base else None):
            live = self._live.get(k) if k is not None and _hashable(k) else None
            if live is not None:
                off = _offset_in(x, live.buffer)
                if off is not None:
                    return live, k, off
        return None

    def _encode(self, x: Any, out: Any, key: Hashable) -> None:
        found = self._locate(x, key)
        if found is None or (found[0].mask is None and not found[0].members):
            self.codec._encode(x, out, key)
            return
        start = time.perf_counter()
        live, tkey, off = found
        n = int(x.shape[0])
        y = x
        residual = None
        if live.mask is not None:
            with self._lock:
                slot = self.state.slot(tkey)
                residual = slot["residual"] = _residual_like(slot.get("residual"), x, int(live.buffer.shape[0]))
            y = x + residual[off:off + n]
        self.codec._encode(y, out, key)
        if residual is not None:
            decoded = self.codec._decode(out, n, arrays.empty_f32(x, n))
            err = (y - decoded) * live.mask[off:off + n]
            residual[off:off + n] = _finite(err)
        if live.members:
            self._count_hits(live.members, off, out, y)
        self.timings["feedback_s"] += time.perf_counter() - start

    def _count_hits(self, members: list[tuple[str, int, int]], off: int, out: Any, y: Any) -> None:
        hits = range_hits(self.codec, out, y)
        if hits is None:
            return
        flushed, top = hits
        n = int(y.shape[0])
        for name, lo, numel in members:
            a, b = max(lo, off), min(lo + numel, off + n)
            if a >= b:
                continue
            part = slice(a - off, b - off)
            counts = [_count(flushed[part]), _count(top[part]), _count(y[part] != 0)]
            with self._lock:
                slot = self.state.slot(("gift", "profile", name))
                for k, v in zip(("flushed", "top", "total"), counts):
                    slot[k] = float(slot.get(k, 0.0)) + v

    def _decode(self, buf: Any, n: int, out: Any) -> Any:
        return self.codec._decode(buf, n, out)

    def _decode_add(self, buf: Any, n: int, out: Any) -> None:
        self.codec._decode_add(buf, n, out)  # the inverse transform runs on the whole reduced tensor

    def residual(self, key: Hashable) -> Any:
        """Return the error-feedback residual of tensor ``key`` in transformed coordinates (or None)."""
        return self.state.slot(key).get("residual") if key in self.state else None

    def _invalidate(self) -> None:
        with self._lock:
            self._factors, self._masks, self._live = None, {}, {}
            self._verified = not self.factors()


def _hashable(k: Any) -> bool:
    try:
        hash(k)
    except TypeError:
        return False
    return True


def _address(a: Any) -> int:
    return int(a.__array_interface__["data"][0]) if isinstance(a, np.ndarray) else int(a.data_ptr())


def _offset_in(x: Any, base: Any) -> int | None:
    """Return where the contiguous float32 chunk ``x`` starts inside ``base`` (None if outside)."""
    if type(x) is not type(base) or arrays.dtype_name(x.dtype) != "float32":
        return None
    if not isinstance(x, np.ndarray) and x.device != base.device:
        return None
    diff = _address(x) - _address(base)
    n = int(x.shape[0])
    if diff < 0 or diff % 4 or diff // 4 + n > int(base.shape[0]):
        return None
    return diff // 4


def _like(value: np.ndarray, x: Any) -> Any:
    """Return the numpy array ``value`` as x's kind, on x's device."""
    if isinstance(x, np.ndarray):
        return value
    import torch

    return torch.as_tensor(value, device=x.device)


def _residual_like(residual: Any, x: Any, size: int) -> Any:
    """Return ``residual`` (zeros if missing or of another length) as x's kind, on x's device."""
    if residual is None or int(residual.shape[0]) != size:
        return np.zeros(size, np.float32) if isinstance(x, np.ndarray) else x.new_zeros(size)
    if isinstance(x, np.ndarray):
        return residual if isinstance(residual, np.ndarray) else residual.detach().cpu().numpy()
    if isinstance(residual, np.ndarray) or residual.device != x.device:  # e.g. just loaded from a checkpoint
        import torch

        return torch.as_tensor(residual, dtype=torch.float32, device=x.device)
    return residual


def _finite(err: Any) -> Any:
    if isinstance(err, np.ndarray):
        return np.nan_to_num(err, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
    return err.nan_to_num_(0.0, 0.0, 0.0)


def _count(mask: Any) -> int:
    return int(np.count_nonzero(mask)) if isinstance(mask, np.ndarray) else int(mask.count_nonzero())
