"""``TorchState``: a model, an optimizer, samplers and plain attributes, committed and synced together."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...elastic.state import ObjectState
from .sampler import ElasticSampler

__all__ = ["TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "get_handler_registry", "set_handler_registry"]


def _copy(value: Any, what: str) -> Any:
    try:
        return copy.deepcopy(value)
    except Exception as exc:  # noqa: BLE001 - name what failed and the fix
        raise TypeError(f"cannot commit {what}: its state cannot be copied ({type(exc).__name__}: {exc}); keep "
                        "only copyable objects (tensors, numbers, containers) in its state_dict") from exc


class StateHandler:
    """Save, restore and sync one tracked object (the value of a ``TorchState`` attribute)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root: int = 0) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        """Track ``value`` instead (the attribute was reassigned) and save it."""
        self.value = value
        self.save()

    def saved(self) -> Any:
        """Return the committed state (picklable), for a relaunch."""
        raise NotImplementedError

    def load_saved(self, saved: Any) -> None:
        """Make ``saved`` (from ``saved()``) the committed state."""
        raise NotImplementedError

    def reset(self) -> None:
        """Rebind to the re-formed world (nothing by default)."""


class ModelStateHandler(StateHandler):
    """An ``nn.Module``: its state_dict, copied on commit, broadcast on sync."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._saved = _copy(model.state_dict(), f"model {type(model).__name__}")

    def save(self) -> None:
        self._saved = _copy(self.value.state_dict(), f"model {type(self.value).__name__}")

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root: int = 0) -> None:
        from ..functions import broadcast_parameters

        broadcast_parameters(self.value.state_dict(), root_rank=root)

    def saved(self) -> Any:
        return self._saved

    def load_saved(self, saved: Any) -> None:
        self._saved = saved


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (commwire's ``DistributedOptimizer`` included).

    The state_dict is copied on commit (with a DistributedOptimizer: its codec state
    too, so a restore on the same rank brings the error-feedback residuals back);
    ``sync`` broadcasts the wrapped optimizer's state only: residuals are each
    rank's own and are not copied between ranks.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._saved = _copy(optimizer.state_dict(), f"optimizer {type(optimizer).__name__}")

    def save(self) -> None:
        self._saved = _copy(self.value.state_dict(), f"optimizer {type(self.value).__name__}")

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root: int = 0) -> None:
        from ..functions import broadcast_optimizer_state

        broadcast_optimizer_state(self.value, root_rank=root)

    def saved(self) -> Any:
        from ..optimizer import DistributedOptimizer

        if isinstance(self.value, DistributedOptimizer):
            # its codec state is this rank's share of a sum over the old world: not for another rank
            return {k: v for k, v in self._saved.items() if k != "commwire"}
        return self._saved

    def load_saved(self, saved: Any) -> None:
        self._saved = saved

    def reset(self) -> None:
        from ..optimizer import DistributedOptimizer

        if isinstance(self.value, DistributedOptimizer):
            self.value._rebind()
            self._saved = {k: v for k, v in self._saved.items() if k != "commwire"}
        elif hasattr(self.value, "_rebind"):  # LoRDO, DiLoCo: their schedule's communicator
            self.value._rebind()


class SamplerStateHandler(StateHandler):
    """An ``ElasticSampler``: epoch and processed count, taken from the sync root."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root: int = 0) -> None:
        from ..functions import broadcast_object

        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root_rank=root,
                                                    name="commwire.elastic.sampler"))

    def saved(self) -> Any:
        return self._saved

    def load_saved(self, saved: Any) -> None:
        self._saved = saved

    def reset(self) -> None:
        self.value.reset()  # the number of ranks changed: repartition


_handler_registry: list[tuple[type, type[StateHandler]]] = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, type[StateHandler]]]:
    """Return the (type, handler class) pairs ``TorchState`` uses, first match wins."""
    return _handler_registry


def set_handler_registry(registry: list[tuple[type, type[StateHandler]]]) -> None:
    """Replace the (type, handler class) pairs ``TorchState`` uses."""
    global _handler_registry
    _handler_registry = list(registry)


def _bcast(obj: Any, root_rank: int = 0) -> Any:
    from ..functions import broadcast_object

    return broadcast_object(obj, root_rank=root_rank, name="commwire.elastic.state")


def _rank() -> int:
    from ..basics import rank

    return rank()


class TorchState(ObjectState):
    """State of a PyTorch training process: models, optimizers, samplers and plain attributes.

    Args:
        model: optional ``nn.Module``.
        optimizer: optional optimizer (a commwire ``DistributedOptimizer`` included).
        **kwargs: more attributes; a Module, Optimizer or ElasticSampler gets its handler,
            anything else is kept as an ``ObjectState`` attribute.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers, plain = {}, {}
        for name, value in kwargs.items():
            handler = next((cls(value) for kind, cls in _handler_registry if isinstance(value, kind)), None)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=_bcast, get_rank=_rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        root = self._choose_root()
        for handler in self._handlers.values():
            handler.sync(root)
        self._sync_objects(root)

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()

    def _snapshot(self) -> Any:
        return {"objects": dict(self._saved_state),
                "handlers": {name: handler.saved() for name, handler in self._handlers.items()}}

    def _load_snapshot(self, snapshot: Any) -> None:
        for name, saved in snapshot.get("handlers", {}).items():
            if name in self._handlers:
                self._handlers[name].load_saved(saved)
        super()._load_snapshot(snapshot)  # sets the objects and restores everything

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and hasattr(self, name):
            handlers[name].set_value(value)
        super().__setattr__(name, value)
