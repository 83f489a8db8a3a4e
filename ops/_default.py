"""The default implementation of an op call (``implementation=None``), and why.

Never slower than what the user already has: on a GPU the default is, per
op, device kind and call, the fastest implementation measured for that call
which can run it (docs/design.md §5.2):

1. the call's key: its problem (:attr:`ops._op.Call.problem`: dims bucketed,
   dtype, the variant the tuning cache keys on) and its pass, "fwd" for the
   op alone or "fwd+bwd" when it is traced under differentiation
   (:func:`differentiated`);
2. the measured ranking of that key on the device kind, or the nearest
   measured one (:func:`ops.tuning.rankings.lookup`: the same device kind,
   else its family, H100 and H200 sharing; a bucket within 16x in every dim;
   fewest differences), ours (``triton``, ``pallas_triton``, ``mosaic_gpu``
   where registered) ranked with the user's alternatives (``xla``, and cuDNN
   for attention) by time;
3. implementations that failed in that measurement, then the rest of the
   platform's :data:`SAFE_ORDER`, for calls nothing near was measured for;
4. of those, each that is registered for the op, may run on the platform
   (:attr:`ops._op.Implementation.platforms`), is not barred from the default
   (:attr:`ops._op.Implementation.not_default`: linear cross-entropy's XLA
   path, which forms the N x V logits the op exists to avoid) and whose
   ``supported(call)`` accepts the call, in that order.

The first is what runs; the others are its fallbacks (NotImplementedError
while the call is traced moves to the next). On a CPU the default is
``xla``: the kernel backends only interpret there. A custom_vjp op's
backward runs on its forward's implementation (the rankings' "bwd" pass is
recorded so that a split pick, cuDNN's forward with our backward say, can be
made where it measures faster; none does today).

``ops.resolve_implementation`` (:mod:`ops._resolve`) answers for a call
without running it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ops.tuning import rankings

# Per platform, the order tried where no measurement ranks a call: our kernels as
# they were the default before measurements (our Triton lowering first), then the
# alternatives; on a CPU only XLA. Implementations an op does not have are skipped.
SAFE_ORDER = {"gpu": ("triton", "pallas_triton", "mosaic_gpu", "cudnn", "xla"),
              "tpu": ("mosaic_tpu", "xla"),
              "cpu": ("xla",)}

# Tracers of JAX's autodiff (jvp, and the linearize trace behind grad and vjp), by name:
# their classes are private to jax._src.interpreters.ad.
_AD_TRACERS = ("JVPTracer", "LinearizeTracer")


def differentiated(x) -> bool:
    """Whether ``x`` is being differentiated: a tracer of ``jax.jvp`` / ``jax.grad`` /
    ``jax.vjp``, also under ``jax.vmap`` (a batching tracer is looked through) and
    inside ``lax.scan``. A function jitted or rematerialized (``jax.checkpoint``)
    *inside* the differentiated one traces its body before autodiff sees it: there
    this says False (a choice made for the forward pass alone)."""
    for _ in range(16):  # tracers nest (vmap over grad ...); a bounded walk
        if not isinstance(x, jax.core.Tracer):
            return False
        if type(x).__name__ in _AD_TRACERS:
            return True
        x = getattr(x, "val", None)
    return False


def pass_of(args: Mapping[str, Any]) -> str:
    """"fwd+bwd" when any array of a call's arguments is being differentiated, else "fwd"."""
    return "fwd+bwd" if any(map(differentiated, jax.tree.leaves(dict(args)))) else "fwd"


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``implementation=None`` runs for a call, and why.

    Attributes:
      op: the op's name.
      implementation: the implementation that runs (the first of ``order``).
      order: every implementation tried, in order (a later one runs only where an
        earlier raises NotImplementedError while the call is traced).
      backward: the implementation of the backward pass (a custom_vjp's: today
        always ``implementation``'s own).
      pass_: the call's pass, "fwd" or "fwd+bwd".
      device_kind, platform: the device chosen for.
      rule: "platform" (a CPU: XLA), "measured" (the call's own key was
        measured), "nearest measured" or "safe order" (nothing near was measured,
        or nothing measured can run the call).
      reason: one line saying the above with the numbers.
      measurement: the ranking entry used, or None.
      differences: how that entry differs from the call (empty when exact).
      skipped: ``(name, why)`` of each implementation passed over before
        ``implementation`` (faster, or earlier in the safe order).
    """

    op: str
    implementation: str
    order: tuple[str, ...]
    backward: str
    pass_: str
    device_kind: str
    platform: str
    rule: str
    reason: str
    measurement: rankings.Ranking | None = None
    differences: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()


def _refusal(op, call, name: str) -> str | None:
    """Why the default does not take ``name`` for ``call`` (None: it may). On a CPU
    XLA is the default of every op, ``not_default`` or not: nothing else is fast there."""
    found = op.implementations.get(name)
    if found is None:
        return "not registered for this op"
    if call.target.platform not in found.platforms:
        return f"not a default on {call.target.platform}"
    if found.not_default and call.target.platform != "cpu":
        return found.not_default
    return found.why_not(call)


def choose(op, call) -> Choice:
    """The default implementation of ``call`` (an :class:`ops._op.Call` of ``op``, an
    :class:`ops._op.Op`; see the module docstring).

    Raises:
      NotImplementedError: no implementation can run the call by default (the
        reasons of each are in the message).
      ops.tuning.rankings.RankingsError: a malformed packaged rankings file.
    """
    target = call.target
    safe = SAFE_ORDER.get(target.platform, SAFE_ORDER["cpu"])
    match = None
    if target.platform != "cpu" and call.problem is not None:
        problem = call.problem
        match = rankings.lookup(op.name, target.device_kind, problem.dtype, problem.shape,
                                problem.variant_dict(), call.pass_)
    measured = () if match is None else (
        match.entry.names + tuple(name for name, _ in match.entry.failed))
    order, skipped = [], []
    for name in dict.fromkeys(measured + safe):
        why = _refusal(op, call, name)
        if why is None:
            order.append(name)
        elif not order and (name in measured or name in op.implementations):
            skipped.append((name, why))  # passed over before the first that can run
    if not order:
        raise NotImplementedError(
            f"{op.name}: no implementation can run this call by default on "
            f"{target.device_kind} ({target.platform}): "
            + "; ".join(f"{name}: {why}" for name, why in skipped)
            + ". Pass implementation= to name one.")
    first = order[0]
    base = dict(op=op.name, implementation=first, order=tuple(order), backward=first,
                pass_=call.pass_, device_kind=target.device_kind, platform=target.platform,
                skipped=tuple(skipped))
    passed = "".join(f"; {name} passed over: {why}" for name, why in skipped)
    if target.platform == "cpu":
        return Choice(**base, rule="platform",
                      reason="on a CPU the kernel backends only interpret: XLA" + passed)
    if match is not None and first in match.entry.names:
        entry = match.entry
        times = ", ".join(f"{n} {t:.4g} ms" for n, t in entry.ranking) + (
            f" (summed over {len(entry.cases)} cases)" if len(entry.cases) > 1 else "")
        where = "this call" if match.exact else (
            "the nearest measured call (" + ", ".join(match.differences) + ")")
        return Choice(**base, rule="measured" if match.exact else "nearest measured",
                      reason=f"fastest that can run it as measured for {where}, {entry.pass_} on "
                      f"{entry.device_kind} [{entry.source or 'unnamed run'}]: {times}" + passed,
                      measurement=entry, differences=match.differences)
    why = ("no measurement near this call" if match is None
           else "no implementation measured for it can run it")
    return Choice(**base, rule="safe order", measurement=None if match is None else match.entry,
                  differences=() if match is None else match.differences,
                  reason=f"{why}: the safe order {safe} on {target.platform}" + passed)
