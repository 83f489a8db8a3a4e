"""The implementation registry and the default implementation (ops/_op.py, ops/_default.py,
ops/tuning/rankings.py; docs/design.md §5.2).

On this host (a CPU) the GPU default is exercised through stub tables: a stub
ranking (:func:`ops.tuning.rankings.override`), stub implementations that record
that they ran (the op's table copied and patched), and the call's target set to
an H200. The packaged rankings (seeded from the first H200 measurement) are
checked through :func:`ops.resolve_implementation`, which runs nothing.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
from ops import _default, _op, _resolve
from ops.tuning import rankings
from tests.test_implementation import CALLS

H200 = "NVIDIA H200"
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------

def test_every_op_registers_xla_and_its_kernel_backends():
    for op in _op.registered():
        table = op.implementations
        assert next(iter(table)) == "xla" and not table["xla"].ours
        for backend, cls in op.configs.items():
            assert table[backend].config is cls and table[backend].ours
        assert set(op.configs) <= set(op.kernel_backends)  # and what later modules register
    assert _op.get("dot_product_attention").implementations["cudnn"].platforms == ("gpu",)
    assert not any("cudnn" in op.implementations for op in _op.registered()
                   if op.name != "dot_product_attention")


def test_other_ops_refuse_cudnn():
    with pytest.raises(NotImplementedError, match=r"implementation='cudnn' has no kernel"):
        ops.fused_matmul(np.ones((4, 8), np.float32), np.ones((8, 4), np.float32),
                         implementation="cudnn")


def test_a_new_backend_registers_without_editing_the_op(monkeypatch):
    """mosaic_gpu kernels arriving later: one register_implementation call, then
    implementation="mosaic_gpu" runs them (and the op's other names are untouched)."""
    monkeypatch.setitem(_op._IMPLEMENTATIONS, "layer_norm",
                        dict(_op._IMPLEMENTATIONS["layer_norm"]))
    ran = []

    def run(call):
        ran.append(call.args["x"].shape)
        return _op.get("layer_norm").implementations["xla"].run(call)

    _op.register_implementation("layer_norm", _op.Implementation("mosaic_gpu", run,
                                                                  platforms=("gpu",)),
                                replace=True)  # (replacing any the op has by then)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(ops.layer_norm(x, implementation="mosaic_gpu"),
                                  ops.layer_norm(x, implementation="xla"))
    assert ran == [(3, 4)]
    with pytest.raises(ValueError, match="registered already"):
        _op.register_implementation("layer_norm", _op.Implementation("mosaic_gpu", run))
    with pytest.raises(ValueError, match="implementation name 'cuda'"):
        _op.register_implementation("layer_norm", _op.Implementation("cuda", run))


def test_supported_refuses_before_anything_is_traced(monkeypatch):
    import pallas_core.call

    def traced(*args, **kwargs):
        raise AssertionError("a kernel was traced")

    monkeypatch.setattr(pallas_core.call, "build_call", traced)
    q = np.ones((1, 8, 2, 96), np.float32)
    with pytest.raises(NotImplementedError, match="cannot run this call: JAX's Triton lowering "
                       "needs power-of-two head dims"):
        ops.dot_product_attention(q, q, q, implementation="pallas_triton")


# --------------------------------------------------------------------------
# cuDNN's feature set
# --------------------------------------------------------------------------

def _attention_call(device_kind=H200, dtype=BF16, shape=(2, 1024, 8, 128), **kwargs):
    q = S(shape, dtype)
    call = _resolve.capture_call(ops.dot_product_attention, (q, q, q), kwargs)
    return dataclasses.replace(call, target=_op.Target.of_kind(device_kind))


