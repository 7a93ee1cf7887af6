"""Import the research studies of the repository's benchmarks/ folder, which the package does not ship."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FOLDER = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """Return ``benchmarks/NAME.py``; its private sibling modules (``_outliers``, ...) import as they do when run.

    A study is registered as ``research_NAME``: tests/lordo and tests/gift are folders
    of the same names on the tests' import path. A private helper (``_simulated``)
    imports under its own name, the one the studies import it by, so there is one copy.
    """
    if str(FOLDER) not in sys.path:
        sys.path.append(str(FOLDER))  # what `python benchmarks/NAME.py` puts first on sys.path
    if name.startswith("_"):
        return importlib.import_module(name)
    key = f"research_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, FOLDER / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
