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
