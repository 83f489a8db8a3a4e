"""``python -m benchmarks.tune``: fill the autotuning cache (docs/design.md §5.4).

For each problem of every op registered with a tuning spec (:mod:`ops._op`;
:func:`ops.tuning.search.main_problems`, or ``--quick``'s small ones) the
tuner lists the op's candidate configs (its config class's ``candidates``), drops those that do
not fit the GPU (compiled for its ``sm_XY``: shared memory over the limit,
register spills, in the forward pass and, for an op that registers one, its
training step's kernels too unless ``--inference-only``;
:func:`ops.tuning.search.compile_filter`), times the rest on
the device (forward pass, fresh random inputs, median of several samples,
:func:`benchmarks.harness.time_fn`), and stores the fastest as a cache entry
keyed by the device's kind. The heuristic's own config is timed as well and
recorded beside the winner (``measured``), so a result shows what tuning
bought.

On a host without a GPU nothing is timed: the compile filter runs for
``--target`` (default sm_90) and its verdicts are printed and written to
the report; no cache entry is made.

Rankings (docs/design.md §5.2): on a GPU, after each problem is tuned, every
registered implementation of its op that runs there (ours, ``xla``, ``cudnn``
for attention) is timed on the problem's call, forward alone ("fwd") and,
where the op registers a training step, forward and backward ("fwd+bwd"), ours
on the winner just found; the implementations ranked by median time are a
rankings entry (:mod:`ops.tuning.rankings`) for the device kind, written to
``--rankings`` (default beside ``--out``, ``rankings.json``; ``--no-rankings``
skips it). The default implementation of a call (``implementation=None``)
is the first of its ranking that can run it.

Outputs: ``--out`` (default: the packaged cache, ``ops/tuning/configs.json``)
receives the winners, merged with what the file holds; ``--report`` (default
beside ``--out``, ``tune_report.json``) every verdict and time. ``--merge
FILE`` copies the entries of a cache file (e.g. one a GPU session wrote under
``benchmarks/results/``) into ``--out``, and those of the ``rankings.json``
beside it (when there is one) into ``--rankings`` (default: the packaged
``ops/tuning/rankings.json``), and exits. ``--from-results FILE`` turns a
benchmark run's ``results.json`` (``python -m benchmarks``: every
implementation timed on the suite's shapes) into rankings entries in
``--rankings`` (default: the packaged file), its source recorded as
``--source-path`` (the path the run is committed under), and exits.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import jax

import ops.tuning as tuning
import pallas_core as pl
from benchmarks import checkpoint, harness, suite
from benchmarks.__main__ import git_commit
from ops import _op, _resolve
from ops._implementation import IMPLEMENTATIONS
from ops.tuning import rankings, search

_OPS_HELP = ", ".join(sorted(op.name for op in search.tuned_ops()))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune",
                                     description="Fill the autotuning cache: time each op's "
                                     "candidate configurations on the GPU and keep the fastest "
                                     "(on a host without a GPU, only compile them for --target).")
    parser.add_argument("--quick", action="store_true", help="One small problem per op family.")
    parser.add_argument("--ops", default=None,
                        help=f"Comma-separated ops to tune (default: all of the problem set): {_OPS_HELP}.")
    parser.add_argument("--dtype", default="bfloat16", help="Input dtype (default bfloat16).")
    parser.add_argument("--implementation", default="triton", choices=("triton", "pallas_triton"),
                        help="The GPU implementation whose configurations are tuned (default triton).")
    parser.add_argument("--target", default=None,
                        help="GPU target to compile for, e.g. sm_90 (default: the GPU's, else sm_90).")
    parser.add_argument("--out", type=Path, default=tuning.PACKAGED_CACHE,
                        help="Cache file the winners are merged into (default: the packaged cache).")
    parser.add_argument("--report", type=Path, default=None,
                        help="JSON report of every verdict and time (default: beside --out).")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="Stop starting new problems after this many seconds.")
    parser.add_argument("--iters", type=int, default=10, help="Timed samples per candidate.")
    parser.add_argument("--max-candidates", type=int, default=None, metavar="N",
                        help="Try only the first N candidates of each problem.")
    parser.add_argument("--inference-only", action="store_true",
                        help="Compile only each candidate's forward pass, not the training step "
                        "(the forward that keeps residuals and the backward): faster, for a cache "
                        "that serves inference only.")
    parser.add_argument("--merge", type=Path, default=None, metavar="FILE",
                        help="Merge FILE's entries into --out, and those of the rankings.json "
                        "beside FILE into --rankings, and exit.")
    parser.add_argument("--rankings", type=Path, default=None,
                        help="Rankings file the measured rankings are merged into (default: "
                        "rankings.json beside --out; with --merge or --from-results the "
                        "packaged ops/tuning/rankings.json).")
    parser.add_argument("--no-rankings", action="store_true",
                        help="Do not time the implementations against each other.")
    parser.add_argument("--from-results", type=Path, default=None, metavar="FILE",
                        help="Turn a benchmark results.json into rankings entries in --rankings "
                        "and exit.")
    parser.add_argument("--source-path", default=None,
                        help="With --from-results: the path the run is committed under, "
                        "recorded as the entries' source (default: FILE as given).")
    parser.add_argument("--source-commit", default=None,
                        help="With --from-results: the commit the run measured, when its "
                        "results.json names another.")
    return parser.parse_args(argv)


def gpu_target(device) -> str | None:
    """``"sm_XY"`` of a CUDA device, None for anything else."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = str(capability).split(".")[:2]
    return f"sm_{major}{minor}"


