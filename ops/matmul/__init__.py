"""Fused matmul with epilogue."""
from ops.matmul.fused_matmul import default_block_sizes, fused_matmul, reference
from ops.matmul import mosaic_gpu  # noqa: F401 - registers implementation="mosaic_gpu"

__all__ = ["default_block_sizes", "fused_matmul", "reference"]
