"""Jobs started by torch's launchers, which do not start MPI, and torchrun's scripts under commwire run
— tier 2 (several processes).

torchrun (or ``torch.multiprocessing``) starts every process as a world of 1 for MPI: commwire must say
so on each of them instead of letting each train alone. The other way round, a script written for
torchrun runs unchanged under ``commwire run``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi

_MPI_LAUNCHED = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMI_PORT", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                 "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _MPI_LAUNCHED} | {"PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_torchrun_job_is_refused_on_every_rank(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import commwire.torch as hvd
        hvd.init()
        print("trained alone on rank", hvd.rank(), "of", hvd.size(), flush=True)
    """))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port()), str(script)]
    proc = subprocess.run(torchrun, env=_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "trained alone" not in out
    said = "torchrun started this process as one of 2 (WORLD_SIZE=2), but MPI made it a world of 1"
    assert out.count(said) == 2, out[-3000:]  # each rank says it
    assert out.count("commwire run -np 2 python") == 2


def test_processes_joined_by_torch_distributed_alone_are_refused(tmp_path):
    # torch.multiprocessing-style: the processes meet in torch.distributed (no launcher variables), MPI never.
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent("""
        import sys
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
        import commwire
        try:
            commwire.init()
        except RuntimeError as exc:
            print("refused:", exc, flush=True)
        dist.destroy_process_group()
    """))
    url = f"tcp://127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), url, str(r)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, out in enumerate(outs):
        assert procs[rank].returncode == 0, out[-3000:]
        assert ("refused: torch.distributed started this process as one of 2 (torch.distributed.get_world_size() "
                "= 2), but MPI made it a world of 1") in out, out[-3000:]


@pytest.mark.parametrize("elastic", [[], ["--min-np", "1", "--max-np", "2", "-H", "localhost:2"]],
                         ids=["plain", "elastic"])
def test_a_script_written_for_torchrun_runs_under_commwire_run(tmp_path, elastic):
    # init_process_group() with env:// and LOCAL_RANK from the environment, as torchrun's scripts do;
    # then commwire's DDP hook: each rank's gradient is the average of every rank's, computed apart.
    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent("""
        import os
        import torch
        import torch.distributed as dist
        import commwire.torch as hvd

        dist.init_process_group("gloo")
        hvd.init()
        assert (dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])) == \
            (hvd.rank(), hvd.size(), hvd.local_rank())
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*hvd.ddp_hook("none", model=ddp))
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(hvd.size())]
        ddp(xs[hvd.rank()]).sum().backward()
        w = model.weight.detach().clone().requires_grad_()
        sum(torch.nn.functional.linear(x, w, model.bias.detach()).sum() for x in xs).backward()
        torch.testing.assert_close(model.weight.grad, w.grad / hvd.size(), rtol=1e-6, atol=1e-7)
        print("same gradient on rank", hvd.rank(), flush=True)
    """))
    run = [sys.executable, "-m", "commwire", "run", "-np", "2", *elastic, sys.executable, str(script)]
    proc = subprocess.run(run, env=_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("same gradient on rank") == 2, out[-3000:]


def test_horovodrun_options_gloo_timestamps_and_no_stall_check_take_effect(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""
        import commwire, commwire.torch as hvd
        hvd.init()
        print("transport", commwire.world().transport.name, "watchdog", commwire.world().watchdog is not None)
    """))
    run = [sys.executable, "-m", "commwire", "run", "-np", "2", "--gloo", "-prefix-timestamp", "--no-stall-check",
           sys.executable, str(script)]
    proc = subprocess.run(run, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "transport" in ln]
    stamp = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"  # time.asctime(), as horovodrun's
    found = [re.fullmatch(rf"{stamp}\[(\d)\]<stdout>:transport torch watchdog False", ln) for ln in lines]
    assert all(found) and sorted(m.group(1) for m in found) == ["0", "1"], lines
