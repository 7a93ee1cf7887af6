"""Give a model's activations outlier features: fixed large gains on a few input channels of chosen layers.

Large language models grow a few activation channels that are tens of times
larger than the rest (Dettmers et al. 2022, "LLM.int8()": up to ~60x at 6.7B
parameters; the largest sit in the MLP down-projection inputs). A model small
enough for CPU benchmarks does not grow them in a few hundred steps, so they
are injected: every ``nn.Linear`` whose module name ends in one of ``gains``
multiplies its input by a fixed (non-trained) gain vector that is 1 except on
``channels`` channels, where it is the layer type's gain. Layers of the same
input width share the channel set, as outlier features of the residual stream
are shared by the layers that read it. The weight columns of those channels are
divided by the gain at injection, so the function at step 0 is unchanged; from
then on the inputs, the input second moments A and the weight gradients carry
the outliers (gradient columns ×gain), while Adam's updates per weight stay the
same size.

Example:
    >>> model = make_lm(LMConfig(d_model=128, layers=2), seed=0)
    >>> channels = inject_outliers(model, OutlierConfig(channels=4, gains=(("down", 32.0),)))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["OutlierConfig", "inject_outliers"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OutlierConfig:
    """Which layers get outlier input channels, how many and how large."""

    channels: int = 4
    """Outlier channels per input width."""
    gains: tuple[tuple[str, float], ...] = (("down", 32.0), ("qkv", 8.0), ("up", 8.0))
    """(module-name suffix, gain) pairs; the MLP down-projection input gets the largest, as in LLMs."""
    seed: int = 0
    """Seed of the channel choice."""

    def __post_init__(self) -> None:
        if not isinstance(self.channels, int) or self.channels < 0:
            raise ValueError(f"OutlierConfig.channels={self.channels!r}; use an int >= 0")
        for item in self.gains:
            if len(item) != 2 or not isinstance(item[0], str) or not float(item[1]) > 0:
                raise ValueError(f"OutlierConfig.gains entry {item!r}; use (module-name suffix, positive gain)")


def inject_outliers(model: Any, config: OutlierConfig | None = None) -> dict[str, list[int]]:
    """Add the gains to ``model``'s matching ``nn.Linear`` layers in place; return weight name -> channels."""
    import torch

    config = config or OutlierConfig()
    gains = dict(config.gains)
    rng = np.random.default_rng(config.seed)
    by_width: dict[int, list[int]] = {}
    chosen: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        suffix = name.rsplit(".", 1)[-1]
        if not isinstance(module, torch.nn.Linear) or suffix not in gains or not config.channels:
            continue
        d = module.in_features
        if config.channels > d:
            raise ValueError(f"OutlierConfig.channels={config.channels} exceeds the input width {d} of {name!r}")
        if d not in by_width:
            by_width[d] = sorted(int(c) for c in rng.choice(d, config.channels, replace=False))
        gain = torch.ones(d, dtype=module.weight.dtype, device=module.weight.device)
        gain[by_width[d]] = float(gains[suffix])
        with torch.no_grad():
            module.weight /= gain  # the same function at step 0
        module.register_buffer("outlier_gain", gain, persistent=False)
        module.register_forward_pre_hook(_scale_input)
        chosen[f"{name}.weight"] = list(by_width[d])
    return chosen


def _scale_input(module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    # Forward hooks (GIFT's statistics) see these scaled inputs: pre-hooks replace the arguments.
    return (inputs[0] * module.outlier_gain, *inputs[1:])
