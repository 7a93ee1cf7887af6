"""commwire in one minute: what it does on 4 ranks, each figure next to its baseline.

    commwire run -np 4 python examples/demo.py

1. Collectives: commwire.allreduce vs raw mpi4py Allreduce (same buffers, same job).
2. Compressed all-reduce of a 16 MiB gradient: bytes on the wire and error of
   bf16 / FP8 / NVFP4 vs the FP32 all-reduce.
3. Communication-avoiding SGD (s-step Gram exchange) vs SGD on a logistic
   regression: all-reduce count, bytes and loss with the same batches.
4. PyTorch: DistributedOptimizer vs torch DDP (gloo), same model and data.

Everything is measured in this run; nothing is quoted from elsewhere. On one
machine messages travel through shared memory, where latency is ~15-20 µs and
bandwidth high: fewer bytes and fewer messages pay off on real networks (see
`commwire lab` and `commwire bench` for measured multi-host figures).
"""

from __future__ import annotations

import time

import numpy as np

import commwire as cw
from commwire.bench.allreduce import format_table as allreduce_table
from commwire.bench.allreduce import run_allreduce_bench


def say(comm: cw.Communicator, text: str = "") -> None:
    """Print on rank 0 only."""
    if comm.rank == 0:
        print(text, flush=True)


def collectives(comm: cw.Communicator) -> None:
    """Show a correct sum and commwire's overhead over raw mpi4py."""
    say(comm, "== 1. all-reduce: commwire vs raw mpi4py (median of interleaved batches) ==")
    result = cw.allreduce(np.ones(3) * comm.rank)
    say(comm, f"sum of ranks on every rank: {result}")
    rows = run_allreduce_bench([8, 1 << 20, 16 << 20], repeats=5)
    say(comm, allreduce_table(rows))


def compressed(comm: cw.Communicator) -> None:
    """Compare wire bytes, error and time of codecs on one gradient-sized tensor."""
    say(comm, "\n== 2. compressed all-reduce of a 16 MiB float32 tensor (4M elements) ==")
    x = np.random.default_rng(comm.rank).standard_normal(4 << 20).astype(np.float32)
    exact = comm.allreduce(x.astype(np.float64), "avg")
    say(comm, "| wire format | bytes sent by each rank | vs fp32 | rel. L2 error | time ms |")
    say(comm, "|---|---|---|---|---|")
    fp32_bytes = None
    for codec in (None, "bf16", "fp8-e4m3", "nvfp4"):
        cw.allreduce(x, "avg", codec=codec, name="demo")  # warm-up (JIT, buffers)
        cw.stats(reset=True)
        comm.barrier()
        start = time.perf_counter()
        got = cw.allreduce(x, "avg", codec=codec, name="demo")
        elapsed = comm.mpi.allreduce(time.perf_counter() - start, op=_max())
        snap = cw.stats(reset=True)
        sent = snap["compressed_allreduce" if codec else "allreduce"]["bytes"]
        fp32_bytes = fp32_bytes or sent
        err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        say(comm, f"| {codec or 'fp32 (MPI_Allreduce)'} | {sent / 1e6:.2f} MB | {fp32_bytes / sent:.2f}x fewer | "
                  f"{err:.4f} | {elapsed * 1e3:.1f} |")


def casgd(comm: cw.Communicator) -> None:
    """Train the same logistic regression with SGD and CA-SGD; compare messages and loss."""
    from commwire.glm import GLM

    say(comm, "\n== 3. logistic regression, 20000 x 64, features split over ranks: SGD vs CA-SGD (s=16) ==")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((20_000, 64)) / 8
    y = (X @ rng.standard_normal(64) + 0.3 * rng.standard_normal(20_000) > 0).astype(float)
    say(comm, "| solver | precision | all-reduces | bytes sent | wall s | final loss |")
    say(comm, "|---|---|---|---|---|---|")
    for solver, s, precision in (("sgd", 1, "fp32"), ("casgd", 16, "mixed")):
        model = GLM(loss="logistic", solver=solver, s=s, batch_size=16, lr=0.5, precision=precision,
                    max_iter=2, tol=None, random_state=0)
        cw.stats(reset=True)
        comm.barrier()
        start = time.perf_counter()
        model.fit(X, y)
        elapsed = comm.mpi.allreduce(time.perf_counter() - start, op=_max())
        snap = cw.stats(reset=True)["allreduce"]
        say(comm, f"| {solver} | {precision} | {snap['calls']} | {snap['bytes'] / 1e6:.2f} MB | {elapsed:.2f} | "
                  f"{model.loss_curve_[-1]:.5f} |")


def torch_vs_ddp(comm: cw.Communicator) -> None:
    """Time DistributedOptimizer against DDP over gloo on a 100-tensor MLP."""
    try:
        import torch  # noqa: F401
    except ImportError:
        say(comm, "\n(torch not installed: pip install 'commwire[torch]' to see the DistributedOptimizer demo)")
        return
    from commwire.bench.torch_ddp import format_table, run_torch_bench

    say(comm, "\n== 4. PyTorch: DistributedOptimizer vs DDP (gloo), MLP with 100 parameter tensors ==")
    rows = run_torch_bench(layers=50, width=128, batch=32, steps=5, rounds=3, codecs="fp8-e4m3",
                           unfused=False)
    say(comm, format_table(rows))


def _max():  # type: ignore[no-untyped-def]
    from mpi4py import MPI

    return MPI.MAX


def main() -> None:
    """Run the four parts of the demo."""
    comm = cw.init()
    say(comm, f"commwire {cw.__version__} on {comm.size} ranks")
    collectives(comm)
    compressed(comm)
    casgd(comm)
    torch_vs_ddp(comm)


if __name__ == "__main__":
    main()
