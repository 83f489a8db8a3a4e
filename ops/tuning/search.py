"""What the tuner searches: each op's problems, candidate configs, and the compile filter.

A :class:`Problem` is one op at one shape and dtype on one implementation;
:func:`candidates` lists the configs worth trying for it (block sizes,
``num_warps``, ``num_stages``; a hand-picked space per op family, clamped to
the problem's size), and :func:`compile_filter` keeps those that compile for
the target GPU within its shared memory and without register spills. Both
run on any host: Triton compiles for ``sm_90`` without a GPU
(:func:`pallas_core.triton.compile`). Timing the survivors needs the device
and lives in ``benchmarks/tune.py``.

A candidate reaches the op exactly as a tuned config would: installed as a
cache entry (:func:`ops.tuning.cache.override`) under a device kind of its
own, so what is compiled here is what a lookup would run.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops.tuning import cache
from ops.tuning.targets import smem_limit

ROW_OPS = ("layer_norm", "rms_norm", "softmax", "log_softmax", "logsumexp", "cross_entropy", "sum",
           "mean", "max")
# The device kind candidates are installed under while compiling (any name no GPU has).
_CANDIDATE_KIND = "pallas-kernels tuning candidate"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One tuning problem.

    Attributes:
      op: a key of :data:`ops.tuning.cache.CONFIG_FIELDS`.
      shape: the op's lookup dims: fused_matmul ``(m, n, k)``; row-wise ops
        ``(rows, features)``; dot_product_attention ``(T, S, head_dim)``
        (batch 1, 16 query heads over 16 key/value heads, causal when ``T == S``:
        see :meth:`variant`).
      dtype: input dtype name.
      implementation: the backend tuned ("triton" or "pallas_triton").
    """

    op: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    implementation: str = "triton"

    def __post_init__(self):
        if self.op not in cache.CONFIG_FIELDS:
            raise ValueError(f"op: expected one of {sorted(cache.CONFIG_FIELDS)}, got {self.op!r}.")
        want = 2 if self.op in ROW_OPS else 3
        if len(self.shape) != want or not all(isinstance(d, int) and d > 0 for d in self.shape):
            raise ValueError(f"shape: {self.op} takes {want} positive ints, got {self.shape!r}.")

    @property
    def name(self) -> str:
        return f"{self.op}/{'x'.join(map(str, self.shape))}/{self.dtype}/{self.implementation}"

    def variant(self) -> dict:
        """The cache variant of the call :meth:`function` makes (:data:`cache.VARIANT_FIELDS`):
        attention is causal when ``T == S`` (self-attention), full otherwise."""
        if self.op == "dot_product_attention":
            t, s, _ = self.shape
            return {"causal": t == s}
        return {}

    def entry(self, config: Mapping[str, int], device_kind: str, measured=None) -> dict:
        """The cache entry that makes ``config`` this problem's tuned config on ``device_kind``."""
        return cache.make_entry(self.op, self.implementation, device_kind, self.dtype, self.shape,
                                config, measured, self.variant())

    def function(self) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
        """``(fn, args)``: the op's forward pass and its argument shapes."""
        dt = jnp.dtype(self.dtype)
        impl = self.implementation
        sds = jax.ShapeDtypeStruct
        import ops  # here: ops imports this package, so not at module import time
        if self.op == "fused_matmul":
            m, n, k = self.shape
            return (lambda x, w: ops.fused_matmul(x, w, implementation=impl),
                    [sds((m, k), dt), sds((k, n), dt)])
        if self.op == "dot_product_attention":
            t, s, h = self.shape
            causal = self.variant()["causal"]
            return (lambda q, k, v: ops.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation=impl),
                    [sds((1, t, 16, h), dt), sds((1, s, 16, h), dt), sds((1, s, 16, h), dt)])
        return _row_function(self.op, self.shape, dt, impl)

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


def _row_function(op, shape, dt, impl):
    import ops
    rows, features = shape
    sds = jax.ShapeDtypeStruct
    x = sds((rows, features), dt)
    p = sds((features,), dt)
    if op == "layer_norm":
        return lambda x, s, b: ops.layer_norm(x, s, b, implementation=impl), [x, p, p]
    if op == "rms_norm":
        return lambda x, s: ops.rms_norm(x, s, implementation=impl), [x, p]
    if op == "cross_entropy":
        return (lambda x, y: ops.cross_entropy(x, y, implementation=impl),
                [x, sds((rows,), jnp.int32)])
    fn = getattr(ops, op)
    return lambda x: fn(x, axis=-1, implementation=impl), [x]


def _clamp(block: int, dim: int, floor: int = 16) -> int:
    return min(block, max(floor, pl.next_power_of_2(dim)))


def _unique(configs: Sequence[dict]) -> list[dict]:
    seen, out = set(), []
    for c in configs:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# (block_m, block_n, block_k, num_warps, num_stages, group_size): the shapes
