"""Feed a GIFT codec with the input statistics of a model's ``nn.Linear`` layers.

GIFT (:mod:`commwire.codecs.gift`) whitens each weight gradient by its layer's
input second moment A = E[a aᵀ]. :class:`GiftHooks` puts a forward hook on
every ``nn.Linear`` whose weight the optimizer trains, names it as in
``named_parameters`` (the names the fusion buckets use), and collects
``Σ a aᵀ`` cheaply: only during the ``window`` steps before each refresh, and
from at most ``max_rows`` strided rows of each input (tokens × batch), on the
layer's own device. After ``optimizer.step()`` it counts the step and, on the
refresh steps, hands the sums to the codec (one device-to-host copy per layer)
and calls its collective ``refresh`` (statistics all-reduced, factors
identical on every rank).

Schedule (the paper's protocol): the first refresh follows step
``max(profile, window)`` — with ``profile=100`` the codec has counted the
layers' range hits over steps 1..100 and selects the fragile layers there —
then one every ``refresh`` steps (default 50): steps P, P + K, P + 2K, ...
Until the first refresh gradients travel untransformed.

``DistributedOptimizer(..., compression="gift+fp8-e4m3", model=model)`` wires
this up itself; :func:`attach` does it for an optimizer built without
``model=``.

Example:
    >>> opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),
    ...                                named_parameters=model.named_parameters(),
    ...                                compression="gift:profile=100,top=2+fp8-e4m3", model=model)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

import torch

from .._validate import positive_int
from ..codecs.base import Codec
from ..codecs.gift import Gift

__all__ = ["GiftHooks", "GiftHooksConfig", "attach", "find_gift"]

_ADAPTER = ("gift", "adapter")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GiftHooksConfig:
    """How the forward hooks sample layer inputs."""

    window: int = 10
    """Steps of statistics collected before each refresh (capped at the refresh interval)."""
    max_rows: int = 256
    """Input rows (batch × tokens) kept per layer and forward pass, by a fixed stride."""

    def __post_init__(self) -> None:
        for name in ("window", "max_rows"):
            positive_int(f"GiftHooksConfig.{name}", getattr(self, name))


def find_gift(codec: Codec | None) -> Gift | None:
    """Return the GIFT stage inside ``codec`` (None if it has none)."""
    if codec is None:
        return None
    return next((s for s in codec.stages if isinstance(s, Gift)), None)


class GiftHooks:
    """Collect nn.Linear input statistics for a GIFT codec and refresh it every K steps.

    Args:
        model: the module whose ``nn.Linear`` layers are hooked.
        codec: a codec containing a GIFT stage (``codecs.get("gift+fp8-e4m3")``).
        named_parameters: ``(name, param)`` pairs naming the weights as the buckets do.
        comm: communicator for the refresh collectives (None: single process).
        config: sampling settings.
    """

    def __init__(self, model: torch.nn.Module, codec: Codec, named_parameters: Iterable[tuple[str, Any]],
                 comm: Any = None, config: GiftHooksConfig | None = None) -> None:
        stage = find_gift(codec)
        if stage is None:
            raise ValueError(f"codec {codec.spec!r} has no GIFT stage; use e.g. 'gift+fp8-e4m3'")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.stage = stage
        self.comm = comm
        self.config = config if config is not None else GiftHooksConfig()
        by_id = {id(p): n for n, p in named_parameters}
        self.layers: dict[str, torch.nn.Linear] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and id(module.weight) in by_id:
                name = by_id[id(module.weight)]
                stage.declare(name, module.in_features)
                self.layers[name] = module
        if not self.layers:
            raise ValueError("model has no nn.Linear layer whose weight is in named_parameters; GIFT has "
                             "nothing to transform (use a plain codec such as 'fp8-e4m3')")
        stage.check_layers()
        self._gram: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self.timings = {"stats_s": 0.0}
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in self.layers.items()]

    # ----------------------------------------------------------------- schedule
    @property
    def steps(self) -> int:
        """Return the optimizer steps completed (saved with the codec state)."""
        return int(self.stage.state.slot(_ADAPTER).get("steps", 0))

    def _window(self) -> int:
        return min(self.config.window, self.stage.config.refresh)

    def first_refresh(self) -> int:
        """Return the step after which the first refresh runs: ``max(profile, window)``."""
        return max(self.stage.config.profile, self._window())

    def refresh_due(self, completed: int) -> bool:
        """Return whether a refresh follows step number ``completed`` (1-based)."""
        first, k = self.first_refresh(), self.stage.config.refresh
        return completed >= first and (completed - first) % k == 0

    def _next_refresh(self, step: int) -> int:
        first, k = self.first_refresh(), self.stage.config.refresh
        return first if step <= first else first + -(-(step - first) // k) * k

    def collecting(self) -> bool:
        """Return whether the step now running feeds the next refresh's statistics."""
        upcoming = self.steps + 1
        return self._next_refresh(upcoming) - upcoming < self._window()

    # ----------------------------------------------------------------- hooks
    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not (module.training and torch.is_grad_enabled() and self.collecting()
                    and self.stage.wants_statistics(name)):
                return
            start = time.perf_counter()
            with torch.no_grad():
                a = inputs[0].detach().reshape(-1, module.in_features)
                stride = -(-a.shape[0] // self.config.max_rows)
                a = a[::stride].float()
                gram = a.T @ a
                if name in self._gram:
                    self._gram[name] += gram
                else:
                    self._gram[name] = gram.to(torch.float64)
                self._rows[name] = self._rows.get(name, 0) + int(a.shape[0])
            self.timings["stats_s"] += time.perf_counter() - start

        return hook

    def after_step(self) -> dict[str, Any] | None:
        """Count one optimizer step; on refresh steps, hand over the statistics and refresh (collective)."""
        completed = self.steps + 1
        self.stage.state.slot(_ADAPTER)["steps"] = completed
        if not self.refresh_due(completed):
            return None
        for name in sorted(self._gram):
            self.stage.observe(name, self._gram[name].cpu().numpy(), self._rows[name])
        self._gram.clear()
        self._rows.clear()
        return self.stage.refresh(self.comm)

    def state_dict(self) -> dict[str, Any]:
        """Return the statistics gathered since the last refresh (so a checkpoint mid-window resumes exactly)."""
        return {"gram": {n: g.cpu().clone() for n, g in self._gram.items()}, "rows": dict(self._rows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore statistics saved by :meth:`state_dict`."""
        self._gram = {n: g.clone() for n, g in state["gram"].items()}
        self._rows = dict(state["rows"])

    def remove(self) -> None:
        """Detach the forward hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def attach(model: torch.nn.Module, optimizer: Any, config: GiftHooksConfig | None = None) -> GiftHooks:
    """Hook ``model`` into a DistributedOptimizer built with a GIFT compression; return the hooks."""
    fusion = getattr(optimizer, "_fusion", None)
    if fusion is None:
        raise TypeError(f"attach needs a commwire DistributedOptimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_gift", None) is not None:
        raise RuntimeError("this optimizer already has GIFT hooks attached")
    hooks = GiftHooks(model, fusion.codec, optimizer._named, optimizer.comm, config)
    optimizer._gift = hooks
    return hooks
