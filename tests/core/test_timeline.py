"""The Chrome-trace timeline: streamed to disk as it is recorded, merged on rank 0, kept when a job dies.

One-rank tests drive ``Timeline`` in this process; the rest start real MPI jobs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from mpi_helpers import run_mpi

from commwire.comm import timeline as tl
from commwire.comm.runtime import timeline_path


def read_trace(path: Path) -> list[dict]:
    """Parse a timeline file, closed or not (Chrome's array format allows a missing ']')."""
    text = path.read_text().rstrip()
    return json.loads(text if text.endswith("]") else text + "]")


def test_each_event_is_in_the_file_as_soon_as_it_is_recorded(tmp_path):
    path = tmp_path / "sub" / "trace.json"
    recorder = tl.Timeline(str(path), 0)
    try:
        t = time.perf_counter()
        recorder.add("layer1.weight", t, t + 0.002, op="allreduce", bytes=64)
        meta, event = read_trace(path)
        assert meta == {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}}
        assert event["name"] == "layer1.weight" and event["ph"] == "X" and event["pid"] == 0
        assert event["args"] == {"op": "allreduce", "bytes": 64}
        assert event["dur"] == pytest.approx(2000.0, rel=1e-6)
        assert abs(event["ts"] / 1e6 - time.time()) < 60  # wall-clock microseconds
    finally:
        recorder.close()
    assert path.read_text().rstrip().endswith("]")
    assert len(json.loads(path.read_text())) == 2


def test_memory_does_not_grow_with_the_events(tmp_path):
    recorder = tl.Timeline(str(tmp_path / "trace.json"), 0)
    t = time.perf_counter()
    for i in range(20_000):
        recorder.add("g", t, t + 1e-6, op="allreduce", bytes=8)
    assert not any(isinstance(v, list) for v in vars(recorder).values())  # nothing kept per event
    assert len(read_trace(tmp_path / "trace.json")) == 20_001
    recorder.close()


def test_a_failed_write_stops_the_timeline_with_one_warning(tmp_path):
    recorder = tl.Timeline(str(tmp_path / "trace.json"), 0)
    os.close(recorder._fd)  # the file went away under it (disk full, unmounted...)
    t = time.perf_counter()
    with pytest.warns(UserWarning, match="no more events are recorded on rank 0"):
        recorder.add("g", t, t)
    recorder.add("g", t, t)  # no second warning, no exception
    recorder.close()


def test_each_launch_and_reformed_world_of_an_elastic_job_has_its_own_timeline():
    assert timeline_path("/x/trace.json", 0, 0) == "/x/trace.json"
    assert timeline_path("/x/trace.json", 0, 1) == "/x/trace.reset1.json"
    assert timeline_path("/x/trace.json", 2, 0) == "/x/trace.launch2.json"
    assert timeline_path("trace", 1, 3) == "trace.launch1.reset3"


def _job(tmp_path: Path, code: str, n: int = 2, env: dict | None = None):
    script = tmp_path / "job.py"
    script.write_text(code)
    return run_mpi(n, [str(script)], timeout=120, env=env)


@pytest.mark.mpi
def test_ranks_merge_into_one_track_each_and_leave_no_parts(tmp_path):
    path = tmp_path / "trace.json"
    proc = _job(tmp_path, "import commwire as cw, numpy as np\n"
                          "cw.init()\n"
                          "[cw.allreduce(np.ones(8), name='grad') for _ in range(3)]\n"
                          "cw.allgather(np.ones(2))\n"
                          "cw.finalize()\n", n=3, env={"COMMWIRE_TIMELINE": str(path)})
    assert proc.returncode == 0, proc.stderr
    trace = json.loads(path.read_text())
    events = [e for e in trace if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert sorted(e["pid"] for e in events if e["name"] == "grad") == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert {e["name"] for e in events} == {"grad", "allgather"}
    assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in events)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "trace.json"]