def test_cudnn_takes_plain_and_causal_calls_only():
    from ops.attention import cudnn
    assert cudnn.supported(_attention_call()) is None
    assert cudnn.supported(_attention_call(is_causal=True)) is None
    refusals = {
        "logits_soft_cap": _attention_call(logits_soft_cap=30.0),
        "sinks": _attention_call(sinks=S((8,), jnp.float32)),
        "dropout": _attention_call(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
        "local_window_size": _attention_call(local_window_size=(64, 0)),
        "segment ids": _attention_call(query_segment_ids=S((2, 1024), jnp.int32),
                                       key_value_segment_ids=S((2, 1024), jnp.int32)),
        "dtype float32": _attention_call(dtype=jnp.float32),
        "head dims": _attention_call(shape=(2, 1024, 8, 256)),
        "return_residual": _attention_call(return_residual=True),
        "NVIDIA GPU": _attention_call(device_kind="cpu"),
    }
    for word, call in refusals.items():
        why = cudnn.supported(call)
        assert why is not None and word in why, (word, why)


def test_cudnn_refuses_to_run_on_a_cpu():
    q = np.ones((1, 8, 2, 16), np.float32)
    with pytest.raises(NotImplementedError, match="cuDNN runs on an NVIDIA GPU"):
        ops.dot_product_attention(q, q, q, implementation="cudnn")
    out = ops.dot_product_attention(q, q, q, implementation=("cudnn", "xla"))  # falls back
    np.testing.assert_array_equal(out, ops.dot_product_attention(q, q, q, implementation="xla"))


# --------------------------------------------------------------------------
# The packaged rankings (the first H200 measurement)
# --------------------------------------------------------------------------

def _on_h200(op, *args, **kwargs):
    return ops.resolve_implementation(op, *args, device_kind=H200, **kwargs)


def test_seeded_rankings_on_an_h200():
    q = S((2, 8192, 16, 128), BF16)
    plain = _on_h200("dot_product_attention", q, q, q, is_causal=True)
    assert (plain.implementation, plain.rule) == ("cudnn", "measured")
    capped = _on_h200("dot_product_attention", q, q, q, is_causal=True, logits_soft_cap=30.0)
    assert _op.get("dot_product_attention").implementations[capped.implementation].ours
    assert capped.skipped[0][0] == "cudnn" and "logits_soft_cap" in capped.skipped[0][1]
    matmul = _on_h200("fused_matmul", S((8192, 8192), BF16), S((8192, 8192), BF16))
    assert (matmul.implementation, matmul.rule) == ("xla", "measured")
    norm = _on_h200("layer_norm", S((16384, 4096), BF16), S((4096,), BF16), S((4096,), BF16),
                    differentiated=True)
    assert norm.pass_ == "fwd+bwd" and _op.get("layer_norm").implementations[norm.implementation].ours
    for differentiated in (False, True):
        loss = _on_h200("linear_cross_entropy", S((8192, 4096), BF16), S((4096, 131072), BF16),
                        S((8192,), jnp.int32), differentiated=differentiated)
        assert loss.implementation != "xla" and "xla" not in loss.order, loss
        assert loss.skipped[0][0] == "xla" and "logits" in loss.skipped[0][1]


def test_h100_shares_the_h200_ranking_and_other_devices_take_the_safe_order():
    q = S((2, 8192, 16, 128), BF16)
    h100 = ops.resolve_implementation("dot_product_attention", q, q, q, is_causal=True,
                                      device_kind="NVIDIA H100 80GB HBM3")
    assert (h100.implementation, h100.rule) == ("cudnn", "nearest measured")
    a100 = ops.resolve_implementation("dot_product_attention", q, q, q, is_causal=True,
                                      device_kind="NVIDIA A100-SXM4-80GB")
    assert a100.rule == "safe order" and a100.order[0] == _default.SAFE_ORDER["gpu"][0]
    cpu = ops.resolve_implementation("dot_product_attention", q, q, q, device_kind="cpu")
    assert (cpu.order, cpu.rule) == (("xla",), "platform")


def test_packaged_rankings_name_their_runs():
    table = rankings.load(rankings.PACKAGED_RANKINGS)
    assert table.entries
    for entry in table.entries.values():
        source = table.sources[entry.source]
        assert source["path"].startswith("benchmarks/results/") and source["device_kind"]
        assert entry.cases


@pytest.mark.parametrize("name", sorted(CALLS))
def test_cpu_default_is_xla_for_every_op(name):
    call = _resolve.capture_call(lambda: CALLS[name](None))
    assert call.target.platform == "cpu" and call.problem is not None
    choice = _default.choose(call.op, call)
    assert (choice.implementation, choice.order, choice.rule) == ("xla", ("xla",), "platform")


# --------------------------------------------------------------------------
# The op runs what resolve_implementation says (stub tables on this host)
# --------------------------------------------------------------------------

def _stub_table(monkeypatch, op_name: str, ran: list) -> None:
    """The op's table with triton and pallas_triton replaced by stubs that record
    their run and return XLA's answer."""
    table = dict(_op._IMPLEMENTATIONS[op_name])
    xla = table["xla"]
    for name in ("triton", "pallas_triton"):
        def run(call, name=name):
            ran.append(name)
            return xla.run(call)
        table[name] = dataclasses.replace(table[name], run=run)
    monkeypatch.setitem(_op._IMPLEMENTATIONS, op_name, table)
    monkeypatch.setattr(_op.Target, "current", classmethod(lambda cls: cls("gpu", H200)))


def _stub_rankings(call: _op.Call, fwd_first: str, fwd_bwd_first: str) -> list:
    p = call.problem
    other = {"triton": "pallas_triton", "pallas_triton": "triton"}
    return [rankings.make_entry(p.op, H200, p.dtype, p.shape, pass_,
                                {first: 1.0, other[first]: 2.0, "xla": 3.0}, variant=p.variant_dict())
            for pass_, first in (("fwd", fwd_first), ("fwd+bwd", fwd_bwd_first))]


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_op_runs_what_resolve_says(name, monkeypatch):
    ran: list = []
    _stub_table(monkeypatch, name, ran)
    call = _resolve.capture_call(lambda: CALLS[name](None))
    assert call.op.name == name and call.target == _op.Target("gpu", H200)
    with rankings.override(_stub_rankings(call, "pallas_triton", "triton")):
        choice = _default.choose(call.op, call)
        assert (choice.implementation, choice.rule) == ("pallas_triton", "measured")
        want = CALLS[name]("xla")
        got = CALLS[name](None)
    assert ran == ["pallas_triton"]
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_under_differentiation_the_fwd_bwd_ranking_decides(monkeypatch):
    ran: list = []
    _stub_table(monkeypatch, "rms_norm", ran)
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    call = _resolve.capture_call(ops.rms_norm, (x,))
    with rankings.override(_stub_rankings(call, "pallas_triton", "triton")):
        assert ops.resolve_implementation("rms_norm", x).implementation == "pallas_triton"
        assert ops.resolve_implementation("rms_norm", x, differentiated=True).implementation == "triton"
        grad = jax.grad(lambda v: ops.rms_norm(v).sum())(x)
        assert ran == ["triton"]
        jax.jit(lambda v: ops.rms_norm(v))(x)
        assert ran == ["triton", "pallas_triton"]
    np.testing.assert_allclose(grad, jax.grad(lambda v: ops.rms_norm(v, implementation="xla")
                                              .sum())(x))


def test_an_explicit_implementation_is_always_obeyed(monkeypatch):
    ran: list = []
    _stub_table(monkeypatch, "softmax", ran)
    x = np.ones((2, 8), np.float32)
    call = _resolve.capture_call(ops.softmax, (x,))
    with rankings.override(_stub_rankings(call, "pallas_triton", "pallas_triton")):
        ops.softmax(x, implementation="triton")
        ops.softmax(x, implementation=("triton", "xla"))
    assert ran == ["triton", "triton"]


def test_a_refusing_implementation_passes_to_the_next(monkeypatch):
    ran: list = []
    _stub_table(monkeypatch, "softmax", ran)
    table = _op._IMPLEMENTATIONS["softmax"]
    table["pallas_triton"] = dataclasses.replace(table["pallas_triton"],
                                                 supported=lambda call: "a stub refusal")
    x = np.ones((2, 8), np.float32)
    call = _resolve.capture_call(ops.softmax, (x,))
    with rankings.override(_stub_rankings(call, "pallas_triton", "pallas_triton")):
        choice = ops.resolve_implementation("softmax", x)
        assert choice.implementation == "triton"
        assert choice.skipped == (("pallas_triton", "a stub refusal"),)
        ops.softmax(x)
    assert ran == ["triton"]
    for n in ("triton", "xla"):
        table[n] = dataclasses.replace(table[n], supported=lambda call: "refused too")
    with pytest.raises(NotImplementedError, match="no implementation can run this call by default"):
        ops.resolve_implementation("softmax", x)


# --------------------------------------------------------------------------
# Lookups and the differentiation test
# --------------------------------------------------------------------------

def _entry(shape=(4096, 4096), pass_="fwd", kind=H200, first="triton", op="layer_norm", **kw):
    return rankings.make_entry(op, kind, "bfloat16", shape, pass_,
                               {first: 1.0, "xla": 2.0}, **kw)


def test_lookup_prefers_the_call_then_the_nearest():
    entries = [_entry(), _entry((512, 4096), first="pallas_triton"),
               _entry(pass_="fwd+bwd", first="pallas_triton"),
               _entry(kind="NVIDIA H100 80GB HBM3", shape=(64, 64), first="pallas_triton")]
    with rankings.override(entries):
        exact = rankings.lookup("layer_norm", H200, "bfloat16", (3000, 4096), {}, "fwd")
        assert exact.exact and exact.entry.names[0] == "triton"
        near = rankings.lookup("layer_norm", H200, "bfloat16", (1024, 4096), {}, "fwd")
        assert not near.exact and near.entry.bucket == (512, 4096)
        assert rankings.lookup("layer_norm", H200, "bfloat16", (4096, 4096), {},
                               "fwd+bwd").entry.names[0] == "pallas_triton"
        far = rankings.lookup("layer_norm", H200, "bfloat16", (1 << 20, 4096), {}, "fwd")
        assert far is None  # 256x more rows than anything measured
        own = rankings.lookup("layer_norm", "NVIDIA H100 80GB HBM3", "bfloat16", (64, 64), {},
                              "fwd")
        assert own.exact  # measured apart: its own entries only
        assert rankings.lookup("layer_norm", "NVIDIA A100-SXM4-80GB", "bfloat16", (4096, 4096),
                               {}, "fwd") is None
    assert rankings.device_family("NVIDIA GH200 480GB") == rankings.device_family(H200) == "sm_90"


def test_lookup_counts_variant_differences():
    op = "dot_product_attention"
    entries = [_entry((8192, 8192, 128), op=op, first="cudnn", variant={"causal": True}),
               _entry((8192, 8192, 128), op=op, first="pallas_triton",
                      variant={"causal": True, "soft_cap": True})]
    with rankings.override(entries):
        found = rankings.lookup(op, H200, "bfloat16", (8192, 8192, 128),
                                {"causal": True, "soft_cap": True, "group": 4}, "fwd")
        assert found.entry.names[0] == "pallas_triton" and found.differences == ("group=1",)


def test_rankings_files_are_validated(tmp_path):
    good = _entry()
    path = tmp_path / "rankings.json"
    assert rankings.write(path, [good], {}) == 1
    assert rankings.load(path).entries[good.key] == good
    for bad, message in (({"version": 9, "entries": []}, "version"),
                         ({"version": 1, "entries": [{"op": "layer_norm"}]}, "missing key"),
                         ({"version": 1, "entries": [{**good.as_json(), "ranking": [
                             {"implementation": "xla", "median_ms": 2.0},
                             {"implementation": "triton", "median_ms": 1.0}]}]}, "fastest first"),
                         ({"version": 1, "entries": [{**good.as_json(), "source": "nowhere"}]},
                          "source")):
        with pytest.raises(rankings.RankingsError, match=message):
            rankings.parse(bad)


def test_differentiation_is_seen_through_grad_vjp_jvp_and_vmap():
    seen = []

    def f(x):
        seen.append(_default.pass_of({"x": x}))
        return jnp.sum(x * x)

    x = jnp.ones((3,))
    jax.grad(f)(x)
    jax.vjp(f, x)
    jax.jvp(f, (x,), (x,))
    jax.grad(lambda v: jax.vmap(f)(v[None]).sum())(x)
    jax.jit(f)(x)
    f(x)
    assert seen == ["fwd+bwd"] * 4 + ["fwd"] * 2


def test_resolve_implementation_answers_for_the_default_only():
    with pytest.raises(TypeError, match="implementation=None"):
        ops.resolve_implementation("softmax", np.ones((2, 2)), implementation="xla")
    with pytest.raises(KeyError, match="no op 'conv'"):
        ops.resolve_implementation("conv", np.ones((2, 2)))
    with pytest.raises(ValueError, match="device_kind"):
        ops.resolve_implementation("softmax", np.ones((2, 2)), device_kind="")


# --------------------------------------------------------------------------
# The tools that write rankings (benchmarks/tune.py)
# --------------------------------------------------------------------------

def _result_rows(case: str, times: dict, errors: dict | None = None) -> list[dict]:
    return ([{"case": case, "implementation": n, "median_ms": t, "error": None}
             for n, t in times.items()]
            + [{"case": case, "implementation": n, "median_ms": None, "error": e}
               for n, e in (errors or {}).items()])


def test_rankings_from_a_benchmark_run():
    """Each case keyed by the problem the op itself sees; cases with one key summed;
    implementations that are not an op's (jax_pallas) left out; failures kept."""
    from benchmarks import tune
    matmul = "fused_matmul/{}/8192x8192x8192/bfloat16/fwd"
    attention = "dot_product_attention/causal+gqa8/4x4096x4096x32x4x64/bfloat16/fwd+bwd"
    rows = (_result_rows(matmul.format("plain"), {"xla": 1.0, "triton": 2.0, "pallas_triton": 3.0})
            + _result_rows(matmul.format("bias+gelu_exact"), {"xla": 2.0, "triton": 1.5})
            + _result_rows(attention, {"xla": 9.0, "cudnn": 1.0, "pallas_triton": 2.0,
                                       "jax_pallas": 0.5}, {"triton": "NotImplementedError: x"}))
    document = {"meta": {"platform": "gpu", "device_kind": H200}, "rows": rows}
    entries = {e.op: e for e in tune.rankings_from_results(document, source="run", log=lambda m: 0)}
    mm = entries["fused_matmul"]
    assert (mm.bucket, mm.pass_, mm.ranking) == ((8192,) * 3, "fwd", (("xla", 3.0), ("triton", 3.5)))
    assert len(mm.cases) == 2
    att = entries["dot_product_attention"]
    assert att.bucket == (4096, 4096, 64) and att.pass_ == "fwd+bwd"
    assert dict(att.variant)["causal"] and dict(att.variant)["group"] == 8
    assert att.names == ("cudnn", "pallas_triton", "xla")
    assert att.failed == (("triton", "NotImplementedError: x"),)


def test_the_tuner_ranks_what_may_be_a_default_here():
    """On this host only XLA may be a default: one entry per pass the op has, keyed by
    the call the tuner's example makes."""
    from benchmarks import tune
    from ops.tuning import search
    (problem,) = [p for p in search.quick_problems() if p.op == "layer_norm"]
    entries = tune.rank_problem(problem, device_kind="cpu", platform="cpu", iters=2, source="t",
                                log=lambda m: 0)
    assert [e.pass_ for e in entries] == ["fwd", "fwd+bwd"]
    for e in entries:
        assert e.names == ("xla",) and e.bucket == problem.op_problem().bucket
