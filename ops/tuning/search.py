"""What the tuner searches: each registered op's problems, candidate configs, and the compile filter.

The tuner iterates the op registry (:mod:`ops._op`): every op registered
with a :class:`ops._op.Tuning` brings its problem shapes, the call that
exercises a problem (``example``) and, through its config class, the
candidate configs (``candidates(problem, device)``: a hand-picked space per
op family, clamped to the problem's size). A :class:`Problem` is one op at
one shape and dtype on one implementation; :func:`candidates` lists its
configs, and :func:`compile_filter` keeps those that compile for the target
GPU within its shared memory and without register spills: the kernels of the
inference call (``example``) and, for an op that registers one
(:attr:`ops._op.Tuning.training`), of its training step too (the forward that
also stores residuals, the backward's products), since a config reaches all
of them. Both run on any
host: Triton compiles for ``sm_90`` without a GPU
(:func:`pallas_core.triton.compile`). Timing the survivors needs the device
and lives in ``benchmarks/tune.py``. Adding an op to the tuner is
registering it with a ``tuning``.

A candidate reaches the op exactly as a tuned config would: installed as a
cache entry (:func:`ops.tuning.cache.override`) under a device kind of its
own, so what is compiled here is what a lookup would run.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops import _op
from ops.tuning import cache
from ops.tuning.targets import smem_limit

# The device kind candidates are installed under while compiling (any name no GPU has).
_CANDIDATE_KIND = "pallas-kernels tuning candidate"


def tuned_ops() -> tuple[_op.Op, ...]:
    """The registered ops the tuner can tune (those with a ``tuning``), in its order:
    ascending :attr:`ops._op.Tuning.order` (compute-bound ops first), then registration."""
    ops_ = [op for op in _op.registered() if op.tuning is not None]
    return tuple(sorted(ops_, key=lambda op: op.tuning.order))


@dataclasses.dataclass(frozen=True)
class Problem:
    """One tuning problem.

    Attributes:
      op: a registered op with a ``tuning`` (:func:`tuned_ops`).
      shape: the op's problem dims (its ``dims``: fused_matmul ``(m, n, k)``;
        row-wise ops ``(rows, features)``; dot_product_attention ``(T, S,
        head_dim)``, its example call batch 1, 16 query heads over 16 key/value
        heads, causal when ``T == S``, and a split-KV decode step: see
        :meth:`variant` and ``ops/attention/block_sizes.py``).
      dtype: input dtype name.
      implementation: the backend tuned ("triton" or "pallas_triton").
    """

    op: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    implementation: str = "triton"

    def __post_init__(self):
        names = tuple(op.name for op in tuned_ops())
        if self.op not in names:
            raise ValueError(f"op: expected one of {sorted(names)}, got {self.op!r}.")
        dims = self.registered.dims
        if len(self.shape) != len(dims) or not all(isinstance(d, int) and d > 0 for d in self.shape):
            raise ValueError(f"shape: {self.op} takes {len(dims)} positive ints {dims}, got "
                             f"{self.shape!r}.")

    @property
    def registered(self) -> _op.Op:
        return _op.get(self.op)

    @property
    def name(self) -> str:
        return f"{self.op}/{'x'.join(map(str, self.shape))}/{self.dtype}/{self.implementation}"

    def variant(self) -> dict:
        """The cache variant of the call :meth:`function` makes (the op's
        :attr:`ops._op.Tuning.variant`; attention is causal when ``T == S``,
        self-attention, full otherwise)."""
        variant = self.registered.tuning.variant
        return {} if variant is None else dict(variant(self.shape))

    def op_problem(self) -> _op.Problem:
        """The op layer's :class:`ops._op.Problem` of this problem."""
        return self.registered.problem(self.shape, self.dtype, self.variant())

    def entry(self, config, device_kind: str, measured=None) -> dict:
        """The cache entry that makes ``config`` (a config or its cache form) this
        problem's tuned config on ``device_kind``."""
        return cache.make_entry(self.op, self.implementation, device_kind, self.dtype, self.shape,
                                as_dict(config), measured, self.variant())

    def function(self) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
        """``(fn, args)``: the op's forward pass and its argument shapes."""
        return self.registered.tuning.example(self.op_problem(), self.implementation)

    def compiled_calls(self) -> list[tuple[str, Callable, list[jax.ShapeDtypeStruct]]]:
        """``(label, fn, args)`` of every call the compile filter compiles: the
        forward pass (``"forward"``, :meth:`function`), then the training step
        (``"training"``) where the op registers one (:attr:`ops._op.Tuning.training`)
        and it has one for this problem (not None)."""
        calls = [("forward", *self.function())]
        training = self.registered.tuning.training
        call = None if training is None else training(self.op_problem(), self.implementation)
        if call is not None:
            calls.append(("training", *call))
        return calls

    def make_inputs(self, key) -> list[jax.Array]:
        """Fresh random inputs for :meth:`function` (integer labels in range)."""
        _, args = self.function()
        keys = jax.random.split(key, len(args))
        out = []
        for k, a in zip(keys, args):
            if jnp.issubdtype(a.dtype, jnp.integer):
                out.append(jax.random.randint(k, a.shape, 0, self.shape[-1], a.dtype))
            else:
                out.append(jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype))
        return out


