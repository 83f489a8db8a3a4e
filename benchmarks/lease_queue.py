"""``python -m benchmarks.lease_queue``: the pending A/B experiments, arms side by side.

The queue is ``benchmarks/lease_queue.json`` (kept in the repository: what each
experiment asks, what it decides, its arms, and the prediction written before
the lease; its ``about`` field gives the format). For each experiment, in
order, this runner

1. builds each arm's case (:func:`resolve_case`: a case of the suite by name, or
   fused_matmul's extra epilogue variants; on a CPU, or with ``--quick``, the
   quick case of the same op, variant and pass instead);
2. compiles each arm under its settings (``tma``: :func:`pallas_core.triton.enable_tma`;
   ``env``: environment variables; ``config``: a tuning-cache entry for the
   op's problem and, for an op whose configs are keyed by variant (attention's
   causal, ...), the entry's ``variant``, :func:`ops.tuning.cache.override`), with JAX's caches cleared
   first so no arm reuses another's trace;
3. checks each arm once against its case's float64 reference (one reference
   per case, shared by the arms that time it);
4. times the arms in interleaved rounds (A, B, A, B, ...), so that a drift of
   the device's clocks falls on every arm alike, and reports each arm's
   median with the spread of its round medians (a difference inside the
   spread is noise);
5. compares the metric with the prediction: ``as predicted`` when inside the
   predicted range, else ``above`` / ``below``.

Each arm's row and each experiment's verdict are appended to ``queue.jsonl``
and printed as they are measured; ``queue.md`` is the table at the end.
``--budget-s`` starts no experiment after that many seconds; SIGTERM / SIGINT
end the run with what it has.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import checkpoint, harness, matmul
from benchmarks.suite import collect_cases

QUEUE_FILE = Path(__file__).resolve().parent / "lease_queue.json"
METRICS = ("speedup", "fraction_of_ceiling")
# A case's shape -> the op's tuning problem dims (what a config arm's cache entry is for).
PROBLEM_DIMS = {"fused_matmul": lambda shape: (shape[0], shape[2], shape[1]),  # (M, K, N) -> (m, n, k)
                # (B, T, S, N, K, H) -> (T, S, head_dim)
                "dot_product_attention": lambda shape: (shape[1], shape[2], shape[5])}
# Cases the queue may name beyond the suite's: op -> make_case(shape, dtype, variant, pass, impls).
BUILDERS = {"fused_matmul": matmul.make_case}
ROUNDS = 3


def load_queue(path: Path = QUEUE_FILE) -> list[dict]:
    """The experiments of a queue file, checked.

    Raises:
      ValueError: a malformed experiment (the message names it and the field).
    """
    data = json.loads(Path(path).read_text())
    experiments = data.get("experiments") if isinstance(data, dict) else None
    if not isinstance(experiments, list):
        raise ValueError(f"{path}: expected {{'experiments': [...]}}.")
    names = set()
    for e in experiments:
        name = e.get("name") if isinstance(e, dict) else None
        where = f"{path}: experiment {name!r}"
        if not name or name in names:
            raise ValueError(f"{where}: every experiment needs a unique name.")
        names.add(name)
        arms = e.get("arms")
        if e.get("metric") not in METRICS:
            raise ValueError(f"{where}: metric must be one of {METRICS}, got {e.get('metric')!r}.")
        if not isinstance(arms, list) or len(arms) < 1 + (e["metric"] == "speedup"):
            raise ValueError(f"{where}: arms must be a list (two or more for a speedup).")
        for arm in arms:
            if not {"label", "case", "implementation"} <= set(arm):
                raise ValueError(f"{where}: every arm needs label, case and implementation.")
            unknown = set(arm) - {"label", "case", "implementation", "tma", "env", "config"}
            if unknown:
                raise ValueError(f"{where}: arm {arm['label']!r} has unknown settings {sorted(unknown)}.")
        prediction = e.get("prediction", {})
        values, ranges = prediction.get("value"), prediction.get("range")
        if not (isinstance(values, list) and isinstance(ranges, list)
                and len(values) == len(ranges) == len(arms)):
            raise ValueError(f"{where}: prediction needs a value and a [low, high] range per arm.")
        if not prediction.get("why") or not prediction.get("figure"):
            raise ValueError(f"{where}: prediction needs its figure and why.")
    return experiments


def split_name(name: str) -> tuple[str, str, tuple[int, ...], str, str]:
    """``op/variant/AxBxC/dtype/pass`` -> (op, variant, dims, dtype, pass); the variant
    may hold slashes (``swiglu/pair``)."""
    parts = name.split("/")
    if len(parts) < 5:
        raise ValueError(f"case: expected op/variant/dims/dtype/pass, got {name!r}.")
    dims = tuple(int(d) for d in parts[-3].split("x"))
    return parts[0], "/".join(parts[1:-3]), dims, parts[-2], parts[-1]


def resolve_case(name: str, platform: str, quick: bool) -> harness.Case:
    """The case an arm names.

    Full size: the suite's case of that name, else one built by the op's
    :data:`BUILDERS` entry. ``quick``: the first case of the platform's quick set,
    then of its full set, with the same op, variant and pass; else the op's builder
    at its quick shape and dtype; else a case with the same op, pass and variant up
    to its first ``+`` (a CPU's prefill case has another GQA group).

    Raises:
      ValueError: no such case.
    """
    op, variant, dims, dtype, pass_name = split_name(name)
    quick_suite = collect_cases(platform, quick=True)
    full_suite = collect_cases(platform, quick=False)
    if not quick:
        found = [c for c in full_suite if c.name == name]
    else:
        found = [c for suite in (quick_suite, full_suite) for c in suite
                 if (c.op, c.variant, c.pass_name) == (op, variant, pass_name)]
    if found:
        return found[0]
    if op in BUILDERS:
        if quick:
            model = next((c for c in quick_suite if c.op == op), None)
            if model is None:
                raise ValueError(f"case {name!r}: the quick suite has no {op} case to size it by.")
            dims, dtype = model.shape, model.dtype
        return BUILDERS[op](dims, dtype, variant, pass_name, harness.kernel_implementations(platform))
    base = variant.split("+")[0]
    found = [c for suite in (quick_suite, full_suite) for c in suite
             if quick and (c.op, c.variant.split("+")[0], c.pass_name) == (op, base, pass_name)]
    if found:
        return found[0]
    raise ValueError(f"case {name!r}: not a {'quick ' if quick else ''}case of the suite on "
                     f"{platform}, and {op} has no builder here.")


@contextlib.contextmanager
def arm_settings(arm: Mapping[str, Any], case: harness.Case) -> Iterator[None]:
    """The arm's settings in force (tma, env, config), JAX's caches cleared on entry."""
    from ops.tuning import cache

    import pallas_core as pl
    with contextlib.ExitStack() as stack:
        if arm.get("env"):
            stack.enter_context(_environment(arm["env"]))
        if arm.get("tma") is not None:
            stack.enter_context(pl.triton.enable_tma(bool(arm["tma"])))
        if arm.get("config"):
            config = arm["config"]
            if config["op"] != case.op or case.op not in PROBLEM_DIMS:
                raise ValueError(f"arm {arm['label']!r}: a config for {config['op']!r} on a "
                                 f"{case.op} case (configs: {sorted(PROBLEM_DIMS)}).")
            entry = cache.make_entry(case.op, arm["implementation"], cache.current_device_kind(),
                                     case.dtype, PROBLEM_DIMS[case.op](case.shape), config["fields"],
                                     variant=config.get("variant"))
            stack.enter_context(cache.override([entry]))
        jax.clear_caches()
        yield


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_experiment(experiment: dict, *, platform: str, quick: bool, key, iters: int,
                   max_seconds: float, emit, timed: bool = True) -> dict:
    """Runs one experiment (see the module docstring); ``emit(row)`` receives each arm's
    row, then the verdict, as they are measured. Returns the verdict. ``timed=False``
    (a CPU, whose kernels run in interpreters) compiles and checks the arms only."""
    start = time.perf_counter()
    arms = experiment["arms"]
    cases: dict[str, harness.Case] = {}
    prepared: dict[str, harness.Prepared] = {}
    compiled, rows = [], []
    for arm in arms:
        row = {"experiment": experiment["name"], "arm": arm["label"], "case": None,
               "implementation": arm["implementation"], "error": None}
        try:
            if arm["case"] not in cases:
                case = cases[arm["case"]] = resolve_case(arm["case"], platform, quick)
                prepared[arm["case"]] = _inputs_and_reference(case, key)
            case = cases[arm["case"]]
            row["case"] = case.name
            if arm["implementation"] not in case.implementations:
                # Not a failure: this platform's case has no such column (jax_pallas on a CPU).
                row["skipped"] = (f"{case.name} has no implementation {arm['implementation']!r} "
                                  f"here (it has {sorted(case.implementations)})")
                compiled.append(None)
                rows.append(row)
                continue
            with arm_settings(arm, case):
                call = harness.compile_fn(case.implementations[arm["implementation"]],
                                          *prepared[arm["case"]].inputs)
            row["max_rel_error"] = harness.check_implementation(call, prepared[arm["case"]],
                                                                harness.StepTimes())
        except Exception as e:  # noqa: BLE001 - the arm reports it, the others still run
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            call = None
        compiled.append(call)
        rows.append(row)
    medians: list[list[float]] = [[] for _ in arms]
    for _ in range(ROUNDS if timed else 0):
        for i, call in enumerate(compiled):
            if call is None:
                continue
            timing = harness.time_compiled(call, *prepared[arms[i]["case"]].inputs, warmup=1,
                                           iters=max(3, iters // ROUNDS), max_seconds=max_seconds)
            medians[i].append(timing["median_ms"])
    for i, row in enumerate(rows):
        if medians[i]:
            case = cases[arms[i]["case"]]
            seconds = float(np.median(medians[i])) * 1e-3
            row.update({"median_ms": seconds * 1e3, "round_ms": medians[i],
                        "tflops": case.flops / seconds / 1e12,
                        "gbps": case.bytes_accessed / seconds / 1e9 if case.bytes_accessed else None})
            if experiment["metric"] == "fraction_of_ceiling":
                row.update(harness.rate_against_ceiling(case, seconds, _ceilings(case)))
    verdict = judge(experiment, rows)
    verdict["seconds"] = round(time.perf_counter() - start, 1)
    for row in rows:
        emit({"kind": "arm", **row})
    emit({"kind": "verdict", **verdict})
    return verdict


def _inputs_and_reference(case: harness.Case, key) -> harness.Prepared:
    """The case's inputs and its float64 reference's outputs (or the exception it raised),
    once per case: every arm that times the case shares them."""
    inputs = jax.block_until_ready(case.make_inputs(
        jax.random.fold_in(key, zlib.crc32(case.name.encode()))))
    try:
        reference = harness.run_reference(harness.compile_reference(case, inputs), inputs)
    except Exception as e:  # noqa: BLE001 - each arm's check reports it
        reference = e
    return harness.Prepared(inputs, {}, reference)


_CEILINGS: dict[str, Any] = {}


def _ceilings(case: harness.Case) -> dict[str, Any]:
    """The measured ceilings a case's rate is compared with: the copy of its own bytes (by
    :func:`harness.rate_against_ceiling`), and the matmul rate, measured once if a
    compute-bound case needs it."""
    if not _CEILINGS:
        _CEILINGS["last_level_cache_bytes"] = harness.last_level_cache_bytes()
    if case.ceiling == "matmul" and "matmul_tflops" not in _CEILINGS:
        _CEILINGS.update(harness.measure_ceilings())
    return _CEILINGS


def judge(experiment: dict, rows: list[dict]) -> dict:
    """The experiment's metric per arm against its prediction."""
    prediction = experiment["prediction"]
    if experiment["metric"] == "speedup":
        first = rows[0].get("median_ms")
        values = [first / r["median_ms"] if first and r.get("median_ms") else None for r in rows]
    else:
        values = [r.get("fraction_of_ceiling") for r in rows]
    outcomes = []
    for row, value, (low, high) in zip(rows, values, prediction["range"]):
        if row.get("error") or row.get("skipped"):
            outcomes.append("failed" if row.get("error") else "skipped")
        elif not row.get("round_ms"):
            outcomes.append("not timed")
        elif value is None or (isinstance(value, float) and math.isnan(value)):
            outcomes.append("not measured")
        else:
            outcomes.append("as predicted" if low <= value <= high else
                            ("above" if value > high else "below"))
    spread = [(max(r["round_ms"]) - min(r["round_ms"])) / r["median_ms"]
              if r.get("round_ms") and r.get("median_ms") else None for r in rows]
    return {"experiment": experiment["name"], "metric": experiment["metric"],
            "arms": [r["arm"] for r in rows], "values": values,
            "predicted": prediction["value"], "ranges": prediction["range"], "outcomes": outcomes,
            "spread": spread, "errors": [r.get("max_rel_error") for r in rows],
            "failed": [r["arm"] for r in rows if r.get("error")], "decides": experiment.get("decides")}


