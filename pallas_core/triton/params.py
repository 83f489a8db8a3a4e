"""Triton compiler params, taken by both the ``triton`` and ``pallas_triton`` backends."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pallas_core.params import ResolvedParams, check_semantics


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Triton launch parameters.

    Args:
      num_warps: warps per program (power of two), or None for the default (4).
      num_stages: software-pipelining depth of loops, or None for the default (3).
      dimension_semantics: as in :class:`pallas_core.CompilerParams`.
    """

    num_warps: int | None = None
    num_stages: int | None = None
    dimension_semantics: Sequence[str] | None = None

    def _resolve(self) -> ResolvedParams:
        triton = {k: v for k, v in (("num_warps", self.num_warps),
                                    ("num_stages", self.num_stages)) if v is not None}
        return ResolvedParams(check_semantics(self.dimension_semantics), triton=triton)
