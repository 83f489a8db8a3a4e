"""``python -m benchmarks``: run the benchmark suite on the default device.

With no arguments it runs every registered case at sizes that suit the
platform, shows progress, prints a table and writes results.json,
results.md and results.png to
``benchmarks/results/<date>-<platform>-<device>/`` (with a ``-quick``
suffix for ``--quick``; or ``--out``). Exit status 0 on success, 1 if any implementation failed or
no case matched ``--filter``.

To benchmark another op, register its case module in :mod:`benchmarks.suite`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import subprocess
import sys
import zlib
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks import harness
from benchmarks.plots import write_plot
from benchmarks.suite import collect_cases

# The registry: one module per op, each with cases(platform, quick).

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_ROOT = Path(__file__).resolve().parent / "results"

# (warmup calls, timed samples, time budget in s) per implementation. CPU
# budgets keep the full suite to about a minute on a 2-core CI machine;
# accelerators get many samples for stable medians.
_SETTINGS = {"cpu": (2, 20, 2.0), "accelerator": (5, 50, 10.0), "quick": (1, 5, 1.0)}

COLUMNS = ("case", "shape", "dtype", "pass", "implementation", "median ms",
           "rate", "speed-up vs XLA", "% of ceiling", "max rel err", "peak MiB")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: "
                             "benchmarks/results/<date>-<platform>-<device>/)")
    parser.add_argument("--quick", action="store_true",
                        help="one tiny case per op, few samples: a smoke test")
    parser.add_argument("--filter", default=None, metavar="SUBSTR",
                        help="only cases whose name (op/variant/shape/dtype/pass) contains SUBSTR")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed samples per implementation (default: 20 on CPU, 50 elsewhere)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random inputs")
    return parser.parse_args(argv)


def git_commit() -> str | None:
    """Short hash of HEAD, with "+dirty" for uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def default_out_dir(now: datetime.datetime, info: dict[str, str], quick: bool) -> Path:
    """``benchmarks/results/<date>-<platform>-<device-kind>``; quick runs get a
    ``-quick`` suffix so that a smoke test never overwrites the day's full run."""
    slug = re.sub(r"[^a-z0-9]+", "-", info["device_kind"].lower()).strip("-") or "device"
    return RESULTS_ROOT / f"{now:%Y-%m-%d}-{info['platform']}-{slug}{'-quick' if quick else ''}"


# ----------------------------------------------------------------------------
# Formatting shared by the terminal table and results.md
# ----------------------------------------------------------------------------

def _num(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    return format(value, fmt)


def format_row(row: dict) -> list[str]:
    """A result row as the strings of :data:`COLUMNS`."""
    impl = row["implementation"] + (" FAILED" if row.get("error") else "")
    frac = row.get("fraction_of_ceiling")
    percent = None if frac is None else 100 * frac
    peak = row.get("peak_bytes")  # only in the rows of cases with report_memory
    peak_mib = None if peak is None else peak / 2**20
    return [row["op"] + "/" + row["variant"], "x".join(map(str, row["shape"])), row["dtype"],
            row["pass"], impl, _num(row.get("median_ms"), ".3f"), _rate(row),
            _num(row.get("speedup_vs_xla"), ".3g"), _num(percent, ".3g"),
            _num(row.get("max_rel_error"), ".2e"), _num(peak_mib, ".4g")]


def _rate(row: dict) -> str:
    """GB/s for memory-bound rows (bound by the copy ceiling), TFLOP/s for the rest."""
    if row.get("ceiling") == "copy" and row.get("gbps") is not None:
        return _num(row["gbps"], ".4g") + " GB/s"
    return "-" if row.get("tflops") is None else _num(row["tflops"], ".4g") + " TFLOP/s"


def _failures(rows) -> list[str]:
    return [f"{r['case']} [{r['implementation']}]: {r['error']}" for r in rows if r.get("error")]


def _ceiling_text(meta: dict) -> str:
    c = meta["ceilings"]
    return (f"copy {c['copy_gbps']:.1f} GB/s (a+1 over {c['copy_bytes'] // 2 // 2**20} MiB "
            f"float32, read+write counted); matmul {c['matmul_tflops']:.3g} TFLOP/s "
            f"({'x'.join(map(str, c['matmul_shape']))} {c['matmul_dtype']})")


# ----------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------

def write_json(path: Path, meta: dict, rows: list[dict]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, allow_nan=True) + "\n")


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    lines = [
        f"# Benchmark results: {meta['device_kind']} ({meta['platform']})", "",
        f"- Date: {meta['date']}",
        f"- JAX: {meta['jax_version']}",
        f"- Commit: {meta['git_commit'] or 'unknown'}",
        f"- Measured ceilings: {_ceiling_text(meta)}",
        f"- Timing: median ms per call over up to {meta['iters']} samples (at least "
        f"{harness.MIN_TIMED_RUNS}, {meta['max_seconds']} s budget) after {meta['warmup']} "
        f"warm-up calls; calls under {harness.MIN_SAMPLE_SECONDS * 1e3:g} ms are batched "
        "into one sample.",
        "- Matmul shapes are M x K x N; TFLOP/s counts 2*M*N*K per product, 3 products for "
        "fwd+bwd. Rate: TFLOP/s for compute-bound ops (matmul, attention), GB/s (bytes the "
        "op must read and write) for memory-bound ones (norms, softmax, cross-entropy). "
        "% of ceiling: of the measured ceiling the op is bound by (the matmul rate or the copy "
        "bandwidth). Max rel err: max|out - ref| / max|ref| against a float32 reference.",
        "- Attention shapes are B x T x S x N x K x H; TFLOP/s counts 4*B*N*T*S*H per forward "
        "(half if causal) and 3.5 times that for fwd+bwd (FlashAttention-2's convention). "
        "Peak MiB: the compiled executable's temporary plus output buffers, for the ops where "
        "memory is the point.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    failures = _failures(rows)
    if failures:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in failures]
    path.write_text("\n".join(lines) + "\n")


