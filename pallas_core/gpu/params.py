"""``pallas_core.gpu.CompilerParams``: Mosaic GPU's compiler parameters, both forms.

One class serves the grid-form ``pallas_call(backend="mosaic_gpu")`` (where
``dimension_semantics`` says which grid axes are the sequential pipeline)
and ``pallas_core.gpu.kernel`` (warpgroup kernels), with the fields of JAX
0.10.2's ``plgpu.CompilerParams``. ``dimension_semantics`` takes ours
(``"parallel"`` / ``"arbitrary"``) and JAX's (``"parallel"`` /
``"sequential"``) spellings; both mean the same.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pallas_core.params import ResolvedParams, check_semantics


def _mgpu():
    from jax.experimental.mosaic import gpu as mgpu
    return mgpu


def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def lowering_semantics_enum():
    """JAX's ``LoweringSemantics`` (``Lane``: per-thread arrays, ``Warpgroup``: warpgroup arrays)."""
    return _mgpu().LoweringSemantics


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Mosaic GPU parameters (JAX 0.10.2's ``plgpu.CompilerParams`` fields, and ours).

    Args:
      approx_math: allow approximate transcendental functions (``ex2.approx``...).
      dimension_semantics: per grid axis of a grid-form ``pallas_call``:
        ``"parallel"`` axes become the CUDA grid, ``"arbitrary"`` (JAX:
        ``"sequential"``) axes the in-kernel pipeline over TMA copies.
      max_concurrent_steps: pipeline depth of the sequential axes (SMEM slots
        per operand). ``None``: 2, or 1 where an output block is revisited
        along a sequential axis (JAX's pipeline rotates output slots, so an
        accumulating output needs a single slot; docs/pallas_core.md section 16).
      unsafe_no_auto_barriers: never insert the barriers that make loads and
        stores by one thread look synchronous (see JAX's docstring for when it
        is safe).
      reduction_scratch_bytes: SMEM reserved for cross-warp reductions.
      profile_space, profile_dir: Mosaic GPU's in-kernel profiler (both or neither);
        profile_trace_scope: ``plgpu.TraceScope.WARPGROUP`` (JAX's default) or ``WARP``.
      lowering_semantics: ``LoweringSemantics.Lane`` (JAX's default) or
        ``LoweringSemantics.Warpgroup``.

    Raises:
      ValueError / TypeError: a field of the wrong kind, named.
    """

    dimension_semantics: Sequence[str] | None = None
    max_concurrent_steps: int | None = None
    approx_math: bool = False
    unsafe_no_auto_barriers: bool = False
    reduction_scratch_bytes: int = 128 * 4 * 4
    profile_space: int = 0
    profile_dir: str = ""
    lowering_semantics: Any = None
    profile_trace_scope: Any = None

    def __post_init__(self):
        if self.dimension_semantics is not None:
            object.__setattr__(self, "dimension_semantics",
                               tuple(_semantics_name(s) for s in self.dimension_semantics)
                               if not isinstance(self.dimension_semantics, str)
                               else self.dimension_semantics)
            check_semantics(self.dimension_semantics)
        steps = self.max_concurrent_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"CompilerParams: max_concurrent_steps must be an int >= 1 or None, "
                             f"got {steps!r}.")
        for name in ("approx_math", "unsafe_no_auto_barriers"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CompilerParams: {name} must be a bool, got {getattr(self, name)!r}.")
        for name in ("reduction_scratch_bytes", "profile_space"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"CompilerParams: {name} must be an int >= 0, got {v!r}.")
        if bool(self.profile_space) != bool(self.profile_dir):
            raise ValueError("CompilerParams: give both profile_space and profile_dir, or neither.")
        semantics = self.lowering_semantics
        if semantics is None:
            object.__setattr__(self, "lowering_semantics", lowering_semantics_enum().Lane)
        elif not isinstance(semantics, lowering_semantics_enum()):
            raise TypeError("CompilerParams: lowering_semantics must be a plgpu.LoweringSemantics "
                            f"(Lane or Warpgroup), got {semantics!r}.")

    replace = dataclasses.replace

    def _fields_for_jax(self) -> dict:
        fields = dict(approx_math=self.approx_math,
                      unsafe_no_auto_barriers=self.unsafe_no_auto_barriers,
                      reduction_scratch_bytes=self.reduction_scratch_bytes,
                      profile_space=self.profile_space, profile_dir=self.profile_dir,
                      lowering_semantics=self.lowering_semantics)
        if self.profile_trace_scope is not None:
            fields["profile_trace_scope"] = self.profile_trace_scope
        return fields

    def _resolve(self) -> ResolvedParams:
        gpu = self._fields_for_jax()
        gpu["max_concurrent_steps"] = self.max_concurrent_steps
        return ResolvedParams(check_semantics(self.dimension_semantics), gpu=gpu)

    def to_jax(self, dimension_semantics=None, max_concurrent_steps: int = 1):
        """JAX's ``plgpu.CompilerParams`` with these fields (``"arbitrary"`` as ``"sequential"``)."""
        return to_jax(self._fields_for_jax(), dimension_semantics, max_concurrent_steps)


def to_jax(fields: dict, dimension_semantics=None, max_concurrent_steps: int = 1):
    """JAX's ``plgpu.CompilerParams`` from resolved ``fields`` (``ResolvedParams.gpu``)."""
    fields = {k: v for k, v in fields.items() if k != "max_concurrent_steps"}
    if dimension_semantics is not None:
        dimension_semantics = tuple("sequential" if s == "arbitrary" else s
                                    for s in dimension_semantics)
    return _plgpu().CompilerParams(dimension_semantics=dimension_semantics,
                                   max_concurrent_steps=max_concurrent_steps, **fields)


def _semantics_name(s) -> str:
    name = str(getattr(s, "value", s)).lower()
    return "arbitrary" if name == "sequential" else name


def for_kernel(params):
    """The JAX ``plgpu.CompilerParams`` a ``pallas_core.gpu.kernel`` passes on.

    Raises:
      TypeError: params that are neither ours nor JAX's ``plgpu.CompilerParams``.
    """
    if params is None:
        return _plgpu().CompilerParams()
    if isinstance(params, CompilerParams):
        return params.to_jax(None, params.max_concurrent_steps or 1)
    if isinstance(params, _plgpu().CompilerParams):
        return params
    raise TypeError("kernel: compiler_params must be pallas_core.gpu.CompilerParams or "
                    f"jax.experimental.pallas.mosaic_gpu.CompilerParams, got {type(params).__name__}.")
