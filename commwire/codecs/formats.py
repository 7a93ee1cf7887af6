"""Describe every low-precision number format as one row of data.

One frozen :class:`FloatFormat` per format, collected in :data:`FORMATS`, holds
the bit layout (exponent bits, mantissa bits, bias) and the special-value rules.
Everything else is derived from those fields: the largest finite value, the
smallest normal and subnormal, the NaN/Inf codes, the 256-entry decode table and
the integer constants the encoding kernels (numba on CPU, torch on GPU) use.
No format has its own encoder: the kernels read :meth:`FloatFormat.kernel_params`
and run the same bit arithmetic for all of them.

Value of a code (formats.md): exponent field e > 0 gives
``(-1)^S * 2^(e - bias) * (1 + m / 2^M)``; e = 0 gives ``(-1)^S * 2^(1 - bias) * m / 2^M``.

Special-value rules (``specials``):

- ``"ieee"``: the all-ones exponent is reserved; mantissa 0 is ±Inf, anything else NaN
  (fp16, bf16, E5M2).
- ``"fn"``: no Inf; only the all-ones exponent *and* mantissa is NaN (E4M3 "fn",
  E8M0). Do not confuse with AMD's "fnuz" (single NaN at 0x80), which is not here.
- ``"none"``: every code is a finite number (E2M1).

Encoding rules shared by every format: round to nearest even (or stochastic, see
``commwire.codecs._kernels``); finite values beyond ``max_finite`` saturate to
±``max_finite``; NaN encodes as the format's NaN; ±Inf encodes as ±Inf where the
format has it, otherwise as NaN (E4M3) or ±max (E2M1, which has neither).
E8M0 is in the table for decoding MX scales; the kernels do not encode it
(it has no zero and no sign, so the generic rules do not apply).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["FloatFormat", "FORMATS", "get_format"]

_F32_EXP_BIAS = 127
_F32_MAN_BITS = 23


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FloatFormat:
    """One binary floating-point format: bit layout and special-value rules."""

    name: str
    """Short name used in codec specs and error messages (``"e4m3"``)."""
    exp_bits: int
    """Number of exponent bits."""
    man_bits: int
    """Number of explicit mantissa bits."""
    bias: int
    """Exponent bias."""
    specials: str
    """``"ieee"``, ``"fn"`` or ``"none"`` (see the module docstring)."""
    signed: bool = True
    """Whether the format has a sign bit (E8M0 has none)."""
    subnormals: bool = True
    """Whether exponent field 0 encodes subnormals and zero (E8M0: no)."""
    reference: str = ""
    """Name of the matching ``ml_dtypes``/numpy dtype, the bit-exact test reference."""

    def __post_init__(self) -> None:
        if self.specials not in ("ieee", "fn", "none"):
            raise ValueError(f"FloatFormat {self.name!r}: specials={self.specials!r}; use 'ieee', 'fn' or 'none'")
        if not 1 <= self.exp_bits <= 8 or not 0 <= self.man_bits <= 10:
            raise ValueError(
                f"FloatFormat {self.name!r}: exp_bits={self.exp_bits}, man_bits={self.man_bits} "
                "do not fit the float32-based kernels (need 1..8 exponent and 0..10 mantissa bits)"
            )

    # ---- layout ---------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width of one code in bits."""
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def sign_mask(self) -> int:
        """Code bit that holds the sign (0 for unsigned formats)."""
        return 1 << (self.bits - 1) if self.signed else 0

    @property
    def _top_exp_field(self) -> int:
        """Exponent field of the largest finite value."""
        all_ones = (1 << self.exp_bits) - 1
        # IEEE reserves the top exponent; so does "fn" without mantissa bits (E8M0),
        # whose only code at the top exponent is the NaN.
        reserved = self.specials == "ieee" or (self.specials == "fn" and self.man_bits == 0)
        return all_ones - 1 if reserved else all_ones

    @property
    def _top_man_field(self) -> int:
        """Mantissa field of the largest finite value."""
        all_ones = (1 << self.man_bits) - 1
        # "fn" spends the single all-ones code on NaN, so max finite is one below it.
        return all_ones - 1 if self.specials == "fn" and self.man_bits > 0 else all_ones

    # ---- values ---------------------------------------------------------------
    @property
    def max_finite(self) -> float:
        """Largest finite magnitude (448 for E4M3)."""
        e = self._top_exp_field - self.bias
        return float(2.0**e * (1 + self._top_man_field / 2**self.man_bits))

    @property
    def min_normal(self) -> float:
        """Smallest positive normal magnitude."""
        return float(2.0 ** (1 - self.bias)) if self.subnormals else float(2.0 ** (-self.bias))

    @property
    def min_subnormal(self) -> float:
        """Smallest positive magnitude (equals ``min_normal`` without subnormals)."""
        return float(2.0 ** (1 - self.bias - self.man_bits)) if self.subnormals else self.min_normal

    @property
    def max_code(self) -> int:
        """Code of +max_finite."""
        return (self._top_exp_field << self.man_bits) | self._top_man_field

    @property
    def nan_code(self) -> int | None:
        """Code of +NaN (quiet NaN for IEEE formats), or None when the format has none."""
        if self.specials == "none":
            return None
        all_exp = ((1 << self.exp_bits) - 1) << self.man_bits
        if self.specials == "fn":
            return all_exp | ((1 << self.man_bits) - 1)
        return all_exp | (1 << (self.man_bits - 1))

    @property
    def inf_code(self) -> int | None:
        """Code of +Inf, or None when the format has no infinity."""
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.specials == "ieee" else None

    def ml_dtype(self) -> np.dtype:
        """Return the reference numpy dtype (imports ml_dtypes for the float8/4 types)."""
        if hasattr(np, self.reference):
            return np.dtype(self.reference)
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.reference))

    # ---- derived tables ---------------------------------------------------------
    def decode_values(self, codes: np.ndarray) -> np.ndarray:
        """Decode integer codes to float32 with the formula of formats.md."""
        codes = np.asarray(codes, dtype=np.int64)
        m_mask = (1 << self.man_bits) - 1
        e_mask = (1 << self.exp_bits) - 1
        sign = np.where(codes & self.sign_mask, -1.0, 1.0) if self.signed else 1.0
        e = (codes >> self.man_bits) & e_mask
        m = codes & m_mask
        frac = m / float(2**self.man_bits)
        if self.subnormals:
            mag = np.where(e > 0, np.exp2(e - self.bias) * (1 + frac), 2.0 ** (1 - self.bias) * frac)
        else:
            mag = np.exp2(e - self.bias) * (1 + frac)
        if self.specials == "ieee":
            mag = np.where(e == e_mask, np.where(m == 0, np.inf, np.nan), mag)
        elif self.specials == "fn":
            mag = np.where((e == e_mask) & (m == m_mask), np.nan, mag)
        return (sign * mag).astype(np.float32)

    def lut(self) -> np.ndarray:
        """Return the float32 decode table indexed by code (``2**bits`` entries)."""
        return _lut(self)

    def kernel_params(self) -> tuple:
        """Return the integer constants the encoding kernels need (see ``_kernels``).

        The tuple is ``(shift, rebias, minnorm_bits, magic, magic_bits, max_bits,
        nan_code, inf_code, sign_shift, man_bits, emin)``: ``shift`` drops float32
        mantissa bits, ``rebias`` moves the float32 exponent to this format's bias,
        ``magic`` is the float whose ulp equals this format's subnormal spacing (adding
        it rounds a subnormal to the nearest code, RNE, in one float add).
        """
        return _kernel_params(self)


