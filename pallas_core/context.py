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


def current() -> KernelContext:
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "pallas_core: program_id/num_programs/run_scoped can only be used inside "
            "a kernel that pallas_core.pallas_call is tracing.")
    return ctx


@contextlib.contextmanager
def installed(ctx: KernelContext):
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
