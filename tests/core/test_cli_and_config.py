"""Launcher, CLI and configuration — tier 1 (single process, no MPI job started)."""

from __future__ import annotations

import os
import sys

import pytest

from commwire import _config, launch
from commwire.cli import main

HYDRA = launch.Launcher(kind="mpich", path="/opt/mpich/bin/mpiexec")
OMPI = launch.Launcher(kind="openmpi", path="/opt/ompi/bin/mpirun")
SLURM = launch.Launcher(kind="slurm", path="/usr/bin/srun")


def test_build_command_mpich_hosts_env_and_args():
    argv = launch.build_command(HYDRA, 4, ["python", "t.py"], hosts="a:2,b:2", env={"X": "1"},
                                mpi_args=["-bind-to", "core"])
    assert argv == ["/opt/mpich/bin/mpiexec", "-n", "4", "-hosts", "a:2,b:2", "-genv", "X", "1",
                    "-bind-to", "core", "python", "t.py"]


def test_build_command_openmpi_oversubscribes_and_exports():
    argv = launch.build_command(OMPI, 8, ["./a.out"], hosts="n1:4,n2", env={"Y": "v"})
    assert argv[:4] == ["/opt/ompi/bin/mpirun", "-np", "8", "--oversubscribe"]
    assert ["-H", "n1:4,n2:1"] == argv[argv.index("-H"):argv.index("-H") + 2]
    assert "-x" in argv and "Y=v" in argv and argv[-1] == "./a.out"
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)


def test_build_command_slurm_exports_env():
    argv = launch.build_command(SLURM, 2, ["python", "t.py"], env={"A": "b"})
    assert argv == ["/usr/bin/srun", "-n", "2", "--export=ALL,A=b", "--kill-on-bad-exit=1", "python", "t.py"]
    # the user's own choice of whether a dead rank ends the step stands
    assert "--kill-on-bad-exit=1" not in launch.build_command(SLURM, 2, ["t"], mpi_args=["-K0"])


def test_build_command_slurm_passes_the_mpi_plugin_unless_told_another():
    srun = launch.Launcher(kind="slurm", path="/usr/bin/srun", mpi_plugin="pmix",
                           mpi_plugins_offered=("pmix", "none", "pmi2", "pmix_v4"))
    assert launch.build_command(srun, 2, ["python", "t.py"])[5:] == ["--mpi=pmix", "python", "t.py"]
    assert launch.build_command(srun, 2, ["t"], mpi_args=["--mpi=pmi2"])[5:] == ["--mpi=pmi2", "t"]
    assert launch.build_command(srun, 2, ["t"], mpi_args=["--mpi", "none"])[5:] == ["--mpi", "none", "t"]
    versioned = launch.Launcher(kind="slurm", path="srun", mpi_plugin="pmix", mpi_plugins_offered=("pmix_v3",))
    assert "--mpi=pmix" in launch.build_command(versioned, 2, ["t"])
    lacking = launch.Launcher(kind="slurm", path="srun", mpi_plugin="pmix", mpi_plugins_offered=("none", "pmi2"))
    with pytest.raises(ValueError, match="srun offers the MPI plugins none, pmi2, not pmix.*--mpi-args=--mpi=NAME"):
        launch.build_command(lacking, 2, ["t"])
    assert launch.build_command(lacking, 2, ["t"], mpi_args=["--mpi=pmi2"])[-2:] == ["--mpi=pmi2", "t"]


def test_the_slurm_plugin_follows_mpi4pys_mpi(monkeypatch):
    from mpi4py import MPI

    monkeypatch.delenv("SLURM_MPI_TYPE", raising=False)
    assert [launch.slurm_mpi_plugin(v) for v in ("MPICH", "Intel MPI", "Open MPI", "Other")] == \
        ["pmi2", "pmi2", "pmix", None]
    assert launch.mpi4py_vendor() == MPI.get_vendor()[0]  # asked in a subprocess: MPI is not started here
    monkeypatch.setenv("SLURM_MPI_TYPE", "pmi2")  # the user's choice: srun reads it, commwire adds nothing
    assert launch.slurm_mpi_plugin("Open MPI") is None


