"""Where a Mosaic GPU kernel runs: JAX's Mosaic GPU lowering, or JAX's GPU interpret mode.

Decided once per call, before anything is traced (:func:`choose`):

* ``interpret=True`` or a ``InterpretGPUParams`` (or JAX's
  ``force_gpu_interpret_mode`` in force): the GPU interpret mode
  (:mod:`pallas_core.gpu.interpret`), race detection on unless the params
  given say otherwise.
* ``interpret=False``: JAX's Mosaic GPU lowering (on a GPU, refused as below
  when it is older than sm_90; on a host without a GPU it lowers for ``cuda``
  but cannot run).
* ``interpret=None`` (the default), by the default device:

  - a CUDA GPU of compute capability 9.0 or newer: JAX's Mosaic GPU lowering;
  - any other GPU (an older NVIDIA chip, ROCm): ``NotImplementedError``
    naming the device and sm_90, so a sequence of implementations falls back;
  - no GPU (CPU, TPU): :data:`BOTH`: the call runs in the interpret mode and
    *lowers* for ``cuda`` as JAX's Mosaic GPU kernel (``lax.platform_dependent``
    picks the branch when the computation is lowered; the ``cuda`` branch is
    what a GPU host would run). So ``jax.jit(f).trace(x).lower(
    lowering_platforms=("cuda",))`` checks the real lowering on the CPU host
    while ``f(x)`` runs the same kernel interpreted.

Mosaic GPU's lowering targets sm_90 when no GPU is present (JAX reads the
compute capability from the device; a CPU device has none, and JAX assumes
9.0), which is the chip the warpgroup primitives (``wgmma``, TMA, register
reallocation) exist on.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

MOSAIC = "mosaic"
INTERPRET = "interpret"
BOTH = "both"
MIN_COMPUTE_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class Choice:
    """How one call runs: ``kind`` (:data:`MOSAIC`, :data:`INTERPRET` or :data:`BOTH`)
    and, where the interpreter may run, its ``InterpretGPUParams``."""

    kind: str
    interpret_params: Any = None


def default_device():
    """The default device (a separate function so tests can stand in another)."""
    return jax.devices()[0]


def compute_capability(device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, None for anything else (ROCm's ``gfx...``)."""
    cc = getattr(device, "compute_capability", None)
    if not isinstance(cc, str) or cc.startswith("gfx"):
        return None
    try:
        major, minor = (int(v) for v in cc.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def check_gpu(device, what: str) -> None:
    """Refuses a GPU Mosaic GPU's warpgroup kernels do not run on.

    Raises:
      NotImplementedError: ``device`` is not a CUDA GPU of compute capability
        9.0 or newer; the message names the device and sm_90.
    """
    cc = compute_capability(device)
    kind = getattr(device, "device_kind", str(device))
    if cc is None:
        raise NotImplementedError(
            f"{what}: Mosaic GPU kernels need an NVIDIA GPU of compute capability 9.0 or newer "
            f"(sm_90, Hopper); the default device is {kind!r} "
            f"(compute capability {getattr(device, 'compute_capability', None)!r}).")
    if cc < MIN_COMPUTE_CAPABILITY:
        raise NotImplementedError(
            f"{what}: Mosaic GPU kernels (warpgroups, TMA, wgmma, register reallocation) need "
            f"sm_90 or newer; the default device {kind!r} is sm_{cc[0]}{cc[1]} (compute capability "
            f"{cc[0]}.{cc[1]}). Use another implementation on this GPU.")


def why_not_gpu(platform: str, device_kind: str, sm: str | None, what: str) -> str | None:
    """Why a GPU of ``device_kind`` cannot run Mosaic GPU's warpgroup kernels, or None.

    None also for another ``platform`` (a host without a GPU runs the kernels in the
    interpret mode). This process's own GPU, where it is of ``device_kind``, is asked
    for its compute capability (:func:`check_gpu`); another kind (a call resolved for
    another machine, say an H200 from a CPU host) is judged by its family's
    ``sm`` (``"sm_90"``; None: unknown, not refused)."""
    if platform != "gpu":
        return None
    device = default_device()
    if getattr(device, "device_kind", None) == device_kind:
        try:
            check_gpu(device, what)
        except NotImplementedError as e:
            return str(e)
        return None
    if sm is not None and sm[3:].isdigit() and int(sm[3:]) < 90:
        return (f"{what}: Mosaic GPU kernels (warpgroups, TMA, wgmma) need sm_90 or newer; "
                f"{device_kind!r} is {sm}")
    return None


def forced_interpret_params():
    """JAX's ``force_gpu_interpret_mode`` params in force, or None."""
    from jax._src import config
    value = config.pallas_tpu_interpret_mode_context_manager.value
    from pallas_core.gpu.interpret import InterpretGPUParams
    return value if isinstance(value, InterpretGPUParams) else None


def choose(interpret, what: str) -> Choice:
    """How a call with ``interpret`` (None, a bool or an ``InterpretGPUParams``) runs.

    Raises:
      TypeError: ``interpret`` of another kind.
      NotImplementedError: the default device is a GPU older than sm_90 (or not CUDA).
    """
    from pallas_core.gpu import interpret as interpret_mode
    if interpret is not None and not isinstance(interpret, (bool, interpret_mode.InterpretGPUParams)):
        raise TypeError(f"{what}: interpret must be None, a bool or an InterpretGPUParams, "
                        f"got {interpret!r}.")
    forced = forced_interpret_params()
    if interpret is True or isinstance(interpret, interpret_mode.InterpretGPUParams):
        return Choice(INTERPRET, interpret_mode.params_for(interpret))
    if forced is not None and interpret is None:
        return Choice(INTERPRET, interpret_mode.params_for(forced))
    device = default_device()
    if getattr(device, "platform", "") in ("gpu", "cuda", "rocm"):
        check_gpu(device, what)
        return Choice(MOSAIC)
    if interpret is False:  # lowering for a GPU from a host without one
        return Choice(MOSAIC)
    return Choice(BOTH, interpret_mode.params_for(True))
