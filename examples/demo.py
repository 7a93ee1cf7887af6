"""commwire in a few minutes: each capability next to its baseline, measured where it pays.

    commwire run -np 4 python examples/demo.py            # --no-lab: one machine only

On one machine messages go through shared memory (~15 µs, many GB/s): fewer
bytes and fewer messages barely pay there, and codecs cost CPU. So:

- as root with ``ip`` and ``tc``, the demo brings up a 4-host emulated cluster
  (network namespaces on one bridge, every link limited to 1 Gbit/s, MPI over
  TCP between them; ``commwire lab``) for the link-bound parts — compressed
  all-reduce vs FP32, DistributedOptimizer vs torch DDP, CA-SGD vs SGD — and
  takes it down again at the end, also on Ctrl-C (a lab that was already up is
  used and left up);
- otherwise it measures those parts on this machine and prints next to them
  the cost model's projection for a 1 Gbit/s and a 10 Gbit/s cluster,
  clearly labelled as a projection.

Everything marked "measured" is measured in this run; nothing is quoted from
elsewhere. It ends with a summary: capability, baseline, ratio, where.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import commwire as cw

LAB_HOSTS, LAB_BANDWIDTH = 4, "1gbit"
CLUSTERS = {"1 Gbit/s": 1e9, "10 Gbit/s": 1e10}
ALPHA = 12.4e-6  # s per round: fitted on the 4-host lab (docs/results/2026-11-costmodel.md); its link ran at 0.86 of line rate
LINE_FRACTION = 0.86


def say(comm: cw.Communicator, text: str = "") -> None:
    """Print on rank 0 only."""
    if comm.rank == 0:
        print(text, flush=True)


def _slowest(comm: cw.Communicator, seconds: float) -> float:
    from mpi4py import MPI

    return float(comm.mpi.allreduce(seconds, op=MPI.MAX))


# --------------------------------------------------------------------------- the parts
def overhead(comm: cw.Communicator) -> dict[str, Any]:
    """A correct sum, an error every rank raises together, and the overhead over raw mpi4py."""
    from commwire.bench.allreduce import run_allreduce_bench

    result = cw.allreduce(np.ones(3) * comm.rank)
    try:  # the last rank passes a bad dtype: every rank raises, the next call pairs up
        cw.allreduce(np.ones(2, np.complex64 if comm.rank == comm.size - 1 else np.float32), name="demo.bad")
        raised = False
    except TypeError:
        raised = True
    run_allreduce_bench([8, 1 << 20], repeats=2)  # warm-up: connections, page faults, the first calls' agreement
    rows = run_allreduce_bench([8, 1 << 20], repeats=7)
    return {"sum": result.tolist(), "raised_everywhere": all(comm.allgather_object(raised)),
            "ratios": {r["bytes"]: r["ratio"] for r in rows}}


def compressed(comm: cw.Communicator) -> list[dict[str, Any]]:
    """FP32 MPI_Allreduce vs FP8 and NVFP4 compressed all-reduce of 16 MiB, in this job."""
    from commwire.bench.allreduce import run_allreduce_bench

    return [row for codec in ("fp8-e4m3", "nvfp4") for row in run_allreduce_bench([16 << 20], repeats=3,
                                                                                   codec=codec)]


def casgd(comm: cw.Communicator) -> list[dict[str, Any]]:
    """The same logistic regression with SGD (FP32) and CA-SGD (s=32, mixed precision)."""
    from commwire.glm import GLM

    rng = np.random.default_rng(0)
    X = rng.standard_normal((20_000, 64)) / 8
    y = (X @ rng.standard_normal(64) + 0.3 * rng.standard_normal(20_000) > 0).astype(float)
    rows = []
    for solver, s, precision in (("sgd", 1, "fp32"), ("casgd", 32, "mixed")):
        model = GLM(loss="logistic", solver=solver, s=s, batch_size=4, lr=0.5, precision=precision,
                    max_iter=1, tol=None, random_state=0)
        cw.stats(reset=True)
        comm.barrier()
        start = time.perf_counter()
        model.fit(X, y)
        wall = _slowest(comm, time.perf_counter() - start)
        snap = cw.stats(reset=True).get("allreduce", {"calls": 0, "bytes": 0, "time_s": 0.0})
        rows.append({"solver": solver, "s": s, "precision": precision, "allreduces": snap["calls"],
                     "bytes": snap["bytes"], "comm_s": _slowest(comm, snap["time_s"]), "wall_s": wall,
                     "loss": float(model.loss_curve_[-1])})
    return rows


def torch_vs_ddp(comm: cw.Communicator) -> list[dict[str, Any]] | None:
    """DistributedOptimizer (FP32, FP8, NVFP4) vs torch DDP over gloo on a 100-tensor MLP."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from commwire.bench.torch_ddp import run_torch_bench

    return run_torch_bench(layers=50, width=256, batch=32, steps=3, rounds=3, codecs="fp8-e4m3,nvfp4",
                           unfused=False)


