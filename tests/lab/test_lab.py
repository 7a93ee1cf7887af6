"""Tests of commwire.lab, the emulated cluster.

Tiers: the parsing/validation tests run everywhere; the lab tests need root, `ip`,
`tc`, kernel support for namespaces, bridges, veth and tbf, and MPICH's mpiexec, and
skip cleanly otherwise (or when someone else's lab is up, which they must not touch).
The lab tests bring up 2 hosts at 100mbit once and always take them down again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from commwire import lab
from commwire.lab import netns, spec

PROBE = Path(__file__).with_name("lab_probe.py")
RATE = "100mbit"
HOSTS = 2


# --- everywhere -----------------------------------------------------------------------

@pytest.mark.parametrize("text, bps", [
    ("1gbit", 10**9), ("10gbit", 10**10), ("100mbit", 10**8), ("2.5gbit", 25 * 10**8),
    ("500kbit", 5 * 10**5), (" 1Gbit/s ", 10**9), ("10GBitps", 10**10), (10**9, 10**9),
])
def test_parse_bandwidth(text: str | int, bps: int) -> None:
    assert lab.parse_bandwidth(text) == bps


@pytest.mark.parametrize("text", ["fast", "1", "1gbps", "100 mb", "1.5", "", "gbit", "-1gbit", "1e3mbit"])
def test_parse_bandwidth_rejects_with_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"cannot parse bandwidth .*kbit, mbit"):
        lab.parse_bandwidth(text)


def test_parse_bandwidth_range_and_type() -> None:
    with pytest.raises(ValueError, match="outside the supported range"):
        lab.parse_bandwidth("1kbit")
    with pytest.raises(ValueError, match="outside the supported range"):
        lab.parse_bandwidth("1tbit")
    with pytest.raises(TypeError, match="bandwidth must be a string"):
        lab.parse_bandwidth(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tc reads it as bytes"):
        lab.parse_bandwidth("100mbps")


def test_format_bandwidth() -> None:
    assert [lab.format_bandwidth(b) for b in (10**9, 15 * 10**8, 10**8, 1234)] == \
        ["1gbit", "1500mbit", "100mbit", "1234bit"]


def test_placement_blocks() -> None:
    assert lab.placement(4, 4) == [1, 1, 1, 1]
    assert lab.placement(8, 4) == [2, 2, 2, 2]
    assert lab.placement(6, 4) == [2, 2, 2]
    assert lab.placement(2, 4) == [1, 1]
    with pytest.raises(ValueError, match=r"np=0 must be a positive integer"):
        lab.placement(0, 4)


def test_up_validates_before_privileges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=f"hosts must be between 1 and {lab.MAX_HOSTS}.*got 300"):
        lab.up(300)
    with pytest.raises(ValueError, match="hosts must be between 1 and"):
        lab.up(0)
    with pytest.raises(TypeError, match="hosts must be an int"):
        lab.up("4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot parse bandwidth 'quick'"):
        lab.up(2, "quick")
    with pytest.raises(PermissionError, match="needs root.*sudo"):
        lab.up(2)
    with pytest.raises(PermissionError, match="needs root"):
        lab.down()


def test_refuses_without_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name, path=None: None if name == "tc" else "/x/ip")
    with pytest.raises(RuntimeError, match="needs tc, not found on PATH; install iproute2"):
        lab.status()


def test_state_dir_must_be_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMWIRE_LAB_DIR", "relative/dir")
    with pytest.raises(ValueError, match="COMMWIRE_LAB_DIR must be an absolute"):
        spec.state_dir()


# --- root + iproute2 + kernel support -------------------------------------------------

def _skip_reason() -> str | None:
    """Return why the lab tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "lab tests need root"
    if not (shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")):
        return "lab tests need `ip` (iproute2)"
    if not (shutil.which("tc") or shutil.which("tc", path="/usr/sbin:/sbin")):
        return "lab tests need `tc` (iproute2)"
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    if shutil.which("mpiexec", path=search) is None:
        return "lab tests need MPICH's mpiexec"
    return None


def _remaining() -> list[str]:
    """Return every cw* namespace, root-namespace link and hosts dir that exists now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    found = [line.split()[0] for line in out if line.startswith("cw")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += [line.split(": ")[1] for line in links.splitlines() if line.split(": ")[1].startswith("cw")]
    etc = Path("/etc/netns")
    found += [str(p) for p in etc.iterdir() if p.name.startswith("cw")] if etc.is_dir() else []
    return found


@pytest.fixture(scope="module")
def _lab_module() -> Iterator[None]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if _remaining() or spec.state_dir().exists():
        pytest.skip(f"a lab or its leftovers exist ({_remaining()}); not touching someone else's lab")
    try:
        lab.up(HOSTS, RATE)
    except RuntimeError as exc:
        lab.down()
        if "the kernel needs" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        yield
    finally:
        lab.down()
        assert _remaining() == []
        assert not spec.state_dir().exists()


@pytest.fixture
def up_lab(_lab_module: None) -> lab.LabSpec:
    """Return the running 2-host lab, bringing it back if a test took it down (up is idempotent)."""
    return lab.up(HOSTS, RATE)


def _in_host(host: str, code: str) -> str:
    """Run Python *code* inside lab host *host* and return its stdout."""
    argv = lab.host_command(host, [sys.executable, "-c", code])
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.strip()


_CONNECT = """
import socket
try:
    socket.create_connection(("cw-h1", 9), timeout=1.0)
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.mark.lab
def test_up_is_idempotent_and_refuses_other_settings(up_lab: lab.LabSpec) -> None:
    assert up_lab.names == ("cw-h0", "cw-h1")
    assert up_lab.addresses == ("198.18.0.10", "198.18.0.11")
    assert lab.up(HOSTS, "100000kbit") == up_lab
    assert lab.status() == up_lab
    with pytest.raises(RuntimeError, match="already up with hosts=2 bandwidth=100mbit.*lab down"):
        lab.up(3, RATE)
    with pytest.raises(RuntimeError, match="requested hosts=2 bandwidth=1gbit"):
        lab.up(HOSTS, "1gbit")


@pytest.mark.lab
@pytest.mark.mpi
def test_allreduce_over_tcp_at_the_link_rate(up_lab: lab.LabSpec) -> None:
    prefix, env = lab.launch_args(2, os.environ)
    argv = [*prefix, sys.executable, str(PROBE), "--small-repeats", "100", "--large-mb", "8",
            "--large-repeats", "1"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["sum"] == report["expected"] == 3.0
    assert len(set(report["netns"])) == 2, "both ranks ran in the same namespace"
    # 2 ranks: each link carries the whole 8 MiB once per direction. Shared memory would
    # take milliseconds; the lower bound is what proves traffic crossed the limited links.
    expected = report["large_bytes"] * 8 / lab.parse_bandwidth(RATE)
    assert 0.7 * expected < report["large_s"] < 4 * expected, report


@pytest.mark.lab
def test_cut_and_heal(up_lab: lab.LabSpec) -> None:
    assert _in_host("cw-h0", _CONNECT) == "ConnectionRefusedError"  # reachable, port closed
    assert lab.cut("cw-h1") == "cw-h1"
    try:
        assert lab.status().cut == ("cw-h1",)
        assert _in_host("cw-h0", _CONNECT) in ("TimeoutError", "OSError")
        with pytest.raises(RuntimeError, match="cw-h1 are cut.*lab heal cw-h1"):
            lab.launch_args(2, os.environ)
    finally:
        assert lab.heal(1) == "cw-h1"
    assert lab.status().cut == ()
    assert _in_host("cw-h0", _CONNECT) == "ConnectionRefusedError"


@pytest.mark.lab
def test_unknown_host(up_lab: lab.LabSpec) -> None:
    with pytest.raises(ValueError, match="unknown lab host 'cw-h7'; the lab has cw-h0..cw-h1 \\(or 0..1\\)"):
        lab.cut("cw-h7")
    with pytest.raises(ValueError, match="unknown lab host 5"):
        lab.heal(5)


@pytest.mark.lab
def test_down_cleans_leftovers_of_a_killed_run(up_lab: lab.LabSpec) -> None:
    stray = subprocess.Popen(lab.host_command("cw-h1", ["sleep", "60"]))
    try:
        (spec.state_dir() / "state.json").unlink()  # as if `up` had been SIGKILLed
        with pytest.raises(RuntimeError, match="leftovers from a killed run.*namespace cw-h0.*lab down"):
            lab.status()
        with pytest.raises(RuntimeError, match="leftovers from an earlier lab.*lab down"):
            lab.up(HOSTS, RATE)
        removed = lab.down()
        assert "namespace cw-h1" in removed and "namespace cw-sw" in removed
        assert any(item.startswith("process") for item in removed)
        assert stray.wait(timeout=10) != 0
        assert _remaining() == [] and lab.status() is None
        assert lab.down() == []
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()


@pytest.mark.lab
def test_interrupted_up_tears_down(up_lab: lab.LabSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    lab.down()
    calls = []

    def interrupted(*args: object) -> None:
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(netns, "_tbf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lab.up(HOSTS, RATE)
    assert _remaining() == [] and not spec.state_dir().exists()
    monkeypatch.undo()
    assert lab.up(HOSTS, RATE).hosts == HOSTS
