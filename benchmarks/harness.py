"""Timing and measurement helpers shared by every op's benchmark cases.

An op's benchmark module describes its work as :class:`Case` objects (the
inputs, one function per implementation, an exact reference run in float64
by :func:`reference_output`); this module times them (:func:`time_fn`),
checks their accuracy (:func:`max_relative_error`), measures the device's
ceilings (:func:`measure_ceilings`, and :func:`copy_gbps` at each
memory-bound case's own size) and turns one case into result rows: timed
(:func:`run_case`) or, on a host whose implementations are interpreters,
accuracy only (:func:`check_case`). Units: times in ms, rates in TFLOP/s
and GB/s.

A case's fixed cost (everything but its timed samples) is kept small, since a
lent GPU's minutes are few: every implementation and the float64 reference
are compiled at once in threads (:func:`prepare_case`; XLA's and Triton's
compilers release the GIL), the reference runs once per case and stays on
the device, errors are reduced on the device (no host copy of the outputs),
and the first call doubles as the first warm-up. :class:`StepTimes` records
the seconds of each step (inputs, compile, reference, check, warm-up,
timing), which the CLI prints per case.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_core.backends import BACKENDS

BASELINE = "xla"
PASSES = ("fwd", "fwd+bwd")

# The kernel implementation each platform is benchmarked with. CPUs have no
# kernel backend, so they run our Pallas interpreter: slow by design, but it
# exercises the same kernels and catches accuracy regressions without a GPU
# (and, where triton is installed, our Triton lowering in Triton's CPU
# interpreter: see kernel_implementations).
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
            "vs_best_other", "ceiling_rate", "cache_resident", "fraction_of_ceiling", "max_rel_error", "peak_bytes",
            "error", "device_kind", "platform")
# Keys only in the rows of cases that ask for them; none today (peak_bytes is in every row).
OPTIONAL_ROW_KEYS = ()
# Keys of every row that check_case returns (accuracy only, nothing timed).
ACCURACY_ROW_KEYS = ("op", "case", "variant", "shape", "dtype", "pass", "implementation", "ceiling",
                     "max_rel_error", "error", "device_kind", "platform")


def kernel_implementation(platform: str) -> str:
    """Our kernel implementation for a JAX platform name ("cpu", "gpu", "tpu")."""
    return _KERNEL_IMPLEMENTATION.get(platform, "interpret")


# On GPUs our own Triton lowering runs beside JAX's Pallas Triton lowering of the
# same kernel source, the yardstick it must match or beat.
_GPU_IMPLEMENTATIONS = ("triton", "pallas_triton")


def kernel_implementations(platform: str) -> tuple[str, ...]:
    """Every kernel implementation benchmarked on ``platform`` (beside the XLA baseline).

    GPUs: ``triton`` and ``pallas_triton``. CPUs: ``interpret`` and, when
    triton and torch are installed (the ``bench`` extra), ``triton``, which
    runs our Triton lowering in Triton's CPU interpreter: the GPU kernels'
    generated code, checked for accuracy without a GPU.
    """
    if platform in ("gpu", "cuda"):
        return _GPU_IMPLEMENTATIONS
    if platform == "cpu" and triton_available():
        return ("interpret", "triton")
    return (kernel_implementation(platform),)


_TRITON_MODULES = ("triton", "torch")
# What to install for them, as the README's set-up says.
TRITON_INSTALL_HINT = ('pip install -e ".[bench]" (it brings triton and torch; for a CPU-only '
                       "torch add --extra-index-url https://download.pytorch.org/whl/cpu)")


def triton_available() -> bool:
    """Whether triton and torch (Triton's CPU interpreter's tensors) can be imported."""
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in _TRITON_MODULES)


def require_triton(what: str) -> None:
    """Raises ModuleNotFoundError, naming the extra to install, unless triton and torch
    can be imported: ``what`` (a command or module) needs Triton's compiler or its CPU
    interpreter."""
    import importlib.util
    missing = [m for m in _TRITON_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"{what} needs {' and '.join(missing)} (Triton's compiler and its CPU interpreter, "
            f"which runs on torch tensors): {TRITON_INSTALL_HINT}.", name=missing[0])


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
      reference: ``fn(*inputs)`` computing the exact answer, every float
        input upcast with :func:`upcast` (float64 in :func:`reference_output`);
        its output has the same tree structure as the implementations'.
      ceiling: which measured ceiling the case is compared to: "matmul"
        (compute-bound ops) or "copy" (memory-bound ops).
      bytes_accessed: bytes one call must read and write, for GB/s; None when
        not meaningful.
      report_memory: the op's point is memory (e.g. a loss that never
        materialises its logits): ``python -m benchmarks.attention_memory``
        and the figure single these out. Every timed row reports
        ``peak_bytes`` regardless.
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


def upcast(x):
    """``x`` in the references' dtype: float64 while :func:`reference_output` runs
    (JAX's x64 mode), float32 otherwise; integer arrays (labels) unchanged."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


def _wide(x) -> jax.ShapeDtypeStruct:
    """The reference's argument spec for input ``x``: float64 for a floating input."""
    dtype = jnp.float64 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    return jax.ShapeDtypeStruct(x.shape, dtype)


def compile_reference(case: "Case", inputs: tuple):
    """``case.reference`` compiled for ``inputs`` in float64 (JAX's x64 mode, for this
    compile only). Run it with :func:`run_reference`."""
    with jax.enable_x64(True):
        return compile_fn(case.reference, *(_wide(x) for x in inputs))


def run_reference(compiled, inputs: tuple):
    """A compiled reference (:func:`compile_reference`) on ``inputs`` upcast to float64;
    its outputs stay on the device (compare them with :func:`max_relative_error`)."""
    with jax.enable_x64(True):
        wide = tuple(jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating)
                     else jnp.asarray(x) for x in inputs)
        return jax.block_until_ready(compiled(*wide))


