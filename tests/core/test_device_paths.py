"""Device paths without a GPU — tier 1 (single process) and tier 2 (launches mpiexec -n 1 and -n 3).

Tier 1 checks the pieces a device path is made of: the order-preserving
integer form of floats that float min/max of device arrays travel in, the
CPU stand-in switch, which codecs run on the device, and the stream ordering
of lane work (``StreamOrder``) against a recording fake of torch's CUDA
streams (the real streams run in tests/gpu). Tier 2 runs tests/core/mpi_device.py,
every collective's device path with torch CPU tensors standing in for CUDA ones.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from mpi_helpers import run_mpi_pytest

import commwire as cw
from commwire.codecs import Codec, ErrorFeedback, HadamardTransform, Pipeline, Transform
from commwire.codecs.collective import compressed_allreduce, device_space, has_device_kernels
from commwire.comm import arrays
from commwire.comm.arrays import StreamOrder, device_ops, stream_order

torch = pytest.importorskip("torch")


@pytest.mark.mpi
# 1 rank (the size-1 shortcuts) and 3 (several peers, uneven splits, not a power of two); the host
# paths run on 1, 2 and 4 ranks in tests/core/test_mpi.py and tests/gpu on whatever a GPU machine
# has. 2 and 4 here added ~230 s to a loaded CI run for no path of their own.
@pytest.mark.parametrize("n", [1, 3])
def test_device_paths_suite(n):
    run_mpi_pytest(n, "tests/core/mpi_device.py", timeout=600)


# ---------------------------------------------------------------- ordered integers
def _special(dtype: type) -> np.ndarray:
    info = np.finfo(dtype)
    return np.array([0.0, -0.0, 1.0, -1.0, info.tiny, -info.tiny, info.smallest_subnormal, -info.smallest_subnormal,
                     info.max, -info.max, np.inf, -np.inf, 3.5, -2.25], dtype=dtype)


@pytest.mark.parametrize("dtype, itype", [(np.float32, np.int32), (np.float64, np.int64)])
def test_ordered_integers_keep_the_float_order_and_invert_exactly(dtype, itype):
    ops = device_ops(torch.ones(1))
    rng = np.random.default_rng(0)
    bits = rng.integers(np.iinfo(itype).min, np.iinfo(itype).max, size=20_000, dtype=itype)
    values = np.concatenate([bits.view(dtype), _special(dtype)])
    values = values[~np.isnan(values)]
    code = ops.ordered(torch.from_numpy(values), "min").numpy()
    assert code.dtype == itype
    order = np.argsort(code, kind="stable")
    assert np.all(np.diff(values[order]) >= 0)  # sorting the integers sorts the floats (-0 before +0)
    back = ops.unordered(torch.from_numpy(code), np.dtype(dtype)).numpy()
    np.testing.assert_array_equal(back.view(itype), values.view(itype))  # bit for bit, signed zeros included


@pytest.mark.parametrize("op", ["min", "max"])
def test_nan_becomes_the_integer_that_wins(op):
    ops = device_ops(torch.ones(1))
    x = torch.tensor([np.nan, -np.nan, -np.inf, np.inf, 0.0], dtype=torch.float32)
    code = ops.ordered(x, op)
    winner = code.min() if op == "min" else code.max()
    assert code[0] == winner and code[1] == winner
    assert torch.isnan(ops.unordered(winner.reshape(1), np.dtype(np.float32))).all()


def test_cpu_standin_makes_torch_cpu_tensors_device_arrays():
    t = torch.ones(2)
    assert not arrays.is_device_array(t)
    with arrays.cpu_standin():
        assert arrays.is_device_array(t)
        assert not arrays.is_device_array(np.ones(2))
        with arrays.cpu_standin(False):
            assert not arrays.is_device_array(t)
        assert arrays.is_device_array(t)
    assert not arrays.is_device_array(t)
    assert stream_order(t, np.ones(1), None, "x") is None  # no CUDA tensor: nothing to order


def test_which_codecs_have_device_kernels():
    for spec in ("fp16", "bf16", "fp8-e4m3", "fp8-e5m2:block=128,sr", "nvfp4", "ef+nvfp4", "hadamard+fp8-e4m3",
                 "ef+hadamard+nvfp4"):
        assert has_device_kernels(cw.codecs.get(spec)), spec
    for spec in ("gift+fp8-e4m3", "gift+nvfp4"):
        assert not has_device_kernels(cw.codecs.get(spec)), spec


class _HostCodec(Codec):
    """float32 bytes on the wire, lossy in name only; records the kind of array each encode gets."""

    def __init__(self):
        super().__init__()
        self.kinds = []

    @property
    def spec(self):
        return f"test-{type(self).__name__}"

    def wire_nbytes(self, n):
        return 4 * n

    def _encode(self, x, out, key):
        self.kinds.append(arrays.kind_of(x))
        if isinstance(x, np.ndarray):
            out[...] = x.view(np.uint8)
        else:
            out.copy_(x.view(torch.uint8))

    def _decode(self, buf, n, out):
        if isinstance(buf, np.ndarray):
            out[...] = buf.view(np.float32)
        else:
            out.copy_(buf.view(torch.float32))
        return out


class _DeviceCodec(_HostCodec):
    device_capable = True


class _HostTransform(Transform):
    @property
    def spec(self):
        return "test-host-transform"

    def forward(self, x, key):
        return x.copy() if isinstance(x, np.ndarray) else x.clone()

    def inverse(self, y, out):
        out[...] = y
        return out


@pytest.mark.parametrize("cls", [_DeviceCodec, _HostCodec])
def test_a_codec_declares_itself_whether_it_runs_on_the_device(cls):
    # A codec from outside commwire's codec modules is on the device exactly when it says so.
    comm = cw.init()
    codec = cls()
    x = torch.arange(1000, dtype=torch.float32)
    with arrays.cpu_standin():
        assert (device_space(comm, codec, x) is not None) is cls.device_capable
        y = compressed_allreduce(comm, x, codec=codec, name=f"declared.{cls.__name__}")
    assert set(codec.kinds) == {"torch" if cls.device_capable else "numpy"}
    assert isinstance(y, torch.Tensor) and torch.equal(y, x)
    # Wrapping stages derive it from every stage they hold.
    assert has_device_kernels(ErrorFeedback(cls())) is cls.device_capable
    assert has_device_kernels(Pipeline(HadamardTransform(), cls())) is cls.device_capable
    assert not has_device_kernels(Pipeline(_HostTransform(), cls()))


# ---------------------------------------------------------------- stream order (recording fake)
class _FakeCuda:
    """Enough of torch.cuda to record how StreamOrder orders work across threads."""

    def __init__(self, log: list):
        self.log = log
        self.local = threading.local()
        self.caller = _Stream("caller", log)

    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.caller)

    def Event(self):  # noqa: N802 - torch's name
        return _Event(self.log)

    def Stream(self, device=None):  # noqa: N802 - torch's name
        return _Stream("side", self.log)

    def stream(self, s):
        fake = self

        class _Context:
            def __enter__(self):
                fake.local.stream = s

            def __exit__(self, *exc):
                del fake.local.stream

        return _Context()


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.recorded_on))


class _Event:
    count = 0

    def __init__(self, log):
        self.log, self.recorded_on = log, None

    def record(self, stream):
        self.recorded_on = stream.name
        self.log.append(("record", stream.name))


class _FakeTensor:
    is_cuda = True

    def __init__(self, log):
        self.log = log

    def record_stream(self, stream):
        self.log.append(("record_stream", stream.name))


class _FakeTorch:
    def __init__(self, log):
        self.cuda = _FakeCuda(log)
        self.Tensor = _FakeTensor


def test_stream_order_on_a_worker_thread(monkeypatch):
    log: list = []
    fake = _FakeTorch(log)
    monkeypatch.setattr(arrays, "_side_streams", {})
    order = StreamOrder(fake, "cuda:0")
    assert log == [("record", "caller")]  # the caller's queued work, up to submission
    seen = []

    def worker():
        with order.worker():
            seen.append(fake.cuda.current_stream().name)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == ["side"]  # the lane's kernels run on the side stream...
    assert log[1] == ("wait", "side", "caller")  # ...which first waits for the caller's event
    assert log[2] == ("record", "side")  # and marks the end of the lane's work
    result = (_FakeTensor(log), np.zeros(2))
    assert order.join(result) is result
    assert log[3:] == [("wait", "caller", "side"), ("record_stream", "caller")]


def test_stream_order_on_the_callers_thread_changes_nothing():
    log: list = []
    fake = _FakeTorch(log)
    order = StreamOrder(fake, "cuda:0")
    with order.worker():
        assert fake.cuda.current_stream().name == "caller"
    assert order.join("result") == "result"
    assert log == [("record", "caller")]


def test_submit_runs_lane_work_inside_the_order_and_joins_at_wait(monkeypatch):
    from commwire.comm import communicator as communicator_module

    comm = cw.init()
    calls = []

    class _Order:
        def worker(self):
            class _Context:
                def __enter__(self):
                    calls.append(("enter", threading.current_thread().name))

                def __exit__(self, *exc):
                    calls.append(("exit",))

            return _Context()

        def join(self, result):
            calls.append(("join", threading.current_thread().name))
            return result

    marker = object()
    monkeypatch.setattr(communicator_module, "stream_order",
                        lambda *values: _Order() if marker in values else None)
    handle = comm.submit(lambda c, x, tag: (c.size, tag), marker, tag="t")
    assert handle.wait() == (comm.size, "t")
    assert calls[0][0] == "enter" and calls[1] == ("exit",)
    assert calls[2] == ("join", threading.current_thread().name)
    if cw.thread_level() == "multiple":
        assert calls[0][1].startswith("commwire-lane")  # ran on the lane thread
    calls.clear()
    assert comm.call(lambda c, x: c.rank, marker) == comm.rank
    assert [c[0] for c in calls] == ["enter", "exit", "join"]
