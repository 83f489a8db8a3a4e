"""The suite's tables, for the console (rich, at most :data:`WIDTH` columns) and results.md.

Rows are grouped by op, one table per op, so a case is named by its variant,
shape, dtype and pass (never cut), and each table's caption explains its
shape letters (:data:`SHAPE_LEGEND`). Three kinds of table:

* timing (:func:`timing_tables`): one row per case and implementation, on a
  GPU/TPU or with ``--time-interpreters``;
* accuracy (:func:`accuracy_tables`): one row per case, one error column per
  implementation, the default on a host without a GPU;
* static (:func:`static_tables`): the sm_90 compile of each essential GPU
  kernel and the H100 roofline bound it implies (:mod:`benchmarks.roofline`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from rich import box
from rich.table import Table

from benchmarks.harness import vs_best_other

WIDTH = 120

# What the letters of each op's shape stand for.
SHAPE_LEGEND = {
    "fused_matmul": "M x K x N (x is M x K, w is K x N)",
    "layer_norm": "rows x hidden",
    "rms_norm": "rows x hidden",
    "softmax": "rows x cols (over the last axis)",
    "log_softmax": "rows x cols (over the last axis)",
    "logsumexp": "rows x cols (over the last axis)",
    "sum": "rows x cols",
    "mean": "rows x cols",
    "max": "rows x cols",
    "cross_entropy": "N x V (N=tokens V=classes)",
    "linear_cross_entropy": "N x D x V (N=tokens D=hidden V=classes)",
    "dot_product_attention": "B x T x S x N x K x H (B=batch T=queries S=keys "
                             "N=query heads K=key/value heads H=head dim)",
    "apply_rotary_embedding": "B x T x N x H (B=batch T=tokens N=heads H=head dim)",
    "gated_linear_unit": "M x K x N (x is M x K, weights K x 2 x N; /pair: two K x N)",
    "paged_attention": "B x S x N x K x H x P (B=sequences S=cached tokens N=query heads "
                       "K=key/value heads H=head dim P=page size; one new token per sequence: "
                       "tokens/s = B / time)",
}
_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "float64": "f64"}
DTYPE_LEGEND = "dtype: bf16=bfloat16 f32=float32 f16=float16"


def num(value, fmt: str) -> str:
    """``value`` formatted, ``-`` for None, ``nan`` / ``inf`` as such."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    return format(value, fmt)


def shape_text(row: Mapping) -> str:
    return "x".join(map(str, row["shape"]))


def dtype_text(dtype: str) -> str:
    return _DTYPES.get(dtype, dtype)


def legend(op: str) -> str:
    return f"shape: {SHAPE_LEGEND.get(op, 'dims of the input')}"


def by_op(rows: Sequence[Mapping]) -> dict[str, list[Mapping]]:
    grouped: dict[str, list[Mapping]] = {}
    for row in rows:
        grouped.setdefault(row["op"], []).append(row)
    return grouped


def _table(title: str, headers: Sequence[str], text_columns: int) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold",
                  box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False)
    for i, name in enumerate(headers):
        table.add_column(name, justify="left" if i < text_columns else "right",
                         overflow="fold", no_wrap=i < text_columns)
    return table


# ----------------------------------------------------------------------------
# Timing (GPU / TPU, or --time-interpreters)
# ----------------------------------------------------------------------------

TIMING_COLUMNS = ("variant", "shape", "dtype", "pass", "implementation", "median ms", "{rate}",
                  "vs XLA", "vs best other", "% ceiling", "rel err", "peak MiB")


def ceiling_text(row: Mapping) -> str:
    """``% ceiling`` cell: the fraction in percent, ``in cache`` for a cache-resident case."""
    if row.get("cache_resident"):
        return "in cache"
    frac = row.get("fraction_of_ceiling")
    return num(None if frac is None else 100 * frac, ".3g")


