"""What a host without a GPU can say about our GPU kernels: sm_90 compiles and H100 roofline bounds.

For one essential case per op (:func:`essential_cases`: the benchmark's own
GPU cases, at its model sizes, fwd+bwd) every Triton kernel is compiled ahead
of time for ``sm_90`` through the static gate (:func:`benchmarks.static.analyze`:
registers, spills, ``wgmma`` / TMA / ``cp.async`` counts, the SASS
instructions per iteration of each loop (the work of one step of the
kernel's main loop), and for the memory-bound ops the reads per element
counted in Triton's interpreter, i.e. the passes over HBM).

From the case's work and those passes follows a roofline bound on an H100 SXM
(:data:`H100_SXM`, NVIDIA's datasheet figures):

    bound = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)

where FLOPs is the case's count (:attr:`benchmarks.harness.Case.flops`),
the peak is the dense bf16 Tensor Core rate for compute-bound ops (matmul,
attention, linear cross-entropy) and the FP32 CUDA-core rate for the
memory-bound ones (their math runs in float32), and bytes are the case's
minimal traffic (:attr:`~benchmarks.harness.Case.bytes_accessed`, else its
inputs plus outputs) plus, for each extra pass a kernel makes over its input
(reads per element above 1), the bytes of the case's largest input once more.
It is a lower bound on the time of one call, never a measurement: nothing
runs on a GPU here.

Compiles take about 5 s per case; results are cached
(:func:`cache_dir`) under a key of every source file they depend on and the
triton version, so a second run on an unchanged tree costs nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import attention, cross_entropy, decoder_ops, harness, matmul, norms, softmax

TARGET = "sm_90"
REPO_ROOT = Path(__file__).resolve().parents[1]

# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16 Tensor Core
# 1,979 TFLOP/s and TF32 989 TFLOP/s are quoted "with sparsity"; dense is half.
# FP32 (CUDA cores) 67 TFLOP/s; GPU memory bandwidth 3.35 TB/s (HBM3, 80 GB).
H100_SXM = {
    "name": "H100 SXM (80 GB HBM3)",
    "source": "NVIDIA H100 Tensor Core GPU datasheet; dense = half its 'with sparsity' figures",
    "bf16_tensor_tflops": 1979 / 2,
    "tf32_tensor_tflops": 989 / 2,
    "fp32_tflops": 67.0,
    "hbm_gbps": 3350.0,
}


@dataclasses.dataclass(frozen=True)
class StaticCase:
    """One benchmark case compiled for the GPU: the case (its work) and how to run
    one program's worth of it in Triton's interpreter to count traffic."""

    case: harness.Case
    small: Callable[[], tuple] | None = None  # () -> concrete inputs of a few rows, or None


def essential_cases() -> list[StaticCase]:
    """One fwd+bwd case per op family at the GPU benchmark's model sizes, ``triton`` only.

    fused_matmul with the bias+gelu_exact epilogue at 8192^3; layer_norm and
    rms_norm over 16384 x 4096; softmax over 4096 x 16384; cross_entropy at
    8192 x 131072; linear_cross_entropy at 8192 x 4096 x 131072; causal
    attention at 4 x 4096 tokens, 16 heads of 128; the rotary embedding of 4 x 4096
    tokens, 32 heads of 128; the SwiGLU gated_linear_unit at 8192 x 4096 x 14336. All
    bfloat16.
    """
    impl = ("triton",)
    small_rows = 16  # rows for the traffic count: every row is read alike
    found = [
        StaticCase(matmul.make_case((8192, 8192, 8192), "bfloat16", "bias+gelu_exact", "fwd+bwd",
                                    impl)),
        *(StaticCase(norms.make_case(op, (16384, 4096), "bfloat16", "fwd+bwd", impl),
                     _small(norms.make_case, op, (small_rows, 4096), "bfloat16", "fwd+bwd", impl))
          for op in norms.OPS),
        StaticCase(softmax.make_case("softmax", (4096, 16384), "bfloat16", "axis=-1", "fwd+bwd", impl),
                   _small(softmax.make_case, "softmax", (small_rows, 16384), "bfloat16", "axis=-1",
                          "fwd+bwd", impl)),
        StaticCase(cross_entropy.make_ce_case((8192, 131072), "bfloat16", "fwd+bwd", impl),
                   _small(cross_entropy.make_ce_case, (small_rows, 131072), "bfloat16", "fwd+bwd",
                          impl)),
        StaticCase(cross_entropy.make_linear_case((8192, 4096, 131072), "bfloat16", "fwd+bwd", impl)),
        StaticCase(attention.make_case(attention.Shape(4, 4096, 4096, 16, 16, 128, True, "bfloat16"),
                                       "fwd+bwd", impl)),
        StaticCase(decoder_ops.rope_case((4, 4096, 32, 128, 128), "bfloat16", "fwd+bwd", impl),
                   _small(decoder_ops.rope_case, (1, 2, 32, 128, 128), "bfloat16", "fwd+bwd", impl)),
        StaticCase(decoder_ops.glu_case((8192, 4096, 14336), "bfloat16", "swiglu", "fwd+bwd", impl)),
    ]
    return found


def _small(make_case, *args) -> Callable[[], tuple]:
    """``() -> inputs`` of the case ``make_case(*args)`` (a few rows of the same width)."""
    return lambda: make_case(*args).make_inputs(jax.random.key(0))


def abstract_inputs(case: harness.Case) -> tuple:
    """The case's inputs as ``jax.ShapeDtypeStruct`` (nothing is allocated)."""
    return jax.eval_shape(case.make_inputs, jax.random.key(0))


