"""Describing user functions (kernels, index maps) in error messages.

Kernels and index maps are called positionally by pallas_call, so their arity
is checked before anything is traced, and a mismatch is reported in the words
Python itself uses for a bad call (``missing 2 required positional arguments:
'i' and 'j'``), which is also what JAX's Pallas reports.
"""
from __future__ import annotations

import inspect


def function_source(fn) -> str:
    """``"name at file:line"`` of a Python function (its name alone for other callables)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    code = getattr(fn, "__code__", None)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


def _quoted(names) -> str:
    names = [f"'{n}'" for n in names]
    if len(names) <= 2:
        return " and ".join(names)
    return ", ".join(names[:-1]) + ", and " + names[-1]


def arity_error(fn, n_args: int) -> str | None:
    """Why ``fn`` cannot be called with ``n_args`` positional arguments, in
    Python's words, or None if it can (or its signature cannot be read)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    name = getattr(fn, "__name__", "function")
    if n_args < len(required):
        missing = [p.name for p in required[n_args:]]
        s = "s" if len(missing) != 1 else ""
        return f"{name}() missing {len(missing)} required positional argument{s}: {_quoted(missing)}"
    if n_args > len(positional):
        if len(required) == len(positional):
            takes = f"{len(positional)} positional argument{'s' if len(positional) != 1 else ''}"
        else:
            takes = f"from {len(required)} to {len(positional)} positional arguments"
        was = "was" if n_args == 1 else "were"
        return f"{name}() takes {takes} but {n_args} {was} given"
    return None
