"""Benchmark commwire's two transports against torch.distributed's own all_reduce, same job.

For each message size, one MPI job times, on the same float32 data and interleaved
call by call so that noise hits every arm alike:

- ``torch.distributed``: ``dist.all_reduce`` of a CPU tensor on the default group (gloo) — the baseline;
- ``commwire mpi``: ``Communicator.allreduce`` on the mpi transport (the world communicator);
- ``commwire torch``: the same call on a communicator over torch.distributed's default group
  (``Communicator.from_process_group``);
- ``mpi4py Allreduce``: the MPI library's own all-reduce, for reference;
- with ``--codec``, the compressed all-reduce on each transport;
- with ``--exchange``, what one pipeline segment of the compressed all-reduce costs each
  transport in messages alone: every rank sends that many bytes to, and receives as many
  from, every other rank (MPI ``Isend``/``Irecv`` against ``torch.distributed``
  ``isend``/``irecv``), ratio to MPI.

Every sample is the slowest rank's time of one call (all ranks start together after a
barrier), or with ``--calls N`` its time per call over N calls back to back, as a training
step's buckets follow each other (the FP32 arms' in-place sums are reset after each
sample); the table gives the median of ``--repeats`` samples and each arm's ratio to the
baseline (FP32 arms) or to the mpi transport's compressed all-reduce (the torch transport's
compressed arm), and the CPU time one call took on all ranks together, with the part spent
outside the calling threads (gloo's own threads; MPICH moves data in the caller's thread and
polls while it waits, so its arms' CPU time includes waiting). Where ranks share cores (the
lab: every namespace on this machine's cores), CPU time near cores × wall time means the arm
is bound by the CPU, not by the link. Run it where the link is the bottleneck: ``commwire lab up --hosts 4`` then
``commwire run --lab -np 4 python -m commwire.bench.transports``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ._report import emit
from .allreduce import check_sizes_and_codecs, parse_size

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "check_args", "run_transport_bench", "format_table", "main"]

NAME = "transports"
HELP = "FP32 and compressed all-reduce on the mpi and torch transports vs torch.distributed's all_reduce"
DRIVER = False

DEFAULT_SIZES = "1M,4M,16M,64M"


def _sample(comm: Any, fn: Callable[[], Any], cpu: list[tuple[float, float]] | None = None,
            calls: int = 1) -> float:
    """Return the slowest rank's seconds per call of ``fn``, ``calls`` calls back to back (ranks start together).

    With ``cpu``, also append the CPU seconds per call summed over the ranks: every thread of
    each rank's process, and the part that ran outside the calling thread (gloo's threads, lanes).
    """
    from mpi4py import MPI

    comm.mpi.Barrier()
    start, proc, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(calls):
        fn()
    wall = (time.perf_counter() - start) / calls
    if cpu is None:
        return float(comm.mpi.allreduce(wall, op=MPI.MAX))
    used, own = (time.process_time() - proc) / calls, (time.thread_time() - thread) / calls
    every = comm.mpi.allgather((wall, used, used - own))
    cpu.append((sum(e[1] for e in every), sum(e[2] for e in every)))
    return float(max(e[0] for e in every))


def _row(ranks: int, nbytes: int, kind: str, arm: str, samples: list[float], base: float, baseline: str,
         moved: int, cpu: list[tuple[float, float]] | None = None) -> dict[str, Any]:
    """One table row: the median of ``samples`` (seconds), its ratio to ``base``, GB/s of ``moved`` bytes,
    and the median CPU time per call of every rank together (``cpu``: see ``_sample``)."""
    median = float(np.median(samples))
    row = {"ranks": ranks, "bytes": nbytes, "kind": kind, "arm": arm, "median_ms": median * 1e3,
           "min_ms": min(samples) * 1e3, "max_ms": max(samples) * 1e3, "GBps": moved / median / 1e9,
           "ratio": median / base, "baseline": baseline}
    if cpu:
        row["cpu_ms"] = float(np.median([c[0] for c in cpu])) * 1e3
        row["cpu_threads_ms"] = float(np.median([c[1] for c in cpu])) * 1e3
    return row


def exchange_rows(world: Any, nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Time one all-peers exchange of ``nbytes`` per peer over MPI and over torch.distributed's default group."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    mpi = world.mpi.Dup()  # apart from every other message of the job
    rank, size = mpi.Get_rank(), mpi.Get_size()
    peers = [r for r in range(size) if r != rank]
    send = np.full(nbytes, rank, dtype=np.uint8)
    got = np.zeros((len(peers), nbytes), dtype=np.uint8)
    t_send, t_got = torch.from_numpy(send), torch.zeros(len(peers), nbytes, dtype=torch.uint8)

    def over_mpi() -> None:
        reqs = [mpi.Irecv(got[i], source=p, tag=11) for i, p in enumerate(peers)]
        MPI.Request.Waitall(reqs + [mpi.Isend(send, dest=p, tag=11) for p in peers])

    def over_torch() -> None:
        works = [dist.irecv(t_got[i], src=p, tag=11) for i, p in enumerate(peers)]
        for work in works + [dist.isend(t_send, dst=p, tag=11) for p in peers]:
            work.wait()

    arms = [("MPI Isend/Irecv", over_mpi), (f"torch.distributed isend/irecv ({dist.get_backend()})", over_torch)]
    for _, fn in arms:
        for _ in range(3):
            fn()
    samples: list[list[float]] = [[] for _ in arms]
    for _ in range(repeats):
        for i, (_, fn) in enumerate(arms):
            samples[i].append(_sample(world, fn))
    for buf in (got, t_got.numpy()):  # every peer's bytes arrived: a broken exchange is not timed as a fast one
        if not all((row == p).all() for row, p in zip(buf, peers)):
            raise RuntimeError(f"rank {rank}: the exchange delivered wrong bytes")
    mpi.Free()
    base = float(np.median(samples[0]))
    return [_row(size, nbytes, "exchange", label, samples[i], base, arms[0][0], nbytes * len(peers))
            for i, (label, _) in enumerate(arms)]


def run_transport_bench(sizes: list[int], *, repeats: int = 5, codec: str | None = "fp8-e4m3",
                        threads: int = 1, exchange: list[int] | None = None, calls: int = 1) -> list[dict[str, Any]]:
    """Time every arm at every size (``calls`` calls back to back per sample); return one row per (size, arm)."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import commwire as cw
    from commwire.comm.communicator import Communicator
    from commwire.comm.torch_transport import init_torch_distributed

    torch.set_num_threads(threads)
    world = cw.init()  # the mpi transport unless COMMWIRE_TRANSPORT says otherwise
    if world.transport.name != "mpi":
        raise ValueError(f"run this benchmark with the mpi transport as the world's (COMMWIRE_TRANSPORT="
                         f"{world.transport.name!r} is set); it builds the torch communicator itself")
    if not dist.is_initialized():
        init_torch_distributed(world.mpi, "gloo")
    backend = dist.get_backend()
    tcomm = Communicator.from_process_group(dist.group.WORLD, comm=world)
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        rng = np.random.default_rng(world.rank)
        x = rng.standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        # The FP32 arms reduce in place, as dist.all_reduce does: each its own buffer, reset to x
        # after every sample (the sums grow by a factor of the rank count per call).
        t, y, ty, z = torch.from_numpy(x.copy()), x.copy(), torch.from_numpy(x.copy()), x.copy()
        t_out = torch.empty_like(t)
        tx = torch.from_numpy(x)
        arms: list[tuple[str, str, Callable[[], Any]]] = [
            ("fp32", f"torch.distributed ({backend})", lambda: dist.all_reduce(t)),
            ("fp32", "commwire mpi", lambda: world.allreduce(y, out=y, name="bench.fp32")),
            ("fp32", f"commwire torch ({backend})", lambda: tcomm.allreduce(ty, out=ty, name="bench.fp32")),
            ("fp32", "mpi4py Allreduce", lambda: world.mpi.Allreduce(MPI.IN_PLACE, z)),
        ]

        def reset() -> None:
            np.copyto(y, x)
            np.copyto(z, x)
            t.copy_(tx)
            ty.copy_(tx)

        if codec:
            arms += [
                (codec, "commwire mpi", lambda: cw.allreduce(x, codec=codec, out=out, name="bench.c", comm=world)),
                (codec, f"commwire torch ({backend})",
                 lambda: cw.allreduce(tx, codec=codec, out=t_out, name="bench.c", comm=tcomm)),
            ]
        from ..codecs.collective import TUNE_CALLS, tuned_segment_bytes

        for kind, _, fn in arms:  # warm-up: connections, buffers, numba, the codec segment tuner
            for _ in range(2 + (TUNE_CALLS if kind != "fp32" else 0)):
                fn()
                reset()
        samples: list[list[float]] = [[] for _ in arms]
        cpu: list[list[tuple[float, float]]] = [[] for _ in arms]
        for _ in range(repeats):
            for i, (_, _, fn) in enumerate(arms):
                samples[i].append(_sample(world, fn, cpu[i], calls))
            reset()
        medians = [float(np.median(s)) for s in samples]
        fp32_arms = sum(kind == "fp32" for kind, _, _ in arms)  # the codec arms follow, the mpi transport's first
        for i, (kind, label, _) in enumerate(arms):
            base, baseline = ((medians[0], arms[0][1]) if kind == "fp32"
                              else (medians[fp32_arms], f"{codec} on commwire mpi"))
            rows.append(_row(world.size, n * 4, kind, label, samples[i], base, baseline, n * 4, cpu[i]))
            rows[-1]["calls"] = calls
            if kind != "fp32":  # the tuner's choice explains a slow arm (more segments: more messages)
                rows[-1]["segment_bytes"] = tuned_segment_bytes(world if "mpi" in label else tcomm, codec, n)
    for nbytes in exchange or []:
        rows += exchange_rows(world, nbytes, max(repeats, 5))
    tcomm.free()
    return rows


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table."""
    from .allreduce import _human

    head = ("| ranks | size | payload | arm | median ms | min–max ms | GB/s | ratio | vs | segment KiB "
            "| CPU ms, all ranks (other threads) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        seg = f"{r['segment_bytes'] / 1024:.0f}" if r.get("segment_bytes") else "-"
        cpu = f"{_ms(r['cpu_ms'])} ({_ms(r['cpu_threads_ms'])})" if "cpu_ms" in r else "-"
        lines.append(f"| {r['ranks']} | {_human(r['bytes'])} | {r['kind']} | {r['arm']} | {_ms(r['median_ms'])} | "
                     f"{_ms(r['min_ms'])}–{_ms(r['max_ms'])} | {r['GBps']:.3f} | {r['ratio']:.3f} | {r['baseline']} "
                     f"| {seg} | {cpu} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench transports``."""
    parser = argparse.ArgumentParser(prog="commwire bench transports", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes (bytes, K, M)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved samples per arm and size (median)")
    parser.add_argument("--codec", default="fp8-e4m3", help="codec of the compressed arms ('' for none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--calls", type=int, default=1, help="calls per sample, back to back (the sample is "
                        "their mean); 1: one call that all ranks start together")
    parser.add_argument("--exchange", default="", help="also time an all-peers exchange of these bytes per peer "
                        "over MPI and torch.distributed (comma-separated, e.g. 4K,64K)")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad ``--sizes``, ``--repeats`` or ``--codec`` before any rank starts."""
    check_sizes_and_codecs(args.sizes, args.codec or "", example="1M,4M")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: give 1 or more (the table shows the median)")
    if args.calls < 1:
        raise ValueError(f"--calls {args.calls}: give 1 or more (calls per sample, back to back)")
    check_sizes_and_codecs(args.exchange, "", example="4K,64K", option="--exchange")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run on the current MPI world and print rank 0's table."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    exchange = [parse_size(s) for s in args.exchange.split(",") if s.strip()]
    rows = run_transport_bench(sizes, repeats=args.repeats, codec=args.codec or None, threads=args.threads,
                               exchange=exchange, calls=args.calls)
    import commwire as cw

    emit(format_table(rows), rows, args.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
