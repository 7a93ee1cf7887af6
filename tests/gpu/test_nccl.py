"""The torch transport on NCCL — tier 3 (GPU; one GPU per rank, as NCCL requires).

CUDA tensors move over an NCCL process group (``Communicator.from_process_group``).
References: collectives against float64 numpy sums of every rank's input computed
on the host (tolerances of tests/mpi_helpers.TOL; integers and data moves exact);
the compressed all-reduce bit-identical to the same codec's run on host arrays
over MPI (the codec kernels are bit-exact on the device, tests/gpu/test_codecs.py)
and within its documented bound of the float64 mean; the DDP hook on DDP's NCCL
group equal to plain DDP on that group after 10 steps (rtol 1e-6).

Under COMMWIRE_GPU_EMULATE=cpu the same tests run on a gloo group with CPU tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu import EMULATE, device, is_on_device, size

import commwire as cw
from mpi_helpers import TOL

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

WORLD = cw.init()
P, R = WORLD.size, WORLD.rank
BOUNDS = {"fp8-e4m3": 0.06, "nvfp4": 0.2}


@pytest.fixture(scope="module")
def nccl():
    """Return (communicator over an NCCL group of every rank, that group)."""
    from mpi4py import MPI

    from commwire.comm.communicator import Communicator
    from commwire.comm.torch_transport import init_torch_distributed, new_group

    if not EMULATE and P > torch.cuda.device_count():
        pytest.skip(f"NCCL needs one GPU per rank: {P} ranks share {torch.cuda.device_count()} GPU(s) "
                    "(run this module with one rank per GPU)")
    dev = device()
    if not dist.is_initialized():
        init_torch_distributed(MPI.COMM_WORLD, "gloo" if EMULATE else "cpu:gloo,cuda:nccl")
    backend = "gloo" if EMULATE else "nccl"
    name = WORLD.mpi.bcast(f"nccl-tier-{np.random.default_rng().integers(1 << 30)}" if R == 0 else None)
    pg = new_group(list(range(P)), backend, name)
    comm = Communicator.from_process_group(pg, comm=WORLD)
    assert comm.transport.describe().endswith(backend), comm.transport.describe()
    if EMULATE:  # the emulated device's tensors are CPU tensors: gloo moves them where NCCL would
        comm.transport.backends = {"cpu": "gloo", "cuda": "nccl"}
    yield comm, pg, dev
    comm.free()


def _data(rank, n, dtype, case=0):
    rng = np.random.default_rng(1000 * case + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(0, 5, size=n).astype(dtype)
    return rng.uniform(-2, 2, size=n).astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_allreduce(nccl, dtype, op):
    comm, _, dev = nccl
    if op == "avg" and dtype.startswith(("int", "uint")):
        pytest.skip("avg on integers is refused on every transport (tests/core)")
    n = size(300_000)
    stack = np.stack([_data(r, n, dtype).astype(np.float64) for r in range(P)])
    want = {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0)}[op]
    for _ in range(2):  # the first call agrees on the signature, the second takes the steady path
        got = comm.allreduce(torch.from_numpy(_data(R, n, dtype)).to(dev), op, name=f"nccl-{dtype}-{op}")
        assert is_on_device(got)
        tol = TOL.get(dtype, 0)
        np.testing.assert_allclose(got.cpu().numpy().astype(np.float64), want, rtol=tol, atol=tol)


def test_bfloat16_and_in_place(nccl):
    comm, _, dev = nccl
    n = size(100_000)
    want = np.sum([_data(r, n, "float32", case=2).astype(np.float64) for r in range(P)], axis=0)
    x = torch.from_numpy(_data(R, n, "float32", case=2)).to(dev)
    assert comm.allreduce(x, out=x, name="nccl-inplace") is x
    np.testing.assert_allclose(x.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    got = comm.allreduce(torch.from_numpy(_data(R, n, "float32", case=2)).to(dev, torch.bfloat16), name="nccl-bf16")
    assert got.dtype == torch.bfloat16 and is_on_device(got)
    np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=1e-2, atol=2e-2 * P)


def test_data_moves(nccl):
    comm, _, dev = nccl
    rows = [_data(r, (r + 1) * 3, "float32", case=3).reshape(r + 1, 3) for r in range(P)]
    got = comm.allgather(torch.from_numpy(rows[R]).to(dev))
    np.testing.assert_array_equal(got.cpu().numpy(), np.concatenate(rows))
    b = comm.broadcast(torch.from_numpy(_data(R, 77, "int64", case=4)).to(dev), root=P - 1)
    np.testing.assert_array_equal(b.cpu().numpy(), _data(P - 1, 77, "int64", case=4))
    full = np.sum([_data(r, 2 * P + 1, "float64", case=5) for r in range(P)], axis=0)
    rs = comm.reduce_scatter(torch.from_numpy(_data(R, 2 * P + 1, "float64", case=5)).to(dev), "sum")
    np.testing.assert_allclose(rs.cpu().numpy(), np.array_split(full, P)[R], rtol=1e-12)


@pytest.mark.parametrize("spec", ["fp8-e4m3", "nvfp4", "ef+fp8-e4m3"])
def test_compressed_allreduce(nccl, spec):
    from commwire.codecs import get
    from commwire.codecs.collective import compressed_allreduce

    comm, _, dev = nccl
    n = size(3_000_000)
    host_codec, device_codec = get(spec), get(spec)
    for step in range(2):
        a = np.random.default_rng(100 * step + R).standard_normal(n).astype(np.float32)
        want = compressed_allreduce(WORLD, a, "avg", codec=host_codec, name="nccl-c", segment_bytes=1 << 20)
        got = compressed_allreduce(comm, torch.from_numpy(a).to(dev), "avg", codec=device_codec, name="nccl-c",
                                   segment_bytes=1 << 20)
        assert is_on_device(got)
        np.testing.assert_array_equal(got.cpu().numpy(), want)  # payloads over NCCL, the same bits as over MPI
        if step == 0:
            exact = np.mean([np.random.default_rng(r).standard_normal(n).astype(np.float64) for r in range(P)], 0)
            err = np.linalg.norm(got.cpu().numpy() - exact) / np.linalg.norm(exact)
            assert 0 < err < BOUNDS[spec.split("+")[-1]], err


def _train(pg, dev, codec, steps=10):
    import commwire.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 1)).to(dev)
    ddp = DDP(model, device_ids=[dev] if dev.type == "cuda" else None, process_group=pg, bucket_cap_mb=1)
    if codec is not None:
        state, hook = hvd.ddp_hook(codec, model=ddp)  # transport="torch": DDP's own (NCCL) group
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(100 + R)
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), x[:, :1] * 0.5).backward()
        opt.step()
    return model


def test_ddp_hook_on_the_nccl_group(nccl):
    _, pg, dev = nccl
    if EMULATE:
        pytest.skip("COMMWIRE_GPU_EMULATE=cpu: the hook's own communicator over the gloo group refuses the emulated "
                    "device tensors (tests/torch runs the hook on gloo groups)")
    start, ref, got = _train(pg, dev, None, steps=0), _train(pg, dev, None), _train(pg, dev, "none")
    for (name, a), b, a0 in zip(ref.named_parameters(), got.parameters(), start.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=name)
        assert float((a - a0).abs().max()) > 1e-5, name  # training moved the weights
