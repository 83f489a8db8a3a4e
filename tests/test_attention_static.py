"""Rung 5 for flash attention: the shipped Triton configurations compiled for sm_90.

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

import re

import jax
import jax.numpy as jnp
import pytest

import ops
import pallas_core as pl
from ops.tuning.targets import smem_limit

SMEM_LIMIT = smem_limit("sm_90")  # bytes of shared memory one sm_90 block may use


def _compile(h, dtype, **kw):
    def grads(q, k, v):
        loss = lambda q, k, v: jnp.sum(ops.dot_product_attention(
            q, k, v, implementation="triton", **kw).astype(jnp.float32))
        return jax.grad(loss, (0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((1, 2048, 8, h), dtype), jax.ShapeDtypeStruct((1, 2048, 2, h), dtype),
            jax.ShapeDtypeStruct((1, 2048, 2, h), dtype)]
    return pl.triton.compile(grads, *args, target="sm_90")


def _check(reports):
    assert sorted(r["name"] for r in reports) == ["flash_attention_dkdv", "flash_attention_dq",
                                                  "flash_attention_fwd"]
    for r in reports:
        ptx = r["asm"]["ptx"]
        assert r["shared_memory_bytes"] <= SMEM_LIMIT, r["name"]
        assert r["spill_bytes"] == 0, (r["name"], r["registers"], r["spill_bytes"])
        assert "wgmma.mma_async" in ptx, r["name"]
        assert len(re.findall(r"cp\.async", ptx)) > 0, r["name"]


@pytest.mark.parametrize("h", [64, 128])
def test_causal_gqa_bf16_compiles_without_spills(h):
    _check(_compile(h, jnp.bfloat16, is_causal=True))


def test_all_options_compile_without_spills():
    _check(_compile(128, jnp.bfloat16, is_causal=True, logits_soft_cap=30.0,
                    key_value_seq_lengths=jnp.array([1000], jnp.int32),
                    dropout_rate=0.1, dropout_rng=jax.random.key(0)))


def test_float32_compiles_without_spills():
    """float32 runs IEEE products on FMA units: 16 x 16 tiles, 8 warps, one stage."""
    reports = _compile(128, jnp.float32, is_causal=True)
    for r in reports:
        assert r["spill_bytes"] == 0, (r["name"], r["registers"], r["spill_bytes"])
        assert r["shared_memory_bytes"] <= SMEM_LIMIT, r["name"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [32, 64, 80, 96, 128, 192, 256])
def test_every_head_dim_compiles_without_spills(h, dtype):
    _check(_compile(h, dtype, is_causal=True))


@pytest.mark.slow
@pytest.mark.parametrize("h", [32, 64, 80, 96, 128, 192, 256])
def test_every_float32_head_dim_compiles_without_spills(h):
    for r in _compile(h, jnp.float32, is_causal=True):
        assert r["spill_bytes"] == 0, (r["name"], r["registers"], r["spill_bytes"])
