"""``python -m benchmarks.compat``: do this machine's JAX and Triton take our kernels? (under a minute)

The first step of a lent GPU's session (``benchmarks/gpu_session.sh``): before
anything is timed, every kernel the session will run is traced under the
machine's own JAX, so a JAX difference shows up as a list, not as a run of
failed cases. Nothing runs on the device; the same checks run on a host
without a GPU (under its JAX), and a CI test runs a few.

Items checked, each on every GPU implementation it has:

* every registered op with a tuning example (:mod:`ops._op`): its call and its
  training step (:meth:`ops.tuning.search.Problem.compiled_calls`) at its
  quick problem (else its first tuned shape), bfloat16;
* every benchmark case of the GPU suite's quick set
  (:func:`benchmarks.suite.collect_cases`), at abstract inputs.

Checks per item and implementation:

* ``triton`` (ours): the Triton source of every kernel is generated
  (:mod:`pallas_core.triton.codegen`). A primitive the code generator has no
  rule for is listed with its kernel and source line, and generation goes on
  past it (its value stands in as a placeholder), so one trace lists every
  such primitive, not only the first;
* ``pallas_triton``, ``jax_pallas`` (JAX's Pallas Triton lowering) and
  ``mosaic_gpu`` (JAX's Mosaic GPU lowering): the call is lowered for ``cuda``
  (``jit(f).trace(...).lower(lowering_platforms=("cuda",))``); when that
  fails, every primitive in its kernels that JAX's Triton lowering has no rule
  for is listed too.

Writes ``compat.json`` (versions, commit, every item's verdict, seconds) and
``compat.txt`` (the same as text) to ``--out``, printing each verdict as it is
reached, so a run cut short keeps what it found. Exit status 1 if anything
failed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform as host_platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from benchmarks import checkpoint, provenance

# Implementations whose Triton source we generate, and those lowered for cuda through JAX.
SOURCE_IMPLEMENTATIONS = ("triton",)
CUDA_LOWERED_IMPLEMENTATIONS = ("pallas_triton", "mosaic_gpu", "jax_pallas")
_MODULES = ("jax", "jaxlib", "triton", "jax_triton", "flax", "numpy")


def versions() -> dict[str, str]:
    """Versions of Python, JAX, jaxlib, Triton, jax_triton, Flax and numpy (or why a
    module does not import), the device and pallas_core's verified JAX range."""
    from pallas_core import _versions
    found = {"python": host_platform.python_version()}
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - jax_triton refuses to import without a GPU
            found[name] = f"not importable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    device = jax.devices()[0]
    found["device"] = f"{device.device_kind} ({device.platform})"
    found["verified_jax"] = "{} <= jax < {}".format(*_versions.VERIFIED_JAX)
    return found


# ----------------------------------------------------------------------------
# Our Triton code generator: every primitive it has no rule for
# ----------------------------------------------------------------------------

@contextlib.contextmanager
def listing_unsupported(found: list[dict]) -> Iterator[None]:
    """While active, the code generator records each primitive it has no rule for
    (``{"kernel", "primitive", "where"}``) in ``found`` and writes a placeholder for
    its results instead of stopping, so one trace lists them all. The source it
    writes then is not meant to run: only :func:`check_source` uses this."""
    from pallas_core.triton import codegen
    writer = codegen.KernelWriter
    original = getattr(writer, "_equation", None)
    if original is None:  # the code generator changed shape: report its first error only
        yield
        return

    def equation(self, eqn, env):
        name = eqn.primitive.name
        if getattr(self, f"_p_{name}", None) is not None or self.table_handler(name) is not None:
            return original(self, eqn, env)
        frames = [eqn, *reversed(getattr(self, "eqn_stack", []))]
        where = next((w for w in map(getattr(codegen, "_user_frame", lambda e: ""), frames) if w), "")
        entry = {"kernel": self.call.name, "primitive": name, "where": where.strip(" ()")}
        if entry not in found:  # a kernel traced twice (two calls) lists it once
            found.append(entry)
        for var in eqn.outvars:
            aval = var.aval
            env[var] = self.assign("0", getattr(aval, "shape", ()), getattr(aval, "dtype", "float32"))

    writer._equation = equation
    try:
        yield
    finally:
        writer._equation = original


def check_source(fn: Callable, args) -> dict[str, Any]:
    """Generates the Triton source of every ``triton`` kernel in ``fn(*args)`` (traced
    only). Returns ``kernels`` (their names), ``unsupported`` (each primitive without a
    rule, with its kernel and source line) and ``error`` (any other failure, or None)."""
    from pallas_core.triton import backend
    unsupported: list[dict] = []
    error = None
    with listing_unsupported(unsupported), backend.capturing() as records:
        try:
            jax.make_jaxpr(fn)(*args)
        except Exception as e:  # noqa: BLE001 - reported, the next item goes on
            error = _error_text(e)
    return {"kernels": sorted({r["name"] for r in records}), "unsupported": unsupported,
            "error": error}


