"""Rotary position embedding (RoPE): ``apply_rotary_embedding(x, positions, inv_freq)``.

Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
Embedding", section 3.4.2: the features of every head are taken in pairs and
pair ``i`` of the token at position ``p`` is rotated by the angle ``p *
inv_freq[i]``. Pairing, as the model families spell it:

* ``interleaved=False`` (Llama, Mistral, Qwen, Gemma, GPT-NeoX; transformers'
  ``rotate_half``): feature ``i`` with ``i + R/2``;
* ``interleaved=True`` (GPT-J, the paper's own layout): ``2i`` with ``2i + 1``.

Partial rotary (GPT-NeoX, Phi): only the first ``R = 2 len(inv_freq)``
features of each head rotate; features ``R..H`` pass through unchanged.
``cos`` and ``sin`` are multiplied by ``attention_scaling`` (YaRN's attention
factor; 1 otherwise).

One kernel, forward and backward. A program owns ``block_tokens`` tokens and
``block_heads`` heads with their whole head dim; it forms the angles
``float32(position) * inv_freq`` (the float32 product transformers forms) and
their ``cos`` / ``sin`` in float32 once per token and frequency, shared by
every head of the block, rotates the two halves of each pair in float32 and
rounds once to x's dtype. No ``[T, R]`` table is ever written to memory: the
kernel reads x once and writes the result once, plus 4 bytes per token
(position) and ``2R`` bytes per program (inv_freq).

Rotations are orthogonal, so the gradient with respect to x is the rotation
by the negative angle (the same kernel with ``sin`` negated; ``attention_scaling``
scales it the same way). Positions are integers (no gradient); the gradient
with respect to ``inv_freq`` (rarely wanted) comes from XLA's autodiff of
:func:`ops.decoder.reference.rotary_embedding_reference` and is removed by
dead-code elimination under ``jit`` when unused.

Against transformers (``apply_rotary_pos_emb`` with ``LlamaRotaryEmbedding``'s
``cos`` / ``sin``): float32 inputs agree to float32 rounding; for 16-bit
inputs transformers rounds ``cos`` / ``sin`` and each product to x's dtype,
this op rounds only the result, so it is the more accurate of the two.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

import pallas_core as pl
from ops._checks import check_array, check_float_dtype
from ops._op import Device, KernelConfig, Op, Problem, Tuning, Variant, register, tunable, vjp_training
from ops._partitioning import reshape, run
from ops.decoder.reference import rotary_embedding_reference

_OP = "apply_rotary_embedding"

# Elements of x per program on a GPU: 16 KiB of bf16 read and written, enough
# loads in flight per SM for a copy-like kernel at 8 programs per SM.
_GPU_BLOCK_ELEMENTS = 8192
# Bytes of x per program on mosaic_tpu (double-buffered in and out: 4 x this in VMEM).
_TPU_BLOCK_BYTES = 1 << 19


def apply_rotary_embedding(x, positions, inv_freq, *, interleaved: bool = False,
                           attention_scaling: float = 1.0, implementation=None,
                           block_sizes=None) -> jax.Array:
    """Rotates the first ``R`` features of every head by ``positions * inv_freq``.

    Args:
      x: ``[B, T, N, H]`` or ``[T, N, H]`` (tokens, heads, head dim), float32 /
        bfloat16 / float16: queries or keys.
      positions: integer ``[B, T]`` or ``[T]`` (a ``[T]`` is shared by every
        batch row), the token positions (any int dtype; read as int32, and
        converted to float32 for the angle, exact below ``2**24``, as
        transformers converts them).
      inv_freq: ``[R / 2]`` float (read as float32), ``R <= H``: the inverse
        frequencies in radians per position, from :func:`ops.rope_frequencies`.
      interleaved: a static bool: False pairs feature ``i`` with ``i + R/2``
        (transformers' ``rotate_half``), True pairs ``2i`` with ``2i + 1`` (GPT-J).
      attention_scaling: a static Python number multiplying ``cos`` and ``sin``
        (YaRN's attention factor; :func:`ops.rope_frequencies` returns it).
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton", "pallas_triton" or
        "mosaic_tpu", or a
        sequence of these tried in order (:mod:`ops._implementation`).
        ``pallas_triton`` needs power-of-two ``H``, ``R / 2`` and ``H - R`` (or
        ``R = H``) and raises NotImplementedError otherwise.
      block_sizes: optional ``(block_tokens, block_heads)``; None takes the tuning
        cache's entry, else the heuristic (:class:`RopeConfig`).

    Returns:
      x's shape and dtype: ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` for each pair
      ``(x1, x2)``, features ``R..H`` unchanged, computed in float32 and rounded once.

    Raises:
      TypeError: non-arrays, x not float32 / bfloat16 / float16, positions not
        integer, inv_freq not floating, interleaved not a bool, attention_scaling
        not a Python number.
      ValueError: x not rank 3 or 4, positions not ``[B, T]`` / ``[T]`` of x's
        tokens, inv_freq not rank 1 or empty, ``2 len(inv_freq) > H``, a
        non-finite attention_scaling, bad block_sizes or implementation.

    Differentiable in x (the rotation by the negative angle, one kernel) and
    inv_freq (XLA); jit- and vmap-compatible.
    """
    interleaved, attention_scaling, blocks = _check(x, positions, inv_freq, interleaved,
                                                    attention_scaling, block_sizes)
    return OP.run(implementation, x=x, positions=positions, inv_freq=inv_freq,
                  interleaved=interleaved, scaling=attention_scaling, explicit=blocks)


def _check(x, positions, inv_freq, interleaved, attention_scaling, block_sizes):
    check_array(x, "x", _OP)
    check_array(positions, "positions", _OP)
    check_array(inv_freq, "inv_freq", _OP)
    check_float_dtype(x, "x", _OP)
    if x.ndim not in (3, 4):
        raise ValueError(f"{_OP}: x must be [B, T, N, H] or [T, N, H], got shape {tuple(x.shape)}.")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{_OP}: positions must have an integer dtype, got "
                        f"{np.dtype(positions.dtype).name}.")
    tokens = tuple(x.shape[:-2])
    if tuple(positions.shape) not in (tokens, tokens[-1:]):
        raise ValueError(f"{_OP}: positions must have shape {tokens}"
                         + (f" or {tokens[-1:]}" if len(tokens) > 1 else "")
                         + f" (x's tokens), got {tuple(positions.shape)}.")
    if not jnp.issubdtype(inv_freq.dtype, jnp.floating):
        raise TypeError(f"{_OP}: inv_freq must be a float array (float32 [R / 2]), got "
                        f"{np.dtype(inv_freq.dtype).name}.")
    if inv_freq.ndim != 1 or inv_freq.shape[0] == 0:
        raise ValueError(f"{_OP}: inv_freq must have shape [R / 2] with R >= 2, got "
                         f"{tuple(inv_freq.shape)}.")
    if 2 * inv_freq.shape[0] > x.shape[-1]:
        raise ValueError(f"{_OP}: the rotary dim R = 2 * len(inv_freq) = {2 * inv_freq.shape[0]} "
                         f"exceeds x's head dim H = {x.shape[-1]}.")
    if not isinstance(interleaved, (bool, np.bool_)):
        raise TypeError(f"{_OP}: interleaved must be a bool, got {type(interleaved).__name__}.")
    if isinstance(attention_scaling, bool) or not isinstance(attention_scaling, numbers.Real):
        raise TypeError(f"{_OP}: attention_scaling must be a Python number, got "
                        f"{type(attention_scaling).__name__}.")
    if not np.isfinite(attention_scaling):
        raise ValueError(f"{_OP}: attention_scaling must be finite, got {attention_scaling}.")
    blocks = None
    if block_sizes is not None:
        sizes = tuple(block_sizes)
        if len(sizes) != 2 or not all(isinstance(b, (int, np.integer)) and not isinstance(b, bool)
                                      and b > 0 for b in sizes):
            raise ValueError(f"{_OP}: block_sizes must be two positive ints (block_tokens, "
                             f"block_heads), got {block_sizes!r}.")
        blocks = RopeConfig(block_tokens=int(sizes[0]), block_heads=int(sizes[1]))
    return bool(interleaved), float(attention_scaling), blocks


def _rope_on(impl, x, positions, inv_freq, interleaved, scaling, explicit):
    """The checked call on one implementation."""
    positions = jnp.broadcast_to(positions, x.shape[:-2]).astype(jnp.int32)
    inv_freq = inv_freq.astype(jnp.float32)
    if impl == "xla" or x.size == 0:
        return rotary_embedding_reference(x, positions, inv_freq, interleaved=interleaved,
                                          attention_scaling=scaling)
    *_, heads, head_dim = x.shape
    rotary_dim = 2 * inv_freq.shape[0]
    if pl.backend_traits(impl).power_of_two_blocks:
        _require_powers_of_two(impl, head_dim, rotary_dim)
    problem = OP.problem((x.size // (heads * head_dim), heads, head_dim, rotary_dim), x.dtype,
                         {"interleaved": interleaved})
    config = OP.select(problem, impl, explicit)
    x3 = reshape(x, (-1, heads, head_dim))
    kernel = _Kernel(backend=impl, config=config, interleaved=interleaved, scaling=scaling)
    out = _rope(x3, reshape(positions, (-1, 1)), inv_freq.reshape(1, -1), kernel)
    return reshape(out, x.shape)


def _odd_blocks(head_dim: int, rotary_dim: int) -> str | None:
    """Why JAX's Pallas Triton lowering cannot tile the call (None: it can): its blocks
    (the head dim, half the rotary dims, the unrotated rest) must be powers of two."""
    sizes = {"H": head_dim, "R / 2": rotary_dim // 2}
    if rotary_dim < head_dim:
        sizes["H - R"] = head_dim - rotary_dim
    odd = {k: v for k, v in sizes.items() if v & (v - 1)}
    if odd:
        return (f"needs power-of-two blocks (JAX's Pallas Triton lowering), got {odd}; "
                "'triton' pads them")
    return None


def _require_powers_of_two(impl, head_dim, rotary_dim):
    why = _odd_blocks(head_dim, rotary_dim)
    if why is not None:
        raise NotImplementedError(f"{_OP}: implementation={impl!r} {why}.")


def _problem_of(x, inv_freq, interleaved, **_):
    """The call's problem ``(tokens, heads, head_dim, rotary_dim)`` and variant
    (:attr:`ops._op.Op.problem_of`)."""
    *_, heads, head_dim = x.shape
    return ((x.size // max(heads * head_dim, 1), heads, head_dim, 2 * inv_freq.shape[0]), x.dtype,
            {"interleaved": bool(interleaved)})


def _pallas_triton_supported(call) -> str | None:
    return _odd_blocks(call.args["x"].shape[-1], 2 * call.args["inv_freq"].shape[0])


# --------------------------------------------------------------------------
# Config (the op layer's typed config) and its heuristic
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RopeVariant(Variant):
    """What changes the kernel beyond shape and dtype: the pairing."""

    interleaved: bool = False


@dataclasses.dataclass(frozen=True)
class RopeConfig(KernelConfig):
    """The rotary kernel's launch configuration.

    Attributes:
      block_tokens: tokens per program.
      block_heads: heads per program (each with its whole head dim).
      num_warps: Triton warps (None: 4).
    """

    block_tokens: int = tunable()
    block_heads: int = tunable()
    num_warps: int | None = tunable(None)

    @classmethod
    def heuristic(cls, problem: Problem, device: Device) -> "RopeConfig":
        """Blocks of about 8192 elements on Triton GPUs (whole heads; power-of-two
        sizes), of about 512 KiB with every head on mosaic_tpu (token blocks a
        multiple of 8, the sublane tiling of the positions block), 8 tokens and
        up to 4 heads on the interpreter (so edge blocks are exercised), and
        whole dims up to 128 tokens in Triton's CPU interpreter."""
        tokens, heads, head_dim, _ = problem.shape
        p2 = pl.next_power_of_2
        if device.interpreter:
            return cls(min(128, p2(tokens)), p2(heads))
        traits = device.traits
        if traits.hardware == "tpu":
            row_bytes = heads * head_dim * np.dtype(problem.dtype).itemsize
            bt = max(8, _TPU_BLOCK_BYTES // max(1, row_bytes) // 8 * 8)
            return cls(tokens if tokens <= bt else bt, heads)
        if traits.triton:
            hp = p2(head_dim)
            bh = min(p2(heads), max(1, _GPU_BLOCK_ELEMENTS // hp))
            bt = min(p2(tokens), max(1, _GPU_BLOCK_ELEMENTS // (bh * hp)))
            return cls(bt, bh)
        return cls(min(8, p2(tokens)), min(4, p2(heads)))

    @classmethod
    def candidates(cls, problem: Problem, device: Device) -> tuple["RopeConfig", ...]:
        """The heuristic's blocks at a half, twice and four times the elements, at 4 and 8 warps."""
        base = cls.heuristic(problem, device)
        if not device.traits.triton or device.interpreter:
            return (base,)
        tokens = pl.next_power_of_2(problem.shape[0])
        out = []
        for scale in (1, 2, 4, 0.5):
            bt = int(min(tokens, max(1, base.block_tokens * scale)))
            for warps in (4, 8):
                c = cls(bt, base.block_heads, warps)
                if c not in out:
                    out.append(c)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    backend: str
    config: RopeConfig
    interleaved: bool
    scaling: float


# --------------------------------------------------------------------------
# The kernel: rotation by +angle (forward) or -angle (backward)
# --------------------------------------------------------------------------

def _rotary_kernel(pos_ref, freq_ref, x_ref, o_ref, *, half, head_dim, interleaved, cos_scale,
                   sin_scale):
    angles = pos_ref[...].astype(jnp.float32) * freq_ref[...]  # [bt, 1] * [1, R/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if cos_scale != 1.0:
        cos = cos * cos_scale
    if sin_scale != 1.0:
        sin = sin * sin_scale
    if interleaved:
        first, second = pl.ds(0, half, stride=2), pl.ds(1, half, stride=2)
    else:
        first, second = pl.ds(0, half), pl.ds(half, half)
    x1 = x_ref[:, :, first].astype(jnp.float32)
    x2 = x_ref[:, :, second].astype(jnp.float32)
    o_ref[:, :, first] = (x1 * cos - x2 * sin).astype(o_ref.dtype)
    o_ref[:, :, second] = (x2 * cos + x1 * sin).astype(o_ref.dtype)
    rotary = 2 * half
    if rotary < head_dim:
        rest = pl.ds(rotary, head_dim - rotary)
        o_ref[:, :, rest] = x_ref[:, :, rest]


def _rotate(x, positions, inv_freq, kernel: _Kernel, *, inverse: bool):
    """One device: x ``[tokens, N, H]`` rotated by ``+-positions * inv_freq``."""
    tokens, heads, head_dim = x.shape
    half = inv_freq.shape[1]
    cfg = kernel.config
    bt, bh = min(cfg.block_tokens, tokens), min(cfg.block_heads, heads)
    traits = pl.backend_traits(kernel.backend)
    sublanes = traits.tile[0]
    if sublanes > 1:
        bh = heads  # the second-minor dim of x's block: whole (or whole sublane tiles)
        if bt != tokens:  # the second-minor dim of the positions block
            bt = max(sublanes, bt // sublanes * sublanes)
    grid = (pl.cdiv(tokens, bt), pl.cdiv(heads, bh))
    sin_scale = -kernel.scaling if inverse else kernel.scaling
    body = functools.partial(_rotary_kernel, half=half, head_dim=head_dim,
                             interleaved=kernel.interleaved, cos_scale=kernel.scaling,
                             sin_scale=sin_scale)
    semantics = ("parallel", "parallel")
    if traits.triton:
        params = pl.triton.CompilerParams(num_warps=cfg.num_warps or 4, num_stages=1,
                                          dimension_semantics=semantics)
    else:
        params = pl.CompilerParams(semantics)
    block = pl.BlockSpec((bt, bh, head_dim), lambda i, j: (i, j, 0))
    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=grid,
        in_specs=[pl.BlockSpec((bt, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec((1, half), lambda i, j: (0, 0)), block],
        out_specs=block, compiler_params=params, backend=kernel.backend,
        name="rotary_embedding_bwd" if inverse else "rotary_embedding")(positions, inv_freq, x)


def _partitioned(x, positions, inv_freq, kernel: _Kernel, *, inverse: bool):
    """Tokens and heads run where they live; the head dim and inv_freq are needed whole."""
    def local(x, positions, inv_freq, *, reduced):
        del reduced
        return (_rotate(x, positions, inv_freq, kernel, inverse=inverse),)

    return run(_OP, local, (x, positions, inv_freq), ("t n h", "t one", "one f"), ("t n h",),
               gather=("h", "f"), out_like=(0,))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rope(x, positions, inv_freq, kernel: _Kernel):
    return _partitioned(x, positions, inv_freq, kernel, inverse=False)


def _rope_fwd(x, positions, inv_freq, kernel):
    return _partitioned(x, positions, inv_freq, kernel, inverse=False), (x, positions, inv_freq)


def _rope_bwd(kernel, residuals, g):
    x, positions, inv_freq = residuals
    dx = _partitioned(g, positions, inv_freq, kernel, inverse=True)
    # d inv_freq from XLA (dead code under jit unless asked for).
    _, pullback = jax.vjp(lambda f: rotary_embedding_reference(
        x, positions[:, 0], f[0], interleaved=kernel.interleaved,
        attention_scaling=kernel.scaling), inv_freq)
    (dfreq,) = pullback(g)
    return dx, None, dfreq


_rope.defvjp(_rope_fwd, _rope_bwd)


# --------------------------------------------------------------------------
# Registration with the op layer
# --------------------------------------------------------------------------

def _example(problem: Problem, implementation: str):
    tokens, heads, head_dim, rotary_dim = problem.shape
    args = [jax.ShapeDtypeStruct((tokens, heads, head_dim), problem.dtype),
            jax.ShapeDtypeStruct((tokens,), jnp.int32),
            jax.ShapeDtypeStruct((rotary_dim // 2,), jnp.float32)]
    interleaved = problem.variant_dict().get("interleaved", False)

    def fn(x, positions, inv_freq):
        return apply_rotary_embedding(x, positions, inv_freq, interleaved=interleaved,
                                      implementation=implementation)
    return fn, args


OP = register(Op(
    name=_OP, dims=("tokens", "heads", "head_dim", "rotary_dim"),
    configs={b: RopeConfig for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=rotary_embedding_reference, variant=RopeVariant, entry=_rope_on,
    problem_of=_problem_of, function=apply_rotary_embedding, supported={"pallas_triton": _pallas_triton_supported},
    tuning=Tuning(example=_example, shapes=((16384, 32, 128, 128), (16384, 8, 128, 128)),
                  quick=((256, 4, 64, 64),), training=vjp_training(_example)),
    missing_reason=" (mosaic_gpu: no kernel for it yet)"))
