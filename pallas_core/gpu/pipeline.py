"""In-kernel pipelines over TMA copies: ``emit_pipeline`` and ``emit_pipeline_warp_specialized``.

JAX's Mosaic GPU pipelines (``jax.experimental.pallas.mosaic_gpu``), with our
arguments checked first and our BlockSpecs / memory spaces converted
(:func:`pallas_core.gpu.specs.to_jax_spec`). What they emit is JAX's:

* ``emit_pipeline``: every warpgroup runs the loop; ``max_concurrent_steps``
  SMEM slots per operand, TMA loads issued that many steps ahead, each
  output block stored (TMA) when its index changes and at the end. Output
  slots rotate with the step, so an output block revisited on consecutive
  steps must be accumulated elsewhere (a register carry, ``init_carry``) or
  the pipeline given one slot.
* ``emit_pipeline_warp_specialized``: ``num_compute_wgs`` compute
  warpgroups run ``body`` while the last warpgroup (the producer) issues the
  TMA loads, with ``memory_registers`` registers per thread (the compute
  warpgroups get the rest via ``setmaxnreg``); consumed-slot barriers tell
  the producer when a slot may be refilled. ``compute_context`` wraps the
  compute warpgroups' loop (an accumulator scope and the epilogue), and then
  ``body`` carries a value. Call it with the GMEM Refs (optionally
  ``allocations=`` from ``.get_allocations(*gmem_refs)``, made once with
  ``pl.run_scoped``).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from pallas_core.gpu.specs import to_jax_specs


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def _check_grid(grid, what):
    if isinstance(grid, (int, np.integer)):
        grid = (grid,)
    try:
        grid = tuple(grid)
    except TypeError:
        raise TypeError(f"{what}: grid must be a tuple of ints, got {grid!r}.") from None
    for d in grid:
        if isinstance(d, jax.core.Tracer):
            continue
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
            raise ValueError(f"{what}: grid dims must be ints >= 1 (or traced int32 scalars), "
                             f"got {grid!r}.")
    return grid


def _positive(value, what, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what}: {name} must be an int >= 1, got {value!r}.")
    return int(value)


def emit_pipeline(body: Callable, *, grid, in_specs=(), out_specs=(), max_concurrent_steps: int = 1,
                  init_carry=None):
    """A pipeline over ``grid`` in the kernel (JAX's ``plgpu.emit_pipeline``).

    ``body(indices, *in_smem_refs, *out_smem_refs[, carry])``; returns a
    function of the GMEM Refs. See the module docstring.

    Raises:
      ValueError / TypeError: a bad grid, ``max_concurrent_steps`` below 1 or not
        above every input's ``delay_release``, or specs that are not BlockSpecs.
    """
    what = "emit_pipeline"
    if not callable(body):
        raise TypeError(f"{what}: body must be callable, got {body!r}.")
    grid = _check_grid(grid, what)
    steps = _positive(max_concurrent_steps, what, "max_concurrent_steps")
    in_specs, out_specs = to_jax_specs(tuple(in_specs), f"{what} in_specs"), to_jax_specs(
        tuple(out_specs), f"{what} out_specs")
    for spec in in_specs:
        if getattr(spec, "delay_release", 0) >= steps:
            raise ValueError(f"{what}: max_concurrent_steps ({steps}) must exceed every input's "
                             f"delay_release, got {spec.delay_release}.")
    return _plgpu().emit_pipeline(body, grid=grid, in_specs=in_specs, out_specs=out_specs,
                                  max_concurrent_steps=steps, init_carry=init_carry)


def emit_pipeline_warp_specialized(body: Callable, *, grid, memory_registers: int, in_specs=(),
                                   out_specs=(), max_concurrent_steps: int = 2, wg_axis,
                                   num_compute_wgs: int, pipeline_state=None,
                                   manual_consumed_barriers: bool = False, compute_context=None,
                                   memory_thread_idx: int | None = None):
    """A producer-consumer pipeline (JAX's ``plgpu.emit_pipeline_warp_specialized``).

    ``body(indices, *in_smem_refs, *out_smem_refs[, *consumed_barriers][, carry])``.
    The kernel needs ``num_threads = num_compute_wgs + 1`` warpgroups named
    ``wg_axis``; the producer is the last. See the module docstring.

    Raises:
      ValueError / TypeError: a bad grid; ``memory_registers`` not a multiple of 8 in
        [24, 256] (``setmaxnreg``'s range, PTX ISA); ``num_compute_wgs`` below 1;
        ``max_concurrent_steps`` not above ``delay_release``; no ``wg_axis``.
    """
    what = "emit_pipeline_warp_specialized"
    if not callable(body):
        raise TypeError(f"{what}: body must be callable, got {body!r}.")
    grid = _check_grid(grid, what)
    if (isinstance(memory_registers, bool) or not isinstance(memory_registers, (int, np.integer))
            or memory_registers % 8 or not 24 <= memory_registers <= 256):
        raise ValueError(f"{what}: memory_registers must be a multiple of 8 in [24, 256] "
                         f"(setmaxnreg), got {memory_registers!r}; 40 suits a TMA producer.")
    num_compute_wgs = _positive(num_compute_wgs, what, "num_compute_wgs")
    steps = _positive(max_concurrent_steps, what, "max_concurrent_steps")
    if wg_axis is None or not isinstance(wg_axis, str):
        raise TypeError(f"{what}: wg_axis must be the kernel's thread_name (a str), got {wg_axis!r}.")
    in_specs = to_jax_specs(in_specs if isinstance(in_specs, (list, tuple)) else (in_specs,),
                            f"{what} in_specs")
    out_specs = to_jax_specs(out_specs if isinstance(out_specs, (list, tuple)) else (out_specs,),
                             f"{what} out_specs")
    for spec in jax.tree.leaves(in_specs, is_leaf=lambda s: hasattr(s, "delay_release")):
        if getattr(spec, "delay_release", 0) >= steps:
            raise ValueError(f"{what}: max_concurrent_steps ({steps}) must exceed the inputs' "
                             f"delay_release, got {spec.delay_release}.")
    return _plgpu().emit_pipeline_warp_specialized(
        body, grid=grid, memory_registers=int(memory_registers), in_specs=in_specs,
        out_specs=out_specs, max_concurrent_steps=steps, wg_axis=wg_axis,
        num_compute_wgs=num_compute_wgs, pipeline_state=pipeline_state,
        manual_consumed_barriers=manual_consumed_barriers, compute_context=compute_context,
        memory_thread_idx=memory_thread_idx)
