"""Fused numba kernels for the CPU codecs: scale, saturate, round and pack in one pass.

Why this shape:

- Every element kernel works on the float32 *bit pattern*: rounding to nearest
  even is "add 0x7ff.. plus the kept LSB, then shift" for normal results, and one
  float add of a magic constant for subnormal results. Both are computed and the
  right one selected, so the loop has no branches and LLVM vectorises it.
- Element loops live in small non-parallel ``_*_slice`` functions called on one
  chunk each from a ``prange`` driver: vectorisation is lost when the loop body
  is inlined into the parallel region, and kept when it is a separate function.
- Chunks are fixed-size, and the random bits of stochastic rounding depend only
  on (stream, global element index), so the result is identical for any thread
  count.
- Decoding reads a 256-entry table (``FloatFormat.lut``) per code.

The format constants come from ``FloatFormat.kernel_params`` so one kernel
serves every format. Stochastic rounding rounds up with probability
(|y| - lo) / (hi - lo), computed exactly in integers from the dropped mantissa
bits compared with 32 random bits (bias below 2**-32 of one code step).
Thread count: ``commwire.codecs.set_threads`` (see ``_threads``).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from ._threads import get_threads

_CHUNK = 1 << 14  # elements per parallel task: 64 KiB of float32, stays in L2
_M32 = 0xFFFFFFFF
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF


def _jit(**options):
    """Compile with an on-disk cache, or without one where no cache dir is writable."""

    def decorate(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # numba found no writable cache locator
            return njit(cache=False, **options)(fn)

    return decorate


def _use_threads() -> None:
    numba.set_num_threads(min(get_threads(), numba.config.NUMBA_NUM_THREADS))


def _typed(params: tuple) -> tuple:
    # int32 constants keep the vector lanes 32 bits wide (twice the lanes of int64).
    return tuple(v if isinstance(v, np.floating) else np.int32(v) for v in params)


# ---- scalar helpers (inlined) -------------------------------------------------


@njit(inline="always")
def _bits(f):
    return np.float32(f).view(np.int32)


@njit(inline="always")
def _flt(b):
    return np.int32(b).view(np.float32)


@njit(inline="always")
def _rand32(idx, stream):
    # lowbias32 hash of (index, stream): counter-based, so reproducible and order-free.
    h = (idx * 0x9E3779B9 + stream) & _M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    h ^= h >> 16
    return h


@njit(inline="always")
def _code_rne(y, p):
    """Encode one scaled float32 to a code, RNE, saturating (see formats.py rules)."""
    shift, rebias, minnorm, magic, magic_bits, max_bits, nan_code, inf_code, sign_shift, _m, _e = p
    b = _bits(y)
    sign = ((b >> 31) & 1) << sign_shift
    a = b & _ABS_MASK
    am = min(a, np.int32(max_bits))
    c_sub = _bits(_flt(am) + magic) - magic_bits
    c_nor = (am - rebias + ((1 << (shift - 1)) - 1) + ((am >> shift) & 1)) >> shift
    c = c_sub if am < minnorm else c_nor
    c = inf_code if a == _INF_BITS else c
    c = nan_code if a > _INF_BITS else c
    return c | sign


@njit(inline="always")
def _code_sr(y, p, r):
    """Encode one scaled float32 with stochastic rounding driven by 32 random bits ``r``."""
    shift, rebias, minnorm, magic, magic_bits, max_bits, nan_code, inf_code, sign_shift, man_bits, emin = p
    b = _bits(y)
    sign = ((b >> 31) & 1) << sign_shift
    a = b & _ABS_MASK
    am = np.int64(min(a, np.int32(max_bits)))
    c_nor = (am - rebias + (r & ((1 << shift) - 1))) >> shift
    # Subnormal result: fixed point with 32 fraction bits of |y| / min_subnormal.
    ef = am >> 23
    e = max(ef, 1) - 127
    m24 = (am & 0x7FFFFF) | (0x800000 if ef > 0 else 0)
    k = min(23 + emin - man_bits - e, 63)
    full = (m24 << 32) >> k
    c_sub = (full >> 32) + (1 if r < (full & _M32) else 0)
    c = c_sub if am < minnorm else c_nor
    c = inf_code if a == _INF_BITS else c
    c = nan_code if a > _INF_BITS else c
    return c | sign


# ---- slice kernels (vectorised inner loops) ----------------------------------


@_jit()
def _amax_slice(u):
    """Return (max finite |x| bits, max |x| bits) of an int32 view."""
    m_fin = np.int32(0)
    m_all = np.int32(0)
    for i in range(u.size):
        a = u[i] & np.int32(_ABS_MASK)
        m_all = max(m_all, a)
        m_fin = max(m_fin, a if a < np.int32(_INF_BITS) else np.int32(0))
    return m_fin, m_all


@_jit()
def _enc_rne_slice(x, out, inv, p):
    for i in range(x.size):
        out[i] = np.uint8(_code_rne(x[i] * inv, p))


@_jit()
def _enc_sr_slice(x, out, inv, p, stream, base):
    for i in range(x.size):
        out[i] = np.uint8(_code_sr(x[i] * inv, p, _rand32(base + i, stream)))


@_jit()
def _enc16_slice(x, out, p):
    # Little-endian byte pairs: independent of the buffer's alignment.
    for i in range(x.size):
        c = _code_rne(x[i], p)
        out[2 * i] = np.uint8(c & 0xFF)
        out[2 * i + 1] = np.uint8((c >> 8) & 0xFF)


@_jit()
def _dec_slice(codes, lut, scale, out):
    for i in range(codes.size):
        out[i] = lut[codes[i]] * scale


@_jit()
def _dec16_slice(buf, lut, out):
    for i in range(out.size):
        out[i] = lut[np.int32(buf[2 * i]) | (np.int32(buf[2 * i + 1]) << 8)]


# ---- parallel drivers ---------------------------------------------------------


@_jit(parallel=True)
def _amax(x):
    u = x.view(np.int32)
    n = u.size
    nch = (n + _CHUNK - 1) // _CHUNK
    res = np.zeros(nch, np.int32)
    for c in prange(nch):
        res[c] = _amax_slice(u[c * _CHUNK : min(c * _CHUNK + _CHUNK, n)])[0]
    m = np.int32(0)
    for c in range(nch):
        m = max(m, res[c])
    return _flt(m)


@_jit(parallel=True)
def _fp8_tensor(x, out, inv, p, sr, stream):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        if sr:
            _enc_sr_slice(x[lo:hi], out[lo:hi], inv, p, stream, lo)
        else:
            _enc_rne_slice(x[lo:hi], out[lo:hi], inv, p)


@_jit(parallel=True)
def _fp8_blocks(x, out, scales, block, p, max_finite, floor, sr, stream):
    n = x.size
    nb = scales.size
    per = max(1, _CHUNK // block)  # blocks per task
    ntask = (nb + per - 1) // per
    for t in prange(ntask):
        for b in range(t * per, min(t * per + per, nb)):
            lo = b * block
            hi = min(lo + block, n)
            m = _flt(_amax_slice(x[lo:hi].view(np.int32))[0])
            scale = max(m / max_finite, floor)
            scales[b] = scale
            inv = np.float32(1.0) / scale
            if sr:
                _enc_sr_slice(x[lo:hi], out[lo:hi], inv, p, stream, lo)
            else:
                _enc_rne_slice(x[lo:hi], out[lo:hi], inv, p)


@_jit(parallel=True)
def _dec_blocks(codes, scales, block, lut, out):
    n = out.size
    nb = scales.size
    per = max(1, _CHUNK // block)
    ntask = (nb + per - 1) // per
    for t in prange(ntask):
        for b in range(t * per, min(t * per + per, nb)):
            lo = b * block
            hi = min(lo + block, n)
            _dec_slice(codes[lo:hi], lut, scales[b], out[lo:hi])


@_jit(parallel=True)
def _enc16(x, out, p):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _enc16_slice(x[lo:hi], out[2 * lo : 2 * hi], p)


@_jit(parallel=True)
def _dec16(buf, lut, out):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _dec16_slice(buf[2 * lo : 2 * hi], lut, out[lo:hi])


# ---- NVFP4 -------------------------------------------------------------------


@_jit()
def _halve_max(a, h):
    # Unsigned indices: numba then skips negative-index wraparound, and LLVM vectorises.
    for j in range(h.size):
        i = np.uint64(j) * np.uint64(2)
        h[np.uint64(j)] = max(a[i] & np.int32(_ABS_MASK), a[i + np.uint64(1)] & np.int32(_ABS_MASK))


@_jit()
def _block16_absmax(u, bm):
    """Write max |x| bits (non-finite included) of each full 16-element block of ``u``."""
    h1 = np.empty(bm.size * 8, np.int32)
    h2 = np.empty(bm.size * 4, np.int32)
    h3 = np.empty(bm.size * 2, np.int32)
    # A tree of pairwise maxima on contiguous data vectorises; a 16-step reduction per block does not.
    _halve_max(u, h1)
    _halve_max(h1, h2)
    _halve_max(h2, h3)
    _halve_max(h3, bm)


@_jit()
def _nvfp4_scales(bm, scodes, inv, sg, p8, lut8):
    """Turn block max bits into E4M3 scale codes (NaN for non-finite blocks) and 1/scale."""
    nan_code = np.int32(p8[6])
    for b in range(bm.size):
        m = bm[b]
        sb = (_flt(m) / np.float32(6.0)) / sg
        code = _code_rne(sb, p8)
        # Guard: a scale that underflows E4M3 would zero a non-zero block.
        code = 1 if (code == 0) & (m > 0) else code
        # E2M1 has no NaN/Inf: a non-finite block gets the E4M3 NaN scale instead.
        code = nan_code if m >= _INF_BITS else code
        d = lut8[np.uint64(code)] * sg
        scodes[b] = np.uint8(code)
        inv[b] = np.float32(1.0) / d if d > 0 else np.float32(0.0)


@_jit()
def _nvfp4_codes_rne(x, codes, inv, p4):
    for b in range(inv.size):
        base = np.uint64(b) * np.uint64(16)
        s = inv[b]
        for k in range(16):
            i = base + np.uint64(k)
            codes[i] = np.uint8(_code_rne(x[i] * s, p4) & 0xF)


@_jit()
def _nvfp4_codes_sr(x, codes, inv, p4, stream, start):
    for b in range(inv.size):
        base = np.uint64(b) * np.uint64(16)
        s = inv[b]
        for k in range(16):
            i = base + np.uint64(k)
            codes[i] = np.uint8(_code_sr(x[i] * s, p4, _rand32(start + np.int64(i), stream)) & 0xF)


@_jit()
def _pack_nibbles(codes, packed):
    """Pack two 4-bit codes per byte, even element in the low nibble."""
    pairs = codes[: codes.size // 2 * 2].view(np.uint16)
    for j in range(pairs.size):
        v = pairs[np.uint64(j)]
        # uint16 view of two bytes is little-endian on every platform numba supports.
        packed[np.uint64(j)] = np.uint8((v & 0xF) | ((v >> 4) & 0xF0))
    if codes.size % 2:
        packed[codes.size // 2] = codes[codes.size - 1]


@_jit()
def _nvfp4_chunk(x, packed, scodes, sg, p8, p4, lut8, sr, stream, start):
    n = x.size
    nb = scodes.size
    nfull = n // 16
    bm = np.empty(nb, np.int32)
    _block16_absmax(x[: nfull * 16].view(np.int32), bm[:nfull])
    if nb > nfull:  # a partial last block (only in the last chunk)
        _m, m_all = _amax_slice(x[nfull * 16 :].view(np.int32))
        bm[nfull] = m_all
    inv = np.empty(nb, np.float32)
    _nvfp4_scales(bm, scodes, inv, sg, p8, lut8)
    codes = np.empty(nb * 16, np.uint8)
    xs = x
    if nb > nfull:  # pad the partial block with zeros so the block loop stays uniform
        xs = np.zeros(nb * 16, np.float32)
        xs[:n] = x
    if sr:
        _nvfp4_codes_sr(xs, codes, inv, p4, stream, start)
    else:
        _nvfp4_codes_rne(xs, codes, inv, p4)
    _pack_nibbles(codes[:n], packed)


@_jit(parallel=True)
def _nvfp4_encode(x, packed, scodes, sg, p8, p4, lut8, sr, stream):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK  # _CHUNK is a multiple of 16 and of 2
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _nvfp4_chunk(
            x[lo:hi], packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16],
            sg, p8, p4, lut8, sr, stream, lo,
        )


@_jit()
def _nvfp4_dec_slice(packed, scodes, sg, lut8, lut4, out):
    n = out.size
    d = np.empty(scodes.size, np.float32)
    for b in range(scodes.size):
        d[b] = lut8[scodes[b]] * sg
    for j in range(n // 2):
        byte = packed[j]
        s = d[j >> 3]
        out[2 * j] = lut4[byte & 0xF] * s
        out[2 * j + 1] = lut4[byte >> 4] * s
    if n % 2:
        out[n - 1] = lut4[packed[n // 2] & 0xF] * d[(n - 1) >> 4]


@_jit(parallel=True)
def _nvfp4_decode(packed, scodes, sg, lut8, lut4, out):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _nvfp4_dec_slice(packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, lut8, lut4, out[lo:hi])


# ---- backend API (same names and signatures as _torch_kernels) ----------------


def amax(x: np.ndarray) -> np.float32:
    """Return the largest finite |x| of a flat float32 array (0.0 if there is none)."""
    _use_threads()
    return np.float32(_amax(x))


def tensor_scale(amax_value, divisor: float, floor: float) -> np.float32:
    """Return max(amax / divisor, floor) in float32 (the floor keeps 1/scale finite)."""
    return max(np.float32(amax_value) / np.float32(divisor), np.float32(floor))


def put_f32(out: np.ndarray, values) -> None:
    """Write float32 values into a uint8 buffer as little-endian bytes."""
    out[:] = np.asarray(values, dtype="<f4").reshape(-1).view(np.uint8)


def get_f32(buf: np.ndarray) -> np.ndarray:
    """Read little-endian float32 values from a uint8 buffer at any alignment."""
    return buf.copy().view("<f4").astype(np.float32)


def get_f32_into(buf: np.ndarray, out: np.ndarray) -> None:
    """Copy little-endian float32 bytes into the float32 vector ``out`` (one memcpy)."""
    if out.dtype.byteorder in ("<", "=") and np.little_endian:
        out.view(np.uint8)[:] = buf
    else:
        out[:] = get_f32(buf)


def encode_scaled(x, out, scale, params, *, sr=False, stream=0) -> None:
    """Write one 8-bit code per element of ``x * (1 / scale)`` into ``out``."""
    _use_threads()
    inv = np.float32(1.0) / np.float32(scale)
    _fp8_tensor(x, out, inv, _typed(params), sr, stream)


def encode_blocks(x, out, scales, block, params, max_finite, floor, *, sr=False, stream=0) -> None:
    """Write per-block scales (max(block amax / max_finite, floor)) and 8-bit codes."""
    _use_threads()
    _fp8_blocks(x, out, scales, block, _typed(params), np.float32(max_finite), np.float32(floor), sr, stream)


def decode_blocks(codes, scales, block, lut, out) -> None:
    """Decode 8-bit codes times per-block scales (one scale per tensor: ``block >= n``)."""
    _use_threads()
    _dec_blocks(codes, scales, max(1, block), lut, out)


def encode16(x, out, params) -> None:
    """Write two little-endian bytes per element (fp16/bf16 codes, RNE) into ``out``."""
    _use_threads()
    _enc16(x, out, _typed(params))


def decode16(buf, lut, out) -> None:
    """Decode little-endian 16-bit codes through a 65536-entry table into ``out``."""
    _use_threads()
    _dec16(buf, lut, out)


def nvfp4_encode(x, packed, scodes, sg, p8, p4, lut8, *, sr=False, stream=0) -> None:
    """Write NVFP4 packed codes (low nibble = even element) and E4M3 block-scale codes."""
    _use_threads()
    _nvfp4_encode(x, packed, scodes, np.float32(sg), _typed(p8), _typed(p4), lut8, sr, stream)


def nvfp4_decode(packed, scodes, sg, lut8, lut4, out) -> None:
    """Decode NVFP4 packed codes with E4M3 block scales and the FP32 global scale."""
    _use_threads()
    _nvfp4_decode(packed, scodes, np.float32(sg), lut8, lut4, out)
