"""The shared test battery an op family's tests get by subclassing.

An op is described once, by an :class:`OpSpec`: the op, its reference (the
same math in XLA, run on float32 copies of the inputs), an input generator
(NumPy's RNG: no new ``jax.random`` shape, so no threefry compile per shape),
the cases (shapes that do not divide the kernels' tiles, options, dtypes),
which arguments are differentiated, the implementations to run, and the bad
inputs with the argument each error must name. A test class then subclasses
:class:`OpBattery` with that spec::

    class TestRmsNorm(OpBattery):
        spec = RMS_NORM

and pytest runs, for every implementation of the spec (the kernels on
``interpret``, our Triton lowering on ``triton`` in Triton's CPU interpreter
where the family runs it, and ``xla``), each with its own capability flags (an
implementation whose registered ``supported(call)`` refuses a case skips it,
with the reason: :class:`ops._op.Implementation`) and tolerances
(:attr:`OpSpec.tolerances`):

- ``test_matches_reference[impl-case-dtype]``: one ``jax.jit`` compile of the
  outputs and of the vector-Jacobian product with fixed, non-uniform
  cotangents (:func:`tests.op_test_case.weights_like`); the outputs have the
  ``xla`` implementation's shapes and dtypes and are within
  ``tests.tolerances.FORWARD[dtype]`` of the reference (entries the
  reference makes non-finite, such as a fully masked row's ``-inf``
  logsumexp, must be the same non-finite value), and every gradient has its
  argument's dtype and is within ``BACKWARD[dtype]`` of ``jax.vjp`` of the
  reference. Errors are relative to the reference's largest magnitude
  (:func:`tests.tolerances.assert_close`).
- ``test_eager[impl]``: for each kernel implementation, its eager case (the
  spec's ``eager_case`` where it runs on ``impl``, else the first case that
  does; its first dtype) without ``jit``, asked for as the sequence
  ``(unavailable, impl)``: the implementation that has no kernel raises
  NotImplementedError and the op falls back to ``impl``
  (``ops._implementation``); outputs and gradients as above. It stands in for
  the jitted run of that case and dtype, so jit and no-jit cost one run.
  An eager interpreter run is slower than a jitted one: pick a small case.
- ``test_xla_is_the_reference[dtype]``: with ``xla_is_reference``, the
  ``xla`` implementation gives the reference's bits on the eager case.
- ``test_bad_input[name]``: each bad input raises its error type, the
  message names the argument (and matches the spec's pattern), and no
  kernel was traced first (``pallas_core.call.build_call`` is replaced by one
  that fails the test); an unknown and an unavailable implementation name
  are added to every spec's list.
- ``test_on_gpu[impl-case-dtype]`` (marked ``gpu``: run by ``pytest -m gpu``
  on a machine with one, skipped elsewhere): every case and dtype on every
  implementation the op has registered for a GPU (:func:`gpu_implementations`:
  ``triton``, ``pallas_triton``, ``cudnn`` for attention, ``mosaic_gpu`` once
  registered), jitted, against the reference as above, where the
  implementation's ``supported`` takes the case on the device.

Each case costs an interpreter compile, so cases are few and small: list
the cases a family needs (a cross product of every option and dtype is
rarely worth its compiles) and say per case which dtypes, implementations
and whether gradients. The special-purpose tests of a family (edge masks,
hypothesis sweeps, lowering for other platforms, layers) stay beside the
battery in its test module.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_core as pl
from ops import _op, _resolve
from tests.op_test_case import weights_like
from tests.tolerances import BACKWARD, FORWARD, assert_close, for_dtype

KERNEL_IMPLEMENTATIONS = ("interpret", "triton")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the op.

    Attributes:
      name: the test id.
      inputs: keyword arguments of the spec's input generator (shapes, and
        which optional operands are present).
      options: static keyword arguments of both the op and the reference.
      tiles: keyword arguments only the kernel implementations get (block
        sizes, ``max_chunk``), on top of the spec's ``tiles`` for that
        implementation.
      dtypes: the float dtypes to run (None: the spec's).
      implementations: the implementations to run (None: the spec's).
      grads: also compare the gradients.
    """
    name: str
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    tiles: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dtypes: Sequence[Any] | None = None
    implementations: Sequence[str] | None = None
    grads: bool = True