def time_config(problem: search.Problem, config, device_kind: str, inputs, *, iters: int) -> dict:
    """Median ms of ``problem``'s forward pass run with ``config`` (None: the heuristic).

    A fresh function per config: jit caches traces by function, and the
    config is read when the op is traced.
    """
    fn, _ = problem.function()
    if config is None:
        return harness.time_fn(fn, *inputs, warmup=2, iters=iters, max_seconds=2.0)
    with tuning.device_kind(device_kind), tuning.override([problem.entry(config, device_kind)]):
        return harness.time_fn(fn, *inputs, warmup=2, iters=iters, max_seconds=2.0)


def tune_problem(problem: search.Problem, *, target: str, device_kind: str | None, iters: int,
                 max_candidates: int | None = None, training: bool = True, log=print) -> dict:
    """Filters (and, with a device kind, times) ``problem``'s candidates (``training``:
    the compile filter compiles the op's training step too).

    Returns ``{"problem", "verdicts", "timings", "entry"}``; ``entry`` is the
    winner's cache entry, or None when nothing was timed or nothing fitted.
    """
    configs = search.candidates(problem)[:max_candidates]
    verdicts = search.compile_filter(problem, configs, target=target, log=log, training=training)
    kept = [v.config for v in verdicts if v.kept]
    result = {"problem": problem.name, "target": target,
              "verdicts": [dict(config=v.config, kept=v.kept, reason=v.reason,
                                kernels=list(v.kernels)) for v in verdicts],
              "timings": [], "entry": None}
    if device_kind is None or not kept:
        return result
    inputs = problem.make_inputs(jax.random.key(0))
    heuristic_ms = time_config(problem, None, device_kind, inputs, iters=iters)["median_ms"]
    for config in kept:
        try:
            ms = time_config(problem, config, device_kind, inputs, iters=iters)["median_ms"]
        except Exception as e:  # noqa: BLE001 - a config that fails at run time is skipped
            log(f"  {problem.name} {config}: failed at run time: {type(e).__name__}: {e}")
            continue
        result["timings"].append(dict(config=config, median_ms=ms))
        log(f"  {problem.name} {config}: {ms:.4f} ms")
    if result["timings"]:
        best = min(result["timings"], key=lambda t: t["median_ms"])
        measured = dict(median_ms=best["median_ms"], heuristic_ms=heuristic_ms,
                        speedup_vs_heuristic=heuristic_ms / best["median_ms"],
                        candidates=len(verdicts), kept=len(kept), commit=git_commit(),
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        result["entry"] = problem.entry(best["config"], device_kind, measured)
        log(f"{problem.name}: best {best['config']} {best['median_ms']:.4f} ms "
            f"(heuristic {heuristic_ms:.4f} ms)")
    return result


# ----------------------------------------------------------------------------
# Rankings: every implementation of an op timed on the same call
# ----------------------------------------------------------------------------

def _random_inputs(args, key, high: int) -> list:
    """Fresh random arrays shaped as ``args`` (integers in ``[0, high)``)."""
    out = []
    for k, a in zip(jax.random.split(key, len(args)), args):
        if jax.numpy.issubdtype(a.dtype, jax.numpy.integer):
            out.append(jax.random.randint(k, a.shape, 0, high, a.dtype))
        else:
            out.append(jax.random.normal(k, a.shape, jax.numpy.float32).astype(a.dtype))
    return out


def ranked_implementations(op: _op.Op, platform: str) -> tuple[str, ...]:
    """The implementations of ``op`` the default may choose on ``platform``."""
    return tuple(name for name, impl in op.implementations.items() if platform in impl.platforms)


def rank_problem(problem: search.Problem, *, device_kind: str, platform: str, iters: int,
                 source: str, winner: dict | None = None, log=print) -> list[rankings.Ranking]:
    """Times every implementation of ``problem``'s op that may be a default on this
    device on its call, "fwd" and (where the op has a training step) "fwd+bwd"; one
    rankings entry per pass, naming ``source``. ``winner``: the tuned cache entry of
    ``problem``'s own implementation (installed while ours run)."""
    op, op_problem = problem.registered, problem.op_problem()
    names = ranked_implementations(op, platform)
    out = []
    for pass_, make in (("fwd", op.tuning.example), ("fwd+bwd", op.tuning.training)):
        if make is None or make(op_problem, names[0]) is None:
            continue
        fn, args = make(op_problem, names[0])
        key_problem = _resolve.capture_call(fn, args).problem  # what a lookup of the call sees
        inputs = _random_inputs(args, jax.random.key(1), problem.shape[-1])
        times, failed = {}, {}
        for name in names:
            fn, _ = make(op_problem, name)
            overrides = [winner] if winner is not None and name == problem.implementation else []
            try:
                with tuning.override(overrides):
                    times[name] = harness.time_fn(fn, *inputs, warmup=2, iters=iters,
                                                  max_seconds=2.0)["median_ms"]
            except Exception as e:  # noqa: BLE001 - a failure is part of the ranking
                failed[name] = harness._error_text(e)
        if not times:
            continue
        entry = rankings.make_entry(op.name, device_kind, key_problem.dtype, key_problem.shape,
                                    pass_, times, failed, key_problem.variant_dict(),
                                    source=source, cases=[f"{problem.name}/{pass_}"])
        log(f"  {problem.name} {pass_}: " + ", ".join(f"{n} {t:.4g} ms" for n, t in entry.ranking)
            + "".join(f", {n} failed" for n in failed))
        out.append(entry)
    return out


def tuner_source(device_kind: str, target: str) -> dict:
    return {"tool": "python -m benchmarks.tune", "device_kind": device_kind, "target": target,
            "commit": git_commit(), "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def rankings_from_results(document: dict, *, source: str, log=print) -> list[rankings.Ranking]:
    """Rankings entries from a benchmark run's ``results.json`` (decoded): each case's
    successful implementations (those of :data:`ops.IMPLEMENTATIONS`) ranked by median
    time, failures listed; the key is the problem the op itself sees for the case
    (its call traced abstractly up to the op layer, :func:`ops._resolve.capture_call`),
    the pass the case's. Cases with one key (fused_matmul's plain and bias + gelu
    products) are merged, each implementation's times summed over them (those timed
    in only some are left out)."""
    meta = document["meta"]
    cases = {c.name: c for c in suite.collect_cases(meta["platform"])}
    rows: dict[str, list[dict]] = {}
    for row in document["rows"]:
        rows.setdefault(row["case"], []).append(row)
    merged: dict[tuple, dict] = {}
    for name, group in rows.items():
        case = cases.get(name)
        ours = None if case is None else next(
            (i for i in case.implementations if i in pl.BACKENDS), None)
        if ours is None:
            log(f"  {name}: no such case with a kernel implementation now; skipped.")
            continue
        shapes = jax.eval_shape(case.make_inputs, jax.random.key(0))
        problem = _resolve.capture_call(case.implementations[ours], shapes).problem
        key = (case.op, problem.dtype, problem.bucket, problem.variant, case.pass_name)
        times = {r["implementation"]: r["median_ms"] for r in group
                 if r["implementation"] in IMPLEMENTATIONS and not r.get("error")
                 and r.get("median_ms")}
        failed = {r["implementation"]: r["error"] for r in group
                  if r["implementation"] in IMPLEMENTATIONS and r.get("error")}
        if key in merged:
            old = merged[key]
            failed = {**old["failed"], **failed}
            times = {n: t + old["times"][n] for n, t in times.items()
                     if n in old["times"] and n not in failed}
            old.update(times=times, failed=failed, cases=old["cases"] + [name])
        else:
            merged[key] = dict(problem=problem, times=times, failed=failed, cases=[name],
                               pass_=case.pass_name)
    entries = []
    for m in merged.values():
        p = m["problem"]
        if m["times"]:
            entries.append(rankings.make_entry(
                p.op, meta["device_kind"], p.dtype, p.shape, m["pass_"], m["times"], m["failed"],
                p.variant_dict(), source=source, cases=m["cases"]))
    return entries


def _merge(args) -> int:
    entries = json.loads(args.merge.read_text())["entries"] if args.merge.exists() else None
    if entries is None:
        print(f"{args.merge}: no such file.")
        return 1
    tuning.load(args.merge)  # validates, version included
    print(f"{args.out}: {tuning.write(args.out, entries)} entries after merging {len(entries)}.")
    beside = args.merge.with_name("rankings.json")
    if beside.exists():
        table = rankings.load(beside)
        out = args.rankings or rankings.PACKAGED_RANKINGS
        print(f"{out}: {rankings.write(out, table.entries.values(), table.sources)} rankings "
              f"after merging {len(table.entries)}.")
    return 0


def _from_results(args) -> int:
    if not args.from_results.exists():
        print(f"{args.from_results}: no such file.")
        return 1
    document = json.loads(args.from_results.read_text())
    meta = document["meta"]
    info = {"path": args.source_path or str(args.from_results), "tool": "python -m benchmarks",
            "device_kind": meta["device_kind"], "commit": args.source_commit or meta["git_commit"],
            "jax_version": meta["jax_version"], "date": meta["date"]}
    source = f"{meta['device_kind']} {str(meta['date'])[:10]} benchmarks".replace(" ", "-")
    entries = rankings_from_results(document, source=source)
    out = args.rankings or rankings.PACKAGED_RANKINGS
    print(f"{out}: {rankings.write(out, entries, {source: info})} rankings after adding "
          f"{len(entries)} from {args.from_results}.")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge is not None:
        return _merge(args)
    if args.from_results is not None:
        return _from_results(args)
    device = jax.devices()[0]
    target = args.target or gpu_target(device) or "sm_90"
    timing = gpu_target(device) is not None
    device_kind = device.device_kind if timing else None
    problems = search.quick_problems(args.dtype, args.implementation) if args.quick else \
        search.main_problems(args.dtype, args.implementation)
    if args.ops:
        wanted = set(args.ops.split(","))
        unknown = wanted - {op.name for op in search.tuned_ops()}
        if unknown:
            print(f"--ops: unknown op(s) {sorted(unknown)}; expected some of {_OPS_HELP}.")
            return 2
        problems = [p for p in problems if p.op in wanted]
    print(f"Tuning {len(problems)} problem(s) for {target} on {device.device_kind} "
          f"({'timed on the device' if timing else 'compile filter only: no GPU, nothing is timed'})")
    start, results, written = time.monotonic(), [], 0
    report = args.report or args.out.with_name("tune_report.json")
    ranking_file = args.rankings or args.out.with_name("rankings.json")
    ranking = timing and not args.no_rankings
    source = f"tune-{device.device_kind}-{git_commit() or 'unknown'}".replace(" ", "-")

    def save(result) -> None:
        """The winner into the cache file and the report rewritten, after every problem:
        a tuner stopped by its caller's time limit keeps what it has measured."""
        nonlocal written
        if result["entry"] is not None:
            tuning.write(args.out, [result["entry"]])
            written += 1
        if timing or args.report is not None:
            report.write_text(json.dumps({"device_kind": device.device_kind, "target": target,
                                          "commit": git_commit(), "results": results},
                                         indent=1) + "\n")

    with checkpoint.stop_on_sigterm():
        try:
            for problem in problems:
                if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                    print(f"Budget of {args.budget_s:g} s spent; skipping {problem.name} and the rest.")
                    break
                results.append(tune_problem(problem, target=target, device_kind=device_kind,
                                            iters=args.iters, max_candidates=args.max_candidates,
                                            training=not args.inference_only))
                save(results[-1])
                if ranking:
                    entries = rank_problem(problem, device_kind=device_kind, platform=device.platform,
                                           iters=args.iters, source=source,
                                           winner=results[-1]["entry"])
                    rankings.write(ranking_file, entries,
                                   {source: tuner_source(device.device_kind, target)})
        except (checkpoint.Stopped, KeyboardInterrupt) as e:
            print(f"Stopped ({e or 'Ctrl-C'}) after {len(results)} problem(s); those are saved.")
    if written:
        print(f"{written} winner(s) written to {args.out} "
              f"({len(tuning.load(args.out))} entries in the file).")
    if timing or args.report is not None:
        print(f"Report written to {report}")
    if ranking and ranking_file.exists():
        print(f"Rankings written to {ranking_file} ({len(rankings.load(ranking_file).entries)} "
              "entries in the file).")
    dropped = sum(not v["kept"] for r in results for v in r["verdicts"])
    kept = sum(v["kept"] for r in results for v in r["verdicts"])
    print(f"{kept} candidate(s) kept, {dropped} dropped by the {target} compile filter.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
