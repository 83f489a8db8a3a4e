"""Timing and measurement helpers shared by every op's benchmark cases.

An op's benchmark module describes its work as :class:`Case` objects (the
inputs, one function per implementation, a float32 reference); this module
times them (:func:`time_fn`), checks their accuracy
(:func:`max_relative_error`), measures the device's ceilings once per run
(:func:`measure_ceilings`) and turns one case into result rows
(:func:`run_case`). Units: times in ms, rates in TFLOP/s and GB/s.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BASELINE = "xla"
PASSES = ("fwd", "fwd+bwd")

# The kernel implementation each platform is benchmarked with. CPUs have no
# kernel backend, so they run our Pallas interpreter: slow by design, but it
# exercises the same kernels and catches accuracy regressions without a GPU.
_KERNEL_IMPLEMENTATION = {"gpu": "triton", "cuda": "triton", "rocm": "triton",
                          "tpu": "mosaic_tpu", "cpu": "interpret"}

# Fewer samples than this make p10/p90 meaningless; a time budget never cuts below it.
MIN_TIMED_RUNS = 3
# Calls shorter than this are batched into one timed sample (see time_fn).
MIN_SAMPLE_SECONDS = 2e-3
MAX_CALLS_PER_SAMPLE = 100

# Keys of every row that run_case returns (the results.json schema).
ROW_KEYS = ("op", "case", "variant", "shape", "dtype", "pass", "implementation", "ceiling", "median_ms",
            "p10_ms", "p90_ms", "runs", "compile_ms", "tflops", "gbps", "speedup_vs_xla",
            "fraction_of_ceiling", "max_rel_error", "error", "device_kind", "platform")
# Keys only in the rows of cases that ask for them (see Case.report_memory).
OPTIONAL_ROW_KEYS = ("peak_bytes",)


def kernel_implementation(platform: str) -> str:
    """Our kernel implementation for a JAX platform name ("cpu", "gpu", "tpu")."""
    return _KERNEL_IMPLEMENTATION.get(platform, "interpret")


# On GPUs our own Triton lowering runs beside JAX's Pallas Triton lowering of the
# same kernel source, the yardstick it must match or beat.
_GPU_IMPLEMENTATIONS = ("triton", "pallas_triton")


def kernel_implementations(platform: str) -> tuple[str, ...]:
    """Every kernel implementation benchmarked on ``platform`` (beside the XLA baseline)."""
    if platform in ("gpu", "cuda"):
        return _GPU_IMPLEMENTATIONS
    return (kernel_implementation(platform),)


def device_info(device: jax.Device | None = None) -> dict[str, str]:
    """``{"device_kind": ..., "platform": ...}`` of ``device`` (default: the first device)."""
    device = device or jax.devices()[0]
    return {"device_kind": device.device_kind, "platform": device.platform}


def random_normal(key, shape: Sequence[int], dtype, scale: float = 1.0) -> jax.Array:
    """Standard-normal values times ``scale`` in ``dtype``.

    Benchmarks never use zeros or ones: constant data can take fast paths
    (and hides indexing bugs) that real activations never hit.
    """
    return (scale * jax.random.normal(key, tuple(shape), jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmarked computation: an op, a variant, a shape, a dtype and a pass.

    Attributes:
      op: the op's public name, e.g. "fused_matmul".
      variant: what the op computes in this case, e.g. "plain", "bias+gelu_exact".
      shape: the problem's sizes, e.g. (M, K, N) for a matmul.
      dtype: the inputs' dtype name, e.g. "bfloat16".
      pass_name: "fwd" or "fwd+bwd".
      flops: floating-point operations of one call (for TFLOP/s).
      make_inputs: ``key -> tuple of arrays``, fresh random inputs for one call.
      implementations: implementation name -> un-jitted ``fn(*inputs)``; must
        hold :data:`BASELINE` ("xla"), the plain-JAX version a user would write.
      reference: ``fn(*inputs)`` computing the exact answer in float32; its
        output has the same tree structure as the implementations'.
      ceiling: which measured ceiling the case is compared to: "matmul"
        (compute-bound ops) or "copy" (memory-bound ops).
      bytes_accessed: bytes one call must read and write, for GB/s; None when
        not meaningful.
      report_memory: add ``peak_bytes`` to this case's rows: the compiled
        executable's temporary plus output buffer bytes
        (:func:`compiled_peak_bytes`), for ops whose point is memory (e.g. a
        loss that never materialises its logits). Off by default, so rows of
        other cases keep exactly :data:`ROW_KEYS`.
    """
    op: str
    variant: str
    shape: tuple[int, ...]
    dtype: str
    pass_name: str
    flops: float
    make_inputs: Callable[[jax.Array], tuple]
    implementations: Mapping[str, Callable]
    reference: Callable
    ceiling: str = "matmul"
    bytes_accessed: float | None = None
    report_memory: bool = False

    @property
    def name(self) -> str:
        """Unique, filterable: ``op/variant/AxBxC/dtype/pass``."""
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.op}/{self.variant}/{dims}/{self.dtype}/{self.pass_name}"