@functools.cache
def _lut(fmt: FloatFormat) -> np.ndarray:
    table = fmt.decode_values(np.arange(1 << fmt.bits))
    table.setflags(write=False)
    return table


@functools.cache
def _kernel_params(fmt: FloatFormat) -> tuple:
    if not fmt.subnormals or not fmt.signed:
        raise ValueError(f"format {fmt.name!r} is decode-only: the kernels encode signed formats with subnormals")
    shift = _F32_MAN_BITS - fmt.man_bits
    rebias = (_F32_EXP_BIAS - fmt.bias) << _F32_MAN_BITS
    emin = 1 - fmt.bias
    minnorm_bits = int(np.float32(2.0**emin).view(np.int32))
    magic = np.float32(2.0 ** (emin - fmt.man_bits + _F32_MAN_BITS))
    magic_bits = int(magic.view(np.int32))
    max_bits = int(np.float32(fmt.max_finite).view(np.int32))
    # Formats without NaN encode NaN as +0 and Inf as max: the codec above marks
    # non-finite blocks another way (NVFP4 uses the NaN block scale).
    nan_code = fmt.nan_code if fmt.nan_code is not None else 0
    if fmt.inf_code is not None:
        inf_code = fmt.inf_code
    elif fmt.nan_code is not None:
        inf_code = fmt.nan_code
    else:
        inf_code = fmt.max_code
    return (shift, rebias, minnorm_bits, magic, magic_bits, max_bits, nan_code, inf_code, fmt.bits - 1, fmt.man_bits, emin)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat(name="e4m3", exp_bits=4, man_bits=3, bias=7, specials="fn", reference="float8_e4m3fn"),
        FloatFormat(name="e5m2", exp_bits=5, man_bits=2, bias=15, specials="ieee", reference="float8_e5m2"),
        FloatFormat(name="e2m1", exp_bits=2, man_bits=1, bias=1, specials="none", reference="float4_e2m1fn"),
        FloatFormat(
            name="e8m0", exp_bits=8, man_bits=0, bias=127, specials="fn", signed=False, subnormals=False,
            reference="float8_e8m0fnu",
        ),
        FloatFormat(name="fp16", exp_bits=5, man_bits=10, bias=15, specials="ieee", reference="float16"),
        FloatFormat(name="bf16", exp_bits=8, man_bits=7, bias=127, specials="ieee", reference="bfloat16"),
    )
}
"""The table of formats, keyed by name. Add a row here to add a format."""


def get_format(name: str) -> FloatFormat:
    """Return the format called ``name`` from :data:`FORMATS`."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown number format {name!r}; valid: {', '.join(FORMATS)}") from None