def reference_output(case: "Case", inputs: tuple):
    """``case.reference`` on ``inputs`` in float64, as numpy arrays.

    The references upcast with :func:`upcast`, so under JAX's x64 mode (on
    here, for this call only) every product and sum is float64: the errors
    reported against it are the implementations' own, not float32's.
    """
    out = run_reference(compile_reference(case, inputs), inputs)
    return jax.tree.map(lambda a: np.asarray(a, np.float64), out)


def compile_fn(fn: Callable, *args) -> Callable:
    """``fn`` jitted and compiled ahead of time for ``args``' shapes and dtypes."""
    return jax.jit(fn).lower(*args).compile()


def compile_workers() -> int:
    """Threads :func:`prepare_case` compiles in: ``$PALLAS_KERNELS_COMPILE_WORKERS``, else
    the host's cores (at most 8)."""
    text = os.environ.get("PALLAS_KERNELS_COMPILE_WORKERS", "")
    if text.strip():
        return max(1, int(text))
    return max(1, min(8, os.cpu_count() or 1))


class StepTimes:
    """Seconds spent in each step of one case, for the run's log and results.json.

    Steps: ``inputs`` (the random inputs), ``compile`` (every implementation and
    the reference: the parallel compile's wall time beyond the inputs' drawn
    meanwhile; each one's own seconds in :attr:`compiles`), ``reference`` (its float64 run), ``check`` (each
    implementation's first call and its error), ``warm-up`` and ``timing``
    (the timed samples), and ``ceiling`` (a memory-bound case's copy of its own
    bytes, :func:`copy_gbps`, measured once per size). Everything but
    ``timing`` is the case's fixed cost.
    """

    ORDER = ("inputs", "compile", "reference", "ceiling", "check", "warm-up", "timing")

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.compiles: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def fixed_seconds(self) -> float:
        """Everything but the timed samples."""
        return sum(v for k, v in self.seconds.items() if k != "timing")

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "compiles": {k: round(v, 3) for k, v in self.compiles.items()},
                "fixed_s": round(self.fixed_seconds, 3)}

    def summary(self) -> str:
        """One line: each step's seconds in order, the compiles per implementation."""
        parts = [f"{name} {self.seconds[name]:.1f}" for name in self.ORDER if name in self.seconds]
        compiles = ", ".join(f"{k} {v:.1f}" for k, v in self.compiles.items())
        return (f"{'; '.join(parts)} s (fixed {self.fixed_seconds:.1f} s"
                + (f"; compiles in parallel: {compiles}" if compiles else "") + ")")


