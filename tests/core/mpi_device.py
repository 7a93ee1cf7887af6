"""The device paths of every collective, run on the CPU — tier 2 (mpiexec -n 1..4, no GPU).

Run by tests/core/test_device_paths.py as ``mpiexec -n {1,2,3,4} python -m
pytest`` on this file. Inside ``arrays.cpu_standin()`` torch CPU tensors count
as device arrays, so they take the paths CUDA tensors take: their work buffers
are prepared with torch ops, and MPI gets the tensors themselves (``direct``:
a communicator with ``cuda_aware=True``) or host copies (``staged``); in
``mixed`` the even ranks go direct and the odd ones staged, which must work
because both paths send the same messages. What a CPU cannot show (CUDA
streams, device pointers in MPI) is checked by tests/gpu on a GPU machine; the
stream rules are checked here through the order in which the paths call
``synchronize`` and MPI.

References and tolerances are those of mpi_collectives.py (float64 sums of
each rank's deterministic input); compressed all-reduces must equal the host
path's result bit for bit (same kernels' bits, same message order), except
Hadamard, whose matrix products round differently in torch and numpy.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from mpi4py import MPI

import commwire as cw
from commwire.codecs.collective import compressed_allreduce, device_space
from commwire.comm import arrays

torch = pytest.importorskip("torch")

WORLD = cw.init()
P, R = WORLD.size, WORLD.rank
BAD = P - 1
COMMS = {
    "direct": cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=True, uid="direct"),
    "staged": cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=False, uid="staged"),
    "mixed": cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=R % 2 == 0, uid="mixed"),
}
CHECKED = cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=True, check=True, uid="checked")
DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
from mpi_helpers import check_close  # noqa: E402
_names = itertools.count()


@pytest.fixture(autouse=True)
def _standin():
    with arrays.cpu_standin():
        yield


def fresh(label: str) -> str:
    return f"{label}.{next(_names)}"


def data(rank: int, shape: tuple[int, ...], dtype: str, case: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(0, 5, size=shape).astype(dtype)
    return rng.uniform(-2, 2, size=shape).astype(np_dtype(dtype))


def np_dtype(name: str) -> np.dtype:
    return arrays.BFLOAT16 if name == "bfloat16" else np.dtype(name)


def tensor(a: np.ndarray):
    if a.dtype == arrays.BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def numpy_of(t) -> np.ndarray:
    assert isinstance(t, torch.Tensor), type(t)
    return t.view(torch.int16).numpy().view(arrays.BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


REFERENCE = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max}


# ---------------------------------------------------------------- every collective
@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_allreduce(mode, dtype, op):
    comm = COMMS[mode]
    if op == "avg" and dtype.startswith(("int", "uint")):
        with pytest.raises(TypeError, match="avg"):
            comm.allreduce(tensor(data(0, (3,), dtype)), op)
        return
    name = fresh("ar")
    for _ in range(2):  # the first call agrees by exchange, the second carries the flag (fused)
        x = tensor(data(R, (5, 3), dtype))
        got = comm.allreduce(x, op, name=name)
        assert isinstance(got, torch.Tensor) and got.dtype == x.dtype and tuple(got.shape) == (5, 3)
        want = REFERENCE[op](np.stack([data(r, (5, 3), dtype).astype(np.float64) for r in range(P)]), axis=0)
        check_close(numpy_of(got), want, dtype)
        check_close(numpy_of(x), data(R, (5, 3), dtype).astype(np.float64), dtype)  # input untouched


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("n", [7, 40_000])  # fused flag / flag beside the data
def test_allreduce_in_place_out_and_non_contiguous(mode, n):
    comm = COMMS[mode]
    want = np.sum([data(r, (n,), "float32").astype(np.float64) for r in range(P)], axis=0)
    for _ in range(2):
        x = tensor(data(R, (n,), "float32"))
        assert comm.allreduce(x, "sum", out=x, name=f"inplace{n}") is x
        check_close(x.numpy(), want, "float32")
        out = torch.zeros(n)
        assert comm.allreduce(tensor(data(R, (n,), "float32")), "sum", out=out, name=f"out{n}") is out
        check_close(out.numpy(), want, "float32")
    base = tensor(data(R, (6, 4), "float64"))
    got = comm.allreduce(base.t())
    check_close(got.numpy(), np.sum([data(r, (6, 4), "float64").T for r in range(P)], axis=0), "float64")


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_min_max_propagate_nan_and_keep_infinities(mode, dtype):
    comm = COMMS[mode]
    values = np.array([1.5, -0.25, np.inf, -np.inf, 3.0, 0.0, -7.0, 2.0], dtype=np.float64)
    mine = values * (R + 1)
    if R == BAD:
        mine[1] = np.nan  # one rank's NaN wins everywhere, as with numpy's minimum/maximum
    everyone = np.stack([values * (r + 1) for r in range(P)])
    everyone[BAD, 1] = np.nan
    for op, ref in (("min", np.minimum.reduce), ("max", np.maximum.reduce)):
        got = numpy_of(comm.allreduce(tensor(mine.astype(np_dtype(dtype))), op, name=fresh(op)))
        want = ref(everyone.astype(np_dtype(dtype)).astype(np.float64), axis=0)
        np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), np.isnan(want))
        np.testing.assert_array_equal(got.astype(np.float64)[~np.isnan(want)], want[~np.isnan(want)])


@pytest.mark.parametrize("mode", list(COMMS))
def test_min_max_of_integers_and_bool(mode):
    comm = COMMS[mode]
    for dtype in ("int32", "int64", "uint8"):
        x = tensor(data(R, (9,), dtype))
        everyone = np.stack([data(r, (9,), dtype) for r in range(P)])
        np.testing.assert_array_equal(comm.allreduce(x, "min").numpy(), everyone.min(axis=0))
        np.testing.assert_array_equal(comm.allreduce(x, "max").numpy(), everyone.max(axis=0))
    every = np.array([[True, r == 0, r != BAD] for r in range(P)])
    flags = torch.from_numpy(every[R].copy())
    np.testing.assert_array_equal(comm.allreduce(flags, "min").numpy(), every.all(axis=0))  # logical and
    np.testing.assert_array_equal(comm.allreduce(flags, "max").numpy(), every.any(axis=0))  # logical or


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_allgather_unequal_rows(mode, dtype):
    comm = COMMS[mode]
    kind = "uint8" if dtype == "bool" else dtype
    mine = data(R, (R + 1, 3), kind)
    mine = mine.astype(bool) if dtype == "bool" else mine
    got = comm.allgather(tensor(mine), name=fresh("ag"))
    assert isinstance(got, torch.Tensor)
    want = np.concatenate([(data(r, (r + 1, 3), kind).astype(bool) if dtype == "bool" else data(r, (r + 1, 3), kind))
                           for r in range(P)])
    np.testing.assert_array_equal(numpy_of(got), want)
    np.testing.assert_array_equal(comm.allgather(torch.tensor(float(R))).numpy(), np.arange(P, dtype=np.float32))


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_from_every_root_in_place_and_out(mode, dtype):
    comm = COMMS[mode]
    for root in range(P):
        want = data(root, (4, 2), dtype)
        got = comm.broadcast(tensor(data(R, (4, 2), dtype)), root=root)
        np.testing.assert_array_equal(numpy_of(got), want)
        x = tensor(data(R, (4, 2), dtype))
        assert comm.broadcast(x, root=root, out=x) is x
        np.testing.assert_array_equal(numpy_of(x), want)
        out = tensor(np.zeros((4, 2), np_dtype(dtype)))
        mine = tensor(data(R, (4, 2), dtype))
        assert comm.broadcast(mine, root=root, out=out) is out
        np.testing.assert_array_equal(numpy_of(out), want)
        np.testing.assert_array_equal(numpy_of(mine), data(R, (4, 2), dtype))  # input untouched


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max"])
def test_reduce_scatter(mode, dtype, op):
    comm = COMMS[mode]
    rows = 2 * P + 1  # uneven: the first rank gets one row more
    got = comm.reduce_scatter(tensor(data(R, (rows, 2), dtype)), op)
    full = REFERENCE[op](np.stack([data(r, (rows, 2), dtype).astype(np.float64) for r in range(P)]), axis=0)
    block = np.array_split(full, P)[R]
    assert isinstance(got, torch.Tensor)
    check_close(numpy_of(got), block, dtype)
    counts = [rows] + [0] * (P - 1)
    got = comm.reduce_scatter(tensor(data(R, (rows, 2), dtype)), op, counts=counts)
    check_close(numpy_of(got), full if R == 0 else full[:0], dtype)


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_and_alltoallv(mode, dtype):
    comm = COMMS[mode]
    mine = data(R, (2 * P, 3), dtype)
    got = comm.alltoall(tensor(mine))
    want = np.concatenate([data(r, (2 * P, 3), dtype)[2 * R:2 * R + 2] for r in range(P)])
    np.testing.assert_array_equal(numpy_of(got), want)
    splits = [(R + d) % 3 for d in range(P)]  # rows this rank sends to each rank
    send = data(R, (sum(splits), 2), dtype)
    got, received = comm.alltoallv(tensor(send), splits)
    parts = []
    for r in range(P):
        theirs = [(r + d) % 3 for d in range(P)]
        lo = sum(theirs[:R])
        parts.append(data(r, (sum(theirs), 2), dtype)[lo:lo + theirs[R]])
    np.testing.assert_array_equal(numpy_of(got), np.concatenate(parts))
    np.testing.assert_array_equal(received, [(r + R) % 3 for r in range(P)])


@pytest.mark.parametrize("mode", list(COMMS))
def test_async_variants_on_the_lane(mode):
    comm = COMMS[mode]
    x = tensor(data(R, (9,), "float32"))
    handles = [comm.allreduce_async(x, "max"), comm.allgather_async(x), comm.broadcast_async(x, root=0),
               comm.reduce_scatter_async(x, "sum"), comm.alltoall_async(tensor(data(R, (P,), "float32")))]
    results = [h.wait() for h in handles[::-1]][::-1]
    np.testing.assert_array_equal(results[0].numpy(), comm.allreduce(x, "max").numpy())
    np.testing.assert_array_equal(results[1].numpy(), comm.allgather(x).numpy())
    np.testing.assert_array_equal(results[2].numpy(), comm.broadcast(x, root=0).numpy())
    np.testing.assert_array_equal(results[3].numpy(), comm.reduce_scatter(x, "sum").numpy())


# ---------------------------------------------------------------- compressed all-reduce
SPECS = ["fp16", "bf16", "fp8-e4m3", "fp8-e5m2:block=128", "nvfp4", "ef+fp8-e4m3", "ef+nvfp4", "fp8-e4m3:sr",
         "hadamard+fp8-e4m3"]


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1000, 70_000])  # the single-Allgather variant / the pipeline
def test_compressed_matches_host_path_bit_for_bit(mode, spec, n):
    comm = COMMS[mode]
    assert device_space(comm, cw.codecs.get(spec), torch.ones(1)) is not None  # really the device path
    name = fresh("c")
    # Codec objects of their own, called with the same name: the same error-feedback residuals
    # and stochastic-rounding streams on both paths.
    host_codec, device_codec = cw.codecs.get(spec), cw.codecs.get(spec)
    for step in range(3):  # error feedback carries state across calls: compare every step
        a = data(R, (n,), "float32", case=step)
        host = compressed_allreduce(WORLD, a, "avg", codec=host_codec, name=name, segment_bytes=16 << 10)
        got = compressed_allreduce(comm, tensor(a), "avg", codec=device_codec, name=name, segment_bytes=16 << 10)
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
        if spec.startswith("hadamard"):
            assert np.linalg.norm(got.numpy() - host) <= 0.02 * np.linalg.norm(host)
        else:
            np.testing.assert_array_equal(got.numpy(), host)
        everyone = comm.allgather(got[None])
        assert all(torch.equal(everyone[0], everyone[r]) for r in range(P))  # bit-identical on every rank


@pytest.mark.parametrize("mode", list(COMMS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_compressed_dtypes_in_place_and_out(mode, dtype):
    comm = COMMS[mode]
    a = data(R, (70_000,), dtype)
    host = compressed_allreduce(WORLD, a, "sum", codec="fp8-e4m3", segment_bytes=16 << 10)
    x = tensor(a)
    assert compressed_allreduce(comm, x, "sum", codec="fp8-e4m3", out=x, segment_bytes=16 << 10) is x
    np.testing.assert_array_equal(numpy_of(x), host)
    out = tensor(np.zeros(70_000, np_dtype(dtype)))
    compressed_allreduce(comm, tensor(a), "sum", codec="fp8-e4m3", out=out, segment_bytes=16 << 10)
    np.testing.assert_array_equal(numpy_of(out), host)
    shaped = compressed_allreduce(comm, tensor(a).reshape(350, 200), "sum", codec="fp8-e4m3",
                                  segment_bytes=16 << 10)
    assert tuple(shaped.shape) == (350, 200)
    np.testing.assert_array_equal(numpy_of(shaped).reshape(-1), host)


def test_compressed_codec_without_device_kernels_goes_through_the_host():
    assert device_space(COMMS["direct"], cw.codecs.get("gift+fp8-e4m3"), torch.ones(1)) is None
    assert device_space(COMMS["direct"], cw.codecs.get("nvfp4"), np.ones(1)) is None
    with arrays.cpu_standin(False):
        assert device_space(COMMS["direct"], cw.codecs.get("nvfp4"), torch.ones(1)) is None


def test_compressed_async_matches_blocking():
    comm = COMMS["direct"]
    a = data(R, (70_000,), "float32")
    handle = cw.codecs.collective.compressed_allreduce_async(comm, tensor(a), "avg", codec="nvfp4",
                                                             segment_bytes=16 << 10)
    blocking = compressed_allreduce(comm, tensor(a), "avg", codec="nvfp4", segment_bytes=16 << 10)
    np.testing.assert_array_equal(handle.wait().numpy(), blocking.numpy())


# ---------------------------------------------------------------- agreement on the device paths
DEVICE_CASES = {
    "unsupported dtype": (lambda c, n, bad: c.allreduce(torch.ones(3, dtype=torch.complex64 if bad else
                                                                   torch.float32), name=n), TypeError),
    "avg of integers": (lambda c, n, bad: c.allreduce(torch.ones(3, dtype=torch.int32 if bad else torch.float32),
                                                      "avg", name=n), TypeError),
    "shape (fused flag)": (lambda c, n, bad: c.allreduce(torch.ones(3 + bad), name=n), cw.CollectiveMismatchError),
    "shape (flag beside)": (lambda c, n, bad: c.allreduce(torch.ones(50_000 + bad), name=n),
                            cw.CollectiveMismatchError),
    "min shape (ordered)": (lambda c, n, bad: c.allreduce(torch.ones(3 + bad), "min", name=n),
                            cw.CollectiveMismatchError),
    "host vs device": (lambda c, n, bad: c.allreduce(np.ones(3, np.float32) if bad else torch.ones(3), name=n),
                       cw.CollectiveMismatchError),
    "broadcast dtype": (lambda c, n, bad: c.broadcast(torch.ones(3, dtype=torch.int16 if bad else torch.float32),
                                                      name=n), cw.CollectiveMismatchError),
    "allgather trailing shape": (lambda c, n, bad: c.allgather(torch.ones(2, 3 + bad), name=n),
                                 cw.CollectiveMismatchError),
    "reduce_scatter scalar": (lambda c, n, bad: c.reduce_scatter(torch.ones(() if bad else (P,)), name=n),
                              ValueError),
    "alltoall length": (lambda c, n, bad: c.alltoall(torch.ones(P + bad), name=n), ValueError),
    "compressed shape": (lambda c, n, bad: compressed_allreduce(c, torch.ones(70_000 + 128 * bad), codec="nvfp4",
                                                                name=n, segment_bytes=16 << 10),
                         cw.CollectiveMismatchError),
    "compressed integers": (lambda c, n, bad: compressed_allreduce(
        c, torch.ones(300, dtype=torch.int32 if bad else torch.float32), codec="fp8-e4m3", name=n), TypeError),
}


@pytest.mark.skipif(P < 2, reason="needs at least two ranks")
@pytest.mark.parametrize("mode", ["first", "steady", "checked"])
@pytest.mark.parametrize("path", ["direct", "staged", "mixed"])
@pytest.mark.parametrize("case", list(DEVICE_CASES))
def test_every_rank_raises_together_on_device_paths(case, path, mode):
    fn, exc_type = DEVICE_CASES[case]
    comm = CHECKED if mode == "checked" else COMMS[path]
    name = fresh(case)
    if mode == "steady":
        fn(comm, name, False)
    with pytest.raises(exc_type) as info:
        fn(comm, name, R == BAD)
    assert f"of {P}" in str(info.value), str(info.value)
    got = comm.allreduce(torch.full((3,), R + 1.0), name="after")  # the next collective pairs up
    np.testing.assert_array_equal(got.numpy(), np.full(3, P * (P + 1) / 2))
    fn(comm, name, False)  # and the name stays usable


@pytest.mark.skipif(P < 2, reason="needs at least two ranks")
def test_same_name_new_shape_everywhere_is_redone_on_the_device_path():
    comm = COMMS["direct"]
    name = fresh("reshape")
    for n in (3, 5, 40_000, 3):
        got = comm.allreduce(torch.ones(n), "min", name=name)
        np.testing.assert_array_equal(got.numpy(), np.ones(n, np.float32))


# ---------------------------------------------------------------- stream rules
class _Log:
    """Record device-ops calls that queue work, stream syncs and MPI calls that read device buffers."""

    QUEUE = ("contiguous", "clone", "float32", "ordered", "flat_copy", "set_item", "copy_into", "cast", "unordered",
             "divide_")

    def __init__(self, monkeypatch):
        self.events: list[str] = []
        ops = type(arrays.device_ops(torch.ones(1)))
        for name in self.QUEUE:
            monkeypatch.setattr(ops, name, self._wrap(getattr(ops, name), name))
        monkeypatch.setattr(ops, "synchronize", self._wrap(lambda _self, x: None, "sync"))

    def _wrap(self, fn, label):
        def wrapped(*args, **kwargs):
            self.events.append(label)
            return fn(*args, **kwargs)

        return wrapped


class _MpiSpy:
    """Forward to a communicator; log the data calls that get a torch buffer."""

    def __init__(self, mpi, log):
        self._mpi, self._log = mpi, log

    def __getattr__(self, name):
        attr = getattr(self._mpi, name)
        if not callable(attr) or name.startswith("Get") or name in ("Dup", "Split", "Split_type"):
            return attr

        def call(*args, **kwargs):
            flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
            if any(isinstance(a, torch.Tensor) for a in flat):
                self._log.events.append("mpi " + name)
            return attr(*args, **kwargs)

        return call


def test_direct_paths_synchronize_after_queued_work_and_before_mpi(monkeypatch):
    log = _Log(monkeypatch)
    comm = cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=True, uid="spy")
    comm.transport.mpi = _MpiSpy(comm.transport.mpi, log)
    x = tensor(data(R, (6, 2), "bfloat16"))
    for _ in range(2):
        comm.allreduce(x, "sum", name="s")
        comm.allreduce(tensor(data(R, (6, 2), "float32")), "max", name="m")
        comm.allreduce(tensor(data(R, (40_000,), "float32")), "avg", name="big")
    comm.allgather(x.t())
    comm.broadcast(x.t(), root=0)
    comm.reduce_scatter(tensor(data(R, (2 * P, 2), "float16")), "min")
    comm.alltoall(tensor(data(R, (P, 3), "float32")).t().contiguous().t())
    reads = [i for i, e in enumerate(log.events) if e.startswith("mpi")]
    assert len(reads) >= 9, log.events
    for i in reads:
        before = [e for e in log.events[:i] if not e.startswith("mpi")]
        assert before and before[-1] == "sync", (i, log.events)  # nothing queued since the last sync


def test_staged_paths_never_hand_torch_buffers_to_mpi(monkeypatch):
    log = _Log(monkeypatch)
    comm = cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=False, uid="spy2")
    comm.transport.mpi = _MpiSpy(comm.transport.mpi, log)
    comm.allreduce(tensor(data(R, (6,), "float16")), "max")
    comm.allgather(tensor(data(R, (3,), "float32")))
    comm.broadcast(tensor(data(R, (3,), "int64")))
    comm.reduce_scatter(tensor(data(R, (P,), "float32")))
    comm.alltoall(tensor(data(R, (P,), "float32")))
    assert not [e for e in log.events if e.startswith("mpi")], log.events


def test_compressed_direct_path_readies_device_buffers_before_mpi(monkeypatch):
    from commwire.codecs import collective

    events: list[str] = []
    monkeypatch.setattr(collective._DeviceSpace, "ready", lambda self: events.append("ready"))
    for name in ("_encode", "_decode", "_decode_add"):
        real = getattr(collective._Run, name)

        def logged(self, *args, _real=real, **kwargs):
            events.append("kernel")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(collective._Run, name, logged)
    comm = cw.Communicator(MPI.COMM_WORLD.Dup(), cuda_aware=True, uid="spy3")
    spy = _MpiSpy(comm.transport.mpi, _Log.__new__(_Log))
    spy._log.events = events
    comm.transport.mpi = spy
    real_pipe = collective._pipe

    def spied_pipe(c):
        pipe = real_pipe(c)
        if not isinstance(pipe.mpi, _MpiSpy):
            pipe.mpi = _MpiSpy(pipe.mpi, spy._log)
        return pipe

    monkeypatch.setattr(collective, "_pipe", spied_pipe)
    for n in (1000, 70_000):
        for _ in range(2):
            compressed_allreduce(comm, tensor(data(R, (n,), "float32")), codec="ef+nvfp4", segment_bytes=16 << 10)
    sends = [i for i, e in enumerate(events) if e in ("mpi Isend", "mpi Iallgather")]
    assert sends, events
    for i in sends:
        last_ready = max(j for j in range(i) if events[j] == "ready")
        assert "kernel" not in events[last_ready:i], (i, events[max(0, i - 12):i + 1])
    # every call readies before its first receive (earlier calls' decoding may read those buffers)
    if P > 1:
        firsts = [i for i, e in enumerate(events) if e == "mpi Irecv" and events[i - 1] != "mpi Irecv"
                  and "mpi Irecv" not in events[max(0, i - 3):i]]
        assert all("ready" in events[max(0, i - 2):i] for i in firsts[:1]), events[:20]


# ---------------------------------------------------------------- fusion and DistributedOptimizer
@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("codec", [None, "fp8-e4m3"])
def test_fusion_buckets_stay_on_the_tensors_device_and_reduce_on_its_path(mode, codec, monkeypatch):
    from commwire.fusion import FusionBuffer

    comm = COMMS[mode]
    ops = type(arrays.device_ops(torch.ones(1)))
    seen = {"to_host": 0, "synchronize": 0}
    for name in seen:
        real = getattr(ops, name)

        def counted(self, *args, _real=real, _name=name):
            seen[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(ops, name, counted)
    tensors = [("w", torch.zeros(300, 4)), ("b", torch.zeros(300))]
    fb = FusionBuffer(tensors, comm=comm, op="avg", codec=codec, threshold_bytes=1 << 20)
    assert all(b.buffer.device == torch.device("cpu") and isinstance(b.buffer, torch.Tensor) for b in fb.buckets)
    fb.add("w", torch.full((300, 4), float(R)))
    fb.add("b", torch.full((300,), float(R + 1)))
    got = fb.wait()
    tol = 0 if codec is None else 0.1
    np.testing.assert_allclose(got["w"].numpy(), np.full((300, 4), (P - 1) / 2), atol=tol)
    np.testing.assert_allclose(got["b"].numpy(), np.full(300, (P + 1) / 2), atol=tol)
    if codec is None:
        assert seen["synchronize" if mode == "direct" else "to_host"] > 0, seen
        assert seen["to_host" if mode == "direct" else "synchronize"] == 0, seen


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_distributed_optimizer_matches_single_process_training(mode, compression):
    from commwire.torch.optimizer import DistributedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    reference.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               compression=compression, comm=COMMS[mode])
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs, ys = torch.randn(4 * P, 8, generator=gen), torch.randn(4 * P, 1, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs[4 * R:4 * R + 4]), ys[4 * R:4 * R + 4]).backward()
        opt.step()
        ref_opt.zero_grad()
        # the mean of the ranks' mean losses: the gradient DistributedOptimizer averages
        sum(torch.nn.functional.mse_loss(reference(xs[4 * r:4 * r + 4]), ys[4 * r:4 * r + 4])
            for r in range(P)).div(P).backward()
        ref_opt.step()
    tol = 1e-6 if compression == "none" else 2e-3
    for a, b in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=tol)
