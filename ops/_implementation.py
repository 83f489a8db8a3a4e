"""Choosing an op's implementation (shared by every op).

``implementation=None`` picks the best available for the default device's
platform and falls back to ``"xla"``; a named implementation is used as asked
(a Mosaic or Triton implementation on hardware that lacks it fails when JAX
lowers it).
"""
from __future__ import annotations

import jax

IMPLEMENTATIONS = ("xla", "interpret", "triton", "mosaic_tpu", "mosaic_gpu", "pallas_triton")

# Our own Triton lowering is not built yet: GPUs use JAX's Pallas Triton
# lowering until it is. CPUs have no fast kernel backend, so XLA is best there.
_PLATFORM_DEFAULT = {"cpu": "xla", "gpu": "pallas_triton", "cuda": "pallas_triton",
                     "tpu": "mosaic_tpu"}


def resolve_implementation(implementation: str | None, op: str) -> str:
    """The implementation to run for ``op``.

    Raises:
      ValueError: an unknown name.
      NotImplementedError: ``"triton"`` until our own Triton lowering lands.
    """
    if implementation is None:
        return _PLATFORM_DEFAULT.get(jax.default_backend(), "xla")
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}.")
    if implementation == "triton":
        raise NotImplementedError(
            f"{op}: implementation='triton' (pallas_core's own Triton lowering) is not built "
            "yet; use 'pallas_triton' (JAX's Pallas Triton lowering) on GPUs meanwhile.")
    return implementation
