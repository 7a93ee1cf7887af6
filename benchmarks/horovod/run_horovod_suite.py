"""Run Horovod's own PyTorch test suite and examples against commwire.torch.

Nothing of Horovod is copied into this repository: point ``--horovod`` at a
checkout (a work tree, or a bare git directory such as the one the search
tool's ``fetch`` gives) and this script copies the files it needs into a
temporary directory, changing only:

- ``import horovod.torch as hvd`` → ``import commwire.torch as hvd`` (and, in
  the examples, ``import horovod`` → ``import commwire as horovod``);
- test/utils/common.py: drop ``from horovod.runner.util.threads import
  in_thread`` (a launcher helper test_torch.py never uses);
- test_torch.py: leave torch >= 2.13's ``Muon`` out of the loops over
  ``torch.optim`` classes (Horovod itself fails there: Muon takes only 2-D
  parameters).

The suite runs as ONE ``mpiexec -n N python -m pytest test_torch.py`` job per
N, the way Horovod runs it, through the launcher ``commwire run`` would pick
(MPICH's or Open MPI's mpiexec beside this Python; srun, with its ``--mpi``
plugin, in a Slurm allocation); every rank writes its own JUnit report, and the
summary gives each rank's passed / failed / skipped counts and the failures.
The examples (pytorch_synthetic_benchmark.py, pytorch_mnist.py,
pytorch_imagenet_resnet50.py) run with the torchvision stand-in of
benchmarks/horovod/torchvision_standin (no CPU torchvision wheel matches the
torch here): plain, ``--fp16-allreduce`` and ``--use-adasum``; the ImageNet
example (it needs ``pip install tqdm tensorboard``) also with
``--batches-per-allreduce 2`` (gradients of two backward passes per step),
``--gradient-predivide-factor 2``, and once more for two epochs where the plain
run left its epoch-1 checkpoint, which it must resume from (rank 0 loads it,
``broadcast_parameters`` and ``broadcast_optimizer_state`` hand it on); the MNIST
example also as ``python pytorch_mnist.py --num-proc N`` (no launcher: it starts
its ranks through ``horovod.run``, here ``commwire.run``), over MPI and with
``--communication gloo``.

``--process-sets`` adds Horovod's two tests of ``hvd.init(process_sets=...)``,
test/parallel/test_process_sets_static.py and test_process_sets_multi_comm.py
(written against horovod.tensorflow, they use only the API horovod.torch
shares), each as one job per N, changing ``import horovod.tensorflow as hvd``
and the one internal call, ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``,
to commwire's ``commwire.torch.process_sets.registered()``.

``--elastic`` adds test/single/test_torch_elastic.py (one process, as Horovod's CI
runs test/single) and the elastic examples (pytorch_synthetic_benchmark_elastic.py,
pytorch_mnist_elastic.py, pytorch_imagenet_resnet50_elastic.py) under
``commwire run --min-np 1 --max-np N``, each once undisturbed and once with a
rank killed mid-training.

Usage:
    python benchmarks/horovod/run_horovod_suite.py --horovod /work/.mirror/horovod+horovod/repo \\
        --np 2,3 --examples --json horovod_suite.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "torchvision_standin"
SUITE = "test/parallel/test_torch.py"
IMPORT_EDIT = (r"^import horovod\.torch as hvd$", "import commwire.torch as hvd")
PROCESS_SET_TESTS = ("test/parallel/test_process_sets_static.py", "test/parallel/test_process_sets_multi_comm.py")
COMMON = "test/utils/common.py"
EXAMPLES = ("examples/pytorch/pytorch_synthetic_benchmark.py", "examples/pytorch/pytorch_mnist.py",
            "examples/pytorch/pytorch_imagenet_resnet50.py")
ELASTIC_TESTS = "test/single/test_torch_elastic.py"
ELASTIC_EXAMPLES = ("examples/elastic/pytorch/pytorch_synthetic_benchmark_elastic.py",
                    "examples/elastic/pytorch/pytorch_mnist_elastic.py",
                    "examples/elastic/pytorch/pytorch_imagenet_resnet50_elastic.py")


def read(horovod: Path, rel: str) -> str:
    """Return the text of ``rel`` from a work tree or a bare git directory."""
    if (horovod / rel).exists():
        return (horovod / rel).read_text()
    git_dir = horovod if (horovod / "HEAD").exists() else horovod / ".git"
    out = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"HEAD:{rel}"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"cannot read {rel} from {horovod}: {out.stderr.strip()}; pass a Horovod checkout")
    return out.stdout


def edit(text: str, replacements: list[tuple[str, str]], what: str) -> str:
    """Apply each (regex, replacement) exactly where it matches; fail if one matches nothing."""
    for pattern, repl in replacements:
        text, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
        if n == 0:
            raise SystemExit(f"{what}: expected to find {pattern!r}; is this Horovod's file?")
    return text


def prepare(horovod: Path, work: Path) -> Path:
    """Write the edited suite and helpers under ``work``; return the directory of test_torch.py."""
    (work / "parallel").mkdir(parents=True)
    (work / "utils").mkdir()
    suite = edit(read(horovod, SUITE), [
        IMPORT_EDIT,
        (r"subclass != torch\.optim\.SparseAdam$", "subclass != torch.optim.SparseAdam and subclass.__name__ != 'Muon'"),
    ], SUITE)
    common = edit(read(horovod, COMMON), [(r"^from horovod\.runner\.util\.threads import in_thread$", "")], COMMON)
    (work / "parallel" / "test_torch.py").write_text(suite)
    for rel in PROCESS_SET_TESTS:
        text = edit(read(horovod, rel), [
            (r"^import horovod\.tensorflow as hvd$",
             "import commwire.torch as hvd\nfrom commwire.torch import process_sets"),
            (r"hvd\.mpi_ops\._basics\._get_process_set_ids_and_ranks\(\)", "process_sets.registered()"),
        ], rel)
        (work / "parallel" / Path(rel).name).write_text(text)
    (work / "utils" / "common.py").write_text(common)
    return work / "parallel"


def launched(n: int, command: list[str]) -> list[str]:
    """Return the argv that starts ``command`` on ``n`` ranks with the launcher ``commwire run`` picks: the
    mpiexec of MPICH or Open MPI beside this Python, or srun (with its --mpi plugin) in a Slurm allocation."""
    from commwire import launch

    try:
        return launch.build_command(launch.find_launcher(), n, command)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"cannot start {n} ranks: {exc}") from None


def run_suite(directory: Path, n: int, timeout: float, out: Path, deselect: list[str] = (),
              test: str = "test_torch.py") -> dict:
    """Run ``test`` as one n-rank job (without the TorchTests named in ``deselect``); return per-rank counts."""
    out.mkdir(parents=True, exist_ok=True)
    skip = "".join(f" --deselect {test}::TorchTests::{name}" for name in deselect)
    rank = "${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-$SLURM_PROCID}}"  # Hydra, Open MPI, srun
    rank_cmd = (f"{sys.executable} -m pytest -q -p no:cacheprovider {test}{skip} "
                f"--junitxml={out}/rank{rank}.xml > {out}/rank{rank}.log 2>&1")
    start = time.monotonic()
    try:
        proc = subprocess.run(launched(n, ["sh", "-c", rank_cmd]), cwd=directory, timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    elapsed = time.monotonic() - start
    ranks = []
    for r in range(n):
        report = out / f"rank{r}.xml"
        ranks.append(junit_counts(report) if report.exists() else {"missing": str(report)})
    return {"test": test, "ranks": n, "launcher": launched(n, ["x"])[0], "exit": code,
            "seconds": round(elapsed, 1), "deselected": list(deselect), "per_rank": ranks}


def junit_counts(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
            message = next(c.get("message", "") for c in case if c.tag in ("failure", "error"))
            counts["failures"].append(f"{case.get('name')}: {message.splitlines()[0][:160] if message else ''}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    ran = counts["passed"] + counts["failed"]
    counts["pass_rate"] = round(counts["passed"] / ran, 4) if ran else 0.0
    return counts


def _example_env(images: int) -> dict[str, str]:
    """Return the examples' environment: the torchvision stand-in first on the path, its data set sizes."""
    return {**os.environ, "PYTHONPATH": f"{STANDIN}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "COMMWIRE_STANDIN_MNIST_TRAIN": "2048", "COMMWIRE_STANDIN_MNIST_TEST": "512",
            "COMMWIRE_STANDIN_IMAGEFOLDER": str(images)}


