"""Mosaic GPU-specific names (``plgpu``): shared memory and compiler params."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pallas_core.memory import MemorySpace
from pallas_core.params import ResolvedParams, check_semantics

SMEM = MemorySpace("gpu", "SMEM")


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Mosaic GPU parameters.

    Args:
      dimension_semantics: ``"parallel"`` / ``"arbitrary"`` per grid axis;
        arbitrary axes become Mosaic GPU's in-kernel sequential pipeline.
      max_concurrent_steps: pipeline depth of the sequential axes.
    """

    dimension_semantics: Sequence[str] | None = None
    max_concurrent_steps: int = 2

    def _resolve(self) -> ResolvedParams:
        return ResolvedParams(check_semantics(self.dimension_semantics),
                              gpu={"max_concurrent_steps": self.max_concurrent_steps})
