"""Mixture-of-experts ops: the grouped matmul ``ragged_dot``."""
from ops.moe.ragged_dot import ragged_dot
from ops.moe.reference import ragged_dot_reference

__all__ = ["ragged_dot", "ragged_dot_reference"]
