"""Batch normalisation with statistics over all ranks: Horovod's ``SyncBatchNorm``.

In training mode the mean and variance are those of every rank's batch taken
together (per-rank batch sizes may differ, and may be 0), so training with
local batches on P ranks normalises as one process would on their
concatenation, and backward accounts for every rank's share of the statistics.
In eval mode it is plain batch normalisation and does not communicate.

Communication per layer and training step, through a commwire Communicator:

* forward: one allgather of ``[count, mean, M2]`` per rank (``2C + 1``
  float64; ``M2`` is the sum of squared deviations from the rank's mean). The
  ranks' moments are combined in float64 with Chan et al.'s pairwise formula,
  which avoids the cancellation of ``Σx² - (Σx)² / N`` when the mean is large
  against the spread.
* backward: one allreduce of ``[Σ dy, Σ dy·(x - mean)]`` (``2C`` float64),
  only when the input needs a gradient (every rank must agree on that, as on
  calling backward at all: a rank that skips it leaves the others waiting).

The gradients of ``weight`` and ``bias`` stay local, as in Horovod: the
DistributedOptimizer reduces them with the other parameters. float16 and
bfloat16 inputs are normalised in float32.

Differences from ``horovod.torch.SyncBatchNorm``: CPU tensors work (Horovod
requires CUDA); ``momentum=None`` gives the cumulative average as in
``torch.nn.BatchNorm*`` (Horovod fails there); in eval mode with
``track_running_stats=False`` each rank normalises with its own batch, as
plain BatchNorm and ``torch.nn.SyncBatchNorm`` do, where Horovod would
synchronise; ``process_set=`` picks the ranks that share statistics.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import runtime
from ..comm.communicator import Communicator

__all__ = ["SyncBatchNorm"]

_COMPUTE = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
            torch.float32: torch.float32, torch.float64: torch.float64}


class SyncBatchNorm(_BatchNorm):
    """Batch-normalise over the batches of all ranks (N-dimensional, input ``(N, C, ...)``).

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; None
            keeps a cumulative average.
        affine: learn a per-channel scale ``weight`` and shift ``bias``.
        track_running_stats: keep running mean and variance for eval mode;
            without them eval mode normalises with the batch's own statistics.
        process_set: the ranks whose batches are pooled (an object whose
            ``.comm`` is a commwire Communicator); None: all ranks.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, *, process_set: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        """Raise ValueError unless ``input`` is ``(N, C, ...)`` with this layer's ``C``."""
        if input.dim() < 2 or input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expects input of shape (N, {self.num_features}, ...), "
                f"got {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise ``input`` with all ranks' batch statistics (training) or the running ones (eval)."""
        self._check_input_dim(input)
        factor = self._running_factor()
        if not self.training:
            batch_stats = self.running_mean is None and self.running_var is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                batch_stats, 0.0, self.eps)
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        comm = _comm_for(self.process_set)
        if comm.size == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, True, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor, comm)

    def _running_factor(self) -> float:
        """Count this batch (training) and return the new batch's weight in the running statistics."""
        if not (self.training and self.track_running_stats and self.num_batches_tracked is not None):
            return 0.0 if self.momentum is None else self.momentum
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum


