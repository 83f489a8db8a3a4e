"""Triton-specific names (``pltriton``) and our own Triton lowering.

``backend="triton"`` generates Triton source from the kernel's jaxpr
(:mod:`pallas_core.triton.codegen`), launches it with ``jax_triton`` on CUDA
and runs it in Triton's interpreter elsewhere.

* :class:`CompilerParams`: ``num_warps``, ``num_stages``.
* atomics: :func:`atomic_add`, ``atomic_max``, ``atomic_min``, ``atomic_and``,
  ``atomic_or``, ``atomic_xor``, ``atomic_xchg``, ``atomic_cas``
  (read-modify-write on a Ref; return the old values).
* JAX 0.10.2's ``pallas.triton`` kernel names: ``load`` / ``store`` (masked, with
  cache / eviction / volatile hints), ``dot``, ``debug_barrier``,
  ``max_contiguous``, ``approx_tanh`` (:mod:`pallas_core.triton.primitives`),
  ``elementwise_inline_asm`` (:mod:`pallas_core.triton.inline_asm`).
* :func:`source`: the generated source of every triton pallas_call in ``f``.
* :func:`compile`: ahead-of-time compilation for a named GPU (``"sm_90"``),
  which works on a host without a GPU.
* :func:`tma_enabled` / :func:`enable_tma`: the library default of
  ``CompilerParams.tma`` (environment variable ``PALLAS_CORE_TRITON_TMA``).
* JAX's ``pallas.triton`` names added after 0.11.0 (GPU introspection:
  ``GpuInfo``, ``GpuVersion``, ``get_gpu_info``, ``get_gpu_info_from_version``,
  ``is_gpu_device``; ``CUSTOM_CALL_TARGET_NAME``): JAX's own, where the installed
  JAX has them (an AttributeError naming the name and the JAX version elsewhere).
"""
from __future__ import annotations

import jax

from pallas_core.triton.atomics import (atomic_add, atomic_and, atomic_cas, atomic_max, atomic_min,
                                       atomic_or, atomic_xchg, atomic_xor)
from pallas_core.triton.descriptors import enable_tma, tma_enabled
from pallas_core.triton.inline_asm import elementwise_inline_asm
from pallas_core.triton.params import CompilerParams
from pallas_core.triton.primitives import approx_tanh, debug_barrier, dot, load, max_contiguous, store

__all__ = ["CompilerParams", "approx_tanh", "atomic_add", "atomic_and", "atomic_cas", "atomic_max",
           "atomic_min", "atomic_or", "atomic_xchg", "atomic_xor", "compile", "debug_barrier", "dot", "elementwise_inline_asm",
           "enable_tma", "load", "max_contiguous", "source", "store", "tma_enabled"]


# JAX's own, re-exported on first use: they describe JAX's devices and JAX's own
# Pallas Triton custom call, and exist only in JAX after 0.11.0.
_FROM_JAX_AFTER_0_11_0 = frozenset({"CUSTOM_CALL_TARGET_NAME", "GpuInfo", "GpuVersion", "get_gpu_info",
                                    "get_gpu_info_from_version", "is_gpu_device"})


def __getattr__(name):
    if name not in _FROM_JAX_AFTER_0_11_0:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from jax.experimental.pallas import triton as jax_pallas_triton
        return getattr(jax_pallas_triton, name)
    except (ImportError, AttributeError):
        raise AttributeError(
            f"pallas_core.triton.{name} is JAX's jax.experimental.pallas.triton.{name}, re-exported "
            f"where the installed JAX has it (JAX after 0.11.0); JAX {jax.__version__} does not."
        ) from None


def _trace(f, *args, **kwargs):
    from pallas_core.triton import backend
    # Kernels are recorded while JAX traces them; a function traced before
    # (make_jaxpr and jit cache traces by function and shapes) would not be
    # traced again and its kernels would go unseen. Hence clear_caches, at the
    # price of recompiling what runs next.
    jax.clear_caches()
    with backend.capturing() as records:
        jax.make_jaxpr(f)(*args, **kwargs)
    return records


def source(f, *args, **kwargs) -> list[str]:
    """Generated Triton source of every ``backend="triton"`` pallas_call in ``f(*args)``.

    ``f`` is only traced (``jax.make_jaxpr``); nothing runs. ``args`` may be
    arrays or ``jax.ShapeDtypeStruct``s. JAX's caches are cleared first
    (``jax.clear_caches``), so asking twice, or after running ``f``, sees the
    same kernels.
    """
    return [r["source"] for r in _trace(f, *args, **kwargs)]


def compile(f, *args, target: str = "sm_90", **kwargs) -> list[dict]:  # noqa: A001 - Triton's verb
    """Compiles every triton pallas_call in ``f(*args)`` ahead of time for ``target``.

    Works without a GPU (Triton ships its own ptxas). Returns one report per
    kernel: ``name``, ``target``, ``num_warps``, ``num_stages``,
    ``shared_memory_bytes``, ``global_scratch_bytes`` (per program: what
    Triton's launcher must allocate, e.g. for tensor descriptors made in the
    kernel), ``registers`` (per thread) and
    ``spill_bytes`` (spill stores plus loads), the last two read from
    ``ptxas -v`` on the generated PTX, and ``asm`` (every stage's text).

    Raises:
      ValueError: a target other than ``"sm_XY"``.
    """
    from pallas_core.triton import runtime

    if not (isinstance(target, str) and target.startswith("sm_") and target[3:].isdigit()):
        raise ValueError(f"target: expected a CUDA target such as 'sm_90', got {target!r}.")
    capability = int(target[3:])
    reports = []
    for r in _trace(f, *args, **kwargs):
        compiled = runtime.compile_kernel(r["source"], r["name"], r["pointer_dtypes"], r["constexprs"],
                                          num_warps=r["num_warps"], num_stages=r["num_stages"],
                                          capability=capability)
        metadata = compiled.metadata
        usage = _ptxas_usage(compiled.asm["ptx"], capability)
        reports.append(dict(name=r["name"], target=target, num_warps=metadata.num_warps,
                            num_stages=metadata.num_stages, shared_memory_bytes=metadata.shared,
                            global_scratch_bytes=metadata.global_scratch_size,
                            registers=usage["registers"], spill_bytes=usage["spill_bytes"],
                            asm=compiled.asm))
    return reports


def _ptxas_usage(ptx: str, capability: int) -> dict:
    """Registers per thread and spill bytes of a PTX module, from Triton's own ``ptxas -v``."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        log = subprocess.run([ptxas, "--gpu-name", arch, "-v", path, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    return dict(registers=int(registers.group(1)) if registers else None, spill_bytes=sum(spills))
