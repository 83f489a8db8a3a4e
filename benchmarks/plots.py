"""The benchmark figures: one PNG per op family, each readable at 100% zoom.

Each file (``results-<family>.png``, at most :data:`MAX_WIDTH_PX` x
:data:`MAX_HEIGHT_PX`) holds one horizontal bar chart per kind of bound in
the family: one group of bars per case (variant, shape, dtype, pass), one bar
per implementation, the legend outside the plot area, the family and kind in
the panel's title and the device, date and commit in the figure's.

Timed rows (GPU / TPU, or ``--time-interpreters``): compute-bound cases
(``ceiling == "matmul"``) plot TFLOP/s with the measured matmul ceiling as a
dashed line; memory-bound ones (``"copy"``) plot GB/s with each case's own
ceiling (a copy moving the case's bytes, ``ceiling_rate``) as a black tick
across its bars; cases whose bytes fit in the last-level cache are labelled
``(in cache)``. Each timed bar of ours (a pallas_core backend) is labelled
with its rate and, in brackets, its ``vs best other``: the fastest
implementation of the case that is not ours over ours
(:func:`benchmarks.harness.vs_best_other`; above 1x ours is faster). Untimed
rows (a host without a GPU) plot each implementation's error against the
float64 reference, on a log scale.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.harness import vs_best_other

MAX_WIDTH_PX = 1600
MAX_HEIGHT_PX = 1200
DPI = 100
_WIDTH_IN = 12.0  # 1200 px at DPI
_BAR_IN = 0.2  # height of one bar, in inches, before the cap
_FONT = 10

# Panels group ops by family; an op not listed is a family of its own.
FAMILIES = {"fused_matmul": "matmul", "layer_norm": "norms", "rms_norm": "norms",
            "softmax": "softmax", "log_softmax": "softmax", "logsumexp": "softmax",
            "sum": "reductions", "mean": "reductions", "max": "reductions",
            "cross_entropy": "cross-entropy", "linear_cross_entropy": "cross-entropy",
            "dot_product_attention": "attention"}
_UNITS = {"matmul": ("tflops", "TFLOP/s", "matmul ceiling"),
          "copy": ("gbps", "GB/s", "copy ceiling at the case's size")}
_FLOOR = 1e-10  # an error of exactly 0 is drawn here on the log scale, labelled "exact"
_ERROR = ("max_rel_error", "max |out - ref| / max |ref| vs float64 (log scale, lower is better; "
                           f"an exact result is drawn at {_FLOOR:g})")


def _timed(rows: Sequence[Mapping]) -> bool:
    return any(r.get("median_ms") is not None for r in rows)


def panels(rows: Sequence[Mapping]) -> list[tuple[str, str, list[Mapping]]]:
    """``(family, kind, rows)`` per panel, in the rows' order. ``kind`` is the
    row's ceiling ("matmul" / "copy") for timed rows and "error" otherwise;
    failed rows and rows without a value are left out."""
    timed = _timed(rows)
    grouped: dict[tuple[str, str], list[Mapping]] = {}
    for r in rows:
        kind = (r.get("ceiling") or "matmul") if timed else "error"
        key = _UNITS[kind][0] if timed else _ERROR[0]
        if r.get("error") or r.get(key) is None:
            continue
        grouped.setdefault((FAMILIES.get(r["op"], r["op"]), kind), []).append(r)
    return [(family, kind, group) for (family, kind), group in grouped.items()]


def _case_label(r: Mapping) -> str:
    label = f"{r['op']} {r['variant']} {'x'.join(map(str, r['shape']))} {r['dtype']} {r['pass']}"
    return label + (" (in cache)" if r.get("cache_resident") else "")


def _panel_title(kind: str, group: Sequence[Mapping]) -> str:
    ops = ", ".join(dict.fromkeys(r["op"] for r in group))
    if kind == "error":
        return f"{ops}: error against float64"
    unit = _UNITS[kind][1]
    return f"{ops}: {'compute' if kind == 'matmul' else 'memory'}-bound, {unit} (higher is better)"


def _vs_best_other(rows: Sequence[Mapping]) -> dict[int, float | None]:
    """``id(row)`` -> the row's ``vs_best_other`` (recorded, else computed per case)."""
    cases: dict[str, list[Mapping]] = {}
    for r in rows:
        cases.setdefault(_case_label(r), []).append(r)
    out = {}
    for group in cases.values():
        for r, ratio in zip(group, vs_best_other(group)):
            out[id(r)] = r.get("vs_best_other", ratio)
    return out


def write_plots(out_dir: Path, meta: Mapping, rows: Sequence[Mapping]) -> list[dict]:
    """Writes one ``results-<family>.png`` per op family into ``out_dir`` (a
    ``results-empty.png`` saying so when nothing succeeded).

    Returns what was drawn, per file: ``path``, ``title``, ``panels`` (each
    panel's title, x-axis label and case labels) and ``size_px``.
    """
    families: dict[str, list[tuple[str, list[Mapping]]]] = {}
    for family, kind, group in panels(rows):
        families.setdefault(family, []).append((kind, group))
    if not families:
        return [_draw(Path(out_dir) / "results-empty.png", meta, [])]
    return [_draw(Path(out_dir) / f"results-{re.sub(r'[^a-z0-9]+', '-', family)}.png", meta, parts)
            for family, parts in families.items()]


