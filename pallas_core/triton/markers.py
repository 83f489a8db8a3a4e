"""Named calls that carry Triton-only meaning through the kernel's jaxpr.

While our Triton lowering traces a kernel, operations a jaxpr cannot say by
itself (a load whose mask must reach the pointer access, a cache hint, a
barrier, an approximate tanh) are small jitted functions with recognisable
names, as the atomics are (:mod:`pallas_core.triton.atomics`). The code
writer (:mod:`pallas_core.triton.codegen`) reads the name and emits the
Triton spelling. Each body computes the operation without the Triton-only
part, and these calls are only made under our Triton lowering (other backends
run the plain operation), so no other backend ever sees them:

* ``pallas_core_load[__hint...]`` ``(mask, other, view)``: the body is
  ``view[...]`` (``view`` is ``ref.at[index]``); the writer loads with ``mask`` / ``other`` folded into the
  pointer access (masked-off lanes are not read, so they may run past the
  edge), and with the hints of the name (``__cache_modifier_cg``,
  ``__eviction_policy_evict_last``, ``__volatile``);
* ``pallas_core_store[__hint...]`` ``(value, mask, view)``: the body is
  ``view[...] = value``; the writer stores only where ``mask`` holds;
* ``pallas_core_hint_multiple_of__16_16`` / ``..._max_contiguous__...``
  ``(x)``: identity; ``tl.multiple_of`` / ``tl.max_contiguous``;
* ``pallas_core_approx_tanh`` ``(x)``: ``tanh``; ``tanh.approx`` on a GPU;
* ``pallas_core_debug_barrier`` ``()``: nothing; ``tl.debug_barrier()``;
* ``pallas_core_debug_print__<hex of the prefix>`` ``(*values)``: nothing;
  ``tl.device_print(prefix, *values)``;
* ``pallas_core_roll__<axis>[__<stride>_<stride_axis>]`` ``(x, shift)``:
  ``pltpu.roll``; ``tl.gather`` along ``axis`` at the rolled positions;
* ``pallas_core_math__<helper>`` ``(*xs)``: a portable formula of a function
  no JAX primitive names (gelu's tanh form); the writer calls the jit helper
  ``_<helper>`` of :mod:`pallas_core.triton.jit_helpers` instead, as it does
  for ``lax.logistic`` (``_sigmoid``).
"""
from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp

from pallas_core import indexing, registry
from pallas_core.rolling import rolled

PREFIX = "pallas_core_"
LOAD = PREFIX + "load"
STORE = PREFIX + "store"
HINT = PREFIX + "hint_"
APPROX_TANH = PREFIX + "approx_tanh"
DEBUG_BARRIER = PREFIX + "debug_barrier"
DEBUG_PRINT = PREFIX + "debug_print__"
ROLL = PREFIX + "roll__"
MATH = PREFIX + "math__"


def _named(fn, name, **jit_kw):
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, **jit_kw)


def _hint_suffix(hints) -> str:
    """``(("cache_modifier", ".cg"), ("volatile", True))`` -> ``"__cache_modifier_cg__volatile"``."""
    parts = []
    for key, value in hints:
        parts.append(key if value is True else f"{key}_{str(value).lstrip('.')}")
    return "".join("__" + p for p in parts)


def parse_hints(name: str, base: str) -> dict:
    """The hints encoded in a marker name by :func:`_hint_suffix`."""
    out: dict = {}
    for part in name[len(base):].split("__")[1:]:
        if part == "volatile":
            out["volatile"] = True
        elif part.startswith("cache_modifier_"):
            out["cache_modifier"] = "." + part[len("cache_modifier_"):]
        elif part.startswith("eviction_policy_"):
            out["eviction_policy"] = part[len("eviction_policy_"):]
    return out


@functools.lru_cache(maxsize=None)
def _load_fn(suffix):
    def body(mask, other, view):
        return view[...]
    return _named(body, LOAD + suffix)


@functools.lru_cache(maxsize=None)
def _store_fn(suffix):
    def body(value, mask, view):
        view[...] = value
    return _named(body, STORE + suffix)


def load(ref, idx, mask, other, hints):
    """A masked load under our Triton lowering (see the module docstring)."""
    view = ref.at[idx]  # a Ref with its views: a pytree a jitted function takes
    mask = jnp.bool_(True) if mask is None else indexing.broadcast_mask(mask, view.shape, "load")
    other = jnp.zeros((), ref.dtype) if other is None else jnp.asarray(other, ref.dtype)
    if other.shape:
        other = jnp.broadcast_to(other, view.shape)
    return _load_fn(_hint_suffix(hints))(mask, other, view)


def store(ref, idx, value, mask, hints):
    """A masked store under our Triton lowering (see the module docstring)."""
    view = ref.at[idx]
    value = indexing.value_for(value, view.shape, ref.dtype, "store")
    mask = jnp.bool_(True) if mask is None else indexing.broadcast_mask(mask, view.shape, "store")
    _store_fn(_hint_suffix(hints))(value, mask, view)


