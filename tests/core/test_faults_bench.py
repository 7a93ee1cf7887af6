"""The fault-injection benchmark itself — tier 2 (launches real failing jobs)."""

import pytest

from commwire.bench import faults

pytestmark = pytest.mark.mpi


def test_each_local_scenario_ends_in_time_and_names_the_rank():
    records = faults.run_fault_bench(["kill9", "raise", "stall"], repeats=1, np_=3, timeout=2.0, seed=1)
    assert [r["scenario"] for r in records] == ["kill9", "raise", "stall"]
    for r in records:
        assert r["ok"], r
    assert "| kill9 | 1 | 1 | 0 | 1/1 | 0 |" in faults.format_table(records, 2.0)


def test_unknown_scenario_is_refused():
    with pytest.raises(ValueError, match="unknown scenarios"):
        faults.run_fault_bench(["meteor"], repeats=1)


@pytest.mark.parametrize("scenario", ["resume-ef", "resume-lordo"])
def test_a_killed_job_resumes_from_its_checkpoint_bit_identically(scenario):
    records = faults.run_fault_bench([scenario], repeats=1, np_=2, timeout=2.0, seed=2)
    (r,) = records
    assert r["ok"], r
    assert r["identical"] and r["resumed_from"] >= 4 and r["kill_step"] >= r["resumed_from"]
    assert f"| {scenario} | 1 | 1 | 0 | 1/1 | 0 |" in faults.format_table(records, 2.0)
    assert faults.format_table(records, 2.0).endswith("| 1/1 |")
