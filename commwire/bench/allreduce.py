"""Benchmark ``commwire.allreduce`` against raw mpi4py ``Allreduce`` in the same job.

Both run on the same buffers, interleaved batch by batch so that noise from
other processes hits them alike; each row reports the median per-call time of
each, the algorithm bandwidth (message bytes / time) and the ratio.

With ``--codec SPEC`` the compressed all-reduce is compared with the FP32
MPI all-reduce instead, and its time is split into encode, transfer and decode.
``--check`` picks the agreement mode of commwire's communicator (``first``, the
default, ``true`` or ``false``; see commwire.comm.protocol).

Run: ``commwire bench allreduce -np 4`` (or under any MPI launcher).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "run_allreduce_bench", "format_table", "build_parser", "check_args", "main",
           "parse_size", "check_sizes_and_codecs"]

NAME = "allreduce"
HELP = "plain and compressed all-reduce vs raw mpi4py Allreduce"
DRIVER = False

DEFAULT_SIZES = "8,64,1K,16K,256K,1M,4M,16M,64M"
CHECKS = {"first": "first", "true": True, "false": False}


def parse_size(text: str) -> int:
    """Parse ``8``, ``64K``, ``1M``, ``1G`` (powers of 1024) into bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text.strip().upper().removesuffix("B")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count like 8, 64K, 1M or 1G") from None
    if value < 4:
        raise ValueError(f"size {text!r} is below one float32 (4 bytes)")
    return value


def _timed_batches(comm: Any, fns: list[Callable[[], Any]], iters: int, repeats: int) -> list[float]:
    """Return each function's median seconds per call, batches interleaved."""
    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up: first-touch pages, MPI connection setup
        for _ in range(min(iters, 5)):
            fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            comm.mpi.Barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            elapsed = (time.perf_counter() - start) / iters
            # Every rank must agree on the sample: take the slowest rank's time.
            samples[i].append(comm.mpi.allreduce(elapsed, op=_max_op()))
    return [float(np.median(s)) for s in samples]


def _max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def _iters_for(nbytes: int, budget_s: float) -> int:
    # Aim each batch at ~budget_s assuming ~2 GB/s and 20 us latency.
    guess = 20e-6 + nbytes / 2e9
    return int(max(1, min(2000, budget_s / guess)))


def run_allreduce_bench(
    sizes: list[int], *, repeats: int = 7, budget_s: float = 0.02, codec: str | None = None,
    check: bool | str = "first",
) -> list[dict[str, Any]]:
    """Time commwire vs the raw baseline for each message size; return table rows."""
    import commwire as cw
    from ..codecs.collective import compressed_allreduce

    world = cw.init()
    comm = world if check == world.check else world.duplicate(check=check)
    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        rng = np.random.default_rng(comm.rank)
        x = rng.standard_normal(n).astype(np.float32)
        raw_out = np.empty_like(x)
        cw_out = np.empty_like(x)
        iters = _iters_for(nbytes, budget_s)

        def raw() -> None:
            comm.mpi.Allreduce(x, raw_out)

        if codec is None:
            def ours() -> None:
                comm.allreduce(x, out=cw_out)
        else:
            def ours() -> None:
                compressed_allreduce(comm, x, codec=codec, out=cw_out, name="bench")

        ours()  # first call: JIT compilation, buffers, lane: not part of the phase split
        if codec is not None:  # let the segment tuner settle first, as it does in the first steps of training
            from ..codecs.collective import TUNE_CALLS, tuned_segment_bytes

            for _ in range(TUNE_CALLS):
                if tuned_segment_bytes(comm, codec, n) is not None:
                    break
                ours()
        cw.stats(reset=True)
        t_raw, t_cw = _timed_batches(comm, [raw, ours], iters, repeats)
        row: dict[str, Any] = {
            "ranks": comm.size,
            "bytes": n * 4,
            "raw_us": t_raw * 1e6,
            "commwire_us": t_cw * 1e6,
            "raw_GBps": n * 4 / t_raw / 1e9,
            "commwire_GBps": n * 4 / t_cw / 1e9,
            "ratio": t_cw / t_raw,
            "check": check,
        }
        if codec is not None:
            row.update(_codec_breakdown(cw.stats(), n))
            row["codec"] = codec
            from ..codecs.collective import tuned_segment_bytes

            row["segment_bytes"] = tuned_segment_bytes(comm, codec, n)
            row["rel_l2_err"] = float(np.linalg.norm(cw_out - raw_out) / max(np.linalg.norm(raw_out), 1e-30))
        rows.append(row)
    return rows


