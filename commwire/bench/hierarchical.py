"""Benchmark the hierarchical compressed all-reduce against the flat one and FP32 MPI, same job.

For each message size and codec, one MPI job runs on the same float32 data, arms
interleaved sample by sample so that noise hits them alike:

- ``fp32 mpi``: mpi4py's ``Allreduce`` (the MPI library's own algorithm) — the baseline;
- ``flat``: ``compressed_allreduce(..., hierarchical=False)``: every rank's tensor encoded,
  payloads exchanged with every other rank;
- ``hierarchical``: FP32 reduce-scatter inside each node, the codec across nodes only,
  FP32 all-gather inside each node (``commwire.codecs.hierarchical``).

Each sample is the slowest rank's time per call over ``--calls`` calls back to back; the
table gives the median of ``--repeats`` samples and the ratio to the baseline, and the
relative error of the result against the float64 sum of every rank's tensor (the same on
every rank: results are bit-identical across ranks). Bytes leaving a node per call, two ways:

- ``pattern``: from the message pattern, per node: the flat arm sends every peer a
  ``1/P`` share of its encoded tensor in each of two phases, ``2 (P - L) c / P`` per rank
  to the ``P - L`` ranks of other nodes (``c``: encoded bytes of the tensor, ``L`` ranks
  per node); the hierarchical arm's across-node all-reduce ``2 (N - 1) c / (N L)`` per rank;
- ``NIC``: measured, the growth of the node's network interfaces' transmitted bytes
  (``/proc/net/dev``, loopback left out) over the timed calls, headers included; it counts
  only where the job alone uses the interfaces (the lab's namespaces).

Nodes are the ranks on one host (the lab: one network namespace), or blocks of ``--group``
consecutive ranks. Run it where the network is the bottleneck and several ranks share each
host: ``commwire lab up --hosts 2`` then ``commwire run --lab -np 4 python -m
commwire.bench.hierarchical`` (2 ranks per lab host).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import numpy as np

from ._report import emit
from .allreduce import _human, check_sizes_and_codecs, parse_size
from .transports import _sample


def _bytes(n: float) -> str:
    """Return ``n`` bytes with three significant digits (KiB, MiB)."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "check_args", "run_hierarchical_bench", "format_table", "main"]

NAME = "hierarchical"
HELP = "hierarchical compressed all-reduce (lossless inside nodes) vs the flat one and FP32 MPI"
DRIVER = False

DEFAULT_SIZES = "1M,4M,16M,64M"
DEFAULT_CODECS = "fp8-e4m3,ef+nvfp4"


def _nic_tx() -> int:
    """Return the bytes this network namespace's interfaces (not loopback) have transmitted."""
    total = 0
    try:
        with open("/proc/net/dev", encoding="ascii") as fh:
            for line in fh.readlines()[2:]:
                name, _, fields = line.partition(":")
                if name.strip() != "lo":
                    total += int(fields.split()[8])
    except OSError:
        return 0
    return total