@dataclasses.dataclass
class Prepared:
    """A case ready to run: its inputs, each implementation compiled (or the exception
    its compile raised), and the reference's outputs on the device (or its exception)."""
    inputs: tuple
    compiled: dict[str, Any]
    reference: Any


def _timed_compile(fn: Callable, args) -> tuple[Any, float]:
    start = time.perf_counter()
    try:
        return fn(*args), time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - returned, recorded in the implementation's row
        return e, time.perf_counter() - start


def prepare_case(case: "Case", key, steps: StepTimes | None = None,
                 workers: int | None = None) -> Prepared:
    """Makes ``case``'s inputs from ``key``, compiles every implementation and the float64
    reference in threads meanwhile, then runs the reference once.

    Tracing is Python (one thread at a time), but XLA's compiles, Triton's passes and
    ptxas release the GIL, so five implementations compile in little more than the
    slowest one's time; they compile for the inputs' shapes
    (``jax.eval_shape(case.make_inputs)``) while the inputs are drawn. Each thread
    runs in a copy of the caller's context (contextvars: a tuning-cache override,
    ``pallas_core.triton.enable_tma``), so it traces what the caller would. A
    compile that fails in a thread is tried again in this one before its
    exception is kept (a failure of threading never reads as the kernel's).
    Compiles only touch the device to autotune; the reference runs after them,
    before anything is timed.

    Raises:
      ValueError: the case has no :data:`BASELINE` implementation.
    """
    next(baseline_first(case.implementations))  # no baseline: raised before any compile
    steps = steps if steps is not None else StepTimes()
    workers = workers or compile_workers()
    inputs = None

    def draw() -> float:
        nonlocal inputs
        start = time.perf_counter()
        inputs = jax.block_until_ready(case.make_inputs(key))
        steps.add("inputs", time.perf_counter() - start)
        return time.perf_counter() - start

    try:
        specs = jax.eval_shape(case.make_inputs, key)
    except Exception:  # noqa: BLE001 - inputs made outside JAX's tracing: draw them first
        draw()
        specs = inputs
    tasks = {name: (compile_fn, (fn, *specs)) for name, fn in case.implementations.items()}
    tasks[_REFERENCE] = (compile_reference, (case, specs))
    start, drawing = time.perf_counter(), 0.0
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(min(workers, len(tasks))) as pool:
            futures = {name: pool.submit(contextvars.copy_context().run, _timed_compile, fn, args)
                       for name, (fn, args) in tasks.items()}
            if inputs is None:
                drawing = draw()
            results = {name: future.result() for name, future in futures.items()}
    else:
        results = {name: _timed_compile(fn, args) for name, (fn, args) in tasks.items()}
        if inputs is None:
            drawing = draw()
    steps.add("compile", time.perf_counter() - start - drawing)
    for name, (out, _) in results.items():
        if isinstance(out, Exception) and workers > 1:  # again alone: a real failure fails again
            with steps.step("compile"):
                results[name] = _timed_compile(*tasks[name])
    steps.compiles.update({name: seconds for name, (_, seconds) in results.items()})
    compiled = {name: out for name, (out, _) in results.items() if name != _REFERENCE}
    reference, _ = results[_REFERENCE]
    if not isinstance(reference, Exception):
        with steps.step("reference"):
            try:
                reference = run_reference(reference, inputs)
            except Exception as e:  # noqa: BLE001 - every row reports it
                reference = e
    return Prepared(inputs, compiled, reference)