def with_vs_best_other(rows: Sequence[Mapping]) -> list[dict]:
    """The rows, each with ``vs_best_other`` (:func:`benchmarks.harness.vs_best_other`,
    per case): recorded in timed rows since it was; computed here for older runs."""
    cases: dict[str, list[Mapping]] = {}
    for row in rows:
        cases.setdefault(row["case"], []).append(row)
    ratios = {id(r): v for group in cases.values() for r, v in zip(group, vs_best_other(group))}
    return [dict(r) if "vs_best_other" in r else {**r, "vs_best_other": ratios[id(r)]}
            for r in rows]


def timing_cells(row: Mapping) -> list[str]:
    impl = row["implementation"] + (" FAILED" if row.get("error") else "")
    rate = row.get("gbps") if row.get("ceiling") == "copy" else row.get("tflops")
    peak = row.get("peak_bytes")
    return [row["variant"], shape_text(row), dtype_text(row["dtype"]), row["pass"], impl,
            num(row.get("median_ms"), ".4g"), num(rate, ".4g"), num(row.get("speedup_vs_xla"), ".3g"),
            num(row.get("vs_best_other"), ".3g"), ceiling_text(row),
            num(row.get("max_rel_error"), ".1e"), "-" if peak is None else _amount(peak / 2**20)]


def rate_unit(rows: Sequence[Mapping]) -> str:
    return "GB/s" if rows and rows[0].get("ceiling") == "copy" else "TFLOP/s"


TIMING_NOTES = (
    "median ms: per call. TFLOP/s (compute-bound ops) or GB/s (memory-bound: bytes the op must "
    "move). vs XLA: the xla row's time over this row's. vs best other: for our kernels, the "
    "fastest implementation that is not ours (xla, cudnn, jax_pallas) over this row's time "
    "(above 1: ours is faster). % ceiling: of the measured matmul rate, "
    "or of a copy moving the case's own bytes; 'in cache': the bytes fit in the last-level "
    "cache, no fraction claimed. rel err: max|out - ref| / max|ref| against float64. peak MiB: "
    "the compiled executable's temporaries plus outputs.")


def timing_tables(rows: Sequence[Mapping]) -> list[tuple]:
    """``(title, headers, cells, legend, text columns)`` per op."""
    out = []
    for op, group in by_op(with_vs_best_other(rows)).items():
        headers = [h.format(rate=rate_unit(group)) for h in TIMING_COLUMNS]
        out.append((op, headers, [timing_cells(r) for r in group], legend(op), 5))
    return out


# ----------------------------------------------------------------------------
# Accuracy (host without a GPU)
# ----------------------------------------------------------------------------

ACCURACY_NOTES = ("Each cell: max|out - ref| / max|ref| of that implementation against the same "
                  "math in float64 (every output and gradient); nothing is timed.")


def accuracy_tables(rows: Sequence[Mapping]) -> list[tuple]:
    """``(title, headers, cells, legend, text columns)`` per op: a row per case, an error
    column per implementation."""
    out = []
    for op, group in by_op(rows).items():
        impls = list(dict.fromkeys(r["implementation"] for r in group))
        cases: dict[str, dict[str, Mapping]] = {}
        for r in group:
            cases.setdefault(r["case"], {})[r["implementation"]] = r
        cells = []
        for per_impl in cases.values():
            first = next(iter(per_impl.values()))
            cells.append([first["variant"], shape_text(first), dtype_text(first["dtype"]),
                          first["pass"]] + [_error_cell(per_impl.get(i)) for i in impls])
        out.append((op, ["variant", "shape", "dtype", "pass"] + [f"{i} err" for i in impls], cells,
                    legend(op), 4))
    return out


def _error_cell(row: Mapping | None) -> str:
    if row is None:
        return "-"
    return "FAILED" if row.get("error") else num(row.get("max_rel_error"), ".1e")


# ----------------------------------------------------------------------------
# Static compile and roofline bound
# ----------------------------------------------------------------------------

KERNEL_COLUMNS = ("op: kernel", "regs", "spill B", "smem KiB", "wgmma", "TMA", "cp.async",
                  "loop instrs", "reads/elem", "gate")
