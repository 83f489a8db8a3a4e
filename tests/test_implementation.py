"""``implementation=`` as a name or a sequence of names tried in order (ops._implementation)."""
import importlib
import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops._implementation import check_implementation, run_implementation

fused_matmul_module = importlib.import_module("ops.matmul.fused_matmul")  # the module, not the op

RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 40)).astype(np.float32)
W = RNG.standard_normal((40, 24)).astype(np.float32)
LABELS = np.array([1, 0, 5], np.int32)
Q = RNG.standard_normal((1, 8, 2, 16)).astype(np.float32)
SCALE = np.ones((40,), np.float32)
PAGES = RNG.standard_normal((2, 2, 4, 16)).astype(np.float32)  # [K, P, page_size, H]
COMBINED = RNG.standard_normal((2, 4, 4, 16)).astype(np.float32)  # [pages, page_size, 2K, H]
I32 = lambda *v: np.array(v, np.int32)  # noqa: E731

# Every public op, called on small numpy inputs (the "xla" fallback costs no kernel).
CALLS = {
    "dot_product_attention": lambda impl: ops.dot_product_attention(Q, Q, Q, implementation=impl),
    "fused_matmul": lambda impl: ops.fused_matmul(X, W, implementation=impl),
    "linear_cross_entropy": lambda impl: ops.linear_cross_entropy(X, W, LABELS, implementation=impl),
    "cross_entropy": lambda impl: ops.cross_entropy(X, LABELS, implementation=impl),
    "layer_norm": lambda impl: ops.layer_norm(X, SCALE, SCALE, implementation=impl),
    "rms_norm": lambda impl: ops.rms_norm(X, SCALE, implementation=impl),
    "softmax": lambda impl: ops.softmax(X, implementation=impl),
    "log_softmax": lambda impl: ops.log_softmax(X, implementation=impl),
    "logsumexp": lambda impl: ops.logsumexp(X, axis=-1, implementation=impl),
    "sum": lambda impl: ops.sum(X, axis=-1, implementation=impl),
    "mean": lambda impl: ops.mean(X, axis=-1, implementation=impl),
    "max": lambda impl: ops.max(X, axis=-1, implementation=impl),
    "gated_linear_unit": lambda impl: ops.gated_linear_unit(
        X, np.stack([W, W], axis=1), activation="silu", implementation=impl),
    "ragged_dot": lambda impl: ops.ragged_dot(X, np.stack([W, W]), I32(2, 1), implementation=impl),
    "apply_rotary_embedding": lambda impl: ops.apply_rotary_embedding(
        Q[0], np.arange(8, dtype=np.int32), np.linspace(1, 0.01, 8, dtype=np.float32),
        implementation=impl),
    "paged_attention": lambda impl: ops.paged_attention(
        Q[0, :1], PAGES, PAGES, I32([0, 1]), I32(5), implementation=impl),
    "ragged_paged_attention": lambda impl: ops.ragged_paged_attention(
        Q[0, :3, :2], COMBINED, I32(5), I32([0, 1]), I32(0, 3), I32(1), implementation=impl),
    "update_kv_pages": lambda impl: ops.update_kv_pages(  # a jax cache: numpy has no .at
        jnp.asarray(COMBINED), Q[0, :2], Q[0, :2], I32(0, 5), implementation=impl),
}


def test_every_public_op_is_covered():
    public = {n for n in ops.__all__ if callable(getattr(ops, n)) and n.islower()
              and "implementation" in inspect.signature(getattr(ops, n)).parameters}
    assert public == set(CALLS)


@pytest.mark.parametrize("op", sorted(CALLS))
def test_sequence_falls_back_past_an_implementation_without_kernel(op):
    """mosaic_gpu has no kernel for any op (NotImplementedError): the next entry runs."""
    with pytest.raises(NotImplementedError, match="mosaic_gpu"):
        CALLS[op]("mosaic_gpu")
    got = CALLS[op](["mosaic_gpu", "xla"])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(CALLS[op]("xla")))


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("bad", [[], (), ("xla", "cuda"), ("xla", None), 3, b"xla", {"xla": 1}])
def test_bad_implementation_names_the_argument(op, bad):
    with pytest.raises(ValueError, match=r"implementation must be None or one of"):
        CALLS[op](bad)


def _refusing_kernel(*args, **kwargs):
    raise NotImplementedError("this kernel refuses the call")


def test_kernel_refusing_the_call_falls_back(monkeypatch):
    """An implementation whose kernel raises NotImplementedError for this call: the next runs."""
    want = np.asarray(ops.fused_matmul(X, W, implementation="interpret"))
    monkeypatch.setattr(fused_matmul_module, "_fused_matmul", _refusing_kernel)
    with pytest.raises(NotImplementedError, match="refuses"):
        ops.fused_matmul(X, W, implementation="interpret")
    got = ops.fused_matmul(X, W, implementation=("interpret", "xla"))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_all_failing_raises_the_last_error(monkeypatch):
    monkeypatch.setattr(fused_matmul_module, "_fused_matmul", _refusing_kernel)
    with pytest.raises(NotImplementedError, match="wgmma"):  # mosaic_gpu's, raised last
        ops.fused_matmul(X, W, implementation=("interpret", "mosaic_gpu"))
    with pytest.raises(NotImplementedError, match="refuses"):  # interpret's, raised last
        ops.fused_matmul(X, W, implementation=("mosaic_gpu", "interpret"))


def test_run_implementation_order_and_errors():
    tried = []

    def body(name):
        tried.append(name)
        if name != "xla":
            raise NotImplementedError(name)
        return "ran " + name

    assert run_implementation(("mosaic_gpu", "interpret", "xla", "triton"), "op", body) == "ran xla"
    assert tried == ["interpret", "xla"]  # mosaic_gpu refused before the body; triton not tried

    def value_error(name):
        tried.append(name)
        raise ValueError("bad block sizes")

    tried.clear()
    with pytest.raises(ValueError, match="bad block sizes"):  # only NotImplementedError falls back
        run_implementation(("interpret", "xla"), "op", value_error)
    assert tried == ["interpret"]
    tried.clear()
    with pytest.raises(ValueError, match="op: implementation"):  # checked before any body runs
        run_implementation(("xla", "cuda"), "op", body)
    assert tried == []


def test_check_implementation_returns_hashable():
    assert check_implementation(None, "op") is None
    assert check_implementation("xla", "op") == "xla"
    checked = check_implementation(["triton", "xla"], "op")
    assert checked == ("triton", "xla") and hash(checked) == hash(("triton", "xla"))
