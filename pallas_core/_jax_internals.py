"""The one private JAX API pallas_core relies on, kept in one place.

``discharge_state`` turns a jaxpr that allocates and mutates Refs into a
pure one (JAX itself runs it on every jitted program that holds Refs). The
interpreter applies it to each kernel body so that the programs it builds
contain no Refs at all, which is what lets ``vmap`` batch a ``pl.when``
(JAX cannot batch a stateful ``cond``) and keeps every transformation usable.
"""
from __future__ import annotations

import jax

try:
    from jax._src.state.discharge import discharge_state as _discharge_state
except ImportError as e:  # pragma: no cover - only on an incompatible JAX
    raise ImportError(
        "pallas_core needs jax._src.state.discharge.discharge_state (present in "
        f"jax 0.10.x); this JAX ({jax.__version__}) does not provide it.") from e


def discharge_refs(closed_jaxpr: jax.extend.core.ClosedJaxpr):
    """A pure ClosedJaxpr equivalent to ``closed_jaxpr`` (Ref effects threaded through)."""
    return _discharge_state(closed_jaxpr)