def compile_fn(fn: Callable, *args) -> Callable:
    """``fn`` jitted and compiled ahead of time for ``args``' shapes and dtypes."""
    return jax.jit(fn).lower(*args).compile()


def compiled_peak_bytes(compiled) -> int | None:
    """Device memory a compiled executable needs beyond its arguments: temporary
    plus output buffer bytes from XLA's ``memory_analysis()``; None where the
    platform does not report it."""
    try:
        stats = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes)


def _stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()),
            "mean_ms": float(ms.mean()), "runs": int(ms.size)}


def time_fn(fn: Callable, *args, warmup: int = 3, iters: int = 20,
            max_seconds: float | None = None) -> dict[str, Any]:
    """Wall-clock time of one ``fn(*args)`` call in ms, after compiling and warming up.

    ``fn`` is jitted and compiled first (:func:`compile_fn`), called once for
    its output, then ``warmup`` more times untimed, then timed in up to
    ``iters`` samples. A sample ends with ``jax.block_until_ready`` so that the
    device's work is counted, not just its dispatch. Dispatching and syncing
    cost tens of microseconds, which would inflate sub-millisecond kernels, so
    a sample queues enough calls back to back to last about
    :data:`MIN_SAMPLE_SECONDS` and reports the time per call.

    Args:
      warmup: untimed calls after the first.
      iters: timed samples (at most).
      max_seconds: optional budget for the timed samples; timing stops once
        it is spent, after at least :data:`MIN_TIMED_RUNS` samples.

    Returns:
      ``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``mean_ms`` (ms per
      call), ``runs`` (timed samples), ``calls_per_sample``, ``compile_ms``
      (ms to trace and compile), ``peak_bytes`` (:func:`compiled_peak_bytes`)
      and ``output`` (the first call's result, for accuracy checks).
    """
    start = time.perf_counter()
    call = compile_fn(fn, *args)
    compile_ms = (time.perf_counter() - start) * 1e3
    output = jax.block_until_ready(call(*args))
    for _ in range(warmup):
        jax.block_until_ready(call(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(call(*args))
    one_call = time.perf_counter() - t0
    calls_per_sample = int(min(MAX_CALLS_PER_SAMPLE, max(1, MIN_SAMPLE_SECONDS // one_call)))

    seconds: list[float] = []
    budget_start = time.perf_counter()
    for _ in range(max(iters, 1)):
        t0 = time.perf_counter()
        for _ in range(calls_per_sample):
            result = call(*args)
        jax.block_until_ready(result)
        seconds.append((time.perf_counter() - t0) / calls_per_sample)
        over_budget = max_seconds is not None and time.perf_counter() - budget_start > max_seconds
        if over_budget and len(seconds) >= MIN_TIMED_RUNS:
            break
    return {**_stats_ms(seconds), "calls_per_sample": calls_per_sample, "compile_ms": compile_ms,
            "peak_bytes": compiled_peak_bytes(call), "output": output}


def max_relative_error(output, reference) -> float:
    """``max |output - reference| / max |reference|``, worst over the trees' leaves.

    Normalising by the largest reference magnitude (not elementwise) keeps
    values near zero, where a low-precision dtype's relative error is
    meaningless, from dominating. NaN or inf in ``output`` gives NaN / inf.
    """
    out_leaves = jax.tree.leaves(output)
    ref_leaves = jax.tree.leaves(reference)
    if len(out_leaves) != len(ref_leaves):
        raise ValueError(f"output has {len(out_leaves)} leaves, reference {len(ref_leaves)}.")
    worst = 0.0
    for o, r in zip(out_leaves, ref_leaves):
        r = jnp.asarray(r, jnp.float32)
        err = float(jnp.max(jnp.abs(jnp.asarray(o, jnp.float32) - r)))
        scale = float(jnp.max(jnp.abs(r)))
        rel = err / scale if scale > 0 else err
        if math.isnan(rel):
            return rel
        worst = max(worst, rel)
    return worst


def measure_ceilings(device: jax.Device | None = None, *, iters: int = 20) -> dict[str, Any]:
    """The device's measured copy bandwidth (GB/s) and large-matmul rate (TFLOP/s).

    Copy: ``a + 1`` over a large float32 array (an elementwise op, so XLA
    cannot elide it), counting the bytes read plus the bytes written. Matmul:
    an ``n x n x n`` product in bfloat16 on accelerators (their peak dtype),
    float32 on CPU. Sizes suit the platform; on CPU each takes well under a
    second. A ceiling is what the device can do, so each uses its fastest
    run, not the median: a busy host must not lower it. These are what
    "fraction of ceiling" in results is relative to.
    """
    device = device or jax.devices()[0]
    on_cpu = device.platform == "cpu"
    copy_elems = (16 if on_cpu else 256) * 2**20  # 64 MiB on CPU, 1 GiB elsewhere
    n = 1024 if on_cpu else 8192
    mm_dtype = jnp.float32 if on_cpu else jnp.bfloat16
    k_copy, k_a, k_b = jax.random.split(jax.random.key(1234), 3)

    src = jax.device_put(random_normal(k_copy, (copy_elems,), jnp.float32), device)
    copy = time_fn(lambda a: a + 1, src, warmup=2, iters=iters)
    copy_bytes = 2 * src.nbytes
    del src, copy["output"]

    a = jax.device_put(random_normal(k_a, (n, n), mm_dtype), device)
    b = jax.device_put(random_normal(k_b, (n, n), mm_dtype), device)
    matmul = time_fn(jnp.dot, a, b, warmup=2, iters=iters)
    del a, b, matmul["output"]
    return {
        "copy_gbps": copy_bytes / (copy["min_ms"] * 1e-3) / 1e9,
        "copy_bytes": copy_bytes,
        "matmul_tflops": 2 * n**3 / (matmul["min_ms"] * 1e-3) / 1e12,
        "matmul_shape": [n, n, n],
        "matmul_dtype": jnp.dtype(mm_dtype).name,
    }


def run_case(case: Case, *, key, ceilings: Mapping[str, Any], warmup: int, iters: int,
             max_seconds: float | None = None,
             device: jax.Device | None = None) -> list[dict[str, Any]]:
    """Times every implementation of ``case``; one row (dict) per implementation.

    Each row has the keys in :data:`ROW_KEYS`: the case's identity (op, case,
    variant, shape, dtype, pass, implementation), the ceiling it is bound by
    ("matmul": compute-bound, rated in TFLOP/s; "copy": memory-bound, GB/s), timing (median_ms, p10_ms,
    p90_ms in ms; runs; compile_ms), tflops (TFLOP/s), gbps (GB/s, None unless
    the case counts bytes), speedup_vs_xla (the baseline's median over this
    row's; 1.0 for the baseline), fraction_of_ceiling (of the case's measured
    ceiling), max_rel_error (vs the float32 reference), error (None, or why
    the implementation failed: a failure is recorded rather than raised so
    that one broken kernel does not lose a long run), device_kind and platform.
    Rows of a case with ``report_memory`` also have ``peak_bytes``.
    """
    inputs = case.make_inputs(key)
    reference = jax.jit(case.reference)(*inputs)
    base = {"op": case.op, "case": case.name, "variant": case.variant, "shape": list(case.shape),
            "dtype": case.dtype, "pass": case.pass_name, "ceiling": case.ceiling,
            **device_info(device)}
    rows, baseline_ms = [], None
    for impl_name, fn in _baseline_first(case.implementations):
        row = {**dict.fromkeys(ROW_KEYS), **base, "implementation": impl_name}
        if case.report_memory:
            row["peak_bytes"] = None
        try:
            timing = time_fn(fn, *inputs, warmup=warmup, iters=iters, max_seconds=max_seconds)
        except Exception as e:  # noqa: BLE001 - recorded in the row, reported, exit code 1
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            rows.append(row)
            continue
        seconds = timing["median_ms"] * 1e-3
        if impl_name == BASELINE:
            baseline_ms = timing["median_ms"]
        tflops = case.flops / seconds / 1e12
        gbps = case.bytes_accessed / seconds / 1e9 if case.bytes_accessed else None
        if case.ceiling == "matmul":
            achieved, ceiling = tflops, ceilings.get("matmul_tflops")
        else:
            achieved, ceiling = gbps, ceilings.get("copy_gbps")
        row.update({field: timing[field] for field in ("median_ms", "p10_ms", "p90_ms", "runs",
                                                     "compile_ms")})
        if case.report_memory:
            row["peak_bytes"] = timing["peak_bytes"]
        row.update({
            "tflops": tflops,
            "gbps": gbps,
            "speedup_vs_xla": baseline_ms / timing["median_ms"] if baseline_ms else None,
            "fraction_of_ceiling": achieved / ceiling if achieved and ceiling else None,
            "max_rel_error": max_relative_error(timing["output"], reference),
        })
        rows.append(row)
    return rows


def _baseline_first(implementations: Mapping[str, Callable]):
    if BASELINE not in implementations:
        raise ValueError(f"a case must include the {BASELINE!r} baseline implementation, got "
                         f"{sorted(implementations)}.")
    yield BASELINE, implementations[BASELINE]
    yield from ((k, v) for k, v in implementations.items() if k != BASELINE)


def forward_and_backward(fn, *, nondiff: int = 0):
    """``(*primals, *passed, cotangent) -> (out, grads)``: a training step's work for ``fn``.

    The last ``nondiff`` arguments before the cotangent (labels, say) are
    passed to ``fn`` undifferentiated. The forward output is returned too, so
    no compiler can drop the forward pass when the gradients alone would not
    need it (a plain matmul).
    """
    def fwd_bwd(*args):
        *rest, cotangent = args
        split = len(rest) - nondiff
        primals, passed = rest[:split], rest[split:]
        out, pullback = jax.vjp(lambda *p: fn(*p, *passed), *primals)
        return out, pullback(cotangent.astype(out.dtype))
    return fwd_bwd


def pick_shapes(platform: str, quick: bool, *, cpu, accelerator, quick_shapes):
    """The shapes for ``platform``: tiny on CPUs (they run the interpreter), real elsewhere.

    ``quick_shapes`` maps "cpu" / "accelerator" to the one-case smoke-test sets.
    """
    kind = "cpu" if platform == "cpu" else "accelerator"
    if quick:
        return quick_shapes[kind]
    return cpu if kind == "cpu" else accelerator
