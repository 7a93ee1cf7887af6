"""Fused kernels: decode_add, and the NVFP4 round-to-nearest path against the generic kernels.

Tier: single process, CPU. Every comparison is bit for bit (int32 views), so
NaN payloads and signed zeros count too.
"""

import numpy as np
import pytest
from numba import njit

from commwire import codecs
from commwire.codecs import Codec, _kernels, get_format

torch = pytest.importorskip("torch")

SPECS = [
    "none", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=128", "fp8-e5m2:block=7",
    "nvfp4", "nvfp4:sr,seed=3", "ef+nvfp4", "ef+fp8-e4m3", "hadamard+nvfp4", "gift+fp8-e4m3",
    "ef+hadamard:size=32,seed=1+fp8-e4m3:block=64", "mxfp8-e4m3", "mxfp4", "mxfp4:sr,seed=3", "int8",
    "int4:sr,seed=2", "int8:block=7", "sign", "ef+sign:block=8",
]
FUSED = ["fp16", "bf16", "fp8-e4m3", "fp8-e4m3:block=128", "nvfp4", "ef+nvfp4", "gift+fp8-e4m3"]
LENGTHS = [0, 1, 15, 17, 1001, 16384 + 33, 70001]


def bits(a):
    return np.asarray(a, np.float32).view(np.int32)


def data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if n > 100:
        x[7:9] = [np.nan, np.inf]  # one non-finite block
        x[40:60] = 0.0
        x[64:80] *= np.float32(1e-7)  # a block scale that underflows E4M3
    return x


# ---- decode_add -----------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_decode_add_equals_decode_then_add(spec, n):
    codec = codecs.get(spec)
    buf = codec.encode(data(n, seed=n), key="t").data
    acc = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    acc[::50] = -0.0
    if n > 5:
        acc[5] = np.nan
    want = acc + codec.decode_from(buf, n)
    got = acc.copy()
    assert codec.decode_add(buf, n, got) is got
    np.testing.assert_array_equal(bits(got), bits(want))
    assert n == 0 or not np.array_equal(bits(got), bits(acc))  # it did add something


@pytest.mark.parametrize("spec", ["fp16", "fp8-e4m3:block=128", "nvfp4", "ef+nvfp4", "hadamard+nvfp4"])
def test_decode_add_on_torch_matches_numpy(spec):
    codec = codecs.get(spec)
    n = 1037
    buf = codec.encode(data(n, seed=2)).data
    acc = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    got_np = codec.decode_add(buf, n, acc.copy())
    got_t = codec.decode_add(torch.from_numpy(buf.copy()), n, torch.from_numpy(acc.copy()))
    if "hadamard" in spec:  # matmul rounding differs between BLAS and torch
        np.testing.assert_allclose(got_t.numpy(), got_np, rtol=0, atol=1e-4)
    else:
        np.testing.assert_array_equal(bits(got_t.numpy()), bits(got_np))


@pytest.mark.parametrize("spec", FUSED)
def test_fused_codecs_override_decode_add(spec):
    # The one-pass kernels are the point of decode_add for these codecs (and stages that pass decoding through).
    assert type(codecs.get(spec))._decode_add is not Codec._decode_add


def test_decode_add_checks_its_arguments():
    codec = codecs.get("nvfp4")
    buf = codec.encode(data(100, seed=0)).data
    with pytest.raises(ValueError, match="float32 vector of 100"):
        codec.decode_add(buf, 100, np.zeros(99, np.float32))
    with pytest.raises(ValueError, match="float32 vector"):
        codec.decode_add(buf, 100, np.zeros(100, np.float64))
    with pytest.raises(ValueError, match="wire_nbytes"):
        codec.decode_add(buf[:-1], 100, np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="one kind"):
        codec.decode_add(buf, 100, torch.zeros(100))


# ---- NVFP4 round-to-nearest path == generic kernels ----------------------------------

E4M3, E2M1, E8M0 = get_format("e4m3"), get_format("e2m1"), get_format("e8m0")


