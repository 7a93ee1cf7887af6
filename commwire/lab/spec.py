"""Describe a lab (names, addresses, bandwidth) and persist it for other processes."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from .. import _config

__all__ = [
    "LabSpec", "plan", "host_name", "host_address", "switch_port", "state_dir",
    "load_state", "save_state", "locked",
    "SWITCH", "BRIDGE", "HOST_IFACE", "MAX_HOSTS", "PREFIX_LEN",
]

# Every name starts with "cw" so `lab down` (and a human) can find leftovers.
SWITCH = "cw-sw"          # namespace that holds the bridge: the root namespace stays untouched
BRIDGE = "cwbr0"          # bridge inside SWITCH
HOST_IFACE = "cwlab0"     # the same name in every host so FI_TCP_IFACE can name it once
_HOST = "cw-h{}"
_PORT = "cwv{}"           # switch-side end of host i's veth pair
_SUBNET = "198.18.0.{}"   # RFC 2544 benchmarking range: never routed anywhere real
_FIRST = 10
PREFIX_LEN = 24
MAX_HOSTS = 254 - _FIRST + 1
_STATE_FILE = "state.json"
_ENV_DIR = "COMMWIRE_LAB_DIR"
_DEFAULT_DIR = "/run/commwire-lab"  # tmpfs: vanishes on reboot together with the namespaces


def host_name(index: int) -> str:
    """Return the namespace (and host) name of lab host *index*."""
    return _HOST.format(index)


def host_address(index: int) -> str:
    """Return the IPv4 address of lab host *index*."""
    return _SUBNET.format(_FIRST + index)


def switch_port(index: int) -> str:
    """Return the switch-side interface name of lab host *index*'s link."""
    return _PORT.format(index)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LabSpec:
    """An emulated cluster: *hosts* namespaces on one bridge, each link limited to *bandwidth*."""

    hosts: int
    """Number of host namespaces."""
    bandwidth: str
    """Per-link limit in tc notation, normalised (e.g. '1gbit')."""
    bandwidth_bps: int
    """The same limit in bits per second."""
    names: tuple[str, ...]
    """Host (namespace) names, resolvable inside every host."""
    addresses: tuple[str, ...]
    """IPv4 address of each host, in the order of *names*."""
    shim: str
    """Path of the Hydra launcher shim ("ssh HOST CMD" → run CMD in namespace HOST)."""
    cut: tuple[str, ...] = ()
    """Hosts whose link is currently down (see `cut`/`heal`); not persisted, read live."""

    def settings(self) -> tuple[int, int]:
        """Return what `up` compares to decide whether a running lab matches a request."""
        return (self.hosts, self.bandwidth_bps)

    def describe(self) -> str:
        """Return a human-readable summary: hosts, addresses, limit, cut links."""
        lines = [f"lab up: {self.hosts} host(s) on {BRIDGE} in namespace {SWITCH}, {self.bandwidth} per link"]
        for name, addr in zip(self.names, self.addresses):
            lines.append(f"  {name}  {addr}/{PREFIX_LEN}{'  (cut)' if name in self.cut else ''}")
        return "\n".join(lines)

    def to_json(self) -> str:
        """Return the persisted form (without the live *cut* field)."""
        data = dataclasses.asdict(self)
        del data["cut"]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str) -> LabSpec:
        """Return the spec stored in *text*; *source* names the file in errors."""
        try:
            data = json.loads(text)
            data["names"], data["addresses"] = tuple(data["names"]), tuple(data["addresses"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as exc:
            raise RuntimeError(
                f"lab state file {source} is unreadable ({exc}); run `commwire lab down` to clean up"
            ) from None


def plan(hosts: int, bandwidth_bps: int, bandwidth: str) -> LabSpec:
    """Return the spec of a lab with *hosts* hosts, validating the count against the address plan."""
    if isinstance(hosts, bool) or not isinstance(hosts, int):
        raise TypeError(f"hosts must be an int, got {hosts!r}")
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(
            f"hosts must be between 1 and {MAX_HOSTS} (addresses {host_address(0)}"
            f"..{host_address(MAX_HOSTS - 1)}/{PREFIX_LEN}), got {hosts}"
        )
    return LabSpec(
        hosts=hosts, bandwidth=bandwidth, bandwidth_bps=bandwidth_bps,
        names=tuple(host_name(i) for i in range(hosts)),
        addresses=tuple(host_address(i) for i in range(hosts)),
        shim=str(state_dir() / "ssh-shim"),
    )


def state_dir() -> Path:
    """Return the directory of the state file and shim ($COMMWIRE_LAB_DIR or /run/commwire-lab)."""
    value = _config.env_str(_ENV_DIR, _DEFAULT_DIR)
    if not value or not os.path.isabs(value):
        raise ValueError(f"{_ENV_DIR} must be an absolute directory path, got {value!r}")
    return Path(value)


def load_state() -> LabSpec | None:
    """Return the persisted spec, or None when no lab state file exists."""
    path = state_dir() / _STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return LabSpec.from_json(text, str(path))


def save_state(spec: LabSpec) -> None:
    """Persist *spec* atomically so a concurrent reader never sees half a file."""
    path = state_dir() / _STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(spec.to_json())
    os.replace(tmp, path)


@contextlib.contextmanager
def locked() -> Iterator[Path]:
    """Hold an exclusive lock on the state directory (created if needed, removed if left empty)."""
    directory = state_dir()
    while True:
        directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # `down` removes the directory: if that happened while we waited, the
            # lock is on a dead inode and would exclude nobody, so take it again.
            try:
                same = os.stat(directory).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield directory
                finally:
                    # The directory lives only while locked or while it holds a lab's
                    # files, so an idle machine keeps nothing of the lab.
                    with contextlib.suppress(OSError):
                        directory.rmdir()
                return
        finally:
            os.close(fd)
