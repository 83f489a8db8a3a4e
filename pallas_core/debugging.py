"""``pl.debug_print``: print values from inside a kernel (JAX 0.10.2's meaning).

``debug_print(fmt, *args)``: ``fmt`` holds one ``{}`` placeholder per value, or
none, in which case the values are printed after it, separated by spaces.
The interpreter prints once per grid point, in execution order, through
``jax.debug.print``. The Mosaic and pallas_triton backends get JAX's own
``debug_print`` (whose format rules per backend JAX documents). Our Triton
lowering has no printing (Triton's ``device_print`` would need a GPU to run
and its own format), so it raises NotImplementedError.
"""
from __future__ import annotations

import string

import jax

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
      ValueError: a placeholder count that is neither 0 nor ``len(args)``.
      NotImplementedError: on our triton backend.
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
    if backend == "triton":
        raise NotImplementedError("debug_print: our triton backend cannot print from a kernel; "
                                  "run the kernel with interpret=True to print.")
    if n == 0 and args:
        fmt = " ".join([fmt] + ["{}"] * len(args))
    jax.debug.print(fmt, *args)
