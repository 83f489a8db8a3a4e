"""``CostEstimate``: what a kernel costs, for schedulers that cannot see inside it.

XLA treats a custom call as opaque; Mosaic TPU (and Mosaic GPU) attach a
``pallas_call``'s estimate to it so XLA can overlap it with other work.
``pallas_call(cost_estimate=...)`` takes a :class:`CostEstimate` (JAX 0.10.2's
fields) or the dict form ``{"flops", "transcendentals", "bytes_accessed"}``;
JAX's own ``CostEstimate`` is accepted too. The interpreter and our Triton
lowering have no scheduler to tell, so there it is checked and unused.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class CostEstimate:
    """A kernel's cost, summed over the whole grid.

    Args:
      flops: floating-point (and integer) arithmetic operations.
      transcendentals: exp / log / tanh / ... evaluations.
      bytes_accessed: bytes read from and written to device memory (HBM).
      remote_bytes_transferred: bytes sent to other devices.

    Raises:
      TypeError: a field that is not a non-negative int.
    """

    flops: int
    transcendentals: int
    bytes_accessed: int
    remote_bytes_transferred: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                    or value < 0):
                raise TypeError(f"CostEstimate: {field.name} must be a non-negative int, "
                                f"got {value!r}.")
            object.__setattr__(self, field.name, int(value))


def as_cost_estimate(cost) -> CostEstimate | None:
    """Any accepted ``cost_estimate`` form as a :class:`CostEstimate` (None stays None).

    Raises:
      TypeError: an object that is none of the accepted forms, or bad field values.
      ValueError: a dict without ``flops`` / ``bytes_accessed`` or with unknown keys.
    """
    if cost is None or isinstance(cost, CostEstimate):
        return cost
    if isinstance(cost, Mapping):
        fields = {f.name for f in dataclasses.fields(CostEstimate)}
        unknown = set(cost) - fields
        if unknown or not {"flops", "bytes_accessed"} <= set(cost):
            raise ValueError(f"cost_estimate: expected a dict with flops, bytes_accessed and "
                             f"optionally transcendentals / remote_bytes_transferred, got keys "
                             f"{sorted(cost)}.")
        return CostEstimate(**{"transcendentals": 0, **cost})
    if all(hasattr(cost, f) for f in ("flops", "transcendentals", "bytes_accessed")):
        return CostEstimate(cost.flops, cost.transcendentals, cost.bytes_accessed,
                            getattr(cost, "remote_bytes_transferred", 0))  # JAX's CostEstimate
    raise TypeError(f"cost_estimate: expected pallas_core.CostEstimate, a dict or None, "
                    f"got {type(cost).__name__}.")
