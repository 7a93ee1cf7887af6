"""Benchmark the codecs: throughput against memcpy, and round-trip error.

For each codec and size: encode and decode throughput in GB/s of float32 input
through the low-level path (``encode_into`` / ``decode_from`` into preallocated
buffers, the path the compressed collectives use), the memcpy bandwidth
(``np.copyto`` of the same float32 array) measured in the same loop, and the
ratios. Times are the best of ``repeats`` after one warm-up call (which also
compiles the numba kernels); memcpy, encode and decode calls alternate so that
all three see the same machine load. Errors: relative L2 ``||decode(encode(x)) - x|| / ||x||``
on standard Gaussian data and, when torch is installed, on the concatenated
gradients of a small MLP (one backward pass on random data, fixed seed).

Run ``python -m commwire.bench.codecs --sizes 64`` (sizes in MB of float32).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from commwire import codecs as _codecs

__all__ = ["NAME", "HELP", "DRIVER", "DEFAULT_CODECS", "run_codec_bench", "format_table", "build_parser", "main"]

NAME = "codecs"
HELP = "codec encode/decode throughput vs memcpy, round-trip error"
DRIVER = False

DEFAULT_CODECS = ("none", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=128", "nvfp4", "hadamard+nvfp4")


def _best_interleaved(fns, repeats: int) -> list[float]:
    """Return the best time of each function, calling them in turn ``repeats`` times."""
    for fn in fns:
        fn()  # warm-up: numba compile, page faults
    best = [float("inf")] * len(fns)
    # Interleaving keeps memcpy and codec timings under the same machine load
    # (other processes may share the cores), so their ratio stays meaningful.
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _rel_l2(codec: _codecs.Codec, x: np.ndarray) -> float:
    y = codec.decode_from(_encoded(codec, x), x.size)
    return float(np.linalg.norm((y - x).astype(np.float64)) / np.linalg.norm(x.astype(np.float64)))


def _encoded(codec: _codecs.Codec, x: np.ndarray) -> np.ndarray:
    buf = np.empty(codec.wire_nbytes(x.size), np.uint8)
    codec.encode_into(x, buf, key="bench")
    return buf


def model_gradients(seed: int = 0) -> np.ndarray | None:
    """Return the flattened float32 gradients of a small MLP after one backward pass (None without torch)."""
    try:
        import torch
    except ImportError:
        return None
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    x = torch.randn(64, 256, generator=gen)
    y = torch.randint(0, 10, (64,), generator=gen)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().astype(np.float32)


def run_codec_bench(
    sizes: Sequence[float] = (64,), codecs: Sequence[str] = DEFAULT_CODECS, repeats: int = 5, seed: int = 0
) -> list[dict]:
    """Measure every codec at every size (MB of float32); return one dict per (codec, size)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = np.random.default_rng(seed)
    grads = model_gradients(seed)
    rows = []
    for size_mb in sizes:
        n = int(size_mb * 2**20) // 4
        if n < 1:
            raise ValueError(f"size {size_mb} MB holds no float32 element; use sizes >= 4e-6")
        x = rng.standard_normal(n).astype(np.float32)
        dst = np.empty_like(x)
        for spec in codecs:
            codec = _codecs.get(spec)
            buf = np.empty(codec.wire_nbytes(n), np.uint8)
            out = np.empty(n, np.float32)
            t_copy, t_enc, t_dec = _best_interleaved([
                lambda: np.copyto(dst, x),
                lambda: codec.encode_into(x, buf, key="bench"),
                lambda: codec.decode_from(buf, n, out),
            ], repeats)
            memcpy_now = 4 * n / t_copy / 1e9
            enc, dec = 4 * n / t_enc / 1e9, 4 * n / t_dec / 1e9
            rows.append({
                "codec": codec.spec, "size_mb": size_mb, "n": n,
                "bytes_per_elem": codec.wire_nbytes(n) / n,
                "encode_gbps": enc, "decode_gbps": dec, "memcpy_gbps": memcpy_now,
                "encode_ratio": enc / memcpy_now, "decode_ratio": dec / memcpy_now,
                "rel_l2_gauss": float(np.linalg.norm(out - x) / np.linalg.norm(x)),
                "rel_l2_grads": _rel_l2(_codecs.get(spec), grads) if grads is not None else float("nan"),
                "threads": _codecs.get_threads(),
            })
    return rows


def format_table(rows: list[dict]) -> str:
    """Return the benchmark rows as an aligned text table."""
    header = ("codec", "MB", "B/elem", "enc GB/s", "dec GB/s", "memcpy", "enc/mc", "dec/mc", "relL2 gauss",
              "relL2 grads")
    lines = [header]
    for r in rows:
        lines.append((
            r["codec"], f"{r['size_mb']:g}", f"{r['bytes_per_elem']:.4f}", f"{r['encode_gbps']:.2f}",
            f"{r['decode_gbps']:.2f}", f"{r['memcpy_gbps']:.2f}", f"{r['encode_ratio']:.2f}",
            f"{r['decode_ratio']:.2f}", f"{r['rel_l2_gauss']:.4f}", f"{r['rel_l2_grads']:.4f}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench codecs``."""
    parser = argparse.ArgumentParser(prog="commwire bench codecs", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[64.0], help="array sizes in MB of float32")
    parser.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS), help="codec specs")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (best is kept)")
    parser.add_argument("--threads", type=int, default=None, help="CPU kernel threads (default: cores / local ranks)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, run the benchmark and print the table."""
    args = build_parser().parse_args(argv)
    _codecs.set_threads(args.threads)
    print(format_table(run_codec_bench(sizes=args.sizes, codecs=args.codecs, repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
