"""The launcher's rank variables, read in one place (commwire.comm.rankenv) — tier 1 (single processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from commwire.codecs import _threads
from commwire.comm import ranklog
from commwire.comm.rankenv import (LAUNCHER_VARIABLES, LauncherRanks, LoneStart, launcher_ranks, lone_start,
                                   torch_variables)

# What each launcher sets for rank 5 of 8, the second of 4 ranks on its node.
LAUNCHERS = {
    "mpich": {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
    "openmpi": {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    # What srun sets in a step (seen on Slurm 22.05); --ntasks-per-node would add SLURM_NTASKS_PER_NODE.
    "slurm": {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
              "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
              "SLURM_JOB_NUM_NODES": "2",
              "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_TASKS_PER_NODE": "4(x2)"},
}
# A batch script's own process: its allocation's counts, no step.
BATCH_SCRIPT = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NUM_NODES": "2"}


@pytest.fixture
def clean_env(monkeypatch):
    for names in LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("COMMWIRE_CODEC_THREADS", raising=False)
    return monkeypatch


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_each_launchers_variables_give_the_same_answer(clean_env, launcher):
    for name, value in LAUNCHERS[launcher].items():
        clean_env.setenv(name, value)
    assert launcher_ranks() == LauncherRanks(rank=5, size=8, local_rank=1, local_size=4)
    assert ranklog.env_rank() == "5"


def test_pmix_rank_alone_gives_the_rank(clean_env):
    clean_env.setenv("PMIX_RANK", "3")
    assert launcher_ranks() == LauncherRanks(rank=3, size=None, local_rank=None, local_size=None)


def test_nothing_announced_is_none_and_an_unknown_rank(clean_env):
    assert launcher_ranks() == LauncherRanks(None, None, None, None)
    assert ranklog.env_rank() == "?"


def test_values_that_are_not_counts_are_skipped():
    env = {"PMI_RANK": "", "OMPI_COMM_WORLD_RANK": "2", "PMI_SIZE": "0", "SLURM_NTASKS": "x", "MPI_LOCALNRANKS": "-1"}
    assert launcher_ranks(env) == LauncherRanks(rank=2, size=None, local_rank=None, local_size=None)


def test_the_table_holds_every_launchers_variables():
    assert set(LAUNCHER_VARIABLES["rank"]) >= {"PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK"}
    assert set(LAUNCHER_VARIABLES["size"]) >= {"PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}
    assert set(LAUNCHER_VARIABLES["local_size"]) >= {"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                                     "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"}


@pytest.mark.parametrize("per_node,node,step_nodes,expected", [
    ("4(x2)", None, None, 4),  # the same on every node: no need to know which node
    ("4(x2),3", "2", "3", 3), ("4(x2),3", "0", "3", 4),
    ("4(x2),3", "2", "2", None),  # the step spans part of the job: SLURM_NODEID does not index its list
    ("4(x2),3", None, "3", None), ("4(x2),3", "5", "3", None), ("4(x,3", "0", "1", None),
])
def test_slurms_per_node_counts_give_this_nodes(per_node, node, step_nodes, expected):
    env = {"SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_JOB_NUM_NODES": "3"}
    env.update({k: v for k, v in (("SLURM_NODEID", node), ("SLURM_STEP_NUM_NODES", step_nodes)) if v is not None})
    assert launcher_ranks(env).local_size == expected


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_codec_threads_share_the_cores_among_the_ranks_of_a_node(clean_env, launcher):
    clean_env.setattr(_threads, "_usable_cpus", lambda: 16)
    for name, value in LAUNCHERS[launcher].items():
        if name in LAUNCHER_VARIABLES["local_size"]:  # the node's rank count alone decides
            clean_env.setenv(name, value)
    _threads.set_threads(None)  # forget the default worked out before
    try:
        assert _threads.default_threads() == 4
    finally:
        _threads.set_threads(None)


# A process MPI started alone although its launcher started several (commwire.init refuses it).
LONE = [
    ({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "none"}, None,
     LoneStart("torchrun", "WORLD_SIZE=4", 4)),
    ({"WORLD_SIZE": "2", "RANK": "0"}, None, LoneStart("torch.distributed", "WORLD_SIZE=2", 2)),
    ({}, 3, LoneStart("torch.distributed", "torch.distributed.get_world_size() = 3", 3)),
    (LAUNCHERS["openmpi"], None, LoneStart("mpiexec", "OMPI_COMM_WORLD_SIZE=8", 8)),
    (LAUNCHERS["mpich"], None, LoneStart("mpiexec", "PMI_SIZE=8", 8)),
    # srun without the MPI plugin this MPI needs starts every task as a world of 1 ...
    (LAUNCHERS["slurm"], None, LoneStart("srun", "SLURM_STEP_NUM_TASKS=8", 8)),
    ({**LAUNCHERS["slurm"], "PMI_SIZE": "8"}, None, LoneStart("srun", "SLURM_STEP_NUM_TASKS=8", 8)),
    # ... while a batch script's own process sees its allocation's SLURM_NTASKS: not a sign of a lone start.
    (BATCH_SCRIPT, None, None),
    ({**LAUNCHERS["slurm"], "SLURM_STEP_NUM_TASKS": "1"}, None, None),
    ({"WORLD_SIZE": "1", "RANK": "0"}, 1, None),
    ({"WORLD_SIZE": "x"}, None, None),
]


@pytest.mark.parametrize("env,torch_world,expected", LONE)
def test_a_lone_start_is_told_by_the_launchers_variables(env, torch_world, expected):
    assert lone_start(1, env, torch_world) == expected
    assert lone_start(8, env, torch_world) is None  # MPI started them together


def _init_alone(env: dict[str, str], code: str = "commwire.init()") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in {n for names in LAUNCHER_VARIABLES.values() for n in names} | {"WORLD_SIZE", "RANK"}}
    return subprocess.run([sys.executable, "-c", f"import commwire\nfrom mpi4py import MPI\nprint({code})"],
                          env={**clean, **env}, capture_output=True, text=True, timeout=120)


def test_init_refuses_a_process_another_mpis_launcher_started():
    # What Open MPI's mpirun gives each process of an mpi4py built on MPICH: its own world of 1.
    proc = _init_alone({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1"})
    assert proc.returncode != 0
    assert "RuntimeError: the launcher started 3 processes (OMPI_COMM_WORLD_SIZE=3)" in proc.stderr, proc.stderr
    assert "commwire run -np 3" in proc.stderr and "comm=MPI.COMM_SELF" in proc.stderr


def test_init_refuses_a_task_srun_started_without_this_mpis_plugin():
    # What `srun -n 2 --mpi=none python train.py` gives each task of an mpi4py on MPICH (seen on Slurm 22.05).
    from mpi4py import MPI

    proc = _init_alone({k: v for k, v in LAUNCHERS["slurm"].items() if k != "SLURM_STEP_NUM_TASKS"}
                       | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"})
    assert proc.returncode != 0
    assert "RuntimeError: srun started this process as one of 2 (SLURM_STEP_NUM_TASKS=2)" in proc.stderr, proc.stderr
    needed = {"MPICH": "pmi2", "Intel MPI": "pmi2", "Open MPI": "pmix"}[MPI.get_vendor()[0]]
    assert f"`srun --mpi={needed} ...`" in proc.stderr and "commwire run -np 2" in proc.stderr
    batch = _init_alone(BATCH_SCRIPT, "commwire.init().size")
    assert batch.returncode == 0 and batch.stdout.strip() == "1", batch.stderr
    alone = _init_alone({"OMPI_COMM_WORLD_SIZE": "3"}, "commwire.init(comm=MPI.COMM_SELF).size")
    assert alone.returncode == 0 and alone.stdout.strip() == "1", alone.stderr
    plain = _init_alone({}, "commwire.init().size")
    assert plain.returncode == 0 and plain.stdout.strip() == "1", plain.stderr


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_torchs_variables_come_from_each_launchers(launcher):
    assert torch_variables(LAUNCHERS[launcher]) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "4"}
    # What the environment sets already stays (the user's, or torchrun's); nothing without a rank and a size.
    assert torch_variables({**LAUNCHERS[launcher], "LOCAL_RANK": "3"}) == {"RANK": "5", "WORLD_SIZE": "8",
                                                                           "LOCAL_WORLD_SIZE": "4"}
    assert torch_variables({"PMI_RANK": "1", "MPI_LOCALRANKID": "1"}) == {}
