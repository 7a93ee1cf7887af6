"""Benchmark DDP's communication hooks against commwire's, side by side in one job.

Every configuration trains the same small transformer (commwire.bench.lm) on
the same batches for the same steps, with torch DistributedDataParallel over
gloo; only the communication hook differs:

- ``ddp``: DDP's built-in all-reduce (FP32);
- ``ddp bf16``: DDP's own ``bf16_compress_hook`` (its implementation, called under another name:
  DDP refuses that name without NCCL, though gloo reduces bfloat16 on the CPU);
- ``ddp powersgd r1`` / ``r4``: DDP's PowerSGD hook at its default rank (1) and
  at rank 4 (low-rank after 2 warm-up steps, with its error feedback; buckets
  chained, see ``_ordered_powersgd``: over gloo the unchained hook can hang);
- ``commwire <codec>``: ``commwire.torch.ddp_hook(codec)`` (none, bf16, FP8,
  NVFP4, MX, INT8/INT4, sign, error feedback);
- ``no communication``: the same steps under ``ddp.no_sync()`` — each rank
  trains alone, nothing is sent. Not a method: the floor any hook's step time
  sits on (forward, backward, optimizer), so the table shows how much of a
  step is left for communication to save.

Steps are timed in interleaved rounds (each round runs every configuration),
the slowest rank's median counts. Bytes per step are measured where they are
sent: commwire's hook counts its own wire bytes; torch's hooks are counted by
wrapping ``torch.distributed.all_reduce``, which they call; the built-in path,
which does not go through Python, sends every gradient in FP32. The loss is the
validation loss after the run.

Run: ``commwire bench ddp -np 4`` or ``commwire run --lab -np 4 python -m commwire.bench.ddp``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ._report import emit

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "run_ddp_bench", "over_seeds", "format_table", "main", "CONFIGS"]

NAME = "ddp"
HELP = "DDP communication hooks: DDP's own (bf16, PowerSGD) vs commwire's codecs; --seeds"
DRIVER = False

DEFAULT_CONFIGS = ("ddp", "ddp bf16", "ddp powersgd r1", "ddp powersgd r4", "commwire none", "commwire bf16",
                   "commwire fp8-e4m3", "commwire ef+fp8-e4m3", "commwire nvfp4", "commwire ef+nvfp4",
                   "no communication")
CONFIGS = DEFAULT_CONFIGS + ("commwire mxfp8-e4m3", "commwire mxfp4", "commwire ef+mxfp4", "commwire int8",
                             "commwire int4", "commwire ef+int4", "commwire ef+sign")
"""Every configuration ``--configs`` accepts; the MX, integer and sign ones run only when named."""
OPTIMIZERS = ("adamw", "adamw-fused")


class _CountingAllreduce:
    """Wrap torch.distributed.all_reduce to count the bytes torch's hooks hand it."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist, self.original, self.bytes = dist, dist.all_reduce, 0

    def __enter__(self) -> _CountingAllreduce:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        self.dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        self.dist.all_reduce = self.original


