"""``ops.resolve_implementation``: which implementation an op call runs by default, and why.

It runs nothing: the call is traced abstractly up to the op layer
(:func:`capture_call`), where the op has checked its arguments, and the
default's rule (:func:`ops._default.choose`) answers for it on the device
asked about.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from ops import _default, _op


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def capture_call(fn, args: Sequence = (), kwargs: Mapping | None = None, *,
                 differentiated: bool = False) -> _op.Call:
    """The checked :class:`ops._op.Call` that ``fn(*args, **kwargs)`` (a public op, or a
    function calling one) makes first, without running it: traced abstractly
    (``jax.eval_shape``; arrays and ``jax.ShapeDtypeStruct`` alike), stopped at
    :meth:`ops._op.Op.run`. With ``differentiated`` it is traced under ``jax.vjp`` over
    its float arrays (the "fwd+bwd" pass).

    Raises:
      ValueError: ``fn`` returned without calling an op.
      TypeError, ValueError: the op's own argument checks.
    """
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs or {})))
    where = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def call(*arrays):
        full = list(leaves)
        for i, a in zip(where, arrays):
            full[i] = a
        a, k = jax.tree.unflatten(tree, full)
        return fn(*a, **k)

    def traced(*arrays):
        if not differentiated:
            return call(*arrays)
        floats = [j for j, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.floating)]

        def of_floats(*values):
            full = list(arrays)
            for j, v in zip(floats, values):
                full[j] = v
            return call(*full)
        return jax.vjp(of_floats, *(arrays[j] for j in floats))[0]

    specs = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in where]
    with _op.capturing():
        try:
            jax.eval_shape(traced, *specs)
        except _op.CapturedCall as captured:
            return captured.call
    raise ValueError(f"{getattr(fn, '__name__', fn)!r} returned without calling a registered "
                     "op: nothing to resolve.")


def resolve_implementation(op_name: str, *args, device_kind: str | None = None,
                           differentiated: bool = False, **kwargs) -> _default.Choice:
    """The implementation ``ops.<op_name>(*args, **kwargs)`` runs by default, and why.

    Nothing is run or compiled: the op checks its arguments (arrays or
    ``jax.ShapeDtypeStruct``) and stops where it would pick an implementation.

    Args:
      op_name: a registered op's public name ("dot_product_attention", ...).
      *args, **kwargs: the op's arguments, as it takes them (no ``implementation``).
      device_kind: the device to answer for (``jax.Device.device_kind``, e.g.
        "NVIDIA H200"; "cpu"; "TPU v5 lite"); None: the default device.
      differentiated: answer for the call under ``jax.grad`` / ``jax.vjp`` (the
        "fwd+bwd" rankings) rather than for the forward alone.

    Returns:
      A :class:`ops._default.Choice`: ``implementation``, ``order`` (with fallbacks),
      ``rule`` and ``reason`` (the measurement, its run and times, or the rule).

    Raises:
      KeyError: no op ``op_name`` is registered.
      TypeError: ``implementation`` among the arguments.
      TypeError, ValueError: the op's argument checks.
      NotImplementedError: nothing can run the call by default.
    """
    op = _op.get(op_name)
    if "implementation" in kwargs:
        raise TypeError("resolve_implementation answers for implementation=None; drop "
                        "implementation= from the arguments.")
    call = capture_call(op.function, args, kwargs, differentiated=differentiated)
    if device_kind is not None:
        call = dataclasses.replace(call, target=_op.Target.of_kind(device_kind))
    return _default.choose(call.op, call)
