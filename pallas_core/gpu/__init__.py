"""``pallas_core.gpu``: Mosaic GPU (``plgpu``), under JAX 0.10.2's names (docs/pallas_core.md section 16).

``from pallas_core import gpu as plgpu`` in place of
``from jax.experimental.pallas import mosaic_gpu as plgpu`` (and
``import pallas_core as pl``) runs a kernel written for JAX's Mosaic GPU on
pallas_core: lowered by JAX's Mosaic GPU lowering on an sm_90+ GPU, and run
in JAX's GPU interpret mode, races detected, on a host without one.

Ours (arguments checked before anything is traced):

* :func:`kernel` (warpgroup kernels: grid / cluster / warpgroups, scratch,
  compiler params, where it runs: :mod:`pallas_core.gpu.target`);
* memory types :data:`SMEM` / :data:`GMEM` (with ``transforms``), :class:`ACC`,
  :class:`Barrier`, :class:`ClusterBarrier` (:mod:`pallas_core.gpu.memory`);
* :class:`BlockSpec` (``transforms``, ``delay_release``, ``collective_axes``),
  :class:`CompilerParams` (both the grid form's ``dimension_semantics`` and
  plgpu's fields), the pipelines :func:`emit_pipeline` and
  :func:`emit_pipeline_warp_specialized`;
* ``load``, ``layout_cast``, ``broadcasted_iota``, ``async_prefetch``,
  ``wgmma`` (:mod:`pallas_core.gpu.primitives`: JAX's on the lowering path,
  spelled for the interpreter in the interpret mode);
* the interpret mode's :class:`RaceError`; JAX's ``InterpretGPUParams`` and
  ``force_gpu_interpret_mode`` under these names;
* :func:`mosaic_modules`: the Mosaic GPU MLIR a function lowers to for ``cuda``
  (:mod:`pallas_core.gpu.lowering`), read on any host.

JAX's own, re-exported as they are (their meaning is JAX's lowering's):
``copy_gmem_to_smem``, ``copy_smem_to_gmem``, ``commit_smem``,
``commit_smem_to_gmem_group``, ``wait_smem_to_gmem``, ``barrier_wait``,
``barrier_arrive``, ``wgmma_wait``, ``wgmma_accumulator_load``,
``set_max_registers``, ``transpose_ref``, ``transform_ref``,
``TilingTransform``, ``SwizzleTransform``, ``find_swizzle``, ``Layout``,
``LoweringSemantics``, ``nd_loop``, ``NDLoopInfo``, ``planar_snake``,
``TransposeTransform`` (JAX's Ref transform, ``jax._src.state.types``: plgpu
0.10.2 does not export it; ``transpose_ref`` makes it); and any
other public name of ``jax.experimental.pallas.mosaic_gpu`` (Blackwell's
``tcgen05`` / TMEM, semaphores, ...), forwarded. JAX 0.10.2 has no
JAX's modules are imported when a name of theirs is first used, not with
pallas_core.
"""
from pallas_core.gpu.interpret import RaceError
from pallas_core.gpu.lowering import mosaic_modules
from pallas_core.gpu.mosaic_kernel import kernel
from pallas_core.gpu.memory import ACC, GMEM, SMEM, Barrier, ClusterBarrier, GPUMemorySpace
from pallas_core.gpu.params import CompilerParams
from pallas_core.gpu.pipeline import emit_pipeline, emit_pipeline_warp_specialized
from pallas_core.gpu.primitives import async_prefetch, broadcasted_iota, layout_cast, load, wgmma
from pallas_core.gpu.specs import BlockSpec

WGMMAAccumulatorRef = ACC

_JAX_NAMES = (
    "copy_gmem_to_smem", "copy_smem_to_gmem", "commit_smem", "commit_smem_to_gmem_group",
    "wait_smem_to_gmem", "barrier_wait", "barrier_arrive", "wgmma_wait",
    "wgmma_accumulator_load", "set_max_registers", "transpose_ref", "transform_ref",
    "TilingTransform", "SwizzleTransform", "find_swizzle", "Layout", "LoweringSemantics",
    "nd_loop", "NDLoopInfo", "planar_snake",
)

__all__ = [
    "ACC", "Barrier", "BlockSpec", "ClusterBarrier", "CompilerParams", "GMEM", "GPUMemorySpace",
    "InterpretGPUParams", "RaceError", "SMEM", "WGMMAAccumulatorRef", "async_prefetch",
    "broadcasted_iota", "emit_pipeline", "emit_pipeline_warp_specialized",
    "force_gpu_interpret_mode", "kernel", "layout_cast", "load", "mosaic_modules", "wgmma",
    "TransposeTransform", *_JAX_NAMES,
]


def __getattr__(name):
    # JAX's Mosaic GPU modules cost about a second to import: only when first used.
    if name == "TransposeTransform":
        from jax._src.state.types import TransposeTransform
        return TransposeTransform
    if name in ("InterpretGPUParams", "force_gpu_interpret_mode"):
        from jax._src.pallas.mosaic_gpu.interpret import params
        return getattr(params, name)
    if name.startswith("_"):
        raise AttributeError(name)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    try:
        return getattr(plgpu, name)
    except AttributeError:
        raise AttributeError(f"module 'pallas_core.gpu' has no attribute {name!r} (nor has JAX's "
                             "jax.experimental.pallas.mosaic_gpu)") from None
