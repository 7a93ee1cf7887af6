"""An emulated multi-host cluster on one machine: network namespaces, a bridge, tc limits.

Needs root and iproute2 (`ip`, `tc`). Hosts cw-h0..cw-h{N-1} get 198.18.0.(10+i)/24
on a bridge that lives in its own namespace (cw-sw), so the root namespace is never
touched; every link is limited to the same bandwidth in both directions (tbf). The
kernel here has no netem, so latency and loss are not injected: the namespaces' TCP
stack gives real small-message latency, `cut`/`heal` give link failures.

Example::

    from commwire import lab
    spec = lab.up(hosts=4, bandwidth="1gbit")
    argv, env = lab.launch_args(4, os.environ)
    subprocess.run([*argv, "python", "train.py"], env=env, check=True)
    lab.cut("cw-h2"); lab.heal("cw-h2")
    lab.down()
"""

from .bandwidth import format_bandwidth, parse_bandwidth
from .launcher import LAB_ENV, launch_args, placement
from .netns import cut, down, heal, host_command, require_tools, status, up
from .spec import MAX_HOSTS, LabSpec

__all__ = [
    "LabSpec", "MAX_HOSTS", "LAB_ENV",
    "up", "down", "status", "cut", "heal", "host_command", "require_tools",
    "launch_args", "placement", "parse_bandwidth", "format_bandwidth",
]
