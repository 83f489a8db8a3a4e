"""``layers.GatedMLP``: the gated feed-forward block of Llama, Mistral, Qwen and Gemma.

``down_proj(activation(x @ gate) * (x @ up))`` (Shazeer 2020, "GLU Variants
Improve Transformer", section 2: SwiGLU with ``"silu"``, GeGLU with
``"gelu"``). The gate and up projections run as one ``ops.gated_linear_unit``
kernel (both accumulators in one pass over each ``x`` tile), the down
projection as ``ops.fused_matmul``. The Linen twin is
:class:`layers.linen.GatedMLP`.

Parameters are three bias-free ``nnx.Linear`` submodules named as in
transformers, ``gate_proj``, ``up_proj`` and ``down_proj``, each holding
``kernel`` ``[in, out]``: a transformers checkpoint's ``mlp.gate_proj.weight``
``[hidden, d]`` is ``gate_proj.kernel`` transposed, and so on, with no other
reshaping. The kernel takes the two projections as the pair ``(gate, up)``
(``ops.gated_linear_unit``'s paired form), each read in place as its own
operand: no per-call stack of the ``2 d hidden`` weights (at decode, a few
tokens per step, such a copy would read and write the weights once more
before the kernel reads them: XLA's cost analysis of one 8-token step of
Llama 3 8B's gated linear unit in bfloat16 counts 674 MiB accessed with the
stack against 226 MiB for the pair, the weights being 224 MiB), and their
gradients come back as a pair.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_kernel_init

import ops
from layers.dense import Dense, _check_activation, _check_implementation

__all__ = ["GatedMLP"]


def _check_features(value, name: str, owner: str, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: invalid argument {name}={value!r}; expected a positive int"
                         + (" or None" if optional else "") + ".")
    return value


def check_activation_name(activation, owner: str):
    """A gated MLP's activation: a name from ``ops.ACTIVATIONS`` or an elementwise callable."""
    if activation is None:
        raise ValueError(f"{owner}: invalid argument activation=None; a gated MLP needs an "
                         "activation for its gate (\"silu\": SwiGLU, \"gelu\": GeGLU).")
    _check_activation(activation, owner)
    return activation


def gated_mlp(x, gate, up, down, *, activation, implementation):
    """``(activation(x @ gate) * (x @ up)) @ down`` through our kernels (shared with Linen)."""
    h = ops.gated_linear_unit(x, (gate, up), activation=activation, implementation=implementation)
    return ops.fused_matmul(h, down, implementation=implementation)


class GatedMLP(nnx.Module):
    """Gated MLP: ``down_proj(activation(gate_proj(x)) * up_proj(x))``, by our kernels.

    Args:
      in_features: ``d``, the features of ``x``.
      hidden_features: the gated width (transformers' ``intermediate_size``).
      out_features: the output features (None: ``in_features``).
      activation: the gate's activation: a name from ``ops.ACTIVATIONS``
        (``"silu"``, SwiGLU, the default: Llama, Mistral, Qwen; ``"gelu"``,
        the tanh form, GeGLU: Gemma's ``gelu_pytorch_tanh``; ``"gelu_exact"``)
        or an elementwise JAX callable, applied to the float32 pre-activation
        inside the kernel.
      dtype: the compute dtype (None: the promoted type of ``x`` and the
        kernels), as ``nnx.Linear``.
      param_dtype: the kernels' dtype (float32).
      kernel_init: the initializer of all three kernels (``nnx.Linear``'s
        default, LeCun normal).
      implementation: None (the platform's default, resolved at call time), a
        name from ``ops.IMPLEMENTATIONS`` or a sequence of them tried in
        order; used by both kernels.
      rngs: the parameters' rngs.

    Parameters: ``gate_proj.kernel`` ``[in_features, hidden_features]``,
    ``up_proj.kernel`` (same), ``down_proj.kernel`` ``[hidden_features,
    out_features]``; no biases (none of the model families above has one).

    Call: ``x`` ``[..., in_features]`` -> ``[..., out_features]`` in the
    compute dtype, accumulated in float32.

    Raises:
      ValueError / TypeError: at construction, non-positive features, a
        missing or unknown ``activation``, a bad ``implementation``, each
        naming the argument; at call time, ``ops.gated_linear_unit``'s errors
        (a last axis of ``x`` other than ``in_features``).
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 *, activation: Any = "silu", dtype=None, param_dtype=jnp.float32,
                 kernel_init=default_kernel_init, implementation=None, rngs: nnx.Rngs):
        owner = "layers.GatedMLP"
        in_features = _check_features(in_features, "in_features", owner)
        hidden_features = _check_features(hidden_features, "hidden_features", owner)
        out_features = _check_features(out_features, "out_features", owner, optional=True)
        self.activation = check_activation_name(activation, owner)
        self.implementation = _check_implementation(implementation, owner)
        self.in_features, self.hidden_features = in_features, hidden_features
        self.out_features = in_features if out_features is None else out_features
        self.dtype = dtype
        linear = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=kernel_init, implementation=self.implementation, rngs=rngs)
        self.gate_proj = Dense(in_features, hidden_features, **linear)
        self.up_proj = Dense(in_features, hidden_features, **linear)
        self.down_proj = Dense(hidden_features, self.out_features, **linear)

    def __call__(self, x):
        """``[..., in_features]`` -> ``[..., out_features]``."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"layers.GatedMLP: x has {x.shape[-1]} features in its last axis, "
                             f"the layer expects in_features={self.in_features}.")
        x, gate, up, down = nnx_dtypes.promote_dtype(
            (x, self.gate_proj.kernel[...], self.up_proj.kernel[...],
             self.down_proj.kernel[...]), dtype=self.dtype)
        return gated_mlp(x, gate, up, down, activation=self.activation,
                         implementation=self.implementation)
