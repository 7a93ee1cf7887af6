"""Multi-rank checks of the core — tier 2 (launches mpiexec with 1, 2 and 4 ranks).

Each test starts real MPI processes as subprocesses with a timeout, so a hang
fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_helpers import ROOT, run_mpi, run_mpi_pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n,transport", [(1, "mpi"), (2, "mpi"), (4, "mpi"), (3, "torch")])
def test_collectives_suite(n, transport):
    run_mpi_pytest(n, "tests/core/mpi_collectives.py", transport=transport)


def _commwire(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commwire", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, **kw)


def test_run_prints_sum_on_every_rank():
    code = "import commwire as cw, numpy as np; cw.init(); print(cw.allreduce(np.ones(3) * cw.rank()))"
    proc = _commwire("run", "-np", "4", sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("[6. 6. 6.]") == 4, proc.stdout


def test_failing_rank_aborts_job_fast_with_its_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import commwire as cw, numpy as np\n"
        "cw.init()\n"
        "if cw.rank() == 2:\n"
        "    raise RuntimeError('boom on rank two')\n"
        "cw.allreduce(np.ones(3))\n"
        "cw.barrier()\n"
    )
    start = time.monotonic()
    proc = _commwire("run", "-np", "4", sys.executable, str(script), timeout=30)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 10, elapsed
    assert "rank 2 of 4 raised an unhandled exception" in proc.stderr
    assert "RuntimeError: boom on rank two" in proc.stderr
    assert f'File "{script}", line 4' in proc.stderr


def test_failing_rank_without_commwire_import_still_aborts(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise SystemExit(3)\n"
        "MPI.COMM_WORLD.Barrier()\n"
    )
    start = time.monotonic()
    proc = _commwire("run", "-np", "2", sys.executable, str(script), timeout=30)
    assert proc.returncode != 0
    assert time.monotonic() - start < 10
    assert "rank 1 of 2" in proc.stderr and "SystemExit(3)" in proc.stderr


def test_check_env_flag_reports_mismatch(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(
        "import commwire as cw, numpy as np\n"
        "cw.init()\n"
        "cw.allreduce(np.ones(3 + cw.rank()), name='layer1.weight')\n"
    )
    proc = run_mpi(2, [str(script)], timeout=60, env={"COMMWIRE_CHECK": "1"})
    assert proc.returncode != 0
    assert "shape differs" in proc.stderr and "rank 0: (3,)" in proc.stderr and "rank 1: (4,)" in proc.stderr


def test_bench_allreduce_runs_and_reports_ratio(tmp_path):
    out = tmp_path / "rows.json"
    proc = _commwire("bench", "allreduce", "-np", "2", "--sizes", "8,1M", "--repeats", "2", "--check", "false",
                     "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(lines) == 2, proc.stdout
    ratios = [float(line.split("|")[7]) for line in lines]
    assert all(r > 0 for r in ratios)
    rows = json.loads(out.read_text())
    assert [(r["bytes"], r["check"]) for r in rows] == [(8, False), (1 << 20, False)]
    assert [round(r["ratio"], 2) for r in rows] == ratios


def test_bench_allreduce_codecs_reports_speedup_and_phases():
    proc = _commwire("bench", "allreduce", "-np", "2", "--sizes", "1M", "--repeats", "1",
                     "--codec", "fp8-e4m3,nvfp4", timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[3].strip(): line.split("|") for line in proc.stdout.splitlines()
            if line.startswith("| 2 |")}
    assert set(rows) == {"fp8-e4m3", "nvfp4"}, proc.stdout
    assert 1.0 <= float(rows["fp8-e4m3"][10]) < 1.01 and 0.5625 <= float(rows["nvfp4"][10]) < 0.57
    assert float(rows["fp8-e4m3"][11]) < 0.06 and float(rows["nvfp4"][11]) < 0.2


def test_singleton_without_mpiexec():
    code = ("import commwire as cw, numpy as np; c = cw.init(); assert cw.size() == 1 and cw.rank() == 0; "
            "print(cw.allreduce(np.arange(3.0), op='avg').tolist(), cw.thread_level())")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=Path(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0.0, 1.0, 2.0] multiple"


def _aborted_after_stall(script: Path, n: int = 3) -> subprocess.CompletedProcess:
    """Run ``script`` on ``n`` ranks (it sets a 2 s stall timeout); return the job, checked to have aborted in time."""
    start = time.monotonic()
    proc = _commwire("run", "-np", str(n), sys.executable, str(script), timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - start < 2 + 10
    return proc


def test_watchdog_names_the_missing_rank_and_aborts(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(
        "import commwire as cw, numpy as np, time\n"
        "cw.init(timeout=2)\n"
        "cw.allreduce(np.ones(2), name='warmup')\n"
        "if cw.rank() == 1:\n"
        "    time.sleep(60)\n"
        "cw.allreduce(np.ones(4), name='grad.layer3')\n"
    )
    proc = _aborted_after_stall(script)
    assert "allreduce 'grad.layer3'" in proc.stderr
    assert "missing from this collective: ranks [1]" in proc.stderr
    assert "rank 1: not in any collective; last completed allreduce 'warmup'" in proc.stderr


def test_watchdog_report_on_a_sub_communicator_names_only_its_members(tmp_path):
    # Rank 0 made one more communicator than ranks 1 and 2 before their common one: the members
    # must still name it alike (the report once called rank 0, inside it, missing), and rank 3,
    # no member, is not missing from it.
    script = tmp_path / "sub.py"
    script.write_text(
        "import commwire as cw, numpy as np, time\n"
        "world = cw.init(timeout=2)\n"
        "alone = world.new_group([0])\n"
        "three = world.new_group([0, 1, 2])\n"
        "if cw.rank() in (0, 1):\n"
        "    three.allreduce(np.ones(1), name='stuck')\n"
        "time.sleep(60)\n"
    )
    proc = _aborted_after_stall(script, n=4)
    assert "world ranks [0, 1, 2]); timeout 2 s" in proc.stderr, proc.stderr
    assert "rank 0: in the same collective" in proc.stderr and "rank 1: in the same collective" in proc.stderr
    assert "missing from this collective: ranks [2]\n" in proc.stderr, proc.stderr
    assert "rank 3:" not in proc.stderr


def test_watchdog_report_is_the_same_for_stepped_and_lane_collectives(tmp_path):
    # Rank 0 moves its all-reduces on its own thread (Communicator.start, polled with test()),
    # rank 2 runs them on the lane: both must be seen in the same collective, under its name,
    # while rank 1 is late; a polling rank must be watched too.
    script = tmp_path / "stepped_stall.py"
    script.write_text(
        "import commwire as cw, numpy as np, time\n"
        "from commwire.comm.communicator import Communicator\n"
        "world = cw.init(timeout=2)\n"
        "arrays = {'big': np.ones(1 << 16), 'small': np.ones(4)}  # the flag beside the data; in it\n"
        "for name, a in arrays.items():\n"
        "    world.allreduce_async(a, name=name).wait()  # agreed: later calls may step\n"
        "for i in range(3):\n"
        "    if cw.rank() == 1 and i == 2:\n"
        "        time.sleep(60)\n"
        "    for name, a in arrays.items():\n"
        "        if cw.rank() == 0:\n"
        "            h = world.start(Communicator.allreduce_steps, Communicator.allreduce, a, name=name)\n"
        "            assert type(h).__name__ == '_Stepped', h\n"
        "            while not h.test():\n"
        "                time.sleep(0.001)\n"
        "        else:\n"
        "            h = world.allreduce_async(a, name=name)\n"
        "        assert h.wait()[0] == 3.0\n"
    )
    proc = _aborted_after_stall(script)
    reports = [block for block in proc.stderr.split("commwire watchdog: ")[1:]]
    assert reports, proc.stderr
    for report in reports:
        assert report.startswith(("rank 0 has waited", "rank 2 has waited")), report
        assert " in allreduce 'big' " in report.splitlines()[0], report
        assert "missing from this collective: ranks [1]" in report, report
        assert "rank 1: not in any collective; last completed allreduce 'small'" in report, report
        assert report.count("in the same collective") == 2, report  # ranks 0 and 2
    assert "stepped" not in proc.stderr


def test_rank_left_in_a_collective_after_its_peers_ended_aborts_at_once(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(
        "import commwire as cw, numpy as np\n"
        "cw.init(timeout=120)\n"
        "cw.allreduce(np.ones(2), name='warmup')\n"
        "for i in range(3 if cw.rank() == 1 else 2):  # a loop that ends early on some ranks\n"
        "    cw.allreduce(np.ones(4), name='step')\n"
    )
    start = time.monotonic()
    proc = _commwire("run", "-np", "3", sys.executable, str(script), timeout=100)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60  # far below the 120 s stall timeout
    assert "ranks [0, 2] of this collective have ended their program" in proc.stderr, proc.stderr
    assert "rank 0: program ended (finalize or exit) without joining this collective" in proc.stderr


def test_ranks_outside_a_sub_communicator_may_end_first(tmp_path):
    script = tmp_path / "subset.py"
    script.write_text(
        "import commwire as cw, numpy as np, time\n"
        "world = cw.init(timeout=120)\n"
        "pair = world.split(color=int(cw.rank() < 2))\n"
        "if cw.rank() < 2:\n"
        "    for i in range(2):\n"
        "        if cw.rank() == 0:\n"
        "            time.sleep(3)  # rank 1 waits longer than the grace while rank 2 has ended\n"
        "        print('sum', pair.allreduce(np.ones(1), name='pair')[0], flush=True)\n"
    )
    proc = _commwire("run", "-np", "3", sys.executable, str(script), timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("sum 2.0") == 4, proc.stdout


def test_mpi_that_commwire_initialised_is_finalised_at_exit(tmp_path):
    # With mpi4py.rc.initialize = False (as Horovod's tests set it) commwire calls MPI_Init itself,
    # and mpi4py leaves such an MPI unfinalised: the launcher took rank 0's exit for a crash and
    # killed rank 2 before it could print.
    script = tmp_path / "late.py"
    script.write_text(
        "import mpi4py, time\n"
        "mpi4py.rc.initialize = False\n"
        "import commwire as cw, numpy as np\n"
        "cw.init()\n"
        "total = cw.allreduce(np.ones(1))[0]\n"
        "cw.finalize()\n"
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 2:\n"
        "    time.sleep(3)\n"
        "    print('late rank done', total, flush=True)\n"
    )
    proc = run_mpi(3, [str(script)], timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "late rank done 3.0" in proc.stdout, proc.stdout + proc.stderr


def test_watchdog_warn_mode_lets_a_slow_rank_finish(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(
        "import commwire as cw, numpy as np, time\n"
        "cw.init(timeout=1, on_stall='warn')\n"
        "if cw.rank() == 0:\n"
        "    time.sleep(2.5)\n"
        "print('sum', cw.allreduce(np.ones(1), name='late')[0])\n"
    )
    proc = _commwire("run", "-np", "2", sys.executable, str(script), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("sum") == 2 and proc.stdout.count("2.0") == 2, proc.stdout  # lines may interleave
    assert "missing from this collective: ranks [0]" in proc.stderr and "continuing to wait" in proc.stderr


def test_killed_rank_is_named_and_nothing_is_left_running(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(
        "import commwire as cw, numpy as np, os, signal\n"
        "cw.init()\n"
        "for i in range(400):\n"
        "    if cw.rank() == 1 and i == 20:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    cw.allreduce(np.ones(1 << 14), name=f'step{i}')\n"
    )
    start = time.monotonic()
    proc = _commwire("run", "-np", "3", sys.executable, str(script), timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - start < 10
    first = [line for line in proc.stderr.splitlines() if "died first" in line]
    assert len(first) == 1 and first[0].strip().startswith("rank 1 "), proc.stderr
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
