"""What each backend contributes, filled in by the backends themselves (docs/design.md §2).

Backend-neutral modules (:mod:`pallas_core.call`, :mod:`pallas_core.primitives`,
:mod:`pallas_core.tpu_ops`) import only this module, never a backend: a backend
module registers, when it is imported,

* its runner (:func:`register_backend`): ``run(call, args)``, which lowers a
  resolved call and runs it; ``batch_grid=True`` when vmap should add a batch
  grid axis (:mod:`pallas_core.batching`) rather than batch what it emits;
  and its :class:`pallas_core.traits.BackendTraits`, the facts ops choose
  tiles and launch parameters by (:func:`traits`);
* its rules for primitives whose meaning it must carry itself
  (:func:`register_rule`): a primitive (``"load"``, ``"store"``,
  ``"multiple_of"``, ``"roll"``, ``"debug_print"``, ``"elementwise_inline_asm"``) with a rule on the current backend calls the
  rule, else it runs its plain ``jax.numpy`` form. This is how JAX's Pallas
  keeps a lowering rule per backend for each primitive;
* the name prefixes of its atomic read-modify-write calls
  (:func:`register_atomic_prefix`): a kernel that makes one may write an output
  block from several programs, which decides the grid's semantics
  (:func:`pallas_core.validation.resolve_semantics`).

:mod:`pallas_core` (its ``__init__``) imports every backend module, so the
tables are full before any kernel is traced.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pallas_core.traits import BackendTraits


@dataclasses.dataclass(frozen=True)
class Runner:
    """A backend's ``run(call, args)``, whether vmap adds a batch grid axis for it, and
    the traits it declared."""

    run: Callable
    batch_grid: bool
    traits: BackendTraits


_RUNNERS: dict[str, Runner] = {}
_RULES: dict[tuple[str, str], Callable] = {}
_ATOMIC_PREFIXES: list[str] = []


def register_backend(name: str, run: Callable, *, traits: BackendTraits,
                     batch_grid: bool = False) -> None:
    """Makes ``run(call, args)`` the way calls resolved for backend ``name`` run, and
    ``traits`` what :func:`traits` answers for it.

    Raises:
      ValueError: ``traits`` is not a BackendTraits named ``name``.
    """
    if not isinstance(traits, BackendTraits) or traits.name != name:
        raise ValueError(f"traits: expected BackendTraits(name={name!r}, ...), got {traits!r}.")
    _RUNNERS[name] = Runner(run, batch_grid, traits)


def runner(name: str) -> Runner:
    """The registered runner of backend ``name``.

    Raises:
      NotImplementedError: no backend module registered ``name``.
    """
    try:
        return _RUNNERS[name]
    except KeyError:
        raise NotImplementedError(f"backend {name!r}: no runner registered; registered: "
                                  f"{sorted(_RUNNERS)}.") from None


def traits(name: str) -> BackendTraits:
    """The traits backend ``name`` declared when it registered.

    Raises:
      NotImplementedError: no backend module registered ``name``.
    """
    return runner(name).traits


def register_rule(primitive: str, backend: str, rule: Callable) -> None:
    """Makes ``rule`` what ``primitive`` does inside kernels traced for ``backend``."""
    _RULES[primitive, backend] = rule


def rule(primitive: str, backend: str) -> Callable | None:
    """``primitive``'s rule on ``backend``, or None: run the primitive's plain form."""
    return _RULES.get((primitive, backend))


def register_atomic_prefix(prefix: str) -> None:
    """Marks the named calls (``pjit`` names) starting with ``prefix`` as atomic updates."""
    if prefix not in _ATOMIC_PREFIXES:
        _ATOMIC_PREFIXES.append(prefix)


def atomic_prefixes() -> tuple[str, ...]:
    """Every registered atomic-call name prefix."""
    return tuple(_ATOMIC_PREFIXES)
