"""Choosing an op's implementation (shared by every op and layer).

``implementation=`` is None, a name from :data:`IMPLEMENTATIONS`, or a
non-empty sequence of names tried in order (docs/design.md §5.2):

- None: the op's default. On a CPU that is ``"xla"`` (no kernel backend is
  fast there); on a GPU the fastest implementation measured for the call that
  can run it, ours or the user's own alternatives (``xla``, ``cudnn``), from
  the rankings shipped beside the tuning cache (:mod:`ops._default`,
  :mod:`ops.tuning.rankings`); on a TPU ``mosaic_tpu``.
  ``ops.resolve_implementation`` says which, and why.
- A name is used as asked (a Mosaic or Triton implementation on hardware
  that lacks it fails when JAX lowers it).
- A sequence, such as ``("mosaic_gpu", "triton", "xla")``: an implementation
  that cannot run this call raises :class:`NotImplementedError` while the op
  is called (no kernel for that backend, an option its kernels refuse) and
  the next one is tried; when none can, the last error is raised. Errors of
  any other kind propagate at once. Failures that only appear when JAX later
  lowers or compiles a traced call (under ``jit``) are past the op and are
  not caught.

:func:`check_implementation` validates the argument before anything is
traced. The registered ops run their implementations through
:meth:`ops._op.Op.run`; :func:`run_implementation` is the same loop for code
that is not an op (the layers), its None being :func:`platform_default`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pallas_core.backends import backend_traits, default_backend

# "xla": the op's XLA reference; "cudnn": cuDNN's flash attention through
# jax.nn.dot_product_attention (attention only); the others: pallas_core backends.
IMPLEMENTATIONS = ("xla", "interpret", "triton", "mosaic_tpu", "mosaic_gpu", "pallas_triton",
                   "cudnn")

KERNEL_BACKENDS = ("interpret", "triton", "pallas_triton", "mosaic_tpu")

# What ``implementation=`` takes.
ImplementationArg = str | Sequence[str] | None

_R = TypeVar("_R")


def platform_default() -> str:
    """The op-level default for the default device's platform: pallas_call's default
    backend there (:func:`pallas_core.backends.default_backend`: gpu -> triton, tpu ->
    mosaic_tpu), except where that is the interpreter (a CPU, or an unknown platform):
    no kernel backend is fast there, so XLA's own ops are best (docs/design.md §2)."""
    backend = default_backend()
    return "xla" if backend_traits(backend).interpreted else backend


def check_implementation(implementation, op: str) -> str | tuple[str, ...] | None:
    """Validates ``implementation=`` without resolving it.

    Returns:
      None, the name, or the sequence as a tuple of names (hashable, so a layer
      can keep it as a Flax attribute or dataclass field).

    Raises:
      ValueError: an unknown name, an empty sequence, or anything that is not
        None, a string or a sequence of strings; the message names
        ``implementation`` and ``op``.
    """
    if implementation is None:
        return None
    if isinstance(implementation, str):
        names = (implementation,)
    elif isinstance(implementation, Sequence) and not isinstance(implementation, bytes):
        names = tuple(implementation)
    else:
        names = ()
    if (not names or not all(isinstance(n, str) and n in IMPLEMENTATIONS for n in names)):
        raise ValueError(f"{op}: implementation must be None or one of {IMPLEMENTATIONS}, or a "
                         f"non-empty sequence of them tried in order; got {implementation!r}.")
    return implementation if isinstance(implementation, str) else names


def _candidates(implementation) -> tuple[str, ...]:
    if implementation is None:
        return (platform_default(),)
    return (implementation,) if isinstance(implementation, str) else tuple(implementation)


def _require_kernel(name: str, op: str, kernel_backends, missing_reason: str) -> str:
    if name != "xla" and name not in kernel_backends:
        raise NotImplementedError(
            f"{op}: implementation={name!r} has no kernel yet{missing_reason}; "
            f"available: 'xla', {', '.join(repr(b) for b in kernel_backends)}.")
    return name


def run_implementation(implementation, op: str, body: Callable[[str], _R], *,
                       kernel_backends: Sequence[str] = KERNEL_BACKENDS,
                       missing_reason: str = "") -> _R:
    """Runs ``body(name)`` for the first implementation in ``implementation`` that can run.

    Args:
      implementation: the op's ``implementation=`` argument (see the module docstring).
      op: the op's name, for messages.
      body: the op's work for one resolved implementation name; it raises
        NotImplementedError when that implementation cannot run this call.
      kernel_backends: the pallas_core backends ``op`` has kernels for; any other
        name but ``"xla"`` raises NotImplementedError (and the next is tried).
      missing_reason: why a backend outside ``kernel_backends`` is missing,
        appended to that error.

    Returns:
      What ``body`` returned for the first name that ran.

    Raises:
      ValueError: a bad ``implementation`` (from :func:`check_implementation`),
        before ``body`` runs.
      NotImplementedError: the last one raised, when no name could run.
    """
    check_implementation(implementation, op)
    error = None
    for name in _candidates(implementation):
        try:
            return body(_require_kernel(name, op, kernel_backends, missing_reason))
        except NotImplementedError as e:
            error = e
    raise error