@dataclasses.dataclass(frozen=True)
class BadInput:
    """A call the op must refuse before tracing a kernel.

    Attributes:
      name: the test id.
      args: the positional arguments.
      kwargs: keyword arguments; without ``implementation`` the call asks for the
        spec's first implementation, so a check done only inside a kernel is seen.
      error: the exception type.
      argument: the argument the message must name (as a word).
      match: a regular expression the message must also match (optional).
    """
    name: str
    args: tuple
    kwargs: Mapping[str, Any]
    error: type[Exception]
    argument: str
    match: str | None = None


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """What the battery needs to know about one op.

    Attributes:
      name: the op's name (ids and messages).
      op: ``op(*args, implementation=..., **options, **tiles)``.
      reference: ``reference(*args, **options)``, called on float32 copies of
        the float inputs.
      make_inputs: ``make_inputs(rng, dtype, **case.inputs) -> tuple`` of
        positional arguments (arrays, None for an absent operand, or pytrees of
        arrays), with ``rng`` a ``numpy.random.Generator``.
      cases: the calls to check; the first is the eager case unless
        ``eager_case`` names another.
      grad_argnums: the positions differentiated (those holding None or a
        non-float array in a call are skipped).
      implementations: the implementations every case runs (a case may narrow them).
      dtypes: the default dtypes of a case.
      tiles: per implementation, keyword arguments of every kernel call.
      bad_inputs: the calls to refuse.
      forward / backward: the per-dtype tolerances of outputs and gradients.
      unavailable: an implementation the op has no kernel for, used for the
        fallback of ``test_eager`` and added to the bad inputs (None: neither).
      xla_is_reference: the ``xla`` implementation is the reference itself.
      eager_case: the name of the eager case (None: the first case).
      tolerances: per implementation, ``(forward, backward)`` tolerances replacing
        the spec's for it (another library's kernels, say).
    """
    name: str
    op: Callable[..., Any]
    reference: Callable[..., Any]
    make_inputs: Callable[..., tuple]
    cases: Sequence[Case]
    grad_argnums: tuple[int, ...] = (0,)
    implementations: Sequence[str] = ("interpret",)
    dtypes: Sequence[Any] = (jnp.float32,)
    tiles: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    bad_inputs: Sequence[BadInput] = ()
    forward: Mapping[Any, float] = dataclasses.field(default_factory=lambda: FORWARD)
    backward: Mapping[Any, float] = dataclasses.field(default_factory=lambda: BACKWARD)
    unavailable: str | None = "mosaic_gpu"
    xla_is_reference: bool = True
    eager_case: str | None = None
    tolerances: Mapping[str, tuple[Mapping[Any, float], Mapping[Any, float]]] = dataclasses.field(
        default_factory=dict)

    def case(self, name: str | None = None) -> Case:
        if name is None:
            return self.cases[0]
        return next(c for c in self.cases if c.name == name)

    def runs_on(self, case: Case) -> Sequence[str]:
        return case.implementations or self.implementations

    def eager(self, implementation: str) -> tuple[Case, Any]:
        """The case and dtype ``test_eager`` runs on ``implementation``: ``eager_case``
        where it runs there, else the first case that does; its first dtype."""
        named = self.case(self.eager_case)
        case = named if implementation in self.runs_on(named) else next(
            c for c in self.cases if implementation in self.runs_on(c))
        return case, (case.dtypes or self.dtypes)[0]

    def inputs(self, case: Case, dtype) -> tuple:
        """The case's arguments; the seed depends on the case, so cases differ."""
        seed = sum(map(ord, f"{self.name}/{case.name}"))
        return tuple(self.make_inputs(np.random.default_rng(seed), dtype, **case.inputs))

    def call(self, case: Case, implementation, tiles: bool = True) -> Callable[..., Any]:
        """``op`` on ``implementation`` with the case's options (and, on our kernels,
        with ``tiles``, its tiles)."""
        names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
        kwargs = dict(case.options)
        if tiles and names[-1] in pl.BACKENDS:
            kwargs.update(self.tiles.get(names[-1], {}))
            kwargs.update(case.tiles)
        return lambda *args: self.op(*args, implementation=implementation, **kwargs)

    def tolerance(self, implementation, dtype) -> tuple[float, float]:
        """The forward and backward tolerances of ``implementation`` at ``dtype``."""
        name = implementation if isinstance(implementation, str) else implementation[-1]
        forward, backward = self.tolerances.get(name, (self.forward, self.backward))
        return for_dtype(forward, dtype), for_dtype(backward, dtype)

    def registered(self) -> _op.Op:
        """The registered op the spec's op calls (its first, for a composite)."""
        case = self.case(self.eager_case)
        return _resolve.capture_call(self.call(case, "xla"), self.inputs(case, self.dtypes[0])).op

    def unsupported(self, case: Case, implementation: str, args, target=None,
                    tiles: bool = True) -> str | None:
        """Why ``implementation`` cannot run ``case`` (its registered ``supported`` on the
        checked call; ``target`` instead of this process's device), None where it can."""
        call = _resolve.capture_call(self.call(case, implementation, tiles), args)
        if target is not None:
            call = dataclasses.replace(call, target=target)
        found = call.op.implementations.get(implementation)
        if found is None:
            return f"{call.op.name} has no implementation {implementation!r}"
        return found.why_not(call)

    def ref(self, case: Case) -> Callable[..., Any]:
        return lambda *args: self.reference(*upcast(args), **case.options)

    def all_bad_inputs(self) -> list[BadInput]:
        args = self.inputs(self.case(self.eager_case), self.dtypes[0])
        extra = [BadInput("unknown_implementation", args, {"implementation": "cuda"}, ValueError,
                          "implementation", r"implementation must be None or one of")]
        if self.unavailable is not None:
            extra.append(BadInput("unavailable_implementation", args,
                                  {"implementation": self.unavailable}, NotImplementedError,
                                  "implementation", re.escape(repr(self.unavailable))))
        return [*self.bad_inputs, *extra]


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def upcast(tree):
    """Every float array of ``tree`` as float32 (the reference's inputs)."""
    def up(a):
        if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.asarray(a, jnp.float32)
        return a
    return jax.tree.map(up, tree)


