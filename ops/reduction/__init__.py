"""Row-wise and reduction kernels: norms, the softmax family, sum/mean/max, cross-entropy."""
from ops.reduction.cross_entropy import cross_entropy
from ops.reduction.linear_cross_entropy import linear_cross_entropy
from ops.reduction.norms import layer_norm, rms_norm
from ops.reduction.reduce import max, mean, sum  # noqa: A004 - the names of jnp's reductions
from ops.reduction.softmax import log_softmax, logsumexp, softmax

__all__ = ["cross_entropy", "layer_norm", "linear_cross_entropy", "log_softmax", "logsumexp",
           "max", "mean", "rms_norm", "softmax", "sum"]
