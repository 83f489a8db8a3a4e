"""Flash attention (FlashAttention-2): :func:`dot_product_attention` and its parts."""
from ops.attention.attention import dot_product_attention
from ops.attention.block_sizes import BlockSizes, default_block_sizes
from ops.attention.reference import attention_reference

from ops.attention import cudnn  # noqa: E402,F401,I001 - registers implementation="cudnn" on the op
from ops.attention import mosaic_gpu  # noqa: E402,F401,I001 - registers implementation="mosaic_gpu"

__all__ = ["BlockSizes", "attention_reference", "default_block_sizes", "dot_product_attention"]