def hard_inputs(n, seed):
    """Normal, heavy-tailed, ties of the E2M1 grid, zeros, non-finite and tiny values."""
    rng = np.random.default_rng(seed)
    grid = np.array([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6], np.float32)
    ties = np.resize(grid, n) * np.float32(2.0) ** rng.integers(-30, 30, n).astype(np.float32)
    yield ties * rng.choice(np.array([-1, 1], np.float32), n)
    yield np.nextafter(np.resize(grid, n), np.float32(7)).astype(np.float32)
    yield rng.standard_normal(n).astype(np.float32)
    yield rng.standard_cauchy(n).astype(np.float32)
    x = (rng.lognormal(0, 10, n) * rng.choice([-1, 1], n)).astype(np.float32)  # tiny to huge
    yield x
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.2] = 0.0
    x[rng.random(n) < 0.1] = -0.0
    x[rng.integers(0, n, 8)] = np.array([np.nan, -np.nan, np.inf, -np.inf] * 2, np.float32)
    yield x
    yield rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)  # any bit pattern


def encode_both(x, sg):
    n = x.size
    fast = (np.full(-(-n // 2), 0xAB, np.uint8), np.full(-(-n // 16), 0xCD, np.uint8))
    generic = (fast[0].copy(), fast[1].copy())
    p8, p4, lut8 = E4M3.kernel_params(), E2M1.kernel_params(), E4M3.lut()
    assert _kernels._nvfp4_fast(p8, p4, lut8)
    _kernels.nvfp4_encode(x, *fast, sg, p8, p4, lut8)
    _kernels._nvfp4_encode(x, *generic, np.float32(sg), _kernels._typed(p8), _kernels._typed(p4), lut8, False, 0)
    return fast, generic


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 33, 1000, 16384 * 2 + 17])
def test_nvfp4_rne_path_matches_generic_kernel(n, threads):
    codecs.set_threads(threads)
    try:
        for seed, x in enumerate(hard_inputs(n, seed=n)):
            amax = _kernels.amax(x)
            for sg in (_kernels.tensor_scale(amax, 6 * 448, 2.0**-117), np.float32(1e-30), np.float32(3.0)):
                (pf, sf), (pg, sg_codes) = encode_both(x, sg)
                np.testing.assert_array_equal(sf, sg_codes, err_msg=f"scales, input {seed}, sg {sg}")
                np.testing.assert_array_equal(pf, pg, err_msg=f"codes, input {seed}, sg {sg}")
                # Decoding: the fast path against the generic decode kernel.
                out_fast, out_generic = np.empty(n, np.float32), np.empty(n, np.float32)
                _kernels.nvfp4_decode(pf, sf, sg, E4M3.lut(), E2M1.lut(), out_fast)
                _kernels._nvfp4_decode(pf, sf, np.float32(sg), E4M3.lut(), E2M1.lut(), out_generic)
                np.testing.assert_array_equal(bits(out_fast), bits(out_generic))
    finally:
        codecs.set_threads(None)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("n", [1, 31, 33, 1000, 16384 * 2 + 17])
def test_mx_rne_path_matches_generic_kernel(n, element, threads):
    fmt = get_format(element)
    codec = codecs.MxCodec(element=element)
    p, pack, nc = fmt.kernel_params(), codec.packed, -(-n // 2) if codec.packed else n
    fast_id = _kernels._MX_FAST[_kernels._typed(p)]
    codecs.set_threads(threads)
    try:
        for seed, x in enumerate(hard_inputs(n, seed=n)):
            fast = (np.full(nc, 0xAB, np.uint8), np.full(-(-n // 32), 0xCD, np.uint8))
            generic = (fast[0].copy(), fast[1].copy())
            _kernels.mx_encode(x, *fast, p, codec.emax, pack)
            _kernels._mx_encode(x, *generic, _kernels._typed(p), np.int32(codec.emax), pack, False, 0, _kernels._GENERIC)
            np.testing.assert_array_equal(fast[1], generic[1], err_msg=f"scales, input {seed}")
            np.testing.assert_array_equal(fast[0], generic[0], err_msg=f"codes, input {seed}")
            for add in (False, True):
                out_fast = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
                out_generic = out_fast.copy()
                _kernels._mx_decode(out_fast, *fast, E8M0.lut(), fmt.lut(), pack, add, fast_id)
                _kernels._mx_decode(out_generic, *fast, E8M0.lut(), fmt.lut(), pack, add, _kernels._GENERIC)
                np.testing.assert_array_equal(bits(out_fast), bits(out_generic))
    finally:
        codecs.set_threads(None)


@njit
def _codes32(y, out, p, inf_is_max):
    for i in range(y.size):
        out[i] = _kernels._code_rne32(y[i], p, inf_is_max)


@njit
def _codes64(y, out, p):
    for i in range(y.size):
        out[i] = _kernels._code_rne(y[i], p)


@pytest.mark.parametrize("name", ["e2m1", "e4m3", "e5m2", "fp16", "bf16"])
def test_int32_rounding_matches_generic_rounding(name):
    # Every sign and exponent, with mantissas at and next to rounding ties (the full
    # 2**32 sweep, run once by hand, takes seconds per format and also matched).
    fmt = get_format(name)
    p = _kernels._typed(fmt.kernel_params())
    high = np.arange(1 << 9, dtype=np.uint32) << 23
    low = np.concatenate([np.arange(1 << 12, dtype=np.uint32) << 11,
                          np.array([1, 2, 3, (1 << 23) - 1], np.uint32),
                          (np.arange(1 << 12, dtype=np.uint32) << 11) + 1,
                          (np.arange(1 << 12, dtype=np.uint32) << 11) - 1 & ((1 << 23) - 1)])
    y = (high[:, None] | low[None, :]).reshape(-1).view(np.float32)
    want = np.empty(y.size, np.int64)
    _codes64(y, want, p)
    for inf_is_max in [False] + ([True] if p[7] == fmt.max_code else []):
        got = np.empty(y.size, np.int64)
        _codes32(y, got, p, inf_is_max)
        np.testing.assert_array_equal(got, want)


def test_format_values_match_tables():
    @njit
    def values(p, sub):
        out = np.empty(127, np.float32)
        for c in range(127):
            out[c] = _kernels._value(np.int32(c), p, sub)
        return out

    @njit
    def e2m1_values():
        out = np.empty(16, np.float32)
        for c in range(16):
            out[c] = _kernels._e2m1_value(np.int32(c))
        return out

    np.testing.assert_array_equal(bits(values(_kernels._E4M3, _kernels._E4M3_SUB)), bits(E4M3.lut()[:127]))
    np.testing.assert_array_equal(bits(e2m1_values()), bits(E2M1.lut()))


# ---- FP8 and 16-bit fast paths (format constants compiled in) against the generic kernels ----

@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("n", [1, 17, 16384 * 2 + 17])
def test_fp8_fast_paths_match_generic_kernels(name, n, threads):
    fmt = get_format(name)
    p = _kernels._typed(fmt.kernel_params())
    f = _kernels._fast_id(p)
    assert f != _kernels._GENERIC and _kernels._table_id(fmt.lut()) == f
    codecs.set_threads(threads)
    try:
        for x in hard_inputs(n, seed=n):
            for inv in (np.float32(1.0), np.float32(0.37), np.float32(3e4)):
                fast, generic = np.empty(n, np.uint8), np.empty(n, np.uint8)
                _kernels._fp8_tensor(x, fast, inv, p, False, 0, f)
                _kernels._fp8_tensor(x, generic, inv, p, False, 0, _kernels._GENERIC)
                np.testing.assert_array_equal(fast, generic)
            for block in (1, 16, 5000):
                y = np.nan_to_num(x * np.float32(0.37), nan=np.nan, posinf=np.inf, neginf=-np.inf)
                fast, generic = np.empty(n, np.uint8), np.empty(n, np.uint8)
                s_fast, s_generic = np.empty(-(-n // block), np.float32), np.empty(-(-n // block), np.float32)
                args = (p, np.float32(fmt.max_finite), np.float32(2.0**-126), False, 0)
                _kernels._fp8_blocks(y, fast, s_fast, block, *args, f)
                _kernels._fp8_blocks(y, generic, s_generic, block, *args, _kernels._GENERIC)
                np.testing.assert_array_equal(fast, generic)
                np.testing.assert_array_equal(bits(s_fast), bits(s_generic))
                for add in (False, True):
                    out_fast = np.random.default_rng(1).standard_normal(n).astype(np.float32)
                    out_generic = out_fast.copy()
                    _kernels._decode8(fast, s_fast, block, fmt.lut(), out_fast, add)
                    _kernels._dec_blocks(fast, s_fast, block, fmt.lut(), out_generic, add)
                    np.testing.assert_array_equal(bits(out_fast), bits(out_generic))
    finally:
        codecs.set_threads(None)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 1])
def test_16bit_fast_paths_match_generic_kernels(name, offset):
    # offset 1: a buffer at an odd address cannot be viewed as uint16, and takes the byte path.
    fmt = get_format(name)
    p = fmt.kernel_params()
    n = 16384 * 2 + 17
    for x in hard_inputs(n, seed=3):
        store = np.empty(2 * n + offset, np.uint8)
        fast, generic = store[offset:], np.empty(2 * n, np.uint8)
        assert (_kernels._halves(fast) is None) == bool(offset)
        _kernels.encode16(x, fast, p)
        _kernels._enc16(x, generic, _kernels._typed(p))
        np.testing.assert_array_equal(fast, generic)
        for add in (False, True):
            out_fast = np.random.default_rng(1).standard_normal(n).astype(np.float32)
            out_generic = out_fast.copy()
            _kernels._decode16(fast, fmt.lut(), out_fast, add)
            _kernels._dec16(generic, fmt.lut(), out_generic, add)
            np.testing.assert_array_equal(bits(out_fast), bits(out_generic))


# ---- threaded and serial drivers ------------------------------------------------

@pytest.mark.parametrize("spec", ["bf16", "fp8-e4m3", "fp8-e5m2:block=128", "nvfp4", "nvfp4:sr,seed=3",
                                  "ef+fp8-e4m3", "hadamard+nvfp4", "mxfp8-e5m2:sr", "mxfp4",
                                  "int8:block=7", "int4:sr", "sign:block=24"])
def test_threaded_and_serial_kernels_give_the_same_bits(spec):
    n = 16384 * 3 + 5  # several chunks: the threaded driver runs at 2 threads
    x = data(n, seed=11)
    wires, decoded = [], []
    for threads in (1, 2):
        codecs.set_threads(threads)
        try:
            c = codecs.get(spec)
            wire = np.asarray(c.encode(x.copy(), key="t").data).copy()
            out = c.decode_from(wire, n)
        finally:
            codecs.set_threads(None)
        wires.append(wire)
        decoded.append(out)
    np.testing.assert_array_equal(wires[0], wires[1])
    np.testing.assert_array_equal(bits(decoded[0]), bits(decoded[1]))


def test_one_codec_thread_never_starts_numbas_thread_pool():
    # An idle OpenMP worker spins: with several ranks per core it starved torch's compute
    # (LoRDO + FP8 ran 7x slower). At one codec thread every kernel must run serially.
    import subprocess
    import sys

    code = (
        "import numpy as np, numba\n"
        "from commwire import codecs\n"
        f"specs = {SPECS!r}\n"
        "x = np.random.default_rng(0).standard_normal(100003).astype(np.float32)\n"
        "for spec in specs:\n"
        "    c = codecs.get(spec)\n"
        "    w = c.encode(x.copy(), key='k').data\n"
        "    c.decode_add(w, x.size, c.decode_from(w, x.size))\n"
        "try:\n"
        "    print('pool started:', numba.threading_layer())\n"
        "except ValueError:\n"
        "    print('no pool')\n"
    )
    env = {**__import__("os").environ, "COMMWIRE_CODEC_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no pool", done.stdout


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", ["ef+fp8-e4m3", "ef+fp8-e5m2"])
def test_fused_error_feedback_matches_encode_decode_subtract(spec, threads):
    # The fused FP8 path must give the unfused path's bits (wire and residual), and the
    # residual must be (x + previous residual) - decoded, non-finite as 0, from numpy.
    n = 16384 * 2 + 17
    codecs.set_threads(threads)
    try:
        fused, plain = codecs.get(spec), codecs.get(spec)
        plain.codec._encode_feedback = lambda *args: False  # the reference: encode, decode, subtract
        previous = np.zeros(n, np.float32)
        for step, x in enumerate(hard_inputs(n, seed=5)):
            w_fused, w_plain = fused.encode(x, key="t").data, plain.encode(x, key="t").data
            np.testing.assert_array_equal(np.asarray(w_fused), np.asarray(w_plain))
            r_fused, r_plain = fused.residual("t"), plain.residual("t")
            np.testing.assert_array_equal(bits(r_fused), bits(r_plain))
            y = x + previous if step else x
            with np.errstate(invalid="ignore", over="ignore"):
                expected = y - fused.decode_from(np.asarray(w_fused), n)
            expected[~np.isfinite(expected)] = 0
            np.testing.assert_array_equal(bits(r_fused), bits(expected))
            assert np.isfinite(r_fused).all() and np.abs(r_fused).max() > 0
            previous = r_fused.copy()
    finally:
        codecs.set_threads(None)
