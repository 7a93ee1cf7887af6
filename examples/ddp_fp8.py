"""Train with PyTorch DDP, sending gradients in FP8 with error feedback through commwire's hook.

Run: ``commwire run -np 4 python examples/ddp_fp8.py`` (add ``--codec nvfp4``,
``--codec none`` for plain FP32, or ``--lab`` before ``-np`` on an emulated cluster).

The script is an ordinary DDP script; the commwire parts are the two marked lines.
It trains the same small transformer twice, with DDP's built-in all-reduce and
with the hook, and prints the validation loss and the bytes each rank sent.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import commwire.torch as hvd
from commwire.bench.lm import Corpus, LMConfig, evaluate, make_lm


def train(codec: str | None, steps: int, corpus: Corpus) -> tuple[float, float, float]:
    model = make_lm(LMConfig(d_model=128, layers=2), seed=0)
    ddp = DDP(model)
    state = None
    if codec is not None:
        state, hook = hvd.ddp_hook(codec, model=model)  # commwire: the hook
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(hvd.rank())
    start = time.perf_counter()
    for _ in range(steps):
        x, y = corpus.batch("train", batch=8, context=64, generator=gen)
        opt.zero_grad()
        logits = ddp(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
    seconds = (time.perf_counter() - start) / steps
    sent = state.bytes_sent / steps if state is not None else sum(p.numel() * 4 for p in model.parameters())
    loss = float(hvd.allreduce(torch.tensor(evaluate(model, corpus, batches=4, batch=16))))
    return loss, sent, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", default="ef+fp8-e4m3", help="commwire codec spec (default ef+fp8-e4m3)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    args = parser.parse_args()
    hvd.init()
    hvd.init_process_group("gloo")  # commwire: torch.distributed from the MPI job, nothing to export
    corpus = Corpus.load()
    base = train(None, args.steps, corpus)
    ours = train(args.codec, args.steps, corpus)
    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {args.steps} steps")
        print(f"DDP built-in all-reduce : validation loss {base[0]:.4f}, {base[1] / 1e6:.2f} MB/step, "
              f"{base[2] * 1e3:.0f} ms/step")
        print(f"DDP + commwire {args.codec:<9}: validation loss {ours[0]:.4f}, {ours[1] / 1e6:.2f} MB/step "
              f"({ours[1] / base[1]:.3f}x), {ours[2] * 1e3:.0f} ms/step")


if __name__ == "__main__":
    main()
