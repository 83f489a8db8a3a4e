"""TPU-specific names (``pltpu``): memory spaces and Mosaic TPU compiler params."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pallas_core.memory import ANY, MemorySpace  # noqa: F401 - ANY: pl.ANY, as pltpu.ANY
from pallas_core.params import ResolvedParams, check_semantics
from pallas_core.tpu_prefetch import PrefetchScalarGridSpec  # noqa: F401 - pltpu's name

VMEM = MemorySpace("tpu", "VMEM")
SMEM = MemorySpace("tpu", "SMEM")


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Mosaic TPU parameters.

    Args:
      dimension_semantics: ``"parallel"`` / ``"arbitrary"`` per grid axis
        (megacore split, seed 002).
      vmem_limit_bytes: scoped VMEM limit in bytes, or None for Mosaic's default.
    """

    dimension_semantics: Sequence[str] | None = None
    vmem_limit_bytes: int | None = None

    def _resolve(self) -> ResolvedParams:
        tpu = {} if self.vmem_limit_bytes is None else {"vmem_limit_bytes": self.vmem_limit_bytes}
        return ResolvedParams(check_semantics(self.dimension_semantics), tpu=tpu)
