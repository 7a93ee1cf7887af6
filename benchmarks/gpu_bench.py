"""GPU benchmarks of benchmarks/gpu_check.sh; each also runs on the CPU (``--cpu``) so it can be tested anywhere.

Parts (each prints a Markdown table and, with ``--json PATH``, writes its rows):

* ``codecs``: encode and decode GB/s of every codec on one device tensor
  (FP32 bytes per second), against a device-to-device copy of the same tensor
  timed in the same run (``ratio_to_copy``). ``--cpu``: torch CPU tensors
  (the same torch kernels) and numpy arrays (numba kernels) against memcpy.
* ``allreduce`` (under mpiexec): the FP32 all-reduce and compressed all-reduces
  of one tensor (default 64 MiB of FP32) on each rank's GPU, device path
  (direct with a CUDA-aware MPI, else staged), median ms and algorithm GB/s
  with the ratio to FP32. ``--cpu``: torch CPU tensors standing in for CUDA
  ones (``arrays.cpu_standin``).
* ``optimizer`` (under mpiexec): DistributedOptimizer's step against torch DDP
  over NCCL on the same model and batches (NCCL needs one GPU per rank; with
  more ranks than GPUs DDP falls back to gloo, and the row says so).
  ``--cpu``: gloo, a small model.
* ``report``: merge the parts' JSON files and the stage log into one
  Markdown + JSON report.

Run: ``python benchmarks/gpu_bench.py codecs --json codecs.json`` and
``mpiexec -n 2 python benchmarks/gpu_bench.py allreduce --json ar.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

CODECS = ("fp16", "bf16", "fp8-e4m3", "fp8-e4m3:block=128", "fp8-e5m2", "nvfp4", "ef+fp8-e4m3", "ef+nvfp4")
ALLREDUCE_CODECS = ("bf16", "fp8-e4m3", "nvfp4", "ef+fp8-e4m3")


# ------------------------------------------------------------------ helpers
def _torch():
    import torch

    return torch


def _device(cpu: bool) -> Any:
    torch = _torch()
    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device (torch.cuda.is_available() is False); pass --cpu to run on the CPU")
    import commwire as cw

    index = cw.local_rank() % torch.cuda.device_count() if cw.is_initialized() else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _sync(device: Any) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        _torch().cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: Any, budget: float, min_reps: int = 3, comm: Any = None) -> float:
    """Return the median seconds of one call of ``fn`` (device work included), over about ``budget`` seconds.

    With ``comm`` (a collective ``fn``) every rank runs the same number of calls: the fewest any rank wants.
    """
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    first = max(time.perf_counter() - start, 1e-6)
    reps = int(max(min_reps, min(200, budget / first)))
    if comm is not None:
        reps = int(comm.allreduce(np.array([reps], dtype=np.int64), "min")[0])
    times: list[float] = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _env() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        torch = _torch()
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from mpi4py import MPI

        info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
        from commwire.comm.runtime import query_mpi_cuda_support

        info["mpi_cuda_aware"] = query_mpi_cuda_support()
    except Exception as exc:  # noqa: BLE001 - environment facts are best effort
        info["mpi"] = f"unavailable: {exc}"
    return info


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _emit(name: str, rows: list[dict[str, Any]], columns: list[str], path: str | None, rank: int = 0,
          extra: dict[str, Any] | None = None) -> None:
    if rank != 0:
        return
    print(f"## {name}\n\n{_table(rows, columns)}\n", flush=True)
    if path:
        Path(path).write_text(json.dumps({"bench": name, "env": _env(), **(extra or {}), "rows": rows}, indent=1))


# ------------------------------------------------------------------ codecs
def bench_codecs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time encode/decode of each codec against a copy of the same tensor, in one process."""
    from commwire.codecs import get

    torch = _torch()
    device = _device(args.cpu)
    n = int(args.mib * (1 << 20)) // 4
    x = torch.randn(n, device=device)
    copy_dst = torch.empty_like(x)
    copy_s = _time(lambda: copy_dst.copy_(x), device, args.budget)
    copy_gbs = x.numel() * 4 / copy_s / 1e9
    rows = [{"codec": "copy (device-to-device)" if device.type == "cuda" else "copy (torch, CPU)",
             "kernels": "torch", "encode_GBps": copy_gbs, "decode_GBps": copy_gbs, "encode_ratio_to_copy": 1.0,
             "decode_ratio_to_copy": 1.0, "wire_bytes_per_elem": 4.0}]
    kinds: list[tuple[str, Any, Any]] = [("torch", x, lambda m: torch.empty(m, dtype=torch.uint8, device=device))]
    if args.cpu:
        host = x.numpy()
        host_dst = np.empty_like(host)
        memcpy_s = _time(lambda: np.copyto(host_dst, host), device, args.budget)
        rows.append({"codec": "copy (numpy memcpy)", "kernels": "numpy", "encode_GBps": n * 4 / memcpy_s / 1e9,
                     "decode_GBps": n * 4 / memcpy_s / 1e9, "wire_bytes_per_elem": 4.0})
        kinds.append(("numba", host, lambda m: np.empty(m, dtype=np.uint8)))
    for spec in args.codecs.split(","):
        for label, data, empty in kinds:
            codec = get(spec)
            wire = empty(codec.wire_nbytes(n))
            out = torch.empty_like(x) if label == "torch" else np.empty_like(data)
            enc = _time(lambda: codec.encode_into(data, wire, key="bench"), device, args.budget)
            dec = _time(lambda: codec.decode_from(wire, n, out=out), device, args.budget)
            base = copy_gbs if label == "torch" else rows[1]["encode_GBps"]
            rows.append({"codec": spec, "kernels": label, "encode_GBps": n * 4 / enc / 1e9,
                         "decode_GBps": n * 4 / dec / 1e9, "encode_ratio_to_copy": n * 4 / enc / 1e9 / base,
                         "decode_ratio_to_copy": n * 4 / dec / 1e9 / base,
                         "wire_bytes_per_elem": codec.wire_nbytes(n) / n})
    _emit("codecs", rows, ["codec", "kernels", "encode_GBps", "decode_GBps", "encode_ratio_to_copy",
                           "decode_ratio_to_copy", "wire_bytes_per_elem"], args.json,
          extra={"mib": args.mib, "device": str(device)})
    return rows