# tensor-core matmuls run well (Triton's matmul tutorial searches the same
# region), with the default grouped ordering (bands of 8 row blocks), then two
# other bands on the default tile.
_MATMUL_SPACE = ((128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8),
                 (128, 128, 64, 4, 4, 8), (128, 128, 32, 4, 4, 8), (128, 64, 64, 4, 4, 8),
                 (64, 128, 64, 4, 4, 8), (64, 64, 64, 4, 4, 8), (128, 128, 128, 8, 3, 8),
                 (128, 256, 64, 8, 4, 8), (64, 256, 64, 4, 4, 8), (128, 128, 64, 8, 4, 8),
                 (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 3, 16))
# (block_q, block_k, num_warps, num_stages) of the attention kernels.
_ATTENTION_SPACE = tuple(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))


def candidates(problem: Problem) -> list[dict]:
    """The configs to try for ``problem`` (deduplicated after clamping to its size)."""
    if problem.op == "fused_matmul":
        m, n, k = problem.shape
        cap_k = 32 if problem.dtype == "float32" else 128
        configs = [dict(block_m=_clamp(bm, m), block_n=_clamp(bn, n), block_k=_clamp(min(bk, cap_k), k),
                        num_warps=w, num_stages=s, group_size=g)
                   for bm, bn, bk, w, s, g in _MATMUL_SPACE]
    elif problem.op == "dot_product_attention":
        t, s, _ = problem.shape
        configs = [dict(block_q=_clamp(bq, t), block_k=_clamp(bk, s), num_warps=w, num_stages=st)
                   for bq, bk, w, st in _ATTENTION_SPACE]
    else:
        rows, features = problem.shape
        configs = []
        for block_rows, chunk, warps in itertools.product((1, 2, 4), (1024, 4096, 8192), (4, 8)):
            chunk = _clamp(chunk, features, floor=128)
            configs.append(dict(block_rows=min(block_rows, pl.next_power_of_2(rows)), chunk=chunk,
                                num_warps=warps,
                                num_stages=2 if pl.cdiv(features, chunk) > 1 else 1))
    return _unique(configs)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """One candidate after compiling: kept, or dropped with the reason.

    Attributes:
      config: the candidate.
      kept: whether it passed.
      reason: why it was dropped ("" when kept).
      kernels: per kernel ``name``, ``registers``, ``spill_bytes``,
        ``shared_memory_bytes`` (from :func:`pallas_core.triton.compile`).
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


def compile_config(problem: Problem, config: Mapping[str, int], target: str = "sm_90") -> list[dict]:
    """:func:`pallas_core.triton.compile` reports of ``problem`` run with ``config``."""
    fn, args = problem.function()
    with cache.device_kind(_CANDIDATE_KIND), cache.override([problem.entry(config, _CANDIDATE_KIND)]):
        return pl.triton.compile(fn, *args, target=target)


def compile_filter(problem: Problem, configs: Sequence[Mapping[str, int]], *,
                   target: str = "sm_90", log: Callable[[str], None] | None = None) -> list[Verdict]:
    """Compiles every config for ``target``; a config is kept when every kernel
    of the op's forward pass fits the target's shared memory and spills no
    registers, and dropped (with the reason) when not, or when it does not
    compile at all (Triton's error, first line)."""
    verdicts = []
    for config in configs:
        try:
            reports = compile_config(problem, config, target)
        except Exception as e:  # noqa: BLE001 - a config Triton or the op refuses is dropped
            reason = f"does not compile: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            verdicts.append(Verdict(dict(config), False, reason[:300]))
        else:
            kernels = tuple({k: r[k] for k in ("name", "registers", "spill_bytes",
                                                "shared_memory_bytes")} for r in reports)
            reason = check_reports(reports, target)
            verdicts.append(Verdict(dict(config), not reason, reason, kernels))
        if log is not None:
            v = verdicts[-1]
            log(f"  {problem.name} {v.config}: {'kept' if v.kept else 'dropped, ' + v.reason}")
    return verdicts


def main_problems(dtype: str = "bfloat16", implementation: str = "triton") -> list[Problem]:
    """The shapes ``python -m benchmarks.tune`` fills the cache for by default: the
    model sizes of the static gate, ``benchmarks/static.py`` (matmul 4096^3 / 8192^3; norms and
    softmax over 4096 rows of 4096..32768 features; cross-entropy over 128256
    classes; attention at 2048 and 4096 tokens, head dims 64 and 128)."""
    # Compute-bound ops first: a session that runs out of its time budget has
    # tuned what tuning moves most.
    problems = [Problem("fused_matmul", (s, s, s), dtype, implementation) for s in (4096, 8192)]
    problems += [Problem("dot_product_attention", (t, t, h), dtype, implementation)
                 for t in (2048, 4096) for h in (64, 128)]
    for op in ("layer_norm", "rms_norm", "softmax"):
        problems += [Problem(op, (4096, f), dtype, implementation) for f in (4096, 8192, 32768)]
    problems.append(Problem("cross_entropy", (4096, 128256), dtype, implementation))
    return problems


def quick_problems(dtype: str = "bfloat16", implementation: str = "triton") -> list[Problem]:
    """One small problem per op family (smoke tests of the tuner)."""
    return [Problem("fused_matmul", (512, 512, 512), dtype, implementation),
            Problem("layer_norm", (256, 4096), dtype, implementation),
            Problem("dot_product_attention", (512, 512, 64), dtype, implementation)]
