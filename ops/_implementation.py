"""Choosing an op's implementation (shared by every op).

``implementation=None`` picks the best available for the default device's
platform and falls back to ``"xla"``; a named implementation is used as asked
(a Mosaic or Triton implementation on hardware that lacks it fails when JAX
lowers it).
"""
from __future__ import annotations

from pallas_core.backends import default_backend

IMPLEMENTATIONS = ("xla", "interpret", "triton", "mosaic_tpu", "mosaic_gpu", "pallas_triton")


def platform_default() -> str:
    """The op-level default for the default device's platform: pallas_call's default
    backend there (:func:`pallas_core.backends.default_backend`: gpu -> triton, tpu ->
    mosaic_tpu), except where that is the interpreter (a CPU, or an unknown platform):
    no kernel backend is fast there, so XLA's own ops are best (docs/design.md §2)."""
    backend = default_backend()
    return "xla" if backend == "interpret" else backend


KERNEL_BACKENDS = ("interpret", "triton", "pallas_triton", "mosaic_tpu")


def resolve_implementation(implementation: str | None, op: str, *,
                           kernel_backends=KERNEL_BACKENDS, missing_reason: str = "") -> str:
    """The implementation to run for ``op``.

    Args:
      kernel_backends: the pallas_core backends ``op`` has kernels for.
      missing_reason: why a backend outside ``kernel_backends`` is missing,
        appended to the error.

    Raises:
      ValueError: an unknown name.
      NotImplementedError: a backend ``op`` has no kernel for.
    """
    if implementation is None:
        return platform_default()
    if not isinstance(implementation, str) or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}.")
    if implementation != "xla" and implementation not in kernel_backends:
        raise NotImplementedError(
            f"{op}: implementation={implementation!r} has no kernel yet{missing_reason}; "
            f"available: 'xla', {', '.join(repr(b) for b in kernel_backends)}.")
    return implementation
