"""``python -m benchmarks``: run the benchmark suite on the default device.

With no arguments it runs every registered case at sizes that suit the
platform, shows progress, prints one table per op and writes results.json,
results.md and one figure per op family (``results-<family>.png``) to
``benchmarks/results/runs/<date>-<platform>-<device>/`` (a folder git
ignores; ``-quick`` suffix for ``--quick``; or ``--out``). Exit status 0 on
success, 1 if any implementation failed, no case matched ``--filter`` or
cases were left not run.

Cases run headline first (:func:`benchmarks.suite.run_order`); ``--headline``
runs only those. Each case prints its steps' seconds (inputs, compile,
reference, check, warm-up, timing; :class:`benchmarks.harness.StepTimes`),
which ``results.json`` keeps in ``meta.case_seconds``.
``--budget-s`` stops starting cases after that many seconds, ``results.json``
is rewritten after every case and SIGTERM ends the run with its report, and
``--resume`` continues an earlier run (:mod:`benchmarks.checkpoint`): how a
suite longer than one call to a lent GPU is measured over several.

On a GPU or TPU each implementation is timed against the XLA baseline. On a
host without one our kernels run only in interpreters, whose speed says
nothing about the kernels, so by default nothing is timed there: the run
reports each implementation's error against a float64 reference (``xla``,
``interpret`` and, with triton installed, ``triton`` in Triton's CPU
interpreter) and the sm_90 compile of each GPU kernel at the GPU
benchmark's sizes with the H100 roofline bound it implies
(:mod:`benchmarks.roofline`). ``--time-interpreters`` times them anyway.

To benchmark another op, register its case module in :mod:`benchmarks.suite`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
import warnings
import zlib
from pathlib import Path

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from benchmarks import checkpoint, harness, tables
from benchmarks.provenance import git_commit, source_fingerprint
from benchmarks.plots import write_plots
from benchmarks.suite import collect_cases, headline, run_order
from ops.tuning import cache as tuning_cache

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_ROOT = Path(__file__).resolve().parent / "results"
# Runs land here by default; .gitignore keeps them out of commits.
RUNS_ROOT = RESULTS_ROOT / "runs"

# (warmup calls, timed samples, time budget in s) per implementation. CPU
# budgets keep a timed suite to about a minute on a 2-core CI machine;
# accelerators get many samples for stable medians.
# Warm-up calls follow the first call (which checks the output) and precede the one
# that sizes the samples: two are enough for compiled code.
_SETTINGS = {"cpu": (2, 20, 2.0), "accelerator": (2, 50, 10.0), "quick": (1, 5, 1.0)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmark suite on the default device and write its tables and figures.",
        epilog="On a host without a GPU the run checks accuracy and compiles the GPU kernels "
               "for sm_90 instead of timing interpreters; see --time-interpreters.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Output folder (default: benchmarks/results/runs/"
                             "<date>-<platform>-<device>/, ignored by git).")
    parser.add_argument("--quick", action="store_true",
                        help="One tiny case per op, few samples, one static compile: a smoke test.")
    parser.add_argument("--filter", default=None, metavar="SUBSTR",
                        help="Only cases whose name (op/variant/shape/dtype/pass) contains SUBSTR.")
    parser.add_argument("--headline", action="store_true",
                        help="Only the headline cases (HEADLINE_CASES in benchmarks/suite.py; with "
                             "--quick, the first quick case of each headline op), every column.")
    parser.add_argument("--iters", type=int, default=None,
                        help="Timed samples per implementation (default: 20 on CPU, 50 elsewhere).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the random inputs.")
    parser.add_argument("--time-interpreters", action="store_true",
                        help="On a host without a GPU, time the interpreters against XLA too "
                             "(their speed says nothing about the kernels).")
    parser.add_argument("--no-static", action="store_true",
                        help="On a host without a GPU, skip the sm_90 compiles and roofline bounds.")
    parser.add_argument("--budget-s", type=checkpoint.positive_seconds, default=None,
                        metavar="SECONDS",
                        help="Start no new case after SECONDS (the report lists the cases not "
                             "run; --resume runs them later). Default: no limit.")
    parser.add_argument("--resume", type=Path, default=None, metavar="RESULTS_JSON",
                        help="Keep the rows of an earlier run's results.json (same device kind) "
                             "and run only the cases it lacks.")
    parser.add_argument("--no-static-cache", action="store_true",
                        help="Compile again even if the static results of this source tree are "
                             "cached (see benchmarks.roofline.cache_dir).")
    return parser.parse_args(argv)


def default_out_dir(now: datetime.datetime, info: dict[str, str], quick: bool) -> Path:
    """``benchmarks/results/runs/<date>-<platform>-<device-kind>``; quick runs get a
    ``-quick`` suffix so that a smoke test never overwrites the day's full run."""
    slug = re.sub(r"[^a-z0-9]+", "-", info["device_kind"].lower()).strip("-") or "device"
    return RUNS_ROOT / f"{now:%Y-%m-%d}-{info['platform']}-{slug}{'-quick' if quick else ''}"


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def cpu_header(info: dict[str, str], implementations: tuple[str, ...], timing: bool) -> str:
    """What a run on a host without a GPU reports, and why."""
    kinds = {"interpret": "interpret (our Pallas interpreter)",
             "triton": "triton (our Triton lowering, in Triton's CPU interpreter)"}
    ours = ", ".join(kinds.get(i, i) for i in implementations)
    device = dict.fromkeys((info["device_kind"], info["platform"]))  # "cpu" once, not twice
    text = (f"No GPU on this host (JAX device: {', '.join(device)}): our kernels run here only "
            f"in interpreters: {ours}. ")
    if timing:
        return text + ("--time-interpreters: the times below are of interpreters against XLA "
                       "on a CPU and say nothing about the kernels' speed on a GPU.")
    return text + ("Nothing is timed. Reported: each implementation's error against a float64 "
                   "reference, and the sm_90 compile of the GPU kernels with the H100 roofline "
                   "bound it implies (a bound, not a measurement). Times of the interpreters: "
                   "--time-interpreters.")


