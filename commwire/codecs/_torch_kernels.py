"""The codec kernels written with torch ops, for torch tensors on CPU or CUDA.

Same function names, signatures and bit arithmetic as ``_kernels`` (numba), so a
codec calls whichever module matches its input (see ``base.kernels``); the
tests check that both produce identical bytes. Everything stays on the tensor's
device: scales are 0-d tensors, never Python floats, so encoding a CUDA tensor
does not synchronise with the host. torch is imported by this module only, which
is itself imported only when a torch tensor or cupy array reaches a codec.
"""

from __future__ import annotations

import numpy as np
import torch

_M32 = 0xFFFFFFFF
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF

_lut_cache: dict[tuple[int, str], torch.Tensor] = {}


def _lut(table: np.ndarray, device: torch.device) -> torch.Tensor:
    # LUTs are cached read-only module-level arrays, so id() is a stable key.
    key = (id(table), str(device))
    if key not in _lut_cache:
        _lut_cache[key] = torch.as_tensor(np.array(table), device=device)  # writable copy
    return _lut_cache[key]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """Return (x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _rand32(idx: torch.Tensor, stream: int) -> torch.Tensor:
    """Return the same lowbias32 hash of (index, stream) as ``_kernels._rand32``."""
    h = (_mul32(idx & _M32, 0x9E3779B9) + stream) & _M32
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _codes_rne(y: torch.Tensor, p: tuple) -> torch.Tensor:
    """Encode scaled float32 values to int32 codes, RNE, saturating (formats.py rules)."""
    shift, rebias, minnorm, magic, magic_bits, max_bits, nan_code, inf_code, sign_shift, _m, _e = p
    b = y.contiguous().view(torch.int32)
    sign = ((b >> 31) & 1) << sign_shift
    a = b & _ABS_MASK
    am = torch.clamp(a, max=max_bits)
    c_sub = (am.view(torch.float32) + float(magic)).view(torch.int32) - magic_bits
    c_nor = (am - rebias + ((1 << (shift - 1)) - 1) + ((am >> shift) & 1)) >> shift
    c = torch.where(am < minnorm, c_sub, c_nor)
    c = torch.where(a == _INF_BITS, inf_code, c)
    c = torch.where(a > _INF_BITS, nan_code, c)
    return c | sign


def _codes_sr(y: torch.Tensor, p: tuple, r: torch.Tensor) -> torch.Tensor:
    """Encode with stochastic rounding driven by 32 random bits per element (int64 ``r``)."""
    shift, rebias, minnorm, magic, magic_bits, max_bits, nan_code, inf_code, sign_shift, man_bits, emin = p
    b = y.contiguous().view(torch.int32)
    sign = ((b >> 31) & 1) << sign_shift
    a = b & _ABS_MASK
    am = torch.clamp(a, max=max_bits).to(torch.int64)
    c_nor = (am - rebias + (r & ((1 << shift) - 1))) >> shift
    ef = am >> 23
    e = torch.clamp(ef, min=1) - 127
    m24 = (am & 0x7FFFFF) | torch.where(ef > 0, 0x800000, 0)
    k = torch.clamp(23 + emin - man_bits - e, max=63)
    full = (m24 << 32) >> k
    c_sub = (full >> 32) + (r < (full & _M32)).to(torch.int64)
    c = torch.where(am < minnorm, c_sub, c_nor)
    c = torch.where(a == _INF_BITS, inf_code, c)
    c = torch.where(a > _INF_BITS, nan_code, c)
    return (c | sign).to(torch.int32)


def _codes(y: torch.Tensor, p: tuple, sr: bool, stream: int, start: int = 0) -> torch.Tensor:
    if not sr:
        return _codes_rne(y, p)
    idx = torch.arange(start, start + y.numel(), dtype=torch.int64, device=y.device).reshape(y.shape)
    return _codes_sr(y, p, _rand32(idx, stream))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Return ``x`` zero-padded to whole blocks, shaped (blocks, block)."""
    nb = -(-x.numel() // block)
    pad = nb * block - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.reshape(nb, block)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Return 4-bit codes packed two a byte, even element in the low nibble (odd length: a 0 nibble last)."""
    q = q & 0xF
    if q.numel() % 2:
        q = torch.cat([q, q.new_zeros(1)])
    return (q[0::2] | (q[1::2] << 4)).to(torch.uint8)


def _unpack4(packed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Return the table values of the 4-bit codes in ``packed`` (two per byte, low nibble first)."""
    p = packed.to(torch.int64)
    return torch.stack([table[p & 0xF], table[p >> 4]], dim=1).reshape(-1)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))