def link_bound_parts(comm: cw.Communicator) -> dict[str, Any]:
    """Run the three parts that depend on the network."""
    return {"compressed": compressed(comm), "casgd": casgd(comm), "torch": torch_vs_ddp(comm)}


# --------------------------------------------------------------------------- the lab
def _lab_possible(no_lab: bool) -> tuple[bool, str]:
    if no_lab:
        return False, "--no-lab given"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        why = ", ".join(([f"{m} not found" for m in missing]) + ([] if os.geteuid() == 0 else ["not root"]))
        return False, why
    return True, ""


def run_on_lab(comm: cw.Communicator, out: Path) -> tuple[dict[str, Any] | None, str]:
    """Rank 0 brings up (or reuses) the lab and runs the link-bound parts there; the others wait idle."""
    result: tuple[dict[str, Any] | None, str] = (None, "")
    if comm.rank == 0:
        result = _drive_lab(out)
    _idle_barrier(comm)  # waiting ranks sleep instead of spinning: the lab's ranks use these cores
    return comm.broadcast_object(result, 0)


def _drive_lab(out: Path) -> tuple[dict[str, Any] | None, str]:
    from commwire.lab import netns

    owned = False
    try:
        running = netns.status()
        if running is None:
            print(f"bringing up a {LAB_HOSTS}-host emulated cluster ({LAB_BANDWIDTH} links, network namespaces); "
                  "it is removed at the end", flush=True)
            netns.up(LAB_HOSTS, LAB_BANDWIDTH)
            owned = True
        elif running.hosts < LAB_HOSTS:
            return None, f"a {running.hosts}-host lab is already up; take it down (commwire lab down) or pass --no-lab"
        else:
            print(f"using the {running.hosts}-host lab that is already up ({running.bandwidth}); leaving it up",
                  flush=True)
        cmd = [sys.executable, "-m", "commwire", "run", "--lab", "-np", str(LAB_HOSTS), "--no-tag-output",
               sys.executable, str(Path(__file__).resolve()), "--lab-part", str(out)]
        with netns.signals_raise():
            # commwire run drops this job's launcher variables before starting the inner one
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            return None, "the lab job failed: " + " | ".join(tail)
        return json.loads(out.read_text()), ""
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return None, f"the lab did not run: {exc}"
    finally:
        if owned:
            netns.down()
            print("lab removed", flush=True)


def _idle_barrier(comm: cw.Communicator) -> None:
    request = comm.mpi.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def lab_part(out: str) -> None:
    """Inside the lab job: run the link-bound parts; rank 0 writes the results."""
    comm = cw.init()
    results = link_bound_parts(comm)
    if comm.rank == 0:
        Path(out).write_text(json.dumps(results))