def _nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------
# The compile
# ----------------------------------------------------------------------------

def compile_case(static_case: StaticCase, target: str = TARGET) -> list[dict[str, Any]]:
    """The static gate's rows (:func:`benchmarks.static.analyze`) for every kernel of
    ``static_case``, each with its ``violations`` (:func:`benchmarks.static.violations`)."""
    from benchmarks import static

    case = static_case.case
    gate = static.GateCase(case.name, case.implementations["triton"], abstract_inputs(case),
                           traffic_args=static_case.small)
    rows = static.analyze(gate, target)
    for row in rows:
        row["violations"] = static.violations(row, target)
    return rows


# ----------------------------------------------------------------------------
# The bound
# ----------------------------------------------------------------------------

def roofline_bound(case: harness.Case, kernel_rows: list[dict], spec: dict = H100_SXM) -> dict:
    """The H100 roofline bound of one call of ``case``, given its kernels' gate rows.

    Returns ``flops``, ``min_bytes`` (the case's minimal traffic),
    ``bytes`` (plus one more read of the largest input per extra pass a
    kernel makes), ``passes`` (the largest reads per element counted, None
    when not counted), ``peak_tflops`` and ``peak_name`` (the rate the flops
    are held to), ``hbm_gbps``, ``compute_us``, ``memory_us``, ``bound_us``
    (the larger), ``bound_by`` ("compute" or "memory") and ``gpu``.
    """
    args = abstract_inputs(case)
    outputs = jax.eval_shape(case.implementations[harness.BASELINE], *args)
    min_bytes = case.bytes_accessed or float(_nbytes(args) + _nbytes(outputs))
    largest_input = max(_nbytes(a) for a in jax.tree.leaves(args))
    reads = [r["reads_per_element"] for r in kernel_rows if r.get("reads_per_element")]
    extra_passes = sum(max(0.0, r - 1.0) for r in reads)
    total_bytes = min_bytes + extra_passes * largest_input
    if case.ceiling == "matmul":
        peak, peak_name = spec["bf16_tensor_tflops"], "bf16 Tensor Core (dense)"
    else:
        peak, peak_name = spec["fp32_tflops"], "FP32 CUDA cores"
    compute_us = case.flops / (peak * 1e12) * 1e6
    memory_us = total_bytes / (spec["hbm_gbps"] * 1e9) * 1e6
    return {"flops": case.flops, "min_bytes": float(min_bytes), "bytes": float(total_bytes),
            "passes": max(reads) if reads else None, "peak_tflops": peak, "peak_name": peak_name,
            "hbm_gbps": spec["hbm_gbps"], "compute_us": compute_us, "memory_us": memory_us,
            "bound_us": max(compute_us, memory_us),
            "bound_by": "compute" if compute_us >= memory_us else "memory", "gpu": spec["name"]}


# ----------------------------------------------------------------------------
# Cache and driver
# ----------------------------------------------------------------------------

def cache_dir() -> Path:
    """``$PALLAS_KERNELS_CACHE`` or ``$XDG_CACHE_HOME/pallas-kernels`` (default
    ``~/.cache/pallas-kernels``), subfolder ``static``: outside the checkout."""
    root = os.environ.get("PALLAS_KERNELS_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pallas-kernels"
    return Path(root) / "static"


@functools.cache
def source_key() -> str:
    """A hash of every source file the compiles depend on (ops/, pallas_core/,
    benchmarks/) and of the triton version."""
    import triton
    digest = hashlib.sha256(triton.__version__.encode())
    for folder in ("ops", "pallas_core", "benchmarks"):
        for path in sorted((REPO_ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".json") and "results" not in path.parts:
                digest.update(path.relative_to(REPO_ROOT).as_posix().encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def report(cases: list[StaticCase] | None = None, *, target: str = TARGET, use_cache: bool = True,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Compiles ``cases`` (default :func:`essential_cases`) and bounds each on an H100.

    Returns ``{"target", "gpu": H100_SXM, "cached": bool, "cases": [{"case",
    "op", "shape", "dtype", "pass", "kernels": [gate rows without their asm],
    "bound": roofline_bound(...)}]}``. Cached under :func:`cache_dir` by
    :func:`source_key` when ``use_cache``.
    """
    cases = essential_cases() if cases is None else cases
    names = [c.case.name for c in cases]
    cache = cache_dir() / f"{target}-{source_key()}-{hashlib.sha256(str(names).encode()).hexdigest()[:8]}.json"
    if use_cache and cache.exists():
        return {**json.loads(cache.read_text()), "cached": True}
    out = []
    for static_case in cases:
        case = static_case.case
        log(f"compiling {case.name} for {target}")
        kernels = [{k: v for k, v in row.items() if k != "asm"} for row in compile_case(static_case, target)]
        out.append({"case": case.name, "op": case.op, "shape": list(case.shape), "dtype": case.dtype,
                    "pass": case.pass_name, "kernels": kernels,
                    "bound": roofline_bound(case, kernels)})
    result = {"target": target, "gpu": H100_SXM, "cases": out}
    if use_cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(result, indent=1) + "\n")
    return {**result, "cached": False}
