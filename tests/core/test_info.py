"""commwire info diagnoses the environment — tier 1 (single process)."""

from __future__ import annotations

import os
import subprocess
import sys

from mpi_helpers import ROOT

from commwire import info


def _by_name(checks):
    return {c.name: c for c in checks}


def test_every_check_runs_and_problems_carry_a_fix():
    checks = info.diagnose()
    assert set(_by_name(checks)) == {"start", "launcher", "thread level", "elastic", "CUDA", "lab", "environment", "torch"}
    for c in checks:
        assert c.status in ("ok", "note", "problem"), c
        assert c.status == "ok" or c.fix, c


def test_bad_commwire_variables_are_a_problem(monkeypatch):
    monkeypatch.setenv("COMMWIRE_TIMEOUTT", "5")
    monkeypatch.setenv("COMMWIRE_TIMEOUT", "abc")
    env = _by_name(info.diagnose())["environment"]
    assert env.status == "problem" and "COMMWIRE_TIMEOUTT" in env.found and "'abc'" in env.found


def test_a_launcher_of_another_mpi_is_a_problem(monkeypatch):
    from commwire import launch

    other = launch.Launcher(kind="openmpi", path="/opt/ompi/bin/mpirun")
    monkeypatch.setattr(launch, "find_launcher", lambda *a, **k: other)
    check = _by_name(info.diagnose())["launcher"]
    assert check.status == "problem" and "every rank would start alone" in check.found and "mpiexec" in check.fix


def test_a_process_torchrun_started_alone_is_a_problem(monkeypatch):
    assert _by_name(info.diagnose())["start"].status == "ok"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    check = _by_name(info.diagnose())["start"]
    assert check.status == "problem" and check.found.startswith("torchrun started this process as one of 4"), check
    assert "commwire run -np 4 python" in check.fix


def test_cli_reports_a_start_by_another_mpis_launcher_instead_of_failing():
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_SIZE", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "commwire", "info"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**env, "OMPI_COMM_WORLD_SIZE": "3"})
    assert proc.returncode == 0, proc.stderr
    assert "problem start: the launcher started 3 processes (OMPI_COMM_WORLD_SIZE=3)" in proc.stdout, proc.stdout
    assert "world_size" in proc.stdout


def test_no_root_or_no_tc_says_how_to_get_the_lab(monkeypatch):
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "tc" else real(name))
    lab = _by_name(info.diagnose())["lab"]
    assert lab.status == "note" and "tc not found" in lab.found and "iproute2" in lab.fix


def test_cli_prints_versions_and_checks():
    proc = subprocess.run([sys.executable, "-m", "commwire", "info"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "mpi_vendor" in proc.stdout and "checks:" in proc.stdout and "launcher:" in proc.stdout


def test_versions_come_from_package_metadata(monkeypatch):
    # Not every package sets __version__ (rich 15 does not): the installed metadata decides.
    import importlib.metadata

    import numpy

    monkeypatch.delattr(numpy, "__version__")
    assert info._version("numpy") == importlib.metadata.version("numpy")
    try:
        expected = importlib.metadata.version("rich")
    except importlib.metadata.PackageNotFoundError:
        expected = None
    assert info._version("rich") == expected


def test_a_module_without_metadata_falls_back_to_its_version_and_a_missing_one_is_none(monkeypatch):
    import types

    module = types.ModuleType("commwire_test_unpackaged")
    module.__version__ = "1.2.3"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert info._version(module.__name__) == "1.2.3"
    assert info._version("commwire_test_not_installed") is None
