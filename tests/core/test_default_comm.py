"""One way to find the default communicator (commwire.comm.default_comm) — tier 1 (single process, subprocesses)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mpi_helpers import ROOT

import commwire as cw
from commwire.comm import default_comm

# Before init(): every adapter raises the same error; only GLM initialises (its quick start has no init()).
_BEFORE_INIT = r"""
import numpy as np
import commwire as cw
from commwire.comm import default_comm
from commwire.fusion import FusionBuffer

def refused(call):
    try:
        call()
    except RuntimeError as exc:
        assert "call commwire.init() first" in str(exc), exc
        return True
    return False

assert refused(lambda: cw.allreduce(np.ones(2)))
assert refused(lambda: default_comm())
assert refused(lambda: FusionBuffer([("w", np.ones(2))]))
assert refused(lambda: cw.checkpoint.save("/nonexistent/ckpt", {}))
assert not cw.is_initialized()
world = default_comm(init_if_needed=True)
assert cw.is_initialized() and world is cw.world() and default_comm() is world
print("ok")
"""


def test_every_adapter_raises_before_init_and_glm_initialises():
    proc = subprocess.run([sys.executable, "-c", _BEFORE_INIT], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_glm_fit_without_init_initialises_commwire():
    pytest.importorskip("sklearn")
    code = ("import numpy as np, commwire as cw; from commwire.glm import GLM\n"
            "X = np.random.default_rng(0).standard_normal((64, 4)); y = (X[:, 0] > 0).astype(float)\n"
            "GLM('logistic', batch_size=8, s=2, max_iter=1, random_state=0).fit(X, y)\n"
            "assert cw.is_initialized(); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_given_communicator_is_returned_as_is():
    world = cw.init()
    sub = world.duplicate()
    assert default_comm(sub) is sub and default_comm(sub, init_if_needed=True) is sub
    assert default_comm() is world and default_comm(None, init_if_needed=True) is world
