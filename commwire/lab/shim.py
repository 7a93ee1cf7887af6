"""Write the script Hydra runs instead of ssh to start its proxy on a lab host."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

__all__ = ["write_shim", "named_host"]

NAME_HOST = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
"""``sh -c`` script run as ``sh -c NAME_HOST HOST CMD...``: name the (new UTS namespace's) host HOST, run CMD."""


def named_host(unshare: str, host: str) -> list[str]:
    """Return the argv prefix that runs a command under its own host name ``host`` (a real host has one)."""
    return [unshare, "--uts", "--", "sh", "-c", NAME_HOST, host]

# Hydra's ssh launcher calls "<launcher-exec> -x HOST 'CMD' ARGS...", like `ssh -x host cmd`.
# sshd would hand the joined words to the remote shell; `sh -c "$*"` does the same inside
# the host's namespace. `ip netns exec` keeps the environment (PATH, the venv) and
# bind-mounts /etc/netns/HOST/hosts so every lab host name resolves there. `unshare --uts`
# gives the host its own host name, as a real host has: MPICH then keeps shared memory for
# the ranks of one lab host and sends everything else over the lab's links.
_TEMPLATE = """#!/bin/sh
# commwire lab: Hydra launcher shim (ssh HOST CMD -> ip netns exec HOST sh -c CMD)
while [ $# -gt 0 ]; do
    case "$1" in
        -[oilpFJ]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
if [ $# -lt 2 ]; then
    echo "commwire lab shim: expected HOST COMMAND..., got: $*" >&2
    exit 255
fi
shift
case "$host" in
    cw-h[0-9]*) ;;
    *) echo "commwire lab shim: $host is not a lab host (cw-hN); is the lab up?" >&2; exit 255 ;;
esac
exec {ip} netns exec "$host" {unshare} --uts -- sh -c {name_host} "$host" sh -c "$*"
"""


def write_shim(path: Path, ip: str, unshare: str) -> Path:
    """Write the launcher shim to *path*, calling *ip* and *unshare* by absolute path, and make it executable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_TEMPLATE.format(ip=shlex.quote(ip), unshare=shlex.quote(unshare), name_host=shlex.quote(NAME_HOST)))
    os.chmod(path, 0o755)
    return path
