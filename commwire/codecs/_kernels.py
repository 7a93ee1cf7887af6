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
- Decoding reads a 256-entry table (``FloatFormat.lut``) per code; E4M3, E5M2,
  bf16 and fp16 also have kernels with their format constants compiled in
  (int32 lanes, values computed instead of looked up), chosen by matching the
  parameters or table, and bit-identical to the table kernels (tests compare).
- NVFP4 has a faster path for round to nearest (the default): with exactly one
  16-element block per AVX-512 vector, each pass runs over whole blocks on
  scratch that stays in cache, and its integer steps are cast back to int32
  after every operation (numba widens int32 arithmetic to int64, which halves
  the vector lanes). The E4M3 and E2M1 constants are compile-time globals, and
  format values are computed rather than looked up (a gather per element does
  not vectorise well). Results are bit-identical to the generic kernels.
- ``*_add`` variants add the decoded values to the output (a reduction) without
  a temporary vector: NVFP4 in one pass; the table decoders (FP8, fp16/bf16)
  decode a tile into L1-resident scratch and add it, because their lookups stay
  scalar and a fused loop ran slower. ``out[i] + value`` rounds exactly like a
  decode into a temporary followed by an add.

The format constants come from ``FloatFormat.kernel_params`` so one kernel
serves every format. Stochastic rounding rounds up with probability
(|y| - lo) / (hi - lo), computed exactly in integers from the dropped mantissa
bits compared with 32 random bits (bias below 2**-32 of one code step).
Thread count: ``commwire.codecs.set_threads`` (see ``_threads``).
"""

from __future__ import annotations

import functools
import threading
import types

import numba
import numpy as np
from numba import njit, prange

from ._threads import get_threads
from .formats import get_format

_CHUNK = 1 << 14  # elements per parallel task: 64 KiB of float32, stays in L2
_ADD_TILE = 1 << 10  # elements decoded into L1-resident scratch before an add
_M32 = 0xFFFFFFFF
_INF_BITS = 0x7F800000
_ABS_MASK = 0x7FFFFFFF
_I = np.int32
_U = np.uint64


def _jit(**options):
    """Compile with an on-disk cache, or without one where no cache dir is writable.

    Every kernel releases the GIL (``nogil``): the lanes that run compressed
    all-reduces encode and decode while the training thread runs Python (the
    autograd hooks that hand buckets over, the DDP reducer's comm hook), instead
    of stalling it for the length of each kernel.
    """
    options.setdefault("nogil", True)

    def decorate(fn):
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # numba found no writable cache locator
            return njit(cache=False, **options)(fn)

    return decorate


class _Driver:
    """A chunked kernel compiled twice: threaded (``prange`` over chunks) and serial (``prange`` as ``range``).

    A call runs the threaded one only when :func:`_parallel` says so. Even at one
    numba thread a ``parallel=True`` kernel starts numba's OpenMP pool, whose idle
    worker spins: with 4 ranks on 2 cores (one codec thread per rank) that spinning
    starved every rank's torch compute (LoRDO with FP8 pseudo-gradients: 11.4 s
    for 32 steps against 1.6 s with the pool never started). The chunks are the
    same in both versions, so both give the same bits.
    """

    __slots__ = ("parallel", "serial")

    def __init__(self, fn):
        self.parallel = _jit(parallel=True)(fn)
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"  # its own on-disk cache entry
        self.serial = _jit()(twin)

    def __call__(self, *args):
        """Run on the first argument's size: threaded for several chunks and threads, else serial."""
        return (self.parallel if _parallel(args[0].size) else self.serial)(*args)


_numba_threads = threading.local()