# ---- backend API (same names and signatures as _kernels) ---------------------


def amax(x: torch.Tensor) -> torch.Tensor:
    """Return the largest finite |x| as a 0-d float32 tensor (0.0 if there is none)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return _finite_abs(x).amax()


def divide(x: torch.Tensor, number: float) -> torch.Tensor:
    """Return ``x / number`` by IEEE division on every device.

    On CUDA, torch divides a tensor by a Python number (a CPU scalar) as a multiplication by
    its reciprocal, which differs from division in the last bit for about half of all float32
    inputs when the number is 6, 448 or 57344; a 0-d tensor on x's device is divided by truly,
    as numpy and the CPU kernels do. Every division of a tensor in these kernels goes through
    here (tests/codecs/test_formats.py runs them with CUDA's reciprocal emulated).
    """
    return x / torch.full((), number, dtype=x.dtype, device=x.device)


def tensor_scale(amax_value: torch.Tensor, divisor: float, floor: float) -> torch.Tensor:
    """Return max(amax / divisor, floor) in float32 (the floor keeps 1/scale finite)."""
    return torch.clamp(divide(amax_value, divisor), min=floor).to(torch.float32)


def put_f32(out: torch.Tensor, values: torch.Tensor) -> None:
    """Write float32 values into a uint8 buffer as little-endian bytes (all torch devices are LE)."""
    out.copy_(values.reshape(-1).to(torch.float32).contiguous().view(torch.uint8))


def get_f32(buf: torch.Tensor) -> torch.Tensor:
    """Read little-endian float32 values from a uint8 buffer at any alignment."""
    return buf.clone().view(torch.float32)


def get_f32_into(buf: torch.Tensor, out: torch.Tensor) -> None:
    """Copy little-endian float32 bytes into the float32 vector ``out`` (one copy)."""
    out.view(torch.uint8).copy_(buf)


def encode_scaled(x, out, scale, params, *, sr=False, stream=0) -> None:
    """Write one 8-bit code per element of ``x * (1 / scale)`` into ``out``."""
    inv = 1.0 / scale
    out.copy_(_codes(x * inv, params, sr, stream).to(torch.uint8))


def encode_blocks(x, out, scales, block, params, max_finite, floor, *, sr=False, stream=0) -> None:
    """Write per-block scales (max(block amax / max_finite, floor)) and 8-bit codes."""
    n = x.numel()
    xb = _blocks(x, block)
    s = torch.clamp(divide(_finite_abs(xb).amax(dim=1), float(max_finite)), min=float(floor)).to(torch.float32)
    scales.copy_(s)
    inv = (1.0 / s)[:, None]
    out.copy_(_codes(xb * inv, params, sr, stream).reshape(-1)[:n].to(torch.uint8))


def decode_blocks(codes, scales, block, lut, out) -> None:
    """Decode 8-bit codes times per-block scales (one scale per tensor: ``block >= n``)."""
    n = out.numel()
    if n == 0:
        return
    block = max(1, min(block, n))
    table = _lut(lut, codes.device)
    values = _blocks(table[codes.long()], block) * scales[:, None]
    out.copy_(values.reshape(-1)[:n])


def decode_blocks_add(codes, scales, block, lut, out) -> None:
    """Add the values of :func:`decode_blocks` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    decode_blocks(codes, scales, block, lut, part)
    out.add_(part)


def encode16(x, out, params) -> None:
    """Write two little-endian bytes per element (fp16/bf16 codes, RNE) into ``out``."""
    c = _codes_rne(x, params)
    out.copy_(torch.stack([c & 0xFF, (c >> 8) & 0xFF], dim=1).reshape(-1).to(torch.uint8))


def decode16(buf, lut, out) -> None:
    """Decode little-endian 16-bit codes through a 65536-entry table into ``out``."""
    idx = buf[0::2].to(torch.int64) | (buf[1::2].to(torch.int64) << 8)
    out.copy_(_lut(lut, buf.device)[idx])


def decode16_add(buf, lut, out) -> None:
    """Add the values of :func:`decode16` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    decode16(buf, lut, part)
    out.add_(part)


def nvfp4_encode(x, packed, scodes, sg, p8, p4, lut8, *, sr=False, stream=0) -> None:
    """Write NVFP4 packed codes (low nibble = even element) and E4M3 block-scale codes."""
    n = x.numel()
    if n == 0:
        return
    xb = _blocks(x, 16)
    m_all = xb.abs().amax(dim=1)
    m_fin = _finite_abs(xb).amax(dim=1)
    code = _codes_rne(divide(m_fin, 6.0) / sg, p8)
    # Guard: a scale that underflows E4M3 would zero a non-zero block.
    code = torch.where((code == 0) & (m_fin > 0), 1, code)
    # E2M1 has no NaN/Inf: a non-finite block gets the E4M3 NaN scale instead.
    code = torch.where(torch.isfinite(m_all), code, p8[6])
    d = _lut(lut8, x.device)[code.long()] * sg
    inv = torch.where(d > 0, 1.0 / d, torch.zeros((), dtype=d.dtype, device=d.device))
    scodes.copy_(code.to(torch.uint8))
    packed.copy_(_pack4(_codes(xb * inv[:, None], p4, sr, stream).reshape(-1)[:n]))


def nvfp4_decode(packed, scodes, sg, lut8, lut4, out) -> None:
    """Decode NVFP4 packed codes with E4M3 block scales and the FP32 global scale."""
    n = out.numel()
    if n == 0:
        return
    values = _unpack4(packed, _lut(lut4, packed.device))[:n]
    d = _lut(lut8, packed.device)[scodes.long()] * sg
    out.copy_((_blocks(values, 16) * d[:, None]).reshape(-1)[:n])


def nvfp4_decode_add(packed, scodes, sg, lut8, lut4, out) -> None:
    """Add the values of :func:`nvfp4_decode` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    nvfp4_decode(packed, scodes, sg, lut8, lut4, part)
    out.add_(part)


def mx_encode(x, out, scodes, params, emax, pack, *, sr=False, stream=0) -> None:
    """Write MX element codes (``pack``: two 4-bit codes a byte, low nibble = even element) and E8M0 scale codes."""
    n = x.numel()
    if n == 0:
        return
    xb = _blocks(x.contiguous(), 32)
    m = (xb.view(torch.int32) & _ABS_MASK).amax(dim=1)
    # floor(log2 amax) from the float32 exponent field, minus emax, clamped so 2**-e is a normal float32.
    e = torch.clamp((m >> 23) - (127 + emax), min=-127, max=126)
    scodes.copy_(torch.where(m >= _INF_BITS, 255, e + 127).to(torch.uint8))
    inv = ((127 - e) << 23).to(torch.int32).view(torch.float32)
    q = _codes(xb * inv[:, None], params, sr, stream).reshape(-1)[:n]
    out.copy_(_pack4(q) if pack else q.to(torch.uint8))


def mx_decode(codes, scodes, lut_s, lut_e, pack, out) -> None:
    """Decode MX element codes times their E8M0 block scales into ``out``."""
    n = out.numel()
    if n == 0:
        return
    table = _lut(lut_e, codes.device)
    values = _unpack4(codes, table) if pack else table[codes.long()]
    d = _lut(lut_s, codes.device)[scodes.long()]
    out.copy_((_blocks(values[:n], 32) * d[:, None]).reshape(-1)[:n])


def mx_decode_add(codes, scodes, lut_s, lut_e, pack, out) -> None:
    """Add the values of :func:`mx_decode` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    mx_decode(codes, scodes, lut_s, lut_e, pack, part)
    out.add_(part)


def int_encode(x, codes, scales, block, qmax, pack, *, sr=False, stream=0) -> None:
    """Write symmetric integer codes (``pack``: INT4, two a byte, low nibble = even element; an even ``block``)
    and FP32 block scales."""
    n = x.numel()
    if n == 0:
        return
    xb = _blocks(x, block)
    m = xb.abs().amax(dim=1)  # NaN and Inf propagate: a non-finite block
    finite = torch.isfinite(m)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
    s = torch.where(finite, torch.clamp(divide(m, float(qmax)), min=2.0**-126), nan).to(torch.float32)
    scales.copy_(s)
    inv = torch.where(finite, 1.0 / s, torch.zeros((), dtype=torch.float32, device=x.device))
    y = xb * inv[:, None]
    y = torch.where(torch.isnan(y), torch.zeros((), dtype=y.dtype, device=y.device), y).clamp(-qmax, qmax)
    if sr:
        idx = torch.arange(y.numel(), dtype=torch.int64, device=y.device).reshape(y.shape)
        lo = torch.floor(y)
        c = lo + ((y - lo).double() * 4294967296.0 > _rand32(idx, stream).double()).to(y.dtype)
    else:
        c = torch.round(y)  # half to even, as np.rint
    c = c.to(torch.int32).reshape(-1)[:n]
    codes.copy_(_pack4(c) if pack else (c & 0xFF).to(torch.uint8))


def int_decode(codes, scales, block, pack, out) -> None:
    """Decode symmetric integer codes times their FP32 block scales into ``out``."""
    n = out.numel()
    if n == 0:
        return
    c = codes.to(torch.int32)
    if pack:
        c = torch.stack([c & 0xF, c >> 4], dim=1).reshape(-1)[:n]
        c = c - ((c & 8) << 1)
    else:
        c = c - ((c & 128) << 1)
    out.copy_((_blocks(c.to(torch.float32), block) * scales[:, None]).reshape(-1)[:n])


def int_decode_add(codes, scales, block, pack, out) -> None:
    """Add the values of :func:`int_decode` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    int_decode(codes, scales, block, pack, part)
    out.add_(part)


def sign_encode(x, bits, scales, block) -> None:
    """Write sign bits (bit k of byte j: element 8j + k is negative) and mean-|x| block scales."""
    n = x.numel()
    if n == 0:
        return
    xb = _blocks(x, block)
    acc = xb.double().abs().sum(dim=1)
    counts = torch.full_like(acc, float(block))
    counts[-1] = n - (acc.numel() - 1) * block
    nan = torch.full((), float("nan"), dtype=torch.float32, device=x.device)
    scales.copy_(torch.where(torch.isfinite(acc), (acc / counts).to(torch.float32), nan))
    neg = (x < 0).to(torch.int32)
    pad = -n % 8
    if pad:
        neg = torch.cat([neg, neg.new_zeros(pad)])
    weights = 2 ** torch.arange(8, dtype=torch.int32, device=x.device)
    bits.copy_((neg.reshape(-1, 8) * weights).sum(dim=1).to(torch.uint8))


def sign_decode(bits, scales, block, out) -> None:
    """Decode sign bits times their block scales into ``out``."""
    n = out.numel()
    if n == 0:
        return
    b = bits.to(torch.int32)
    neg = ((b[:, None] >> torch.arange(8, dtype=torch.int32, device=bits.device)) & 1).reshape(-1)[:n]
    s = _blocks(torch.ones(n, dtype=torch.float32, device=out.device), block) * scales[:, None]
    s = s.reshape(-1)[:n]
    out.copy_(torch.where(torch.isnan(s) | (neg == 0), s, -s))  # a NaN scale decodes to itself, as on the CPU


def sign_decode_add(bits, scales, block, out) -> None:
    """Add the values of :func:`sign_decode` to ``out`` (decoded into a temporary, then added)."""
    part = torch.empty_like(out)
    sign_decode(bits, scales, block, part)
    out.add_(part)


def add_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``a + b`` into ``out`` (float32 vectors of one length; ``out`` may be ``a`` or ``b``)."""
    torch.add(a, b, out=out)


def feedback_residual(y: torch.Tensor, decoded: torch.Tensor, out: torch.Tensor) -> None:
    """Write ``y - decoded`` into ``out``, non-finite differences as 0 (error feedback's residual)."""
    torch.sub(y, decoded, out=out)
    out.nan_to_num_(0.0, 0.0, 0.0)
