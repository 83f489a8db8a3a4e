"""The benchmark figure: one panel per op family, each against the ceiling it is bound by.

Each panel is a horizontal bar chart (case labels stay readable however many
cases there are): one group of bars per case (variant, shape, dtype, pass),
one bar per implementation. Compute-bound cases (``ceiling == "matmul"``)
plot TFLOP/s with the measured matmul ceiling as a dashed line;
memory-bound ones (``"copy"``) plot GB/s with the measured copy bandwidth.
A family holding both kinds gets one panel for each. The figure is at most
:data:`MAX_WIDTH_PX` wide, panels stacked vertically; the title names the
device, platform, date and commit.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

MAX_WIDTH_PX = 1600
DPI = 100
_WIDTH_IN = 15.0  # 1500 px at DPI

# Panels group ops by family; an op not listed is a family of its own.
FAMILIES = {"fused_matmul": "matmul", "layer_norm": "norms", "rms_norm": "norms",
            "softmax": "softmax", "log_softmax": "softmax", "logsumexp": "softmax",
            "sum": "reductions", "mean": "reductions", "max": "reductions",
            "cross_entropy": "cross-entropy", "linear_cross_entropy": "cross-entropy",
            "dot_product_attention": "attention"}
_UNITS = {"matmul": ("tflops", "TFLOP/s", "matmul_tflops", "matmul ceiling"),
          "copy": ("gbps", "GB/s", "copy_gbps", "copy ceiling")}


def panels(rows: Sequence[Mapping]) -> list[tuple[str, str, list[Mapping]]]:
    """``(family, ceiling, rows)`` per panel, in the rows' order; failed rows
    (no time) and rows without a rate in their unit are left out."""
    grouped: dict[tuple[str, str], list[Mapping]] = {}
    for r in rows:
        ceiling = r.get("ceiling") or "matmul"
        if r.get("error") or r.get(_UNITS[ceiling][0]) is None:
            continue
        grouped.setdefault((FAMILIES.get(r["op"], r["op"]), ceiling), []).append(r)
    return [(family, ceiling, group) for (family, ceiling), group in grouped.items()]


def _case_label(r: Mapping) -> str:
    return f"{r['op']}/{r['variant']} {'x'.join(map(str, r['shape']))} {r['dtype']} {r['pass']}"


def write_plot(path: Path, meta: Mapping, rows: Sequence[Mapping]) -> dict:
    """Writes the figure to ``path`` (PNG); an empty run gives a figure saying so.

    Returns what was drawn: ``title``, ``panels`` (each panel's title, x-axis
    label and y tick labels) and ``size_px`` (width, height).
    """
    import matplotlib
    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    groups = panels(rows)
    heights = [1.2 + 0.28 * len({_case_label(r) for r in g}) * max(1, len({r["implementation"] for r in g}))
               for _, _, g in groups] or [1.5]
    fig, axes = plt.subplots(len(heights), 1, figsize=(_WIDTH_IN, sum(heights) + 0.8),
                             gridspec_kw=dict(height_ratios=heights), squeeze=False)
    title = (f"{meta['device_kind']} ({meta['platform']}), {str(meta['date'])[:10]}, "
             f"commit {meta.get('git_commit') or 'unknown'}")
    fig.suptitle(title, fontsize=11)
    drawn = []
    if not groups:
        axes[0][0].text(0.5, 0.5, "no successful rows to plot", ha="center", va="center")
        axes[0][0].set_axis_off()
    for ax, (family, ceiling, group) in zip((a[0] for a in axes), groups):
        key, unit, ceiling_key, ceiling_name = _UNITS[ceiling]
        cases = list(dict.fromkeys(_case_label(r) for r in group))
        impls = list(dict.fromkeys(r["implementation"] for r in group))
        height = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            ys, xs = [], []
            for r in group:
                if r["implementation"] == impl:
                    ys.append(cases.index(_case_label(r)) + (i - (len(impls) - 1) / 2) * height)
                    xs.append(r[key])
            bars = ax.barh(ys, xs, height, label=impl)
            ax.bar_label(bars, labels=[f"{x:.4g}" for x in xs], fontsize=7, padding=2)
        limit = meta.get("ceilings", {}).get(ceiling_key)
        if limit:
            ax.axvline(limit, color="black", linestyle="--", linewidth=1,
                       label=f"{ceiling_name} {limit:.4g} {unit}")
        # Room right of the longest bar (or the ceiling) for its value label.
        ax.set_xlim(0, 1.12 * max([r[key] for r in group] + [limit or 0]))
        ax.set_yticks(range(len(cases)), cases, fontsize=8)
        ax.invert_yaxis()  # first case on top, as in the table
        ax.set_xlabel(f"{unit} (higher is better)")
        ax.set_title(f"{family}: {'compute' if ceiling == 'matmul' else 'memory'}-bound, {unit} "
                     f"against the {ceiling_name}", fontsize=10, loc="left")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
        drawn.append(dict(title=ax.get_title(loc="left"), xlabel=ax.get_xlabel(), cases=cases))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (sum(heights) + 0.8)))  # keep the title clear
    fig.savefig(path, dpi=DPI)
    size = tuple(int(round(d * DPI)) for d in fig.get_size_inches())
    plt.close(fig)
    return dict(title=title, panels=drawn, size_px=size)
