"""Drive the lab: `python -m commwire.lab {up,down,status,cut,heal,exec,run}`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

from . import cut, down, heal, host_command, launch_args, status, up


def _parser() -> argparse.ArgumentParser:
    """Return the argument parser."""
    parser = argparse.ArgumentParser(prog="python -m commwire.lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="create the lab (no-op if already up with the same settings)")
    p.add_argument("--hosts", type=int, required=True, help="number of host namespaces")
    p.add_argument("--bandwidth", default="1gbit", help="per-link limit, e.g. 100mbit, 1gbit (default 1gbit)")
    sub.add_parser("down", help="remove the lab and any leftovers")
    sub.add_parser("status", help="show the lab")
    for name, help_ in (("cut", "take a host's link down"), ("heal", "bring a host's link back up")):
        sub.add_parser(name, help=help_).add_argument("host", help="host name (cw-h1) or index (1)")
    p = sub.add_parser("exec", help="run a command inside a host's namespace")
    p.add_argument("host")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="command (after --)")
    p = sub.add_parser("run", help="run a command on NP MPI ranks across the lab hosts")
    p.add_argument("-n", "--np", type=int, required=True)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="command (after --)")
    return parser


def _argv(argv: list[str]) -> list[str]:
    """Return the command after an optional leading '--'."""
    return argv[1:] if argv[:1] == ["--"] else argv


def main(args: Sequence[str] | None = None) -> int:
    """Parse *args*, run the subcommand and return the exit status."""
    ns = _parser().parse_args(args)
    try:
        if ns.command == "up":
            print(up(ns.hosts, ns.bandwidth).describe())
        elif ns.command == "down":
            removed = down()
            print("\n".join(f"removed {item}" for item in removed) or "nothing to remove")
        elif ns.command == "status":
            spec = status()
            print(spec.describe() if spec else "no lab is up")
        elif ns.command in ("cut", "heal"):
            host = (cut if ns.command == "cut" else heal)(ns.host)
            print(f"{host}: link {'down' if ns.command == 'cut' else 'up'}")
        elif ns.command == "exec":
            return subprocess.call(host_command(ns.host, _argv(ns.argv)))
        else:
            prefix, env = launch_args(ns.np, os.environ)
            command = _argv(ns.argv)
            if not command:
                raise ValueError("run needs a command after --, e.g. -- python train.py")
            return subprocess.call([*prefix, *command], env=env)
    except (ValueError, TypeError, RuntimeError, PermissionError) as exc:
        print(f"commwire lab: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # `up` has already torn down what it had built when this reaches us.
        print(f"commwire lab: {ns.command} interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
