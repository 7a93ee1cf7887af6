"""Environment variables are read in one place (commwire._config, commwire.comm.rankenv) — tier 1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from commwire import _config

PACKAGE = Path(_config.__file__).parent


def test_int_variables_take_whole_numbers_at_least_the_minimum(monkeypatch):
    assert _config.env_int("COMMWIRE_CODEC_THREADS", 0) == 0
    for raw, value in (("3", 3), (" 4.0 ", 4), ("", 0)):
        monkeypatch.setenv("COMMWIRE_CODEC_THREADS", raw)
        assert _config.env_int("COMMWIRE_CODEC_THREADS", 0) == value
    for raw, match in (("two", "is not a number"), ("2.5", "whole number >= 0"), ("-1", "whole number >= 0")):
        monkeypatch.setenv("COMMWIRE_CODEC_THREADS", raw)
        with pytest.raises(ValueError, match=f"COMMWIRE_CODEC_THREADS={raw!r} .*{match}"):
            _config.env_int("COMMWIRE_CODEC_THREADS", 0)


def test_codec_threads_variable_is_validated_when_the_default_is_worked_out(monkeypatch):
    from commwire.codecs import _threads

    monkeypatch.setenv("COMMWIRE_CODEC_THREADS", "3")
    _threads.set_threads(None)
    try:
        assert _threads.get_threads() == 3
        monkeypatch.setenv("COMMWIRE_CODEC_THREADS", "-2")
        _threads.set_threads(None)
        with pytest.raises(ValueError, match="COMMWIRE_CODEC_THREADS"):
            _threads.get_threads()
    finally:
        monkeypatch.delenv("COMMWIRE_CODEC_THREADS")
        _threads.set_threads(None)


def test_horovod_variables_are_documented_and_parsed_here(monkeypatch):
    pytest.importorskip("torch")
    from commwire.torch import _env as horovod_env

    assert horovod_env.HONOURED is _config.HOROVOD_VARIABLES
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    assert horovod_env.fusion_threshold_bytes() == 1024
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='-1' must be >= 0"):
        horovod_env.fusion_threshold_bytes()
    with pytest.raises(KeyError, match="not a documented"):
        _config.env_str("HOROVOD_CYCLE_TIME")  # reported by commwire.torch, never read


def test_set_variables_lists_what_the_environment_holds(monkeypatch):
    monkeypatch.setenv("COMMWIRE_TIMEOUTT", "5")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    assert _config.set_variables()["COMMWIRE_TIMEOUTT"] == "5"
    assert "HOROVOD_CYCLE_TIME" in _config.set_variables("HOROVOD_")
    assert "HOROVOD_CYCLE_TIME" not in _config.set_variables()


def test_cuda_aware_setting_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv("COMMWIRE_CUDA_AWARE", raising=False)
    assert _config.cuda_aware_setting() == "auto"
    monkeypatch.setenv("COMMWIRE_CUDA_AWARE", "yes")
    with pytest.raises(ValueError, match="COMMWIRE_CUDA_AWARE='yes' is not valid"):
        _config.cuda_aware_setting()


_SETTING = re.compile(r"(os\.environ|getenv)[^\n]*[\"'](COMMWIRE|HOROVOD)_|[\"'](COMMWIRE|HOROVOD)_\w*[\"'][^\n]*"
                      r"(os\.environ|getenv)")
_LAUNCHER = re.compile(r"(os\.environ|getenv)[^\n]*[\"'](PMI_RANK|PMI_SIZE|PMIX_RANK|OMPI_COMM_WORLD|SLURM_PROCID|"
                       r"SLURM_NTASKS|SLURM_LOCALID|MPI_LOCAL)")


def test_no_library_module_reads_a_setting_or_a_launcher_rank_itself():
    # Benchmarks build child environments (they sit beside the library and are not settings readers).
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("bench/") or rel in ("_config.py", "comm/rankenv.py"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _SETTING.search(line) or _LAUNCHER.search(line):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "read these through commwire._config / commwire.comm.rankenv:\n" + "\n".join(found)


def test_every_variable_is_documented_on_the_configuration_page():
    from pathlib import Path

    from commwire import _config

    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    missing = [name for name in (*_config.VARIABLES, *_config.HOROVOD_VARIABLES) if f"`{name}`" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}: add a row for each"


def test_hierarchical_allreduce_setting_from_commwire_or_horovod(monkeypatch):
    pytest.importorskip("torch")
    from commwire.codecs.hierarchical import hierarchy_setting, set_default_hierarchy
    from commwire.torch import _env

    try:
        monkeypatch.delenv("COMMWIRE_HIERARCHICAL", raising=False)
        monkeypatch.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
        _env.apply_at_init()  # hvd.init(): Horovod's switch becomes the default
        assert hierarchy_setting(None) == ("node", False)
        assert hierarchy_setting(False) is None  # an explicit argument wins
        monkeypatch.setenv("COMMWIRE_HIERARCHICAL", "0")  # commwire's own variable wins over Horovod's
        set_default_hierarchy(None)
        _env.apply_at_init()
        assert hierarchy_setting(None) is None
        monkeypatch.setenv("COMMWIRE_HIERARCHICAL", "8")
        set_default_hierarchy(None)
        assert hierarchy_setting(None) == (8, False)
        monkeypatch.setenv("COMMWIRE_HIERARCHICAL", "nodes")
        set_default_hierarchy(None)
        with pytest.raises(ValueError, match="COMMWIRE_HIERARCHICAL='nodes' is not valid"):
            hierarchy_setting(None)
    finally:
        set_default_hierarchy(None)
