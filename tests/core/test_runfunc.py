"""commwire.run (horovod.run): a function on N ranks, its values back in rank order — real jobs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from mpi_helpers import ROOT, mpiexec_path

pytestmark = pytest.mark.mpi


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'commwire[mpich]'")
    (tmp_path / "helper_mod.py").write_text("def times(a, b):\n    return a * b\n")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_a_function_of_the_calling_script_runs_on_every_rank_and_returns_in_rank_order(tmp_path):
    # work() lives in the calling script and uses a module beside it: each rank finds both; the
    # script's main part runs once (here), not on the ranks.
    proc = _script(tmp_path, """
        import numpy as np
        import commwire
        import helper_mod

        def work(x, scale=1):
            commwire.init()
            total = float(commwire.allreduce(np.full(1, commwire.rank() + 1.0))[0])
            return {"rank": commwire.rank(), "value": helper_mod.times(x, scale) * commwire.rank(), "total": total}

        if __name__ == "__main__":
            print("MAIN ONCE")
            print("RESULT", commwire.run(work, args=(3,), kwargs={"scale": 2}, num_proc=3))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("MAIN ONCE") == 1
    want = [{"rank": r, "value": 6 * r, "total": 6.0} for r in range(3)]
    assert f"RESULT {want}" in proc.stdout, proc.stdout


def test_a_failing_rank_fails_the_call_and_a_lambda_needs_cloudpickle(tmp_path):
    proc = _script(tmp_path, """
        import commwire

        def fails():
            commwire.init()
            if commwire.rank() == 1:
                raise ValueError("rank one gives up")
            commwire.barrier()

        if __name__ == "__main__":
            try:
                commwire.run(fails, num_proc=2)
            except RuntimeError as exc:
                print("CAUGHT", exc)
            try:
                import cloudpickle  # noqa: F401 - pickles lambdas by value
                print("LAMBDA", commwire.run(lambda a: a + 1, args=(41,), num_proc=2))
            except ImportError:
                try:
                    commwire.run(lambda a: a + 1, args=(41,), num_proc=2)
                except TypeError as exc:
                    print("LAMBDA refused:", exc)
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CAUGHT commwire.run: the job of fails failed" in proc.stdout, proc.stdout
    assert "ValueError: rank one gives up" in proc.stdout + proc.stderr
    assert "LAMBDA [42, 42]" in proc.stdout or "pip install cloudpickle" in proc.stdout, proc.stdout


def test_only_the_last_launchs_results_count(tmp_path):
    # An elastic job launched twice: launch 0's rank 2 returned before the job was re-formed on 2 ranks.
    import pickle

    from commwire.runfunc import read_results

    for launch, rank, value in ((0, 0, "old0"), (0, 2, "stale"), (1, 0, "new0"), (1, 1, "new1")):
        (tmp_path / f"result.{launch}.{rank}").write_bytes(pickle.dumps(value))
    (tmp_path / ".result.1.999").write_bytes(b"half written")
    (tmp_path / "job.pkl").write_bytes(b"")
    assert read_results(str(tmp_path)) == ["new0", "new1"]
    (tmp_path / "empty").mkdir()
    assert read_results(str(tmp_path / "empty")) == []
