"""Backend registry and the platform default (docs/design.md §3.1)."""
from __future__ import annotations

import jax

from pallas_core import batching, registry
from pallas_core.traits import BackendTraits

BACKENDS = ("interpret", "triton", "mosaic_tpu", "mosaic_gpu", "pallas_triton")
JAX_PALLAS_BACKENDS = ("mosaic_tpu", "mosaic_gpu", "pallas_triton")
# Backends whose kernels become Triton: power-of-two tiles, num_warps / num_stages
# (the same as backend_traits(name).triton, which the ops ask instead).
TRITON_BACKENDS = ("triton", "pallas_triton")

# GPUs default to our own Triton lowering; JAX's ("pallas_triton") is the yardstick.
# The only platform-default table: the ops' default implementation derives from it
# (ops._implementation.platform_default: the same, with XLA where this says interpret).
_PLATFORM_DEFAULT = {"cpu": "interpret", "gpu": "triton", "cuda": "triton", "tpu": "mosaic_tpu"}


def default_backend() -> str:
    """The backend for the default device's platform (cpu -> interpret)."""
    return _PLATFORM_DEFAULT.get(jax.default_backend(), "interpret")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}.")
    return backend


def backend_traits(backend: str) -> BackendTraits:
    """What ``backend`` declared about itself when it registered
    (:class:`pallas_core.traits.BackendTraits`): the facts the ops choose tiles,
    walks and launch parameters by, rather than comparing backend names.

    Raises:
      ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    return registry.traits(check_backend(backend))


def choose(backend: str | None, interpret) -> str:
    """The backend a pallas_call runs on: interpret when ``interpret`` is not False,
    else ``backend``, else the platform default."""
    if interpret is not False:
        return "interpret"
    return check_backend(backend) if backend is not None else default_backend()


def run(call, args):
    """Runs a resolved call on its backend (the runner its module registered,
    :mod:`pallas_core.registry`).

    On our own backends (interpret, triton) ``vmap`` adds a batch grid axis
    (:mod:`pallas_core.batching`) instead of batching what the backend emits:
    the kernel body is never batched by JAX, so ``pl.when`` stays a branch and
    control flow inside the kernel keeps its shape (JAX's batching of a
    discharged ``fori_loop`` body trips its own checker under
    ``jax_enable_checks``).
    """
    entry = registry.runner(call.backend)
    if entry.batch_grid:
        return batching.batched_run(call, args, entry.run)
    return entry.run(call, args)