def _differentiated(spec: OpSpec, args) -> tuple[int, ...]:
    return tuple(i for i in spec.grad_argnums if i < len(args) and args[i] is not None
                 and jnp.issubdtype(jnp.asarray(args[i]).dtype, jnp.floating))


def cotangents(out, dtypes=None):
    """Fixed non-uniform weights for every float output, zero where it is not finite,
    rounded to ``dtypes`` (a tree like ``out``; the op's output dtypes, so the reference
    gets the very cotangents the op gets) and given ``out``'s dtypes."""
    dtypes = jax.tree.map(lambda leaf: leaf.dtype, out) if dtypes is None else dtypes

    def weight(leaf, dtype):
        w = jnp.where(jnp.isfinite(leaf), weights_like(leaf), 0.0)
        return w.astype(dtype).astype(leaf.dtype)
    return jax.tree.map(weight, out, dtypes)


def outputs_and_grads(fn, args, argnums, grads: bool, cotangent_dtypes=None):
    """``fn(*args)`` and, when ``grads``, the VJP of :func:`cotangents` with respect
    to ``args[i]`` for ``i`` in ``argnums``."""
    def run(*args):
        def of_differentiated(*diff):
            full = list(args)
            for i, a in zip(argnums, diff):
                full[i] = a
            return fn(*full)
        if not grads or not argnums:
            return fn(*args), ()
        out, pullback = jax.vjp(of_differentiated, *(args[i] for i in argnums))
        return out, pullback(cotangents(out, cotangent_dtypes))
    return run


def assert_matches(actual, expected, tol, what):
    """Same structure and shapes; entries the reference makes non-finite equal it
    exactly; the rest within ``tol`` of the reference's largest finite magnitude."""
    a_leaves, e_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(a_leaves) == len(e_leaves), (what, jax.tree.structure(actual),
                                            jax.tree.structure(expected))
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        name = what if len(a_leaves) == 1 else f"{what}[{i}]"
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, (name, a.shape, e.shape)
        finite = np.isfinite(e)
        if not finite.all():
            np.testing.assert_array_equal(a[~finite], e[~finite], err_msg=f"{name}: non-finite")
            a, e = np.where(finite, a, 0.0), np.where(finite, e, 0.0)
        assert_close(a, e, tol, name)


def gpu_implementations(spec: OpSpec) -> list[str]:
    """The implementations the op has registered for a GPU (those the default may
    choose there, XLA aside), in registration order."""
    return [name for name, impl in spec.registered().implementations.items()
            if name != "xla" and "gpu" in impl.platforms]


def check_call(spec: OpSpec, case: Case, implementation, dtype, *, jit: bool,
               tiles: bool = True) -> None:
    """The op on ``implementation`` against the reference: outputs and gradients; a case
    the implementation's registered ``supported`` refuses is skipped, saying why.
    ``tiles``: pass the case's tiles (those it was written for) to our kernels."""
    args = spec.inputs(case, dtype)
    name = implementation if isinstance(implementation, str) else implementation[-1]
    why = None if name == "xla" else spec.unsupported(case, name, args, tiles=tiles)
    if why is not None:
        pytest.skip(f"{name} cannot run {case.name}: {why}")
    forward, backward = spec.tolerance(implementation, dtype)
    argnums = _differentiated(spec, args)
    structure = jax.eval_shape(spec.call(case, "xla"), *args)
    out_dtypes = jax.tree.map(lambda s: s.dtype, structure)
    wrap = jax.jit if jit else (lambda f: f)
    out, grads = wrap(outputs_and_grads(spec.call(case, implementation, tiles), args, argnums,
                                        case.grads))(*args)
    want, want_grads = jax.jit(outputs_and_grads(spec.ref(case), upcast(args), argnums,
                                                 case.grads, out_dtypes))(*upcast(args))
    assert jax.tree.structure(out) == jax.tree.structure(structure), spec.name
    for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(structure)):
        assert (o.shape, o.dtype) == (s.shape, s.dtype), (spec.name, o.shape, o.dtype, s)
    assert_matches(out, want, forward, f"{spec.name} {case.name}")
    for i, g, w in zip(argnums, grads, want_grads):
        assert (g.shape, g.dtype) == (args[i].shape, args[i].dtype), (spec.name, i)
        assert_matches(g, w, backward, f"{spec.name} {case.name} d{i}")


