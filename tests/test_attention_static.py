"""The static gate for flash attention (docs/design.md §7.4): the shipped Triton
configurations compiled for sm_90.

Each kernel (forward, dQ, dK/dV) at the heuristic's block sizes for 16-bit
inputs and head dims 64 / 96 / 128 / 256 must compile for Hopper with: dots
on ``wgmma`` (tensor cores, asynchronous), loads pipelined with ``cp.async``
(the key/value loop is a ``for`` loop Triton pipelines, not a ``while``),
shared memory within the 227 KiB an H100 block may use, and no register
spills (``ptxas -v``). float32 inputs (IEEE products on FMA units, no
``wgmma``) must fit the same shared memory without spills. Nothing runs:
this is what a CPU host can see of the kernels' speed. The full sweeps (every
head dim the op documents, every dtype) are marked slow.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import ops
import pallas_core as pl
from benchmarks.static import kernel_row, violations


def _compile(h, dtype, **kw):
    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(ops.dot_product_attention(
            q, k, v, implementation="triton", **kw).astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((1, 2048, 8, h), dtype), jax.ShapeDtypeStruct((1, 2048, 2, h), dtype),
            jax.ShapeDtypeStruct((1, 2048, 2, h), dtype)]
    return pl.triton.compile(grads, *args, target="sm_90")


def _check(reports, *, tensor_cores=True):
    """The static gate (benchmarks.static.violations: no spills, shared memory within
    sm_90's limit, 16-bit dots on wgmma) on every kernel, plus pipelined loads."""
    assert sorted(r["name"] for r in reports) == ["flash_attention_dkdv", "flash_attention_dq",
                                                  "flash_attention_fwd"]
    for r in reports:
        row = kernel_row(r)
        assert not violations(row), (r["name"], violations(row))
        if tensor_cores:
            assert row["wgmma"] > 0 and row["cp_async"] > 0, (r["name"], row)


@pytest.mark.parametrize("h", [64, 128])
def test_causal_gqa_bf16_compiles_without_spills(h):
    _check(_compile(h, jnp.bfloat16, is_causal=True))


def test_all_options_compile_without_spills():
    _check(_compile(128, jnp.bfloat16, is_causal=True, logits_soft_cap=30.0,
                    key_value_seq_lengths=jnp.array([1000], jnp.int32),
                    dropout_rate=0.1, dropout_rng=jax.random.key(0)))


def test_float32_compiles_without_spills():
    """float32 runs IEEE products on FMA units: 16 x 16 tiles, 8 warps, one stage."""
    _check(_compile(128, jnp.float32, is_causal=True), tensor_cores=False)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [32, 64, 80, 96, 128, 192, 256])
def test_every_head_dim_compiles_without_spills(h, dtype):
    _check(_compile(h, dtype, is_causal=True))


@pytest.mark.slow
@pytest.mark.parametrize("h", [32, 64, 80, 96, 128, 192, 256])
def test_every_float32_head_dim_compiles_without_spills(h):
    _check(_compile(h, jnp.float32, is_causal=True), tensor_cores=False)
