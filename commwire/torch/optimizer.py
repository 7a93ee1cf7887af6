"""``DistributedOptimizer``: average gradients across ranks while backward runs.

It wraps any ``torch.optim.Optimizer`` by composition (no class is generated
at run time): the wrapper shares the wrapped optimizer's ``param_groups`` and
``state`` and is itself an ``Optimizer`` instance, so LR schedulers and
gradient scalers accept it.

Data flow of a step:
1. a post-accumulate-grad hook fires when a parameter's gradient is ready (on
   the ``backward_passes_per_step``-th backward pass) and copies it into its
   fusion bucket (reverse registration order);
2. a complete bucket starts its (compressed) all-reduce on the background
   lane while backward continues;
3. ``step()`` (or ``synchronize()``) waits for every bucket, writes the
   averaged gradients into ``.grad`` and steps the wrapped optimizer.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .._validate import positive_int
from ..comm.communicator import Communicator
from ..comm.runtime import default_comm
from ..fusion import DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_THRESHOLD_BYTES, FusionBuffer, check_unique_names

__all__ = ["DistributedOptimizer"]

_MB = 1 << 20


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` uses gradients reduced over all ranks.

    Horovod's arguments, in Horovod's order:
        optimizer: the optimizer to wrap.
        named_parameters: ``(name, param)`` pairs (e.g. ``model.named_parameters()``);
            names key codec state in checkpoints. Default: names ``param.{i}``.
        compression: ``Compression.none`` / ``.fp16`` / ``.bf16`` / ``.fp8`` / ``.nvfp4`` /
            ``.fp8_ef`` …, a codec spec string (``"ef+nvfp4"``), a codec object, or your
            own Compressor (``compress``/``decompress``, applied to each fused bucket).
        backward_passes_per_step: backward passes accumulated locally before one
            reduction (gradients are summed over the passes, as in Horovod).
        op: ``Average``, ``Sum`` or ``Adasum`` (Adasum: each rank steps locally and the
            parameter deltas are combined with the Adasum reduction, as Horovod does).
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it (Average only), to steer clear of overflow.
        num_groups: deprecated spelling of ``groups=<int>``.
        groups: an int (that many groups of parameters, each reduced in buckets of its
            own) or lists of parameters that travel together (others alone).
        sparse_as_dense: reduce sparse gradients (``nn.Embedding(sparse=True)``) as dense
            tensors in the fused buckets and hand them back sparse; otherwise they are
            reduced by all-gathering their indices and values.
        process_set: reduce over this process set only (non-members step locally).

    commwire's own (keyword-only):
        fusion_threshold_mb: bucket size in MiB (0: one collective per tensor; default
            25, or HOROVOD_FUSION_THRESHOLD).
        first_bucket_mb: size of the first bucket in MiB.
        find_unused_parameters: exchange which parameters got a gradient, so a
            parameter unused on every rank keeps ``grad=None`` (one extra small
            all-reduce per step). Off: a missing gradient counts as zeros.
        on_nonfinite: what to do when an averaged gradient holds NaN/Inf:
            "propagate" (default: pass it to the optimizer, so AMP loss scaling sees
            it), "skip" (skip the step on every rank alike) or "raise"
            (FloatingPointError naming the parameters).
        overlap: reduce buckets while backward runs (True; "lane": always on a background thread; False: in step()).
        comm: communicator (default: the process set's, or commwire's world before hvd.init()).
        model: the trained module; needed by GIFT compressions (``Compression.gift_fp8``),
            whose transform uses its ``nn.Linear`` input statistics (commwire.torch.gift).

    Example:
        >>> import commwire.torch as hvd
        >>> opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                                named_parameters=model.named_parameters(),
        ...                                compression=hvd.Compression.fp8)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: Any = "none",
        backward_passes_per_step: int = 1,
        op: str = "avg",
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: Any = None,
        *,
        fusion_threshold_mb: float | None = None,
        first_bucket_mb: float = DEFAULT_FIRST_BUCKET_BYTES / _MB,
        find_unused_parameters: bool = False,
        on_nonfinite: str = "propagate",
        overlap: bool | str = True,
        comm: Communicator | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
        positive_int("backward_passes_per_step", backward_passes_per_step)
        op = {"average": "avg", "mean": "avg"}.get(op, op)
        if op not in ("avg", "sum", "adasum"):
            raise ValueError(f"op={op!r} is not supported for gradients; use Average, Sum or Adasum")
        if gradient_predivide_factor <= 0 or (gradient_predivide_factor != 1.0 and op != "avg"):
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average and a "
                             "positive value")
        if num_groups:
            warnings.warn("num_groups has been replaced by groups=<int>", DeprecationWarning, stacklevel=2)
            groups = num_groups if groups is None else groups
        self._inner = optimizer
        self._init_hook_dicts()
        self._named = _resolve_names(optimizer, named_parameters)
        self.comm, self.process_set = _resolve_comm(comm, process_set)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self.find_unused_parameters = find_unused_parameters
        if on_nonfinite not in ("propagate", "skip", "raise"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not valid; use 'propagate', 'skip' or 'raise'")
        self.on_nonfinite = on_nonfinite
        self.nonfinite: list[str] = []
        self.skipped_steps = 0
        self._predivide = float(gradient_predivide_factor)
        from .compression import resolve

        codec_spec, compressor = resolve(compression)
        codec = None
        if codec_spec is not None:
            from ..codecs import get

            codec = get(codec_spec) if isinstance(codec_spec, str) else codec_spec
        if op == "adasum" and (codec is not None or compressor is not None):
            raise ValueError("op=Adasum combines parameter deltas in full precision; use compression=none with it")
        if fusion_threshold_mb is None:
            from ._env import fusion_threshold_bytes

            env = fusion_threshold_bytes()
            fusion_threshold_mb = DEFAULT_THRESHOLD_BYTES / _MB if env is None else env / _MB
        self._passes = {p: 0 for _, p in self._named}
        self._names = {p: n for n, p in self._named}
        self._synchronized = False
        self._skip_sync = False
        self._sparse: dict[str, torch.Tensor] = {}  # name -> this step's sparse gradient (reduced at synchronize)
        self.step_times: list[float] = []
        self._gift: Any = None
        self._hooks: list[Any] = []
        self._fusion: FusionBuffer | None = None
        if self.comm is None or op == "adasum":
            return  # not a member of the process set (steps locally), or Adasum (reduces deltas in step())
        self._given_comm = comm
        self._fusion_args = dict(codec_spec=codec_spec, compressor=compressor, threshold=int(fusion_threshold_mb * _MB),
                                 first=int(first_bucket_mb * _MB), overlap=overlap,
                                 groups=_named_groups(groups, self._named))
        self._fusion = self._make_fusion(codec)
        # GIFT (commwire/torch/gift.py): hook the model's nn.Linear inputs, refresh every K steps.
        from .gift import attach, find_gift

        if find_gift(codec) is not None:
            if model is None:
                raise ValueError(f"compression {codec.spec!r} needs layer input statistics: pass model=<the "
                                 "nn.Module being trained> to DistributedOptimizer")
            attach(model, self)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for _, p in self._named]

    def _make_fusion(self, codec: Any) -> FusionBuffer:
        a = self._fusion_args
        assert self.comm is not None
        return FusionBuffer(
            [(n, p) for n, p in self._named],
            comm=self.comm,
            op="sum" if self._predivide != 1.0 else self.op,
            codec=codec,
            compressor=a["compressor"],
            threshold_bytes=a["threshold"],
            first_bucket_bytes=a["first"],
            overlap=a["overlap"],
            postscale=self._predivide / self.comm.size if self._predivide != 1.0 else 1.0,
            groups=a["groups"],
        )

    def _rebind(self) -> None:
        """Bind to commwire's re-formed world (commwire.elastic) with fresh codec state.

        The old buckets' collectives were cut off by the re-forming; error-feedback residuals
        were each rank's share of a sum over the old world, so they start again from zero.
        """
        if self._given_comm is not None or self._fusion is None:
            return  # an explicit communicator, Adasum or a non-member: nothing bound to the world
        from ..codecs import get

        spec = self._fusion_args["codec_spec"]
        codec = None if spec is None else get(spec) if isinstance(spec, str) else spec
        for stage in getattr(codec, "stages", ()) if not isinstance(spec, str) else ():
            stage.state.clear()
        self.comm, self.process_set = _resolve_comm(None, self.process_set)
        self._fusion = self._make_fusion(codec)
        self._synchronized = False
        for p in self._passes:
            self._passes[p] = 0

    def _init_hook_dicts(self) -> None:
        # torch.optim.Optimizer machinery that LR schedulers and profilers touch.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    # ---------------------------------------------------------------- delegation
    # The wrapped optimizer stays the single source of truth: its load_state_dict()
    # replaces param_groups and state, and the wrapper must see the new ones.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Return the wrapped optimizer's parameter groups (LR schedulers read and write these)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """Return the wrapped optimizer's defaults."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._inner.defaults = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """Return the wrapped optimizer's per-parameter state."""
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Return the wrapped optimizer."""
        return self._inner

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Return {parameter: name} (Horovod's attribute)."""
        return dict(self._names)

    def __repr__(self) -> str:
        buckets = len(self._fusion.buckets) if self._fusion is not None else 0
        return f"DistributedOptimizer({self._inner!r}, buckets={buckets})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer holds MPI handles and cannot be pickled; save state_dict() instead")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before each reduction."""
        positive_int("backward_passes_per_step", passes)
        self.backward_passes_per_step = passes
        for p in self._passes:
            self._passes[p] = 0

    # --------------------------------------------------------------- gradients
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        count = self._passes[p] + 1
        if count > self.backward_passes_per_step:
            raise RuntimeError(
                f"parameter {self._names[p]!r} got gradient #{count} before step(); set "
                f"backward_passes_per_step={count} or call optimizer.step()/synchronize() after each "
                f"{self.backward_passes_per_step} backward pass(es)"
            )
        self._passes[p] = count
        if count != self.backward_passes_per_step:
            return
        assert self._fusion is not None
        name = self._names[p]
        scale = 1.0 / self._predivide if self._predivide != 1.0 else 1.0
        slot = self._fusion.view(name)
        if p.grad.is_sparse:
            if self.sparse_as_dense:
                self._fusion.add(name, p.grad.to_dense(), scale)
                self._sparse[name] = p.grad  # handed back sparse after the reduction
            else:
                self._sparse[name] = p.grad * scale if scale != 1.0 else p.grad
                self._fusion.add(name, torch.zeros((), dtype=slot.dtype))  # its slot travels as zeros
            return
        if p.grad.data_ptr() == slot.data_ptr():
            self._fusion.mark(name, scale)  # autograd accumulated straight into the bucket
        else:
            self._fusion.add(name, p.grad.detach(), scale)
            # From now on the gradient *is* its bucket slot (DDP's gradient_as_bucket_view):
            # autograd accumulates into it in place, and the reduced values land in
            # .grad without a copy back.
            p.grad = slot

    def synchronize(self) -> None:
        """Wait for every gradient reduction and write the results into ``.grad``."""
        if self._fusion is None:  # not a member of the process set, or Adasum: nothing to reduce
            self._synchronized = True
            return
        if not any(self._passes.values()) and not self._fusion.in_flight():
            raise RuntimeError("synchronize()/step() was called but no gradient was computed since the last step; "
                               "call loss.backward() first")
        present = self._global_presence() if self.find_unused_parameters else None
        start = time.perf_counter()
        reduced = self._fusion.wait()
        self.nonfinite = self._find_nonfinite() if self.on_nonfinite != "propagate" else []
        for name, p in self._named:
            if present is not None and not present[name]:
                p.grad = None  # unused on every rank: no gradient, as without distribution
                continue
            sparse = self._sparse.get(name)
            if sparse is not None:
                p.grad = reduced[name].to_sparse() if self.sparse_as_dense else self._reduce_sparse(name, sparse)
                continue
            value = reduced[name]
            if p.grad is None or p.grad.data_ptr() != value.data_ptr():
                p.grad = value
        self._sparse.clear()
        self.step_times.append(time.perf_counter() - start)
        for p in self._passes:
            self._passes[p] = 0
        self._synchronized = True
        if self.nonfinite and self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"non-finite averaged gradients in {len(self.nonfinite)} parameter(s): {self.nonfinite[:5]}; "
                "lower the learning rate or the loss scale, or pass on_nonfinite='skip' to skip such steps"
            )

    def _reduce_sparse(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        from .mpi_ops import _sparse_allreduce

        def gather(x: torch.Tensor, part: str) -> Callable[[], torch.Tensor]:
            gathered = self.comm.allgather(x, name=part)  # on this thread, in step with the other collectives
            return lambda: gathered

        return _sparse_allreduce(grad, name, self.op == "avg", self.comm.size, gather)()

    def _find_nonfinite(self) -> list[str]:
        # The reduced buckets are the same on every rank (a NaN or Inf anywhere
        # reaches every rank's sum), so every rank takes the same decision with
        # no extra message; one isfinite pass per bucket, per-tensor only if needed.
        assert self._fusion is not None
        names = []
        for bucket in self._fusion.buckets:
            if not bool(torch.isfinite(bucket.buffer).all()):
                names += [n for n in bucket.names if not bool(torch.isfinite(self._fusion.view(n)).all())]
        return names

    def _global_presence(self) -> dict[str, bool]:
        local = torch.tensor([self._passes[p] > 0 for _, p in self._named], dtype=torch.uint8)
        counts = self.comm.allreduce(local, "max", name="commwire.unused_parameters")
        return {name: bool(c) for (name, _), c in zip(self._named, counts.tolist())}

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` skip waiting (after an explicit ``synchronize()``, e.g. to clip gradients)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Synchronize the gradients (unless already done) and step the wrapped optimizer."""
        if self.op == "adasum" and self.comm is not None:
            return self._adasum_step(closure)
        if self._skip_sync:
            if not self._synchronized:
                raise RuntimeError("step() inside skip_synchronize() needs an explicit optimizer.synchronize() first")
        elif self._synchronized and not any(self._passes.values()):
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
                          "code.", stacklevel=3)
        else:
            self.synchronize()
        self._synchronized = False
        if self.nonfinite and self.on_nonfinite == "skip":
            self.skipped_steps += 1  # every rank skips: the reduced gradients are identical
            result = None
        else:
            result = self._inner.step(closure) if closure is not None else self._inner.step()
        if self._gift is not None:  # GIFT: count the step; every K steps refresh the factors (collective)
            self._gift.after_step()
        return result

    def _adasum_step(self, closure: Any) -> Any:
        # Horovod's Adasum optimizer: step locally, then combine the parameter deltas with
        # Adasum (one fused reduction per dtype and device; per-tensor dot products).
        assert self.comm is not None
        params = [p for _, p in self._named]
        before = [p.detach().clone() for p in params]
        result = self._inner.step(closure) if closure is not None else self._inner.step()
        groups: dict[tuple[Any, Any], list[int]] = {}
        for i, p in enumerate(params):
            groups.setdefault((p.dtype, p.device), []).append(i)
        from ..comm.adasum import adasum_allreduce

        for k, idx in enumerate(groups.values()):
            deltas = torch.cat([(params[i].detach() - before[i]).reshape(-1) for i in idx])
            host = deltas.cpu().numpy() if deltas.dtype != torch.bfloat16 else deltas.float().cpu().numpy()
            with self.comm.watched("allreduce adasum", f"adasum.delta.{k}"):
                combined = adasum_allreduce(self.comm.mpi, host, counts=[params[i].numel() for i in idx])
            combined_t = torch.from_numpy(combined).to(deltas.device, deltas.dtype)
            for i, piece in zip(idx, combined_t.split([params[i].numel() for i in idx])):
                params[i].copy_(before[i] + piece.view_as(params[i]))
        for p in self._passes:
            self._passes[p] = 0
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (they are views of the fusion buckets).

        An error if reductions are still in flight. Gradients that are not
        bucket views (set by the user) follow ``set_to_none``.
        """
        if self._fusion is None:
            self._inner.zero_grad(set_to_none=set_to_none)
            return
        if self._fusion.in_flight():
            raise RuntimeError(
                "optimizer.zero_grad() was called while gradient reductions were in flight (after "
                "loss.backward() and before optimizer.step()/synchronize()); call step() or synchronize() first"
            )
        if any(self._passes.values()) and not self._synchronized:
            # Partial accumulation (backward_passes_per_step > 1) is discarded with the gradients.
            for p in self._passes:
                self._passes[p] = 0
        # Gradients are views of the fusion buckets: zero the buckets in place (one
        # memset each) instead of dropping the views, whatever set_to_none says.
        self._fusion.zero_()
        self._sparse.clear()
        for name, p in self._named:
            if p.grad is not None and (p.grad.is_sparse or p.grad.data_ptr() != self._fusion.view(name).data_ptr()):
                p.grad = None if set_to_none else p.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refuse: gradient buckets are fixed at construction."""
        raise RuntimeError("add param groups to the optimizer before wrapping it in DistributedOptimizer")

    # -------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return the wrapped optimizer's state dict plus commwire's codec state under "commwire"."""
        sd = self._inner.state_dict()
        if self._fusion is not None:
            sd["commwire"] = self._fusion.state_dict()
            if self._gift is not None:  # GIFT: statistics gathered since the last refresh
                sd["commwire"]["gift_hooks"] = self._gift.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a state dict saved by :meth:`state_dict` (a plain optimizer's also loads)."""
        sd = dict(state_dict)
        ours = sd.pop("commwire", None)
        self._inner.load_state_dict(sd)
        # As Horovod does: a loaded state starts a fresh round of accumulation.
        self._synchronized = False
        for p in self._passes:
            self._passes[p] = 0
        if ours is not None and self._fusion is not None:
            saved_ids = ours.get("bucket_ids")
            current = [b.id for b in self._fusion.buckets]
            if saved_ids is not None and saved_ids != current:
                raise ValueError("checkpoint buckets differ from this optimizer's (other parameters or fusion "
                                 f"threshold): saved {len(saved_ids)} buckets, now {len(current)}; "
                                 "use the same model and fusion_threshold_mb to resume codec state")
            self._fusion.load_state_dict(ours)
            if self._gift is not None and "gift_hooks" in ours:
                self._gift.load_state_dict(ours["gift_hooks"])
            if self._gift is not None:  # GIFT: refuse factors that differ between ranks (collective)
                self._gift.stage.verify(self.comm)

    # ------------------------------------------------------------------- stats
    def overlap_stats(self) -> dict[str, float]:
        """Return communication seconds, seconds exposed in step(), and the hidden fraction."""
        if self._fusion is None:
            return {"comm_s": 0.0, "exposed_s": 0.0, "hidden_fraction": 0.0}
        comm_s, exposed = self._fusion.comm_seconds, self._fusion.exposed_seconds
        hidden = max(0.0, 1.0 - exposed / comm_s) if comm_s > 0 else 0.0
        return {"comm_s": comm_s, "exposed_s": exposed, "hidden_fraction": hidden}

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the wrapper stops reducing)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _resolve_comm(comm: Communicator | None, process_set: Any) -> tuple[Communicator | None, Any]:
    """Return (communicator to reduce over or None on a non-member, process set)."""
    if comm is not None:
        return comm, process_set
    from .basics import is_initialized
    from .process_sets import ProcessSet, comm_of, global_process_set

    if process_set is None or process_set is global_process_set:
        if not is_initialized():  # commwire.init() without hvd.init(): commwire's world
            return default_comm(), process_set
        return comm_of(global_process_set), global_process_set
    if isinstance(process_set, ProcessSet) and process_set.size() is not None and not process_set.included():
        return None, process_set
    return comm_of(process_set), process_set  # a process set not registered yet fails here, clearly