def _comm_for(process_set: Any) -> Communicator:
    """Return the communicator of ``process_set``, or the world's when it is None."""
    if process_set is None:
        return runtime.default_comm()
    from .process_sets import ProcessSet, comm_of

    if isinstance(process_set, ProcessSet):
        return comm_of(process_set)  # a clear error for a non-member or an unregistered set
    if not hasattr(process_set, "comm"):
        raise TypeError(f"process_set={process_set!r} has no .comm; pass a ProcessSet (or None for all ranks)")
    if process_set.comm is None:
        raise ValueError(f"this rank is not a member of process_set={process_set!r}; "
                         "run this SyncBatchNorm only on the set's ranks")
    return process_set.comm


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics (forward) and their gradients (backward) span all ranks."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                factor: float, comm: Communicator) -> torch.Tensor:
        x = input.contiguous().to(_compute_dtype(input.dtype))
        local = _local_moments(x)
        gathered = comm.allgather(local.unsqueeze(0), name="sync_batch_norm.stats")
        total, mean, var = _pool_moments(gathered, x.shape[1])
        if running_mean is not None and running_var is not None:
            _update_running(running_mean, running_var, mean, var * (total / (total - 1)), factor)
        mean, invstd = mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total, ctx.comm, ctx.input_dtype = total, comm, input.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _affine((x - _per_channel(mean, x)) * _per_channel(invstd, x), weight, bias).to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dy = grad_output.contiguous().to(x.dtype)
        xmu = x - _per_channel(mean, x)
        dims = _reduce_dims(x)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = _input_grad(ctx, dy, xmu, invstd, weight, sum_dy, sum_dy_xmu).to(ctx.input_dtype)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _input_grad(ctx: Any, dy: torch.Tensor, xmu: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None,
                sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor) -> torch.Tensor:
    """Return dL/dx from the local terms and the all-rank sums of dy and dy·(x - mean)."""
    channels = dy.shape[1]
    both = torch.cat([sum_dy, sum_dy_xmu]).to(torch.float64)
    both = ctx.comm.allreduce(both, "sum", name="sync_batch_norm.grad") / ctx.total
    mean_dy, mean_dy_xmu = both[:channels].to(dy.dtype), both[channels:].to(dy.dtype)
    scale = invstd if weight is None else invstd * weight.to(dy.dtype)
    centred = dy - _per_channel(mean_dy, dy) - xmu * _per_channel(invstd * invstd * mean_dy_xmu, dy)
    return centred * _per_channel(scale, dy)


# ----------------------------------------------------------------- helpers
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype batch statistics are computed in for inputs of ``dtype``."""
    compute = _COMPUTE.get(dtype)
    if compute is None:
        raise TypeError(f"SyncBatchNorm needs a float16, bfloat16, float32 or float64 input, got {dtype}; cast it")
    return compute


def _reduce_dims(x: torch.Tensor) -> list[int]:
    """Return every dimension but the channel dimension 1."""
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return the per-channel vector ``v`` shaped to broadcast against ``like`` (N, C, ...)."""
    return v.view(1, -1, *([1] * (like.dim() - 2)))


def _local_moments(x: torch.Tensor) -> torch.Tensor:
    """Return this rank's [count, mean (C), M2 (C)] in float64."""
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    if count == 0:
        mean = m2 = torch.zeros(channels, dtype=torch.float64, device=x.device)
    else:
        var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
        mean, m2 = mean.to(torch.float64), var.to(torch.float64) * count
    return torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device), mean, m2])


def _pool_moments(gathered: torch.Tensor, channels: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Return the total count, mean and biased variance of all ranks' moments (Chan et al.)."""
    counts, means, m2s = gathered[:, :1], gathered[:, 1:channels + 1], gathered[:, channels + 1:]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(
            f"SyncBatchNorm needs more than 1 value per channel over all ranks in training, got {total:g} "
            f"(per-rank counts {[int(c) for c in counts.view(-1).tolist()]}); use larger batches or eval mode"
        )
    mean = (counts * means).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return total, mean, m2 / total


def _update_running(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                    unbiased_var: torch.Tensor, factor: float) -> None:
    """Move the running statistics towards this batch's by ``factor``."""
    with torch.no_grad():
        running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
        running_var.mul_(1 - factor).add_(unbiased_var.to(running_var.dtype), alpha=factor)


def _affine(xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Apply the per-channel scale and shift, when the layer has them."""
    if weight is not None:
        xhat = xhat * _per_channel(weight.to(xhat.dtype), xhat)
    if bias is not None:
        xhat = xhat + _per_channel(bias.to(xhat.dtype), xhat)
    return xhat
