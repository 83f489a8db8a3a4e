"""``python -m benchmarks.smoke``: one small case of every op family, every implementation, against float64.

The second step of a lent GPU's session (``benchmarks/gpu_session.sh``), after
the compatibility step: does each implementation run on this device and give
the right answer, before anything is timed? One case per op and variant of the
suite's quick set (:func:`benchmarks.suite.collect_cases` with ``quick``; the
``fwd+bwd`` pass where there is one, since it runs the forward kernels too),
every implementation the case has on this platform (``xla``, ours,
``cudnn``, ``jax_pallas``, ...), each compared with the float64 reference
(:func:`benchmarks.harness.prepare_case`: compiles in parallel, one reference
per case). Nothing is timed.

Each implementation's verdict is printed and appended to ``smoke.jsonl`` the
moment it is known, with the whole error message and the innermost frames of
our code for a failure, so a step cut by its time limit loses nothing it has
found. SIGTERM (``timeout``) and SIGINT end the run with its summary.
A verdict fails on an exception, a non-finite error, or an error above
:data:`LIMITS` for the case's dtype (a gross-error bound, not the tests'
tolerances). Exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
import warnings
import zlib
from pathlib import Path

import jax

from benchmarks import checkpoint, harness
from benchmarks.suite import collect_cases

# Largest max-relative error (against float64) that passes, by input dtype: gross errors
# only (wrong indexing, a dropped mask, garbage), well above each dtype's rounding.
LIMITS = {"bfloat16": 5e-2, "float16": 1e-2, "float32": 2e-3}


def smoke_cases(platform: str, substring: str | None = None) -> list[harness.Case]:
    """One quick case per (op, variant): its ``fwd+bwd`` pass where it has one."""
    chosen: dict[tuple[str, str], harness.Case] = {}
    for case in collect_cases(platform, quick=True, substring=substring):
        key = (case.op, case.variant)
        if key not in chosen or (case.pass_name == "fwd+bwd" and chosen[key].pass_name != "fwd+bwd"):
            chosen[key] = case
    return list(chosen.values())


def error_report(e: BaseException, frames: int = 6) -> str:
    """The exception's type and whole message, then its innermost ``frames`` frames in this
    project's files (JAX's own frames left out), most recent last."""
    ours = [f for f in traceback.extract_tb(e.__traceback__)
            if "/site-packages/" not in f.filename and "/lib/python" not in f.filename]
    lines = [f"{type(e).__name__}: {e}".rstrip()]
    lines += [f"  at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"
              for f in ours[-frames:]]
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e:
        lines.append(f"  caused by {type(cause).__name__}: {' '.join(str(cause).split())[:500]}")
    return "\n".join(lines)


def verdict(case: harness.Case, implementation: str, call, prepared: harness.Prepared,
            steps: harness.StepTimes) -> dict:
    """One implementation's verdict on a prepared case (see the module docstring)."""
    row = {"case": case.name, "op": case.op, "implementation": implementation,
           "compile_s": round(steps.compiles.get(implementation, 0.0), 2),
           "max_rel_error": None, "error": None}
    try:
        if isinstance(prepared.reference, Exception):
            raise RuntimeError("the float64 reference failed") from prepared.reference
        row["max_rel_error"] = harness.check_implementation(call, prepared, steps)
    except Exception as e:  # noqa: BLE001 - reported whole, the run goes on
        row["error"] = error_report(e)
    limit = LIMITS.get(case.dtype, LIMITS["float32"])
    err = row["max_rel_error"]
    row["ok"] = row["error"] is None and err is not None and math.isfinite(err) and err <= limit
    if row["error"] is None and not row["ok"]:
        row["error"] = f"error {err:.3g} against float64, above the {case.dtype} limit {limit:g}"
    return row


def line(row: dict) -> str:
    """The printed form of a verdict."""
    head = f"{'PASS' if row['ok'] else 'FAIL'} {row['case']} [{row['implementation']}]"
    if row["ok"]:
        return f"{head} err {row['max_rel_error']:.2e} (compile {row['compile_s']:.1f} s)"
    return f"{head}: {row['error']}"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.smoke",
        description="Run one small case of every op family on every implementation against "
                    "its float64 reference, printing each verdict (and a failure's whole "
                    "message) as it is known.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Folder for smoke.jsonl (one verdict a line, as they come) and "
                             "smoke.txt (default: print only).")
    parser.add_argument("--filter", default=None, metavar="SUBSTR",
                        help="Only cases whose name contains SUBSTR.")
    parser.add_argument("--budget-s", type=checkpoint.positive_seconds, default=None,
                        metavar="SECONDS",
                        help="Start no new case after SECONDS (the summary lists those not run).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the random inputs.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    platform = jax.devices()[0].platform
    cases = smoke_cases(platform, args.filter)
    print(f"Smoke: {len(cases)} case(s) on {jax.devices()[0].device_kind} ({platform}), "
          f"jax {jax.__version__}", flush=True)
    jsonl = None
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        jsonl = (args.out / "smoke.jsonl").open("w")
    rows, stopped, not_run = [], None, [c.name for c in cases]
    budget = checkpoint.Budget(args.budget_s, start=start)
    base_key = jax.random.key(args.seed)
    try:
        with checkpoint.stop_on_sigterm():
            for case in cases:
                if budget.spent():
                    stopped = f"--budget-s {args.budget_s:g} spent"
                    break
                steps = harness.StepTimes()
                key = jax.random.fold_in(base_key, zlib.crc32(case.name.encode()))
                prepared = harness.prepare_case(case, key, steps)
                for impl, call in harness.baseline_first(prepared.compiled):
                    row = verdict(case, impl, call, prepared, steps)
                    rows.append(row)
                    print(line(row), flush=True)
                    if jsonl:
                        jsonl.write(json.dumps(row) + "\n")
                        jsonl.flush()
                not_run.remove(case.name)
                print(f"  {case.name}: {steps.summary()}", flush=True)
    except (checkpoint.Stopped, KeyboardInterrupt) as e:
        stopped = f"interrupted ({e or 'Ctrl-C'})"
    failed = [r for r in rows if not r["ok"]]
    summary = [f"smoke: {len(rows) - len(failed)} of {len(rows)} implementation(s) passed in "
               f"{time.perf_counter() - start:.0f} s"]
    summary += [f"FAILED {r['case']} [{r['implementation']}]: {r['error'].splitlines()[0]}"
                for r in failed]
    if not_run:
        summary.append(f"{len(not_run)} case(s) not run ({stopped}): {', '.join(not_run)}")
    print("\n".join(summary), flush=True)
    if jsonl:
        jsonl.close()
        (args.out / "smoke.txt").write_text("\n".join([*map(line, rows), "", *summary]) + "\n")
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
