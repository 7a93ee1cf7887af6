"""An independent model of the codec-spec grammar (commwire/codecs/registry.py docstring); imported as ``_spec_model``.

:func:`predict` reads a spec string the way the grammar documents it and says
whether it is valid, which parts are bad (each error is the set of names a
message may use for the bad part: the raw option, its key, its value or the
stage name), the canonical spec of a valid one, and its ``_oracle`` stages::

    spec   := stage ("+" stage)*         # outermost first; the last stage is a codec
    stage  := name [":" option ("," option)*]
    option := key "=" integer | flag      # flags: sr, rne (rounding=...)

Names and options are case-insensitive and surrounding whitespace is ignored;
empty options are skipped. Integers are ASCII ``-?[0-9]+``. Option ranges
come from the codecs' Config dataclasses (fp8.py, nvfp4.py, hadamard.py, gift.py);
one rule spans stages: ``gift:profile=N`` (N > 0) needs a codec with a number format.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import _oracle as oracle

_INT = re.compile(r"-?[0-9]+")
FLAGS = {"sr": ("rounding", "sr"), "rne": ("rounding", "rne")}
_SEED32 = ("an int in [0, 2**32)", lambda v: isinstance(v, int) and 0 <= v < 2**32)
_ROUNDING = ("sr or rne (flags)", lambda v: v in ("sr", "rne"))


def _nonneg(v: object) -> bool:
    return isinstance(v, int) and v >= 0


def _block(v: object) -> bool:
    return isinstance(v, int) and 0 <= v < 2**31  # the kernels index blocks with 32-bit integers


OPTIONS: dict[str, dict[str, tuple[str, Callable[[object], bool]]]] = {
    # codecs (the last stage)
    "none": {}, "identity": {}, "fp16": {}, "bf16": {},
    "fp8-e4m3": {"block": ("an int in [0, 2**31)", _block), "rounding": _ROUNDING, "seed": _SEED32},
    "fp8-e5m2": {"block": ("an int in [0, 2**31)", _block), "rounding": _ROUNDING, "seed": _SEED32},
    "nvfp4": {"rounding": _ROUNDING, "seed": _SEED32},
    # wrapper stages
    "ef": {},
    "hadamard": {"size": ("a power of two in [2, 4096]", lambda v: isinstance(v, int) and 2 <= v <= 4096
                          and v & (v - 1) == 0), "seed": ("an int >= 0", _nonneg)},
    "gift": {"rank": ("an int >= 0", _nonneg), "refresh": ("an int >= 1", lambda v: isinstance(v, int) and v >= 1),
             "ef": ("0 or 1", lambda v: v in (0, 1)), "profile": ("an int >= 0", _nonneg),
             "top": ("an int >= 0", _nonneg)},
}
CODECS = ("none", "identity", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "nvfp4")
WRAPPERS = ("ef", "hadamard", "gift")
_GIFT_DEFAULTS = {"rank": 32, "refresh": 50, "ef": 1, "profile": 0, "top": 0}


@dataclasses.dataclass
class Prediction:
    """What the grammar says about one spec string."""

    errors: list[set[str]]
    """One set per bad part: the names a message may use for it (empty list: valid)."""
    canonical: str = ""
    """The canonical spec of a valid spec (defaults omitted, ``identity`` as ``none``)."""
    stages: list[oracle.Stage] = dataclasses.field(default_factory=list)
    """The error-model stages of a valid spec."""

    @property
    def valid(self) -> bool:
        """Return whether the spec builds."""
        return not self.errors


def _parse_stage(text: str) -> tuple[str, dict[str, object], list[set[str]]]:
    name, _, opts = text.strip().lower().partition(":")
    options: dict[str, object] = {}
    errors: list[set[str]] = []
    for raw in (o.strip() for o in opts.split(",")):
        if not raw:
            continue
        if raw in FLAGS:
            key, value = FLAGS[raw]
        elif "=" in raw:
            key, _, value_text = raw.partition("=")
            key, value_text = key.strip(), value_text.strip()
            if not _INT.fullmatch(value_text):
                errors.append({raw, value_text, key} - {""} or {raw})
                continue
            value = int(value_text)
        else:
            errors.append({raw})
            continue
        if key in options:
            errors.append({key, raw})
            continue
        options[key] = value
    return name.strip(), options, errors


def _canonical(name: str, o: dict[str, object]) -> tuple[str, oracle.Stage]:
    sr = o.get("rounding") == "sr"
    if name in ("none", "identity"):
        return "none", oracle.Stage("none")
    if name in ("fp16", "bf16"):
        return name, oracle.Stage("cast", fmt=name)
    if name.startswith("fp8-"):
        opts = ([f"block={o['block']}"] if o.get("block") else []) + (["sr"] if sr else [])
        opts += [f"seed={o['seed']}"] if sr and o.get("seed") else []
        return name + (":" + ",".join(opts) if opts else ""), oracle.Stage("fp8", fmt=name[4:],
                                                                          block=int(o.get("block") or 0), sr=sr)
    if name == "nvfp4":
        text = "nvfp4" + (":sr" + (f",seed={o['seed']}" if o.get("seed") else "") if sr else "")
        return text, oracle.Stage("nvfp4", sr=sr)
    if name == "hadamard":
        size = int(o.get("size", 16))
        opts = ([f"size={size}"] if size != 16 else []) + ([f"seed={o['seed']}"] if o.get("seed") else [])
        return "hadamard" + (":" + ",".join(opts) if opts else ""), oracle.Stage("hadamard", block=size)
    if name == "gift":
        opts = [f"{k}={int(o.get(k, d))}" for k, d in _GIFT_DEFAULTS.items() if o.get(k, d) != d]
        return "gift" + (":" + ",".join(opts) if opts else ""), oracle.Stage("gift")
    return "ef", oracle.Stage("ef")


def predict(spec: str) -> Prediction:
    """Return what the grammar says about ``spec`` (a str)."""
    parts = [_parse_stage(p) for p in spec.split("+")]
    errors = [e for _, _, errs in parts for e in errs]
    texts, stages = [], []
    for i, (name, options, _) in enumerate(parts):
        last = i == len(parts) - 1
        if "config" in options:  # registry.py refuses config= while parsing, before it looks up the name
            errors.append({"config"})
        if name not in (CODECS if last else WRAPPERS):
            errors.append({name})
            continue
        allowed = OPTIONS[name]
        for key, value in options.items():
            if key not in allowed:
                errors.append({key})
            elif not allowed[key][1](value):
                errors.append({key})
        text, stage = _canonical(name, options)
        texts.append(text)
        stages.append(stage)
    if parts[-1][0] in ("none", "identity"):
        # gift.py: profiling counts range hits of the inner codec's number format; "none" has none
        errors += [{"profile"} for (name, options, _) in parts[:-1] if name == "gift" and options.get("profile")]
    if errors:
        return Prediction(errors=errors)
    return Prediction(errors=[], canonical="+".join(texts), stages=stages)


def wire_nbytes(stages: list[oracle.Stage], n: int) -> int:
    """Return the payload size of ``n`` elements: the last stage's format (wrappers add nothing)."""
    last = stages[-1]
    if last.kind == "none":
        return 4 * n
    if last.kind == "cast":
        return 2 * n
    if last.kind == "fp8":
        return n + 4 * (-(-n // last.block) if last.block else 1)
    return -(-n // 2) + -(-n // 16) + 4


def names_bad_part(message: str, errors: list[set[str]]) -> bool:
    """Return whether ``message`` names at least one bad part (as written or as repr() escapes it)."""
    text = message.lower()
    for names in errors:
        for name in names:
            if name == "" and "''" in text:
                return True
            if name and (name in text or repr(name)[1:-1] in text):
                return True
    return False
