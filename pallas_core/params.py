"""Compiler parameters: the backend-neutral class and their normalisation.

Every accepted form (``pallas_core.CompilerParams``, the backend classes in
``pallas_core.tpu`` / ``.triton`` / ``.gpu``, and the older dict form
``dict(mosaic=dict(dimension_semantics=(...)))``) resolves to one
:class:`ResolvedParams`, so backends read a single structure.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

PARALLEL = "parallel"
ARBITRARY = "arbitrary"
_SEMANTICS = (PARALLEL, ARBITRARY)


@dataclasses.dataclass(frozen=True)
class CompilerParams:
    """Backend-neutral compiler parameters.

    Args:
      dimension_semantics: one of ``"parallel"`` / ``"arbitrary"`` per grid
        axis. A parallel axis may be split across cores or run concurrently;
        an arbitrary axis runs in order. ``None`` infers: an axis along which
        an output block is revisited is arbitrary, the rest parallel.
    """

    dimension_semantics: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class ResolvedParams:
    dimension_semantics: tuple[str, ...] | None = None
    tpu: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    triton: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gpu: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_DICT_KEYS = {"mosaic": "tpu", "mosaic_tpu": "tpu", "tpu": "tpu",
              "triton": "triton", "mosaic_gpu": "gpu", "gpu": "gpu"}


def resolve_params(params) -> ResolvedParams:
    """Normalises any accepted compiler-params form.

    Raises:
      TypeError: an object that is none of the accepted forms.
      ValueError: an unknown dict key or dimension_semantics value.
    """
    if params is None:
        return ResolvedParams()
    if isinstance(params, ResolvedParams):
        return params
    if isinstance(params, Mapping):
        per_backend: dict[str, dict] = {"tpu": {}, "triton": {}, "gpu": {}}
        semantics = None
        for key, value in params.items():
            if key not in _DICT_KEYS:
                raise ValueError(
                    f"compiler_params: unknown key {key!r}; expected one of "
                    f"{sorted(_DICT_KEYS)} (for example dict(mosaic=dict("
                    "dimension_semantics=(...))))).")
            if not isinstance(value, Mapping):
                raise TypeError(f"compiler_params[{key!r}] must be a dict, got "
                                f"{type(value).__name__}.")
            value = dict(value)
            if "dimension_semantics" in value:
                semantics = value.pop("dimension_semantics")
            per_backend[_DICT_KEYS[key]].update(value)
        return ResolvedParams(_check_semantics(semantics), **per_backend)
    to_resolved = getattr(params, "_resolve", None)
    if to_resolved is not None:
        return to_resolved()
    if isinstance(params, CompilerParams):
        return ResolvedParams(_check_semantics(params.dimension_semantics))
    raise TypeError(
        "compiler_params: expected pallas_core.CompilerParams, a backend's "
        "CompilerParams (pallas_core.tpu / .triton / .gpu) or a dict such as "
        f"dict(mosaic=dict(dimension_semantics=...)); got {type(params).__name__}.")


def _check_semantics(semantics):
    if semantics is None:
        return None
    if isinstance(semantics, str):
        raise TypeError("dimension_semantics must be a sequence with one entry per grid "
                        f"axis, got the string {semantics!r}.")
    out = []
    for s in semantics:
        name = getattr(s, "value", s)  # accept enum-like values
        name = str(name).lower()
        if name not in _SEMANTICS:
            raise ValueError(f"dimension_semantics: {s!r} is not one of {_SEMANTICS}.")
        out.append(name)
    return tuple(out)


check_semantics = _check_semantics


@dataclasses.dataclass(frozen=True)
class InterpretParams:
    """How the interpreter simulates parallel hardware (``pallas_call(interpret=...)``).

    Args:
      num_cores: simulated cores (2, like a TPU megacore). The outermost
        ``"parallel"`` grid axis is split across them and each core's scratch
        starts as garbage, so a kernel that carries scratch across a parallel
        axis gives wrong results here, as it would on hardware. 1 runs the grid
        in plain sequential order.
      shuffle_seed: if set, each core runs its parallel grid points in a
        random order drawn from this seed (arbitrary axes keep their order),
        exposing kernels that depend on the order of parallel programs.
    """

    num_cores: int = 2
    shuffle_seed: int | None = None

    def __post_init__(self):
        if not isinstance(self.num_cores, int) or self.num_cores < 1:
            raise ValueError(f"InterpretParams: num_cores must be an int >= 1, got {self.num_cores!r}.")