def _parallel(n: int) -> bool:
    """Return True (after setting numba's thread count) when ``n`` elements should use several threads.

    One thread, or a single chunk of work, runs a serial driver instead: the
    result is the same (chunks are fixed-size), without a parallel launch.
    """
    if n <= _CHUNK:
        return False
    threads = min(get_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads < 2:
        return False
    if getattr(_numba_threads, "n", None) != threads:  # numba's setting is per calling thread
        numba.set_num_threads(threads)
        _numba_threads.n = threads
    return True


@functools.lru_cache(maxsize=None)
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


@njit(inline="always")
def _code_rne32(y, p, inf_is_max):
    """Return ``_code_rne(y, p)``, computed in int32 lanes.

    Numba widens int32 arithmetic to int64; casting back after every step lets
    LLVM keep 16 lanes per AVX-512 vector. Pass ``p`` as a global tuple so that
    its shifts and masks are constants. ``inf_is_max=True`` skips the Inf test,
    valid where the format's Inf code is its largest code (E2M1: Inf saturates
    to ±6 anyway).
    """
    shift, rebias, minnorm, magic, magic_bits, max_bits, nan_code, inf_code, sign_shift, _m, _e = p
    b = _bits(y)
    a = _I(b & _I(_ABS_MASK))
    am = _I(min(a, max_bits))
    c_sub = _I(_bits(_flt(am) + magic) - magic_bits)
    half = _I(_I(_I(1) << _I(shift - _I(1))) - _I(1))
    c_nor = _I(_I(_I(am - _I(rebias - half)) + _I(_I(am >> shift) & _I(1))) >> shift)
    c = c_sub if am < minnorm else c_nor
    if not inf_is_max:
        c = inf_code if a == _I(_INF_BITS) else c
    c = nan_code if a > _I(_INF_BITS) else c
    return _I(c | _I(_I(b >> _I(_I(31) - sign_shift)) & _I(_I(1) << sign_shift)))


@njit(inline="always")
def _value(mag, p, min_subnormal):
    """Return the float32 value of the non-negative finite code ``mag`` of the format of ``p``."""
    shift, rebias, _mn, _mg, _mb, _x, _n, _i, _s, man_bits, _e = p
    normal = _flt(_I(_I(mag << shift) + rebias))
    return normal if mag >= _I(_I(1) << man_bits) else np.float32(mag) * min_subnormal


# ---- format constants of the fast paths ---------------------------------------
#
# A kernel that reads its format's constants as globals (not arguments) compiles them
# in: shifts by constants and int32 lanes, about 4x faster than the generic kernels
# (measured: E4M3 encoding 2.2 vs 8.4 ms for 6.65 M elements, one thread).

_E4M3 = _typed(get_format("e4m3").kernel_params())
_E5M2 = _typed(get_format("e5m2").kernel_params())
_E2M1 = _typed(get_format("e2m1").kernel_params())
_BF16 = _typed(get_format("bf16").kernel_params())
_FP16 = _typed(get_format("fp16").kernel_params())
_E4M3_SUB = np.float32(get_format("e4m3").min_subnormal)
_E5M2_SUB = np.float32(get_format("e5m2").min_subnormal)
_E2M1_SUB = np.float32(get_format("e2m1").min_subnormal)
_E4M3_INF_IS_MAX = bool(_E4M3[7] == get_format("e4m3").max_code)  # False: Inf encodes as the NaN code
_E2M1_INF_IS_MAX = bool(_E2M1[7] == get_format("e2m1").max_code)  # True: Inf saturates to ±6
_E4M3_LUT = get_format("e4m3").lut()
_E5M2_LUT = get_format("e5m2").lut()
_E2M1_LUT = get_format("e2m1").lut()
_BF16_LUT = get_format("bf16").lut()
_FP16_LUT = get_format("fp16").lut()
_GENERIC, _FAST_E4M3, _FAST_E5M2, _FAST_BF16, _FAST_FP16 = 0, 1, 2, 3, 4
"""Which kernel a driver runs: the generic one (constants as arguments) or a format's own."""
_FAST_PARAMS = {_E4M3: _FAST_E4M3, _E5M2: _FAST_E5M2, _BF16: _FAST_BF16, _FP16: _FAST_FP16}
_FAST_TABLES = ((_E4M3_LUT, _FAST_E4M3), (_E5M2_LUT, _FAST_E5M2), (_BF16_LUT, _FAST_BF16), (_FP16_LUT, _FAST_FP16))


def _fast_id(params: tuple) -> int:
    return _FAST_PARAMS.get(params, _GENERIC)


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
def _add_into(out, part):
    for i in range(part.size):
        out[_U(i)] = out[_U(i)] + part[_U(i)]


@_jit()
def _dec_range(codes, scales, block, lut, lo, hi, part):
    """Decode elements lo..hi-1 (blocks of ``block`` elements from element 0) into ``part``."""
    b = lo // block
    i = lo
    while i < hi:
        j = min((b + 1) * block, hi)
        _dec_slice(codes[i:j], lut, scales[b], part[i - lo : j - lo])
        i = j
        b += 1


@_jit()
def _dec16_slice(buf, lut, out):
    for i in range(out.size):
        out[i] = lut[np.int32(buf[2 * i]) | (np.int32(buf[2 * i + 1]) << 8)]


@_jit()
def _dec16_add_slice(buf, lut, out, tmp):
    n = out.size
    for lo in range(0, n, tmp.size):
        hi = min(lo + tmp.size, n)
        part = tmp[: hi - lo]
        _dec16_slice(buf[2 * lo : 2 * hi], lut, part)
        _add_into(out[lo:hi], part)


# ---- format-specific slice kernels (constants compiled in) -----------------------


def _specials(lut: np.ndarray) -> tuple[np.int32, np.int32]:
    """Return (the +Inf code or -1, the smallest NaN code) of a sign-magnitude format's table."""
    half = lut[: lut.size // 2]
    inf = np.flatnonzero(np.isposinf(half))
    return np.int32(inf[0] if inf.size else -1), np.int32(np.flatnonzero(np.isnan(half))[0])


_E4M3_INF, _E4M3_NAN = _specials(_E4M3_LUT)
_E5M2_INF, _E5M2_NAN = _specials(_E5M2_LUT)
_FP16_INF, _FP16_NAN = _specials(_FP16_LUT)
_FP16_SUB = np.float32(get_format("fp16").min_subnormal)


@njit(inline="always")
def _code_value(code, p, sub, sign_code, inf_code, nan_code):
    """Return the float32 value of ``code`` (the same as its table entry): no gather, so it vectorises."""
    mag = _I(code & _I(sign_code - _I(1)))
    v = _value(mag, p, sub)
    v = np.float32(np.inf) if mag == inf_code else v
    v = -v if code >= sign_code else v
    return np.float32(np.nan) if mag >= nan_code else v  # the tables' one NaN, whatever the sign


@_jit()
def _enc_e4m3_slice(x, out, inv):
    for i in range(x.size):
        out[i] = np.uint8(_code_rne32(x[i] * inv, _E4M3, False))


@_jit()
def _enc_e5m2_slice(x, out, inv):
    for i in range(x.size):
        out[i] = np.uint8(_code_rne32(x[i] * inv, _E5M2, False))


@_jit()
def _enc8_fast_slice(x, out, inv, f):
    if f == _FAST_E4M3:
        _enc_e4m3_slice(x, out, inv)
    else:
        _enc_e5m2_slice(x, out, inv)


@_jit()
def _dec_e4m3_slice(codes, scale, out):
    for i in range(codes.size):
        out[i] = _code_value(_I(codes[i]), _E4M3, _E4M3_SUB, _I(0x80), _E4M3_INF, _E4M3_NAN) * scale


@_jit()
def _dec_e4m3_add_slice(codes, scale, out):
    for i in range(codes.size):
        out[i] = out[i] + _code_value(_I(codes[i]), _E4M3, _E4M3_SUB, _I(0x80), _E4M3_INF, _E4M3_NAN) * scale


@_jit()
def _dec_e5m2_slice(codes, scale, out):
    for i in range(codes.size):
        out[i] = _code_value(_I(codes[i]), _E5M2, _E5M2_SUB, _I(0x80), _E5M2_INF, _E5M2_NAN) * scale


@_jit()
def _dec_e5m2_add_slice(codes, scale, out):
    for i in range(codes.size):
        out[i] = out[i] + _code_value(_I(codes[i]), _E5M2, _E5M2_SUB, _I(0x80), _E5M2_INF, _E5M2_NAN) * scale


@_jit()
def _dec8_fast_slice(codes, scale, out, add, f):
    if f == _FAST_E4M3:
        if add:
            _dec_e4m3_add_slice(codes, scale, out)
        else:
            _dec_e4m3_slice(codes, scale, out)
    elif add:
        _dec_e5m2_add_slice(codes, scale, out)
    else:
        _dec_e5m2_slice(codes, scale, out)


@_jit()
def _enc_bf16_slice(x, out16):
    for i in range(x.size):
        out16[i] = np.uint16(_code_rne32(x[i], _BF16, False))


@_jit()
def _enc_fp16_slice(x, out16):
    for i in range(x.size):
        out16[i] = np.uint16(_code_rne32(x[i], _FP16, False))


@njit(inline="always")
def _bf16_value(code):
    v = _flt(_I(_I(code) << _I(16)))  # a bf16 code is the top half of its float32
    return np.float32(np.nan) if v != v else v  # the table's one NaN, whatever the payload


@_jit()
def _dec_bf16_slice(buf16, out):
    for i in range(out.size):
        out[i] = _bf16_value(buf16[i])


@_jit()
def _dec_bf16_add_slice(buf16, out):
    for i in range(out.size):
        out[i] = out[i] + _bf16_value(buf16[i])


@_jit()
def _dec_fp16_slice(buf16, out):
    for i in range(out.size):
        out[i] = _code_value(_I(buf16[i]), _FP16, _FP16_SUB, _I(0x8000), _FP16_INF, _FP16_NAN)


@_jit()
def _dec_fp16_add_slice(buf16, out):
    for i in range(out.size):
        out[i] = out[i] + _code_value(_I(buf16[i]), _FP16, _FP16_SUB, _I(0x8000), _FP16_INF, _FP16_NAN)


@_jit()
def _dec16_fast_slice(buf16, out, add, f):
    if f == _FAST_BF16:
        if add:
            _dec_bf16_add_slice(buf16, out)
        else:
            _dec_bf16_slice(buf16, out)
    elif add:
        _dec_fp16_add_slice(buf16, out)
    else:
        _dec_fp16_slice(buf16, out)


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


@_jit()
def _amax_serial(x):
    return _flt(_amax_slice(x.view(np.int32))[0])


@_Driver
def _fp8_tensor(x, out, inv, p, sr, stream, f):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        if sr:
            _enc_sr_slice(x[lo:hi], out[lo:hi], inv, p, stream, lo)
        elif f != _GENERIC:
            _enc8_fast_slice(x[lo:hi], out[lo:hi], inv, f)
        else:
            _enc_rne_slice(x[lo:hi], out[lo:hi], inv, p)


@_Driver
def _fp8_blocks(x, out, scales, block, p, max_finite, floor, sr, stream, f):
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
            elif f != _GENERIC:
                _enc8_fast_slice(x[lo:hi], out[lo:hi], inv, f)
            else:
                _enc_rne_slice(x[lo:hi], out[lo:hi], inv, p)


@_Driver
def _dec_blocks(codes, scales, block, lut, out, add):
    n = out.size
    nb = scales.size
    per = max(1, _CHUNK // block)
    ntask = (nb + per - 1) // per
    for t in prange(ntask):
        if add:
            # Decode a tile into L1-resident scratch, then add it: the table lookups are
            # scalar either way, and the separate add loop vectorises (one fused loop does not).
            tmp = np.empty(_ADD_TILE, np.float32)
            for lo in range(t * per * block, min((t * per + per) * block, n), _ADD_TILE):
                hi = min(lo + _ADD_TILE, n, (t * per + per) * block)
                _dec_range(codes, scales, block, lut, lo, hi, tmp)
                _add_into(out[lo:hi], tmp[: hi - lo])
        else:
            for b in range(t * per, min(t * per + per, nb)):
                lo = b * block
                hi = min(lo + block, n)
                _dec_slice(codes[lo:hi], lut, scales[b], out[lo:hi])


@_Driver
def _enc16(x, out, p):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _enc16_slice(x[lo:hi], out[2 * lo : 2 * hi], p)


@_Driver
def _dec16(buf, lut, out, add):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        if add:
            tmp = np.empty(_ADD_TILE, np.float32)
            _dec16_add_slice(buf[2 * lo : 2 * hi], lut, out[lo:hi], tmp)
        else:
            _dec16_slice(buf[2 * lo : 2 * hi], lut, out[lo:hi])


@_Driver
def _dec8_fast(codes, scales, block, out, add, f):
    """Decode (or add) 8-bit codes times per-block scales, in fixed chunks whatever the block size."""
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        i = c * _CHUNK
        hi = min(i + _CHUNK, n)
        while i < hi:
            b = i // block
            j = min((b + 1) * block, hi)
            _dec8_fast_slice(codes[i:j], scales[b], out[i:j], add, f)
            i = j


@_Driver
def _enc16_fast(x, out16, f):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        if f == _FAST_BF16:
            _enc_bf16_slice(x[lo:hi], out16[lo:hi])
        else:
            _enc_fp16_slice(x[lo:hi], out16[lo:hi])


@_Driver
def _dec16_fast(buf16, out, add, f):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _dec16_fast_slice(buf16[lo:hi], out[lo:hi], add, f)


# ---- NVFP4: generic path (stochastic rounding, other formats) -----------------


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
        packed[codes.size // 2] = codes[codes.size - 1] & np.uint8(0xF)


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


@_Driver
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


@_Driver
def _nvfp4_decode(packed, scodes, sg, lut8, lut4, out):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _nvfp4_dec_slice(packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, lut8, lut4, out[lo:hi])


# ---- NVFP4: round-to-nearest path for E4M3 scales and E2M1 codes --------------
#
# Per chunk, three vectorised passes over whole 16-element blocks:
#   1. max |x| bits of every 4 elements (a stride-4 maximum vectorises with shuffles);
#   2. per block: the maximum of its 4 partial maxima, the E4M3 scale code and 1/scale;
#   3. per block: 16 E2M1 codes of x * (1/scale), one AVX-512 vector, then 2 codes a byte.
# Decoding expands the nibbles to one byte each, then scales whole blocks.


@njit(inline="always")
def _e2m1_value(code):
    """Return the float32 value of an E2M1 code (0..15), the same as its table entry."""
    mag = _I(code & _I(7))
    v = _value(mag, _E2M1, _E2M1_SUB)
    return -v if code >= _I(8) else v


@_jit()
def _absmax4(u, h):
    """Write max |x| bits of each 4 consecutive elements of the int32 view ``u`` into ``h``."""
    m = _I(_ABS_MASK)
    for j in range(h.size):
        i = _U(j) * _U(4)
        h[_U(j)] = max(max(_I(u[i] & m), _I(u[i + _U(1)] & m)), max(_I(u[i + _U(2)] & m), _I(u[i + _U(3)] & m)))


@_jit()
def _nvfp4_scales_rne(h, scodes, inv, sg):
    """Turn 4 partial maxima per block into E4M3 scale codes and 1/scale (as ``_nvfp4_scales``)."""
    nan_code = _I(_E4M3[6])
    for b in range(inv.size):
        i = _U(b) * _U(4)
        m = max(max(h[i], h[i + _U(1)]), max(h[i + _U(2)], h[i + _U(3)]))
        sb = (_flt(m) / np.float32(6.0)) / sg
        code = _code_rne32(sb, _E4M3, _E4M3_INF_IS_MAX)
        # Guard: a scale that underflows E4M3 would zero a non-zero block.
        code = _I(1) if (code == _I(0)) & (m > _I(0)) else code
        # E2M1 has no NaN/Inf: a non-finite block gets the E4M3 NaN scale instead.
        code = nan_code if m >= _I(_INF_BITS) else code
        # The scale's value, computed rather than read from lut8 (a gather): the same float32,
        # and NaN for the NaN code, whose 1/scale becomes 0 below as in _nvfp4_scales.
        mag = _I(code & _I(0x7F))
        v = np.float32(np.nan) if mag == nan_code else _value(mag, _E4M3, _E4M3_SUB)
        d = (-v if code >= _I(0x80) else v) * sg
        scodes[_U(b)] = np.uint8(code)
        inv[_U(b)] = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)


@_jit()
def _e2m1_codes(x, codes, inv):
    """Write one E2M1 code per byte for x * inv[block]."""
    for b in range(inv.size):
        base = _U(b) * _U(16)
        s = inv[_U(b)]
        for k in range(16):
            i = base + _U(k)
            codes[i] = np.uint8(_code_rne32(x[i] * s, _E2M1, _E2M1_INF_IS_MAX))


@_jit()
def _nvfp4_rne_blocks(x, packed, scodes, sg, h, inv, codes):
    """Encode whole blocks (``x.size == 16 * scodes.size``) using the scratch ``h``, ``inv``, ``codes``."""
    nb = scodes.size
    _absmax4(x.view(np.int32), h[: nb * 4])
    _nvfp4_scales_rne(h[: nb * 4], scodes, inv[:nb], sg)
    _e2m1_codes(x, codes[: nb * 16], inv[:nb])
    _pack_nibbles(codes[: nb * 16], packed)


@_jit()
def _nvfp4_rne_chunk(x, packed, scodes, sg, h, inv, codes):
    n = x.size
    nfull = n // 16
    _nvfp4_rne_blocks(x[: nfull * 16], packed[: nfull * 8], scodes[:nfull], sg, h, inv, codes)
    if nfull < scodes.size:  # a partial last block: zeros encode as +0 and leave the block maximum alone
        t = np.zeros(16, np.float32)
        t[: n - nfull * 16] = x[nfull * 16 :]
        tp = np.empty(8, np.uint8)
        _nvfp4_rne_blocks(t, tp, scodes[nfull:], sg, h, inv, codes)
        packed[nfull * 8 :] = tp[: packed.size - nfull * 8]


@_jit()
def _nvfp4_rne_serial(x, packed, scodes, sg):
    n = x.size
    h = np.empty(_CHUNK // 4, np.int32)
    inv = np.empty(_CHUNK // 16, np.float32)
    codes = np.empty(_CHUNK, np.uint8)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        _nvfp4_rne_chunk(
            x[lo:hi], packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, h, inv, codes
        )


@_jit(parallel=True)
def _nvfp4_rne_parallel(x, packed, scodes, sg):
    n = x.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        h = np.empty(_CHUNK // 4, np.int32)
        inv = np.empty(_CHUNK // 16, np.float32)
        codes = np.empty(_CHUNK, np.uint8)
        _nvfp4_rne_chunk(
            x[lo:hi], packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, h, inv, codes
        )


@_jit()
def _unpack_nibbles(packed, codes):
    """Write codes[2j] = low nibble, codes[2j + 1] = high nibble of packed[j]."""
    pairs = codes.view(np.uint16)
    for j in range(packed.size):
        v = np.uint16(packed[_U(j)])
        # uint16 view of two bytes is little-endian on every platform numba supports.
        pairs[_U(j)] = np.uint16((v & np.uint16(0xF)) | ((v & np.uint16(0xF0)) << np.uint16(4)))


@_jit()
def _e2m1_dec(codes, d, out):
    for b in range(d.size):
        s = d[_U(b)]
        for k in range(16):
            i = _U(b) * _U(16) + _U(k)
            out[i] = _e2m1_value(_I(codes[i])) * s


@_jit()
def _e2m1_dec_add(codes, d, out):
    for b in range(d.size):
        s = d[_U(b)]
        for k in range(16):
            i = _U(b) * _U(16) + _U(k)
            out[i] = out[i] + _e2m1_value(_I(codes[i])) * s


@_jit()
def _nvfp4_dec_chunk(packed, scodes, sg, lut8, out, add, codes, d):
    n = out.size
    nb = scodes.size
    for b in range(nb):
        d[b] = lut8[scodes[b]] * sg
    _unpack_nibbles(packed, codes[: 2 * packed.size])
    nfull = n // 16
    if add:
        _e2m1_dec_add(codes[: nfull * 16], d[:nfull], out[: nfull * 16])
    else:
        _e2m1_dec(codes[: nfull * 16], d[:nfull], out[: nfull * 16])
    for i in range(nfull * 16, n):  # a partial last block
        v = _e2m1_value(_I(codes[i])) * d[nfull]
        out[i] = out[i] + v if add else v


@_jit()
def _nvfp4_dec_serial(packed, scodes, sg, lut8, out, add):
    n = out.size
    codes = np.empty(_CHUNK, np.uint8)
    d = np.empty(_CHUNK // 16, np.float32)
    for lo in range(0, n, _CHUNK):
        hi = min(lo + _CHUNK, n)
        _nvfp4_dec_chunk(
            packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, lut8, out[lo:hi], add, codes, d
        )


@_jit(parallel=True)
def _nvfp4_dec_parallel(packed, scodes, sg, lut8, out, add):
    n = out.size
    nch = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nch):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        codes = np.empty(_CHUNK, np.uint8)
        d = np.empty(_CHUNK // 16, np.float32)
        _nvfp4_dec_chunk(
            packed[lo // 2 : (hi + 1) // 2], scodes[lo // 16 : (hi + 15) // 16], sg, lut8, out[lo:hi], add, codes, d
        )


def _same_table(table: np.ndarray, reference: np.ndarray) -> bool:
    return table is reference or (table.shape == reference.shape and np.array_equal(table, reference, equal_nan=True))


def _nvfp4_fast(p8: tuple, p4: tuple, lut8: np.ndarray) -> bool:
    """Return True when the NVFP4 formats are E4M3 scales and E2M1 codes (the RNE fast path's constants)."""
    return _typed(tuple(p8)) == _E4M3 and _typed(tuple(p4)) == _E2M1 and _same_table(lut8, _E4M3_LUT)


def _nvfp4_decode_into(packed, scodes, sg, lut8, lut4, out, add) -> None:
    sg = np.float32(sg)
    if _same_table(lut4, _E2M1_LUT):
        driver = _nvfp4_dec_parallel if _parallel(out.size) else _nvfp4_dec_serial
        driver(packed, scodes, sg, lut8, out, add)
        return
    if add:
        part = np.empty_like(out)
        _nvfp4_decode(packed, scodes, sg, lut8, lut4, part)
        np.add(out, part, out=out)
    else:
        _nvfp4_decode(packed, scodes, sg, lut8, lut4, out)


@_jit()
def _residual_slice(y, d, r):
    for i in range(r.size):
        v = y[i] - d[i]
        r[i] = v if abs(v) < np.float32(np.inf) else np.float32(0.0)  # NaN and ±Inf fail the test


@_Driver
def _residual(y, d, r):
    n = r.size
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _residual_slice(y[lo:hi], d[lo:hi], r[lo:hi])


@_jit()
def _add_amax_slice(x, r, y):
    """Write y = x + r; return the largest finite |y| as int32 bits (as ``_amax_slice``'s first)."""
    m = np.int32(0)
    for i in range(y.size):
        v = x[i] + r[i]
        y[i] = v
        a = _I(_bits(v) & _I(_ABS_MASK))
        m = max(m, a if a < _I(_INF_BITS) else _I(0))
    return m


@_Driver
def _add_amax(x, r, y, res):
    n = y.size
    for c in prange(res.size):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        res[c] = _add_amax_slice(x[lo:hi], r[lo:hi], y[lo:hi])


@_jit()
def _ef_e4m3_slice(y, codes, r, scale):
    for i in range(y.size):
        v = y[i] - _code_value(_I(codes[i]), _E4M3, _E4M3_SUB, _I(0x80), _E4M3_INF, _E4M3_NAN) * scale
        r[i] = v if abs(v) < np.float32(np.inf) else np.float32(0.0)


@_jit()
def _ef_e5m2_slice(y, codes, r, scale):
    for i in range(y.size):
        v = y[i] - _code_value(_I(codes[i]), _E5M2, _E5M2_SUB, _I(0x80), _E5M2_INF, _E5M2_NAN) * scale
        r[i] = v if abs(v) < np.float32(np.inf) else np.float32(0.0)


@_Driver
def _fp8_feedback(y, out, r, inv, scale, f):
    # Per chunk while it is in cache: the codes (the encoder's loop), then one loop for
    # y - decoded value, the new residual (two simple loops vectorise; one fused loop did not).
    n = y.size
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        hi = min(lo + _CHUNK, n)
        _enc8_fast_slice(y[lo:hi], out[lo:hi], inv, f)
        if f == _FAST_E4M3:
            _ef_e4m3_slice(y[lo:hi], out[lo:hi], r[lo:hi], scale)
        else:
            _ef_e5m2_slice(y[lo:hi], out[lo:hi], r[lo:hi], scale)


# ---- tasks of whole blocks (MX, integer and sign codecs) --------------------------


@njit(inline="always")
def _block_task(t, per, block, n, nb):
    """Return (first element, end element, first block, end block) of task ``t`` of ``per`` blocks."""
    return t * per * block, min((t + 1) * per * block, n), t * per, min((t + 1) * per, nb)


# ---- MX (OCP): 32-element blocks with E8M0 power-of-two scales ------------------
#
# Per block: the largest |x| as bits (non-finite included); its float32 exponent field is
# floor(log2 amax) (-127 for zero and float32 subnormals); the scale exponent is that minus the
# element format's emax, clamped to [-127, 126] so 2**-e stays a normal float32. A block holding
# NaN or Inf gets the E8M0 NaN code. Elements are x * 2**-e (exact: a power of two), rounded and
# saturated by the same code arithmetic as FP8. Round to nearest (the default) runs the NVFP4
# fast path's shape: a stride-4 maximum, the scales of whole blocks, then each block's codes with
# its format's constants compiled in; stochastic rounding runs the generic code kernels.
# Chunks are a multiple of 32 elements, so no block straddles two.

_MX_BLOCK = 32
_MX_FAST = {_E4M3: _FAST_E4M3, _E5M2: _FAST_E5M2, _E2M1: 5}
"""The element formats with a compiled-in round-to-nearest path (5: E2M1)."""


@njit(inline="always")
def _mx_exponent(m, emax):
    """Return the scale exponent e of a block whose largest |x| has the bits ``m``."""
    return _I(min(max(_I(_I(m >> _I(23)) - _I(127)) - emax, _I(-127)), _I(126)))


@_jit()
def _mx_scales(u, scodes, inv, emax):
    """Write each block's E8M0 scale code and 1/scale (2**-e) from the int32 view ``u`` (any length)."""
    n = u.size
    for b in range(scodes.size):
        lo = b * _MX_BLOCK
        m = np.int32(0)
        for i in range(lo, min(lo + _MX_BLOCK, n)):
            m = max(m, u[i] & np.int32(_ABS_MASK))
        e = _mx_exponent(m, emax)
        scodes[b] = np.uint8(255) if m >= np.int32(_INF_BITS) else np.uint8(e + 127)
        inv[b] = _flt(_I(_I(127) - e) << _I(23))


@_jit()
def _mx_scales_whole(h, scodes, inv, emax):
    """As :func:`_mx_scales` for whole blocks, from 8 partial maxima (``_absmax4``) per block."""
    for b in range(scodes.size):
        i = _U(b) * _U(8)
        m = max(max(max(h[i], h[i + _U(1)]), max(h[i + _U(2)], h[i + _U(3)])),
                max(max(h[i + _U(4)], h[i + _U(5)]), max(h[i + _U(6)], h[i + _U(7)])))
        e = _mx_exponent(m, emax)
        scodes[_U(b)] = np.uint8(255) if m >= _I(_INF_BITS) else np.uint8(e + _I(127))
        inv[_U(b)] = _flt(_I(_I(127) - e) << _I(23))


@_jit()
def _mx_codes(x, codes, inv, p, sr, stream, start):
    """Write one code per byte of x * inv[block], RNE or stochastic (global index ``start + i``)."""
    for b in range(inv.size):
        lo = b * _MX_BLOCK
        hi = min(lo + _MX_BLOCK, x.size)
        if sr:
            _enc_sr_slice(x[lo:hi], codes[lo:hi], inv[b], p, stream, start + lo)
        else:
            _enc_rne_slice(x[lo:hi], codes[lo:hi], inv[b], p)


@njit(inline="always")
def _mx_code(y, f):
    if f == _FAST_E4M3:
        return _code_rne32(y, _E4M3, _E4M3_INF_IS_MAX)
    if f == _FAST_E5M2:
        return _code_rne32(y, _E5M2, False)
    return _code_rne32(y, _E2M1, _E2M1_INF_IS_MAX)


@_jit()
def _mx_codes_whole(x, codes, inv, f):
    """Write the codes of whole blocks, the element format ``f`` compiled in (the branch is loop-invariant)."""
    for b in range(inv.size):
        s = inv[_U(b)]
        for k in range(_MX_BLOCK):
            i = _U(b) * _U(_MX_BLOCK) + _U(k)
            codes[i] = np.uint8(_mx_code(x[i] * s, f))


@_jit()
def _mx_chunk(x, out, scodes, p, emax, pack, sr, stream, start, f):
    n = x.size
    nb = scodes.size
    inv = np.empty(nb, np.float32)
    if f == _GENERIC or sr:
        _mx_scales(x.view(np.int32), scodes, inv, emax)
        codes = np.empty(n, np.uint8) if pack else out
        _mx_codes(x, codes, inv, p, sr, stream, start)
    else:
        xs = x
        if n % _MX_BLOCK:  # a partial last block (only in the last chunk): zero padding changes no maximum
            xs = np.zeros(nb * _MX_BLOCK, np.float32)
            xs[:n] = x
        h = np.empty(nb * 8, np.int32)
        _absmax4(xs.view(np.int32), h)
        _mx_scales_whole(h, scodes, inv, emax)
        codes = np.empty(nb * _MX_BLOCK, np.uint8) if pack or n % _MX_BLOCK else out
        _mx_codes_whole(xs, codes, inv, f)
        if not pack and n % _MX_BLOCK:
            out[:] = codes[:n]
    if pack:
        _pack_nibbles(codes[:n], out)


@_Driver
def _mx_encode(x, out, scodes, p, emax, pack, sr, stream, f):
    n = x.size
    per = _CHUNK // _MX_BLOCK  # tasks of _CHUNK elements
    for t in prange((scodes.size + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, _MX_BLOCK, n, scodes.size)
        codes = out[lo // 2 : (hi + 1) // 2] if pack else out[lo:hi]
        _mx_chunk(x[lo:hi], codes, scodes[b0:b1], p, emax, pack, sr, stream, lo, f)


@_jit()
def _mx_dec_generic(out, codes, d, lut_e, add):
    n = out.size
    for b in range(d.size):
        s = d[b]
        for i in range(b * _MX_BLOCK, min(b * _MX_BLOCK + _MX_BLOCK, n)):
            v = lut_e[codes[i]] * s
            out[i] = out[i] + v if add else v


@njit(inline="always")
def _mx_value(code, f):
    if f == _FAST_E4M3:
        return _code_value(code, _E4M3, _E4M3_SUB, _I(0x80), _E4M3_INF, _E4M3_NAN)
    if f == _FAST_E5M2:
        return _code_value(code, _E5M2, _E5M2_SUB, _I(0x80), _E5M2_INF, _E5M2_NAN)
    return _e2m1_value(code)


@_jit()
def _mx_dec_whole(out, codes, d, f, add):
    """Decode whole blocks (``add``: add to ``out``); ``f`` and ``add`` are loop-invariant branches."""
    for b in range(d.size):
        s = d[_U(b)]
        for k in range(_MX_BLOCK):
            i = _U(b) * _U(_MX_BLOCK) + _U(k)
            v = _mx_value(_I(codes[i]), f) * s
            out[i] = out[i] + v if add else v


@_jit()
def _mx_dec_chunk(out, codes, scodes, lut_s, lut_e, pack, add, f):
    n = out.size
    d = np.empty(scodes.size, np.float32)
    for b in range(scodes.size):
        d[b] = lut_s[scodes[b]]
    c = codes
    if pack:
        c = np.empty(2 * codes.size, np.uint8)
        _unpack_nibbles(codes, c)
    if f == _GENERIC:
        _mx_dec_generic(out, c, d, lut_e, add)
        return
    nfull = n // _MX_BLOCK
    _mx_dec_whole(out[: nfull * _MX_BLOCK], c, d[:nfull], f, add)
    if nfull < d.size:  # a partial last block
        _mx_dec_generic(out[nfull * _MX_BLOCK :], c[nfull * _MX_BLOCK :], d[nfull:], lut_e, add)


@_Driver
def _mx_decode(out, codes, scodes, lut_s, lut_e, pack, add, f):
    n = out.size
    per = _CHUNK // _MX_BLOCK
    for t in prange((scodes.size + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, _MX_BLOCK, n, scodes.size)
        c = codes[lo // 2 : (hi + 1) // 2] if pack else codes[lo:hi]
        _mx_dec_chunk(out[lo:hi], c, scodes[b0:b1], lut_s, lut_e, pack, add, f)


# ---- symmetric integers (INT8, INT4) with FP32 block scales --------------------
#
# Per block: scale = max(amax / qmax, 2**-126) over all |x| (a non-finite block gets a NaN
# scale and zero codes); code = clamp(round(x * (1 / scale)), -qmax, qmax), rounded to nearest
# even (np.rint) or stochastically (up with probability equal to the fraction, from 32 random
# bits compared in float64, where both sides are exact). INT4 codes are packed two a byte.


@_jit()
def _int_chunk(x, codes, scales, block, qmax, sr, stream, start):
    """Encode one task's blocks, one code a byte: scale, then codes, block by block.

    Unsigned indices: numba then skips negative-index wraparound and LLVM vectorises the
    loops (signed indices from the block's start ran at a third of the speed).
    """
    n = x.size
    q = np.float32(qmax)
    u = x.view(np.int32)
    for b in range(scales.size):
        base = _U(b) * _U(block)
        cnt = min(block, n - b * block)
        m = _I(0)
        for k in range(cnt):
            m = max(m, _I(u[base + _U(k)] & _I(_ABS_MASK)))
        finite = m < _I(_INF_BITS)
        scale = max(_flt(m) / q, np.float32(2.0**-126)) if finite else np.float32(np.nan)
        scales[b] = scale
        inv = np.float32(1.0) / scale if finite else np.float32(0.0)
        if sr:
            for k in range(cnt):
                i = base + _U(k)
                y = x[i] * inv
                y = np.float32(0.0) if y != y else min(max(y, -q), q)
                f = np.floor(y)
                up = np.float64(y - f) * 4294967296.0 > np.float64(_rand32(start + b * block + k, stream))
                codes[i] = np.uint8(np.int32(f + np.float32(1.0) if up else f) & 0xFF)
        else:
            for k in range(cnt):
                i = base + _U(k)
                y = x[i] * inv
                y = np.float32(0.0) if y != y else min(max(y, -q), q)
                codes[i] = np.uint8(np.int32(np.rint(y)) & 0xFF)


@_Driver
def _int_encode(x, codes, scales, block, qmax, pack, sr, stream):
    n = x.size
    nb = scales.size
    per = max(1, _CHUNK // block)  # blocks per task
    for t in prange((nb + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, block, n, nb)  # lo is even for INT4: its blocks are even
        s = scales[b0:b1]
        if pack:  # one code a byte first, then two a byte
            tmp = np.empty(hi - lo, np.uint8)
            _int_chunk(x[lo:hi], tmp, s, block, qmax, sr, stream, lo)
            _pack_nibbles(tmp, codes[lo // 2 : (hi + 1) // 2])
        else:
            _int_chunk(x[lo:hi], codes[lo:hi], s, block, qmax, sr, stream, lo)


@_jit()
def _unpack_int4(packed, c8):
    """Write the signed 4-bit codes of ``packed`` (low nibble first) into the int8 array ``c8``."""
    for j in range(c8.size // 2):
        v = np.int32(packed[j])
        lo4 = v & 15
        hi4 = (v >> 4) & 15
        c8[2 * j] = np.int8(lo4 - ((lo4 & 8) << 1))
        c8[2 * j + 1] = np.int8(hi4 - ((hi4 & 8) << 1))
    if c8.size % 2:
        v = np.int32(packed[c8.size // 2]) & 15
        c8[c8.size - 1] = np.int8(v - ((v & 8) << 1))


@_jit()
def _int_dec_chunk(out, c8, scales, block, add):
    n = out.size
    for b in range(scales.size):
        s = scales[b]
        base = _U(b) * _U(block)
        cnt = min(block, n - b * block)
        if add:
            for k in range(cnt):
                i = base + _U(k)
                out[i] = out[i] + np.float32(c8[i]) * s
        else:
            for k in range(cnt):
                i = base + _U(k)
                out[i] = np.float32(c8[i]) * s


@_Driver
def _int_decode(out, codes, scales, block, pack, add):
    n = out.size
    nb = scales.size
    per = max(1, _CHUNK // block)
    for t in prange((nb + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, block, n, nb)
        s = scales[b0:b1]
        if pack:
            c8 = np.empty(hi - lo, np.int8)
            _unpack_int4(codes[lo // 2 : (hi + 1) // 2], c8)
            _int_dec_chunk(out[lo:hi], c8, s, block, add)
        else:
            _int_dec_chunk(out[lo:hi], codes[lo:hi].view(np.int8), s, block, add)


# ---- sign (1 bit per element) with a mean-|x| scale per block ----------------------
#
# Per block: scale = float32(sum |x| / count), the sum in float64 (exact for blocks whose
# values span fewer than ~22 binades; beyond that the torch kernels' summation order may round
# the scale differently in the last bit); a non-finite block gets a NaN scale. Bit k of byte j
# is 1 when element 8j + k is negative. Blocks are whole bytes (a multiple of 8 elements).


@_jit()
def _sign_chunk(x, bits, scales, block):
    n = x.size
    for b in range(scales.size):
        base = _U(b) * _U(block)
        cnt = min(block, n - b * block)
        acc = 0.0
        for k in range(cnt):
            acc += abs(np.float64(x[base + _U(k)]))
        scales[b] = np.float32(acc / cnt) if acc < np.inf else np.float32(np.nan)
    zero = np.float32(0.0)
    for j in range(n // 8):  # whole bytes: eight comparisons, unrolled
        i = _U(j) * _U(8)
        bits[_U(j)] = np.uint8(
            (x[i] < zero) | ((x[i + _U(1)] < zero) << 1) | ((x[i + _U(2)] < zero) << 2)
            | ((x[i + _U(3)] < zero) << 3) | ((x[i + _U(4)] < zero) << 4) | ((x[i + _U(5)] < zero) << 5)
            | ((x[i + _U(6)] < zero) << 6) | ((x[i + _U(7)] < zero) << 7))
    if n % 8:  # a partial last byte (only at the tensor's end)
        v = 0
        for k in range(n % 8):
            v |= (1 << k) if x[n - n % 8 + k] < zero else 0
        bits[n // 8] = np.uint8(v)


@_Driver
def _sign_encode(x, bits, scales, block):
    n = x.size
    nb = scales.size
    per = max(1, _CHUNK // block)
    for t in prange((nb + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, block, n, nb)  # lo is a multiple of 8: blocks are whole bytes
        _sign_chunk(x[lo:hi], bits[lo // 8 : (hi + 7) // 8], scales[b0:b1], block)


@_jit()
def _sign_dec_chunk(out, bits, scales, block, add):
    n = out.size
    for b in range(scales.size):
        s = scales[b]
        base = _U(b) * _U(block)  # a multiple of 8: the block starts on a byte
        cnt = min(block, n - b * block)
        for j in range((cnt + 7) // 8):
            byte = np.int32(bits[(base >> _U(3)) + _U(j)])
            for k in range(min(8, cnt - 8 * j)):
                i = base + _U(8 * j + k)
                v = -s if (byte >> k) & 1 else s
                v = s if s != s else v  # a NaN scale decodes to itself, sign bit included, as the other decoders'
                out[i] = out[i] + v if add else v


@_Driver
def _sign_decode(out, bits, scales, block, add):
    n = out.size
    nb = scales.size
    per = max(1, _CHUNK // block)
    for t in prange((nb + per - 1) // per):
        lo, hi, b0, b1 = _block_task(t, per, block, n, nb)
        _sign_dec_chunk(out[lo:hi], bits[lo // 8 : (hi + 7) // 8], scales[b0:b1], block, add)


# ---- backend API (same names and signatures as _torch_kernels) ----------------


def add_into(a, b, out) -> None:
    """Write ``a + b`` into ``out`` (float32 vectors of one length; ``out`` may be ``a`` or ``b``)."""
    np.add(a, b, out=out)


def feedback_residual(y, decoded, out) -> None:
    """Write ``y - decoded`` into ``out``, non-finite differences as 0 (error feedback's residual)."""
    _residual(y, decoded, out)


def amax(x: np.ndarray) -> np.float32:
    """Return the largest finite |x| of a flat float32 array (0.0 if there is none)."""
    return np.float32(_amax(x) if _parallel(x.size) else _amax_serial(x))


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
    inv = np.float32(1.0) / np.float32(scale)
    p = _typed(params)
    _fp8_tensor(x, out, inv, p, sr, stream, _fast_id(p))


def feedback_encode_scaled(x, residual, y, out, params, max_finite, floor):
    """Error feedback around per-tensor FP8 in two passes; return the scale, or None where not fused.

    Writes ``y = x + residual``, the codes of ``y`` (scale from its largest finite
    magnitude, as :func:`tensor_scale` and :func:`encode_scaled`) into ``out``, and
    ``residual = y - decoded`` (non-finite as 0): the bits of add_into, amax,
    encode_scaled, decode_blocks and feedback_residual in turn, without their five
    passes and calls. Only the E4M3/E5M2 fast kernels are fused (else None, nothing written).
    """
    f = _fast_id(_typed(params))
    if f not in (_FAST_E4M3, _FAST_E5M2):
        return None
    res = np.zeros(max(1, (y.size + _CHUNK - 1) // _CHUNK), np.int32)
    _add_amax(x, residual, y, res)
    scale = tensor_scale(res.max().view(np.float32), max_finite, floor)
    _fp8_feedback(y, out, residual, np.float32(1.0) / np.float32(scale), np.float32(scale), f)
    return scale


def encode_blocks(x, out, scales, block, params, max_finite, floor, *, sr=False, stream=0) -> None:
    """Write per-block scales (max(block amax / max_finite, floor)) and 8-bit codes."""
    p = _typed(params)
    _fp8_blocks(x, out, scales, block, p, np.float32(max_finite), np.float32(floor), sr, stream, _fast_id(p))


def _table_id(lut: np.ndarray) -> int:
    """Return the fast-path id of a decoding table (the formats' cached tables, by identity), else generic."""
    return next((f for table, f in _FAST_TABLES if lut is table), _GENERIC)


def _halves(buf: np.ndarray) -> np.ndarray | None:
    """Return a byte buffer as little-endian uint16 codes when it can be viewed so, else None."""
    if not np.little_endian or buf.ctypes.data % 2 or buf.size % 2 or not buf.flags.c_contiguous:
        return None
    return buf.view(np.uint16)


def _decode8(codes, scales, block, lut, out, add) -> None:
    f = _table_id(lut)
    if f in (_FAST_E4M3, _FAST_E5M2):
        _dec8_fast(codes, scales, max(1, min(block, out.size)), out, add, f)
    else:
        _dec_blocks(codes, scales, max(1, block), lut, out, add)


def decode_blocks(codes, scales, block, lut, out) -> None:
    """Decode 8-bit codes times per-block scales (one scale per tensor: ``block >= n``)."""
    _decode8(codes, scales, block, lut, out, False)


def decode_blocks_add(codes, scales, block, lut, out) -> None:
    """Add the values of :func:`decode_blocks` to ``out`` in one pass (same rounding as decode, then add)."""
    _decode8(codes, scales, block, lut, out, True)


def encode16(x, out, params) -> None:
    """Write two little-endian bytes per element (fp16/bf16 codes, RNE) into ``out``."""
    p = _typed(params)
    f, halves = _fast_id(p), _halves(out)
    if f in (_FAST_BF16, _FAST_FP16) and halves is not None:
        _enc16_fast(x, halves, f)
    else:
        _enc16(x, out, p)


def _decode16(buf, lut, out, add) -> None:
    f, halves = _table_id(lut), _halves(buf)
    if f in (_FAST_BF16, _FAST_FP16) and halves is not None:
        _dec16_fast(halves, out, add, f)
    else:
        _dec16(buf, lut, out, add)


def decode16(buf, lut, out) -> None:
    """Decode little-endian 16-bit codes through a 65536-entry table into ``out``."""
    _decode16(buf, lut, out, False)


def decode16_add(buf, lut, out) -> None:
    """Add the values of :func:`decode16` to ``out`` in one pass."""
    _decode16(buf, lut, out, True)


def nvfp4_encode(x, packed, scodes, sg, p8, p4, lut8, *, sr=False, stream=0) -> None:
    """Write NVFP4 packed codes (low nibble = even element) and E4M3 block-scale codes."""
    sg = np.float32(sg)
    if not sr and _nvfp4_fast(p8, p4, lut8):
        driver = _nvfp4_rne_parallel if _parallel(x.size) else _nvfp4_rne_serial
        driver(x, packed, scodes, sg)
        return
    _nvfp4_encode(x, packed, scodes, sg, _typed(p8), _typed(p4), lut8, sr, stream)


def nvfp4_decode(packed, scodes, sg, lut8, lut4, out) -> None:
    """Decode NVFP4 packed codes with E4M3 block scales and the FP32 global scale."""
    _nvfp4_decode_into(packed, scodes, sg, lut8, lut4, out, False)


def nvfp4_decode_add(packed, scodes, sg, lut8, lut4, out) -> None:
    """Add the values of :func:`nvfp4_decode` to ``out`` in one pass (same rounding as decode, then add)."""
    _nvfp4_decode_into(packed, scodes, sg, lut8, lut4, out, True)


def mx_encode(x, out, scodes, params, emax, pack, *, sr=False, stream=0) -> None:
    """Write MX element codes (``pack``: two 4-bit codes a byte, low nibble = even element) and E8M0 scale codes."""
    p = _typed(params)
    _mx_encode(x, out, scodes, p, np.int32(emax), bool(pack), bool(sr), stream, _MX_FAST.get(p, _GENERIC))


def _mx_table_id(lut: np.ndarray) -> int:
    return next((f for table, f in ((_E4M3_LUT, _FAST_E4M3), (_E5M2_LUT, _FAST_E5M2), (_E2M1_LUT, 5))
                 if lut is table), _GENERIC)


def mx_decode(codes, scodes, lut_s, lut_e, pack, out) -> None:
    """Decode MX element codes times their E8M0 block scales into ``out``."""
    _mx_decode(out, codes, scodes, lut_s, lut_e, bool(pack), False, _mx_table_id(lut_e))


def mx_decode_add(codes, scodes, lut_s, lut_e, pack, out) -> None:
    """Add the values of :func:`mx_decode` to ``out`` in one pass (same rounding as decode, then add)."""
    _mx_decode(out, codes, scodes, lut_s, lut_e, bool(pack), True, _mx_table_id(lut_e))


def int_encode(x, codes, scales, block, qmax, pack, *, sr=False, stream=0) -> None:
    """Write symmetric integer codes (``pack``: INT4, two a byte, low nibble = even element; an even ``block``)
    and FP32 block scales."""
    _int_encode(x, codes, scales, int(block), np.int32(qmax), bool(pack), bool(sr), stream)


def int_decode(codes, scales, block, pack, out) -> None:
    """Decode symmetric integer codes times their FP32 block scales into ``out``."""
    _int_decode(out, codes, scales, int(block), bool(pack), False)


def int_decode_add(codes, scales, block, pack, out) -> None:
    """Add the values of :func:`int_decode` to ``out`` in one pass (same rounding as decode, then add)."""
    _int_decode(out, codes, scales, int(block), bool(pack), True)


def sign_encode(x, bits, scales, block) -> None:
    """Write sign bits (bit k of byte j: element 8j + k is negative) and mean-|x| block scales."""
    _sign_encode(x, bits, scales, int(block))


def sign_decode(bits, scales, block, out) -> None:
    """Decode sign bits times their block scales into ``out``."""
    _sign_decode(out, bits, scales, int(block), False)


def sign_decode_add(bits, scales, block, out) -> None:
    """Add the values of :func:`sign_decode` to ``out`` in one pass."""
    _sign_decode(out, bits, scales, int(block), True)
