"""Horovod-style data-parallel training with commwire: switch by changing one import.

Trains a small GPT (byte-level, several transformer blocks) on the Python
documentation text that ships with CPython, so it runs offline:

    commwire run -np 4 python examples/train_horovod.py --steps 200 --compression fp8-e4m3

Every rank samples its own batches; DistributedOptimizer averages gradients
during backward. Rank 0 prints loss, step time and bytes sent per step.
"""

from __future__ import annotations

import argparse
import time

import torch

import commwire
import commwire.torch as hvd  # was: import horovod.torch as hvd
from commwire.bench.lm import Corpus, LMConfig, evaluate, make_lm


def main() -> None:
    """Parse arguments and train."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="per-rank learning rate (scaled by the rank count)")
    p.add_argument("--compression", default="none", help="none, bf16, fp8-e4m3, ef+fp8-e4m3, nvfp4, ...")
    p.add_argument("--fusion-mb", type=float, default=25.0)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # ranks share the machine's cores
    corpus = Corpus.load()
    model = make_lm(LMConfig(d_model=args.d_model, layers=args.layers, context=args.context))
    # Horovod recipe: scale the learning rate by the number of workers.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=args.compression, fusion_threshold_mb=args.fusion_mb)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    n_tensors = sum(1 for _ in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {n_tensors} parameter tensors, {n_params / 1e6:.2f} M parameters, "
              f"compression={args.compression}, {len(optimizer._fusion.buckets)} fusion buckets", flush=True)
    commwire.stats(reset=True)
    window: list[float] = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x, y = corpus.batch("train", batch=args.batch, context=args.context, generator=gen)
        optimizer.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        optimizer.step()
        window.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps:
            avg_loss = hvd.allreduce(loss.detach(), name="loss").item()
            snap = commwire.stats(reset=True)
            sent = sum(snap.get(k, {}).get("bytes", 0) for k in ("allreduce", "compressed_allreduce"))
            if hvd.rank() == 0:
                print(f"step {step:5d}  loss {avg_loss:.4f}  step {1e3 * sum(window) / len(window):7.1f} ms  "
                      f"sent {sent / len(window) / 1e6:7.3f} MB/step", flush=True)
            window = []
    val = evaluate(model, corpus)
    if hvd.rank() == 0:
        print(f"validation loss {val:.4f} nats/byte; overlap {optimizer.overlap_stats()}", flush=True)


if __name__ == "__main__":
    main()
