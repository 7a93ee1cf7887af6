"""Benchmark commwire's DistributedOptimizer against torch DDP over gloo, same job.

Every configuration trains its own copy of the same model on the same data in
the same MPI job; configurations take turns in short rounds so that machine
noise hits them alike, and the median step time of each is reported with its
ratio to DDP (FP32, gloo). Also reported: wire bytes per step (commwire's
counters), the number of collectives per step, and the fraction of
communication time hidden behind backward (1 − time waited in step() / time
the collectives took).

Run: ``commwire bench torch -np 4``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

import numpy as np

from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "run_torch_bench", "format_table", "main", "make_model"]

NAME = "torch"
HELP = "DistributedOptimizer vs torch DDP over gloo, codecs, fusion, overlap"
DRIVER = False


def make_model(layers: int, width: int) -> Any:
    """Return an MLP with ``2 * layers`` parameter tensors (weights and biases)."""
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def _init_gloo(comm: Any) -> None:
    import torch.distributed as dist

    from ..comm.torch_transport import free_port

    if dist.is_initialized():
        return
    # MASTER_ADDR (torch's convention; `commwire run --lab` sets it) is where rank 0
    # listens; on one machine that is loopback.
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = comm.broadcast_object(free_port(host) if comm.rank == 0 else None, 0)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=comm.rank, world_size=comm.size)


def _configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    out = [("ddp-gloo fp32", {"ddp": True}), ("commwire fp32", {"compression": "none"})]
    if args.unfused:
        out.append(("commwire fp32 unfused", {"compression": "none", "fusion_threshold_mb": 0}))
    if args.lane:
        out.append(("commwire fp32 lane", {"compression": "none", "overlap": "lane"}))
    if args.no_overlap:
        out.append(("commwire fp32 no overlap", {"compression": "none", "overlap": False}))
    out += [(f"commwire {c}", {"compression": c}) for c in args.codecs.split(",") if c]
    return out


def run_torch_bench(*, layers: int = 50, width: int = 256, batch: int = 32, steps: int = 10, rounds: int = 5,
                    codecs: str = "bf16,fp8-e4m3,nvfp4", unfused: bool = True, threads: int = 1,
                    no_overlap: bool = False, lane: bool = False, hvd_init: bool = False) -> list[dict[str, Any]]:
    """Train each configuration for ``rounds`` x ``steps`` steps; return one row per configuration."""
    import torch

    import commwire as cw
    import commwire.torch as hvd

    torch.set_num_threads(threads)
    comm = cw.init()
    _init_gloo(comm)
    if hvd_init:  # as a Horovod script: the optimizers reduce on the global process set (it agrees on every call)
        hvd.init()
    args = argparse.Namespace(codecs=codecs, unfused=unfused, no_overlap=no_overlap, lane=lane)
    gen = torch.Generator().manual_seed(comm.rank)
    data = [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)) for _ in range(4)]
    runners: list[tuple[str, Callable[[int], None], Any, Any]] = []
    for label, cfg in _configs(args):
        model = make_model(layers, width)
        if cfg.get("ddp"):
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(model, bucket_cap_mb=25)
            opt: Any = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            net = ddp
        else:
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                           named_parameters=model.named_parameters(),
                                           compression=cfg["compression"],
                                           fusion_threshold_mb=cfg.get("fusion_threshold_mb", 25.0),
                                           overlap=cfg.get("overlap", True))
            net = model

        def step(i: int, net: Any = net, opt: Any = opt) -> None:
            x, y = data[i % len(data)]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()

        runners.append((label, step, opt, model))
    n_tensors = sum(1 for _ in runners[0][3].parameters())
    times: dict[str, list[float]] = {label: [] for label, *_ in runners}
    wire: dict[str, int] = {label: 0 for label, *_ in runners}
    calls: dict[str, int] = {label: 0 for label, *_ in runners}
    from ..codecs.collective import TUNE_CALLS

    for label, step, *_ in runners:  # warm-up: allocations, lanes, numba compilation
        # compressed buckets also tune their pipeline segment in their first calls
        for i in range(2 + (TUNE_CALLS if "fp32" not in label else 0)):
            step(i)
    for label, step, opt, _ in runners:
        if hasattr(opt, "_fusion"):
            opt._fusion.comm_seconds = opt._fusion.exposed_seconds = 0.0
    for r in range(rounds):
        for label, step, opt, _ in runners:
            comm.barrier()
            cw.stats(reset=True)
            for i in range(steps):
                start = time.perf_counter()
                step(i)
                times[label].append(time.perf_counter() - start)
            snap = cw.stats(reset=True)
            wire[label] += sum(v["bytes"] for k, v in snap.items()
                               if k in ("allreduce", "compressed_allreduce"))
            calls[label] += sum(v["calls"] for k, v in snap.items()
                                if k in ("allreduce", "compressed_allreduce"))
    total_steps = rounds * steps
    # Every rank reports its own medians; the table uses the slowest rank's, as the job does.
    medians = comm.allgather_object({label: float(np.median(t)) for label, t in times.items()})
    ddp_time = max(m[runners[0][0]] for m in medians)
    rows = []
    for label, _, opt, model in runners:
        median = max(m[label] for m in medians)
        row = {"config": label, "ranks": comm.size, "tensors": n_tensors, "step_ms": median * 1e3,
               "ratio_vs_ddp": median / ddp_time,
               "wire_MB_per_step": wire[label] / total_steps / 1e6 if label != runners[0][0] else float("nan"),
               "collectives_per_step": calls[label] / total_steps if label != runners[0][0] else float("nan"),
               "hidden_fraction": opt.overlap_stats()["hidden_fraction"] if hasattr(opt, "overlap_stats")
               else float("nan")}
        rows.append(row)
    ddp_bytes = sum(p.numel() * p.element_size() for p in runners[0][3].parameters())
    rows[0]["wire_MB_per_step"] = ddp_bytes / 1e6  # DDP sends every gradient in FP32
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table."""
    head = ("| config | ranks | tensors | median step ms | ratio vs DDP | wire MB/step | collectives/step | "
            "hidden comm |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['ranks']} | {r['tensors']} | {r['step_ms']:.1f} | "
                     f"{r['ratio_vs_ddp']:.2f} | {r['wire_MB_per_step']:.2f} | {r['collectives_per_step']:.1f} | "
                     f"{r['hidden_fraction']:.0%} |".replace("nan%", "-").replace("| nan |", "| - |"))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench torch``."""
    parser = argparse.ArgumentParser(prog="commwire bench torch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=50, help="Linear layers (2 parameter tensors each)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", default="bf16,fp8-e4m3,nvfp4", help="comma-separated compressions to add")
    parser.add_argument("--no-unfused", dest="unfused", action="store_false", help="skip the unfused run")
    parser.add_argument("--no-overlap", action="store_true",
                        help="add an FP32 run whose buckets are reduced on the caller's thread in step() (overlap=False)")
    parser.add_argument("--lane", action="store_true",
                        help="add an FP32 run whose buckets are all reduced on the lane's thread (overlap='lane')")
    parser.add_argument("--hvd-init", action="store_true",
                        help="call hvd.init() first, as a Horovod script does: buckets reduce on its global process "
                             "set, which checks every collective's arguments on every rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", dest="json_path")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run on the current MPI world and print rank 0's table."""
    a = build_parser().parse_args(argv)
    rows = run_torch_bench(layers=a.layers, width=a.width, batch=a.batch, steps=a.steps, rounds=a.rounds,
                           codecs=a.codecs, unfused=a.unfused, threads=a.threads, no_overlap=a.no_overlap,
                           lane=a.lane, hvd_init=a.hvd_init)
    import commwire as cw

    emit(format_table(rows), rows, a.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
