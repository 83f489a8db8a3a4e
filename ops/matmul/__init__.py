"""Fused matmul with epilogue."""
from ops.matmul.fused_matmul import default_block_sizes, fused_matmul, reference

__all__ = ["default_block_sizes", "fused_matmul", "reference"]
