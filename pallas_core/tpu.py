"""TPU-specific names (``pltpu``), as in JAX 0.10.2's ``pallas.tpu``.

Memory spaces (VMEM, SMEM, HBM, ANY), Mosaic TPU :class:`CompilerParams`,
scalar prefetch (:class:`PrefetchScalarGridSpec`, :mod:`pallas_core.tpu_prefetch`),
``roll``, the masked ``load`` / ``store``, ``bitcast`` and the kernel PRNG (:mod:`pallas_core.tpu_ops`), manual DMA and
semaphores (:mod:`pallas_core.dma`). See docs/pallas_core.md.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pallas_core.dma import AsyncCopyDescriptor, SemaphoreType, async_copy, make_async_copy, sync_copy
from pallas_core.memory import ANY, TPU_SMEM, MemorySpace
from pallas_core.params import ARBITRARY, PARALLEL, ResolvedParams, check_semantics
from pallas_core.tpu_ops import bitcast, load, prng_random_bits, prng_seed, roll, store
from pallas_core.tpu_prefetch import PrefetchScalarGridSpec

__all__ = ["ANY", "ARBITRARY", "AsyncCopyDescriptor", "CompilerParams", "HBM", "MemorySpace",
           "PARALLEL", "PrefetchScalarGridSpec", "SMEM", "SemaphoreType", "VMEM", "async_copy",
           "bitcast", "load", "make_async_copy", "prng_random_bits", "prng_seed", "roll", "store",
           "sync_copy"]

VMEM = MemorySpace("tpu", "VMEM")
SMEM = TPU_SMEM
HBM = MemorySpace("tpu", "HBM")  # like ANY on the interpreter: the whole array, not blocked


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Mosaic TPU parameters.

    Args:
      dimension_semantics: ``"parallel"`` / ``"arbitrary"`` per grid axis
        (megacore split).
      vmem_limit_bytes: scoped VMEM limit in bytes, or None for Mosaic's default.
    """

    dimension_semantics: Sequence[str] | None = None
    vmem_limit_bytes: int | None = None

    def _resolve(self) -> ResolvedParams:
        tpu = {} if self.vmem_limit_bytes is None else {"vmem_limit_bytes": self.vmem_limit_bytes}
        return ResolvedParams(check_semantics(self.dimension_semantics), tpu=tpu)
