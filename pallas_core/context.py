"""Which lowering is in progress: backend-neutral primitives dispatch on it.

``pallas_call`` installs a :class:`KernelContext` while the kernel body is
traced. ``program_id``/``num_programs``/``run_scoped`` ask the innermost one,
so a kernel written once runs on the interpreter (grid indices supplied
directly) and on JAX's Pallas lowerings (their primitives called).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

_CURRENT: contextvars.ContextVar["KernelContext | None"] = contextvars.ContextVar(
    "pallas_core_kernel_context", default=None)


class KernelContext:
    """Interface of a lowering's kernel-side services."""

    backend: str = ""

    def program_id(self, axis: int) -> Any:
        raise NotImplementedError

    def num_programs(self, axis: int) -> Any:
        raise NotImplementedError

    def run_scoped(self, body, scratch_shapes) -> Any:
        raise NotImplementedError

    def run_scoped_named(self, body, scratch_shapes, named, collective_axes) -> Any:
        """``run_scoped`` with keyword scratch (``body(*refs, **named_refs)``) and JAX's
        ``collective_axes`` (one allocation shared along those axes: Mosaic GPU's
        warpgroups, which only its context has)."""
        if collective_axes:
            raise NotImplementedError(
                f"run_scoped: collective_axes={collective_axes!r} share scratch between the "
                f"warpgroups of a Mosaic GPU kernel; the {self.backend} backend has none.")
        n, names = len(scratch_shapes), list(named)
        return self.run_scoped(lambda *refs: body(*refs[:n], **dict(zip(names, refs[n:]))),
                               tuple(scratch_shapes) + tuple(named.values()))

    def run_state(self, fn, init) -> Any:
        """``pl.run_state(fn)(init)``: JAX's, whose Refs every discharging backend takes."""
        from jax.experimental import pallas as jpl
        return jpl.run_state(fn)(init)


def backend() -> str:
    """The backend of the kernel being traced ("" outside a kernel)."""
    ctx = _CURRENT.get()
    return ctx.backend if ctx is not None else ""


def current() -> KernelContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "pallas_core: program_id/num_programs/run_scoped can only be used inside "
            "a kernel that pallas_core.pallas_call is tracing.")
    return ctx


# While set (by a code generator tracing an index map), what the index maps of a
# scalar-prefetch call (:mod:`pallas_core.tpu_prefetch`) get in place of the scalar
# arrays they close over.
_SCALAR_REFS: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("scalar_refs",
                                                                            default=None)


@contextlib.contextmanager
def scalar_refs(refs):
    """Index maps bound by :func:`pallas_core.tpu_prefetch.prefetching_call` read ``refs``
    (Refs traced by a code generator) instead of the scalar arrays of the call, within
    this context."""
    token = _SCALAR_REFS.set(tuple(refs))
    try:
        yield
    finally:
        _SCALAR_REFS.reset(token)


def prefetched_scalar_refs() -> tuple | None:
    """The Refs :func:`scalar_refs` installed, or None outside it."""
    return _SCALAR_REFS.get()


@contextlib.contextmanager
def installed(ctx: KernelContext):
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
