"""Drop-in Flax layers backed by the fused kernels in :mod:`ops` (DESIGN 4).

* :class:`layers.Dense` -- a subclass of ``flax.nnx.Linear`` computing
  ``activation(x @ kernel + bias)`` with ``ops.fused_matmul``.
* :class:`layers.linen.Dense` -- the same for ``flax.linen.Dense``.
* :class:`layers.LayerNorm`, :class:`layers.RMSNorm` -- subclasses of
  ``flax.nnx.LayerNorm`` / ``RMSNorm`` over ``ops.layer_norm`` / ``ops.rms_norm``,
  with Linen twins ``layers.linen.LayerNorm`` / ``RMSNorm``.

Both keep their Flax parent's constructor arguments, defaults, parameter
names, shapes, initializers and metadata, so state and checkpoints made by
the Flax layer load unchanged; they add keyword ``activation`` (None, a name
from ``ops.ACTIVATIONS`` or a callable) and ``implementation`` (None or one of
``ops.IMPLEMENTATIONS``), both validated at construction.
"""
from layers import linen
from layers.dense import Dense
from layers.norms import LayerNorm, RMSNorm

__all__ = ["Dense", "LayerNorm", "RMSNorm", "linen"]