# ----------------------------------------------------------------------------
# JAX's Pallas Triton lowering, for cuda
# ----------------------------------------------------------------------------

def _jax_triton_rules():
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    return getattr(lowering, "triton_lowering_rules", None)


def unsupported_by_jax_triton(fn: Callable, args) -> list[dict]:
    """Every primitive in the Pallas kernels of ``fn(*args)`` that JAX's Triton lowering
    has no rule for (``{"kernel", "primitive"}``), nested jaxprs included."""
    rules = _jax_triton_rules()
    if rules is None:
        return []
    found: list[dict] = []

    def walk(jaxpr, kernel):
        for eqn in jaxpr.eqns:
            if eqn.primitive not in rules:
                found.append({"kernel": kernel, "primitive": eqn.primitive.name})
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, kernel)

    def find_calls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call" and "jaxpr" in eqn.params:
                info = eqn.params.get("name_and_src_info") or eqn.params.get("name")
                kernel = str(getattr(info, "name", info) or "pallas_call")
                walk(getattr(eqn.params["jaxpr"], "jaxpr", eqn.params["jaxpr"]), kernel)
                continue
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                find_calls(sub)

    find_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    return [dict(t) for t in dict.fromkeys(tuple(sorted(f.items())) for f in found)]


def check_cuda_lowering(fn: Callable, args) -> dict[str, Any]:
    """Lowers ``fn(*args)`` for ``cuda``. Returns ``error`` (None when it lowers) and, on
    failure, ``unsupported`` (:func:`unsupported_by_jax_triton`)."""
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return {"error": None, "unsupported": []}
    except Exception as e:  # noqa: BLE001 - reported, the next item goes on
        error = _error_text(e)
    try:
        unsupported = unsupported_by_jax_triton(fn, args)
    except Exception:  # noqa: BLE001 - the lowering's own error says enough
        unsupported = []
    return {"error": error, "unsupported": unsupported}


# ----------------------------------------------------------------------------
# What is checked
# ----------------------------------------------------------------------------

def _error_text(e: Exception) -> str:
    """The exception's type and message, and the innermost frame of ours it came from."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/site-packages/" not in f.filename and "/lib/python" not in f.filename
              and Path(f.filename).resolve() != Path(__file__).resolve()]
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    message = " ".join(str(e).split())[:600]
    return f"{type(e).__name__}: {message}{where}"


def op_items(quick_only: bool = True, ops_filter: str | None = None) -> list[dict]:
    """``{"item", "implementation", "call"}`` per registered op with a tuning example, GPU
    implementation and call (forward, training step); ``call`` is ``() -> (fn, args)``."""
    from ops.tuning import search
    items = []
    for op in search.tuned_ops():
        shapes = op.tuning.quick or (() if quick_only and not op.tuning.shapes else op.tuning.shapes[:1])
        if not shapes or (ops_filter and ops_filter not in op.name):
            continue
        available = getattr(op, "implementations", None) or op.configs
        for impl in (*SOURCE_IMPLEMENTATIONS, *CUDA_LOWERED_IMPLEMENTATIONS):
            if impl not in available:
                continue
            problem = search.Problem(op.name, tuple(shapes[0]), "bfloat16", impl)
            for label in ("forward", "training")[:1 if op.tuning.training is None else 2]:
                items.append({"item": f"op {problem.name} {label}", "implementation": impl,
                              "call": _op_call(problem, label)})
    return items


def _op_call(problem, label):
    def call():
        calls = {name: (fn, args) for name, fn, args in problem.compiled_calls()}
        return calls.get(label)
    return call


def case_items(filter_: str | None = None) -> list[dict]:
    """``{"item", "implementation", "call"}`` per GPU implementation of every quick
    benchmark case of the GPU suite (the XLA baseline and cuDNN left out)."""
    from benchmarks.suite import collect_cases
    items = []
    for case in collect_cases("gpu", quick=True, substring=filter_):
        for impl, fn in case.implementations.items():
            if impl in (*SOURCE_IMPLEMENTATIONS, *CUDA_LOWERED_IMPLEMENTATIONS):
                items.append({"item": f"case {case.name}", "implementation": impl,
                              "call": _case_call(case, fn)})
    return items


def _case_call(case, fn):
    return lambda: (fn, jax.eval_shape(case.make_inputs, jax.random.key(0)))


def check_item(item: dict) -> dict[str, Any]:
    """One item's verdict: ``ok``, ``kernels`` (ours), ``unsupported``, ``error``, ``seconds``."""
    start = time.perf_counter()
    try:
        call = item["call"]()
    except Exception as e:  # noqa: BLE001 - the example itself fails to build
        result = {"error": _error_text(e), "unsupported": []}
    else:
        if call is None:
            result = {"error": None, "unsupported": [], "skipped": "the op has no such call here"}
        elif item["implementation"] in SOURCE_IMPLEMENTATIONS:
            result = check_source(*call)
        else:
            result = check_cuda_lowering(*call)
    ok = result.get("error") is None and not result.get("unsupported")
    return {"item": item["item"], "implementation": item["implementation"], "ok": ok,
            **result, "seconds": round(time.perf_counter() - start, 2)}


