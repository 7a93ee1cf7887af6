"""Horovod Elastic's PyTorch API over commwire: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

    >>> import commwire.torch as hvd
    >>> state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    >>> @hvd.elastic.run
    ... def train(state):
    ...     for state.epoch in range(state.epoch, epochs):
    ...         ...
    ...         state.commit()
    >>> train(state)

Launched with ``commwire run --min-np/--max-np/--host-discovery-script`` (see
commwire.elastic for how the world is re-formed). Where the world is re-formed
in process (``ulfm``), the global process set is rebuilt on the survivors,
process sets added with ``add_process_set`` are dropped (add them again in a
reset callback), and every commwire ``DistributedOptimizer`` tracked by a
``TorchState`` is bound to the new world with fresh codec state (error-feedback
residuals start from zero: the ranks' shares of the sum changed). Where the job is
relaunched, every process starts fresh and the state comes from the newest commit.
"""

from __future__ import annotations

from ...elastic import HostsUpdatedInterrupt, ObjectState, State, run_fn
from .sampler import ElasticSampler
from .state import TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HostsUpdatedInterrupt"]


def run(func):  # type: ignore[no-untyped-def]
    """Decorate ``func(state, ...)`` to survive lost and added hosts (see ``commwire.elastic.run``).

    Collective operations must not run outside ``func`` in an elastic job: a relaunched
    worker would meet them while the others synchronise state.
    """
    return run_fn(func, _reset)


def _reset() -> None:
    from .. import basics

    basics.rebuild_after_reform()