def verdict_text(v: dict) -> str:
    """One line per arm of a verdict, under the experiment's name."""
    lines = [f"{v['experiment']} ({v['metric']}; {v.get('seconds', 0):.0f} s):"]
    for arm, value, predicted, (low, high), outcome, spread in zip(
            v["arms"], v["values"], v["predicted"], v["ranges"], v["outcomes"], v["spread"]):
        measured = "-" if value is None else f"{value:.3g}"
        noise = "" if spread is None else f", rounds spread {spread:.1%}"
        lines.append(f"  {arm}: {measured} (predicted {predicted:g}, {low:g}-{high:g}): "
                     f"{outcome}{noise}")
    lines += [f"  FAILED arm {a}" for a in v["failed"]]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lease_queue",
        description="Run the queued A/B experiments of benchmarks/lease_queue.json: each "
                    "experiment's arms compiled under their settings, checked against float64, "
                    "timed side by side in interleaved rounds, and judged against the "
                    "prediction written before the lease.")
    parser.add_argument("--queue", type=Path, default=QUEUE_FILE,
                        help="The queue file (default: benchmarks/lease_queue.json).")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="Comma-separated experiment names to run (default: all, in order).")
    parser.add_argument("--quick", action="store_true",
                        help="Each arm on its op's quick case (always so on a CPU).")
    parser.add_argument("--out", type=Path, default=None,
                        help="Folder for queue.jsonl (rows as measured) and queue.md.")
    parser.add_argument("--budget-s", type=checkpoint.positive_seconds, default=None,
                        metavar="SECONDS",
                        help="Start no experiment after SECONDS (the report lists those not run).")
    parser.add_argument("--iters", type=int, default=30,
                        help="Timed samples per arm over all rounds (default 30).")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the random inputs.")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
    experiments = load_queue(args.queue)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {e["name"] for e in experiments}
        if unknown:
            print(f"error: --only names no experiment: {sorted(unknown)}", file=sys.stderr)
            return 2
        experiments = [e for e in experiments if e["name"] in wanted]
    device = jax.devices()[0]
    quick = args.quick or device.platform == "cpu"
    timed = device.platform != "cpu"
    print(f"Queue: {len(experiments)} experiment(s) on {device.device_kind} ({device.platform})"
          + (", each arm on its quick case" if quick else "")
          + ("; our kernels run in interpreters here: each arm is compiled and checked, "
             "nothing is timed" if not timed else ""), flush=True)
    out = args.out
    jsonl = None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        jsonl = (out / "queue.jsonl").open("w")

    def emit(row):
        if row["kind"] == "arm":
            measured = (f"FAILED: {row['error']}" if row.get("error") else
                        f"skipped: {row['skipped']}" if row.get("skipped") else
                        (f"{row['median_ms']:.4g} ms, " if row.get("median_ms") else "")
                        + f"err {row['max_rel_error']:.1e}")
            print(f"  {row['experiment']} / {row['arm']} [{row['implementation']}] {row['case']}: "
                  f"{measured}", flush=True)
        else:
            print(verdict_text(row), flush=True)
        if jsonl:
            jsonl.write(json.dumps(row, default=float) + "\n")
            jsonl.flush()

    verdicts, not_run, stopped = [], [e["name"] for e in experiments], None
    budget = checkpoint.Budget(args.budget_s, start=start)
    try:
        with checkpoint.stop_on_sigterm():
            for experiment in experiments:
                if budget.spent():
                    stopped = f"--budget-s {args.budget_s:g} spent"
                    break
                print(f"{experiment['name']}: {experiment['question']}", flush=True)
                verdicts.append(run_experiment(
                    experiment, platform=device.platform, quick=quick,
                    key=jax.random.key(args.seed), iters=args.iters,
                    max_seconds=2.0 if not quick else 0.5, emit=emit, timed=timed))
                not_run.remove(experiment["name"])
    except (checkpoint.Stopped, KeyboardInterrupt) as e:
        stopped = f"interrupted ({e or 'Ctrl-C'})"
    tail = [f"queue: {len(verdicts)} experiment(s) in {time.perf_counter() - start:.0f} s"]
    if not_run:
        tail.append(f"{len(not_run)} not run ({stopped}): {', '.join(not_run)}")
    print("\n".join(tail), flush=True)
    if jsonl:
        jsonl.close()
        (out / "queue.md").write_text(markdown(verdicts, device, quick) + "\n".join(tail) + "\n")
    failed = any(v["failed"] for v in verdicts)
    return 1 if failed or not_run else 0


def markdown(verdicts: list[dict], device, quick: bool) -> str:
    """The verdicts as one Markdown table."""
    lines = [f"# Queued experiments on {device.device_kind}" + (" (quick cases)" if quick else ""),
             "", "| experiment | arm | metric | measured | predicted | range | outcome | rounds spread |",
             "|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        for arm, value, predicted, (low, high), outcome, spread in zip(
                v["arms"], v["values"], v["predicted"], v["ranges"], v["outcomes"], v["spread"]):
            lines.append(f"| {v['experiment']} | {arm} | {v['metric']} | "
                         f"{'-' if value is None else f'{value:.3g}'} | {predicted:g} | "
                         f"{low:g}-{high:g} | {outcome} | "
                         f"{'-' if spread is None else f'{spread:.1%}'} |")
    return "\n".join(lines) + "\n\n"


if __name__ == "__main__":
    sys.exit(main())
