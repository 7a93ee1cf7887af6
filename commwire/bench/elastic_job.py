"""An elastic training job for ``commwire bench faults`` and the tests: a DistributedOptimizer under hvd.elastic.

Trains an MLP regression (fixed synthetic data, the same on every rank; each
rank takes its share through an ElasticSampler) with ``hvd.elastic.run``,
committing every ``--commit-every`` steps. Rank 0 appends one JSON line per
step to ``--log``: step, world size, loss, commit id, time, and whether every
rank's parameters are bit-identical (a hash all-gathered after each step, and
after each sync: LoRDO's replicas differ between its periodic syncs by design).
``--die-at STEP --die-rank R`` makes rank R kill itself with SIGKILL at that
step of the first launch (a lost host, for tests without a lab).

Run: ``commwire run -np 4 --min-np 2 --max-np 4 -H localhost:4 python -m commwire.bench.elastic_job --log L``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
from typing import Any

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commwire.bench.elastic_job", description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--compression", default="ef+fp8-e4m3", help="a commwire codec spec, or none")
    parser.add_argument("--optimizer", choices=("sgd", "lordo", "glm"), default="sgd",
                        help="DistributedOptimizer(SGD), LoRDO, or GLM(solver='casgd') one epoch per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    parser.add_argument("--log", required=True, help="JSON lines file rank 0 appends to")
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=None)
    return parser


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _log(path: str, rank: int) -> Any:
    log = open(path, "a", encoding="utf-8") if rank == 0 else None

    def emit(entry: dict[str, Any]) -> None:
        if log is not None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

    return emit


def _die(path: str, rank: int) -> None:
    """Note the moment in the log (one short append) and die by SIGKILL, as a lost host's rank does."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"event": "killed", "rank": rank, "time": time.time()}) + "\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _glm_main(args: argparse.Namespace) -> None:
    """GLM(solver="casgd") under commwire.elastic: one epoch per step, warm-started from the last commit."""
    import numpy as np

    import commwire
    from commwire import elastic
    from commwire.glm import GLM

    comm = commwire.init()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4096, 32))
    y = (x @ rng.normal(size=32) + 0.5 * rng.normal(size=4096) > 0).astype(np.int64)
    first_launch = os.environ.get("COMMWIRE_ELASTIC_VERSION", "0") == "0"
    born_as = comm.rank
    emit = _log(args.log, comm.rank)
    state = elastic.ObjectState(coef=np.zeros(32), intercept=None, step=0)

    def agree() -> bool:
        world = commwire.world()
        return len(set(world.allgather_object(hashlib.sha256(state.coef.tobytes()).hexdigest()))) == 1

    @elastic.run
    def train(state: Any) -> None:
        world = commwire.world()
        emit({"event": "synced", "size": world.size, "time": time.time(), "step": state.step,
              "commit": state.commit_id, "agree": agree()})
        while state.step < args.steps:
            if first_launch and args.die_at is not None and state.step == args.die_at and born_as == args.die_rank:
                _die(args.log, born_as)
            model = GLM(loss="logistic", solver="casgd", s=8, batch_size=args.batch, lr=args.lr * 10, max_iter=1,
                        tol=None, random_state=args.seed * 1000 + state.step)
            model.fit(x, y, coef_init=state.coef, intercept_init=state.intercept)
            state.coef, state.intercept = model.coef_.ravel().copy(), float(model.intercept_[0])
            state.step += 1
            emit({"event": "step", "step": state.step, "size": world.size, "loss": model.loss_curve_[-1],
                  "time": time.time(), "agree": agree(), "commit": state.commit_id})
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if state.step % args.commit_every == 0:
                state.commit()
                emit({"event": "commit", "step": state.step, "commit": state.commit_id, "time": time.time()})

    train(state)
    emit({"event": "done", "step": state.step, "size": commwire.world().size, "time": time.time(),
          "digest": hashlib.sha256(state.coef.tobytes()).hexdigest()[:16]})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.optimizer == "glm":
        _glm_main(args)
        return
    import torch

    import commwire.torch as hvd

    hvd.init()
    torch.manual_seed(args.seed)
    n = 4096
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(1))
    w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
    y = torch.tanh(x @ w_true) + 0.05 * torch.randn(n, 1, generator=torch.Generator().manual_seed(3))
    dataset = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1))
    if args.optimizer == "lordo":
        codec = None if args.compression == "none" else args.compression.removeprefix("ef+")
        opt = hvd.LoRDO(model.named_parameters(), lr=args.lr / 10, rank=4, sync_every=4, codec=codec)
    else:
        codec = None if args.compression == "none" else args.compression
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=codec or hvd.Compression.none)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0, epoch=0)
    first_launch = os.environ.get("COMMWIRE_ELASTIC_VERSION", "0") == "0"
    born_as = hvd.rank()  # the rank this process started as: a re-formed world renumbers the survivors
    emit = _log(args.log, hvd.rank())

    def on_reset() -> None:
        from commwire.elastic import world

        emit({"event": "reset", "size": hvd.size(), "time": time.time(), "step": state.step,
              "reform": world.last_reform()})

    state.register_reset_callbacks([on_reset])
    loss_fn = torch.nn.MSELoss()

    @hvd.elastic.run
    def train(state: Any) -> None:
        synced = hvd.allgather_object(_digest(model))
        emit({"event": "synced", "size": hvd.size(), "time": time.time(), "step": state.step,
              "commit": state.commit_id, "agree": len(set(synced)) == 1})
        while state.step < args.steps:
            loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=state.sampler)
            for batch_idx, (xb, yb) in enumerate(loader):
                if state.step >= args.steps:
                    break
                if (first_launch and args.die_at is not None and state.step == args.die_at
                        and born_as == args.die_rank):
                    _die(args.log, born_as)
                opt.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                opt.step()
                state.sampler.record_batch(batch_idx, args.batch)
                state.step += 1
                digests = hvd.allgather_object(_digest(model))
                mean_loss = hvd.allreduce(loss.detach(), op=hvd.Average, name="loss").item()
                emit({"event": "step", "step": state.step, "size": hvd.size(), "loss": mean_loss,
                      "time": time.time(), "agree": len(set(digests)) == 1, "commit": state.commit_id})
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if state.step % args.commit_every == 0:
                    state.commit()
                    emit({"event": "commit", "step": state.step, "commit": state.commit_id, "time": time.time()})
            else:
                state.epoch += 1
                state.sampler.set_epoch(state.epoch)
                continue
    train(state)
    emit({"event": "done", "step": state.step, "size": hvd.size(), "time": time.time(), "digest": _digest(model)})


if __name__ == "__main__":
    main()