BOUND_COLUMNS = ("op", "shape", "GFLOP", "MB moved", "passes", "compute us", "memory us",
                 "bound us", "bound by")


def static_notes(static: Mapping) -> str:
    gpu = static["gpu"]
    return (f"{static['target']} compiles on this host (Triton's ptxas), nothing run. regs: per "
            "thread; loop instrs: SASS instructions per iteration of each loop (nvdisasm); "
            "reads/elem: passes over the largest input, counted in Triton's interpreter. Bound: "
            f"max(FLOPs / peak, bytes / bandwidth) on an {gpu['name']}: "
            f"{gpu['bf16_tensor_tflops']:g} TFLOP/s bf16 Tensor Core (dense) for matmul and "
            f"attention, {gpu['fp32_tflops']:g} TFLOP/s FP32 for the row ops, "
            f"{gpu['hbm_gbps']:g} GB/s HBM3 ({gpu['source']}). A lower bound on time, "
            "not a measurement.")


def kernel_cells(case: Mapping, k: Mapping) -> list[str]:
    bad = k.get("violations") or []
    loops = k.get("loop_instructions") or []
    return ["  " + k["kernel"], num(k.get("registers"), "d"), num(k.get("spill_bytes"), "d"),
            num(k.get("shared_memory_bytes", 0) / 1024, ".1f"), num(k.get("wgmma"), "d"),
            num(k.get("tma"), "d"), num(k.get("cp_async"), "d"),
            "+".join(map(str, loops)) or "-", num(k.get("reads_per_element"), ".3g"),
            "FAIL" if bad else "ok"]


def _amount(x: float) -> str:
    """Four significant digits, large values as whole numbers with thousands separators."""
    return f"{x:,.0f}" if x >= 1e4 else f"{x:.4g}"


def bound_cells(case: Mapping) -> list[str]:
    b = case["bound"]
    return [case["op"], "x".join(map(str, case["shape"])), _amount(b["flops"] / 1e9),
            _amount(b["bytes"] / 1e6), num(b["passes"], ".3g"), _amount(b["compute_us"]),
            _amount(b["memory_us"]), _amount(b["bound_us"]), b["bound_by"]]


def static_tables(static: Mapping) -> list[tuple]:
    kernels = []
    for c in static["cases"]:  # the op on a line of its own, its kernels indented under it
        kernels.append([f"{c['op']}:"] + [""] * (len(KERNEL_COLUMNS) - 1))
        kernels += [kernel_cells(c, k) for k in c["kernels"]]
    bounds = [bound_cells(c) for c in static["cases"]]
    ops = dict.fromkeys(c["op"] for c in static["cases"])
    legends = "; ".join(f"{op} {SHAPE_LEGEND[op].split(' (')[0]}" for op in ops if op in SHAPE_LEGEND)
    return [(f"{static['target']} kernels (compiled, not run)", list(KERNEL_COLUMNS), kernels,
             "fwd+bwd, bf16, the GPU benchmark's sizes (shapes in the bound's table); loop "
             "instrs: one count per inner loop; gate: the static gate's verdict", 1),
            (f"Roofline bound on an {static['gpu']['name']} (a bound, not a measurement)",
             list(BOUND_COLUMNS), bounds, f"shape: {legends}", 2)]


# ----------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------

def rich_tables(tables) -> list[tuple[Table, str]]:
    """``(rich table, legend line)`` per table; the legend goes under the table,
    as a line of its own (a caption would wrap at the table's width)."""
    out = []
    for title, headers, cells, caption, text_columns in tables:
        table = _table(title, headers, text_columns)
        for row in cells:
            table.add_row(*row, style="red" if any("FAIL" in c for c in row) else None)
        out.append((table, caption))
    return out


def markdown_tables(tables) -> list[str]:
    lines = []
    for title, headers, cells, caption, _ in tables:
        lines += [f"### {title}", "", caption, "", "| " + " | ".join(headers) + " |",
                  "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        lines.append("")
    return lines
