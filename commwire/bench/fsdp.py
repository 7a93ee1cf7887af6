"""Benchmark FSDP2's own collectives against commwire's compressed ones, side by side in one job.

Every configuration trains the same small transformer (commwire.bench.lm),
each block and the root sharded with ``fully_shard`` over gloo, on the same
batches for the same steps; only the collectives differ:

- ``fsdp``: FSDP2's defaults (FP32 reduce-scatter and all-gather);
- ``fsdp bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``: bf16
  parameters (all-gathered in bf16) and gradients reduced in bf16 — FSDP2's own
  way to halve both collectives;
- ``commwire rs=<codec>``: ``commwire.torch.fsdp.compress`` with that codec on the gradient
  reduce-scatter and FSDP's own FP32 all-gather; ``... ag=fp8-e4m3`` with commwire's FP8
  parameter all-gather as well; ``commwire bf16 ...``: the same on top of FSDP2's bf16 policy
  (bf16 compute; the codecs encode the bf16 parameters and gradients);
- with ``--hsdp`` on 4 ranks (2 replicas x 2 shards): ``hsdp`` (FSDP2's native HSDP on a 2-D
  mesh) and ``hsdp replicate=<codec>`` (each replica sharded over its shard group; the
  all-reduce across replicas through commwire with that codec; ``rs=``/``ag=`` compress the
  reduce-scatter and all-gather inside each shard group as well).

Steps are timed in interleaved rounds (each round runs every configuration);
the slowest rank's median counts. Bytes per step are what one rank sends of its
own data, measured where it is sent: commwire's counters for its collectives
(the encoded blocks a reduce-scatter sends its peers; the encoded shard an
all-gather hands out; the encoded tensor of an all-reduce); for FSDP's own
collectives, wrappers that see the tensors torch moves: (P-1)/P of the
reduce-scatter input, the all-gather's own shard, the all-reduced tensor. The
loss is the validation loss after the run; the JSON rows also hold it after
every round (``val_curve``; one per seed in ``val_curves``).

Run: ``commwire bench fsdp -np 4`` or ``commwire run --lab -np 4 python -m commwire.bench.fsdp``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from ._report import emit
from .ddp import over_seeds

__all__ = ["NAME", "HELP", "DRIVER", "build_parser", "run_fsdp_bench", "format_table", "main", "CONFIGS",
           "HSDP_CONFIGS"]

NAME = "fsdp"
HELP = "FSDP2's reduce-scatter / all-gather (FP32, bf16) vs commwire's FP8 / NVFP4 codecs; --seeds, --hsdp"
DRIVER = False

_RS = ("fp8-e4m3", "ef+fp8-e4m3", "nvfp4", "ef+nvfp4")
CONFIGS = ("fsdp", "fsdp bf16", *(f"commwire rs={c}" for c in _RS), *(f"commwire rs={c} ag=fp8-e4m3" for c in _RS),
           "commwire bf16 rs=ef+fp8-e4m3 ag=fp8-e4m3", "commwire bf16 rs=ef+nvfp4 ag=fp8-e4m3")
HSDP_CONFIGS = ("hsdp", "hsdp replicate=ef+fp8-e4m3", "hsdp replicate=ef+nvfp4",
                "hsdp rs=ef+fp8-e4m3 ag=fp8-e4m3 replicate=ef+fp8-e4m3")
_COMMWIRE_OPS = {"rs": "compressed_reduce_scatter", "ag": "compressed_allgather", "ar": "compressed_allreduce"}


class _Counted:
    """Bytes of FSDP's own collectives, per rank: counting wrappers around torch's default comms and all_reduce."""

    def __init__(self, size: int) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        self.bytes = {"rs": 0, "ag": 0, "ar": 0}
        counter = self

        class ReduceScatter(DefaultReduceScatter):  # torch's own reduce-scatter, counted
            def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                         async_op: bool = False) -> Any:
                p = group.size()
                counter.bytes["rs"] += input_tensor.numel() * input_tensor.element_size() * (p - 1) // p
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        class AllGather(DefaultAllGather):  # torch's own all-gather, counted
            def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, async_op: bool = False) -> Any:
                counter.bytes["ag"] += input_tensor.numel() * input_tensor.element_size()
                return super().__call__(output_tensor, input_tensor, group, async_op)

        self.reduce_scatter, self.all_gather = ReduceScatter, AllGather
        self.dist, self.original = dist, dist.all_reduce

    def install(self, module: Any, reduce_scatter: bool, all_gather: bool) -> None:
        if reduce_scatter:
            module.set_custom_reduce_scatter(self.reduce_scatter())
        if all_gather:
            module.set_custom_all_gather(self.all_gather())

    def __enter__(self) -> _Counted:  # HSDP's native all-reduce calls torch.distributed.all_reduce
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.bytes["ar"] += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)

        self.dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        self.dist.all_reduce = self.original


def _parse(label: str) -> dict[str, Any]:
    """Return what ``label`` configures: hsdp, bf16, and a codec per commwire role; ValueError if malformed.

    A label is ``fsdp``, ``hsdp`` or ``commwire``, then optionally ``bf16``, then ``rs=<codec>``,
    ``ag=<codec>`` and (``hsdp``) ``replicate=<codec>``, any codec spec that the role accepts.
    """
    from ..torch.fsdp import FSDPCompression

    words = label.split()
    kind = words[0] if words else ""
    roles: dict[str, str] = {}
    allowed = {"fsdp": (), "hsdp": ("rs", "ag", "replicate"), "commwire": ("rs", "ag")}.get(kind)
    for word in words[1:] if allowed is not None else [""]:
        role, _, spec = word.partition("=")
        if word == "bf16":
            continue
        if allowed is None or role not in allowed or not spec or role in roles:
            raise ValueError(
                f"configuration {label!r}: expected 'fsdp [bf16]', 'commwire [bf16] rs=<codec> ag=<codec>' (either "
                "role may be left out) or 'hsdp [bf16] [rs=<codec>] [ag=<codec>] [replicate=<codec>]', e.g. "
                f"'commwire rs=ef+hadamard+nvfp4 ag=fp8-e4m3'; the known ones: {', '.join(CONFIGS + HSDP_CONFIGS)}")
        roles[role] = spec
    if kind == "commwire" and not roles:
        raise ValueError(f"configuration {label!r} names no codec: add rs=<codec> and/or ag=<codec>")
    try:  # the checks compress() makes, on fresh codecs (the shared per-spec cache stays untouched)
        FSDPCompression({"reduce_scatter": roles.get("rs"), "all_gather": roles.get("ag"),
                         "replicate": roles.get("replicate")}, "torch", None)
    except ValueError as exc:
        raise ValueError(f"configuration {label!r}: {exc}") from None
    return {"hsdp": kind == "hsdp", "bf16": "bf16" in words, "rs": roles.get("rs"), "ag": roles.get("ag"),
            "replicate": roles.get("replicate")}


def run_fsdp_bench(*, configs: tuple[str, ...] = CONFIGS, d_model: int = 256, layers: int = 4, batch: int = 8,
                   context: int = 64, steps: int = 8, rounds: int = 3, lr: float = 3e-3, threads: int = 1,
                   seed: int = 0, batches: int = 8) -> list[dict[str, Any]]:
    """Train every configuration for ``rounds`` x ``steps`` timed steps; return one row per configuration.

    The steps cycle through ``batches`` distinct training batches per rank (more: a convergence run
    rather than a timing run).
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import commwire
    import commwire.torch as hvd
    from commwire.torch import fsdp as cw_fsdp

    from .lm import Corpus, LMConfig, evaluate, make_lm

    torch.set_num_threads(threads)
    hvd.init()
    if not torch.distributed.is_initialized():  # a second run (another seed) reuses the group
        hvd.init_process_group("gloo")
    from ..comm.runtime import world

    comm = world()
    how_of = {label: _parse(label) for label in configs}
    hsdp = any(how["hsdp"] for how in how_of.values())
    if hsdp and comm.size != 4:
        raise ValueError(f"the HSDP configurations need 4 ranks (2 replicas x 2 shards), this job has {comm.size}; "
                         "run with -np 4 or leave out --hsdp")
    corpus = Corpus.load()
    cfg = LMConfig(d_model=d_model, layers=layers, context=context, heads=4)
    gen = torch.Generator().manual_seed(1000 * seed + comm.rank)
    data = [corpus.batch("train", batch=batch, context=context, generator=gen) for _ in range(batches)]
    counted = _Counted(comm.size)
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    runners: list[tuple[str, Callable[[int], None], Any]] = []
    for label, how in how_of.items():
        model = make_lm(cfg, seed=seed)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if how["bf16"] \
            else MixedPrecisionPolicy()
        mesh = None
        if how["hsdp"]:
            assert mesh2d is not None
            mesh = mesh2d["shard"] if how["replicate"] else mesh2d
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        for module in [*model.blocks, model]:
            counted.install(module, reduce_scatter=how["rs"] is None, all_gather=how["ag"] is None)
        if how["rs"] or how["ag"] or how["replicate"]:
            cw_fsdp.compress(model, reduce_scatter=how["rs"], all_gather=how["ag"], replicate=how["replicate"],
                             replicate_group=mesh2d["replicate"] if how["replicate"] else None)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        def step(i: int, model: Any = model, opt: Any = opt) -> None:
            x, y = data[i % len(data)]
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        runners.append((label, step, model))
    for _, step, _ in runners:  # warm-up: numba's first compiles, gloo's first connections
        for i in range(3):
            step(i)
    times: dict[str, list[float]] = {r[0]: [] for r in runners}
    sent = {r[0]: np.zeros(3) for r in runners}  # rs, ag, ar bytes
    curves: dict[str, list[float]] = {r[0]: [] for r in runners}
    for r in range(rounds):
        for label, step, _ in runners:
            comm.barrier()
            before_torch = dict(counted.bytes)
            before = commwire.stats()
            with counted:
                for i in range(steps):
                    t0 = time.perf_counter()
                    step(r * steps + i)
                    times[label].append(time.perf_counter() - t0)
            after = commwire.stats()
            for k, role in enumerate(("rs", "ag", "ar")):
                op = _COMMWIRE_OPS[role]
                ours = after.get(op, {}).get("bytes", 0) - before.get(op, {}).get("bytes", 0)
                sent[label][k] += counted.bytes[role] - before_torch[role] + ours
        for label, _, model in runners:  # the validation loss after every round, outside the timing
            curves[label].append(float(comm.allreduce(np.array([evaluate(model, corpus, batches=4, batch=16)]),
                                                      "avg")[0]))
    medians = comm.allgather_object({label: float(np.median(t)) for label, t in times.items()})
    params = sum(p.numel() for p in runners[0][2].parameters())
    first = runners[0][0]
    base = max(m[first] for m in medians)
    per_step = {label: comm.allreduce(sent[label], "max") / (rounds * steps) for label in sent}  # the largest rank
    rows = []
    for label, _, model in runners:
        median = max(m[label] for m in medians)
        mine, ref = per_step[label], per_step[first]
        rows.append({"config": label, "ranks": comm.size, "params": params, "step_ms": median * 1e3,
                     "ratio_vs_fsdp": median / base, "MB_per_step": float(mine.sum()) / 1e6,
                     "rs_MB": float(mine[0]) / 1e6, "ag_MB": float(mine[1]) / 1e6, "ar_MB": float(mine[2]) / 1e6,
                     "rs_vs_first": float(mine[0] / ref[0]) if ref[0] else float("nan"),
                     "bytes_vs_fp32": float(mine.sum() / ref.sum()), "val_loss": curves[label][-1],
                     "val_curve": curves[label]})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Render the rows as a Markdown table (loss as mean ± sd and range over seeds, when there are several)."""
    first = rows[0]
    seeds = first.get("seeds", 1)
    lines = [f"{first['ranks']} ranks, {first['params'] / 1e6:.2f} M parameters; bytes sent per rank and step; "
             f"ratios to `{first['config']}`" + (f"; {seeds} seeds (step times: median over seeds)" if seeds > 1
                                                 else ""), "",
             "| configuration | step ms | vs first | MB/step (RS + AG + AR) | RS bytes vs first | "
             "bytes vs first | validation loss |"
             + (" seeds' range | mean ≤ first's worst seed |" if seeds > 1 else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if seeds > 1 else "")]
    for r in rows:
        parts = " + ".join(f"{r[k]:.2f}" for k in ("rs_MB", "ag_MB", "ar_MB") if r[k] or k != "ar_MB")
        line = (f"| {r['config']} | {r['step_ms']:.1f} | {r['ratio_vs_fsdp']:.2f}× | {r['MB_per_step']:.2f} "
                f"({parts}) | {r['rs_vs_first']:.3f} | {r['bytes_vs_fp32']:.3f} | {r['val_loss']:.4f}")
        if seeds > 1:
            lo, hi = r["val_loss_range"]
            within = {True: "yes", False: "no"}.get(r.get("within_fsdp_range"), "-")
            line += f" ± {r['val_loss_sd']:.4f} | {lo:.4f}–{hi:.4f} | {within}"
        lines.append(line + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``commwire bench fsdp``."""
    parser = argparse.ArgumentParser(prog="commwire bench fsdp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated; 'fsdp [bf16]', 'commwire [bf16] rs=<codec> ag=<codec>' (any codec spec, "
                        "either role optional) or 'hsdp [rs=<codec>] [ag=<codec>] [replicate=<codec>]'; default: "
                        + ", ".join(CONFIGS))
    parser.add_argument("--hsdp", action="store_true",
                        help="run the HSDP configurations instead (4 ranks: 2 replicas x 2 shards)")
    parser.add_argument("--d-model", type=int, default=256, help="transformer width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default 8)")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--batches", type=int, default=8,
                        help="distinct training batches per rank, cycled (default 8; raise it for a convergence run)")
    parser.add_argument("--seeds", type=int, default=3, help="run everything with seeds 0..N-1 (default 3)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the benchmark, print the table on rank 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configs = HSDP_CONFIGS if args.hsdp else tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if not configs:
        parser.error(f"--configs {args.configs!r} names no configuration; e.g. {', '.join(CONFIGS[:3])}")
    for label in configs:
        try:
            _parse(label)
        except ValueError as exc:
            parser.error(f"--configs: {exc}")
    if min(args.d_model, args.layers, args.batch, args.context, args.steps, args.rounds, args.seeds,
           args.batches) < 1 or args.d_model % 4:
        parser.error("--d-model (a multiple of 4), --layers, --batch, --context, --steps, --rounds, --batches and "
                     "--seeds must be >= 1")
    rows = over_seeds([run_fsdp_bench(configs=configs, d_model=args.d_model, layers=args.layers, batch=args.batch,
                                      context=args.context, steps=args.steps, rounds=args.rounds, seed=seed,
                                      batches=args.batches)
                       for seed in range(args.seeds)], reference=configs[0], key="fsdp")
    from ..comm.runtime import world

    emit(format_table(rows), rows, args.json, rank=world().rank)


if __name__ == "__main__":
    main()
