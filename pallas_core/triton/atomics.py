"""Atomic read-modify-write on Refs: ``atomic_add``, ``max``, ``min``, ``and``, ``or``,
``xor``, ``xchg``, ``cas``.

Each atomic is a small jitted read-modify-write named ``pallas_core_atomic_<op>``.
Backends that run programs one after another (the interpreter) execute the
body as it is, which is atomic there; our Triton code generator recognises the
name and emits ``tl.atomic_<op>`` instead. All return the values the memory
held before the update.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from pallas_core import registry

ATOMIC_PREFIX = "pallas_core_atomic_"
registry.register_atomic_prefix(ATOMIC_PREFIX)  # call.py asks for it to choose grid semantics

_UPDATES = {
    "add": lambda old, val, cmp: old + val,
    "max": lambda old, val, cmp: jnp.maximum(old, val),
    "min": lambda old, val, cmp: jnp.minimum(old, val),
    "and": lambda old, val, cmp: old & val,
    "or": lambda old, val, cmp: old | val,
    "xor": lambda old, val, cmp: old ^ val,
    "xchg": lambda old, val, cmp: val,
    "cas": lambda old, val, cmp: jnp.where(old == cmp, val, old),
}


def _make_body(op):
    def body(ref, val, mask, cmp, *index_leaves, treedef):
        idx = jax.tree.unflatten(treedef, index_leaves)
        old = ref[idx]
        new = _UPDATES[op](old, jnp.asarray(val, old.dtype), jnp.asarray(cmp, old.dtype))
        ref[idx] = jnp.where(mask, new, old)
        return old

    body.__name__ = body.__qualname__ = ATOMIC_PREFIX + op
    return jax.jit(body, static_argnames=("treedef",))


_BODIES = {op: _make_body(op) for op in _UPDATES}


_BITWISE = ("and", "or", "xor")


def _atomic(op, ref, idx, val, mask, cmp):
    if op in _BITWISE and not jnp.issubdtype(ref.dtype, jnp.integer):
        raise TypeError(f"atomic_{op}: the Ref must hold integers (int32, uint32, int64, "
                        f"uint64), got {ref.dtype}.")
    if not isinstance(idx, tuple):
        idx = (idx,)
    leaves, treedef = jax.tree.flatten(idx)
    mask = jnp.asarray(True) if mask is None else mask
    cmp = jnp.zeros((), jnp.int32) if cmp is None else cmp
    return _BODIES[op](ref, val, mask, cmp, *leaves, treedef=treedef)


def atomic_add(ref, idx, val, *, mask=None):
    """``ref[idx] += val`` atomically; returns the old values."""
    return _atomic("add", ref, idx, val, mask, None)


def atomic_max(ref, idx, val, *, mask=None):
    """``ref[idx] = max(ref[idx], val)`` atomically; returns the old values."""
    return _atomic("max", ref, idx, val, mask, None)


def atomic_min(ref, idx, val, *, mask=None):
    """``ref[idx] = min(ref[idx], val)`` atomically; returns the old values."""
    return _atomic("min", ref, idx, val, mask, None)


def atomic_and(ref, idx, val, *, mask=None):
    """``ref[idx] &= val`` atomically (integers); returns the old values."""
    return _atomic("and", ref, idx, val, mask, None)


def atomic_or(ref, idx, val, *, mask=None):
    """``ref[idx] |= val`` atomically (integers); returns the old values."""
    return _atomic("or", ref, idx, val, mask, None)


def atomic_xor(ref, idx, val, *, mask=None):
    """``ref[idx] ^= val`` atomically (integers); returns the old values."""
    return _atomic("xor", ref, idx, val, mask, None)


def atomic_xchg(ref, idx, val, *, mask=None):
    """Stores ``val`` at ``ref[idx]`` atomically; returns the old values."""
    return _atomic("xchg", ref, idx, val, mask, None)


def atomic_cas(ref, idx, cmp, val):
    """Where ``ref[idx] == cmp``, stores ``val``, atomically; returns the old values."""
    return _atomic("cas", ref, idx, val, None, cmp)


__all__ = ["atomic_add", "atomic_and", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
           "atomic_xchg", "atomic_xor"]