@pytest.mark.mpi
def test_rank_zeros_path_names_the_timeline_as_horovods_does(tmp_path):
    # Horovod's own timeline test gives every rank a path of its own; rank 0's is the timeline.
    code = ("import os, sys, commwire as cw, numpy as np\n"
            "from mpi4py import MPI\n"
            f"root = {str(tmp_path)!r}\n"
            "os.environ['COMMWIRE_TIMELINE'] = os.path.join(root, f'r{MPI.COMM_WORLD.rank}', 't.json')\n"
            "cw.init()\n"
            "cw.allreduce(np.ones(3), name='test_allreduce')\n"
            "cw.finalize()\n")
    proc = _job(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((tmp_path / "r0" / "t.json").read_text())
    assert sorted(e["pid"] for e in trace if e.get("name") == "test_allreduce") == [0, 1]
    assert not (tmp_path / "r1" / "t.json").exists() and not list((tmp_path / "r1").iterdir())


@pytest.mark.mpi
def test_a_timeline_rank_0_cannot_write_fails_on_every_rank(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    proc = _job(tmp_path, "import sys, commwire as cw\n"
                          "try:\n"
                          f"    cw.init(timeline={str(tmp_path / 'file' / 'trace.json')!r})\n"
                          "except OSError as exc:\n"
                          "    sys.stdout.write(f'raised: {exc}\\n')\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("raised: the timeline could not be started (rank 0: cannot write the timeline") == 2, \
        proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "job.py"]


@pytest.mark.mpi
def test_start_timeline_switches_files_as_horovods_does(tmp_path):
    code = ("import commwire as cw, numpy as np\n"
            "from commwire.comm import runtime\n"
            "cw.init()\n"
            "runtime.stop_timeline()\n"  # none running: nothing to do
            "cw.allreduce(np.ones(2), name='before')\n"
            f"runtime.start_timeline({str(tmp_path / 'a.json')!r})\n"
            "cw.allreduce(np.ones(2), name='first')\n"
            f"runtime.start_timeline({str(tmp_path / 'b.json')!r})\n"
            "cw.allreduce(np.ones(2), name='second')\n"
            "runtime.stop_timeline()\n"
            "cw.allreduce(np.ones(2), name='after')\n"
            "runtime.stop_timeline()\n")
    proc = _job(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    for file, name in (("a.json", "first"), ("b.json", "second")):
        trace = json.loads((tmp_path / file).read_text())
        assert sorted(e["pid"] for e in trace if e["ph"] == "X") == [0, 1], (file, trace)
        assert {e["name"] for e in trace if e["ph"] == "X"} == {name}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "job.py"]


@pytest.mark.mpi
def test_a_job_that_dies_leaves_every_ranks_events_on_disk(tmp_path):
    path = tmp_path / "trace.json"
    # Rank 1 is killed outright (no Python code runs after it); the launcher then kills rank 0.
    code = ("import os, signal, commwire as cw, numpy as np\n"
            f"cw.init(timeline={str(path)!r})\n"
            "for _ in range(5):\n"
            "    cw.allreduce(np.ones(4), name='step')\n"
            "if cw.rank() == 1:\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "cw.barrier()\n")
    proc = _job(tmp_path, code)
    assert proc.returncode != 0
    mine = read_trace(path)
    part = read_trace(Path(tl.part_path(str(path), 1)))
    assert [e["pid"] for e in mine if e.get("name") == "step"] == [0] * 5
    assert [e["pid"] for e in part if e.get("name") == "step"] == [1] * 5


@pytest.mark.mpi
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_rank_memory_stays_flat_over_many_calls(tmp_path):
    code = ("import sys, commwire as cw, numpy as np\n"
            f"cw.init(timeline={str(tmp_path / 't.json')!r})\n"
            "def rss():\n"
            "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
            "x = np.ones(2)\n"
            "for _ in range(2000):\n"
            "    cw.allreduce(x, name='warm')\n"
            "before = rss()\n"
            "for _ in range(30000):\n"
            "    cw.allreduce(x, name='g')\n"
            "sys.stdout.write(f'grew {rss() - before}\\n')\n"
            "cw.finalize()\n")
    proc = _job(tmp_path, code)
    assert proc.returncode == 0, proc.stderr
    grew = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("grew")]
    # 30,000 events held in memory took about 17 MB per rank (580 B each); streamed, under 4 MB
    assert len(grew) == 2 and max(grew) < 4 << 20, grew
    assert len([e for e in json.loads((tmp_path / "t.json").read_text()) if e.get("name") == "g"]) == 60000


@pytest.mark.mpi
def test_the_cost_benchmark_reports_both_arms(tmp_path):
    path = tmp_path / "t.json"
    proc = run_mpi(2, ["benchmarks/timeline_cost.py", "--calls", "500", "--path", str(path)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line[:7] for line in lines] == ["rank 0:", "rank 1:"], proc.stdout
    assert all("500 calls; no timeline" in line and "us/call (" in line for line in lines)
    assert lines[0].endswith("1002 events")  # 2 tracks' names and 2 x 500 calls; the warm-up is not recorded


@pytest.mark.mpi
def test_rank_0_failing_to_write_the_merge_leaves_no_rank_waiting(tmp_path):
    # Rank 0's file turns unwritable (a full disk, say) just before the other ranks hand it their parts.
    code = ("import os, commwire as cw, numpy as np\n"
            "from commwire.comm import runtime\n"
            f"cw.init(timeline={str(tmp_path / 't.json')!r})\n"
            "for _ in range(3):\n"
            "    cw.allreduce(np.ones(64), name='g')\n"
            "recorder = runtime.world().timeline\n"
            "if cw.rank() == 0:\n"
            "    recorder._fd = os.open(recorder.file, os.O_RDONLY)  # writes now fail\n"
            "cw.finalize()\n"
            "print('finished', flush=True)\n")
    proc = _job(tmp_path, code, n=3)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("finished") == 3
    assert "the other ranks' events are not all in it" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.py", "t.json"]
