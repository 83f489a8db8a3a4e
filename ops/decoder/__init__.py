"""The ops of a decoder LLM: rotary embedding and its frequencies, the gated linear unit."""
from ops.decoder.glu import gated_linear_unit
from ops.decoder.rope import apply_rotary_embedding
from ops.decoder.rope_frequencies import rope_frequencies

__all__ = ["apply_rotary_embedding", "gated_linear_unit", "rope_frequencies"]
