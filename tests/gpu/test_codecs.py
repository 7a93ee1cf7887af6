"""Codec kernels and the compressed all-reduce on CUDA — tier 3 (GPU).

The torch kernels on the device must produce the bytes the numba kernels
produce on the host (payloads compared bit for bit, and decoded values), for
every format, per-tensor and block scales, RNE and stochastic rounding, odd
lengths and non-finite values. The compressed all-reduce of CUDA tensors
(direct or staged) must equal the host path's result bit for bit, except
Hadamard, whose matrix product rounds differently on the device (bounded
relative error instead).
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import device, is_on_device, require_cupy, size, skip_unless_cuda_aware
from mpi4py import MPI

import commwire as cw
from commwire.codecs import get
from commwire.codecs.collective import compressed_allreduce, device_space

torch = pytest.importorskip("torch")

WORLD = cw.init()
P, R = WORLD.size, WORLD.rank
SPECS = ["fp16", "bf16", "fp8-e4m3", "fp8-e5m2", "fp8-e4m3:block=128", "fp8-e5m2:block=32,sr", "fp8-e4m3:sr",
         "nvfp4", "nvfp4:sr", "ef+fp8-e4m3", "ef+nvfp4"]


def sample(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))).astype(np.float32)
    if n > 10:
        x[[1, 5, 9]] = [np.nan, np.inf, -np.inf]
        x[7] = 0.0
    return x


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 17, 4096, size(1_000_003)])
def test_device_payloads_equal_the_cpu_kernels(spec, n):
    host_codec, device_codec = get(spec), get(spec)
    for step in range(2):  # stateful stages (error feedback, SR streams) advance alike
        x = sample(n, seed=step)
        want = host_codec.encode(x, key="t")
        got = device_codec.encode(torch.from_numpy(x).to(device()), key="t")
        assert is_on_device(got.data)
        np.testing.assert_array_equal(got.data.cpu().numpy(), want.data)
        np.testing.assert_array_equal(device_codec.decode(got).cpu().numpy(), host_codec.decode(want))


def test_decode_add_on_the_device_equals_the_cpu():
    for spec in ("fp8-e4m3", "nvfp4", "bf16"):
        codec = get(spec)
        x, acc = sample(50_000), sample(50_000, seed=3)
        payload = codec.encode(x).data
        want = acc.copy()
        codec.decode_add(payload, x.size, want)
        got = torch.from_numpy(acc).to(device())
        codec.decode_add(torch.from_numpy(payload).to(device()), x.size, got)
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_cupy_arrays_encode_through_torch():
    cupy = require_cupy()
    codec = get("nvfp4")
    x = sample(10_000)
    with cupy.cuda.Device(device().index):
        got = codec.encode(cupy.asarray(x))
        assert isinstance(got.data, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(got.data), codec.encode(x).data)


@pytest.fixture(scope="module", params=["direct", "staged"])
def comm(request):
    if request.param == "direct":
        skip_unless_cuda_aware()
    return cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=request.param == "direct", uid=f"gpuc-{request.param}")


@pytest.mark.parametrize("spec", ["bf16", "fp8-e4m3", "fp8-e4m3:block=128", "nvfp4", "ef+fp8-e4m3", "ef+nvfp4:sr",
                                  "hadamard+fp8-e4m3"])
@pytest.mark.parametrize("n", [1000, size(3_000_000)])
def test_compressed_allreduce_equals_the_host_path(comm, spec, n):
    assert device_space(comm, get(spec), torch.ones(1, device=device())) is not None
    host_codec, device_codec = get(spec), get(spec)
    for step in range(2):
        a = np.random.default_rng(100 * step + R).standard_normal(n).astype(np.float32)
        want = compressed_allreduce(WORLD, a, "avg", codec=host_codec, name="t", segment_bytes=1 << 20)
        x = torch.from_numpy(a).to(device())
        got = compressed_allreduce(comm, x, "avg", codec=device_codec, name="t", segment_bytes=1 << 20)
        assert is_on_device(got) and got.dtype == torch.float32
        if spec.startswith("hadamard"):
            assert np.linalg.norm(got.cpu().numpy() - want) <= 0.02 * np.linalg.norm(want)
        else:
            np.testing.assert_array_equal(got.cpu().numpy(), want)
        # An independent reference: the float64 mean of every rank's input, within the codec's
        # documented bound (tests/collectives/mpi_compressed.py), and not exact for a lossy codec.
        exact = np.mean([np.random.default_rng(100 * step + r).standard_normal(n).astype(np.float64)
                         for r in range(P)], axis=0)
        # (Error feedback's later steps carry the previous residual; stochastic rounding's error
        # is up to 1.5x round-to-nearest's.)
        if step == 0 or not spec.startswith("ef+"):
            err = np.linalg.norm(got.cpu().numpy() - exact) / np.linalg.norm(exact)
            bound = BOUNDS[spec.split("+")[-1].split(":")[0]] * (1.5 if ":sr" in spec else 1.0)
            assert 0 < err < bound, (spec, step, err)
        # In place: the same values as a fresh host run of the same codec.
        fresh = compressed_allreduce(WORLD, a, "avg", codec=get(spec), name=f"inplace-{step}",
                                     segment_bytes=1 << 20)
        assert compressed_allreduce(comm, x, "avg", codec=get(spec), out=x, name=f"inplace-{step}",
                                    segment_bytes=1 << 20) is x
        if spec.startswith("hadamard"):
            assert np.linalg.norm(x.cpu().numpy() - fresh) <= 0.02 * np.linalg.norm(fresh)
        else:
            np.testing.assert_array_equal(x.cpu().numpy(), fresh)


BOUNDS = {"bf16": 1.2e-2, "fp8-e4m3": 0.06, "nvfp4": 0.2}
"""Relative L2 error bounds of a compressed all-reduce's result (those of tests/collectives/mpi_compressed.py)."""