# --------------------------------------------------------------------------- projections
def projections(comm: cw.Communicator, measured: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Project the link-bound parts to clusters with the cost model (commwire.costmodel)."""
    from commwire.costmodel import LinkModel, allreduce_seconds, codec_rates, compressed_seconds

    p = comm.size
    rates = {codec: codec_rates(codec) for codec in ("fp8-e4m3", "nvfp4")} if comm.rank == 0 else None
    rates = comm.broadcast_object(rates, 0)
    out: dict[str, dict[str, Any]] = {}
    n = 16 << 20
    for label, bps in CLUSTERS.items():
        link = LinkModel(alpha=ALPHA, beta=8 / (bps * LINE_FRACTION))
        fp32 = allreduce_seconds(link, n, p)
        row: dict[str, Any] = {"fp32_ms": fp32 * 1e3}
        for codec, (enc, dec, ratio) in rates.items():
            row[codec] = fp32 / compressed_seconds(link, n, p, wire_ratio=ratio, enc_Bps=enc, dec_Bps=dec)
        sgd, ca = measured["casgd"]
        for r, key in ((sgd, "sgd_s"), (ca, "casgd_s")):
            per = r["bytes"] / max(r["allreduces"], 1)
            row[key] = (r["wall_s"] - r["comm_s"]) + r["allreduces"] * allreduce_seconds(link, per, p)
        out[label] = row
    return out


# --------------------------------------------------------------------------- printing
def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def show_link_parts(comm: cw.Communicator, parts: dict[str, Any], where: str) -> list[list[str]]:
    """Print the three link-bound parts; return their summary rows."""
    summary = []
    say(comm, f"\n== compressed all-reduce of 16 MiB, 4 ranks — {where} ==")
    say(comm, _table([[r["codec"], f"{r['raw_us'] / 1e3:.1f}", f"{r['commwire_us'] / 1e3:.1f}",
                       f"{r['raw_us'] / r['commwire_us']:.2f}x", f"{r['wire_bytes_per_elem']:.2f}",
                       f"{r['rel_l2_err']:.3f}"] for r in parts["compressed"]],
                     ["codec", "FP32 MPI ms", "compressed ms", "speed-up", "wire B/float", "rel. error"]))
    for r in parts["compressed"]:
        summary.append([f"all-reduce {r['codec']}", "FP32 MPI_Allreduce",
                        f"{r['raw_us'] / r['commwire_us']:.2f}x speed-up", where])
    sgd, ca = parts["casgd"]
    say(comm, f"\n== logistic regression 20000 x 64, b=4: SGD vs CA-SGD (s=32) — {where} ==")
    say(comm, _table([[r["solver"], r["precision"], str(r["allreduces"]), f"{r['bytes'] / 1e6:.2f}",
                       f"{r['wall_s']:.2f}", f"{r['loss']:.5f}"] for r in (sgd, ca)],
                     ["solver", "precision", "all-reduces", "MB sent", "wall s", "final loss"]))
    summary.append(["CA-SGD (s=32)", "FP32 SGD, same batches", f"{sgd['wall_s'] / ca['wall_s']:.1f}x speed-up, "
                    f"{sgd['allreduces'] / max(ca['allreduces'], 1):.0f}x fewer all-reduces, loss "
                    f"{100 * (ca['loss'] / sgd['loss'] - 1):+.3f}%", where])
    if parts["torch"]:
        from commwire.bench.torch_ddp import format_table

        say(comm, f"\n== DistributedOptimizer vs torch DDP (gloo), 100-tensor MLP — {where} ==")
        say(comm, format_table(parts["torch"]))
        for r in parts["torch"][1:]:
            summary.append([r["config"].replace("commwire ", "DistributedOptimizer "), "torch DDP (gloo, FP32)",
                            f"{r['ratio_vs_ddp']:.2f}x the step time", where])
    return summary


def main() -> None:
    """Run the demo (or, with --lab-part, its link-bound parts inside the lab job)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-lab", action="store_true", help="run everything on this machine")
    parser.add_argument("--lab-part", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lab_part:
        lab_part(args.lab_part)
        return
    comm = cw.init()
    start = time.perf_counter()
    say(comm, f"commwire {cw.__version__} on {comm.size} ranks")
    basics = overhead(comm)
    say(comm, f"\nall-reduce of 0+1+2+3 on every rank: {basics['sum']}; a bad dtype on one rank raised on every rank: "
              f"{basics['raised_everywhere']}")
    summary = [["all-reduce overhead, 8 B / 1 MiB", "raw mpi4py Allreduce",
                f"{basics['ratios'][8]:.2f}x / {basics['ratios'][1 << 20]:.2f}x the time", "this machine (measured)"]]
    possible, why = _lab_possible(args.no_lab) if comm.rank == 0 else (False, "")
    possible = comm.broadcast_object(possible, 0)
    parts = None
    if possible:
        with tempfile.TemporaryDirectory() as tmp:
            parts, problem = run_on_lab(comm, Path(tmp) / "lab.json")
        if parts is None:
            say(comm, f"\n{problem}; showing this machine's figures and the cost model's projections instead")
    if parts is not None:
        summary += show_link_parts(comm, parts, "4-host lab, 1 Gbit/s (measured)")
    else:
        local = link_bound_parts(comm)
        summary += show_link_parts(comm, local, "this machine, shared memory (measured)")
        proj = projections(comm, local)
        say(comm, "\n== PROJECTION (cost model, not measured): the same on 4 nodes of a cluster ==")
        say(comm, _table([[label, f"{r['fp32_ms']:.1f}", f"{r['fp8-e4m3']:.2f}x", f"{r['nvfp4']:.2f}x",
                           f"{r['sgd_s'] / r['casgd_s']:.1f}x"] for label, r in proj.items()],
                         ["links", "FP32 all-reduce 16 MiB ms", "FP8 speed-up", "NVFP4 speed-up",
                          "CA-SGD speed-up"]))
        for label, r in proj.items():
            summary.append(["all-reduce nvfp4 / fp8", "FP32 MPI_Allreduce",
                            f"{r['nvfp4']:.1f}x / {r['fp8-e4m3']:.1f}x speed-up", f"PROJECTION, {label} cluster"])
            summary.append(["CA-SGD (s=32)", "FP32 SGD", f"{r['sgd_s'] / r['casgd_s']:.1f}x speed-up",
                            f"PROJECTION, {label} cluster"])
        if comm.rank == 0 and not args.no_lab:
            say(comm, f"\n(link-bound figures need the emulated cluster: {why or 'it did not run'}; run this as "
                      "root with iproute2 installed to measure them)")
    say(comm, "\n== summary ==")
    say(comm, _table(summary, ["capability", "baseline", "result", "where"]))
    say(comm, f"\n(demo took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