_REFERENCE = "reference (float64)"


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
    its output, then timed by :func:`time_compiled` (``warmup`` more untimed
    calls, then up to ``iters`` samples).

    Returns:
      :func:`time_compiled`'s fields, ``compile_ms`` (ms to trace and compile),
      ``peak_bytes`` (:func:`compiled_peak_bytes`) and ``output`` (the first
      call's result, for accuracy checks).
    """
    start = time.perf_counter()
    call = compile_fn(fn, *args)
    compile_ms = (time.perf_counter() - start) * 1e3
    output = jax.block_until_ready(call(*args))
    return {**time_compiled(call, *args, warmup=warmup, iters=iters, max_seconds=max_seconds),
            "compile_ms": compile_ms, "peak_bytes": compiled_peak_bytes(call), "output": output}


def time_compiled(call: Callable, *args, warmup: int = 3, iters: int = 20,
                  max_seconds: float | None = None, steps: StepTimes | None = None
                  ) -> dict[str, Any]:
    """Wall-clock time of one call of a compiled ``call(*args)`` in ms, once it has run once.

    ``warmup`` untimed calls, then up to ``iters`` timed samples. A sample ends
    with ``jax.block_until_ready`` so that the device's work is counted, not
    just its dispatch. Dispatching and syncing cost tens of microseconds, which
    would inflate sub-millisecond kernels, so a sample queues enough calls back
    to back to last about :data:`MIN_SAMPLE_SECONDS` and reports the time per
    call (the one call that measures how many is the last warm-up).

    Args:
      warmup: untimed calls (after the first call, made by the caller).
      iters: timed samples (at most).
      max_seconds: optional budget for the timed samples; timing stops once
        it is spent, after at least :data:`MIN_TIMED_RUNS` samples.
      steps: where the ``warm-up`` and ``timing`` seconds are added, if given.

    Returns:
      ``median_ms``, ``p10_ms``, ``p90_ms``, ``min_ms``, ``mean_ms`` (ms per
      call), ``runs`` (timed samples) and ``calls_per_sample``.
    """
    steps = steps if steps is not None else StepTimes()
    with steps.step("warm-up"):
        for _ in range(warmup):
            jax.block_until_ready(call(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(call(*args))
        one_call = time.perf_counter() - t0
    calls_per_sample = int(min(MAX_CALLS_PER_SAMPLE, max(1, MIN_SAMPLE_SECONDS // one_call)))

    seconds: list[float] = []
    with steps.step("timing"):
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
    return {**_stats_ms(seconds), "calls_per_sample": calls_per_sample}


@functools.partial(jax.jit, inline=False)
def _error_terms(output, reference):
    """``(max |output - reference|, max |reference|)`` in float64 (traced under x64)."""
    reference = reference.astype(jnp.float64)
    return (jnp.max(jnp.abs(output.astype(jnp.float64) - reference)),
            jnp.max(jnp.abs(reference)))


def max_relative_error(output, reference) -> float:
    """``max |output - reference| / max |reference|``, worst over the trees' leaves.

    Normalising by the largest reference magnitude (not elementwise) keeps
    values near zero, where a low-precision dtype's relative error is
    meaningless, from dominating. NaN or inf in ``output`` gives NaN / inf.
    Reduced in float64 where the arrays are (on the device for a device
    reference: only two scalars per leaf reach the host).
    """
    out_leaves = jax.tree.leaves(output)
    ref_leaves = jax.tree.leaves(reference)
    if len(out_leaves) != len(ref_leaves):
        raise ValueError(f"output has {len(out_leaves)} leaves, reference {len(ref_leaves)}.")
    worst = 0.0
    with jax.enable_x64(True):
        for o, r in zip(out_leaves, ref_leaves):
            if np.size(r) == 0:
                continue
            err, scale = (float(t) for t in _error_terms(jnp.asarray(o), jnp.asarray(r)))
            rel = err / scale if scale > 0 else err
            if math.isnan(rel):
                return rel
            worst = max(worst, rel)
    return worst


def measure_ceilings(device: jax.Device | None = None, *, iters: int = 20) -> dict[str, Any]:
    """The device's measured copy bandwidth (GB/s) and large-matmul rate (TFLOP/s).

    Copy: :func:`copy_gbps` over a large array (64 MiB of traffic on CPU, 2
    GiB elsewhere), the figure a run's header quotes; each memory-bound case is
    compared with a copy measured at its own traffic instead (see
    :func:`run_case`). Matmul: an ``n x n x n`` product in bfloat16 on
    accelerators (their peak dtype), float32 on CPU. A ceiling is what the
    device can do, so each uses its fastest run, not the median: a busy host
    must not lower it. ``last_level_cache_bytes`` (:func:`last_level_cache_bytes`)
    is recorded beside them.
    """
    device = device or jax.devices()[0]
    on_cpu = device.platform == "cpu"
    copy_bytes = (64 if on_cpu else 2048) * 2**20
    n = 1024 if on_cpu else 8192
    mm_dtype = jnp.float32 if on_cpu else jnp.bfloat16
    k_a, k_b = jax.random.split(jax.random.key(1234))
    copy = copy_gbps(copy_bytes, device, iters=iters)

    a = jax.device_put(random_normal(k_a, (n, n), mm_dtype), device)
    b = jax.device_put(random_normal(k_b, (n, n), mm_dtype), device)
    matmul = time_fn(jnp.dot, a, b, warmup=2, iters=iters)
    del a, b, matmul["output"]
    return {
        "copy_gbps": copy,
        "copy_bytes": copy_bytes,
        "matmul_tflops": 2 * n**3 / (matmul["min_ms"] * 1e-3) / 1e12,
        "matmul_shape": [n, n, n],
        "matmul_dtype": jnp.dtype(mm_dtype).name,
        "last_level_cache_bytes": last_level_cache_bytes(device),
    }


_COPY_GBPS: dict[tuple[int, int], float] = {}


def copy_gbps(traffic_bytes: float, device: jax.Device | None = None, *, iters: int = 20) -> float:
    """Measured bandwidth of a copy moving ``traffic_bytes`` (read plus write), in GB/s.

    The copy is ``a + 1`` over a float32 array of ``traffic_bytes / 8``
    elements (at least 1024): an elementwise op, so no compiler can elide it,
    reading and writing ``traffic_bytes / 2`` each. Measured at a case's own
    traffic, it is the ceiling that case can reach: a small case whose data
    stays in a cache is compared with a copy that stays there too. Fastest of
    the timed samples; cached per size and device for the run.
    """
    device = device or jax.devices()[0]
    elems = max(1024, int(traffic_bytes // 8))
    key = (device.id, elems)
    if key not in _COPY_GBPS:
        src = jax.device_put(random_normal(jax.random.key(elems), (elems,), jnp.float32), device)
        timing = time_fn(lambda a: a + 1, src, warmup=2, iters=iters)
        _COPY_GBPS[key] = 2 * src.nbytes / (timing["min_ms"] * 1e-3) / 1e9
    return _COPY_GBPS[key]


# Last-level (L2) cache of the GPUs we benchmark on, by a substring of their
# device kind, from NVIDIA's architecture whitepapers: Hopper (H100 / H200 /
# H800) 50 MiB, Ampere A100 40 MiB, Ada L4 48 MiB.
_GPU_L2_BYTES = {"H100": 50 * 2**20, "H200": 50 * 2**20, "H800": 50 * 2**20,
                 "A100": 40 * 2**20, "L4": 48 * 2**20}


def last_level_cache_bytes(device: jax.Device | None = None) -> int | None:
    """Size of the device's last-level cache in bytes, None where unknown.

    CPUs: the largest cache Linux lists for CPU 0 (``/sys/devices/system/cpu/
    cpu0/cache``). GPUs: the L2 of the kinds in a small table (H100, H200,
    H800, A100, L4). A memory-bound case whose traffic fits in it is marked
    ``cache_resident``: repeated timed calls then read from the cache, not
    from memory, and no fraction of a memory ceiling is claimed for it.
    """
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        sizes = []
        for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
            text = path.read_text().strip().upper()
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            digits = text.rstrip("KMG")
            if digits.isdigit():
                sizes.append(int(digits) * unit)
        return max(sizes, default=None)
    return next((size for name, size in _GPU_L2_BYTES.items() if name in device.device_kind), None)


def rate_against_ceiling(case: Case, seconds: float, ceilings: Mapping[str, Any],
                         device: jax.Device | None = None) -> dict[str, Any]:
    """A timed case's rates and how they compare with its ceiling.

    Returns ``tflops``, ``gbps`` (None unless the case counts bytes),
    ``ceiling_rate`` (TFLOP/s of the measured matmul ceiling for
    compute-bound cases; for memory-bound ones GB/s of :func:`copy_gbps` at
    the case's own ``bytes_accessed``), ``cache_resident`` (memory-bound
    cases: the traffic fits in the last-level cache; None where unknown or
    compute-bound) and ``fraction_of_ceiling`` (achieved over ceiling_rate;
    None for cache-resident cases).
    """
    tflops = case.flops / seconds / 1e12
    gbps = case.bytes_accessed / seconds / 1e9 if case.bytes_accessed else None
    resident = None
    if case.ceiling == "matmul":
        achieved, ceiling = tflops, ceilings.get("matmul_tflops")
    else:
        achieved = gbps
        ceiling = copy_gbps(case.bytes_accessed, device) if case.bytes_accessed else None
        cache = ceilings.get("last_level_cache_bytes")
        resident = None if not (cache and case.bytes_accessed) else case.bytes_accessed <= cache
    fraction = achieved / ceiling if achieved and ceiling and not resident else None
    return {"tflops": tflops, "gbps": gbps, "ceiling_rate": ceiling, "cache_resident": resident,
            "fraction_of_ceiling": fraction}


def _identity(case: Case, device: jax.Device | None) -> dict[str, Any]:
    """The fields naming a case in its rows: op, case, variant, shape, dtype, pass, ceiling,
    device_kind, platform."""
    return {"op": case.op, "case": case.name, "variant": case.variant, "shape": list(case.shape),
            "dtype": case.dtype, "pass": case.pass_name, "ceiling": case.ceiling,
            **device_info(device)}


def _error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def run_case(case: Case, *, key, ceilings: Mapping[str, Any], warmup: int, iters: int,
             max_seconds: float | None = None, device: jax.Device | None = None,
             steps: StepTimes | None = None, workers: int | None = None) -> list[dict[str, Any]]:
    """Times every implementation of ``case``; one row (dict) per implementation.

    Each row has the keys in :data:`ROW_KEYS`: the case's identity (op, case,
    variant, shape, dtype, pass, implementation), the ceiling it is bound by
    ("matmul": compute-bound, rated in TFLOP/s; "copy": memory-bound, GB/s),
    timing (median_ms, p10_ms, p90_ms in ms; runs; compile_ms, of the
    implementation's own compile in the parallel compile), the rates and
    their ceiling (:func:`rate_against_ceiling`: tflops, gbps, ceiling_rate,
    cache_resident, fraction_of_ceiling), speedup_vs_xla (the baseline's
    median over this row's; 1.0 for the baseline), vs_best_other (ours against
    the fastest implementation of the case that is not ours,
    :func:`vs_best_other`), max_rel_error (vs the
    float64 reference, :func:`prepare_case`), peak_bytes (the compiled
    executable's temporary plus output bytes, :func:`compiled_peak_bytes`),
    error (None, or why the implementation failed: a failure is recorded
    rather than raised so that one broken kernel does not lose a long run),
    device_kind and platform.

    The implementations and the reference compile at once (:func:`prepare_case`,
    ``workers`` threads, ``key`` drawing the inputs); then each implementation in turn (the baseline
    first) is called once, checked against the reference, warmed up
    ``warmup - 1`` more times and timed (:func:`time_compiled`). ``steps``
    receives each step's seconds.
    """
    steps = steps if steps is not None else StepTimes()
    prepared = prepare_case(case, key, steps, workers)
    if case.ceiling == "copy" and case.bytes_accessed:
        with steps.step("ceiling"):  # a copy of the case's bytes, measured once per size
            copy_gbps(case.bytes_accessed, device)
    base = _identity(case, device)
    rows, baseline_ms = [], None
    for impl_name, call in baseline_first(prepared.compiled):
        row = {**dict.fromkeys(ROW_KEYS), **base, "implementation": impl_name,
               "compile_ms": steps.compiles.get(impl_name, 0.0) * 1e3}
        try:
            row["max_rel_error"] = check_implementation(call, prepared, steps)
            timing = time_compiled(call, *prepared.inputs, warmup=max(0, warmup - 1), iters=iters,
                                   max_seconds=max_seconds, steps=steps)
        except Exception as e:  # noqa: BLE001 - recorded in the row, reported, exit code 1
            row["error"] = _error_text(e)
            rows.append(row)
            continue
        if impl_name == BASELINE:
            baseline_ms = timing["median_ms"]
        row.update({field: timing[field] for field in ("median_ms", "p10_ms", "p90_ms", "runs")})
        row["peak_bytes"] = compiled_peak_bytes(call)
        row.update(rate_against_ceiling(case, timing["median_ms"] * 1e-3, ceilings, device))
        row["speedup_vs_xla"] = baseline_ms / timing["median_ms"] if baseline_ms else None
        rows.append(row)
    for row, ratio in zip(rows, vs_best_other(rows)):
        row["vs_best_other"] = ratio
    return rows


def ours(implementation: str) -> bool:
    """Whether an implementation runs this project's kernels (a pallas_core backend); the
    others (xla, cudnn, jax_pallas, ...) are what a user has without us."""
    return implementation in BACKENDS


def vs_best_other(rows: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """Per row of one case: for ours (:func:`ours`), the fastest timed other
    implementation's median over this row's (above 1: ours is faster); None for the
    others, for untimed or failed rows and where nothing else was timed."""
    others = [r["median_ms"] for r in rows if not ours(r["implementation"])
              and r.get("median_ms") and not r.get("error")]
    best = min(others, default=None)
    return [best / r["median_ms"] if best and ours(r["implementation"]) and r.get("median_ms")
            and not r.get("error") else None for r in rows]


def check_case(case: Case, *, key, device: jax.Device | None = None,
               steps: StepTimes | None = None, workers: int | None = None) -> list[dict[str, Any]]:
    """Runs every implementation of ``case`` once; one accuracy row per implementation.

    Nothing is timed: on a host whose implementations are interpreters a time
    says nothing about the kernels. Each row has the keys in
    :data:`ACCURACY_ROW_KEYS`; ``max_rel_error`` is against the float64
    reference (:func:`prepare_case`) and ``error`` is None or why the
    implementation failed (recorded, not raised, as in :func:`run_case`).
    """
    steps = steps if steps is not None else StepTimes()
    prepared = prepare_case(case, key, steps, workers)
    base = _identity(case, device)
    rows = []
    for impl_name, call in baseline_first(prepared.compiled):
        row = {**dict.fromkeys(ACCURACY_ROW_KEYS), **base, "implementation": impl_name}
        try:
            row["max_rel_error"] = check_implementation(call, prepared, steps)
        except Exception as e:  # noqa: BLE001 - recorded in the row, reported, exit code 1
            row["error"] = _error_text(e)
        rows.append(row)
    return rows


def check_implementation(call, prepared: Prepared, steps: StepTimes) -> float:
    """A prepared implementation's first call (``call``: compiled, or the exception its
    compile raised, re-raised here) and its :func:`max_relative_error` against the
    prepared reference (RuntimeError if the reference failed). Adds the ``check`` step."""
    if isinstance(call, Exception):
        raise call
    with steps.step("check"):
        output = jax.block_until_ready(call(*prepared.inputs))
        if isinstance(prepared.reference, Exception):
            raise RuntimeError(f"the float64 reference failed: {_error_text(prepared.reference)}")
        return max_relative_error(output, prepared.reference)


def baseline_first(implementations: Mapping[str, Any]):
    """``(name, value)`` pairs of ``implementations``, :data:`BASELINE` first.

    Raises:
      ValueError: there is no baseline.
    """
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
