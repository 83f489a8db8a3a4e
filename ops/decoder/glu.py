"""Gated linear unit: ``activation(x @ gate) * (x @ up)``.

Dauphin et al. 2017, "Language Modeling with Gated Convolutional Networks"
(section 3) and Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU with
silu, GeGLU with gelu, ReGLU with relu, the bilinear layer with no
activation). Tokamax's semantics: the activation on the gate, the product in
float32, the result in x's dtype. The weights come in two forms: Tokamax's
stacked ``[K, 2, N]`` (gate at index 0), or a pair ``(gate, up)`` of ``[K,
N]`` arrays, which is how models hold them (``layers.GatedMLP``): the kernels
read each projection in place, so no per-call stack copies ``2 K N`` weights.

Forward: one tiled-matmul kernel (the walk of :mod:`ops.matmul.tiled`) with
two float32 accumulators: each program owns a ``block_m x block_n`` tile of
the output, loads each ``x`` tile once per contraction step and multiplies it
by the gate and the up tiles (two Refs: of the one stacked array, the middle
dim squeezed, or of the two arrays of the pair), then applies the activation
and the product in the epilogue. When gradients are wanted the same kernel
also stores the two pre-activations ``z = (x @ gate, x @ up)`` in x's dtype
(one ``[M, 2, N]`` array for stacked weights, a pair of ``[M, N]`` for a
pair; as Tokamax's residuals and ``ops.fused_matmul``'s pre-activation):
recomputing them would cost the forward's ``4 M N K`` flops again.

Backward (``jax.custom_vjp``): one elementwise kernel turns ``(g, z)`` into
``dz = (g * up * act'(gate), g * act(gate))``, written over ``z`` in place
(``input_output_aliases``: the backward holds no ``[M, N]`` array beyond the
two pre-activations). Stacked: with ``[M, 2, N]`` viewed as ``[M, 2N]`` and
``weights`` as ``[K, 2N]`` (free reshapes), ``dx = dz @ weights^T`` and ``dw
= x^T @ dz`` are one matmul each on the shared tiled core. Pair: ``dx =
dz_gate @ gate^T + dz_up @ up^T`` is one kernel with one accumulator and two
products per step, and ``(dgate, dup) = (x^T @ dz_gate, x^T @ dz_up)`` one
kernel with two accumulators sharing the x tile (the forward's shape): the
same tiles and work per step as the stacked form's matmuls, with no
concatenation. ``act'`` comes from JAX autodiff of the activation, traced
inside the kernel.

``implementation="mosaic_gpu"`` runs the same checks, custom_vjp and partitioning
with the products on the warp-specialized Mosaic GPU core instead
(:mod:`ops.matmul.mosaic_gpu_glu`, handed in as ``_Kernel.products``): two
accumulators per consumer warpgroup on a shared x tile, the pre-activations stored
in place in the stacked form, ``dz`` by one XLA fusion, ``dx`` / ``dw`` as above.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import pallas_core as pl
from ops._checks import check_array, check_float_dtype, check_same_dtype
from ops._op import (Call, Device, Implementation, Op, Problem, Tuning, Variant, fit, register,
                     register_implementation, vjp_training)
from ops._partitioning import psum, reduced_axes, reshape, run
from ops.activations import resolve_activation
from ops.decoder.reference import gated_linear_unit_reference, glu_backward_reference
from ops.matmul import tiled
from ops.matmul.config import MatmulConfig, check_block_sizes
from ops.matmul import mosaic_gpu
from ops.matmul.mosaic_gpu_config import MosaicMatmulConfig
from ops.matmul.mosaic_gpu_glu import GluKernels, MosaicGluConfig

_OP = "gated_linear_unit"


def gated_linear_unit(x, weights, *, activation=None, implementation=None,
                      block_sizes=None) -> jax.Array:
    """``activation(x @ gate) * (x @ up)`` with float32 accumulation.

    Args:
      x: ``[..., K]`` float32 / bfloat16 / float16; any number of leading dims.
      weights: the gate and up projections, x's dtype, in one of two forms:

        * a pair ``(gate, up)`` of ``[K, N]`` arrays (a tuple or list of two,
          same shape): each read in place by the kernels as its own operand.
          Use it when the projections are separate parameters (transformers'
          ``gate_proj.weight.T`` and ``up_proj.weight.T``, :class:`layers.GatedMLP`):
          stacking them per call would copy ``2 K N`` weights, as much memory
          traffic again as the kernel's own read at decode sizes. The gradient
          is a pair too.
        * one ``[K, 2, N]`` array, gate at ``[:, 0]`` and up at ``[:, 1]``
          (Tokamax's layout): for weights already stored stacked. The gradient
          has that shape.

      activation: None (the bilinear GLU), a name ``ops.fused_matmul`` accepts
        (``"silu"`` for SwiGLU, ``"gelu"`` (tanh) or ``"gelu_exact"`` for GeGLU,
        ``"relu"``, ``"sigmoid"``, ...; :data:`ops.ACTIVATIONS`) or an
        elementwise JAX callable, applied to the float32 gate.
      implementation: None (the default: "xla" on a CPU; on a GPU the fastest
        measured implementation that can run the call, which
        ``ops.resolve_implementation`` names with its measurement; "mosaic_tpu"
        on a TPU; docs/design.md §5.2), "xla", "interpret", "triton", "pallas_triton",
        "mosaic_tpu" or "mosaic_gpu" (sm_90 warp-specialized kernels,
        :mod:`ops.matmul.mosaic_gpu_glu`: bfloat16 / float16, activations Mosaic GPU's
        lowering takes, a ``MosaicGluConfig`` as block_sizes; NotImplementedError
        otherwise), or a
        sequence of these tried in order (:mod:`ops._implementation`).
        With stacked weights ``mosaic_tpu`` needs ``block_n`` to divide N (its
        heuristic finds one when N <= 512 or N is a multiple of 128) and raises
        NotImplementedError otherwise; the pair form has no such limit.
      block_sizes: optional ``(block_m, block_n, block_k)`` of the forward kernel
        (``block_n`` columns of each of the two accumulators) or a
        :class:`GluConfig`; None takes the tuning cache's entry, else the
        heuristic. The backward's products reuse the tiles by role.

    Returns:
      ``[..., N]`` in x's dtype. With ``K = 0``: ``activation(0) * 0`` (zeros).
      Both forms give the same bits when the same tiles run.

    Raises:
      TypeError: non-arrays, an integer / unsupported dtype, weights' dtype not
        x's, an activation that is neither None, a name nor a callable.
      ValueError: weights neither ``[K, 2, N]`` nor a pair of equal ``[K, N]``
        with x's K, an unknown activation name or a non-elementwise callable,
        bad block_sizes or implementation.

    Differentiable in x and weights (``jax.custom_vjp`` with Pallas backward
    kernels); jit- and vmap-compatible.
    """
    act, explicit, weights = _check(x, weights, activation, block_sizes)
    return OP.run(implementation, x=x, weights=weights, act=act, explicit=explicit)


_FORMS = ("weights must be one [K, 2, N] array (gate and up stacked on axis 1) or a pair "
          "(gate, up) of [K, N] arrays")


def _check_weights(x, weights):
    """``weights`` as the kernels take it: a ``[K, 2, N]`` array or a tuple of two ``[K, N]``."""
    k = x.shape[-1]
    if isinstance(weights, (tuple, list)):
        if len(weights) != 2:
            raise ValueError(f"{_OP}: {_FORMS}; got a {type(weights).__name__} of "
                             f"{len(weights)}.")
        for i, w in enumerate(weights):
            check_array(w, f"weights[{i}]", _OP)
            check_same_dtype(w, x, f"weights[{i}]", "x", _OP)
        shapes = tuple(tuple(w.shape) for w in weights)
        if len(shapes[0]) != 2 or shapes[0] != shapes[1]:
            raise ValueError(f"{_OP}: {_FORMS}; the pair has shapes {shapes[0]} and {shapes[1]}.")
        if shapes[0][0] != k:
            raise ValueError(f"{_OP}: x's last dim ({k}) must equal the first dim of the weights "
                             f"pair ({shapes[0][0]}); got x {tuple(x.shape)} and weights "
                             f"{shapes[0]} x 2.")
        return tuple(weights)
    check_array(weights, "weights", _OP)
    check_same_dtype(weights, x, "weights", "x", _OP)
    if weights.ndim != 3 or weights.shape[1] != 2:
        raise ValueError(f"{_OP}: {_FORMS}; got shape {tuple(weights.shape)}.")
    if weights.shape[0] != k:
        raise ValueError(f"{_OP}: x's last dim ({k}) must equal weights' first dim "
                         f"({weights.shape[0]}); got x {tuple(x.shape)} and weights "
                         f"{tuple(weights.shape)}.")
    return weights


def _check(x, weights, activation, block_sizes):
    """``(activation, explicit config or None, weights normalised)`` or the error."""
    check_array(x, "x", _OP)
    check_float_dtype(x, "x", _OP)
    if x.ndim < 1:
        raise ValueError(f"{_OP}: x must have rank >= 1 [..., K], got a scalar.")
    weights = _check_weights(x, weights)
    act = resolve_activation(activation, _OP)
    if isinstance(block_sizes, MosaicMatmulConfig):  # implementation="mosaic_gpu"'s tiles
        block_sizes.check(_OP)
        return act, block_sizes, weights
    explicit = check_block_sizes(block_sizes, _OP, GluConfig)
    if isinstance(explicit, tuple):
        explicit = GluConfig(*explicit)
    return act, explicit, weights


def _problem(m: int, n: int, k: int, dtype, weights) -> Problem:
    """The op layer's problem of a call: its dims, dtype and weights' form."""
    return OP.problem(*_problem_dims(m, n, k, dtype, weights))


def _problem_dims(m: int, n: int, k: int, dtype, weights) -> tuple:
    return (m, n, k), dtype, {"stacked": True} if not isinstance(weights, tuple) else None


def _problem_of(x, weights, **_):
    """The call's problem (:attr:`ops._op.Op.problem_of`), forward or backward."""
    k, n = _dims(weights)
    return _problem_dims(math.prod(x.shape[:-1]), n, k, x.dtype, weights)


def _entry(impl, x, weights, act, explicit, backward=None, products=None):
    """The checked call on one implementation: the forward, or with ``backward =
    (preactivations, g)`` :func:`glu_backward`'s; ``products``: another core's
    (:class:`_Kernel`), None for the tiled walks here."""
    if products is None and isinstance(explicit, MosaicMatmulConfig):
        raise NotImplementedError(f"{_OP}: block_sizes is a {type(explicit).__name__}, the "
                                  f"tiles of implementation='mosaic_gpu', not of {impl!r}.")
    if backward is None:
        return _glu_on(impl, x, weights, act, explicit, products)
    return _glu_backward_on(impl, x, weights, act, explicit, *backward, products=products)


def _dims(weights) -> tuple[int, int]:
    """``(K, N)`` of either form."""
    if isinstance(weights, tuple):
        return tuple(weights[0].shape)
    return weights.shape[0], weights.shape[2]


def _glu_on(impl, x, weights, act, explicit, products=None):
    """The checked call on one implementation."""
    k, n = _dims(weights)
    if impl == "xla" or x.size == 0 or k * n == 0:
        # Nothing to multiply (M, K or N zero): XLA's answer is exact, with its gradients.
        return gated_linear_unit_reference(x, weights, act)
    x2 = reshape(x, (-1, k))
    config = OP.select(_problem(x2.shape[0], n, k, x.dtype, weights), impl, explicit)
    out = _glu(x2, weights, _Kernel(impl, config, act, products))
    return reshape(out, (*x.shape[:-1], n))


def glu_backward(x, weights, preactivations, g, *, activation=None, implementation=None,
                 block_sizes=None):
    """The backward pass alone: ``(dx, dweights)`` from the forward's residuals.

    What ``jax.vjp`` of :func:`gated_linear_unit` runs after the forward (the
    benchmarks time it as the "bwd" pass; the "xla" implementation is
    :func:`ops.decoder.reference.glu_backward_reference`).

    Args:
      x, weights, activation, implementation, block_sizes: as :func:`gated_linear_unit`.
      preactivations: the forward's residual in the form of ``weights``: with
        ``[K, 2, N]`` weights one ``[..., 2, N]`` array (``x @ gate`` and ``x @ up``
        stacked on axis -2), with a pair a pair of ``[..., N]``; x's dtype.
      g: ``[..., N]``, the output's cotangent.

    Returns:
      ``(dx [..., K], dweights)``, dweights in the form of ``weights``.

    Raises:
      as :func:`gated_linear_unit`; ValueError when preactivations (form or
      shapes) or g do not match the above.
    """
    act, explicit, weights = _check(x, weights, activation, block_sizes)
    k, n = _dims(weights)
    lead = tuple(x.shape[:-1])
    paired = isinstance(weights, tuple)
    if paired != isinstance(preactivations, (tuple, list)) or (paired and len(preactivations) != 2):
        raise ValueError(f"{_OP}: preactivations must be in the form of weights: "
                         + ("a pair of [..., N] arrays" if paired else "one [..., 2, N] array")
                         + f", got {type(preactivations).__name__}.")
    pres = tuple(preactivations) if paired else (preactivations,)
    pre_shape = (*lead, n) if paired else (*lead, 2, n)
    for name, a, shape in ((f"preactivations[{i}]" if paired else "preactivations", p, pre_shape)
                           for i, p in enumerate(pres)):
        check_array(a, name, _OP)
        if tuple(a.shape) != shape:
            raise ValueError(f"{_OP}: {name} must have shape {shape}, got {tuple(a.shape)}.")
    check_array(g, "g", _OP)
    if tuple(g.shape) != (*lead, n):
        raise ValueError(f"{_OP}: g must have shape {(*lead, n)}, got {tuple(g.shape)}.")

    return OP.run(implementation, pass_="bwd", x=x, weights=weights, act=act, explicit=explicit,
                  backward=(preactivations, g))


def _glu_backward_on(impl, x, weights, act, explicit, preactivations, g, products=None):
    """:func:`glu_backward`'s checked call on one implementation."""
    k, n = _dims(weights)
    lead = tuple(x.shape[:-1])
    if impl == "xla" or x.size == 0 or k * n == 0:
        return glu_backward_reference(x, weights, preactivations, g.astype(x.dtype), act)
    pres = tuple(preactivations) if isinstance(weights, tuple) else (preactivations,)
    x2 = reshape(x, (-1, k))
    config = OP.select(_problem(x2.shape[0], n, k, x.dtype, weights), impl, explicit)
    zs = tuple(reshape(p.astype(x.dtype), (x2.shape[0], *p.shape[len(lead):])) for p in pres)
    dx, dw = _glu_bwd(_Kernel(impl, config, act, products), (x2, weights, zs),
                      reshape(g.astype(x.dtype), (-1, n)))
    return reshape(dx, x.shape), dw


# --------------------------------------------------------------------------
# Config and heuristic
# --------------------------------------------------------------------------

def _squeezes_halves(traits: pl.BackendTraits) -> bool:
    """Whether ``traits``' backend lays out a ``(block_k, None, block_n)`` block of stacked
    ``[K, 2, N]`` weights: a squeezed second-minor dim of 2 fits its tiling (not Mosaic
    TPU's (8, 128) tiles, where the stacked form reads column blocks of a ``[K, 2N]`` view)."""
    return traits.fits_tile(1, 2, axis=-2)


@dataclasses.dataclass(frozen=True)
class GluVariant(Variant):
    """What changes the kernels beyond shape and dtype: the weights' form. ``stacked``
    (one ``[K, 2, N]`` array) reads them through a squeezed or ``[K, 2N]`` view and runs
    the backward's dx and dw as plain matmuls; the pair (the plain call, what
    ``layers.GatedMLP`` passes) runs its own dx and dw kernels."""

    stacked: bool = False


@dataclasses.dataclass(frozen=True)
class GluConfig(MatmulConfig):
    """The forward kernel's launch configuration: :class:`ops.matmul.config.MatmulConfig`'s
    fields, ``block_n`` being the columns of each of the gate and up accumulators (the
    kernel's tile is ``block_m x 2 block_n``); its own heuristic and candidates.

    ``walk``: None for the backend's (:func:`ops.matmul.tiled.strategy`); both walks
    run on every backend. ``epilogue_subtile`` is pinned to None (not tunable, so not
    in the tuning cache's entries; 1 is accepted and means the same): the GLU's tiles
    already split the output columns between two ``block_m x block_n`` accumulators
    (block_n halved on the Triton backends), and a split epilogue buys nothing at
    them: compiled for sm_90 (bfloat16, 8192 x 4096 -> 14336, the forward that stores
    the pre-activations), the largest candidate (two 128 x 128 accumulators) takes
    178-190 registers with no spills whole, and halves move registers by under 7
    and shared memory not at all.
    """

    epilogue_subtile: int | None = None  # not tunable: see the class docstring

    def check(self, op: str) -> None:
        """:meth:`MatmulConfig.check`, and ``epilogue_subtile`` None or 1."""
        if self.epilogue_subtile not in (None, 1):
            raise ValueError(f"{op}: block_sizes.epilogue_subtile must be None or 1 (the gated "
                             f"linear unit's epilogue is not split), got {self.epilogue_subtile!r}.")
        super().check(op)

    @classmethod
    def heuristic(cls, problem: Problem, device: Device) -> "GluConfig":
        """The tiled core's tiles for ``[M, K] @ [K, N]``, with ``block_n`` halved on the
        Triton backends: two ``block_m x block_n`` float32 accumulators then hold
        what one 128 x 128 matmul tile holds (64 KiB of registers at 8 warps), and
        each x tile feeds 128 output columns, as in ``ops.fused_matmul``. For stacked
        weights on mosaic_tpu ``block_n`` divides N where a multiple of 128 does (the
        ``[K, 2N]`` view needs it); a pair keeps the tiled core's ``block_n``."""
        m, n, k = problem.shape
        if device.interpreter:
            return cls.from_blocks(tiled.interpreter_block_sizes(m, n, k), device.backend)
        bm, bn, bk = tiled.default_block_sizes(m, n, k, problem.dtype, device.backend)
        if device.traits.triton:
            bn = max(16, bn // 2)
        elif (problem.variant_dict().get("stacked", False) and not _squeezes_halves(device.traits)
              and n % bn):
            # The stacked form's gate and up tiles are column blocks of one [K, 2N] view:
            # block_n divides N (a pair takes edge blocks).
            bn = next((c for c in (512, 384, 256, 128) if c <= bn and n % c == 0), bn)
        return cls.from_blocks((bm, bn, bk), device.backend)

    @classmethod
    def candidates(cls, problem: Problem, device: Device) -> tuple["GluConfig", ...]:
        """Tiles around the heuristic's on the Triton backends (64 / 128 rows and
        columns, 32 / 64 contraction steps, 4 or 8 warps, 3 or 4 stages)."""
        base = cls.heuristic(problem, device)
        if not device.traits.triton or device.interpreter:
            return (base,)
        m, n, k = problem.shape
        walk = tiled.strategy(device.backend)
        out = [base]
        for bm, bn, bk, warps, stages in ((128, 64, 64, 8, 3), (128, 64, 64, 4, 4),
                                          (64, 128, 64, 8, 3), (128, 128, 32, 8, 3),
                                          (64, 64, 64, 4, 4), (128, 64, 32, 8, 4)):
            c = cls(fit(bm, m), fit(bn, n), fit(bk, k), warps, stages, walk=walk)
            if c not in out:
                out.append(c)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One call's kernels: the implementation, its config, the activation and, where the
    products run on another core than the tiled walks below, that core's
    (``forward(x, weights, config, activation, want_z=, out_dtype=)`` and
    ``backward(x, weights, zs, g, config, activation)``:
    :class:`ops.matmul.mosaic_gpu_glu.GluKernels`)."""

    backend: str
    config: GluConfig
    activation: object
    products: object = None


# --------------------------------------------------------------------------
# The kernels: products of A and B tiles on the tiled core's walks
# --------------------------------------------------------------------------
#
# Every kernel here accumulates products of two-dimensional tiles on
# :func:`ops.matmul.tiled.products_call`: the forward ``x @ gate`` and ``x @ up``
# (two accumulators sharing the x tile), the paired backward's ``dw``
# (``x^T @ dz_gate``, ``x^T @ dz_up``: the same shape) and its ``dx``
# (``dz_gate @ gate^T + dz_up @ up^T``: one accumulator). An operand is a
# :class:`ops.matmul.tiled.Operand`: its array, whether its free dim follows the
# output tile's rows or columns, which of its two matrix dims is contracted, and,
# for the stacked ``[K, 2, N]`` weights or ``[M, 2, N]`` pre-activations, the half
# its squeezed middle index picks.

_Operand = tiled.Operand


def _products_call(operands, products, *, kernel: "_Kernel", params, **kw):
    """:func:`ops.matmul.tiled.products_call` on the kernel's backend."""
    return tiled.products_call(operands, products, backend=kernel.backend,
                               compiler_params=params, **kw)


def _load_half(refs, half: int):
    """The gate (0) or up (1) half of a stacked ``[bm, 2, bn]`` block or of a pair of blocks."""
    return refs[0][:, half, :] if len(refs) == 1 else refs[half][...]


def _store_half(refs, half: int, value) -> None:
    """Stores ``value`` as the gate (0) or up (1) half, as :func:`_load_half` reads it."""
    if len(refs) == 1:
        refs[0][:, half, :] = value.astype(refs[0].dtype)
    else:
        refs[half][...] = value.astype(refs[half].dtype)


# --------------------------------------------------------------------------
# Forward kernel: the tiled walk with two accumulators
# --------------------------------------------------------------------------

def _epilogue(accs, outs, *, activation):
    """``out = act(gate) * up``; with z outputs (one stacked or a pair) the two
    pre-activations stored first."""
    gate, up = accs
    out_ref, z_refs = outs[0], outs[1:]
    if z_refs:
        _store_half(z_refs, 0, gate)
        _store_half(z_refs, 1, up)
    if activation is not None:
        gate = activation(gate)
    out_ref[...] = (gate * up).astype(out_ref.dtype)


def _forward_call(x, weights, kernel: _Kernel, *, want_z: bool, out_dtype=None):
    """``(out,)`` or ``(out, *z)``: x ``[M, K]``; weights ``[K, 2, N]`` (z one ``[M, 2,
    N]``) or a pair of ``[K, N]`` (z a pair of ``[M, N]``). With ``out_dtype`` float32
    and no activation (the partial products of a split contraction) the caller applies
    the epilogue itself.

    The stacked weights are zero-padded to whole ``block_k`` steps (a copy, made only
    when ``block_k`` does not divide K); a pair is read in place, the contraction's
    edge masked in the kernel."""
    if kernel.products is not None:
        return kernel.products.forward(x, weights, kernel.config, kernel.activation,
                                       want_z=want_z, out_dtype=out_dtype)
    cfg, backend = kernel.config, kernel.backend
    bm, bn, bk = cfg.blocks
    m, k = x.shape
    paired = isinstance(weights, tuple)
    n = weights[0].shape[1] if paired else weights.shape[2]
    walk = cfg.walk or tiled.strategy(backend)
    out_dtype = out_dtype or x.dtype
    out_shapes = [jax.ShapeDtypeStruct((m, n), out_dtype)]
    z_shapes = [jax.ShapeDtypeStruct((m, n), out_dtype)] * 2 if paired else [
        jax.ShapeDtypeStruct((m, 2, n), out_dtype)]
    if want_z:
        out_shapes += z_shapes
    params = tiled.launch_params(walk, backend, (bm, 2 * bn, bk), num_warps=cfg.num_warps,
                                 num_stages=cfg.num_stages, group_size=cfg.group_size)
    if paired:
        operands = [_Operand(x, True, 1), _Operand(weights[0], False, 0),
                    _Operand(weights[1], False, 0)]
        k_edge = "mask"
    else:
        kp = max(1, pl.cdiv(k, bk)) * bk
        x, weights = tiled.pad_axis(x, 1, kp), tiled.pad_axis(weights, 0, kp)
        k, k_edge = kp, "pad"
        if not _squeezes_halves(pl.backend_traits(backend)):
            # The gate and up tiles are column blocks j and j + N / block_n of weights
            # viewed as [K, 2N].
            if n % bn:
                raise NotImplementedError(f"{_OP}: implementation={backend!r} needs block_n "
                                          f"({bn}) to divide N ({n}) with stacked weights; "
                                          "pass the pair (gate, up) instead.")
            w2 = weights.reshape(kp, 2 * n)
            operands = [_Operand(x, True, 1), _Operand(w2, False, 0),
                        _Operand(w2, False, 0, offset=n // bn)]
        else:
            operands = [_Operand(x, True, 1), _Operand(weights, False, 0, half=0),
                        _Operand(weights, False, 0, half=1)]
    act = getattr(kernel.activation, "__name__", None) or "act"
    outs = _products_call(
        operands, ((0, 1), (0, 2)), num_accs=2, tile=(bm, bn), block_k=bk, k=k, kernel=kernel,
        walk=walk, out_shapes=out_shapes,
        stacked_outs=[False] + ([False, False] if paired else [True])[:len(out_shapes) - 1],
        finish=functools.partial(_epilogue, activation=kernel.activation), params=params,
        name="gated_linear_unit" + (f"_{act}" if kernel.activation else ""), k_edge=k_edge)
    return tuple(outs)


# --------------------------------------------------------------------------
# Backward: dz in place of z, then dx and dw
# --------------------------------------------------------------------------

def _dz_kernel(g_ref, *refs, activation):
    zs, dzs = refs[:len(refs) // 2], refs[len(refs) // 2:]
    g = g_ref[...].astype(jnp.float32)
    gate = _load_half(zs, 0).astype(jnp.float32)
    up = _load_half(zs, 1).astype(jnp.float32)
    if activation is None:
        act, dgate = gate, g * up
    else:
        act, pullback = jax.vjp(activation, gate)
        (dgate,) = pullback(g * up)
    _store_half(dzs, 0, dgate)
    _store_half(dzs, 1, g * act)


def _dz_call(g, zs: tuple, kernel: _Kernel) -> tuple:
    """``dz`` written over ``z`` (aliased): ``[g * up * act'(gate), g * act(gate)]``, one
    ``[M, 2, N]`` array or a pair of ``[M, N]`` as ``zs``."""
    bm, bn, _ = kernel.config.blocks
    m, n = g.shape
    backend = kernel.backend
    params = None
    if pl.backend_traits(backend).triton:
        # No loop: one stage; twice the forward's warps keep act' and the two products
        # of a 2 x block_m x block_n tile in registers (fused_matmul's dz kernel does the same).
        params = pl.triton.CompilerParams(num_warps=2 * tiled.default_num_warps(bm, 2 * bn),
                                          num_stages=1)
    stacked = len(zs) == 1
    z_spec = tiled.products_out_spec(stacked, (bm, bn))
    out = pl.pallas_call(
        functools.partial(_dz_kernel, activation=kernel.activation),
        out_shape=[jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zs] if not stacked else
        jax.ShapeDtypeStruct(zs[0].shape, zs[0].dtype), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))] + [z_spec] * len(zs),
        out_specs=z_spec if stacked else [z_spec] * 2,
        input_output_aliases={1 + i: i for i in range(len(zs))}, compiler_params=params,
        backend=backend, name="gated_linear_unit_dz")(g, *zs)
    return (out,) if stacked else tuple(out)


def _store_outputs(accs, outs):
    for acc, ref in zip(accs, outs):
        ref[...] = acc.astype(ref.dtype)


def _backward(x, weights, zs: tuple, g, kernel: _Kernel):
    """One device: ``(dx, dweights)``, dweights in the form of ``weights``."""
    if kernel.products is not None:
        return kernel.products.backward(x, weights, zs, g, kernel.config, kernel.activation)
    m, k = x.shape
    bm, bn, bk = kernel.config.blocks
    dzs = _dz_call(g.astype(x.dtype), zs, kernel)
    if not isinstance(weights, tuple):
        n = weights.shape[2]
        dz = dzs[0].reshape(m, 2 * n)
        w2 = weights.reshape(k, 2 * n)
        # dx[M, K] = dz[M, 2N] @ w[K, 2N]^T: output tiles (bm, bk), contraction over 2N by 2 bn.
        dx = tiled.matmul(dz, w2, ca=1, cb=1, blocks=(bm, bk, 2 * bn), backend=kernel.backend,
                          out_dtype=x.dtype, name="gated_linear_unit_dx")
        # dw[K, 2N] = x[M, K]^T @ dz[M, 2N]: output tiles (bk, 2 bn), contraction over M by bm.
        dw = tiled.matmul(x, dz, ca=0, cb=0, blocks=(bk, 2 * bn, bm), backend=kernel.backend,
                          out_dtype=weights.dtype, name="gated_linear_unit_dw")
        return dx, dw.reshape(k, 2, n)
    # The pair: no [K, 2N] view exists, so each product keeps its two operands apart
    # (the same tiles and work per step as the stacked form's matmuls).
    gate, up = weights
    n = gate.shape[1]
    walk = kernel.config.walk or tiled.strategy(kernel.backend)
    common = dict(kernel=kernel, walk=walk, k_edge="mask", finish=_store_outputs)
    # dx[M, K] = dz_gate @ gate^T + dz_up @ up^T: one accumulator, contraction over N by bn.
    (dx,) = _products_call(
        [_Operand(dzs[0], True, 1), _Operand(dzs[1], True, 1), _Operand(gate, False, 1),
         _Operand(up, False, 1)], ((0, 2), (1, 3)), num_accs=1, tile=(bm, bk), block_k=bn,
        k=n, out_shapes=[jax.ShapeDtypeStruct((m, k), x.dtype)], stacked_outs=[False],
        params=tiled.launch_params(walk, kernel.backend, (bm, bk, bn)),
        name="gated_linear_unit_dx", **common)
    # d_gate, d_up [K, N] = x^T @ dz_gate, x^T @ dz_up: two accumulators sharing the x
    # tile, contraction over M by bm.
    dws = _products_call(
        [_Operand(x, True, 0), _Operand(dzs[0], False, 0), _Operand(dzs[1], False, 0)],
        ((0, 1), (0, 2)), num_accs=2, tile=(bk, bn), block_k=bm, k=m,
        out_shapes=[jax.ShapeDtypeStruct((k, n), gate.dtype)] * 2, stacked_outs=[False, False],
        params=tiled.launch_params(walk, kernel.backend, (bk, 2 * bn, bm)),
        name="gated_linear_unit_dw", **common)
    return dx, tuple(dws)


# --------------------------------------------------------------------------
# custom_vjp and partitioning
# --------------------------------------------------------------------------

def _operand_dims(weights) -> tuple[tuple, tuple[str, ...], tuple[str, ...]]:
    """``(arrays, their factor signatures, the z outputs' signatures)`` of weights."""
    if isinstance(weights, tuple):
        return weights, ("k n", "k n"), ("m n", "m n")
    return (weights,), ("k two n",), ("m two n",)


def _rebuild(weights, arrays):
    return tuple(arrays) if isinstance(weights, tuple) else arrays[0]


def _partitioned_forward(x, weights, kernel: _Kernel, *, want_z: bool):
    """Rows of x ("m") and columns of the weights ("n") run where they live. A
    contraction ("k") split on both gives each device partial products of both
    accumulators: the kernel stores them in float32 without its epilogue, one
    psum per z array adds them, and the activation and product follow in XLA."""
    arrays, w_dims, z_dims = _operand_dims(weights)

    def local(x, *ws, reduced):
        ws = _rebuild(weights, ws)
        if not reduced_axes(reduced, "k"):
            return _forward_call(x, ws, kernel, want_z=want_z)
        partial = dataclasses.replace(kernel, activation=None)
        _, *zps = _forward_call(x, ws, partial, want_z=True, out_dtype=jnp.float32)
        zs = [psum(zp, reduced, "k") for zp in zps]
        gate, up = (zs[0][:, 0], zs[0][:, 1]) if len(zs) == 1 else zs
        if kernel.activation is not None:
            gate = kernel.activation(gate)
        out = (gate * up).astype(x.dtype)
        return (out, *(z.astype(x.dtype) for z in zs)) if want_z else (out,)

    return run(_OP, local, (x, *arrays), ("m k", *w_dims),
               ("m n", *z_dims) if want_z else ("m n",), reduce=("k",))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _glu(x, weights, kernel: _Kernel):
    return _partitioned_forward(x, weights, kernel, want_z=False)[0]


def _glu_fwd(x, weights, kernel):
    out, *zs = _partitioned_forward(x, weights, kernel, want_z=True)
    return out, (x, weights, tuple(zs))


def _glu_bwd(kernel, residuals, g):
    x, weights, zs = residuals
    arrays, w_dims, z_dims = _operand_dims(weights)
    nw = len(arrays)

    def local(x, *rest, reduced):
        ws, zs, g = rest[:nw], rest[nw:-1], rest[-1]
        dx, dw = _backward(x, _rebuild(weights, ws), tuple(zs), g, kernel)
        # dx sums over N, dw over M: partial sums where those are split.
        return (psum(dx, reduced, "n"), *(psum(d, reduced, "m") for d in _operand_dims(dw)[0]))

    dx, *dws = run(_OP, local, (x, *arrays, *zs, g), ("m k", *w_dims, *z_dims, "m n"),
                   ("m k", *w_dims), reduce=("m", "n"), out_like=tuple(range(1 + nw)))
    return dx, _rebuild(weights, dws)


_glu.defvjp(_glu_fwd, _glu_bwd)


# --------------------------------------------------------------------------
# Registration with the op layer
# --------------------------------------------------------------------------

def _example(problem: Problem, implementation: str):
    m, n, k = problem.shape
    S = jax.ShapeDtypeStruct
    if problem.variant_dict().get("stacked", False):
        args = [S((m, k), problem.dtype), S((k, 2, n), problem.dtype)]

        def fn(x, weights):
            return gated_linear_unit(x, weights, activation="silu", implementation=implementation)
        return fn, args
    args = [S((m, k), problem.dtype), S((k, n), problem.dtype), S((k, n), problem.dtype)]

    def paired(x, gate, up):
        return gated_linear_unit(x, (gate, up), activation="silu", implementation=implementation)
    return paired, args


OP = register(Op(
    name=_OP, dims=("m", "n", "k"),
    configs={b: GluConfig for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
    reference=gated_linear_unit_reference, variant=GluVariant, entry=_entry,
    problem_of=_problem_of, function=gated_linear_unit,
    tuning=Tuning(example=_example, shapes=((8192, 14336, 4096), (8192, 8192, 2048)),
                  quick=((256, 512, 256),), order=10, training=vjp_training(_example))))


# --------------------------------------------------------------------------
# implementation="mosaic_gpu": the products on the warp-specialized Mosaic GPU core
# --------------------------------------------------------------------------

def _mosaic_supported(call: Call) -> str | None:
    """None when the Mosaic GPU kernels (:mod:`ops.matmul.mosaic_gpu_glu`) run ``call``, else
    why not: float32, an activation Mosaic GPU's lowering cannot take, tiles of the other
    kernels (a ``GluConfig``; a ``(block_m, block_n, block_k)`` tuple becomes one) as
    ``block_sizes``, a GPU older than sm_90."""
    a = call.args
    return mosaic_gpu.why_not(a["x"].dtype, block_sizes=a["explicit"], activation=a["act"],
                              call=call)


def _mosaic_run(call: Call):
    return _entry("mosaic_gpu", **call.args, products=GluKernels(call.args["explicit"]))


register_implementation(_OP, Implementation("mosaic_gpu", _mosaic_run, config=MosaicGluConfig,
                                            supported=_mosaic_supported, platforms=("gpu",)))