# ------------------------------------------------------------------ all-reduce
def bench_allreduce(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time the FP32 and compressed all-reduces of one device tensor on every rank."""
    import commwire as cw
    from commwire.codecs.collective import compressed_allreduce
    from commwire.comm import arrays

    torch = _torch()
    world = cw.init()
    device = _device(args.cpu)
    comm = world if args.cuda_aware is None else cw.Communicator(world.mpi.Dup(), cuda_aware=args.cuda_aware == "1")
    path = "direct" if comm.cuda_aware else "staged"
    n = int(args.mib * (1 << 20)) // 4
    x = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(comm.rank))
    rows = []
    with arrays.cpu_standin(args.cpu):
        def plain() -> None:
            comm.allreduce(x, "avg", name="bench.fp32")

        configs: list[tuple[str, Callable[[], None]]] = [("fp32", plain)]
        for spec in args.codecs.split(","):
            codec = cw.codecs.get(spec)
            configs.append((spec, lambda codec=codec: compressed_allreduce(
                comm, x, "avg", codec=codec, name="bench." + codec.spec, segment_bytes=args.segment_mib << 20)))
        for label, fn in configs:
            comm.barrier()
            seconds = _time(fn, device, args.budget, comm=comm)
            seconds = float(comm.allreduce(np.array([seconds]), "max")[0])  # the slowest rank's
            rows.append({"config": label, "path": path, "ranks": comm.size, "MiB": args.mib, "ms": seconds * 1e3,
                         "algbw_GBps": n * 4 / seconds / 1e9})
    base = rows[0]["ms"]
    for row in rows:
        row["speedup_vs_fp32"] = base / row["ms"]
    _emit("allreduce", rows, ["config", "path", "ranks", "MiB", "ms", "algbw_GBps", "speedup_vs_fp32"], args.json,
          rank=comm.rank, extra={"device": str(device), "segment_mib": args.segment_mib})
    return rows


# ------------------------------------------------------------------ optimizer vs DDP
def bench_optimizer(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time DistributedOptimizer's training step against DDP's on the same model and batches."""
    import commwire as cw
    import torch.distributed as dist
    from commwire.bench.torch_ddp import make_model
    from commwire.comm import arrays
    from commwire.torch.ddp import init_process_group
    from commwire.torch.optimizer import DistributedOptimizer

    torch = _torch()
    world = cw.init()
    device = _device(args.cpu)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    backend = "nccl" if device.type == "cuda" and world.size <= gpus else "gloo"
    init_process_group(backend)
    gen = torch.Generator(device=device).manual_seed(world.rank)
    batches = [torch.randn(args.batch, args.width, device=device, generator=gen) for _ in range(4)]
    rows = []

    def measure(label: str, net: Any, opt: Any) -> None:
        def step(i: list[int] = [0]) -> None:  # noqa: B006 - a step counter shared by the calls
            opt.zero_grad()
            net(batches[i[0] % len(batches)]).square().mean().backward()
            opt.step()
            i[0] += 1

        world.barrier()
        seconds = _time(step, device, args.budget, min_reps=args.steps, comm=world)
        seconds = float(world.allreduce(np.array([seconds]), "max")[0])
        rows.append({"config": label, "ranks": world.size, "ms_per_step": seconds * 1e3,
                     "params_M": sum(p.numel() for p in net.parameters()) / 1e6})

    ddp_net = torch.nn.parallel.DistributedDataParallel(
        make_model(args.layers, args.width).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    measure(f"ddp-{backend} fp32", ddp_net, torch.optim.SGD(ddp_net.parameters(), lr=1e-3))
    comm = world if args.cuda_aware is None else cw.Communicator(world.mpi.Dup(), cuda_aware=args.cuda_aware == "1")
    with arrays.cpu_standin(args.cpu):
        for compression in args.compression.split(","):
            net = make_model(args.layers, args.width).to(device)
            opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-3), net.named_parameters(),
                                       compression=compression, comm=comm)
            measure(f"commwire {compression} ({'direct' if comm.cuda_aware else 'staged'})", net, opt)
            opt.remove_hooks()
    base = rows[0]["ms_per_step"]
    for row in rows:
        row["ratio_to_ddp"] = row["ms_per_step"] / base
    dist.destroy_process_group()
    _emit("optimizer", rows, ["config", "ranks", "ms_per_step", "ratio_to_ddp", "params_M"], args.json,
          rank=world.rank, extra={"device": str(device), "layers": args.layers, "width": args.width,
                                  "batch": args.batch, "ddp_backend": backend})
    return rows