def _codec_breakdown(stats: dict[str, Any], n: int) -> dict[str, Any]:
    phases = stats.get("compressed_allreduce_phases", {})
    calls = max(1, int(phases.get("calls", 0)))
    out = {f"{k}_us": v / calls * 1e6 for k, v in phases.items() if k != "calls"}
    codecs = stats.get("codecs", {})
    if codecs:
        spec = next(iter(codecs))
        out["wire_bytes_per_elem"] = codecs[spec]["bytes_per_element"]
    return out


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.0f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render benchmark rows as a Markdown table (plain or compressed mode)."""
    if not rows:
        return "(no rows)"
    if rows[0].get("codec") is None:
        head = ["ranks", "size", "mpi4py µs", "commwire µs", "mpi4py GB/s", "commwire GB/s", "ratio (cw/raw)"]
        body = [[str(r["ranks"]), _human(r["bytes"]), f"{r['raw_us']:.1f}", f"{r['commwire_us']:.1f}",
                 f"{r['raw_GBps']:.3f}", f"{r['commwire_GBps']:.3f}", f"{r['ratio']:.2f}"] for r in rows]
    else:
        head = ["ranks", "size", "codec", "FP32 MPI ms", "compressed ms", "speedup", "encode ms", "transfer ms",
                "decode ms", "wire B/elem", "rel. L2 error", "segment KiB"]
        body = [[str(r["ranks"]), _human(r["bytes"]), r["codec"], f"{r['raw_us'] / 1e3:.2f}",
                 f"{r['commwire_us'] / 1e3:.2f}", f"{r['raw_us'] / r['commwire_us']:.2f}",
                 f"{r.get('encode_us', 0) / 1e3:.2f}", f"{r.get('transfer_us', 0) / 1e3:.2f}",
                 f"{r.get('decode_us', 0) / 1e3:.2f}", f"{r.get('wire_bytes_per_elem', 0):.4f}",
                 f"{r.get('rel_l2_err', 0):.4f}",
                 f"{r['segment_bytes'] / 1024:.0f}" if r.get("segment_bytes") else "-"] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench allreduce``."""
    parser = argparse.ArgumentParser(prog="commwire bench allreduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated message sizes (bytes, K, M)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved batches per size (median taken)")
    parser.add_argument("--budget", type=float, default=0.02, help="seconds per timed batch (approx.)")
    parser.add_argument("--codec", default=None,
                        help="compare compressed all-reduces with the FP32 one: a spec or a comma list "
                             "(e.g. fp8-e4m3,nvfp4)")
    parser.add_argument("--check", choices=sorted(CHECKS), default="first",
                        help="commwire's agreement mode: first (default), true (every call) or false (none)")
    parser.add_argument("--json", dest="json_path", help="also write the rows as JSON here")
    return parser


def check_sizes_and_codecs(sizes: str, codecs: str, example: str = "8,64K,1M", option: str = "--sizes") -> None:
    """Refuse a bad size list (of ``option``) or ``--codec`` spec list with a ValueError that names the option."""
    from ..codecs import registry

    for item in filter(None, (s.strip() for s in sizes.split(","))):
        try:
            parse_size(item)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}; give sizes of 4 bytes or more, e.g. {option} {example}") from None
    for spec in filter(None, (s.strip() for s in codecs.split(","))):
        try:
            registry.get(spec)
        except ValueError as exc:
            raise ValueError(f"--codec: {exc}") from None


def check_args(args: argparse.Namespace) -> None:
    """Refuse a bad ``--sizes`` or ``--codec`` with a ValueError that names the option, before any rank starts."""
    check_sizes_and_codecs(args.sizes, args.codec or "")


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the benchmark on the current MPI world, print rank 0's table."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        parser.error(str(exc))  # one line and exit 2 on every rank, not a traceback per rank
    codecs = [c.strip() for c in args.codec.split(",") if c.strip()] if args.codec else [None]
    rows = [row for codec in codecs
            for row in run_allreduce_bench(sizes, repeats=args.repeats, budget_s=args.budget, codec=codec,
                                           check=CHECKS[args.check])]
    import commwire as cw

    emit(format_table(rows), rows, args.json_path, rank=cw.rank())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