def _named_groups(groups: Any, named: list[tuple[str, torch.nn.Parameter]]) -> list[list[str]] | None:
    """Turn Horovod's ``groups`` (an int, or lists of parameters) into lists of names."""
    if groups is None:
        return None
    names = [n for n, _ in named]
    if not isinstance(groups, (list, tuple)):
        positive_int("groups", groups, extra="or a list of lists of parameters")
        per = -(-len(names) // groups)
        return [names[i:i + per] for i in range(0, len(names), per)]
    by_id = {id(p): n for n, p in named}
    out = []
    for group in groups:
        members = []
        for p in group:
            if not isinstance(p, torch.Tensor) or id(p) not in by_id:
                raise ValueError("groups must hold parameters the optimizer trains (torch.Tensor objects)")
            members.append(by_id[id(p)])
        out.append(members)
    return out


def _resolve_names(optimizer: torch.optim.Optimizer,
                   named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None
                   ) -> list[tuple[str, torch.nn.Parameter]]:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not (isinstance(item, tuple) and len(item) == 2) for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    check_unique_names([n for n, _ in named], "the names in named_parameters")
    by_id = {id(p): n for n, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameter(s) (indices {unnamed[:5]}) are missing from "
                         "named_parameters; pass model.named_parameters() of the model the optimizer trains")
    # Registration order follows the optimizer, which is the model's order.
    return [(by_id[id(p)], p) for p in params]
