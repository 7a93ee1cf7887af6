"""Build, inspect, break and remove the emulated cluster: network namespaces on a bridge."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from . import spec as _spec
from .bandwidth import format_bandwidth, parse_bandwidth, tbf_burst
from .shim import write_shim
from .spec import BRIDGE, HOST_IFACE, PREFIX_LEN, SWITCH, LabSpec

__all__ = ["up", "down", "status", "cut", "heal", "host_command", "require_tools"]

# Exactly the names this module creates, so `down` never removes anyone else's "cw…" objects.
_OUR_NETNS = re.compile(r"cw-(sw|h\d+)")
_OUR_LINK = re.compile(r"cw(br0|v\d+|lab0)")
_NETNS_ETC = Path("/etc/netns")
# Queue bound of tbf, as the time the backlog takes to drain: long enough that
# TCP is not starved by drops, short enough not to hide the bandwidth limit.
_TBF_LATENCY = "50ms"


def require_tools() -> dict[str, str]:
    """Return absolute paths of `ip`, `tc` and `unshare`, refusing clearly when not root or when missing."""
    if os.geteuid() != 0:
        raise PermissionError(
            "commwire lab needs root to create network namespaces and tc qdiscs; rerun with sudo"
        )
    # sudo and cron often drop /usr/sbin from PATH, where iproute2 lives.
    found = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
             for name in ("ip", "tc", "unshare")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        packages = " ".join(p for p, tools in (("iproute2", {"ip", "tc"}), ("util-linux", {"unshare"}))
                            if tools & set(missing))
        raise RuntimeError(
            f"commwire lab needs {' and '.join(missing)}, not found on PATH; install {packages} "
            f"(e.g. `apt-get install {packages}`)"
        )
    return {name: str(path) for name, path in found.items()}


def _run(argv: Sequence[str], what: str = "", fix: str = "") -> str:
    """Run *argv* and return its stdout; raise RuntimeError naming the command, stderr and *fix*."""
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        msg = f"{what or 'command'} failed: `{' '.join(argv)}`: {proc.stderr.strip() or proc.returncode}"
        raise RuntimeError(f"{msg}; {fix}" if fix else msg)
    return proc.stdout


def _json(argv: Sequence[str]) -> list[dict]:
    """Return the parsed `ip -j` output of *argv* (an empty list when ip prints nothing)."""
    text = _run(argv).strip()
    return json.loads(text) if text else []


def _netns_names(ip: str) -> list[str]:
    """Return the names of all named network namespaces."""
    return [entry["name"] for entry in _json([ip, "-j", "netns", "list"])]


def _links(ip: str, netns: str | None = None) -> dict[str, dict]:
    """Return the links of *netns* (root namespace when None) by name."""
    where = ["-n", netns] if netns else []
    return {link["ifname"]: link for link in _json([ip, "-j", *where, "link", "show"])}


def _leftovers(ip: str) -> list[str]:
    """Return every lab object that exists right now, described for messages."""
    names = sorted((name for name in _netns_names(ip) if _OUR_NETNS.fullmatch(name)), key=_natural)
    found = [f"namespace {name}" for name in names]
    found += [f"link {name}" for name in _links(ip) if _OUR_LINK.fullmatch(name)]
    if _NETNS_ETC.is_dir():
        dirs = sorted(p.name for p in _NETNS_ETC.iterdir() if _OUR_NETNS.fullmatch(p.name))
        found += [f"hosts file {_NETNS_ETC / name / 'hosts'}" for name in sorted(dirs, key=_natural)]
    directory = _spec.state_dir()
    if directory.is_dir():
        found += [f"file {path}" for path in sorted(directory.iterdir())]
    return found


def _brief(items: Sequence[str], limit: int = 6) -> str:
    """Return *items* joined for a message, eliding all but the first *limit*."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _natural(name: str) -> tuple:
    """Return a sort key that puts cw-h2 before cw-h10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _check_settings(existing: LabSpec, wanted: LabSpec) -> None:
    """Refuse when the running lab differs from the requested one."""
    if existing.settings() != wanted.settings():
        raise RuntimeError(
            f"a lab is already up with hosts={existing.hosts} bandwidth={existing.bandwidth}; "
            f"requested hosts={wanted.hosts} bandwidth={wanted.bandwidth}: "
            "run `commwire lab down` first"
        )


def _live(ip: str, saved: LabSpec) -> LabSpec:
    """Return *saved* with its live cut list, or raise if parts of the lab have vanished."""
    present = set(_netns_names(ip))
    missing = [name for name in (SWITCH, *saved.names) if name not in present]
    if missing or not Path(saved.shim).exists():
        gone = _brief(missing) if missing else f"shim {saved.shim}"
        raise RuntimeError(
            f"the lab state says {saved.hosts} hosts are up but {gone} is missing "
            "(a killed run or manual cleanup?); run `commwire lab down`, then `commwire lab up` again"
        )
    ports = _links(ip, SWITCH)
    cut = tuple(
        name for i, name in enumerate(saved.names)
        if "UP" not in ports.get(_spec.switch_port(i), {}).get("flags", ())
    )
    return LabSpec(**{**_asdict(saved), "cut": cut})


def _asdict(spec: LabSpec) -> dict:
    """Return the fields of *spec* without deep-copying (dataclasses.asdict turns tuples into lists)."""
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def status() -> LabSpec | None:
    """Return the running lab with its cut hosts, or None when no lab is up."""
    ip = require_tools()["ip"]
    with _spec.locked():
        saved = _spec.load_state()
        leftovers = _leftovers(ip) if saved is None else []
    if saved is None:
        if leftovers:
            raise RuntimeError(
                f"no lab state, but leftovers from a killed run exist: {_brief(leftovers)}; "
                "run `commwire lab down` to remove them"
            )
        return None
    return _live(ip, saved)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into KeyboardInterrupt so a killed `up` (or a driver holding a lab) still tears down."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _tbf(tc: str, netns: str, dev: str, bps: int) -> None:
    """Limit egress of *dev* in *netns* to *bps* with a token bucket (depth: ``tbf_burst``)."""
    burst = tbf_burst(bps)
    _run(
        [tc, "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", f"{bps}bit", "burst", str(burst), "latency", _TBF_LATENCY],
        "setting the bandwidth limit", "the kernel needs the tbf qdisc (modprobe sch_tbf)",
    )


def _hosts_file(spec: LabSpec) -> str:
    """Return /etc/hosts content that resolves every lab host inside every namespace."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost"]
    lines += [f"{addr}\t{name}" for name, addr in zip(spec.names, spec.addresses)]
    return "\n".join(lines) + "\n"