@functools.lru_cache(maxsize=None)
def _hint_fn(kind, values):
    return _named(lambda x: x, f"{HINT}{kind}__" + "_".join(map(str, values)))


def hint(kind: str, x, values: tuple[int, ...]):
    """``x``, marked with ``tl.<kind>(x, values)`` for the code writer."""
    return _hint_fn(kind, tuple(values))(x)


def parse_hint(name: str) -> tuple[str, list[int]]:
    kind, _, values = name[len(HINT):].partition("__")
    return kind, [int(v) for v in values.split("_")]


approx_tanh = _named(lambda x: jnp.tanh(x), APPROX_TANH)


def _barrier():
    return None


debug_barrier = _named(_barrier, DEBUG_BARRIER)


@functools.lru_cache(maxsize=None)
def _print_fn(prefix: str):
    def body(*values):
        return None
    return _named(body, DEBUG_PRINT + prefix.encode().hex())


def debug_print(prefix: str, *values) -> None:
    """``tl.device_print(prefix, *values)`` under our Triton lowering (the prefix is
    carried, hex-encoded, in the marker's name)."""
    _print_fn(prefix)(*values)


def _prefixes(fmt: str) -> list[str]:
    """The text before each ``{}`` of ``fmt``: the prefixes of Triton's prints.

    Raises:
      ValueError: a format spec or conversion, or text after the last ``{}``.
    """
    prefixes, text = [], ""
    for literal, field, spec, conversion in string.Formatter().parse(fmt):
        text += literal
        if field is None:
            continue
        if spec or conversion or field:
            raise ValueError(f"debug_print: fmt {fmt!r}: on the triton backend placeholders are "
                             "bare {} (tl.device_print cannot format values).")
        prefixes.append(text)
        text = ""
    if text.strip():
        raise ValueError(f"debug_print: fmt {fmt!r}: on the triton backend text after the last "
                         "{} cannot be printed (tl.device_print prints a prefix, then the value).")
    return prefixes


def print_values(fmt: str, placeholders: int, values) -> None:
    """``pl.debug_print`` under our Triton lowering (:mod:`pallas_core.debugging`): one
    print of every value with ``fmt`` as the prefix when ``fmt`` has no placeholder,
    else one print per value whose prefix is the text before its ``{}``."""
    if not placeholders:
        debug_print(fmt, *values)
        return
    for prefix, value in zip(_prefixes(fmt), values):
        debug_print(prefix, value)


def print_prefix(name: str) -> str:
    return bytes.fromhex(name[len(DEBUG_PRINT):]).decode()


@functools.lru_cache(maxsize=None)
def _roll_fn(axis: int, stride: int | None, stride_axis: int | None):
    def body(x, shift):
        return rolled(x, shift, axis, stride, stride_axis)

    strided = "" if stride is None else f"__{stride}_{stride_axis}"
    return _named(body, f"{ROLL}{axis}{strided}")


def roll(x, shift, axis: int, stride: int | None, stride_axis: int | None):
    """``pltpu.roll`` under our Triton lowering (arguments already checked)."""
    return _roll_fn(axis, stride, stride_axis)(x, jnp.asarray(shift, jnp.int32))


def parse_roll(name: str) -> tuple[int, int | None, int | None]:
    """``(axis, stride, stride_axis)`` of a roll marker's name."""
    parts = name[len(ROLL):].split("__")
    if len(parts) == 1:
        return int(parts[0]), None, None
    stride, stride_axis = parts[1].split("_")
    return int(parts[0]), int(stride), int(stride_axis)


@functools.lru_cache(maxsize=None)
def _math_fn(helper: str, formula):
    return _named(lambda *xs: formula(*xs), MATH + helper)


def math_helper(helper: str, formula, *xs):
    """``formula(*xs)`` under our Triton lowering, which computes it with the jit helper
    ``_<helper>`` (a key of :data:`pallas_core.triton.jit_helpers.MATH`, taking and
    returning float32) instead; ``xs`` must be float32 arrays of one shape."""
    return _math_fn(helper, formula)(*xs)


def is_marker(name: str) -> bool:
    return name.startswith((LOAD, STORE, HINT, APPROX_TANH, DEBUG_BARRIER, DEBUG_PRINT, ROLL, MATH))


__all__ = ["approx_tanh", "debug_barrier", "debug_print", "hint", "is_marker", "load", "math_helper",
           "parse_hint", "parse_hints", "parse_roll", "print_prefix", "roll", "store"]


# The primitives whose Triton meaning these markers carry (pallas_core.registry).
registry.register_rule("load", "triton", load)
registry.register_rule("store", "triton", store)
registry.register_rule("multiple_of", "triton", lambda x, values: hint("multiple_of", x, values))
registry.register_rule("roll", "triton", roll)
registry.register_rule("debug_print", "triton", print_values)
registry.register_rule("math_helper", "triton", math_helper)