def verdict_line(v: dict) -> str:
    """One line per verdict (more lines for each unsupported primitive)."""
    head = f"{'ok  ' if v['ok'] else 'FAIL'} {v['item']} [{v['implementation']}] {v['seconds']:.1f} s"
    if v.get("skipped"):
        return f"{head}: skipped ({v['skipped']})"
    lines = [head + (f": {len(v['kernels'])} kernel(s)" if v.get("kernels") is not None else "")]
    for u in v.get("unsupported", []):
        where = f" {u['where']}" if u.get("where") else ""
        lines.append(f"       unsupported primitive {u['primitive']!r} in kernel {u['kernel']}{where}")
    if v.get("error"):
        lines.append(f"       {v['error']}")
    return "\n".join(lines)


def summary(verdicts: list[dict]) -> list[str]:
    """The failures grouped: each unsupported primitive with every kernel it was found in."""
    by_primitive: dict[tuple[str, str], set[str]] = {}
    for v in verdicts:
        for u in v.get("unsupported", []):
            by_primitive.setdefault((v["implementation"], u["primitive"]), set()).add(u["kernel"])
    lines = [f"unsupported on {impl}: {prim!r} in {', '.join(sorted(kernels))}"
             for (impl, prim), kernels in sorted(by_primitive.items())]
    errors = [v for v in verdicts if v.get("error")]
    lines += [f"error: {v['item']} [{v['implementation']}]: {v['error']}" for v in errors]
    failed = sum(not v["ok"] for v in verdicts)
    lines.append(f"{len(verdicts) - failed} of {len(verdicts)} check(s) passed"
                 + (f", {failed} failed" if failed else ""))
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compat",
        description="Trace every kernel under this machine's JAX: generate our Triton source "
                    "(listing every primitive without a rule, per kernel) and lower JAX's "
                    "Pallas Triton path for cuda, for the registered ops and the GPU suite's "
                    "quick cases; nothing runs on a device.")
    parser.add_argument("--out", type=Path, default=None,
                        help="Folder for compat.json and compat.txt (default: print only).")
    parser.add_argument("--filter", default=None, metavar="SUBSTR",
                        help="Only ops and cases whose name contains SUBSTR.")
    parser.add_argument("--no-cases", action="store_true",
                        help="Only the registered ops' examples, not the benchmark cases.")
    parser.add_argument("--no-ops", action="store_true",
                        help="Only the benchmark cases, not the registered ops' examples.")
    parser.add_argument("--budget-s", type=checkpoint.positive_seconds, default=None,
                        metavar="SECONDS",
                        help="Start no new check after SECONDS (the report lists those not run).")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    info = {"versions": versions(), "commit": provenance.git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()), flush=True)
    print(f"commit: {info['commit'] or 'unknown'}", flush=True)
    items = ([] if args.no_ops else op_items(ops_filter=args.filter)) + (
        [] if args.no_cases else case_items(args.filter))
    jax.clear_caches()  # kernels traced before would be taken from JAX's caches, unseen
    verdicts, not_run = [], []
    out_text: list[str] = []
    budget = checkpoint.Budget(args.budget_s, start=start)
    for item in items:
        if budget.spent():
            not_run.append(f"{item['item']} [{item['implementation']}]")
            continue
        verdict = check_item(item)
        verdicts.append(verdict)
        line = verdict_line(verdict)
        out_text.append(line)
        print(line, flush=True)
        if args.out:
            _write(args.out, info, verdicts, not_run, out_text, start)
    tail = summary(verdicts) + ([f"{len(not_run)} check(s) not run (--budget-s {args.budget_s:g})"]
                                if not_run else [])
    tail.append(f"compat: {time.perf_counter() - start:.0f} s")
    for line in tail:
        print(line, flush=True)
    if args.out:
        _write(args.out, info, verdicts, not_run, out_text + [""] + tail, start)
    return 0 if all(v["ok"] for v in verdicts) else 1


def _write(out: Path, info: dict, verdicts: list[dict], not_run: list[str], text: list[str],
           start: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {**info, "seconds": round(time.perf_counter() - start, 1), "verdicts": verdicts,
            "not_run": not_run, "ok": all(v["ok"] for v in verdicts)}
    (out / "compat.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    header = [f"versions: {json.dumps(info['versions'])}", f"commit: {info['commit'] or 'unknown'}"]
    (out / "compat.txt").write_text("\n".join(header + text) + "\n")


if __name__ == "__main__":
    sys.exit(main())
