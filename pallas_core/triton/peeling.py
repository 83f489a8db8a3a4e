"""Loop peeling: which ``pl.when`` blocks of a kernel run before or after its loop.

Our Triton lowering runs the innermost sequential (``"arbitrary"``) grid axis
``k`` as a loop inside each program. The TPU-style reduction (docs/pallas_core.md section 5)
guards its initialisation with ``pl.when(k == 0)`` and its epilogue with
``pl.when(k == num_programs - 1)``; written as they stand, both are branches
in every iteration of that loop. Triton's matmul tutorial instead initialises
before the loop and stores after it, which leaves a branch-free body for the
software pipeliner and lets the epilogue's shared-memory layout conversion
reuse the pipeline's buffers (the fused_matmul kernel drops from 128 KiB to
96 KiB of shared memory at 128x128x64, 3 stages, bf16).

:func:`plan` finds the ``pl.when`` blocks (``cond`` equations of the kernel's
top-level jaxpr) that may move without changing results:

* a *first* block (condition ``k == 0``) runs before the loop if it
  commutes with every equation before it: each is free of effects or
  touches only other buffers (the attention kernels read their query block
  before initialising their statistics);
* a *last* block (condition ``k == K - 1``) runs after the loop if it
  commutes, in the same sense, with every equation after it;
* either one reads only Refs and values computed without effects from the
  grid ids and constants (``jnp.zeros``, ``jnp.full(..., -inf)``), which are
  computed again where the block goes; and ``K >= 1`` (with no iteration,
  neither ran).

Everything else stays in the loop as written, so peeling never changes
which stores happen or in which order.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend import core as jex_core
from jax.ref import AbstractRef

# Ref plumbing of the traced kernel (pallas_core.triton.codegen.trace_kernel): no effect on memory.
_NEUTRAL = frozenset({"new_ref", "freeze"})


@dataclasses.dataclass(frozen=True)
class PeelPlan:
    """Indices into the kernel jaxpr's equations.

    ``before`` / ``after``: the ``cond`` equations whose true branch runs
    before / after the loop (in this order); ``before_values`` /
    ``after_values``: the effect-free equations computing their operands
    (written there too, in jaxpr order); ``loop``: the equations written in
    the loop body (the rest, less predicates nothing reads any more).
    """

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    loop: tuple[int, ...] = ()
    before_values: tuple[int, ...] = ()
    after_values: tuple[int, ...] = ()


def plan(jaxpr, loop_var, length: int, enabled: bool = True, memory: dict | None = None) -> PeelPlan:
    """The peeling of the loop over ``loop_var`` (a jaxpr input) of ``length`` iterations.

    ``memory`` maps Ref variables to a buffer id; Refs over one buffer (an
    input aliased to an output) must share it. Refs not in it are distinct.
    """
    eqns = jaxpr.eqns
    if not enabled or length < 1:
        return PeelPlan(loop=tuple(range(len(eqns))))
    memory = memory or {}
    producers = {v: e for e in eqns for v in e.outvars}
    position = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    values = {i: _pure_slice(e.invars[1:], eqns, position) for i, e in enumerate(eqns)}
    kinds = [_iteration_guarded(e, producers, loop_var, length) if values[i] is not None else None
             for i, e in enumerate(eqns)]

    def movable(order, kind):
        moved, passed = [], []  # passed: equations with effects the moved blocks go past
        for i in order:
            eqn = eqns[i]
            buffers = {memory.get(r, r) for r in _refs(eqn)}
            if kinds[i] == kind and all(_commutes(other, buffers, memory) for other in passed):
                moved.append(i)
            elif _has_effects(eqn):
                passed.append(eqn)
        return moved

    before = movable(range(len(eqns)), "first")
    after = [i for i in movable(reversed(range(len(eqns))), "last") if i not in before]
    moved = set(before) | set(after)
    return PeelPlan(tuple(before), tuple(reversed(after)), _live(jaxpr, moved),
                    tuple(sorted(set().union(*(values[i] for i in before)))),
                    tuple(sorted(set().union(*(values[i] for i in after)))))


def _pure_slice(operands, eqns, position) -> set[int] | None:
    """Indices of the equations that compute ``operands`` (besides Refs and literals), or None
    if one of them has effects or touches a Ref: a moved block's values are computed again
    where it goes, from the grid ids and constants alone."""
    slice_, stack, seen = set(), list(operands), set()
    while stack:
        v = stack.pop()
        if isinstance(v, jex_core.Literal) or v in seen or isinstance(v.aval, AbstractRef):
            continue
        seen.add(v)
        if v not in position:  # a grid id or a constant
            continue
        i = position[v]
        if _has_effects(eqns[i]) or eqns[i].primitive.name in _NEUTRAL or _refs(eqns[i]):
            return None
        slice_.add(i)
        stack.extend(eqns[i].invars)
    return slice_


def _refs(eqn) -> set:
    return {v for v in eqn.invars if not isinstance(v, jex_core.Literal) and isinstance(v.aval, AbstractRef)}


def _commutes(eqn, buffers: set, memory: dict) -> bool:
    """Whether ``eqn`` (with effects) touches none of ``buffers``: it then commutes with a
    block that only touches those. An effect without a Ref operand (a callback) never does."""
    refs = _refs(eqn)
    return bool(refs) and not ({memory.get(r, r) for r in refs} & buffers)


def _iteration_guarded(eqn, producers, loop_var, length) -> str | None:
    """"first" / "last" for ``pl.when(k == 0)`` / ``pl.when(k == length - 1)``."""
    if eqn.primitive.name != "cond" or eqn.outvars or len(eqn.params["branches"]) != 2:
        return None
    # pl.when(c) is lax.cond(c, ...): the branch index is convert_element_type(c, int32).
    index = producers.get(eqn.invars[0])
    if index is None or index.primitive.name != "convert_element_type":
        return None
    compare = producers.get(index.invars[0])
    if compare is None or compare.primitive.name != "eq" or np.dtype(index.invars[0].aval.dtype) != np.bool_:
        return None
    lhs, rhs = compare.invars
    if rhs is loop_var:
        lhs, rhs = rhs, lhs
    if lhs is not loop_var or not isinstance(rhs, jex_core.Literal):
        return None
    value = int(rhs.val)
    return "first" if value == 0 else "last" if value == length - 1 else None


def _has_effects(eqn) -> bool:
    """JAX effects, or none and no outputs either: such an equation is only there for what
    the writer emits for it (a marker of :mod:`pallas_core.triton.markers`: a print, a
    barrier), which must stay in the loop, in order."""
    return eqn.primitive.name not in _NEUTRAL and (bool(eqn.effects) or not eqn.outvars)


def _live(jaxpr, moved: set[int]) -> tuple[int, ...]:
    """Equations not ``moved`` that have effects or feed one that is kept (the predicates of
    moved blocks drop out)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    keep = []
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if i in moved:
            continue
        if _has_effects(eqn) or eqn.primitive.name in _NEUTRAL or any(v in needed for v in eqn.outvars):
            keep.append(i)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return tuple(reversed(keep))