def test_srun_mpi_list_is_read(tmp_path):
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nprintf 'MPI plugin types are...\\n\\tpmix\\n\\tnone\\n\\tcray_shasta\\n\\tpmi2\\n"
                    "specific pmix plugin versions available: pmix_v4\\n'\n")
    fake.chmod(0o755)
    assert launch.srun_mpi_plugins(str(fake)) == ["pmix", "none", "cray_shasta", "pmi2", "pmix_v4"]
    assert launch.srun_mpi_plugins(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("bad,match", [("", "names no host"), ("a:x", "HOST:SLOTS"), ("a:0", "HOST:SLOTS")])
def test_parse_hosts_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        launch.parse_hosts(bad)


def test_build_command_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        launch.build_command(HYDRA, 0, ["x"])
    with pytest.raises(ValueError, match="no command"):
        launch.build_command(HYDRA, 1, [])
    with pytest.raises(ValueError, match="does not exist"):
        launch.build_command(HYDRA, 1, ["x"], hostfile=str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "cmd,want",
    [
        (["python", "t.py", "--lr", "1"], ["python", "-m", "commwire._rankmain", "t.py", "--lr", "1"]),
        (["python3.11", "-u", "-X", "dev", "-m", "pkg"], ["python3.11", "-u", "-X", "dev", "-m",
                                                          "commwire._rankmain", "-m", "pkg"]),
        (["python", "-c", "print(1)"], ["python", "-m", "commwire._rankmain", "-c", "print(1)"]),
        (["./a.out", "x"], ["./a.out", "x"]),
        (["python"], ["python"]),
    ],
)
def test_wrap_python(cmd, want):
    assert launch.wrap_python(cmd) == want


def test_find_launcher_errors_say_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pip install 'commwire\[mpich\]'"):
        launch.find_launcher()
    with pytest.raises(ValueError, match="unknown"):
        launch.find_launcher("lam")
    with pytest.raises(RuntimeError, match="Slurm allocation"):
        launch.find_launcher("slurm")


def test_cli_run_without_launcher_fails_cleanly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert main(["run", "-np", "2", "python", "x.py"]) == 1
    assert "pip install 'commwire[mpich]'" in capsys.readouterr().err


def test_cli_run_dry_run_prints_command(capsys):
    assert main(["run", "--dry-run", "-np", "3", "-x", "A=1", "--timeline", "t.json", "python", "s.py"]) == 0
    out = capsys.readouterr().out
    assert "-n 3" in out and "COMMWIRE_RUN 1" in out and "A 1" in out and "COMMWIRE_TIMELINE" in out
    assert out.strip().endswith("python -m commwire._rankmain --tag-output s.py")


def test_cli_run_rejects_bad_env_pair(capsys):
    assert main(["run", "--dry-run", "-x", "1BAD=2", "python", "s.py"]) == 2
    assert "not VAR or VAR=value" in capsys.readouterr().err


def test_every_registered_benchmark_declares_what_the_cli_needs(capsys):
    from commwire.bench import MODULES, STUDIES, registry

    found = registry()
    assert len(found) == len(MODULES) and not set(found) & set(STUDIES)
    for name, module in found.items():
        assert isinstance(module.HELP, str) and "\n" not in module.HELP and isinstance(module.DRIVER, bool)
        assert main(["bench", name, "--", "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: commwire bench {name} "), name
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*found, *STUDIES]) and "python benchmarks/lordo.py" in out


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("mpi_vendor", "thread_level", "cuda_aware_mpi", "launcher", "torch"):
        assert key in out


def test_config_parsing(monkeypatch):
    monkeypatch.setenv("COMMWIRE_CHECK", "yes")
    assert _config.env_bool("COMMWIRE_CHECK") is True
    monkeypatch.setenv("COMMWIRE_CHECK", "maybe")
    with pytest.raises(ValueError, match="COMMWIRE_CHECK='maybe'"):
        _config.env_bool("COMMWIRE_CHECK")
    monkeypatch.setenv("COMMWIRE_THREAD_LEVEL", "triple")
    with pytest.raises(ValueError, match="COMMWIRE_THREAD_LEVEL"):
        _config.env_choice("COMMWIRE_THREAD_LEVEL", ("single", "multiple"), "multiple")
    with pytest.raises(KeyError, match="not a documented"):
        _config.env_str("COMMWIRE_TYPO")


def test_collective_before_init_is_a_clear_error():
    import subprocess

    code = "import commwire as cw, numpy as np; cw.allreduce(np.ones(2))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "call commwire.init() first" in proc.stderr


def test_import_commwire_does_not_import_torch_and_resolves_optimizer_lazily():
    import subprocess

    code = ("import sys, commwire; assert 'torch' not in sys.modules and 'mpi4py.MPI' not in sys.modules; "
            "import commwire.torch as hvd; assert commwire.DistributedOptimizer is hvd.DistributedOptimizer; "
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
