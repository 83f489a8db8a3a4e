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

Outputs: ``--out`` (default: the packaged cache, ``ops/tuning/configs.json``)
receives the winners, merged with what the file holds; ``--report`` (default
beside ``--out``, ``tune_report.json``) every verdict and time. ``--merge
FILE`` copies the entries of a cache file (e.g. one a GPU session wrote under
``benchmarks/results/``) into ``--out`` and exits.
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
from benchmarks import checkpoint, harness
from benchmarks.__main__ import git_commit
from ops.tuning import search

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
                        help="Merge FILE's entries into --out and exit.")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge is not None:
        entries = json.loads(args.merge.read_text())["entries"] if args.merge.exists() else None
        if entries is None:
            print(f"{args.merge}: no such file.")
            return 1
        tuning.load(args.merge)  # validates, version included
        print(f"{args.out}: {tuning.write(args.out, entries)} entries after merging {len(entries)}.")
        return 0
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
        except (checkpoint.Stopped, KeyboardInterrupt) as e:
            print(f"Stopped ({e or 'Ctrl-C'}) after {len(results)} problem(s); those are saved.")
    if written:
        print(f"{written} winner(s) written to {args.out} "
              f"({len(tuning.load(args.out))} entries in the file).")
    if timing or args.report is not None:
        print(f"Report written to {report}")
    dropped = sum(not v["kept"] for r in results for v in r["verdicts"])
    kept = sum(v["kept"] for r in results for v in r["verdicts"])
    print(f"{kept} candidate(s) kept, {dropped} dropped by the {target} compile filter.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