def run_hierarchical_bench(sizes: list[int], codecs: list[str], *, repeats: int = 5, calls: int = 3,
                           group: Any = True, seed: int = 0) -> list[dict[str, Any]]:
    """Time the three arms at each size and codec on the current world; return the table's rows (every rank)."""
    from mpi4py import MPI

    import commwire as cw
    from commwire.codecs.collective import compressed_allreduce, resolve_codec
    from commwire.codecs.hierarchical import hierarchy_setting, levels_of

    cw.init()
    comm = cw.world()
    mpi, size = comm.mpi, comm.size
    setting = hierarchy_setting(group)
    if setting is None:
        raise ValueError(f"--group {group!r}: the hierarchical arm needs a hierarchy ('node' or a group size)")
    levels = levels_of(comm, *setting)
    per = levels.per_group if levels is not None else 1
    nodes = size // per
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        n = nbytes // 4
        x = np.random.default_rng(seed + comm.rank).standard_normal(n).astype(np.float32)
        exact = np.zeros(n, dtype=np.float64)
        for r in range(size):  # the float64 reference, from every rank's data regenerated here
            exact += np.random.default_rng(seed + r).standard_normal(n).astype(np.float32)
        norm = float(np.linalg.norm(exact))
        fp32_out = np.empty_like(x)
        for codec in codecs:
            outs = {"flat": np.empty_like(x), "hierarchical": np.empty_like(x)}
            arms: dict[str, Callable[[], Any]] = {
                "fp32 mpi": lambda: mpi.Allreduce(x, fp32_out, op=MPI.SUM),
                "flat": lambda: compressed_allreduce(comm, x, codec=codec, out=outs["flat"], name="flat",
                                                     hierarchical=False),
                "hierarchical": lambda: compressed_allreduce(comm, x, codec=codec, out=outs["hierarchical"],
                                                             name="hierarchical", hierarchical=group),
            }
            for arm, fn in arms.items():  # warm-up: connections, plans, the segment tuners
                for _ in range(30 if arm != "fp32 mpi" else 3):
                    fn()
            encoded = resolve_codec(codec).wire_nbytes(n)
            pattern = {"fp32 mpi": -1, "flat": 2 * (size - per) * encoded / size,
                       "hierarchical": 2 * (nodes - 1) * encoded / (nodes * per) if nodes > 1 else 0}
            samples: dict[str, list[float]] = {arm: [] for arm in arms}
            nic = {arm: 0 for arm in arms}
            for _ in range(repeats):
                for arm, fn in arms.items():
                    before = _nic_tx()
                    samples[arm].append(_sample(comm, fn, calls=calls))
                    nic[arm] += _nic_tx() - before
            base = float(np.median(samples["fp32 mpi"]))
            # one node's interfaces, read once per node (its first rank), per call
            node_nic = mpi.allgather(nic if levels is None or levels.inner.rank == 0 else None)
            for arm in arms:
                result = fp32_out if arm == "fp32 mpi" else outs[arm]
                measured = [d[arm] / (repeats * calls) for d in node_nic if d is not None]
                median = float(np.median(samples[arm]))
                rows.append({
                    "ranks": size, "nodes": nodes, "bytes": nbytes, "codec": codec, "arm": arm,
                    "median_ms": median * 1e3, "min_ms": min(samples[arm]) * 1e3, "max_ms": max(samples[arm]) * 1e3,
                    "ratio": median / base,
                    "off_node_bytes_pattern": int(pattern[arm] * per),
                    "nic_tx_bytes_per_node": int(max(measured)) if measured else 0,
                    "rel_error": float(np.linalg.norm(result - exact) / norm) if norm else 0.0,
                })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table."""
    lines = ["| ranks | nodes | size | codec | arm | median ms | min–max ms | ratio to fp32 mpi | bytes out of a "
             "node per call: pattern / NIC | rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pattern = "-" if r["off_node_bytes_pattern"] < 0 else _bytes(r["off_node_bytes_pattern"])
        lines.append(f"| {r['ranks']} | {r['nodes']} | {_human(r['bytes'])} | {r['codec']} | {r['arm']} | "
                     f"{r['median_ms']:.2f} | {r['min_ms']:.2f}–{r['max_ms']:.2f} | {r['ratio']:.3f} | "
                     f"{pattern} / {_bytes(r['nic_tx_bytes_per_node'])} | {r['rel_error']:.2e} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench hierarchical``."""
    parser = argparse.ArgumentParser(prog="commwire bench hierarchical", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes (bytes, K, M)")
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="comma-separated codec specs")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved samples per arm (median)")
    parser.add_argument("--calls", type=int, default=3, help="calls per sample, back to back")
    parser.add_argument("--group", default="node", help="'node' (the ranks on one host) or ranks per group")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad sizes, codecs, counts or group before any rank starts."""
    from commwire.codecs.hierarchical import hierarchy_setting

    check_sizes_and_codecs(args.sizes, args.codecs, example="1M,16M")
    if not args.codecs.strip():
        raise ValueError("--codecs is empty: give at least one codec, e.g. fp8-e4m3")
    for option, value in (("--repeats", args.repeats), ("--calls", args.calls)):
        if value < 1:
            raise ValueError(f"{option} {value}: give 1 or more")
    if hierarchy_setting(args.group) is None:
        raise ValueError(f"--group {args.group!r}: give 'node' or a number of ranks per group >= 2")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run on the current MPI world and print rank 0's table."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    group = args.group if args.group.strip().lower() == "node" else int(args.group)
    rows = run_hierarchical_bench(sizes, codecs, repeats=args.repeats, calls=args.calls, group=group)
    import commwire as cw

    emit(format_table(rows), rows, args.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
