"""Render the benchmark suite's report: ``suite.json``, ``suite.md`` and PNG plots.

Holds what turns the suite's part results into a report: the headline (one key
ratio per part), the Markdown builders (headline table, one section and rows table
per part), the matplotlib plots, the writer of ``suite.json`` and ``write_report``,
which writes all three. ``commwire.bench.suite`` runs the parts and calls these.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .suite import PartResult

__all__ = ["PLOTS_MISSING", "display_argv", "headline", "write_json", "write_report"]

PLOTS_MISSING = "plots skipped: matplotlib is not installed (pip install 'commwire[bench]')"
"""What the report and the command line say when the plots are skipped."""


def display_argv(argv: Sequence[str]) -> str:
    """Return *argv* as a user would type it: `commwire run ... python -m ...`."""
    words = list(argv)
    if words[1:3] == ["-m", "commwire"]:
        words = ["commwire", *words[3:]]
    return shlex.join("python" if w == sys.executable else w for w in words)


# --------------------------------------------------------------------------- headline


def _x(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}×"


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _headline_allreduce(r: PartResult) -> list[dict[str, Any]]:
    out = []
    plain = [row for row in r.rows if row.get("codec") is None]
    if plain:
        top = max(plain, key=lambda row: row["bytes"])
        out.append({"measure": f"commwire FP32 all-reduce time at {_size(top['bytes'])} (lower is better)",
                    "ratio": top["ratio"], "baseline": "mpi4py Allreduce",
                    "note": f"{top['commwire_us']:.1f} µs vs {top['raw_us']:.1f} µs"})
    for codec in dict.fromkeys(row["codec"] for row in r.rows if row.get("codec") is not None):
        top = max((row for row in r.rows if row.get("codec") == codec), key=lambda row: row["bytes"])
        out.append({"measure": f"{codec} speed-up at {_size(top['bytes'])} (higher is better)",
                    "ratio": top["raw_us"] / top["commwire_us"], "baseline": "FP32 MPI_Allreduce",
                    "note": f"{top['commwire_us'] / 1e3:.2f} ms vs {top['raw_us'] / 1e3:.2f} ms, "
                            f"rel. L2 error {top.get('rel_l2_err', float('nan')):.4f}"})
    return out


def _headline_glm(r: PartResult) -> list[dict[str, Any]]:
    rows = [row for row in r.rows if row.get("table") == "headline" and row.get("solver") == "casgd"
            and row.get("precision") == "mixed"]
    return [{"measure": f"CA-SGD mixed (s={row['s']}, b={row['b']}) speed-up, {row['dataset']} (higher is better)",
             "ratio": row["speedup_vs_sgd_fp32"], "baseline": "FP32 SGD, same batches",
             "note": f"loss gap {100 * row['loss_gap_vs_sgd_fp32']:+.3f}%"} for row in rows]


def _headline_torch(r: PartResult) -> list[dict[str, Any]]:
    if not r.rows:
        return []
    ddp = r.rows[0]
    return [{"measure": f"{row['config']} step time (lower is better)", "ratio": row["ratio_vs_ddp"],
             "baseline": ddp["config"], "note": f"{row['step_ms']:.1f} ms vs {ddp['step_ms']:.1f} ms"}
            for row in r.rows[1:]]


_HEADLINES = {"allreduce": _headline_allreduce, "glm": _headline_glm, "torch": _headline_torch}


def headline(results: Sequence[PartResult]) -> list[dict[str, Any]]:
    """Return the key ratio(s) of every part: one dict per (part, where, measure)."""
    out = []
    for r in results:
        base = {"part": r.name, "where": r.where}
        if not r.ok:
            status = "not run" if r.rc is None else f"failed (exit {r.rc})"
            out.append({**base, "measure": status, "ratio": None, "baseline": "", "note": r.error or ""})
            continue
        try:
            out += [{**base, **row} for row in _HEADLINES[r.bench](r)]
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            out.append({**base, "measure": "rows not understood", "ratio": None, "baseline": "",
                        "note": f"{type(exc).__name__}: {exc}"})
    return out


# --------------------------------------------------------------------------- Markdown


def _cell(value: Any, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, fmt) if fmt else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _get(key: str, fmt: str = "", scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        return _cell(value * scale if isinstance(value, (int, float)) and not isinstance(value, bool)
                     and scale != 1.0 else value, fmt)
    return get


def _ratio(num: str, den: str) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        try:
            return _x(row[num] / row[den])
        except (KeyError, TypeError, ZeroDivisionError):
            return "-"
    return get


def _pct(key: str) -> Callable[[dict[str, Any]], str]:
    def get(row: dict[str, Any]) -> str:
        value = row.get(key)
        return "-" if not isinstance(value, (int, float)) or not math.isfinite(value) else f"{100 * value:+.3f}%"
    return get


Columns = list[tuple[str, Callable[[dict[str, Any]], str]]]
# Ratio columns (bold headers) come right after the columns that say what a row is.
_COLUMNS: dict[str, Columns] = {
    "allreduce fp32": [
        ("size", lambda r: _size(r["bytes"])), ("ranks", _get("ranks")),
        ("**commwire / mpi4py time**", lambda r: _x(r.get("ratio"))),
        ("mpi4py µs", _get("raw_us", ".1f")), ("commwire µs", _get("commwire_us", ".1f")),
        ("mpi4py GB/s", _get("raw_GBps", ".3f")), ("commwire GB/s", _get("commwire_GBps", ".3f"))],
    "allreduce codecs": [
        ("size", lambda r: _size(r["bytes"])), ("codec", _get("codec")), ("ranks", _get("ranks")),
        ("**speed-up vs FP32 MPI**", _ratio("raw_us", "commwire_us")),
        ("FP32 MPI ms", _get("raw_us", ".2f", 1e-3)), ("compressed ms", _get("commwire_us", ".2f", 1e-3)),
        ("encode ms", _get("encode_us", ".2f", 1e-3)), ("transfer ms", _get("transfer_us", ".2f", 1e-3)),
        ("decode ms", _get("decode_us", ".2f", 1e-3)), ("wire B/elem", _get("wire_bytes_per_elem", ".4f")),
        ("rel. L2 error", _get("rel_l2_err", ".4f"))],
    "glm": [
        ("table", _get("table")), ("data set", _get("dataset")), ("solver", _get("solver")),
        ("precision", _get("precision")), ("s", _get("s")), ("b", _get("b")), ("steps", _get("steps")),
        ("**speed-up vs FP32 SGD**", lambda r: _x(r.get("speedup_vs_sgd_fp32"))),
        ("**best-of speed-up**", lambda r: _x(r.get("best_speedup_vs_sgd_fp32"))),
        ("**loss gap**", _pct("loss_gap_vs_sgd_fp32")),
        ("wall s", _get("wall_s", ".3f")), ("µs/step", _get("us_per_step", ".1f")),
        ("allreduces", _get("allreduces")), ("ranks", _get("ranks"))],
    "torch": [
        ("config", _get("config")), ("ranks", _get("ranks")),
        ("**step time vs DDP**", lambda r: _x(r.get("ratio_vs_ddp"))),
        ("median step ms", _get("step_ms", ".1f")), ("wire MB/step", _get("wire_MB_per_step", ".2f")),
        ("collectives/step", _get("collectives_per_step", ".1f")), ("hidden comm", _get("hidden_fraction", ".0%")),
        ("tensors", _get("tensors"))],
}


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(b) + " |" for b in body]


def _rows_table(result: PartResult) -> list[str]:
    columns = _COLUMNS.get(result.name) or _COLUMNS.get(result.bench)
    if columns is None:
        keys = list(dict.fromkeys(k for row in result.rows for k in row))
        columns = [(k, _get(k)) for k in keys]
    body = []
    for row in result.rows:
        cells = []
        for _, get in columns:
            try:
                cells.append(get(row))
            except (KeyError, TypeError, ValueError):
                cells.append("-")
        body.append(cells)
    return _table([h for h, _ in columns], body)


def _headline_md(rows: list[dict[str, Any]]) -> list[str]:
    body = [[_cell(r["part"]), _cell(r["where"]), _cell(r["measure"]), f"**{_x(r['ratio'])}**"
             if r["ratio"] is not None else "-", _cell(r["baseline"]), _cell(r["note"])] for r in rows]
    return _table(["part", "where", "measure", "ratio", "baseline (same job)", "note"], body)


def _part_md(result: PartResult) -> list[str]:
    status = "not run" if result.rc is None else f"exit {result.rc}"
    lines = ["", f"## {result.name} — {result.where}", "",
             f"`{display_argv(result.argv)}` · {status} · {result.wall_s:.1f} s · {len(result.rows)} rows"
             + (f" · log: [{result.log}]({result.log})" if result.log else "")]
    if not result.ok:
        lines += ["", f"**Failed:** {_cell(result.error)}"]
        if result.stderr_tail:
            lines += ["", "```", *result.stderr_tail[-15:], "```"]
    if result.rows:
        lines += [""] + _rows_table(result)
    return lines


def _markdown(meta: dict[str, Any], results: Sequence[PartResult], plots: list[str] | None,
              heads: list[dict[str, Any]]) -> str:
    host = meta.get("host", {})
    git = meta.get("git") or {}
    commit = git.get("commit", "unknown")[:12] + (" (uncommitted changes)" if git.get("dirty") else "")
    load = host.get("load_average_at_start")
    failed = [r for r in results if not r.ok]
    lines = ["# commwire benchmark suite", "", f"Command: `{meta.get('command', '')}`", "",
             f"Date: {meta.get('date', '')} · host: {host.get('hostname', '?')} ({host.get('platform', '?')}, "
             f"{host.get('cpus', '?')} CPUs"
             + (f", load average {load[0]:.2f} at start" if load else "") + f") · commit: {commit}"
             + (f" · total {meta['wall_s']:.0f} s" if "wall_s" in meta else ""), "",
             "Every figure is a ratio against a baseline measured in the same job (bold columns); "
             "absolute times depend on the machine and on what else ran on it.", ""]
    if meta.get("interrupted"):
        lines += ["**Interrupted:** the suite was stopped before every part ran; this report has what finished.", ""]
    lines += [f"{len(results) - len(failed)} of {len(results)} parts succeeded"
              + (f"; failed: {', '.join(f'{r.name} @ {r.where}' for r in failed)}." if failed else "."), "",
              "## Headline", ""] + _headline_md(heads)
    lines += ["", "## Plots", ""]
    if plots is None:
        lines.append(f"({PLOTS_MISSING}.)")
    elif not plots:
        lines.append("(no rows to plot.)")
    else:
        for name in plots:
            lines += [f"![{Path(name).stem}]({name})", ""]
    for result in results:
        lines += _part_md(result)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def _series_style(wheres: list[str]) -> dict[str, dict[str, Any]]:
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    return {w: {"linestyle": styles[i % len(styles)][0], "marker": styles[i % len(styles)][1]}
            for i, w in enumerate(wheres)}


def _allreduce_series(results: Sequence[PartResult]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    """Return (series, where) -> [(bytes, time_us, speed-up vs its baseline)] for the allreduce parts."""
    series: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    plain_where = {r.where for r in results if r.name == "allreduce fp32" and r.rows}
    for r in results:
        if r.bench != "allreduce":
            continue
        for row in r.rows:
            codec = row.get("codec")
            if codec is None:
                series.setdefault(("mpi4py FP32", r.where), []).append((row["bytes"], row["raw_us"], 1.0))
                series.setdefault(("commwire FP32", r.where), []).append(
                    (row["bytes"], row["commwire_us"], row["raw_us"] / row["commwire_us"]))
            else:
                series.setdefault((codec, r.where), []).append(
                    (row["bytes"], row["commwire_us"], row["raw_us"] / row["commwire_us"]))
                if r.where not in plain_where:  # the codec part's own FP32 baseline
                    series.setdefault(("FP32 MPI", r.where), []).append((row["bytes"], row["raw_us"], 1.0))
    return {key: sorted(dict((b, (b, t, s)) for b, t, s in pts).values()) for key, pts in series.items()}


def _plot_allreduce(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    series = _allreduce_series(results)
    if not series:
        return []
    wheres = list(dict.fromkeys(w for _, w in series))
    names = list(dict.fromkeys(n for n, _ in series))
    style = _series_style(wheres)
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    files = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for (name, where), pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[name], label=f"{name} · {where}",
                **style[where])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per all-reduce (µs, median)")
    ax.set_title("all-reduce time vs size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    files.append(_save(plt, fig, out, "allreduce_time.png"))
    compressed = {k: v for k, v in series.items() if k[0] not in ("mpi4py FP32", "FP32 MPI", "commwire FP32")}
    if compressed:
        fig, ax = plt.subplots(figsize=(8, 5))
        for (name, where), pts in compressed.items():
            ax.plot([p[0] for p in pts], [p[2] for p in pts], color=colors[name], label=f"{name} · {where}",
                    **style[where])
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("speed-up over FP32 MPI_Allreduce (same job)")
        ax.set_title("compressed all-reduce speed-up vs size (> 1: faster)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        files.append(_save(plt, fig, out, "allreduce_speedup.png"))
    return files


def _bars(plt: Any, groups: list[str], bars: dict[str, dict[str, float]], *, ylabel: str, title: str,
          out: Path, name: str) -> str:
    """Draw grouped bars: one group per *groups* entry, one bar per key of *bars*; a line at 1."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(bars)) ** 0.5 + 3), 4.8))
    width = 0.8 / max(len(bars), 1)
    x = np.arange(len(groups))
    for i, (label, values) in enumerate(bars.items()):
        ax.bar(x + i * width, [values.get(g, float("nan")) for g in groups], width, label=label)
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xticks(x + width * (len(bars) - 1) / 2, groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(plt, fig, out, name)


def _plot_glm(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    bars: dict[str, dict[str, float]] = {}
    groups: list[str] = []
    for r in results:
        if r.bench != "glm":
            continue
        for row in r.rows:
            if row.get("table") != "headline" or (row["solver"], row["precision"]) == ("sgd", "fp32"):
                continue
            group = f"{row['dataset']}\n{r.where}"
            groups.append(group)
            label = f"{row['solver']} {row['precision']}" + (f" s={row['s']}" if row["solver"] == "casgd" else "")
            bars.setdefault(label, {})[group] = row["speedup_vs_sgd_fp32"]
    if not bars:
        return []
    return [_bars(plt, list(dict.fromkeys(groups)), bars, ylabel="speed-up vs FP32 SGD (same job)",
                  title="GLM: speed-up over FP32 SGD per data set (> 1: faster)", out=out, name="glm_speedup.png")]


def _plot_torch(plt: Any, results: Sequence[PartResult], out: Path) -> list[str]:
    bars: dict[str, dict[str, float]] = {}
    groups: list[str] = []
    for r in results:
        if r.bench != "torch":
            continue
        for row in r.rows:
            groups.append(row["config"])
            bars.setdefault(r.where, {})[row["config"]] = row["ratio_vs_ddp"]
    if not bars:
        return []
    return [_bars(plt, list(dict.fromkeys(groups)), bars, ylabel="step time / DDP step time (same job)",
                  title="torch: step time vs DDP over gloo (< 1: faster)", out=out,
                  name="torch_step.png")]


def _save(plt: Any, fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _plots(results: Sequence[PartResult], out: Path) -> list[str] | None:
    """Draw the PNGs into *out*; return their names, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    files = []
    for draw in (_plot_allreduce, _plot_glm, _plot_torch):
        try:
            files += draw(plt, results, out)
        except Exception as exc:  # noqa: BLE001 - a plot must never cost the JSON and Markdown
            print(f"commwire bench suite: warning: {draw.__name__[6:]} plot failed: {exc!r}", file=sys.stderr)
            plt.close("all")
    return files


# --------------------------------------------------------------------------- report


def write_json(out: Path, meta: dict[str, Any], results: Sequence[PartResult],
               heads: list[dict[str, Any]] | None = None) -> Path:
    """Write suite.json (meta, every part, the headline) into *out* atomically; return its path.

    *heads* is the headline when the caller has it already; None computes it from *results*.
    """
    path = out / "suite.json"
    data = {"meta": meta, "parts": [r.to_json() for r in results],
            "headline": heads if heads is not None else headline(results)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_report(out: Path | str, meta: dict[str, Any], results: Sequence[PartResult]) -> dict[str, Any]:
    """Write suite.json, suite.md and the PNGs into *out*; return {'json', 'markdown', 'plots'}.

    'plots' is the list of PNG names, or None when matplotlib is not installed (the
    JSON and Markdown are written all the same, and the Markdown says so).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heads = headline(results)
    json_path = write_json(out, meta, results, heads)
    plots = _plots(results, out)
    md_path = out / "suite.md"
    md_path.write_text(_markdown(meta, results, plots, heads), encoding="utf-8")
    return {"json": json_path, "markdown": md_path, "plots": plots}
