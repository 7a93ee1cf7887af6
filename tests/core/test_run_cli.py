"""`commwire run` as horovodrun: its options, whole tagged output lines, one-line errors.

Tier 1 tests call ``commwire.cli.main`` in this process (nothing is launched,
or only ``--dry-run``); tier 2 tests (marked ``mpi``) start real ``commwire
run`` jobs of 2-4 ranks as subprocesses with a timeout, so a hang fails the
test instead of the suite.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mpi_helpers import ROOT, mpiexec_path

from commwire import _rankmain, launch
from commwire.cli import main

HYDRA = launch.Launcher(kind="mpich", path="/opt/mpich/bin/mpiexec")
OMPI = launch.Launcher(kind="openmpi", path="/opt/ompi/bin/mpirun")
SLURM = launch.Launcher(kind="slurm", path="/usr/bin/srun")
TAGGED = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)")


def _commwire(*args: str, timeout: float = 90, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'commwire[mpich]'")
    return subprocess.run([sys.executable, "-m", "commwire", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def _by_rank(text: str, stream: str) -> dict[int, list[str]]:
    """Split tagged output into each rank's lines; fail on a line that is not tagged with this stream."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        match = TAGGED.fullmatch(line)
        assert match and match.group(2) == stream, f"untagged or mistagged line: {line[:200]!r}"
        lines.setdefault(int(match.group(1)), []).append(match.group(3))
    return lines


# --------------------------------------------------------------------------- tier 1: hosts and options