def _ceiling_text(meta: dict) -> str:
    c = meta.get("ceilings")
    if not c:
        return "not measured (nothing timed)"
    cache = c.get("last_level_cache_bytes")
    return (f"copy {c['copy_gbps']:.1f} GB/s over {c['copy_bytes'] // 2**20} MiB moved (each "
            f"memory-bound case against a copy of its own size); matmul "
            f"{c['matmul_tflops']:.3g} TFLOP/s ({'x'.join(map(str, c['matmul_shape']))} "
            f"{c['matmul_dtype']}); last-level cache "
            f"{'unknown' if not cache else f'{cache / 2**20:g} MiB'}")


def _failures(rows) -> list[str]:
    return [f"{r['case']} [{r['implementation']}]: {r['error']}" for r in rows if r.get("error")]


def report_tables(meta: dict, rows: list[dict], static: dict | None):
    """The run's tables (:mod:`benchmarks.tables`), in print order."""
    found = tables.timing_tables(rows) if meta["timed"] else tables.accuracy_tables(rows)
    return found + (tables.static_tables(static) if static else [])


def _notes(meta: dict, static: dict | None) -> list[str]:
    notes = [meta["header"]] if meta.get("header") else []
    notes.append(tables.TIMING_NOTES if meta["timed"] else tables.ACCURACY_NOTES)
    notes.append(tables.DTYPE_LEGEND + ".")
    if meta["timed"]:
        notes.append(f"Ceilings: {_ceiling_text(meta)}.")
    if static:
        notes.append(tables.static_notes(static))
    elif meta.get("static_skipped"):
        notes.append(meta["static_skipped"])
    earlier = meta.get("resumed_from")
    if earlier:
        ceilings = _ceiling_text(earlier) if earlier.get("ceilings") else "not measured"
        notes.append(f"Resumed: {earlier['cases']} case(s) come from the run of {earlier['date']} "
                     f"(commit {earlier['git_commit'] or 'unknown'}; ceilings {ceilings}), "
                     "each rated against its own run's ceilings.")
    if meta.get("not_run"):
        notes.append(f"Incomplete: {len(meta['not_run'])} case(s) not run ({meta['stopped']}); "
                     "python -m benchmarks --resume <this results.json> runs them.")
    return notes


def write_json(path: Path, meta: dict, rows: list[dict], static: dict | None) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows, "static": static}, indent=2,
                               allow_nan=True) + "\n")