def _imagenet_outputs(run_dir: Path) -> list[str]:
    """Return the ImageNet examples' flags that put their TensorBoard log and checkpoints in ``run_dir``."""
    return ["--log-dir", str(run_dir / "logs"), "--checkpoint-format", str(run_dir / "ckpt-{epoch}.pth.tar")]


def run_examples(horovod: Path, work: Path, n: int, timeout: float) -> list[dict]:
    """Run Horovod's PyTorch examples with only the import changed; return one row per run."""
    rows = []
    edits = [IMPORT_EDIT]
    env = _example_env(images=256)
    scripts = {}
    for rel in EXAMPLES:
        extra = [(r"^import horovod$", "import commwire as horovod")] if rel.endswith("mnist.py") else []
        path = work / Path(rel).name
        path.write_text(edit(read(horovod, rel), edits + extra, rel))
        scripts[rel] = path
    flags = ["", "--fp16-allreduce", "--use-adasum"]
    runs = {
        "pytorch_synthetic_benchmark.py": (["--no-cuda", "--num-warmup-batches", "2", "--num-batches-per-iter", "2",
                                            "--num-iters", "3", "--batch-size", "8"], flags),
        "pytorch_mnist.py": (["--no-cuda", "--epochs", "1", "--data-dir", str(work / "data")],
                             flags + [f"--num-proc {n}", f"--num-proc {n} --communication gloo"]),
        # each run writes its own checkpoints; the last resumes the plain run's (its epoch 1) for epoch 2
        "pytorch_imagenet_resnet50.py": (["--no-cuda", "--batch-size", "16", "--val-batch-size", "16",
                                          "--train-dir", str(work / "imagenet" / "train"),
                                          "--val-dir", str(work / "imagenet" / "val")],
                                         flags + ["--batches-per-allreduce 2", "--gradient-predivide-factor 2",
                                                  "--epochs 2"]),
    }
    for rel, path in scripts.items():
        base, variants = runs[path.name]
        for flag in variants:
            args = base + flag.split()
            if path.name == "pytorch_imagenet_resnet50.py":
                run_dir = work / "imagenet" / (flag.replace("-", "").replace(" ", "") if flag != "--epochs 2" else "")
                run_dir.mkdir(parents=True, exist_ok=True)
                args += ([] if flag == "--epochs 2" else ["--epochs", "1"]) + _imagenet_outputs(run_dir)
            start = time.monotonic()
            # --num-proc: the example starts its own ranks (horovod.run); otherwise the MPI launcher starts them
            command = [sys.executable, str(path), *args]
            if not flag.startswith("--num-proc"):
                command = launched(n, command)
            try:
                proc = subprocess.run(command, cwd=work, env=env,
                                      capture_output=True, text=True, timeout=timeout)
                lines = (proc.stdout + proc.stderr).replace("\r", "\n").strip().splitlines()
                # one line per test-set report, throughput figure and (the last render of) finished progress bar
                key = {ln.split("|")[0] if "Epoch" in ln else ln: ln.strip() for ln in lines
                       if "Test set:" in ln or "Total img/sec" in ln or re.search(r"Epoch +#\d+: 100%", ln)}
                code, tail = proc.returncode, list(key.values()) or lines[-3:]
                if flag == "--epochs 2" and any("Epoch     #1" in ln for ln in key):
                    code, tail = "did not resume", tail + ["trained epoch 1 again: the checkpoint was not resumed"]
            except subprocess.TimeoutExpired:
                code, tail = "timeout", []
            rows.append({"example": path.name, "flag": flag or "(plain)", "ranks": n, "exit": code,
                         "seconds": round(time.monotonic() - start, 1), "last_lines": tail})
    return rows


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def run_elastic(horovod: Path, work: Path, n: int, timeout: float) -> list[dict]:
    """Run Horovod's elastic unit tests (one process, as Horovod's CI runs test/single) and elastic examples.

    Each example runs twice under ``commwire run -np N --min-np 1 --max-np N``: undisturbed, and
    with one of its ranks killed (SIGKILL) once training prints progress; both must finish
    (exit 0) and the second must have reset once.
    """
    rows = []
    edits = [IMPORT_EDIT]
    env = _example_env(images=1024)
    tests = work / Path(ELASTIC_TESTS).name
    tests.write_text(edit(read(horovod, ELASTIC_TESTS), edits, ELASTIC_TESTS))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=timeout)
    rows.append({"example": tests.name, "flag": "(one process, pytest)", "ranks": 1, "exit": proc.returncode,
                 "seconds": None, "last_lines": proc.stdout.strip().splitlines()[-1:]})
    runs = {
        "pytorch_synthetic_benchmark_elastic.py": ["--no-cuda", "--num-warmup-batches", "2",
                                                   "--num-batches-per-iter", "2", "--num-iters", "12",
                                                   "--batch-size", "8"],
        "pytorch_mnist_elastic.py": ["--no-cuda", "--epochs", "2", "--data-dir", str(work / "data")],
        # two backward passes per step, a commit every 2 steps, a host check every step
        "pytorch_imagenet_resnet50_elastic.py": ["--no-cuda", "--epochs", "3", "--batch-size", "16",
                                                 "--val-batch-size", "16", "--batches-per-allreduce", "2",
                                                 "--batches-per-commit", "2", "--batches-per-host-check", "1",
                                                 "--train-dir", str(work / "imagenet" / "train"),
                                                 "--val-dir", str(work / "imagenet" / "val")],
    }
    progress = re.compile(r"Iter #1:|Train Epoch: 1 \[\d+/\d+ \(\d\d?%|Train Epoch +#1: 100%")
    for rel in ELASTIC_EXAMPLES:
        path = work / Path(rel).name
        path.write_text(edit(read(horovod, rel), edits, rel))
        for kill in (False, True):
            args = list(runs[path.name])
            if "imagenet" in path.name:  # a fresh directory per run: a checkpoint left behind would be resumed
                args += _imagenet_outputs(work / "imagenet" / ("killed" if kill else "undisturbed"))
            cmd = [sys.executable, "-m", "commwire", "run", "-np", str(n), "--min-np", "1", "--max-np", str(n),
                   "-H", f"localhost:{n}", sys.executable, str(path), *args]
            start = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            lines, killed = [], None
            for line in proc.stdout:  # type: ignore[union-attr]
                lines.append(line.rstrip())
                if kill and killed is None and progress.search(line):
                    found = subprocess.run(["pgrep", "-f", f"commwire._rankmain.*{path}"], capture_output=True,
                                           text=True).stdout.split()
                    # each rank's status guardian is a fork of it (the same command line): leave those out
                    pids = {int(p) for p in found}
                    ranks = sorted(p for p in pids if _parent(p) not in pids)
                    if ranks:
                        killed = ranks[-1]
                        os.kill(killed, 9)
                if time.monotonic() - start > timeout:
                    proc.kill()
                    break
            code = proc.wait()
            key = [ln.split("\r")[-1] for ln in lines if "Total img/sec" in ln or "Test set:" in ln or "reset" in ln
                   or re.search(r"Validate Epoch +#\d+: 100%", ln)]
            rows.append({"example": path.name, "flag": f"rank pid {killed} killed" if kill else "(undisturbed)",
                         "ranks": n, "exit": code, "seconds": round(time.monotonic() - start, 1),
                         "resets": sum("commwire run: reset" in ln for ln in lines), "last_lines": key[-3:]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--horovod", required=True, type=Path, help="Horovod checkout (work tree or git dir)")
    parser.add_argument("--np", default="2,3", help="rank counts, comma-separated (default 2,3)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    parser.add_argument("--examples", action="store_true", help="also run the PyTorch examples")
    parser.add_argument("--elastic", action="store_true",
                        help="also run the elastic unit tests and the elastic PyTorch examples (one rank killed)")
    parser.add_argument("--process-sets", action="store_true",
                        help="also run Horovod's test_process_sets_static.py and test_process_sets_multi_comm.py")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--suite", action=argparse.BooleanOptionalAction, default=True,
                        help="run test_torch.py (default; --no-suite for the examples only)")
    parser.add_argument("--deselect", action="append", default=[], metavar="TEST",
                        help="leave out TorchTests.TEST (repeatable), e.g. a test that no implementation "
                             "can pass at this rank count; the summary names them")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="work in DIR and keep it (each rank's pytest log and JUnit report) instead of "
                             "a temporary directory")
    args = parser.parse_args(argv)
    counts = [int(v) for v in args.np.split(",") if v.strip()]
    import importlib.util

    # Horovod's test/utils/common.py imports mock and pytest (without them every rank's collection
    # fails, which reads like a commwire failure); the ImageNet example, tqdm and TensorBoard.
    needed = (("mock", "pytest") if args.suite or args.process_sets else ()) + (
        ("tqdm", "tensorboard") if args.examples else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"Horovod's tests and examples need {', '.join(missing)}: pip install {' '.join(missing)}")
    results: dict = {"suites": [], "examples": []}
    with tempfile.TemporaryDirectory(prefix="cw-horovod-") as tmp:
        work = Path(tmp)
        if args.keep is not None:
            if args.keep.exists() and any(args.keep.iterdir()):
                raise SystemExit(f"--keep {args.keep}: the directory is not empty; pass a new or empty one")
            work = args.keep.resolve()
            work.mkdir(parents=True, exist_ok=True)
        directory = prepare(args.horovod, work / "suite")
        jobs = [("test_torch.py", n, args.deselect) for n in (counts if args.suite else [])]
        jobs += [(Path(rel).name, n, []) for n in counts if args.process_sets for rel in PROCESS_SET_TESTS]
        for test, n, deselect in jobs:
            row = run_suite(directory, n, args.timeout, work / f"out{n}-{Path(test).stem}", deselect, test)
            results["suites"].append(row)
            left_out = f", without {', '.join(deselect)}" if deselect else ""
            print(f"{test} as one {row['launcher']} job of {n} ranks{left_out}: exit {row['exit']}, "
                  f"{row['seconds']} s")
            for r, rank in enumerate(row["per_rank"]):
                if "missing" in rank:
                    print(f"  rank {r}: no report ({rank['missing']})")
                    continue
                print(f"  rank {r}: {rank['passed']} passed, {rank['failed']} failed, {rank['skipped']} skipped "
                      f"({100 * rank['pass_rate']:.1f}% of those not skipped)")
            failures = sorted({f for rank in row["per_rank"] for f in rank.get("failures", [])})
            for f in failures:
                print(f"    FAILED {f}")
        for wanted, name, runner in ((args.examples, "examples", run_examples), (args.elastic, "elastic", run_elastic)):
            if not wanted:
                continue
            (work / name).mkdir()
            for row in runner(args.horovod, work / name, counts[0], args.timeout):
                results["examples"].append(row)
                resets = f", resets {row['resets']}" if "resets" in row else ""
                print(f"{row['example']} {row['flag']} on {row['ranks']} ranks: exit {row['exit']} "
                      f"({row['seconds']} s{resets}) {' | '.join(row['last_lines'])[:300]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    ok = all(s["exit"] == 0 for s in results["suites"]) and all(e["exit"] == 0 for e in results["examples"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