def test_hostfile_formats_parse_to_the_same_pairs(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# horovodrun / Open MPI style\naa slots=2\nbb slots=4 max_slots=8  # big\n\ncc:3\ndd\n")
    assert launch.parse_hostfile(str(path)) == [("aa", 2), ("bb", 4), ("cc", 3), ("dd", 1)]


@pytest.mark.parametrize("text", ["aa slots=x\n", "aa slots=0\n", "aa cpus=2\n", "# only a comment\n"])
def test_hostfile_errors_name_the_line(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"hosts(:1|' names no host)"):
        launch.parse_hostfile(str(path))


@pytest.mark.parametrize("launcher,want", [
    (HYDRA, ["-hosts", "aa:2,bb:2"]),
    (OMPI, ["-H", "aa:2,bb:2"]),
    (SLURM, ["--nodelist=aa,bb"]),
])
def test_hostfile_reaches_every_launcher_in_its_own_syntax(tmp_path, launcher, want):
    path = tmp_path / "hosts"
    path.write_text("aa slots=2\nbb slots=2\n")
    from_file = launch.build_command(launcher, 4, ["python", "t.py"], hostfile=str(path))
    from_flag = launch.build_command(launcher, 4, ["python", "t.py"], hosts="aa:2,bb:2")
    assert from_file == from_flag
    assert want == from_file[from_file.index(want[0]):from_file.index(want[0]) + len(want)]


def test_dry_run_maps_hosts_and_horovodrun_options(capsys, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("aa slots=2\nbb slots=2\n")
    args = ["run", "--dry-run", "--launcher", "mpich", "-np", "4", "-hostfile", str(hostfile),
            "--fusion-threshold-mb", "32", "--cycle-time-ms", "3.5", "--timeline-filename", "tl.json",
            "--output-filename", str(tmp_path / "logs"), "python", "train.py", "--lr", "1"]
    if main(args) != 0:
        pytest.skip("no MPICH launcher here: " + capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "-n 4 -hosts aa:2,bb:2" in out
    assert "HOROVOD_FUSION_THRESHOLD 33554432" in out and "HOROVOD_CYCLE_TIME 3.5" in out
    assert f"COMMWIRE_TIMELINE {os.path.abspath('tl.json')}" in out
    assert out.strip().endswith(f"python -m commwire._rankmain --tag-output --output-dir {tmp_path / 'logs'} "
                                "train.py --lr 1")


def test_dry_run_takes_horovodruns_other_options(capsys):
    args = ["run", "--dry-run", "--launcher", "mpich", "-np", "2", "-H", "n1:1,n2:1", "--mpi",
            "--network-interface", "eth1", "-p", "2222", "-i", "/keys/id", "--binding-args", "-bind-to core",
            "--no-stall-check", "--stall-check-warning-time-seconds", "30", "--cache-capacity", "0",
            "--hierarchical-allreduce", "--no-autotune", "--log-level", "info", "--log-without-timestamp",
            "--tcp", "--disable-cache", "-prefix-timestamp", "python", "t.py"]
    if main(args) != 0:
        pytest.skip("no MPICH launcher here: " + capsys.readouterr().err)
    out = capsys.readouterr().out
    for variable, value in [("HOROVOD_STALL_CHECK_DISABLE", "1"), ("HOROVOD_STALL_CHECK_TIME_SECONDS", "30"),
                            ("HOROVOD_CACHE_CAPACITY", "0"), ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1"),
                            ("HOROVOD_AUTOTUNE", "0"), ("HOROVOD_LOG_LEVEL", "INFO"), ("HOROVOD_LOG_HIDE_TIME", "1"),
                            ("NCCL_IB_DISABLE", "1"), ("GLOO_SOCKET_IFNAME", "eth1"), ("NCCL_SOCKET_IFNAME", "eth1")]:
        assert f"-genv {variable} {value} " in out, (variable, out)
    # MPICH's Hydra (5.0 here) has no -bootstrap-exec-args: ssh's arguments go in HYDRA_LAUNCHER_EXTRA_ARGS
    assert out.startswith("env 'HYDRA_LAUNCHER_EXTRA_ARGS=-p 2222 -i /keys/id' "), out
    assert "-iface eth1 -launcher ssh -bind-to core python" in out
    assert out.strip().endswith("python -m commwire._rankmain --tag-output --timestamp-output t.py")
    assert "COMMWIRE_TRANSPORT" not in out


def test_horovodruns_options_for_open_mpi_and_the_ones_refused(capsys):
    from commwire.cli import horovodrun

    values = {"nics": ("eth0,eth1",), "ssh_port": 2222, "ssh_identity_file": None, "binding_args": "--bind-to core"}
    assert horovodrun.launcher_args("openmpi", values) == [
        "--mca", "btl_tcp_if_include", "eth0,eth1", "--mca", "oob_tcp_if_include", "eth0,eth1",
        "--mca", "plm_rsh_args", "-p 2222", "--bind-to", "core"]
    assert horovodrun.environment({"use_gloo": True, "nics": ("eth0", "eth1")}) == {
        "COMMWIRE_TRANSPORT": "torch", "GLOO_SOCKET_IFNAME": "eth0,eth1", "NCCL_SOCKET_IFNAME": "eth0,eth1"}
    with pytest.raises(ValueError, match="srun starts the ranks without ssh"):
        horovodrun.launcher_args("slurm", {"ssh_port": 22})
    ssh = {"ssh_port": 2222, "ssh_identity_file": "/k"}
    assert horovodrun.launcher_args("intel", ssh) == ["-bootstrap", "ssh", "-bootstrap-exec-args", "-p 2222 -i /k"]
    assert horovodrun.launcher_prefix("intel", ssh) == horovodrun.launcher_prefix("openmpi", ssh) == []
    assert horovodrun.launcher_prefix("mpich", ssh) == ["env", "HYDRA_LAUNCHER_EXTRA_ARGS=-p 2222 -i /k"]
    for extra, why in [(["--jsrun"], "start the job with jsrun itself"), (["--config-file", "c.yaml"], "YAML"),
                       (["--gloo", "--mpi"], "choose one"), (["--lab", "-p", "22"], "--lab sets up its own")]:
        assert main(["run", "--dry-run", "-np", "2", *extra, "python", "t.py"]) != 0
        assert why in capsys.readouterr().err
    status = main(["run", "--dry-run", "--launcher", "mpich", "-np", "2", "--network-interface", "a",
                   "--network-interface", "b", "python", "t.py"])
    err = capsys.readouterr().err
    assert status != 0 and ("take one interface" in err or "no MPI launcher" in err), err


def test_dry_run_hosts_flag_and_no_tag_output(capsys):
    if main(["run", "--dry-run", "--launcher", "mpich", "-np", "4", "-H", "n1:2,n2:2", "--no-tag-output",
             "python", "t.py"]) != 0:
        pytest.skip("no MPICH launcher here: " + capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "-hosts n1:2,n2:2" in out and out.strip().endswith("python -m commwire._rankmain t.py")


def test_verbose_prints_command_and_added_environment(capsys):
    status = main(["run", "--dry-run", "--verbose", "-np", "2", "--cycle-time-ms", "5", "python", "t.py"])
    err = capsys.readouterr().err
    if "no MPI launcher found" in err:
        pytest.skip(err)
    assert status == 0, err
    assert "commwire run: launcher command: " in err and "commwire._rankmain --tag-output t.py" in err
    assert "HOROVOD_CYCLE_TIME=5" in err and "COMMWIRE_RUN=1" in err and "start timeout: 60 s" in err


def test_a_job_on_this_machine_gets_torchs_rendezvous_and_one_across_hosts_does_not(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    status = main(["run", "--dry-run", "--verbose", "-np", "2", "python", "t.py"])
    err = capsys.readouterr().err
    if "no MPI launcher found" in err:
        pytest.skip(err)
    assert status == 0, err
    port = int(err.split("MASTER_PORT=")[1].split()[0])
    assert "MASTER_ADDR=127.0.0.1" in err and 0 < port < 65536
    monkeypatch.setenv("MASTER_PORT", "29999")  # the user's own win
    main(["run", "--dry-run", "--verbose", "-np", "2", "python", "t.py"])
    assert "MASTER_PORT" not in capsys.readouterr().err.split("environment added:")[1]
    main(["run", "--dry-run", "--verbose", "--launcher", "mpich", "-np", "4", "-H", "n1:2,n2:2", "python", "t.py"])
    assert "MASTER_ADDR" not in capsys.readouterr().err


@pytest.mark.parametrize("cmd,options,want", [
    (["python", "t.py"], ["--tag-output"], ["python", "-m", "commwire._rankmain", "--tag-output", "t.py"]),
    (["./a.out", "x"], ["--tag-output"], [sys.executable, "-m", "commwire._rankmain", "--tag-output", "--exec",
                                          "./a.out", "x"]),
    (["./a.out", "x"], [], ["./a.out", "x"]),
    (["python"], ["--tag-output"], ["python"]),
])
def test_wrap_program(cmd, options, want):
    assert launch.wrap_program(cmd, options) == want


# --------------------------------------------------------------------------- tier 1: one-line errors


@pytest.mark.parametrize("args,message", [
    (["run"], "no command given; e.g. commwire run -np 4 python train.py"),
    (["run", "-np", "2"], "no command given"),
    (["run", "-np", "2", "--bogus", "python", "x.py"], "no such option: --bogus"),
    (["run", "-np", "2", "--verbos", "python", "x.py"], "no such option: --verbos; did you mean --verbose?"),
    (["run", "-np", "2", "--fusion-threshold=4", "python", "x.py"], "did you mean --fusion-threshold-mb"),
    (["run", "-np", "2", "no-such-program-xyz"], "program 'no-such-program-xyz' not found on PATH"),
    (["run", "-np", "2", "./no-such-program-xyz"], "program './no-such-program-xyz' not found"),
    (["run", "-np", "2", "python", "no_such_script.py"], "python script 'no_such_script.py' not found"),
    (["run", "-np", "2", sys.executable, "-m", "no_such_module_xyz"], "finds no module 'no_such_module_xyz'"),
    (["run", "-np", "0", "python", "x.py"], "0 is not in the range x>=1"),
    (["run", "-H", "a:x", "python", "x.py"], "host entry 'a:x' is not HOST or HOST:SLOTS"),
    (["run", "--hostfile", "no/such/hostfile", "python", "x.py"], "hostfile 'no/such/hostfile' cannot be read"),
    (["run", "--fusion-threshold-mb", "-1", "python", "x.py"], "-1 is not in the range x>=0"),
    (["run", "--no-wrap", "--output-filename", "d", "python", "x.py"], "drop --no-wrap"),
    (["bench", "allreduce", "--sizes", "3"], "--sizes: size '3' is below one float32 (4 bytes); give sizes"),
    (["bench", "allreduce", "-np", "2", "--sizes", "8,3"], "size '3' is below one float32"),
    (["bench", "allreduce", "--sizes", "1Q"], "size '1Q' is not a byte count"),
    (["bench", "allreduce", "--codec", "nope"], "--codec: unknown codec 'nope'"),
    (["bench", "codecs", "--bogus"], "unrecognized arguments: --bogus (commwire bench codecs -- --help"),
    (["bench", "glm", "-np", "2", "--datasets", "nope"], "--datasets: data set 'nope' is unknown; choose from"),
    (["bench", "faults", "--scenarios", "nope"], "unknown scenarios ['nope']; choose from"),
    (["bench", "nope"], "'nope' is not one of 'agreement', 'allreduce'"),
    (["bench", "lordo", "-np", "4", "--quick"], "from a checkout of the repository run: commwire run -np N python "
                                                "benchmarks/lordo.py"),
    (["bench", "gift", "--quick"], "commwire run -np N python benchmarks/gift.py"),
    (["bench", "calibrate"], "python benchmarks/calibrate.py"),
    (["bench", "project", "--size", "64M"], "give both --bandwidth and --latency"),
    (["bench"], "Missing argument"),
    (["lab", "up", "--hosts", "x"], "'x' is not a valid integer"),
    (["info", "--bogus"], "No such option"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
])
def test_bad_input_is_one_line_naming_the_value(args, message, capsys):
    start = time.monotonic()
    assert main(args) != 0
    err = capsys.readouterr().err
    if "no MPI launcher found" in err:
        pytest.skip(err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err and err.startswith("commwire"), err
    assert time.monotonic() - start < 10  # refused here, not after launching ranks


def test_unknown_flag_from_the_shell_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "commwire", "run", "-np", "2", "--bogus", "python", "x.py"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("commwire run: no such option: --bogus") and proc.stderr.count("\n") == 1


# --------------------------------------------------------------------------- tier 1: the line writer


def test_line_writer_writes_whole_tagged_lines_at_most_pipe_buf(monkeypatch):
    writes: list[bytes] = []
    monkeypatch.setattr(_rankmain, "_write_all", lambda fd, data: data and writes.append(bytes(data)))
    lines = _rankmain._LineWriter(1, "[3]<stdout>:")
    lines.write(b"par")
    lines.write(b"tial\nnext")
    assert writes == [b"[3]<stdout>:partial\n"]
    lines.flush()  # a flushed partial line becomes a line of its own ...
    lines.write(b"\nafter\n")  # ... and the newline that ended it adds no empty line
    lines.write(b"y" * 10000 + b"\n" + b"z\n" * 3000)
    lines.flush()
    assert all(len(w) <= _rankmain._LINE_MAX and w.endswith(b"\n") for w in writes)
    body = [line[len(b"[3]<stdout>:"):] for w in writes for line in w.splitlines()]
    assert all(line.startswith(b"[3]<stdout>:") for w in writes for line in w.splitlines())
    assert body[:3] == [b"partial", b"next", b"after"]
    assert b"".join(body[3:6]) == b"y" * 10000 and body[6:] == [b"z"] * 3000


# --------------------------------------------------------------------------- tier 2: real jobs

_STRESS = r"""
import sys
from commwire.comm.ranklog import env_rank
r = env_rank()
for i in range(2000):
    print(f"<{r}>out{i}" + "x" * (i % 97))
    sys.stderr.write(f"<{r}>e")
    sys.stderr.write(f"rr{i}\n")
    if i % 50 == 0:
        sys.stdout.write(f"<{r}>part{i}")
        sys.stdout.flush()
        sys.stdout.write(f"<{r}>rest{i}\n")
    if i % 500 == 0:
        sys.stdout.write(f"<{r}>long" + "y" * 9000 + "\n")
sys.stdout.write(f"<{r}>noeol")
"""


@pytest.mark.mpi
def test_stress_no_line_mixes_two_ranks(tmp_path):
    script = tmp_path / "stress.py"
    script.write_text(_STRESS)
    proc = _commwire("run", "-np", "4", sys.executable, str(script), env={"PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
        lines = _by_rank(text, stream)
        assert sorted(lines) == [0, 1, 2, 3]
        for rank, body in lines.items():
            for line in body:  # a piece of a long line carries no marker; no line carries another rank's
                assert set(re.findall(r"<(\d+)>", line)) <= {str(rank)} and line.count("<") <= 1, line[:200]
            if stream == "stderr":
                assert body == [f"<{rank}>err{i}" for i in range(2000)]
                continue
            assert [b for b in body if "out" in b] == [f"<{rank}>out{i}" + "x" * (i % 97) for i in range(2000)]
            assert body.count(f"<{rank}>part50") == 1 and body.count(f"<{rank}>rest50") == 1
            assert body[-1] == f"<{rank}>noeol"


@pytest.mark.mpi
@pytest.mark.parametrize("flags,prefix", [((), "[{r}]<stdout>:"), (("--no-tag-output",), "")])
def test_allreduce_example_prints_one_whole_line_per_rank(flags, prefix):
    code = "import commwire as cw, numpy as np; cw.init(); print(cw.allreduce(np.ones(3) * cw.rank()))"
    proc = _commwire("run", "-np", "4", *flags, sys.executable, "-c", code, env={"PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [prefix.format(r=r) + "[6. 6. 6.]" for r in range(4)]


@pytest.mark.mpi
def test_horovodrun_options_reach_the_ranks_and_output_files_are_written(tmp_path):
    code = ("import os, sys; print(os.environ['HOROVOD_FUSION_THRESHOLD'], os.environ['HOROVOD_CYCLE_TIME'], "
            "os.environ['COMMWIRE_TIMELINE']); sys.stderr.write('to stderr\\n'); sys.stdout.write('no newline')")
    out, timeline = tmp_path / "logs", tmp_path / "tl.json"
    proc = _commwire("run", "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "3.5",
                     "--timeline-filename", str(timeline), "--output-filename", str(out), sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    want = f"33554432 3.5 {timeline}"
    assert _by_rank(proc.stdout, "stdout") == {0: [want, "no newline"], 1: [want, "no newline"]}
    assert _by_rank(proc.stderr, "stderr") == {0: ["to stderr"], 1: ["to stderr"]}
    for rank in (0, 1):  # as horovodrun: DIR/rank.N/stdout and stderr, the lines untagged
        assert (out / f"rank.{rank}" / "stdout").read_text() == f"{want}\nno newline\n"
        assert (out / f"rank.{rank}" / "stderr").read_text() == "to stderr\n"


@pytest.mark.mpi
def test_a_program_that_is_not_python_is_tagged_and_its_failure_named():
    shell = ('r=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$SLURM_PROCID}}; i=0; '
             'while [ $i -lt 300 ]; do echo "<$r>line$i"; printf "<$r>"; i=$((i+1)); done; '
             'echo "<$r>err" >&2; [ "$r" != 1 ]')
    proc = _commwire("run", "-np", "3", "sh", "-c", shell)
    assert proc.returncode != 0
    body = _by_rank(proc.stdout, "stdout")[1]
    assert body == ["<1>line0"] + [f"<1><1>line{i}" for i in range(1, 300)] + ["<1>"]
    assert "[1]<stderr>:<1>err" in proc.stderr.splitlines()
    assert re.search(r"rank 1 \(pid \d+ on .*\): sh exited with status 1", proc.stderr), proc.stderr


@pytest.mark.mpi
def test_start_timeout_fails_in_one_line_and_leaves_nothing_running(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('PMI_RANK') == '1' and os.environ.get('CW_SLOW_START'):\n"
        "    time.sleep(120)\n")
    token = f"cw-start-timeout-{os.getpid()}"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = _commwire("run", "-np", "2", "--start-timeout", "3", sys.executable, "-c", f"'{token}'",
                     env={"PYTHONPATH": path, "CW_SLOW_START": "1"})
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert re.fullmatch(r"commwire run: [12] of 2 ranks had not started after 3 s \(ranks (0, )?1\); raise "
                        r"--start-timeout, or find what holds them up \(.*\)\n", proc.stderr), proc.stderr
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_job_stopped_from_outside_says_so_and_leaves_nothing_running(signum):
    token = f"cw-stopped-{os.getpid()}-{int(signum)}"
    program = f"import commwire as cw, time; cw.init(); print('up', flush=True); time.sleep(120)  # {token}"
    proc = subprocess.Popen([sys.executable, "-m", "commwire", "run", "-np", "2", sys.executable, "-c", program],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "up" not in (proc.stdout.readline() or ""):
        pass
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert f"commwire run: stopped by {signum.name}, sent to every rank" in err, err
    # no per-rank blame from commwire run (the ranks' own output may show the KeyboardInterrupt)
    assert "the job failed" not in err and not any(line.startswith("  rank ") for line in err.splitlines()), err
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout
