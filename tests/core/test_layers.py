"""The package's import structure — tier 1 (reads the source with ``ast``; imports nothing of commwire).

Every module of ``commwire`` is walked: ``import`` and ``from ... import`` statements
anywhere in it (inside functions too) and ``importlib.import_module("...")`` calls with
a literal name. Three rules:

(a) the library never imports its benchmarks: no module outside ``commwire.bench``
    imports it (the CLI's ``bench`` command, which runs them, excepted), and no
    module imports the research studies of the repository's ``benchmarks/`` folder;
(b) no module imports a private name (``_x``: a function, constant or module) of
    another package of commwire; a package's own privates and the root's shared
    helpers (``commwire._config``, ``commwire._validate``) are fine;
(c) layers import downwards only (``LAYERS``); modules of one layer may import each other.

And, in a subprocess, ``import commwire`` leaves the heavy dependencies (torch, numba,
ml_dtypes, ...) unloaded.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "commwire"

LAYERS = {
    # shared helpers every layer may use
    "commwire._config": 0,
    "commwire._validate": 0,
    # core: communicators, collectives, the agreement protocol, transports
    "commwire.comm": 1,
    # codecs and the compressed collectives over codec payloads
    "commwire.codecs": 2,
    # policies: what to send when (fusion buckets, schedules, optimizer maths), checkpoints, the cost model
    "commwire.fusion": 3,
    "commwire.schedules": 3,
    "commwire.optim": 3,
    "commwire.checkpoint": 3,
    "commwire.costmodel": 3,
    # elastic state and its driver: above the core, used by the adapters and the launcher
    "commwire.elastic": 3,
    # adapters: PyTorch, GLM solvers
    "commwire.torch": 4,
    "commwire.glm": 4,
    # tools: the launcher, the rank wrapper, the emulated cluster, diagnostics
    "commwire.launch": 5,
    "commwire._rankmain": 5,
    "commwire.runfunc": 5,
    "commwire.lab": 5,
    "commwire.info": 5,
    # benchmarks a user runs on their cluster, beside the stack
    "commwire.bench": 6,
    # the command line
    "commwire.cli": 7,
    "commwire.__main__": 7,
}
"""Layer of each package or module (the longest matching prefix counts): a module imports only its own layer
and lower ones. The root package ``commwire`` is the public facade: importing it is allowed everywhere."""
SHARED_PRIVATES = ("commwire._config", "commwire._validate")
"""Private modules of the root that every package may import."""
BENCH_RUNNERS = ("commwire.cli",)
"""Modules outside commwire.bench that may import it: the ``commwire bench`` command runs the benchmarks."""
RESEARCH = {"benchmarks"} | {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
"""Top-level names under which the repository's benchmarks/ scripts import (run as files, their folder is on
sys.path)."""


@dataclass(frozen=True)
class Import:
    """One imported name: the importing module, the line, the module imported from and the full dotted name."""

    importer: str
    path: Path
    line: int
    module: str
    """The module the statement loads (a submodule when ``from P import sub`` names one)."""
    name: str
    """The full dotted name imported (``module.attribute`` for an attribute)."""

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.importer} imports {self.name}"


def _modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Return every module of the package: dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return out


def _imports(name: str, path: Path, is_init: bool, modules: dict[str, tuple[Path, bool]],
             source: str | None = None) -> list[Import]:
    """Return what module ``name`` (its file ``path``, or ``source``) imports, resolved to absolute names."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    package = name if is_init else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, path, node.lineno, alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if alias.name == "*":
                    found.append(Import(name, path, node.lineno, module, module))
                elif full in modules:  # `from pkg import submodule`
                    found.append(Import(name, path, node.lineno, full, full))
                else:
                    found.append(Import(name, path, node.lineno, module, full))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            found.append(Import(name, path, node.lineno, node.args[0].value, node.args[0].value))
    return found


def _layer(module: str) -> int | None:
    keys = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    return LAYERS[max(keys, key=len)] if keys else None


