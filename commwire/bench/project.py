"""Project FP32 and compressed all-reduce times to a cluster of many nodes with the α–β cost model.

Give your cluster's links (``--bandwidth``, ``--latency``) and an all-reduce
size: the cost model (:mod:`commwire.costmodel`, MPICH's algorithm choice,
commwire's pipelined compressed all-reduce) predicts the FP32 all-reduce and
each codec's at every node count, one rank per node, with the codecs' encode
and decode throughput measured on this machine (its cores stand in for a node's).

To fit the links on your own all-reduce measurements (``commwire bench allreduce
--json``) and check the model against them, run ``python benchmarks/calibrate.py``
from a checkout of the repository.

Run:
    commwire bench project --nodes 2,16,256,1024 --bandwidth 100gbit --latency 5us --size 64M
"""

from __future__ import annotations

import argparse

from ..costmodel import LinkModel, allreduce_seconds, codec_rates, compressed_seconds

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "check_args", "main", "parse_latency", "projection"]

NAME = "project"
HELP = "alpha-beta cost model: project FP32 and compressed all-reduce to 1024 nodes"
DRIVER = False


def parse_latency(text: str) -> float:
    """Parse a latency like ``5us``, ``150us`` or ``1ms`` into seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * units[unit]
            except ValueError:
                break
    raise ValueError(f"latency {text!r} is not like 5us, 150us or 1ms")


def projection(link: LinkModel, nbytes: int, nodes: list[int], specs: list[str], size_text: str) -> str:
    """Return the Markdown projection of an all-reduce of ``nbytes`` on ``link`` at each node count.

    One row per node count: the FP32 time and, for each codec of ``specs``, its
    time and speed-up over FP32 (codec throughput measured on this machine).
    """
    rates = {spec: codec_rates(spec) for spec in specs}
    lines = [f"projection: {size_text} all-reduce, α = {link.alpha * 1e6:.1f} µs, "
             f"{8 / link.beta / 1e9:.2f} Gbit/s per link; codec throughput measured on this machine, "
             "one rank per node",
             "| nodes | FP32 ms | " + " | ".join(f"{s} ms | {s} speedup" for s in specs) + " |",
             "|" + "---|" * (2 + 2 * len(specs))]
    for p in nodes:
        t32 = allreduce_seconds(link, nbytes, p)
        cells = [f"{p}", f"{t32 * 1e3:.2f}"]
        for spec in specs:
            enc, dec, ratio = rates[spec]
            tc = compressed_seconds(link, nbytes, p, wire_ratio=ratio, enc_Bps=enc, dec_Bps=dec)
            cells += [f"{tc * 1e3:.2f}", f"{t32 / tc:.2f}x" if tc > 0 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench project``."""
    parser = argparse.ArgumentParser(prog="commwire bench project", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", help="link bandwidth of the cluster, e.g. 100gbit (required)")
    parser.add_argument("--latency", help="per-message latency of the cluster, e.g. 5us (required)")
    parser.add_argument("--nodes", default="2,4,8,16,64,256,1024", help="node counts to project to")
    parser.add_argument("--size", default="64M", help="all-reduce size to project")
    parser.add_argument("--codecs", default="fp8-e4m3,nvfp4", help="codecs to project (throughput measured here)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse missing or malformed link values with a ValueError that names the option and the fix."""
    from ..lab.bandwidth import parse_bandwidth
    from .allreduce import parse_size

    if not args.bandwidth or not args.latency:
        raise ValueError("give both --bandwidth and --latency of the cluster's links (e.g. --bandwidth 100gbit "
                         "--latency 5us); python benchmarks/calibrate.py fits them on measured all-reduce times")
    values = (("--bandwidth", parse_bandwidth, args.bandwidth), ("--latency", parse_latency, args.latency),
              ("--size", parse_size, args.size))
    for option, parse, text in values:
        try:
            parse(text)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    try:
        nodes = [int(v) for v in args.nodes.split(",") if v.strip()]
    except ValueError:
        nodes = []
    if not nodes or min(nodes) < 1:
        raise ValueError(f"--nodes {args.nodes!r}: give node counts >= 1, comma-separated, e.g. 2,16,1024")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and print the projection."""
    from ..lab.bandwidth import parse_bandwidth
    from .allreduce import parse_size

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    link = LinkModel(alpha=parse_latency(args.latency), beta=8 / parse_bandwidth(args.bandwidth))
    nodes = [int(v) for v in args.nodes.split(",") if v.strip()]
    specs = [c for c in args.codecs.split(",") if c]
    print(projection(link, parse_size(args.size), nodes, specs, args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
