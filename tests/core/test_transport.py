"""The torch transport (torch.distributed over gloo) against the MPI transport — tier 2 (3 ranks: uneven blocks)."""

from __future__ import annotations

import threading
import time

import pytest
from mpi_helpers import run_mpi_pytest

pytestmark = pytest.mark.mpi
pytest.importorskip("torch")


def test_torch_transport_suite():
    run_mpi_pytest(3, "tests/core/mpi_transport.py")


RENDEZVOUS = """
import torch, torch.distributed as dist
from mpi4py import MPI
from commwire.comm.torch_transport import init_torch_distributed
init_torch_distributed(MPI.COMM_WORLD, "gloo")
x = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(x)
seen = MPI.COMM_WORLD.gather((dist.get_rank(), dist.get_world_size(), x.tolist()))
dist.destroy_process_group()
if seen:
    print("seen", seen)
"""


def test_rendezvous_with_master_addr():
    # `commwire run --lab` sets MASTER_ADDR: rank 0 must still take part in every collective of the
    # rendezvous (it once skipped one when MASTER_ADDR was set, and the job hung).
    from mpi_helpers import run_mpi

    proc = run_mpi(2, ["-c", RENDEZVOUS], timeout=120, env={"MASTER_ADDR": "127.0.0.1", "COMMWIRE_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seen [(0, 2, [3.0, 3.0, 3.0]), (1, 2, [3.0, 3.0, 3.0])]" in proc.stdout


# Across hosts (faked: spans_nodes says so), rank 0 picks the rendezvous address itself.
ACROSS_HOSTS = """
import sys
from mpi4py import MPI
import commwire.comm.torch_transport as tt
tt.spans_nodes = lambda comm: True
try:
    tt.init_torch_distributed(MPI.COMM_WORLD, "gloo")
    import torch.distributed as dist
    sys.stdout.write(f"joined {dist.get_rank()} of {dist.get_world_size()}\\n")
except RuntimeError as exc:
    sys.stdout.write(f"raised: {exc}\\n")
"""


def test_across_hosts_the_rendezvous_uses_the_named_interface_or_every_rank_raises():
    from mpi_helpers import run_mpi

    proc = run_mpi(2, ["-c", ACROSS_HOSTS], timeout=120, env={"GLOO_SOCKET_IFNAME": "lo", "COMMWIRE_TIMEOUT": "30"})
    assert proc.returncode == 0 and proc.stdout.count("joined") == 2, proc.stdout + proc.stderr
    # An interface rank 0 lacks: every rank raises together (rank 0 alone used to raise; the rest waited).
    proc = run_mpi(2, ["-c", ACROSS_HOSTS], timeout=120,
                   env={"GLOO_SOCKET_IFNAME": "nosuch0", "COMMWIRE_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("raised: rank 0 cannot choose an address for torch.distributed's rendezvous "
                             "(no network interface 'nosuch0'") == 2, proc.stdout


def test_the_rendezvous_address_is_never_the_loopback_a_host_name_maps_to(monkeypatch):
    import socket

    from commwire.comm import torch_transport as tt

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # Debian's /etc/hosts entry
    try:
        address = tt.rendezvous_address()  # the default route's source address
    except OSError as exc:  # no default route on this machine: the error says so
        assert "no default route" in str(exc)
    else:
        assert not address.startswith("127."), address
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.1.2.3")
    assert tt.rendezvous_address() == "10.1.2.3"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^docker,lo")  # an exclusion list names no interface to use
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "l")  # a prefix, as NCCL's are
    assert tt.interface_address("lo") == tt.rendezvous_address() == "127.0.0.1"
    with pytest.raises(OSError, match="no network interface 'nosuch0' on this host"):
        tt.interface_address("nosuch0")


def test_transports_table_shows_the_tuned_segment_of_compressed_rows():
    from commwire.bench.transports import format_table

    row = {"ranks": 4, "bytes": 1 << 20, "median_ms": 5.0, "min_ms": 4.0, "max_ms": 9.0, "GBps": 0.2, "ratio": 1.5}
    table = format_table([{**row, "kind": "fp32", "arm": "commwire torch (gloo)", "baseline": "gloo"},
                          {**row, "kind": "fp8-e4m3", "arm": "commwire torch (gloo)", "baseline": "fp8 on mpi",
                           "segment_bytes": 512 << 10, "cpu_ms": 10.04, "cpu_threads_ms": 3.9}])
    lines = table.splitlines()
    assert lines[0].endswith("| segment KiB | CPU ms, all ranks (other threads) |")
    assert lines[2].endswith("| gloo | - | - |")
    assert lines[3] == ("| 4 | 1 MiB | fp8-e4m3 | commwire torch (gloo) | 5.00 | 4.00–9.00 | 0.200 | 1.500 | "
                        "fp8 on mpi | 512 | 10.0 (3.90) |")


class _Work:
    """A torch Work stand-in that completes after ``polls`` calls of is_completed()."""

    def __init__(self, polls):
        self.polls = polls

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0


class _Flag:
    """An MPI request stand-in that completes after ``tests`` calls of Test()."""

    def __init__(self, tests):
        self.tests = 0
        self.needed = tests

    def Test(self):  # noqa: N802 - mpi4py's name
        self.tests += 1
        return self.tests > self.needed


@pytest.mark.parametrize("flag_tests, data_polls, done", [(2, 50, True), (50, 2, False), (0, 0, True)])
def test_the_torch_transport_moves_the_agreement_flag_on_while_it_waits_for_its_data(flag_tests, data_polls, done):
    # MPI moves the flag only inside MPI calls: the transport tests it until it or the data is complete.
    from commwire.comm.torch_transport import TorchTransport, _Request

    transport = TorchTransport.__new__(TorchTransport)  # no process group needed for the waiting logic
    flag = transport.beside = _Flag(flag_tests)
    transport._move_beside([_Request(_Work(data_polls)), _Request(_Work(10**6), pollable=False)])
    assert flag.tests == (flag_tests + 1 if done else data_polls + 1)
    assert (transport.beside is None) == done  # not done: the collective's next wait (or the protocol) goes on


def test_the_torch_transport_tests_the_flag_once_per_wait_and_progress_when_no_work_can_be_polled():
    # gloo's point-to-point works (the compressed all-reduce's pipeline) cannot be polled: each wait
    # and each progress() between codec kernels tests the flag once, without blocking.
    from commwire.comm.torch_transport import TorchTransport, _Request

    transport = TorchTransport.__new__(TorchTransport)
    flag = transport.beside = _Flag(2)
    transport._move_beside([_Request(_Work(10), pollable=False)])
    assert flag.tests == 1 and transport.beside is flag
    transport.progress(None)
    assert flag.tests == 2 and transport.beside is flag
    transport.progress(None)
    assert flag.tests == 3 and transport.beside is None  # done: not tested again
    transport.progress(None)
    assert flag.tests == 3


class _OneRank:
    """The part of a communicator ``_sample`` uses, for one rank."""

    class mpi:  # noqa: N801 - stands in for an mpi4py communicator
        @staticmethod
        def Barrier():  # noqa: N802 - mpi4py's name
            pass

        @staticmethod
        def allgather(value):
            return [value]


def _spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_transports_samples_count_cpu_time_in_the_calling_thread_and_in_others():
    from commwire.bench.transports import _row, _sample

    cpu = []
    wall = _sample(_OneRank, lambda: _spin(0.05), cpu)

    def in_a_helper_thread():
        helper = threading.Thread(target=_spin, args=(0.05,))
        helper.start()
        helper.join()

    _sample(_OneRank, in_a_helper_thread, cpu)
    (own_total, own_other), (helper_total, helper_other) = cpu
    assert wall >= 0.05 and own_total >= 0.05 and own_other < 0.01  # all of it in the calling thread
    assert helper_total >= 0.05 and helper_other >= 0.05  # all of it in another thread
    row = _row(1, 4, "fp32", "arm", [wall, wall], wall, "arm", 4, cpu)
    assert row["cpu_ms"] == pytest.approx((own_total + helper_total) / 2 * 1e3)
    assert row["cpu_threads_ms"] == pytest.approx((own_other + helper_other) / 2 * 1e3)


def test_transports_samples_of_several_calls_give_the_time_and_cpu_per_call():
    # --calls N: N calls back to back, as a training step's buckets; the sample is their mean.
    from commwire.bench.transports import _sample

    calls, cpu = [], []
    wall = _sample(_OneRank, lambda: (calls.append(1), _spin(0.02)), cpu, calls=4)
    assert len(calls) == 4
    assert 0.02 <= wall < 0.075 and 0.02 <= cpu[0][0] < 0.075  # per call: all four took 0.08 s or more
