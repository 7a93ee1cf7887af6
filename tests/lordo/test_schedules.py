"""The Schedule contract, checked alike on EveryStep, LocalSync, SStepGram and LoRDOSchedule — tier 1.

One process. For each schedule: which steps communicate (``due``, ``tick``)
against a hand-computed set, checked again against the collectives the
counters see at every step; ``bytes_per_sync`` / ``messages_per_sync`` against
hand-computed sizes of one parameter set and against the counters at a sync;
the ``state_dict()`` round trip. Several ranks: ``mpi_lordo.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import commwire as cw
from commwire.schedules import (
    EveryStep,
    LocalSync,
    LocalSyncConfig,
    LoRDOConfig,
    LoRDOSchedule,
    Schedule,
    SStepGram,
)

STEPS = 8
K = 3


@pytest.fixture(scope="module", autouse=True)
def world():
    return cw.init()


def parameters() -> dict[str, np.ndarray]:
    """The parameter set every schedule is sized for: a 4 x 6 matrix and a bias of 5, float32."""
    rng = np.random.default_rng(0)
    return {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def gradients(t: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + t)
    return {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


@dataclass
class Case:
    """How to build one schedule over ``params`` and how a training loop drives one step of it."""

    build: Callable[[dict[str, np.ndarray]], Any]
    drive: Callable[[Any, dict[str, np.ndarray], int], None]
    due: set[int]
    """Steps in 1..STEPS that communicate, by hand."""
    bytes_per_sync: int
    messages_per_sync: int


def _every_drive(sched, params, t):
    if sched.tick():
        sched.sync(gradients(t))


def _local_drive(sched, params, t):
    for name, x in params.items():
        x -= 0.01 * gradients(t)[name]
    if sched.tick():
        sched.sync()


def _sstep_drive(sched, params, t):
    if sched.tick():
        sched.rows[...] = np.random.default_rng(t).standard_normal(sched.rows.shape)
        sched.weights[...] = 1.0
        sched.exchange()


def _lordo_drive(sched, params, t):
    sched.step(gradients(t), lr=0.01)


def _lordo(warmup: int) -> Callable[[dict[str, np.ndarray]], LoRDOSchedule]:
    return lambda p: LoRDOSchedule(list(p.items()), LoRDOConfig(rank=2, warmup_steps=warmup),
                                   LocalSyncConfig(sync_every=K))


# 29 values of parameters; LoRDO (rank 2) also averages its moments: 2 x (2 x 6) low-rank ones for
# the 4 x 6 matrix (projected on its smaller side) and 2 x 5 Adam moments for the bias.
CASES = {
    "every-step": Case(lambda p: EveryStep(list(p.items())), _every_drive,
                       due=set(range(1, STEPS + 1)), bytes_per_sync=4 * 29, messages_per_sync=1),
    "local-sync": Case(lambda p: LocalSync(list(p.items()), LocalSyncConfig(sync_every=K)), _local_drive,
                       due={3, 6}, bytes_per_sync=4 * 29, messages_per_sync=1),
    # s = 3 steps of b = 2 rows per exchange, before each group: 3·2 margins + 3·2²·(3−1)/2 Gram entries, float64.
    "sstep-gram": Case(lambda p: SStepGram(s=K, b=2, n_local=6, dtype="float64"), _sstep_drive,
                       due={1, 4, 7}, bytes_per_sync=8 * (6 + 12), messages_per_sync=1),
    # Step 1 averages the first gradients once (seeding the bases), then every K-th step syncs.
    "lordo": Case(_lordo(0), _lordo_drive, due={1, 3, 6}, bytes_per_sync=4 * (29 + 24 + 10), messages_per_sync=2),
    # A warm-up of K steps averages gradients at every step; then every K-th step syncs.
    "lordo-warmup": Case(_lordo(K), _lordo_drive, due={1, 2, 3, 6}, bytes_per_sync=4 * (29 + 24 + 10),
                         messages_per_sync=2),
}


def _counted() -> tuple[int, int]:
    rows = [v for v in cw.stats().values() if isinstance(v, dict) and "bytes" in v]  # not the "_phases" timings
    return sum(r["calls"] for r in rows), sum(r["bytes"] for r in rows)


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(a), sorted(b))
        for key in a:
            _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("kind", list(CASES))
def test_schedule_contract(kind):
    case = CASES[kind]
    params = parameters()
    sched = case.build(params)
    assert isinstance(sched, Schedule)
    assert {t for t in range(1, STEPS + 1) if sched.due(t)} == case.due
    assert sched.bytes_per_sync == case.bytes_per_sync
    assert sched.messages_per_sync == case.messages_per_sync
    with pytest.raises(ValueError, match="step=0"):
        sched.due(0)

    communicated = set()
    for t in range(1, STEPS + 1):
        (calls, nbytes), syncs = _counted(), sched.syncs
        case.drive(sched, params, t)
        calls, nbytes = _counted()[0] - calls, _counted()[1] - nbytes
        if calls:
            communicated.add(t)
        if sched.syncs > syncs:  # a synchronisation: exactly the announced messages and bytes
            assert (calls, nbytes) == (case.messages_per_sync, case.bytes_per_sync), t
        assert sched.steps == t
    assert communicated == case.due

    saved = sched.state_dict()
    twin_params = {n: x.copy() for n, x in params.items()}  # the live weights, as a checkpoint restores them
    twin = case.build(twin_params)
    twin.load_state_dict(saved)
    assert (twin.steps, twin.syncs) == (sched.steps, sched.syncs) == (STEPS, sched.syncs)
    _assert_same(twin.state_dict(), saved)
    for t in range(STEPS + 1, STEPS + K + 1):
        case.drive(sched, params, t)
        case.drive(twin, twin_params, t)
    _assert_same(twin.state_dict(), sched.state_dict())


def test_every_step_averages_and_refuses_unknown_names():
    params = parameters()
    sched = EveryStep(list(params.items()))
    out = sched.sync({"w": np.ones((4, 6), np.float32)})  # "b" missing: it travels as zeros
    np.testing.assert_array_equal(out["w"], 1.0)
    np.testing.assert_array_equal(out["b"], 0.0)
    with pytest.raises(KeyError, match="'c'"):
        sched.sync({"c": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="at least one parameter"):
        EveryStep([])


def test_every_step_counts_what_a_codec_sends():
    params = parameters()
    sched = EveryStep(list(params.items()), codec="bf16")
    assert sched.bytes_per_sync == 2 * 29