def print_table(console: Console, meta: dict, rows: list[dict]) -> None:
    table = Table(title=f"{meta['device_kind']} ({meta['platform']}) - {_ceiling_text(meta)}",
                  title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in COLUMNS[:5] else "right")
    for row in rows:
        table.add_row(*format_row(row), style="red" if row.get("error") else None)
    console.print(table)
    for failure in _failures(rows):
        console.print(f"FAILED: {failure}", markup=False)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    # Logs (CI, pipes) get a wide table instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    device = jax.devices()[0]
    info = harness.device_info(device)
    platform = info["platform"]
    selected = collect_cases(platform, args.quick, args.filter)
    if not selected:
        console.print(f"No benchmark case matches --filter {args.filter!r}.")
        return 1
    warmup, iters, max_seconds = _SETTINGS[
        "quick" if args.quick else ("cpu" if platform == "cpu" else "accelerator")]
    iters = args.iters if args.iters is not None else iters
    now = datetime.datetime.now().astimezone()
    out_dir = args.out or default_out_dir(now, info, args.quick)

    console.print(f"Benchmarking {len(selected)} case(s) on {info['device_kind']} ({platform}), "
                  f"jax {jax.__version__}")
    console.print("Measuring ceilings ...")
    ceilings = harness.measure_ceilings(device)
    meta = {**info, "date": now.isoformat(timespec="seconds"), "jax_version": jax.__version__,
            "git_commit": git_commit(), "python": sys.version.split()[0], "ceilings": ceilings,
            "warmup": warmup, "iters": iters, "max_seconds": max_seconds, "quick": args.quick,
            "filter": args.filter, "seed": args.seed}

    rows: list[dict] = []
    base_key = jax.random.key(args.seed)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("cases", total=len(selected))
        for case in selected:
            progress.update(task, description=case.name)
            # The key depends only on the case's name, so --filter does not change inputs.
            key = jax.random.fold_in(base_key, zlib.crc32(case.name.encode()))
            rows += harness.run_case(case, key=key, ceilings=ceilings, warmup=warmup,
                                     iters=iters, max_seconds=max_seconds, device=device)
            progress.advance(task)

    print_table(console, meta, rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "results.json", meta, rows)
    write_markdown(out_dir / "results.md", meta, rows)
    write_plot(out_dir / "results.png", meta, rows)
    print(f"Results written to {out_dir}")
    failed = [r for r in rows if r.get("error")]
    if failed:
        console.print(f"{len(failed)} implementation(s) failed; see FAILED above.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
