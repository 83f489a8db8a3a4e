"""Triton compiler params, taken by both the ``triton`` and ``pallas_triton`` backends.

Besides the launch parameters, four switches shape the program our own Triton
lowering (``backend="triton"``) writes; :func:`schedule_options` validates
them, whichever form (this class or ``dict(triton=dict(...))``) they came in.
``pallas_triton`` (JAX's own lowering) has no such switches and ignores them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pallas_core.params import ResolvedParams, check_semantics
from pallas_core.triton.descriptors import tma_enabled


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Triton launch parameters and code-generator switches.

    Args:
      num_warps: warps per program (power of two), or None for the default (4).
      num_stages: software-pipelining depth of loops, or None for the default (3).
      dimension_semantics: as in :class:`pallas_core.CompilerParams`.
      group_size: grouped program ordering (Triton's matmul tutorial, "L2
        cache optimizations"): the last two parallel grid axes are walked in
        bands of ``group_size`` blocks of the first of them, the second
        axis fastest inside a band, so programs running at the same time share
        their operand blocks in L2. ``None`` or 1: row-major order.
      persistent: launch this many programs, each striding over the grid's
        parallel tiles (tile ``p``, ``p + persistent``, ...), instead of one
        program per tile; the usual value is the GPU's SM count (132 on an
        H100 SXM). ``None``: one program per tile.
      tma: load and store whole blocks of contiguous, 16-byte-aligned operands
        through tensor descriptors (``tl.make_tensor_descriptor``; the
        tensor-memory accelerator, ``cp.async.bulk.tensor``, on sm_90 and
        newer; Triton rewrites them to pointer accesses on older GPUs).
        Strided, gathered, user-masked or padded-lane accesses, and buffers
        the kernel both reads and writes, keep pointers. ``None`` (the
        default): the library default, :func:`pallas_core.triton.tma_enabled`
        (off unless ``PALLAS_CORE_TRITON_TMA=1`` or inside
        :func:`pallas_core.triton.enable_tma`). On a GPU such kernels get
        Triton's global scratch for their descriptors as a hidden output
        (:mod:`pallas_core.triton.global_scratch`; docs/pallas_core.md).
      loop_peeling: emit a ``pl.when`` on the first (last) iteration of the
        innermost sequential grid axis before (after) its loop, so the loop
        body has no branch; results are unchanged. On by default.

    Raises:
      ValueError: a switch out of its range (see :func:`schedule_options`).
    """

    num_warps: int | None = None
    num_stages: int | None = None
    dimension_semantics: Sequence[str] | None = None
    group_size: int | None = None
    persistent: int | None = None
    tma: bool | None = None
    loop_peeling: bool = True

    def __post_init__(self):
        schedule_options(self._switches())

    def _switches(self) -> dict:
        return dict(group_size=self.group_size, persistent=self.persistent, tma=self.tma,
                    loop_peeling=self.loop_peeling)

    def _resolve(self) -> ResolvedParams:
        triton = {k: v for k, v in (("num_warps", self.num_warps),
                                    ("num_stages", self.num_stages)) if v is not None}
        triton.update(self._switches())
        return ResolvedParams(check_semantics(self.dimension_semantics), triton=triton)


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """The code-generator switches of :class:`CompilerParams`, validated, defaults filled."""

    group_size: int = 1
    persistent: int | None = None
    tma: bool = False
    loop_peeling: bool = True


def schedule_options(triton: Mapping) -> ScheduleOptions:
    """The code-generator switches in a resolved ``triton`` params mapping.

    Raises:
      ValueError: ``group_size`` or ``persistent`` not a positive int (or
        None), ``tma`` not a bool or None (None: :func:`tma_enabled`), or
        ``loop_peeling`` not a bool.
    """
    def positive(name):
        value = triton.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"CompilerParams: {name} must be a positive int or None, got {value!r}.")
        return value

    def flag(name, default):
        value = triton.get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f"CompilerParams: {name} must be True or False, got {value!r}.")
        return value

    return ScheduleOptions(group_size=positive("group_size") or 1, persistent=positive("persistent"),
                           tma=tma_enabled() if triton.get("tma") is None else flag("tma", False),
                           loop_peeling=flag("loop_peeling", True))
