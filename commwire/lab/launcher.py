"""Tell `commwire run --lab` how to start MPI ranks on the lab hosts through MPICH's Hydra."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from .._validate import positive_int
from .netns import require_tools, status
from .shim import named_host, write_shim
from .spec import HOST_IFACE, LabSpec

__all__ = ["launch_args", "placement", "LAB_ENV"]

# Each lab host has its own host name (the launcher shim's UTS namespace), so MPICH keeps
# shared memory for the ranks of one host, as on a real node; between hosts every rank
# talks TCP (libfabric's tcp provider) over the lab interface, the only one that reaches
# other hosts.
LAB_ENV = {
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": HOST_IFACE,
}


def placement(np: int, hosts: int) -> list[int]:
    """Return how many of *np* ranks each host gets: blocks of ceil(np/hosts), in host order.

    Ranks 0..k-1 go to cw-h0, k..2k-1 to cw-h1, ..., like `mpiexec -ppn k` on a real
    cluster, so consecutive ranks share a host; the last used host may get fewer.
    """
    positive_int("np", np)
    per_host = math.ceil(np / hosts)
    counts = [min(per_host, np - i * per_host) for i in range(hosts)]
    return [count for count in counts if count > 0]


def _mpiexec(env: Mapping[str, str]) -> str:
    """Return MPICH's mpiexec (Hydra) from *env*'s PATH or next to this Python."""
    path = shutil.which("mpiexec", path=env.get("PATH")) or shutil.which(
        "mpiexec", path=os.path.dirname(sys.executable)
    )
    if path is None:
        raise RuntimeError("mpiexec not found on PATH; install MPICH (`pip install mpich`)")
    proc = subprocess.run([path, "--version"], capture_output=True, text=True)
    if "HYDRA" not in proc.stdout:
        raise RuntimeError(
            f"{path} is not MPICH's Hydra mpiexec, which `--lab` needs (its ssh launcher runs "
            "the namespace shim); put MPICH's mpiexec first on PATH (`pip install mpich`)"
        )
    return path


def _ready(spec: LabSpec | None, used: list[str] | None = None) -> LabSpec:
    """Return *spec* if ranks can be launched on it (on the hosts *used*, default all), else raise with the fix."""
    if spec is None:
        raise RuntimeError("no lab is up; run `commwire lab up --hosts N` first")
    cut = [h for h in spec.cut if used is None or h in used]
    if cut:
        raise RuntimeError(
            f"lab host(s) {', '.join(cut)} are cut, so their ranks could not start; "
            f"run `commwire lab heal {cut[0]}` first"
        )
    return spec


def launch_args(np: int, env: Mapping[str, str],
                hosts: list[tuple[str, int]] | None = None) -> tuple[list[str], dict[str, str]]:
    """Return the argv prefix and environment that run a command on *np* ranks across the lab.

    Append the user command to the prefix and run it with the returned environment.
    *hosts* (lab host names and rank counts, as the elastic driver chooses them)
    replaces the default placement over every lab host.
    mpiexec itself runs inside cw-h0 under that host's name (so Hydra's proxies
    connect back to a lab address, the root namespace needs none, and Hydra starts
    cw-h0's own ranks itself); Hydra starts the other hosts' proxies through the
    lab's ssh shim, which names each host alike. Ranks are placed in blocks (see `placement`).
    The environment is *env* plus `LAB_ENV` (forced: MPICH must take the tcp provider on
    the lab interface) and this Python's directory first on PATH, so ranks use the same venv.
    """
    tools = require_tools()
    spec = _ready(status(), None if hosts is None else [h for h, _ in hosts])
    # A lab brought up by an older commwire has a shim without the hosts' own names, with
    # which MPICH would take shared memory across lab hosts: write the current one.
    write_shim(Path(spec.shim), tools["ip"], tools["unshare"])
    if hosts is not None:
        unknown = [h for h, _ in hosts if h not in spec.names]
        if unknown or sum(c for _, c in hosts) != np:
            raise ValueError(f"lab hosts {hosts} do not fit: unknown {unknown}, lab has {', '.join(spec.names)}; "
                             f"the counts must add up to {np}")
    counts = placement(np, spec.hosts)
    out = dict(env)
    bindir = os.path.dirname(sys.executable)
    path = out.get("PATH", os.defpath)
    if path.split(os.pathsep)[0] != bindir:
        out["PATH"] = os.pathsep.join([bindir, path])
    out.update(LAB_ENV)
    # All lab "hosts" share this machine's cores: size codec thread pools for the
    # whole job, not for the one rank Hydra sees per host.
    out.setdefault("COMMWIRE_CODEC_THREADS", str(max(1, len(os.sched_getaffinity(0)) // np)))
    # torch.distributed baselines (DDP over gloo) rendezvous with rank 0, which runs on
    # the first host; gloo must also use the lab interface, not loopback.
    out["MASTER_ADDR"] = spec.addresses[0]
    out["GLOO_SOCKET_IFNAME"] = HOST_IFACE
    chosen = hosts if hosts is not None else list(zip(spec.names, counts))
    hostlist = ",".join(f"{name}:{count}" for name, count in chosen)
    out["MASTER_ADDR"] = spec.addresses[spec.names.index(chosen[0][0])]
    argv = [
        tools["ip"], "netns", "exec", chosen[0][0], *named_host(tools["unshare"], chosen[0][0]), _mpiexec(out),
        "-launcher", "ssh", "-launcher-exec", spec.shim,
        "-hosts", hostlist, "-n", str(np),
    ]
    return argv, out
