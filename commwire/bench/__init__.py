"""Benchmarks a user runs to check their own cluster and install (``commwire bench NAME``).

Each module of ``MODULES`` declares what ``commwire bench`` needs:

- ``NAME``: the command's name, and ``HELP``: one line for ``commwire bench --help``;
- ``DRIVER``: True when it launches its own ``commwire run`` jobs (it runs in the
  calling process, and ``commwire bench NAME -np N`` passes ``--np N`` on), False
  for an MPI program (``-np N`` launches it on N ranks);
- ``build_parser()``: its argparse parser, with which the command line is checked
  once, before any rank starts;
- ``check_args(args)`` (optional): refuse values the parser keeps as text, with a
  ValueError whose message names the option;
- ``main(argv)``: run it.

The research studies (learning-rate grids, the GIFT evaluation, the cost model's
calibration) are not part of the package: they live in the repository's
``benchmarks/`` folder and run from a checkout (``STUDIES``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MODULES", "STUDIES", "registry"]

MODULES = ("allreduce", "transports", "hierarchical", "codecs", "glm", "torch_ddp", "grouped", "ddp", "fsdp", "agreement", "faults",
           "project", "suite")
"""The benchmark modules of this package, in the order ``commwire bench --help`` lists them."""

STUDIES = {"lordo": "commwire run -np N python benchmarks/lordo.py",
           "gift": "commwire run -np N python benchmarks/gift.py",
           "calibrate": "python benchmarks/calibrate.py",
           "jobs": "python benchmarks/jobs.py"}
"""The command that runs each research study of the repository's ``benchmarks/`` folder from a checkout."""


def registry() -> dict[str, ModuleType]:
    """Import every benchmark module and return them by ``NAME``."""
    modules = [importlib.import_module(f"{__name__}.{name}") for name in MODULES]
    return {module.NAME: module for module in modules}
