"""Codec behaviour: wire sizes, NVFP4 layout, errors, non-finite values, backends, state.

Tier: single process, CPU. torch tests run on CPU tensors here; the same code
paths serve CUDA tensors (and cupy through DLPack) on a GPU machine.
"""

import pickle

import ml_dtypes
import numpy as np
import pytest

from commwire import codecs
from commwire.codecs import Codec, Payload

torch = pytest.importorskip("torch")

SPECS = [
    "none", "fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=128", "fp8-e5m2:block=7",
    "fp8-e4m3:sr", "nvfp4", "nvfp4:sr,seed=3", "hadamard+nvfp4", "ef+fp8-e4m3", "ef+nvfp4",
    "ef+hadamard:size=32,seed=1+fp8-e4m3:block=64", "mxfp8-e4m3", "mxfp8-e5m2", "mxfp4", "mxfp4:sr,seed=3",
    "ef+mxfp4", "int8", "int4", "int8:block=7,sr", "ef+int4", "sign", "ef+sign:block=8",
]


def gauss(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def rel_l2(codec, x):
    y = codec.decode(codec.encode(x))
    return float(np.linalg.norm(y - x) / np.linalg.norm(x))


# ---- wire sizes -------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 127, 128, 1000, 4096])
def test_wire_nbytes_exact(n):
    assert codecs.get("none").wire_nbytes(n) == 4 * n
    assert codecs.get("fp16").wire_nbytes(n) == 2 * n
    assert codecs.get("fp8-e4m3").wire_nbytes(n) == n + 4
    assert codecs.get("fp8-e4m3:block=128").wire_nbytes(n) == n + 4 * -(-n // 128)
    assert codecs.get("nvfp4").wire_nbytes(n) == -(-n // 2) + -(-n // 16) + 4
    assert codecs.get("mxfp8-e5m2").wire_nbytes(n) == n + -(-n // 32)
    assert codecs.get("mxfp4").wire_nbytes(n) == -(-n // 2) + -(-n // 32)
    assert codecs.get("int8").wire_nbytes(n) == n + 4 * -(-n // 128)
    assert codecs.get("int4:block=64").wire_nbytes(n) == -(-n // 2) + 4 * -(-n // 64)
    for spec in SPECS:
        codec = codecs.get(spec)
        assert codec.encode(gauss(n)).nbytes == codec.wire_nbytes(n)


def test_acceptance_bytes_per_element():
    n = 1 << 16
    assert codecs.get("fp8-e4m3").wire_nbytes(n) == n + 4
    assert codecs.get("nvfp4").wire_nbytes(n) == 0.5625 * n + 4
    assert codecs.get("mxfp8-e4m3").wire_nbytes(n) == 1.03125 * n  # formats.md
    assert codecs.get("mxfp4").wire_nbytes(n) == 0.53125 * n


# ---- accuracy (formats.md targets, within 10%) -------------------------------

@pytest.mark.parametrize("spec,target", [("fp8-e4m3", 0.026), ("fp8-e5m2", 0.053), ("nvfp4", 0.095),
                                         ("mxfp4", 0.115), ("int8", 0.0065), ("int4", 0.097),
                                         ("sign", (1 - 2 / np.pi) ** 0.5)])
def test_gaussian_rel_l2_matches_formats_md(spec, target):
    err = rel_l2(codecs.get(spec), gauss(1 << 18))
    assert abs(err - target) <= 0.1 * target, err


def test_casts_and_identity_accuracy():
    x = gauss(10000)
    assert rel_l2(codecs.get("none"), x) == 0.0
    assert rel_l2(codecs.get("fp16"), x) < 3e-4  # unit roundoff 2**-11
    assert rel_l2(codecs.get("bf16"), x) < 2.5e-3  # unit roundoff 2**-8
    np.testing.assert_array_equal(codecs.get("bf16").decode(codecs.get("bf16").encode(x)),
                                  x.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(codecs.get("fp16").decode(codecs.get("fp16").encode(x)),
                                  x.astype(np.float16).astype(np.float32))


# ---- exact layouts against an ml_dtypes reference -----------------------------

def fp8_reference(x, block):
    """Return the FP8-E4M3 wire bytes of the documented algorithm, computed with ml_dtypes."""
    n = x.size
    block = block or max(n, 1)
    codes, scales = [], []
    for lo in range(0, n, block):
        xb = x[lo:lo + block]
        amax = np.float32(np.max(np.abs(xb[np.isfinite(xb)]), initial=0))
        scale = max(amax / np.float32(448), np.float32(2.0**-126))
        y = np.clip(xb * (np.float32(1) / scale), -448, 448)
        codes.append(y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
        scales.append(scale)
    return np.concatenate(codes + [np.array(scales, "<f4").view(np.uint8)])


@pytest.mark.parametrize("block", [0, 32, 100])
@pytest.mark.parametrize("n", [1, 33, 1000])
def test_fp8_layout_matches_reference(n, block):
    x = gauss(n, seed=n) * 10
    codec = codecs.Fp8Codec(format="e4m3", block=block)
    np.testing.assert_array_equal(codec.encode(x).data, fp8_reference(x, block))


def nvfp4_reference(x):
    """Return NVFP4 wire bytes following formats.md step by step, with ml_dtypes casts."""
    n = x.size
    amax = np.float32(np.max(np.abs(x), initial=0))
    sg = max(amax / np.float32(2688), np.float32(2.0**-117))
    nb = -(-n // 16)
    xp = np.zeros(nb * 16, np.float32)
    xp[:n] = x
    blocks = xp.reshape(nb, 16)
    bamax = np.abs(blocks).max(axis=1)
    sb = (bamax / np.float32(6)) / sg
    scodes = np.clip(sb, 0, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8).copy()
    scodes[(scodes == 0) & (bamax > 0)] = 1  # underflow guard
    d = scodes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * sg
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.clip(blocks * inv[:, None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(-1)[:n]
    q = np.concatenate([q, np.zeros(n % 2, np.uint8)])
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return np.concatenate([packed, scodes, np.array([sg], "<f4").view(np.uint8)])


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 1000, 4099])
def test_nvfp4_layout_matches_reference(n):
    x = gauss(n, seed=n)
    x[: n // 3] *= 1e-4  # small blocks exercise small E4M3 scales
    if n > 40:
        x[16:32] = 0.0  # an all-zero block
    codec = codecs.get("nvfp4")
    payload = codec.encode(x)
    np.testing.assert_array_equal(payload.data, nvfp4_reference(x))


def mx_reference(x, element):
    """Return MX wire bytes by the OCP steps of formats.md, in float64 with ml_dtypes casts."""
    dtype, emax, top = {"e4m3": (ml_dtypes.float8_e4m3fn, 8, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 15, 57344.0),
                        "e2m1": (ml_dtypes.float4_e2m1fn, 2, 6.0)}[element]
    n = x.size
    nb = -(-n // 32)
    xp = np.zeros(nb * 32, np.float64)
    xp[:n] = x
    blocks = xp.reshape(nb, 32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.floor(np.log2(amax)) - emax  # -inf for an all-zero block
    e = np.clip(np.nan_to_num(e, nan=0.0, neginf=-127.0, posinf=127.0), -127, 127)
    scodes = np.where(np.isfinite(amax), e + 127, 255).astype(np.uint8)
    q = np.clip(blocks / np.exp2(e)[:, None], -top, top).astype(dtype).view(np.uint8).reshape(-1)[:n]
    if element == "e2m1":
        q = np.concatenate([q, np.zeros(n % 2, np.uint8)])
        q = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return np.concatenate([q, scodes])


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 1000, 16384 + 99])
def test_mx_layout_matches_reference(n, element):
    x = gauss(n, seed=n) * 3
    x[: n // 3] *= 1e-3  # blocks of other binades
    if n > 100:
        x[32:64] = 0.0  # an all-zero block: the smallest scale
        x[64:96] *= np.float32(1e-38)  # float32 subnormals: the smallest scale, codes of the scaled values
        x[96] = 3e38  # a block near float32's top
    codec = codecs.MxCodec(element=element)
    np.testing.assert_array_equal(codec.encode(x).data, mx_reference(x, element))


@pytest.mark.parametrize("spec,element", [("mxfp8-e4m3", ml_dtypes.float8_e4m3fn), ("mxfp4", ml_dtypes.float4_e2m1fn)])
def test_mx_decode_is_element_value_times_e8m0_scale(spec, element):
    codec = codecs.get(spec)
    x = gauss(4099, seed=2) * np.float32(50)
    x[:64] *= np.float32(1e-30)
    buf = codec.encode(x).data
    n, nc = x.size, codec.wire_nbytes(x.size) - -(-x.size // 32)
    codes = buf[:nc]
    if element is ml_dtypes.float4_e2m1fn:
        codes = np.stack([codes & 0xF, codes >> 4], axis=1).reshape(-1)[:n]
    scales = buf[nc:].view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    want = codes.astype(np.uint8).view(element).astype(np.float64) * np.repeat(scales, 32)[:n]
    np.testing.assert_array_equal(codec.decode_from(buf, n), want.astype(np.float32))
    assert np.array_equal(want, want.astype(np.float32))  # every value is exact in float32


def test_mx_non_finite_block_decodes_nan_and_leaves_the_others():
    x = gauss(128, seed=4)
    x[40] = np.inf
    for spec in ("mxfp8-e4m3", "mxfp8-e5m2", "mxfp4"):
        codec = codecs.get(spec)
        buf = codec.encode(x).data
        assert buf[-3] == 255 and 255 not in (buf[-4], buf[-2], buf[-1])  # the second of 4 scales
        y = codec.decode(codec.encode(x))
        assert np.isnan(y[32:64]).all() and np.isfinite(np.delete(y, range(32, 64))).all()


def test_mx_saturates_the_top_of_the_binade():
    # OCP's floor(log2 amax) scale leaves amax in [2**emax, 2**(emax+1)): 7.5 * 2**e clamps to 6 * 2**e.
    x = np.array([7.5] + [0.5] * 31, np.float32)
    y = codecs.get("mxfp4").decode(codecs.get("mxfp4").encode(x))
    assert y[0] == 6.0 and y[1] == 0.5


def int_reference(x, bits, block):
    """Return INT8/INT4 wire bytes by the documented steps, in float32 numpy arithmetic."""
    qmax = np.float32(2 ** (bits - 1) - 1)
    codes, scales = [], []
    for lo in range(0, x.size, block):
        xb = x[lo:lo + block]
        amax = np.float32(np.max(np.abs(xb)))
        if not np.isfinite(amax):
            scales.append(np.float32(np.nan))
            codes.append(np.zeros(xb.size, np.int8))
            continue
        scale = max(amax / qmax, np.float32(2.0**-126))
        scales.append(scale)
        codes.append(np.clip(np.rint(xb * (np.float32(1) / scale)), -qmax, qmax).astype(np.int8))
    q = np.concatenate(codes).view(np.uint8)
    if bits == 4:
        q = np.concatenate([q & 0xF, np.zeros(q.size % 2, np.uint8)])
        q = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return np.concatenate([q, np.array(scales, "<f4").view(np.uint8)])


@pytest.mark.parametrize("bits,block", [(8, 128), (8, 7), (4, 32), (4, 2)])
@pytest.mark.parametrize("n", [1, 2, 33, 1000, 16384 + 99])
def test_int_layout_matches_reference(n, bits, block):
    x = gauss(n, seed=n) * 7
    x[: n // 3] *= 1e-30  # tiny blocks: the scale floor
    if n > 300:
        x[200:260] = 0.0
        x[290] = np.nan
    codec = codecs.IntCodec(bits=bits, block=block)
    np.testing.assert_array_equal(codec.encode(x).data, int_reference(x, bits, block))
    y = codec.decode(codec.encode(x))
    blk = np.arange(n) // block
    bad = np.isin(blk, blk[~np.isfinite(x)])
    assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()


@pytest.mark.parametrize("spec,top", [("int8:block=6", 127.0), ("int4:block=6", 7.0)])
def test_int_rounds_ties_to_even(spec, top):
    x = np.array([top, 2.5, -3.5, 0.5, 1.5, -0.5], np.float32)  # scale 1: every other value a tie
    for arg in (x, torch.from_numpy(x)):
        y = codecs.get(spec).decode(codecs.get(spec).encode(arg))
        np.testing.assert_array_equal(np.asarray(y), [top, 2.0, -4.0, 0.0, 2.0, -0.0])


@pytest.mark.parametrize("block", [8, 128])
@pytest.mark.parametrize("n", [1, 9, 1000, 16384 + 99])
def test_sign_layout_matches_reference(n, block):
    x = gauss(n, seed=n) * 3
    x[: n // 4] *= 1e-20
    if n > 300:
        x[200:260] = 0.0
        x[290] = -np.inf
    nb = -(-n // block)
    xp = np.zeros(nb * block)
    xp[:n] = x
    counts = np.minimum(block, n - block * np.arange(nb))
    scales = (np.abs(xp).reshape(nb, block).sum(axis=1) / counts).astype(np.float32)  # inf for the bad block
    scales[~np.isfinite(scales)] = np.nan
    want = np.concatenate([np.packbits(x < 0, bitorder="little"), scales.astype("<f4").view(np.uint8)])
    codec = codecs.SignCodec(block=block)
    np.testing.assert_array_equal(codec.encode(x).data, want)
    y = codec.decode(codec.encode(x))
    np.testing.assert_array_equal(y, np.where(x < 0, -1, 1) * np.repeat(scales, block)[:n])


def test_sign_block_must_be_whole_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        codecs.get("sign:block=12")


def test_int_stochastic_rounding_is_unbiased():
    x = np.full(1 << 16, 0.3, np.float32)
    x[0] = 127.0  # scale 1: codes are 0 or 1 around 0.3
    y = codecs.get("int8:sr,block=65536").decode(codecs.get("int8:sr,block=65536").encode(x))
    assert set(np.unique(y[1:])) == {0.0, 1.0}
    assert abs(y[1:].mean() - 0.3) < 0.01


def test_int4_needs_an_even_block():
    with pytest.raises(ValueError, match="even block"):
        codecs.get("int4:block=7")


def test_nvfp4_scales_and_packing_round_trip():
    # Values exactly representable as e2m1 * e4m3 * sg survive unchanged.
    rng = np.random.default_rng(0)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    q = rng.choice(e2m1, size=(64, 16)) * rng.choice([-1, 1], size=(64, 16))
    q[:, 0] = 6.0  # each block's amax is 6 * its scale, so the scale is exact
    scales = np.float32(2.0) ** rng.integers(-6, 8, size=64).astype(np.float32)
    x = (q * scales[:, None]).astype(np.float32).reshape(-1)
    codec = codecs.get("nvfp4")
    payload = codec.encode(x)
    np.testing.assert_array_equal(codec.decode(payload), x)
    n = x.size
    packed = payload.data[: n // 2]
    # Even element in the low nibble, odd element in the high nibble.
    codes = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1).astype(np.uint8)
    np.testing.assert_array_equal(codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32), q.reshape(-1))
    scale_codes = payload.data[n // 2 : n // 2 + n // 16]
    sg = payload.data[-4:].view("<f4")[0]
    np.testing.assert_array_equal(scale_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * sg, scales)


def test_nvfp4_underflowing_block_scale_is_guarded():
    x = np.zeros(32, np.float32)
    x[0] = 1000.0  # sets s_global
    x[16:] = 1e-6  # block scale ~1e-6/6/(1000/2688) underflows E4M3
    y = codecs.get("nvfp4").decode(codecs.get("nvfp4").encode(x))
    assert y[0] == 1000.0
    assert codecs.get("nvfp4").encode(x).data[16 + 1] == 1  # smallest E4M3 scale, not 0
    assert np.all(np.abs(y[16:] - x[16:]) <= 1e-6)


# ---- non-finite values ---------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_non_finite_stays_non_finite(spec):
    x = gauss(300)
    bad = [3, 40, 77]
    x[bad] = [np.nan, np.inf, -np.inf]
    y = codecs.get(spec).decode(codecs.get(spec).encode(x))
    assert not np.isfinite(y[bad]).any()
    # Finite elements outside the bad ones' blocks stay accurate (no amax poisoning).
    codec = codecs.get(spec.split("+")[-1])
    block = getattr(codec, "block", 32)  # IntCodec's and SignCodec's; 32 is the largest block of the others
    far = np.ones(300, bool)
    far[[i for b in bad for i in range(b // block * block, b // block * block + block)]] = False
    assert far.sum() >= 128
    if far.any():
        assert np.all(np.isfinite(y[far]))


def test_e5m2_keeps_signed_infinity():
    x = np.array([1.0, np.inf, -np.inf, 2.0], np.float32)
    y = codecs.get("fp8-e5m2").decode(codecs.get("fp8-e5m2").encode(x))
    assert y[1] == np.inf and y[2] == -np.inf and y[0] == 1.0


# ---- API: kinds, shapes, dtypes, low-level buffers ----------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_decode_restores_shape_and_dtype(dtype):
    x = gauss(60).reshape(3, 4, 5).astype(dtype)
    codec = codecs.get("fp8-e4m3")
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    out = np.empty_like(x)
    assert codec.decode(codec.encode(x), out=out) is out
    np.testing.assert_array_equal(out, y)


@pytest.mark.parametrize("spec", SPECS)
def test_torch_bytes_equal_numpy_bytes(spec):
    x = gauss(1037, seed=5)
    a, b = codecs.get(spec), codecs.get(spec)
    for step in range(2):  # the second step exercises error-feedback residuals and SR counters
        pa, pb = a.encode(x, key="t"), b.encode(torch.from_numpy(x), key="t")
        assert isinstance(pb.data, torch.Tensor) and pb.nbytes == pa.nbytes
        ya, yb = a.decode(pa), b.decode(pb)
        assert isinstance(yb, torch.Tensor) and yb.dtype == torch.float32
        if "hadamard" in spec:  # matmul rounding differs between BLAS and torch
            np.testing.assert_allclose(yb.numpy(), ya, rtol=0, atol=0.3)
        else:
            np.testing.assert_array_equal(pb.data.numpy(), pa.data)
            np.testing.assert_array_equal(yb.numpy(), ya)


@pytest.fixture
def cuda_scalar_division(monkeypatch):
    """Make CPU torch divide a tensor by a Python number as CUDA does: times the float32 reciprocal.

    (torch's CUDA div_true kernel turns a CPU-scalar divisor into ``x * (1 / b)``.) Kernels that
    divide by Python numbers then stop matching the numpy path, as they would on a GPU.
    """
    true_div, true_div_ = torch.Tensor.__truediv__, torch.Tensor.div_
    calls = []

    def as_cuda(x, other):
        if isinstance(other, (int, float)) and not isinstance(other, bool) and x.is_floating_point():
            calls.append(other)
            inv = np.float32(1.0) / np.float32(other)
            return x * torch.full((), float(inv), dtype=x.dtype)
        return None

    def truediv(x, other):
        got = as_cuda(x, other)
        return true_div(x, other) if got is None else got

    def div_(x, other, *args, **kwargs):
        got = None if args or kwargs else as_cuda(x, other)
        return true_div_(x, other, *args, **kwargs) if got is None else x.copy_(got)

    monkeypatch.setattr(torch.Tensor, "__truediv__", truediv)
    monkeypatch.setattr(torch.Tensor, "div_", div_)
    return calls


def test_cuda_reciprocal_emulation_changes_results(cuda_scalar_division):
    # The fixture must bite: x / 448 and x * (1/448) differ for many float32 x.
    x = torch.from_numpy(np.abs(gauss(4096, seed=1)) * 100)
    emulated = (x / 448.0).numpy()
    assert cuda_scalar_division == [448.0]
    exact = x.numpy() / np.float32(448.0)
    assert (emulated != exact).mean() > 0.2


@pytest.mark.parametrize("spec", ["fp8-e4m3", "fp8-e5m2:block=7", "fp8-e4m3:block=32", "nvfp4", "ef+nvfp4",
                                  "mxfp8-e4m3", "ef+mxfp4", "int8", "int4:block=6,sr"])
def test_torch_kernels_divide_truly_where_cuda_takes_reciprocals(spec, cuda_scalar_division):
    # The device kernels must not divide a tensor by a Python number: on CUDA that is a multiply
    # by the reciprocal, and the scales written into the payload would differ from the host's.
    for seed in range(4):
        x = gauss(4099, seed=seed) * np.float32(3.7 ** seed)
        a, b = codecs.get(spec), codecs.get(spec)
        pa, pb = a.encode(x, key="t"), b.encode(torch.from_numpy(x), key="t")
        np.testing.assert_array_equal(pb.data.numpy(), pa.data)
        np.testing.assert_array_equal(b.decode(pb).numpy(), a.decode(pa))
    assert not cuda_scalar_division, f"a kernel divided a tensor by Python numbers {cuda_scalar_division[:3]}"


def test_device_average_divides_truly(cuda_scalar_division):
    from commwire.comm.arrays import device_ops

    x = torch.from_numpy(np.abs(gauss(4096, seed=2)) * 100)
    got = device_ops(x).divide_(x.clone(), 3)
    np.testing.assert_array_equal(got.numpy(), x.numpy() / np.float32(3))
    assert not cuda_scalar_division


def test_torch_bfloat16_round_trip():
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    codec = codecs.get("nvfp4")
    y = codec.decode(codec.encode(x))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert float((y.float() - x.float()).norm() / x.float().norm()) < 0.15


@pytest.mark.parametrize("spec", ["fp8-e4m3", "fp8-e4m3:block=64", "nvfp4", "ef+nvfp4"])
def test_encode_into_slices_of_one_send_buffer(spec):
    # The compressed collective encodes P chunks into slices of one buffer and decodes them.
    codec = codecs.get(spec)
    x = gauss(1001)
    chunks = np.array_split(x, 4)
    sizes = [codec.wire_nbytes(c.size) for c in chunks]
    send = np.zeros(sum(sizes), np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i, c in enumerate(chunks):
        codec.encode_into(c, send[offsets[i]:offsets[i + 1]], key=("bucket", i))
    for i, c in enumerate(chunks):
        out = np.empty(c.size, np.float32)
        y = codec.decode_from(send[offsets[i]:offsets[i + 1]], c.size, out)
        assert y is out
        assert np.linalg.norm(y - c) / np.linalg.norm(c) < 0.15


# ---- bad input -----------------------------------------------------------------

def test_unknown_spec_lists_valid_ones():
    with pytest.raises(ValueError, match="valid codecs: .*fp8-e4m3.*nvfp4"):
        codecs.get("fp7")
    with pytest.raises(ValueError, match="wrapper stages: ef"):
        codecs.get("foo+fp8-e4m3")
    with pytest.raises(ValueError, match="end the spec with a codec"):
        codecs.get("ef")
    with pytest.raises(ValueError, match="bad options"):
        codecs.get("fp8-e4m3:size=3")
    with pytest.raises(ValueError, match="block"):
        codecs.get("fp8-e4m3:block=-1")
    with pytest.raises(ValueError, match="unknown flag"):
        codecs.get("nvfp4:fast")


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.uint8])
def test_integer_and_bool_arrays_raise_type_error(dtype):
    with pytest.raises(TypeError, match="floating-point"):
        codecs.get("fp8-e4m3").encode(np.ones(10, dtype))
    with pytest.raises(TypeError, match="floating-point"):
        codecs.get("none").encode(torch.ones(10, dtype=torch.int64))


def test_payload_from_other_codec_or_truncated_raises():
    x = gauss(100)
    p = codecs.get("fp16").encode(x)
    with pytest.raises(ValueError, match="encoded by codec 'fp16'"):
        codecs.get("bf16").decode(p)
    truncated = Payload(data=p.data[:-1], spec=p.spec, shape=p.shape, dtype=p.dtype, n=p.n, kind=p.kind)
    with pytest.raises(ValueError, match="199 bytes .* wire_nbytes\\(100\\) = 200"):
        codecs.get("fp16").decode(truncated)
    with pytest.raises(ValueError, match="wire_nbytes"):
        codecs.get("nvfp4").decode_from(np.zeros(10, np.uint8), 100)
    with pytest.raises(ValueError, match="1-D float32"):
        codecs.get("nvfp4").encode_into(np.zeros((2, 2), np.float32), np.zeros(100, np.uint8))
    with pytest.raises(TypeError, match="Payload"):
        codecs.get("nvfp4").decode(b"abc")


# ---- specs, registry, state -------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS + ["FP8-E4M3:SR", "fp8-e4m3:rne", "identity"])
def test_canonical_spec_round_trips(spec):
    codec = codecs.get(spec)
    assert codecs.get(codec.spec).spec == codec.spec
    assert isinstance(codec, Codec)


def test_lossless_flags():
    assert codecs.get("none").lossless and codecs.get("ef+none").lossless
    assert not codecs.get("fp16").lossless and not codecs.get("hadamard+none").lossless


def test_register_stage_extends_the_grammar():
    class Negate(codecs.Transform):
        lossless = True
        spec = "negtest"

        def forward(self, x, key):
            return -x

        def inverse(self, y, out):
            out[:] = -y
            return out

    codecs.register_stage("negtest", lambda inner: codecs.Pipeline(Negate(), inner))
    codec = codecs.get("negtest+fp8-e4m3")
    x = gauss(50)
    assert codec.spec == "negtest+fp8-e4m3" and "negtest" in codecs.available()["stages"]
    np.testing.assert_array_equal(codec.decode(codec.encode(x)), codecs.get("fp8-e4m3").decode(codecs.get("fp8-e4m3").encode(x)))
    with pytest.raises(ValueError, match="already registered"):
        codecs.register_stage("negtest", lambda inner: inner)


def test_state_dict_round_trip_and_pickle():
    x = gauss(300)
    a = codecs.get("ef+fp8-e4m3:sr")
    for step in range(3):
        a.encode(x, key="w")
    state = pickle.loads(pickle.dumps(a.state_dict()))
    b = codecs.get("ef+fp8-e4m3:sr")
    b.load_state_dict(state)
    np.testing.assert_array_equal(a.encode(x, key="w").data, b.encode(x, key="w").data)
    with pytest.raises(ValueError, match="saved by codec 'ef\\+fp8-e4m3:sr'"):
        codecs.get("ef+nvfp4").load_state_dict(state)


def test_config_is_frozen_keyword_only():
    cfg = codecs.Fp8Config(format="e5m2", block=64)
    with pytest.raises(Exception):
        cfg.block = 3
    with pytest.raises(TypeError):
        codecs.Fp8Config("e4m3")  # noqa
    assert codecs.Fp8Codec(cfg).spec == "fp8-e5m2:block=64"
