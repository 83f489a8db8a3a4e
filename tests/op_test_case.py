"""One op call checked with and without ``jax.jit`` (chex variants), and the fixed
cotangent weights the op battery (tests/op_battery.py) uses too. An op family's
tests subclass the battery; this base is for one-off checks beside it (the
drop-in arguments of the reductions).

Subclasses decorate a test with ``@chex.variants(with_jit=True, without_jit=True)``
and call :meth:`OpTestCase.check_op`; chex runs the test once per variant, so an op
that works only when traced (or only eagerly) fails one of them. Each variant
compiles the op again, so keep these to small shapes and cheap cases.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np


def weights_like(x):
    """Fixed, non-uniform cotangent weights (a plain sum has zero softmax gradient)."""
    n = int(np.prod(x.shape))
    return jnp.asarray(np.cos(np.arange(n, dtype=np.float32)).reshape(x.shape))


def weighted_loss(fn, argnums):
    """``sum(w * fn(...))`` over every finite float output, as a function of ``argnums``."""
    def loss(*args):
        total = jnp.float32(0)
        for leaf in jax.tree.leaves(fn(*args)):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                continue
            leaf = leaf.astype(jnp.float32)
            total = total + jnp.sum(jnp.where(jnp.isfinite(leaf), leaf, 0.0) * weights_like(leaf))
        return total
    return jax.grad(loss, argnums)


class OpTestCase(chex.TestCase):
    """Checks ops under ``self.variant`` (jit and no jit) against a reference."""

    def check_op(self, op, reference, *args, rtol=1e-5, atol=1e-6, argnums=0, grads=True):
        """``op(*args)`` equals ``reference(*args)`` in shape, dtype and value, and so do
        the gradients of a weighted sum of their outputs with respect to ``argnums``."""
        out = self.variant(op)(*args)
        expected = reference(*args)
        chex.assert_trees_all_equal_shapes_and_dtypes(out, expected)
        chex.assert_trees_all_close(out, expected, rtol=rtol, atol=atol)
        if grads:
            got = self.variant(weighted_loss(op, argnums))(*args)
            chex.assert_trees_all_close(got, weighted_loss(reference, argnums)(*args),
                                        rtol=rtol, atol=atol)