def _private_owner(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """Return the package that owns the first private part of dotted ``name`` (None: nothing private in it)."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            owner = ".".join(parts[:i])
            is_package = modules.get(owner, (None, True))[1]
            return owner if is_package else owner.rpartition(".")[0]
    return None


def violations(imports: list[Import], modules: dict[str, tuple[Path, bool]]) -> dict[str, list[str]]:
    """Return the breaches of each rule, one line each: where, who imports what, and why it is refused."""
    out: dict[str, list[str]] = {"bench": [], "private": [], "layer": []}
    for imp in imports:
        top = imp.module.partition(".")[0]
        if top in RESEARCH:
            out["bench"].append(f"{imp.where()}: the research studies of benchmarks/ are not part of the package")
        if top != "commwire":
            continue
        inside = imp.importer == "commwire.bench" or imp.importer.startswith("commwire.bench.")
        runner = any(imp.importer == r or imp.importer.startswith(r + ".") for r in BENCH_RUNNERS)
        if (imp.module == "commwire.bench" or imp.module.startswith("commwire.bench.")) and not inside \
                and not runner:
            out["bench"].append(f"{imp.where()}: the library never imports commwire.bench")
        owner = _private_owner(imp.name, modules)
        importer_package = imp.importer if modules[imp.importer][1] else imp.importer.rpartition(".")[0]
        shared = any(imp.name == s or imp.name.startswith(s + ".") for s in SHARED_PRIVATES)
        if owner is not None and owner != importer_package and not shared:
            out["private"].append(f"{imp.where()}: a private name of {owner}; make it public there (no leading "
                                  "underscore, a docstring) or move the code into that package")
        if imp.importer == "commwire" or imp.module == "commwire":
            continue  # the root package is the facade: it re-exports, and everyone may import it
        mine, theirs = _layer(imp.importer), _layer(imp.module)
        if mine is None or theirs is None:
            unknown = imp.importer if mine is None else imp.module
            out["layer"].append(f"{imp.where()}: {unknown} has no layer; add it to LAYERS in {Path(__file__).name}")
        elif theirs > mine:
            out["layer"].append(f"{imp.where()}: layer {mine} imports layer {theirs} (an upper layer)")
    return out


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    modules = _modules()
    imports = [imp for name, (path, is_init) in modules.items() for imp in _imports(name, path, is_init, modules)]
    assert len(imports) > 300  # the walk sees the package (a guard against a walk that finds nothing)
    return violations(imports, modules)


def test_the_library_never_imports_its_benchmarks(found):
    assert not found["bench"], "\n".join(found["bench"])


def test_no_module_imports_another_packages_private_names(found):
    assert not found["private"], "\n".join(found["private"])


def test_layers_import_downwards_only(found):
    assert not found["layer"], "\n".join(found["layer"])


def test_the_rules_catch_each_kind_of_breach():
    modules = _modules()
    source = '''
from ..bench import project
from ..codecs._threads import set_threads
from ..comm.communicator import _describe, Communicator
from .. import _config, torch
from ._auto import choose


def later():
    import lordo
    from commwire.cli.main import main
    importlib.import_module("commwire.bench.glm")
'''
    path, _ = modules["commwire.glm.solver"]
    imports = _imports("commwire.glm.solver", path, False, modules, source)
    found = violations(imports, modules)
    names = {kind: [line.split(" imports ")[1].split(":")[0] for line in lines] for kind, lines in found.items()}
    assert names["bench"] == ["commwire.bench.project", "lordo", "commwire.bench.glm"]
    assert names["private"] == ["commwire.codecs._threads.set_threads", "commwire.comm.communicator._describe"]
    assert names["layer"] == ["commwire.bench.project", "commwire.cli.main.main", "commwire.bench.glm"]
    assert found["private"][1].startswith("commwire/glm/solver.py:4: commwire.glm.solver imports ")


def test_importing_commwire_leaves_the_heavy_dependencies_unloaded():
    # Every rank of every job pays for what `import commwire` loads: ml_dtypes 0.7 alone takes
    # ~0.8 s, torch ~2 s. They load on first use (a bfloat16 array, a tensor, a codec kernel).
    import subprocess
    import sys

    heavy = ("torch", "numba", "ml_dtypes", "scipy", "sklearn", "cupy")
    code = f"import sys, commwire; print([m for m in {heavy!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"`import commwire` loads {proc.stdout.strip()}"
