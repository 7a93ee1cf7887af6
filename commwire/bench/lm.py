"""A small decoder-only transformer language model on a text corpus shipped with Python.

Used by the benchmarks and examples that need real gradients of a real model
without downloads: the corpus is the English reference text of the Python
documentation that every CPython ships (``pydoc_data.topics``, ~465 kB),
tokenised as bytes (vocabulary 256). Documents are split into a training and a
validation part by a fixed rule, so every rank and every run sees the same
split.

Example:
    >>> corpus = Corpus.load()
    >>> model = make_lm(LMConfig(d_model=128, layers=2))
    >>> x, y = corpus.batch("train", batch=16, context=64, generator=torch.Generator().manual_seed(0))
    >>> loss = model.loss(x, y)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Corpus", "LMConfig", "make_lm", "evaluate"]


class Corpus:
    """Byte-level train/validation token streams of the Python documentation text."""

    def __init__(self, train: np.ndarray, val: np.ndarray) -> None:
        self.train = train
        self.val = val

    @classmethod
    def load(cls, val_fraction: float = 0.05) -> Corpus:
        """Load ``pydoc_data.topics`` and hold out every document whose index is 0 mod 1/val_fraction."""
        if not 0.0 < val_fraction < 0.5:
            raise ValueError(f"val_fraction={val_fraction} must lie in (0, 0.5)")
        from pydoc_data.topics import topics

        docs = [topics[k].encode("utf-8") for k in sorted(topics)]
        every = max(2, round(1 / val_fraction))
        val = b"\n".join(d for i, d in enumerate(docs) if i % every == 0)
        train = b"\n".join(d for i, d in enumerate(docs) if i % every != 0)
        return cls(np.frombuffer(train, dtype=np.uint8).copy(), np.frombuffer(val, dtype=np.uint8).copy())

    def batch(self, split: str, *, batch: int, context: int, generator: Any) -> tuple[Any, Any]:
        """Sample ``batch`` windows of ``context`` tokens; return inputs and next-token targets."""
        import torch

        data = {"train": self.train, "val": self.val}.get(split)
        if data is None:
            raise ValueError(f"split={split!r} must be 'train' or 'val'")
        if context + 1 > data.size:
            raise ValueError(f"context={context} is longer than the {split} split ({data.size} tokens)")
        starts = torch.randint(0, data.size - context - 1, (batch,), generator=generator).numpy()
        idx = starts[:, None] + np.arange(context + 1)[None, :]
        tokens = torch.from_numpy(data[idx].astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]


@dataclass(frozen=True, kw_only=True, slots=True)
class LMConfig:
    """Shape of :class:`TinyGPT`."""

    vocab: int = 256
    """Vocabulary size (bytes)."""
    d_model: int = 128
    """Width of the residual stream."""
    layers: int = 2
    """Transformer blocks."""
    heads: int = 4
    """Attention heads (must divide d_model)."""
    context: int = 64
    """Maximum sequence length."""
    mlp_ratio: int = 4
    """Hidden width of each MLP as a multiple of d_model."""

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model}")
        for name in ("vocab", "d_model", "layers", "heads", "context", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@functools.cache
def _gpt_class() -> Any:
    # torch is imported here, on first use, so that importing this module stays cheap.
    import torch

    class Block(torch.nn.Module):
        def __init__(self, cfg: LMConfig) -> None:
            super().__init__()
            d = cfg.d_model
            self.heads = cfg.heads
            self.ln1 = torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d)
            self.proj = torch.nn.Linear(d, d)
            self.ln2 = torch.nn.LayerNorm(d)
            self.up = torch.nn.Linear(d, cfg.mlp_ratio * d)
            self.down = torch.nn.Linear(cfg.mlp_ratio * d, d)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            shape = (b, t, self.heads, d // self.heads)
            q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
            att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
            return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))

    class TinyGPT(torch.nn.Module):
        """GPT-style model: pre-norm blocks, learned positions, output tied to the embedding."""

        def __init__(self, cfg: LMConfig) -> None:
            super().__init__()
            self.cfg = cfg
            self.tok = torch.nn.Embedding(cfg.vocab, cfg.d_model)
            self.pos = torch.nn.Embedding(cfg.context, cfg.d_model)
            self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln = torch.nn.LayerNorm(cfg.d_model)
            for name, p in self.named_parameters():
                if p.dim() == 2:  # GPT-2 init; residual projections scaled by depth
                    residual = name.endswith(("down.weight", "proj.weight"))
                    torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * cfg.layers) if residual else 1.0))

        def forward(self, idx: Any) -> Any:
            t = idx.shape[1]
            if t > self.cfg.context:
                raise ValueError(f"sequence of {t} tokens exceeds context={self.cfg.context}")
            x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.tok.weight.T

        def loss(self, idx: Any, targets: Any) -> Any:
            """Return the mean next-token cross-entropy (nats per byte)."""
            logits = self(idx)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return TinyGPT


def make_lm(cfg: LMConfig | None = None, seed: int = 0) -> Any:
    """Return a freshly initialised TinyGPT ``torch.nn.Module`` (same weights for the same seed)."""
    import torch

    torch.manual_seed(seed)
    return _gpt_class()(cfg or LMConfig())


def evaluate(model: Any, corpus: Corpus, *, batches: int = 8, batch: int = 32, seed: int = 1234) -> float:
    """Return the mean validation loss (nats/byte) on a fixed set of windows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = corpus.batch("val", batch=batch, context=model.cfg.context, generator=g)
            total += float(model.loss(x, y))
    model.train(was_training)
    return total / batches
