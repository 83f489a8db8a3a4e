"""Running Mosaic GPU kernels on the CPU: JAX's GPU interpret mode, as pallas_core uses it.

JAX 0.10.2 interprets a Mosaic GPU kernel (``InterpretGPUParams`` as the
``interpret=`` of its ``pallas_call`` / ``plgpu.kernel``) by running the
kernel's jaxpr with one Python thread per warpgroup, GMEM and SMEM buffers,
mbarriers and TMA copies simulated, and, with ``detect_races=True``, a
vector-clock race detector over every access. pallas_core runs kernels there
(:mod:`pallas_core.gpu.target` says when) with:

* race detection on by default (``interpret=True`` means
  ``InterpretGPUParams(detect_races=True)``; given params are kept as given);
* a detected race failing the call: :class:`RaceError` (an exception inside
  ``jax.jit``'s computation surfaces as JAX's ``JaxRuntimeError`` whose
  message holds ``pallas_core.gpu.RaceError`` and the kernel's name; a call
  outside ``jit`` raises :class:`RaceError` itself);
* the additions of :mod:`pallas_core.gpu.interpreter_fixes` (TMA edges and
  predicates, races through TMA stores and ``wgmma``, recovery after a failed
  kernel);
* the pallas_core names the interpreter cannot run as JAX binds them
  (``plgpu.load``, ``layout_cast``, a ``wgmma`` with its left operand in
  registers, ``pl.run_state`` over accumulators...) spelled in what it runs
  (:mod:`pallas_core.gpu.primitives`).
"""
from __future__ import annotations

import jax

from pallas_core.gpu import interpreter_fixes
from pallas_core.gpu.interpreter_fixes import RaceError

__all__ = ["InterpretGPUParams", "RaceError", "force_gpu_interpret_mode", "params_for", "prepare",
           "run_checked"]


def __getattr__(name):
    if name in ("InterpretGPUParams", "force_gpu_interpret_mode"):
        from jax._src.pallas.mosaic_gpu.interpret import params
        return getattr(params, name)
    raise AttributeError(name)


def params_for(interpret):
    """The ``InterpretGPUParams`` a kernel interpreted with ``interpret`` runs under.

    ``True``: ``InterpretGPUParams(detect_races=True)``. Params given are used as
    given (a race fails the call when they detect races). Either way the
    result is :func:`pallas_core.gpu.interpreter_fixes.mark`\\ ed.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    if interpret is True:
        interpret = InterpretGPUParams(detect_races=True)
    elif not isinstance(interpret, InterpretGPUParams):
        raise TypeError(f"interpret: expected True or an InterpretGPUParams, got {interpret!r}.")
    return interpreter_fixes.mark(interpret)


def prepare() -> None:
    """Installs :mod:`pallas_core.gpu.interpreter_fixes` (once) before a kernel is traced."""
    interpreter_fixes.apply()


def run_checked(fn, *args):
    """``fn(*args)``; called outside a trace, it waits for the result and raises a
    race the interpreter found as :class:`RaceError` (inside ``jit`` the error
    surfaces where the computation runs, as JAX's ``JaxRuntimeError``)."""
    try:
        out = fn(*args)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(out)):
            return out
        return jax.block_until_ready(out)
    except jax.errors.JaxRuntimeError as e:
        text = str(e)
        marker = "pallas_core.gpu.RaceError: "
        if marker in text:
            raise RaceError(text[text.index(marker) + len(marker):].strip()) from e
        raise
