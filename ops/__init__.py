"""Curated fused kernels for model authors (DESIGN 3).

Every op is jit/vmap/grad-compatible and takes ``implementation=``: None
picks the best for the platform (falling back to "xla"); see
:mod:`ops._implementation`.
"""
from ops._implementation import IMPLEMENTATIONS
from ops.activations import ACTIVATIONS
from ops.matmul import fused_matmul

__all__ = ["ACTIVATIONS", "IMPLEMENTATIONS", "fused_matmul"]