# ------------------------------------------------------------------ report
def write_report(args: argparse.Namespace) -> None:
    """Merge the JSON files of a gpu_check run and its stage log into report.md and report.json."""
    out = Path(args.out)
    stages = []
    log = Path(args.stages)
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                name, status, seconds, *note = line.split("\t")
                stages.append({"stage": name, "status": status, "seconds": float(seconds),
                               "note": note[0] if note else ""})
    parts = {}
    for path in sorted(out.glob("*.json")):
        if path.name in ("report.json",):
            continue
        try:
            parts[path.stem] = json.loads(path.read_text())
        except ValueError as exc:
            parts[path.stem] = {"error": f"unreadable: {exc}"}
    report = {"stages": stages, "parts": parts, "env": _env()}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = ["# commwire GPU check", "", _table(stages, ["stage", "status", "seconds", "note"]), ""]
    for name, part in parts.items():
        rows = part.get("rows")
        if isinstance(rows, list) and rows:
            columns = list(rows[0])
            lines += [f"## {name} ({part.get('bench', '')})", "", _table(rows, columns), ""]
        elif "error" in part:
            lines += [f"## {name}", "", part["error"], ""]
    (out / "report.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cpu", action="store_true", help="run on the CPU (torch CPU tensors stand in for CUDA)")
    common.add_argument("--json", help="also write the rows as JSON here (rank 0)")
    common.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per configuration")
    p = sub.add_parser("codecs", parents=[common])
    p.add_argument("--mib", type=float, default=64.0, help="FP32 MiB per tensor")
    p.add_argument("--codecs", default=",".join(CODECS))
    p = sub.add_parser("allreduce", parents=[common])
    p.add_argument("--mib", type=float, default=64.0, help="FP32 MiB per rank")
    p.add_argument("--codecs", default=",".join(ALLREDUCE_CODECS))
    p.add_argument("--segment-mib", type=int, default=8, help="pipeline segment (FP32 MiB; fixed: no tuning)")
    p.add_argument("--cuda-aware", choices=("0", "1"), help="force the direct (1) or staged (0) path")
    p = sub.add_parser("optimizer", parents=[common])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="at least this many timed steps")
    p.add_argument("--compression", default="none,fp16,ef+fp8-e4m3")
    p.add_argument("--cuda-aware", choices=("0", "1"), help="force the direct (1) or staged (0) path")
    p = sub.add_parser("report")
    p.add_argument("--out", required=True, help="folder of the parts' JSON files")
    p.add_argument("--stages", required=True, help="tab-separated stage log (name, status, seconds, note)")
    args = parser.parse_args(argv)
    if args.part == "report":
        write_report(args)
        return 0
    if args.cpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    {"codecs": bench_codecs, "allreduce": bench_allreduce, "optimizer": bench_optimizer}[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