def write_markdown(path: Path, meta: dict, rows: list[dict], static: dict | None) -> None:
    lines = [f"# Benchmark results: {meta['device_kind']} ({meta['platform']})", "",
             f"- Date: {meta['date']}; JAX {meta['jax_version']}; commit "
             f"{meta['git_commit'] or 'unknown'}; wall time {meta.get('wall_s', 0):.0f} s."]
    if meta["timed"]:
        lines.append(f"- Timing: median ms per call over up to {meta['iters']} samples (at least "
                     f"{harness.MIN_TIMED_RUNS}, {meta['max_seconds']} s budget) after "
                     f"{meta['warmup']} warm-up calls; calls under "
                     f"{harness.MIN_SAMPLE_SECONDS * 1e3:g} ms are batched into one sample.")
    lines += [f"- {note}" for note in _notes(meta, static)] + [""]
    lines += tables.markdown_tables(report_tables(meta, rows, static))
    failures = _failures(rows)
    if failures:
        lines += ["Failures:", ""] + [f"- {f}" for f in failures]
    path.write_text("\n".join(lines) + "\n")


def print_report(console: Console, meta: dict, rows: list[dict], static: dict | None) -> None:
    for table, legend in tables.rich_tables(report_tables(meta, rows, static)):
        console.print(table)
        console.print(legend, style="dim", markup=False, highlight=False)
        console.print()
    for note in _notes(meta, static)[1:]:
        console.print(note, markup=False, highlight=False)
    for failure in _failures(rows):
        console.print(f"FAILED: {failure}", markup=False)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def _static_report(args, console: Console) -> tuple[dict | None, str | None]:
    """The sm_90 compiles and H100 bounds, or why they were skipped."""
    if args.no_static:
        return None, "Static sm_90 compiles skipped (--no-static)."
    if not harness.triton_available():
        return None, ("Static sm_90 compiles and the triton column skipped: they need triton "
                      f"and torch: {harness.TRITON_INSTALL_HINT}.")
    from benchmarks import roofline
    cases = roofline.essential_cases()
    if args.quick:
        cases = [c for c in cases if c.case.op == "rms_norm"]
    if args.filter:
        cases = [c for c in cases if args.filter in c.case.name] or cases[:0]
    if not cases:
        return None, None
    console.print(f"Compiling {len(cases)} case(s) for sm_90 (cached per source tree) ...")
    return roofline.report(cases, use_cache=not args.no_static_cache,
                           log=lambda m: console.print("  " + m, markup=False)), None


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    # Triton's interpreter computes masked-off lanes too (0/0 in a padded tile, say);
    # numpy's warning about them is noise: those lanes are never stored.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    # At most 120 columns: every table fits, in a terminal and in a log.
    console = Console(width=tables.WIDTH) if not sys.stdout.isatty() else Console(
        width=min(tables.WIDTH, Console().width))
    device = jax.devices()[0]
    info = harness.device_info(device)
    platform = info["platform"]
    on_cpu = platform == "cpu"
    timed = not on_cpu or args.time_interpreters
    selected = collect_cases(platform, args.quick, args.filter)
    if args.headline:
        selected = headline(selected, args.quick)
    if not selected:
        console.print(f"No benchmark case matches --filter {args.filter!r}.")
        return 1
    warmup, iters, max_seconds = _SETTINGS[
        "quick" if args.quick else ("cpu" if on_cpu else "accelerator")]
    iters = args.iters if args.iters is not None else iters
    now = datetime.datetime.now().astimezone()
    out_dir = args.out or default_out_dir(now, info, args.quick)
    header = cpu_header(info, harness.kernel_implementations(platform), timed) if on_cpu else None
    if header:
        console.print(header, markup=False, highlight=False)
    console.print(f"{'Benchmarking' if timed else 'Checking'} {len(selected)} case(s) on "
                  f"{info['device_kind']} ({platform}), jax {jax.__version__}")
    resumed_rows, resumed_from = [], None
    if args.resume:
        try:
            resumed_rows, resumed_from = checkpoint.load_resume(
                args.resume, device_kind=info["device_kind"], platform=platform, timed=timed)
        except ValueError as e:
            console.print(f"error: {e}", markup=False, highlight=False)
            return 2
    ceilings = None
    if timed:
        console.print("Measuring ceilings ...")
        ceilings = harness.measure_ceilings(device)
    meta = {**info, "date": now.isoformat(timespec="seconds"), "jax_version": jax.__version__,
            "headline": args.headline,
            "git_commit": git_commit(), "source_fingerprint": source_fingerprint(),
            "python": sys.version.split()[0], "ceilings": ceilings,
            "timed": timed, "header": header, "warmup": warmup, "iters": iters,
            "max_seconds": max_seconds, "quick": args.quick, "filter": args.filter,
            "seed": args.seed,
            # The tuner's winners the run used beyond the packaged configs, if any.
            "tuning_cache": os.environ.get(tuning_cache.ENV_VAR)}

    if resumed_from:
        meta["resumed_from"] = resumed_from
    rows: list[dict] = list(resumed_rows)
    done = checkpoint.done_cases(rows)
    to_run = [c for c in run_order(selected) if c.name not in done]
    if done:
        console.print(f"Resuming {args.resume}: {len(selected) - len(to_run)} case(s) done there, "
                      f"{len(to_run)} to run.", markup=False, highlight=False)
    budget = checkpoint.Budget(args.budget_s, start=start)
    out_dir.mkdir(parents=True, exist_ok=True)
    not_run = [c.name for c in to_run]
    base_key = jax.random.key(args.seed)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, checkpoint.stop_on_sigterm():
        task = progress.add_task("cases", total=len(to_run))
        try:
            for case in to_run:
                if budget.spent():
                    meta["stopped"] = f"--budget-s {args.budget_s:g} spent"
                    break
                progress.update(task, description=case.name)
                # The key depends only on the case's name, so --filter does not change inputs.
                key = jax.random.fold_in(base_key, zlib.crc32(case.name.encode()))
                steps = harness.StepTimes()
                if timed:
                    rows += harness.run_case(case, key=key, ceilings=ceilings, warmup=warmup,
                                             iters=iters, max_seconds=max_seconds, device=device,
                                             steps=steps)
                else:
                    rows += harness.check_case(case, key=key, device=device, steps=steps)
                # Each case's steps in seconds (its fixed cost: everything but the timing).
                meta.setdefault("case_seconds", {})[case.name] = steps.as_dict()
                progress.console.print(f"{case.name}: {steps.summary()}", markup=False,
                                       highlight=False)
                not_run.remove(case.name)
                checkpoint.write_checkpoint(out_dir / "results.json", meta, rows, not_run)
                progress.advance(task)
        except (checkpoint.Stopped, KeyboardInterrupt) as e:
            meta["stopped"] = f"interrupted ({e or 'Ctrl-C'}) during {progress.tasks[0].description}"
    meta["not_run"] = not_run
    # Tables in the suite's registered order, whatever order the cases ran in.
    position = {c.name: i for i, c in enumerate(selected)}
    rows.sort(key=lambda r: position.get(r["case"], len(position)))

    static = None
    if on_cpu:
        static, meta["static_skipped"] = _static_report(args, console)
    meta["wall_s"] = time.perf_counter() - start
    print_report(console, meta, rows, static)
    meta["complete"] = not not_run
    write_json(out_dir / "results.json", meta, rows, static)
    write_markdown(out_dir / "results.md", meta, rows, static)
    figures = write_plots(out_dir, meta, rows)
    console.print(f"Results written to {out_dir} (results.json, results.md, "
                  f"{', '.join(f['path'].name for f in figures)}) in {meta['wall_s']:.0f} s",
                  markup=False, highlight=False)
    failed = [r for r in rows if r.get("error")]
    failing_kernels = [k for c in (static or {}).get("cases", []) for k in c["kernels"]
                       if k.get("violations")]
    if failed:
        console.print(f"{len(failed)} implementation(s) failed; see FAILED above.")
    if failing_kernels:
        console.print(f"{len(failing_kernels)} kernel(s) fail the static gate; see 'gate' above.")
    if not_run:
        console.print(f"{len(not_run)} case(s) not run ({meta['stopped']}): run them with "
                      f"--resume {out_dir / 'results.json'}", markup=False, highlight=False)
    return 1 if failed or failing_kernels or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