def test_compressed_allreduce_of_bf16_and_cupy(comm):
    cupy = require_cupy()
    a = np.random.default_rng(R).standard_normal(200_000).astype(np.float32)
    want = compressed_allreduce(WORLD, a, "sum", codec="fp8-e4m3", segment_bytes=1 << 20)
    from commwire.comm.arrays import BFLOAT16

    want_bf = compressed_allreduce(WORLD, a.astype(BFLOAT16), "sum", codec="fp8-e4m3", segment_bytes=1 << 20)
    bf = torch.from_numpy(a).to(device(), torch.bfloat16)
    got = compressed_allreduce(comm, bf, "sum", codec="fp8-e4m3", segment_bytes=1 << 20)
    assert got.dtype == torch.bfloat16 and is_on_device(got)
    np.testing.assert_array_equal(got.view(torch.int16).cpu().numpy(), want_bf.view(np.int16))
    with cupy.cuda.Device(device().index):
        got = compressed_allreduce(comm, cupy.asarray(a), "sum", codec="fp8-e4m3", segment_bytes=1 << 20)
        assert isinstance(got, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_the_extending_page_codec_on_the_device():
    # docs/extending.md's int8 codec, executed from the page: it declares device support, so a
    # CUDA tensor's compressed all-reduce runs its kernels on the GPU. Bound: two quantisations
    # (each rank's chunk, then the sum), each within max|value| / 254 per element.
    from docs_examples import run_block

    from commwire import codecs

    page_codec = run_block("extending.md", "class Int8Codec")["Int8Codec"]  # registers the spec "int8"
    assert type(codecs.get("int8")) is page_codec
    n = size(1 << 20)
    inputs = [(np.random.default_rng(r).standard_normal(n) * (r + 1)).astype(np.float32) for r in range(P)]
    x = torch.from_numpy(inputs[R].copy()).to(device())
    assert device_space(WORLD, page_codec(), x) is not None
    y = cw.allreduce(x, codec="int8", name="page-int8-gpu")
    assert is_on_device(y)
    want = np.sum([v.astype(np.float64) for v in inputs], axis=0)
    bound = (sum(np.abs(v).max() for v in inputs) + np.abs(want).max()) / 254 * (1 + 1e-5)
    err = np.abs(y.cpu().numpy().astype(np.float64) - want).max()
    assert 0 < err <= bound, (err, bound)