def _draw(path: Path, meta: Mapping, parts: list[tuple[str, list[Mapping]]]) -> dict:
    import matplotlib
    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    bars = [len(g) for _, g in parts] or [1]
    heights = [0.9 + _BAR_IN * n + 0.08 * len({_case_label(r) for r in g})
               for n, (_, g) in zip(bars, parts or [("", [])])]
    total = min(sum(heights) + 0.7, MAX_HEIGHT_PX / DPI)
    fig, axes = plt.subplots(len(heights), 1, figsize=(_WIDTH_IN, total), squeeze=False,
                             gridspec_kw=dict(height_ratios=heights), layout="constrained")
    title = (f"{meta['device_kind']} ({meta['platform']}), {str(meta['date'])[:10]}, "
             f"commit {meta.get('git_commit') or 'unknown'}")
    fig.suptitle(title, fontsize=_FONT + 1, x=0.01, ha="left")
    drawn = []
    if not parts:
        axes[0][0].text(0.5, 0.5, "no successful rows to plot", ha="center", va="center",
                        fontsize=_FONT)
        axes[0][0].set_axis_off()
    for ax, (kind, group) in zip((a[0] for a in axes), parts):
        ratios = _vs_best_other(group)
        cases = list(dict.fromkeys(_case_label(r) for r in group))
        impls = list(dict.fromkeys(r["implementation"] for r in group))
        height = 0.8 / len(impls)
        key = _ERROR[0] if kind == "error" else _UNITS[kind][0]
        values = []
        for i, impl in enumerate(impls):
            ys, xs, vs = [], [], []
            for r in group:
                if r["implementation"] == impl:
                    ys.append(cases.index(_case_label(r)) + (i - (len(impls) - 1) / 2) * height)
                    xs.append(max(r[key], _FLOOR) if kind == "error" else r[key])
                    vs.append(None if kind == "error" else ratios[id(r)])
            values += xs
            drawn_bars = ax.barh(ys, xs, height, label=impl)
            if len(group) <= 40:
                ax.bar_label(drawn_bars, labels=[_value_label(kind, x, v) for x, v in zip(xs, vs)],
                             fontsize=_FONT - 2, padding=2)
            elif kind == "error":  # too many bars to label each: still say which are exact
                ax.bar_label(drawn_bars, labels=[_value_label(kind, x) if x <= _FLOOR else ""
                                                 for x in xs], fontsize=_FONT - 2, padding=2)
        limit = _draw_ceiling(ax, kind, group, cases, meta)
        if kind == "error":
            ax.set_xscale("log")
            ax.set_xlim(min(values) / 3, max(values) * 6)
            ax.set_xlabel(_ERROR[1], fontsize=_FONT)
        else:
            ax.set_xlim(0, 1.15 * max(values + limit))
            ax.set_xlabel(f"{_UNITS[kind][1]} (higher is better); [Nx] on our bars: vs best other "
                          "(the fastest implementation that is not ours, over ours)", fontsize=_FONT)
        ax.set_yticks(range(len(cases)), cases, fontsize=_FONT - 1)
        ax.tick_params(axis="x", labelsize=_FONT - 1)
        ax.invert_yaxis()  # first case on top, as in the table
        ax.set_title(_panel_title(kind, group), fontsize=_FONT + 1, loc="left")
        ax.legend(fontsize=_FONT - 1, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax.grid(axis="x", alpha=0.3)
        drawn.append(dict(title=ax.get_title(loc="left"), xlabel=ax.get_xlabel(), cases=cases))
    fig.savefig(path, dpi=DPI)
    size = tuple(int(round(d * DPI)) for d in fig.get_size_inches())
    plt.close(fig)
    return dict(path=path, title=title, panels=drawn, size_px=size)


def _value_label(kind: str, x: float, vs_other: float | None = None) -> str:
    if kind == "error":
        return "exact" if x <= _FLOOR else f"{x:.2g}"
    return f"{x:.3g}" + ("" if vs_other is None else f" [{vs_other:.2f}x]")


def _draw_ceiling(ax, kind: str, group: Sequence[Mapping], cases: list[str], meta: Mapping) -> list:
    """The ceiling each bar is compared with; returns the x values drawn."""
    if kind == "matmul":
        limit = (meta.get("ceilings") or {}).get("matmul_tflops")
        if limit:
            ax.axvline(limit, color="black", linestyle="--", linewidth=1,
                       label=f"{_UNITS[kind][2]} {limit:.4g} {_UNITS[kind][1]}")
            return [limit]
        return []
    if kind == "copy":
        per_case = {}
        for r in group:
            if r.get("ceiling_rate"):
                per_case[cases.index(_case_label(r))] = r["ceiling_rate"]
        if per_case:
            ys = list(per_case)
            ax.vlines(list(per_case.values()), [y - 0.45 for y in ys], [y + 0.45 for y in ys],
                      color="black", linewidth=2, label=_UNITS[kind][2])
        return list(per_case.values())
    return []