class _KernelTraced(AssertionError):
    pass


class OpBattery:
    """Subclass as ``TestName`` with ``spec = OpSpec(...)`` to run the battery."""

    spec: ClassVar[OpSpec]

    def pytest_generate_tests(self, metafunc):
        spec = self.spec
        kernels = [i for i in spec.implementations
                   if i != "xla" and any(i in spec.runs_on(c) for c in spec.cases)]
        kernels += sorted({i for c in spec.cases for i in spec.runs_on(c)} - {"xla"} - set(kernels))
        if metafunc.function.__name__ == "test_matches_reference":
            # The eager run of a kernel implementation stands in for the jitted run of
            # its case and dtype: both compare the same outputs and gradients.
            eager = {(i, spec.eager(i)[0].name, dtype_name(spec.eager(i)[1])) for i in kernels}
            params, ids = [], []
            for case in spec.cases:
                for impl in spec.runs_on(case):
                    for dtype in case.dtypes or spec.dtypes:
                        if (impl, case.name, dtype_name(dtype)) in eager:
                            continue
                        params.append((impl, case, dtype))
                        ids.append(f"{impl}-{case.name}-{dtype_name(dtype)}")
            metafunc.parametrize("implementation, case, dtype", params, ids=ids)
        elif metafunc.function.__name__ == "test_eager":
            metafunc.parametrize("implementation", kernels)
        elif metafunc.function.__name__ == "test_xla_is_the_reference":
            metafunc.parametrize("dtype", spec.dtypes if spec.xla_is_reference else [],
                                 ids=dtype_name)
        elif metafunc.function.__name__ == "test_bad_input":
            bad = spec.all_bad_inputs()
            metafunc.parametrize("bad", bad, ids=[b.name for b in bad])
        elif metafunc.function.__name__ == "test_on_gpu":
            params = [(impl, case, dtype) for case in spec.cases
                      for impl in gpu_implementations(spec) for dtype in case.dtypes or spec.dtypes]
            metafunc.parametrize("implementation, case, dtype", params,
                                 ids=[f"{i}-{c.name}-{dtype_name(d)}" for i, c, d in params])

    def test_matches_reference(self, implementation, case, dtype):
        check_call(self.spec, case, implementation, dtype, jit=True)

    def test_eager(self, implementation):
        spec = self.spec
        case, dtype = spec.eager(implementation)
        impl = implementation if spec.unavailable is None else (spec.unavailable, implementation)
        check_call(spec, case, impl, dtype, jit=False)

    def test_xla_is_the_reference(self, dtype):
        spec = self.spec
        case = spec.case(spec.eager_case)
        args = spec.inputs(case, dtype)
        jax.tree.map(np.testing.assert_array_equal, spec.call(case, "xla")(*args),
                     spec.reference(*args, **case.options))

    @pytest.mark.gpu
    def test_on_gpu(self, implementation, case, dtype):
        # The case's tiles were chosen for the implementations it lists; others take their own.
        check_call(self.spec, case, implementation, dtype, jit=True,
                   tiles=implementation in self.spec.runs_on(case))

    def test_bad_input(self, bad, monkeypatch):
        import pallas_core.call

        def traced(*args, **kwargs):
            raise _KernelTraced(f"{self.spec.name}: a kernel was traced before {bad.name} "
                                "was refused")

        monkeypatch.setattr(pallas_core.call, "build_call", traced)
        kwargs = dict(bad.kwargs)
        kwargs.setdefault("implementation", self.spec.implementations[0])
        with pytest.raises(bad.error) as info:
            self.spec.op(*bad.args, **kwargs)
        message = str(info.value)
        assert re.search(rf"\b{re.escape(bad.argument)}\b", message), (bad.argument, message)
        if bad.match is not None:
            assert re.search(bad.match, message), (bad.match, message)