def _torch_bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def] # annotated below
    """DDP's own bf16_compress_hook: the same torch implementation, under another name.

    DDP refuses a hook *named* bf16_compress_hook unless torch has CUDA and NCCL,
    although gloo reduces bfloat16 on the CPU; calling the function it wraps
    (default_hooks._compress_hook with torch.bfloat16) runs the identical code.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _ordered_powersgd() -> Any:
    """Return DDP's PowerSGD hook (torch's implementation) with each bucket started after the previous one is done.

    PowerSGD issues a bucket's second and third all-reduces (Ps, then Qs) from the
    callback of the one before, on gloo's callback threads. With two buckets in flight
    those calls race, ranks can issue them in different orders, gloo pairs mismatched
    collectives and every rank waits forever: on 4 ranks and the 7.2 M-parameter model
    (two buckets) every run hung at the first compressed step, stacks in compute_qs and
    in unpack_uncompressed_tensors_and_allreduce_ps. Chaining the buckets gives every
    rank one order, as a single communication stream (NCCL's) would.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    chain: dict[str, Any] = {"last": None}

    def ordered_powersgd(state, bucket):  # type: ignore[no-untyped-def] # annotated below, for DDP's check
        prev, out = chain["last"], torch.futures.Future()

        def start(_: Any) -> None:
            try:
                inner = powerSGD_hook.powerSGD_hook(state, bucket)
            except Exception as exc:  # noqa: BLE001 - reaches DDP through the future, not a thread's log
                out.set_exception(exc)
                return

            def done(f: Any) -> None:
                try:
                    out.set_result(f.value())
                except Exception as exc:  # noqa: BLE001
                    out.set_exception(exc)

            inner.add_done_callback(done)

        if prev is None:
            start(None)
        else:
            prev.add_done_callback(start)  # runs at once when the previous bucket is already done
        chain["last"] = out
        return out

    ordered_powersgd.__annotations__ = {"state": Any, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}
    return ordered_powersgd


def _annotate_bf16() -> None:
    import torch
    import torch.distributed as dist

    _torch_bf16_hook.__annotations__ = {"process_group": Any, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}


def _register(label: str, ddp: Any, model: Any) -> Any:
    """Register the hook of ``label`` on ``ddp``; return commwire's hook state (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    import commwire.torch as hvd

    _annotate_bf16()
    if label in ("ddp", "no communication"):
        return None
    if label == "ddp bf16":
        ddp.register_comm_hook(None, _torch_bf16_hook)
        return None
    if label.startswith("ddp powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(label[-1]),
                                            start_powerSGD_iter=2, min_compression_rate=0.5)
        ddp.register_comm_hook(state, _ordered_powersgd())
        return None
    state, hook = hvd.ddp_hook(label.split(" ", 1)[1], model=model)
    ddp.register_comm_hook(state, hook)
    return state


def run_ddp_bench(*, configs: tuple[str, ...] = DEFAULT_CONFIGS, d_model: int = 192, layers: int = 3, batch: int = 8,
                  context: int = 64, steps: int = 10, rounds: int = 3, lr: float = 3e-3, threads: int = 1,
                  seed: int = 0, bucket_mb: float = 25.0, optimizer: str = "adamw") -> list[dict[str, Any]]:
    """Train every configuration for ``rounds`` x ``steps`` timed steps; return one row per configuration.

    ``optimizer``: "adamw" (torch's default AdamW: on the CPU a loop over the
    parameters) or "adamw-fused" (``AdamW(fused=True)``, torch's fused kernel:
    the same update, a shorter compute floor under every hook).
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import commwire.torch as hvd

    from ..codecs.collective import TUNE_CALLS
    from .lm import Corpus, LMConfig, evaluate, make_lm

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if optimizer == "adamw-fused" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):
        raise RuntimeError(f"optimizer 'adamw-fused' needs torch >= 2.4 (fused AdamW on the CPU), this is torch "
                           f"{torch.__version__}: upgrade torch or use 'adamw'")
    torch.set_num_threads(threads)
    hvd.init()
    if not torch.distributed.is_initialized():  # a second run (another seed) reuses the group
        hvd.init_process_group("gloo")
    from ..comm.runtime import world

    comm = world()
    corpus = Corpus.load()
    cfg = LMConfig(d_model=d_model, layers=layers, context=context, heads=4)
    gen = torch.Generator().manual_seed(1000 * seed + comm.rank)
    data = [corpus.batch("train", batch=batch, context=context, generator=gen) for _ in range(8)]
    runners: list[tuple[str, Callable[[int], None], Any, Any, dict[str, int]]] = []
    for label in configs:
        model = make_lm(cfg, seed=seed)
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        state = _register(label, ddp, model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=lr, **({"fused": True} if optimizer == "adamw-fused" else {}))
        counted = {"bytes": 0}

        def step(i: int, ddp: Any = ddp, opt: Any = opt, counted: dict[str, int] = counted,
                 torch_hook: bool = label.startswith("ddp "), alone: bool = label == "no communication") -> None:
            x, y = data[i % len(data)]
            opt.zero_grad(set_to_none=True)
            if alone:
                with ddp.no_sync():
                    logits = ddp(x)
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                    loss.backward()
                opt.step()
                return
            logits = ddp(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            if torch_hook:
                with _CountingAllreduce() as c:
                    loss.backward()
                counted["bytes"] += c.bytes
            else:
                loss.backward()
            opt.step()

        runners.append((label, step, state, model, counted))
    # Warm-up: DDP's bucket rebuild, PowerSGD's start, commwire's segment tuner. Every configuration
    # takes the same number of steps, so the losses compare like with like.
    for label, step, *_ in runners:
        for i in range(3 + TUNE_CALLS):
            step(i)
    times: dict[str, list[float]] = {r[0]: [] for r in runners}
    sent: dict[str, int] = {r[0]: 0 for r in runners}
    for r in range(rounds):
        for label, step, state, _, counted in runners:
            comm.barrier()
            before = state.bytes_sent if state is not None else counted["bytes"]
            for i in range(steps):
                t0 = time.perf_counter()
                step(r * steps + i)
                times[label].append(time.perf_counter() - t0)
            sent[label] += (state.bytes_sent if state is not None else counted["bytes"]) - before
    medians = comm.allgather_object({label: float(np.median(t)) for label, t in times.items()})
    fp32_bytes = sum(p.numel() * p.element_size() for p in runners[0][3].parameters())
    base = max(m[runners[0][0]] for m in medians)
    rows = []
    for label, _, state, model, _ in runners:
        median = max(m[label] for m in medians)
        per_step = fp32_bytes if label == "ddp" else 0 if label == "no communication" else \
            sent[label] / (rounds * steps)
        loss = comm.allreduce(np.array([evaluate(model, corpus, batches=4, batch=16)]), "avg")[0]
        rows.append({"config": label, "ranks": comm.size, "params": sum(p.numel() for p in model.parameters()),
                     "optimizer": optimizer,
                     "step_ms": median * 1e3, "ratio_vs_ddp": median / base, "MB_per_step": per_step / 1e6,
                     "bytes_vs_fp32": per_step / fp32_bytes, "val_loss": float(loss)})
    return rows


def over_seeds(runs: list[list[dict[str, Any]]], reference: str = "ddp", key: str = "ddp") -> list[dict[str, Any]]:
    """Combine one row list per seed: median step time, loss mean / sd / range, not above ``reference``'s worst seed.

    ``reference`` is the baseline's config name; rows carry ``ratio_vs_<key>`` and each combined row
    gains ``within_<key>_range``.
    """
    ratio = f"ratio_vs_{key}"
    rows = []
    for per_seed in zip(*runs):
        losses = np.array([r["val_loss"] for r in per_seed])
        row = {**per_seed[0], "step_ms": float(np.median([r["step_ms"] for r in per_seed])),
               ratio: float(np.median([r[ratio] for r in per_seed])),
               "MB_per_step": float(np.mean([r["MB_per_step"] for r in per_seed])),
               "bytes_vs_fp32": float(np.mean([r["bytes_vs_fp32"] for r in per_seed])),
               **{k: float(np.mean([r[k] for r in per_seed])) for k in ("rs_MB", "ag_MB", "ar_MB", "rs_vs_first")
                  if k in per_seed[0]},
               "val_loss": float(losses.mean()), "val_loss_sd": float(losses.std(ddof=1)) if len(losses) > 1 else 0.0,
               "val_loss_range": (float(losses.min()), float(losses.max())), "seeds": len(losses)}
        if "val_curve" in row:
            row["val_curves"] = [r["val_curve"] for r in per_seed]
            del row["val_curve"]
        rows.append(row)
    ref = next((r for r in rows if r["config"] == reference), None)
    for r in rows:
        if ref is not None and r["seeds"] > 1:
            r[f"within_{key}_range"] = bool(r["val_loss"] <= ref["val_loss_range"][1])
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table (loss as mean ± sd over seeds, when there are several)."""
    first = rows[0]
    seeds = first.get("seeds", 1)
    lines = [f"{first['ranks']} ranks, {first['params'] / 1e6:.2f} M parameters, {first.get('optimizer', 'adamw')}; "
             "bytes measured per rank and step"
             + (f"; {seeds} seeds (step times: median over seeds)" if seeds > 1 else ""), "",
             "| hook | step ms | vs DDP | MB/step | bytes vs FP32 | validation loss |"
             + (" seeds' range | mean ≤ DDP's worst seed |" if seeds > 1 else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if seeds > 1 else "")]
    for r in rows:
        line = (f"| {r['config']} | {r['step_ms']:.1f} | {r['ratio_vs_ddp']:.2f}× | {r['MB_per_step']:.2f} | "
                f"{r['bytes_vs_fp32']:.3f} | {r['val_loss']:.4f}")
        if seeds > 1:
            lo, hi = r["val_loss_range"]
            within = {True: "yes", False: "no"}.get(r.get("within_ddp_range"), "-")
            line += f" ± {r['val_loss_sd']:.4f} | {lo:.4f}–{hi:.4f} | {within}"
        lines.append(line + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench ddp``."""
    parser = argparse.ArgumentParser(prog="commwire bench ddp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from: {', '.join(CONFIGS)} (default: all but the MX, integer and sign ones)")
    parser.add_argument("--d-model", type=int, default=192, help="transformer width (default 192)")
    parser.add_argument("--layers", type=int, default=3, help="transformer blocks (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default 8)")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--seeds", type=int, default=1, help="run everything with seeds 0..N-1 (default 1)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb for every configuration (default 25, DDP's own): smaller "
                             "buckets start communicating earlier in backward")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="every configuration's optimizer: torch's default AdamW (on the CPU a loop over the "
                             "parameters) or AdamW(fused=True), the same update in one kernel (default adamw)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the benchmark, print the table on rank 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        parser.error(f"--configs {bad or args.configs!r}: choose from {', '.join(CONFIGS)}")
    if args.bucket_mb <= 0:
        parser.error(f"--bucket-mb {args.bucket_mb:g}: give DDP's bucket size in MB, > 0 (DDP's default: 25)")
    if min(args.d_model, args.layers, args.batch, args.context, args.steps, args.rounds, args.seeds) < 1 \
            or args.d_model % 4:
        parser.error("--d-model (a multiple of 4), --layers, --batch, --context, --steps, --rounds and --seeds "
                     "must be >= 1")
    rows = over_seeds([run_ddp_bench(configs=configs, d_model=args.d_model, layers=args.layers, batch=args.batch,
                                     context=args.context, steps=args.steps, rounds=args.rounds, seed=seed,
                                     bucket_mb=args.bucket_mb, optimizer=args.optimizer)
                       for seed in range(args.seeds)])
    from ..comm.runtime import world

    emit(format_table(rows), rows, args.json, rank=world().rank)


if __name__ == "__main__":
    main()
