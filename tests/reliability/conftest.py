"""Hypothesis profiles and case counts of the fuzz suite.

Profiles: "ci" (the default: a few dozen cases per target, so ``python -m pytest -q``
stays fast) and "soak" (10,000 cases per target)::

    mpiexec -n 3 python -m pytest tests/reliability/mpi_fuzz.py --hypothesis-profile soak
    python -m pytest tests/reliability/test_spec_fuzz.py tests/reliability/test_cli_fuzz.py --hypothesis-profile soak

Registered at import, before pytest's hypothesis plugin reads ``--hypothesis-profile``
(name this folder or a file in it on the command line for that). Every rank
must draw the same examples, hence derandomize and no database. The terminal
summary prints how many cases each target ran (``_oracle.count``).
"""

import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # _oracle (here), also under --import-mode=importlib
    sys.path.insert(0, str(HERE))

import _oracle  # noqa: E402

_COMMON = {"derandomize": True, "database": None, "deadline": None, "suppress_health_check": list(HealthCheck),
           "print_blob": False}
settings.register_profile("ci", max_examples=60, **_COMMON)
settings.register_profile("soak", max_examples=10_000, **_COMMON)


def pytest_configure(config):
    if not config.getoption("hypothesis_profile", default=None):
        settings.load_profile("ci")


def pytest_terminal_summary(terminalreporter):
    if not _oracle.CASES:
        return
    rank = _oracle.rank_label()
    terminalreporter.write_sep("-", f"fuzz cases{rank} (profile {settings.get_current_profile_name()})")
    for target, n in sorted(_oracle.CASES.items()):
        failed = _oracle.FAILED.get(target, 0)
        terminalreporter.write_line(f"{target}: {n} cases, {failed} failing")