def as_dict(config) -> dict:
    """A config's cache form (its set tunable fields); a mapping as it is."""
    return config.tuned() if isinstance(config, _op.KernelConfig) else dict(config)


def candidates(problem: Problem) -> list[dict]:
    """The configs to try for ``problem`` (its op's config class's candidates on the
    tuned backend, distinct after clamping to its size), in their cache form."""
    op_problem = problem.op_problem()
    device = _op.Device(problem.implementation, _CANDIDATE_KIND)
    configs = problem.registered.config_type(problem.implementation).candidates(op_problem, device)
    return list({tuple(sorted(as_dict(c).items())): as_dict(c) for c in configs}.values())


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One candidate after compiling: kept, or dropped with the reason.

    Attributes:
      config: the candidate.
      kept: whether it passed.
      reason: why it was dropped ("" when kept).
      kernels: per kernel compiled ``call`` (``"forward"`` or ``"training"``),
        ``name``, ``registers``, ``spill_bytes``, ``shared_memory_bytes`` (from
        :func:`pallas_core.triton.compile`), up to the first unfit call.
    """

    config: dict
    kept: bool
    reason: str
    kernels: tuple[dict, ...] = ()


def check_reports(reports: Sequence[Mapping], target: str) -> str:
    """Why compiled kernels are unfit for ``target`` ("" when fit): shared memory over
    the chip's limit, or register spills."""
    limit = smem_limit(target)
    for r in reports:
        if r["shared_memory_bytes"] > limit:
            return (f"{r['name']}: {r['shared_memory_bytes']} bytes of shared memory, over "
                    f"{target}'s {limit}")
        if r["spill_bytes"]:
            return f"{r['name']}: spills {r['spill_bytes']} bytes ({r['registers']} registers)"
    return ""


def compile_config(problem: Problem, config, target: str = "sm_90", *,
                   call: str = "forward") -> list[dict]:
    """:func:`pallas_core.triton.compile` reports of ``problem``'s call ``call`` (a label
    of :meth:`Problem.compiled_calls`) run with ``config``.

    Raises:
      ValueError: ``call`` is not one of the problem's calls.
    """
    calls = {label: (fn, args) for label, fn, args in problem.compiled_calls()}
    if call not in calls:
        raise ValueError(f"call: expected one of {sorted(calls)} for {problem.op}, got {call!r}.")
    fn, args = calls[call]
    with cache.device_kind(_CANDIDATE_KIND), cache.override([problem.entry(config, _CANDIDATE_KIND)]):
        return pl.triton.compile(fn, *args, target=target)


def _verdict(problem: Problem, config, target: str, training: bool) -> Verdict:
    """Compiles ``problem``'s calls with ``config`` in order (the forward alone unless
    ``training``), stopping at the first unfit one (a forward that already fails costs
    no backward compiles)."""
    kernels = []
    for label, _, _ in problem.compiled_calls()[:None if training else 1]:
        try:
            reports = compile_config(problem, config, target, call=label)
        except Exception as e:  # noqa: BLE001 - a config Triton or the op refuses is dropped
            reason = (f"{label}: does not compile: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}")
            return Verdict(as_dict(config), False, reason[:300], tuple(kernels))
        kernels += [{"call": label, **{k: r[k] for k in ("name", "registers", "spill_bytes",
                                                       "shared_memory_bytes")}} for r in reports]
        reason = check_reports(reports, target)
        if reason:
            return Verdict(as_dict(config), False, f"{label}: {reason}", tuple(kernels))
    return Verdict(as_dict(config), True, "", tuple(kernels))


def compile_filter(problem: Problem, configs: Sequence, *, target: str = "sm_90",
                   log: Callable[[str], None] | None = None, training: bool = True) -> list[Verdict]:
    """Compiles every config for ``target``; a config is kept when every kernel
    of the op's forward pass and, where the op registers one, of its training
    step (:meth:`Problem.compiled_calls`) fits the target's shared memory and
    spills no registers, and dropped (the reason prefixed with the call,
    ``"forward: "`` or ``"training: "``) when not, or when it does not compile at
    all (Triton's error, first line). ``training=False`` compiles the forward pass
    alone (faster; for a cache that serves inference only)."""
    verdicts = []
    for config in configs:
        verdicts.append(_verdict(problem, config, target, training))
        if log is not None:
            v = verdicts[-1]
            log(f"  {problem.name} {v.config}: {'kept' if v.kept else 'dropped, ' + v.reason}")
    return verdicts


def main_problems(dtype: str = "bfloat16", implementation: str = "triton") -> list[Problem]:
    """The shapes ``python -m benchmarks.tune`` fills the cache for by default: each
    tuned op's :attr:`ops._op.Tuning.shapes` (the model sizes of the static gate,
    ``benchmarks/static.py``), compute-bound ops first (:func:`tuned_ops`), so a
    session that runs out of its time budget has tuned what tuning moves most."""
    return [Problem(op.name, shape, dtype, implementation)
            for op in tuned_ops() for shape in op.tuning.shapes]


def quick_problems(dtype: str = "bfloat16", implementation: str = "triton") -> list[Problem]:
    """One small problem per op family (:attr:`ops._op.Tuning.quick`; smoke tests of the
    tuner)."""
    return [Problem(op.name, shape, dtype, implementation)
            for op in tuned_ops() for shape in op.tuning.quick]