def _build(tools: dict[str, str], spec: LabSpec) -> None:
    """Create namespaces, bridge, links, limits, hosts files and shim of *spec*."""
    ip, tc, unshare = tools["ip"], tools["tc"], tools["unshare"]
    _run([ip, "netns", "add", SWITCH], "creating the switch namespace",
         "the kernel needs network namespace support (CONFIG_NET_NS)")
    _run([ip, "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge"],
         "creating the bridge", "the kernel needs bridge support (modprobe bridge)")
    _run([ip, "-n", SWITCH, "link", "set", BRIDGE, "up"])
    hosts = _hosts_file(spec)
    for i, (name, addr) in enumerate(zip(spec.names, spec.addresses)):
        port = _spec.switch_port(i)
        _run([ip, "netns", "add", name], f"creating namespace {name}")
        _run([ip, "-n", name, "link", "set", "lo", "up"])
        # Created straight into both namespaces: no veth end ever appears in the root namespace.
        _run([ip, "-n", SWITCH, "link", "add", port, "type", "veth",
              "peer", "name", HOST_IFACE, "netns", name],
             f"creating the link of {name}", "the kernel needs veth support (modprobe veth)")
        _run([ip, "-n", SWITCH, "link", "set", port, "master", BRIDGE, "up"])
        _run([ip, "-n", name, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", HOST_IFACE])
        _run([ip, "-n", name, "link", "set", HOST_IFACE, "up"])
        # Both directions: host egress on its own end, host ingress on the switch end.
        _tbf(tc, name, HOST_IFACE, spec.bandwidth_bps)
        _tbf(tc, SWITCH, port, spec.bandwidth_bps)
        etc = _NETNS_ETC / name
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)
    write_shim(Path(spec.shim), ip, unshare)


def up(hosts: int, bandwidth: str = "1gbit") -> LabSpec:
    """Bring up *hosts* namespaces on one bridge with every link limited to *bandwidth*.

    Idempotent: with a lab already up with the same settings this returns it unchanged;
    with other settings, or with leftovers of a killed run, it raises RuntimeError that
    says to run `commwire lab down`. On any error or interrupt everything is torn down.
    """
    bps = parse_bandwidth(bandwidth)
    wanted = _spec.plan(hosts, bps, format_bandwidth(bps))
    tools = require_tools()
    with _spec.locked():
        saved = _spec.load_state()
        if saved is not None:
            _check_settings(saved, wanted)
            return _live(tools["ip"], saved)
        leftovers = _leftovers(tools["ip"])
        if leftovers:
            raise RuntimeError(
                f"leftovers from an earlier lab exist: {_brief(leftovers)}; "
                "run `commwire lab down` first"
            )
        try:
            with signals_raise():
                _build(tools, wanted)
                _spec.save_state(wanted)
        except BaseException:
            _teardown(tools["ip"])
            raise
    return wanted


def _kill_namespace_processes(ip: str, names: Sequence[str]) -> list[str]:
    """Terminate processes still running inside *names* (stray ranks keep a namespace alive)."""
    pids = {
        int(pid): name for name in names
        for pid in subprocess.run([ip, "netns", "pids", name], capture_output=True, text=True).stdout.split()
        if pid.isdigit() and int(pid) != os.getpid()
    }
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [pid for pid in pids if _alive(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.05)
    return [f"process {pid} in {name}" for pid, name in pids.items()]


def _alive(pid: int) -> bool:
    """Return whether *pid* still runs (a zombie does not; reaping it is its parent's business)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _teardown(ip: str) -> list[str]:
    """Remove every lab object found, state or not; return what was removed."""
    removed: list[str] = []
    namespaces = sorted((name for name in _netns_names(ip) if _OUR_NETNS.fullmatch(name)), key=_natural)
    removed += _kill_namespace_processes(ip, [n for n in namespaces if n != SWITCH])
    for name in _links(ip):
        if _OUR_LINK.fullmatch(name):
            # Only an older layout or a manual experiment leaves these in the root namespace.
            subprocess.run([ip, "link", "del", name], capture_output=True)
            removed.append(f"link {name}")
    for name in namespaces:
        # Deleting a namespace deletes its veth ends, the peers, the bridge and the qdiscs.
        subprocess.run([ip, "netns", "del", name], capture_output=True)
        removed.append(f"namespace {name}")
    if _NETNS_ETC.is_dir():
        for path in sorted(_NETNS_ETC.iterdir(), key=lambda p: _natural(p.name)):
            if _OUR_NETNS.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(f"hosts file {path / 'hosts'}")
        with contextlib.suppress(OSError):
            _NETNS_ETC.rmdir()  # only succeeds when empty, i.e. nobody else uses it
    directory = _spec.state_dir()
    if directory.is_dir():
        # The directory itself goes when the lock is released (see spec.locked).
        for path in sorted(directory.iterdir()):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(f"file {path}")
    return removed


def down() -> list[str]:
    """Remove the lab and any leftovers of killed runs; return what was removed ([] if nothing).

    Works without a state file (it scans namespaces, links and /etc/netns for the lab's
    names) and raises RuntimeError only when something could not be removed.
    """
    ip = require_tools()["ip"]
    with _spec.locked():
        removed = _teardown(ip)
    remaining = _leftovers(ip)
    if remaining:
        raise RuntimeError(f"could not remove {_brief(remaining)}; remove them by hand (ip netns del …)")
    return removed


def _index(spec: LabSpec, host: str | int) -> int:
    """Return the index of *host* (a name like 'cw-h1' or an index) in *spec*."""
    if isinstance(host, int) and not isinstance(host, bool) and 0 <= host < spec.hosts:
        return host
    if isinstance(host, str) and host in spec.names:
        return spec.names.index(host)
    if isinstance(host, str) and host.isdigit() and int(host) < spec.hosts:
        return int(host)
    raise ValueError(
        f"unknown lab host {host!r}; the lab has {spec.names[0]}..{spec.names[-1]} (or 0..{spec.hosts - 1})"
    )


def _running() -> tuple[str, LabSpec]:
    """Return the ip path and the running lab, or raise when no lab is up."""
    ip = require_tools()["ip"]
    spec = status()
    if spec is None:
        raise RuntimeError("no lab is up; run `commwire lab up --hosts N` first")
    return ip, spec


def _set_link(host: str | int, state: str) -> str:
    """Set the switch port of *host* to *state* ('up' or 'down') and return the host name."""
    ip, spec = _running()
    i = _index(spec, host)
    port = _spec.switch_port(i)
    _run([ip, "-n", SWITCH, "link", "set", port, state], f"setting the link of {spec.names[i]} {state}")
    return spec.names[i]


def cut(host: str | int) -> str:
    """Take *host*'s link down (its peers see timeouts, as with a pulled cable); return its name."""
    return _set_link(host, "down")


def heal(host: str | int) -> str:
    """Bring *host*'s link back up after `cut`; return its name."""
    return _set_link(host, "up")


def host_command(host: str | int, argv: Sequence[str]) -> list[str]:
    """Return the argv that runs *argv* inside lab host *host*'s namespace."""
    ip, spec = _running()
    if not argv:
        raise ValueError("host_command needs a command to run, got an empty argv")
    return [ip, "netns", "exec", spec.names[_index(spec, host)], *argv]
