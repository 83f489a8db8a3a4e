"""``pl.debug_print``: print values from inside a kernel (JAX 0.10.2's meaning).

``debug_print(fmt, *args)``: ``fmt`` holds one ``{}`` placeholder per value, or
none, in which case the values are printed after it, separated by spaces.
The interpreter prints once per grid point, in execution order, through
``jax.debug.print``. The Mosaic and pallas_triton backends get JAX's own
``debug_print`` (whose format rules per backend JAX documents). Our Triton
lowering emits ``tl.device_print``, which cannot format: it prints a prefix
and then each value (every element of a tensor), with the program's id. A
``fmt`` without placeholders is the prefix of all the values; with
placeholders, each value is printed by its own ``tl.device_print`` whose
prefix is the text before its ``{}`` (so text after the last ``{}``, format
specs and conversions cannot be honoured there and raise ValueError). Triton's
CPU interpreter prints ``(x, y, z) prefix: value`` per value, ``(x, y, z)``
being the launch program's id.
"""
from __future__ import annotations

import string

import jax
import jax.numpy as jnp

from pallas_core import registry
from pallas_core.primitives import _backend


def _placeholders(fmt: str) -> int:
    return sum(field is not None for _, field, _, _ in string.Formatter().parse(fmt))


def debug_print(fmt: str, *args) -> None:
    """Prints ``fmt`` formatted with ``args`` from inside a kernel.

    Args:
      fmt: a ``str`` with one ``{}`` per value, or no placeholder at all.
      args: arrays or scalars (maybe traced).

    Raises:
      TypeError: ``fmt`` that is not a str.
      ValueError: a placeholder count that is neither 0 nor ``len(args)``; on our
        triton backend, what ``tl.device_print`` cannot say (see the module docstring).
      NotImplementedError: on our triton backend, a value whose shape is not all powers
        of two (Triton would print its padding lanes).
    """
    if not isinstance(fmt, str):
        raise TypeError(f"debug_print: fmt must be a str, got {type(fmt).__name__}.")
    n = _placeholders(fmt)
    if n not in (0, len(args)):
        raise ValueError(f"debug_print: fmt {fmt!r} has {n} placeholder(s) for {len(args)} "
                         "value(s); give one {} per value, or none.")
    backend = _backend()
    if backend in ("mosaic_tpu", "mosaic_gpu", "pallas_triton"):
        from jax.experimental import pallas as jpl
        jpl.debug_print(fmt, *args)
        return
    rule = registry.rule("debug_print", backend)  # our triton backend: tl.device_print
    if rule is not None:
        rule(fmt, n, [jnp.asarray(a) for a in args])
        return
    if n == 0 and args:
        fmt = " ".join([fmt] + ["{}"] * len(args))
    jax.debug.print(fmt, *args)
