"""ops.tuning on a CPU host: the cache's round trip, versioning and errors, lookup
precedence (explicit block sizes > cache > heuristic) in every op family, and the
compile filter dropping configs that spill or overflow shared memory on sm_90.
Nothing is timed here: the tuner times only on a GPU (docs/design.md §5.4)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import ops.tuning as tuning
from ops.attention.block_sizes import default_block_sizes as attention_defaults
from ops.attention.block_sizes import select_block_sizes, tuning_variant
from ops.matmul.fused_matmul import default_block_sizes as matmul_defaults
from ops.matmul.fused_matmul import reference as matmul_reference
from ops.matmul.fused_matmul import select_tiles
from ops.reduction._rows import select_row_layout
from ops.reduction.norms import layer_norm_reference
from ops.tuning import search
from pallas_core.triton import backend as triton_backend
from tests.tolerances import FORWARD, assert_close

KIND = jax.devices()[0].device_kind  # what lookups key on by default on this host


def _entry(op, impl, dtype, shape, **config):
    return tuning.make_entry(op, impl, KIND, dtype, shape, config)


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """A user cache file, reached through the environment variable."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    return path


def test_shape_bucket_rounds_up_to_powers_of_two():
    assert tuning.shape_bucket((3000, 4096, 4097, 1, 0)) == (4096, 4096, 8192, 1, 0)


def test_round_trip_through_file_env_var_and_api(tmp_path, user_cache):
    e = _entry("fused_matmul", "triton", "bfloat16", (3000, 500, 70), block_m=64, block_n=32,
               block_k=16, num_warps=2, num_stages=2)
    assert tuning.write(user_cache, [e]) == 1
    on_disk = json.loads(user_cache.read_text())
    assert on_disk["version"] == tuning.CACHE_VERSION and on_disk["entries"] == [e]
    # Any shape in the same bucket finds it; the next bucket does not.
    assert tuning.lookup("fused_matmul", "triton", jnp.bfloat16, (4096, 300, 128)) == e["config"]
    assert tuning.lookup("fused_matmul", "triton", jnp.bfloat16, (4097, 300, 128)) is None
    assert tuning.lookup("fused_matmul", "triton", jnp.float16, (4096, 300, 128)) is None
    assert tuning.lookup("fused_matmul", "pallas_triton", jnp.bfloat16, (4096, 300, 128)) is None
    # Merging keeps other keys and replaces the same key.
    e2 = dict(e, config=dict(e["config"], num_warps=4))
    other = _entry("layer_norm", "triton", "float32", (10, 5000), block_rows=2)
    assert tuning.write(user_cache, [e2, other]) == 2
    assert tuning.lookup("fused_matmul", "triton", jnp.bfloat16, (4096, 300, 128))["num_warps"] == 4
    # set_cache_file wins over the environment variable.
    api_file = tmp_path / "api.json"
    tuning.write(api_file, [e])
    tuning.set_cache_file(api_file)
    try:
        assert tuning.lookup("fused_matmul", "triton", jnp.bfloat16, (4096, 300, 128))["num_warps"] == 2
    finally:
        tuning.set_cache_file(None)


def test_packaged_cache_is_valid_and_current():
    document = json.loads(tuning.PACKAGED_CACHE.read_text())
    assert document["version"] == tuning.CACHE_VERSION
    tuning.load(tuning.PACKAGED_CACHE)  # every entry validates


@pytest.mark.parametrize("document, message", [
    ("{not json", "not valid JSON"),
    ('{"entries": []}', "'version' and 'entries'"),
    ('{"version": 1, "entries": []}', "version 1, but this library reads version 2"),
    ('{"version": 2, "entries": [{"op": "fused_matmul"}]}', "missing key"),
    ('{"version": 2, "entries": [{"op": "conv", "implementation": "triton", "device_kind": "x", '
     '"dtype": "float32", "bucket": [8], "config": {"block_m": 8}}]}', "unknown op 'conv'"),
    ('{"version": 2, "entries": [{"op": "fused_matmul", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8, 8], "config": {"block_m": -8}}]}',
     "'block_m' must be a positive int"),
    ('{"version": 2, "entries": [{"op": "softmax", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8], "config": {"chunk": 100}}]}',
     "chunk must be a power of two >= 128"),
    ('{"version": 2, "entries": [{"op": "fused_matmul", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8, 8], "config": {"tile": 8}}]}',
     "unknown config field 'tile'"),
    ('{"version": 2, "entries": [{"op": "fused_matmul", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 6, 8], "config": {"block_m": 8}}]}',
     "powers of two"),
    ('{"version": 2, "entries": [{"op": "dot_product_attention", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8, 8], "config": {"block_q": 16}, '
     '"variant": {"is_causal": true}}]}', "unknown variant field 'is_causal'"),
    ('{"version": 2, "entries": [{"op": "dot_product_attention", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8, 8], "config": {"block_q": 16}, '
     '"variant": {"causal": 1}}]}', "'causal' must be a bool"),
    ('{"version": 2, "entries": [{"op": "softmax", "implementation": "triton", '
     '"device_kind": "x", "dtype": "float32", "bucket": [8, 8], "config": {"chunk": 128}, '
     '"variant": {"causal": true}}]}', "unknown variant field 'causal' for softmax"),
])
def test_malformed_or_other_version_file_gives_a_clear_error(user_cache, document, message):
    user_cache.write_text(document)
    with pytest.raises(tuning.TuningCacheError, match=message) as info:
        tuning.lookup("fused_matmul", "triton", jnp.float32, (8, 8, 8))
    assert str(user_cache) in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(tuning.TuningCacheError, match=message):
        tuning.set_cache_file(user_cache)
    # The op fails the same way, at trace time, before any kernel is launched.
    x = jnp.ones((8, 8))
    with pytest.raises(tuning.TuningCacheError, match=message):
        jax.make_jaxpr(lambda a: ops.fused_matmul(a, a, implementation="interpret"))(x)


def test_missing_file_and_refused_merge(tmp_path, user_cache):
    with pytest.raises(tuning.TuningCacheError, match="cannot read"):
        tuning.set_cache_file(tmp_path / "absent.json")
    user_cache.write_text('{"version": 0, "entries": []}')
    with pytest.raises(tuning.TuningCacheError, match="version 0"):
        tuning.write(user_cache, [])


def test_matmul_precedence_explicit_then_cache_then_heuristic():
    m, n, k = 40, 50, 70
    heuristic = matmul_defaults(m, n, k, jnp.float32, "interpret")
    assert select_tiles(m, n, k, jnp.float32, "interpret").blocks == heuristic
    entry = _entry("fused_matmul", "interpret", "float32", (m, n, k), block_m=32, block_n=16,
                   block_k=32)
    with tuning.override([entry]):
        tiles = select_tiles(m, n, k, jnp.float32, "interpret")
        assert (tiles.blocks, tiles.num_warps, tiles.walk) == ((32, 16, 32), None, "grid")
        explicit = select_tiles(m, n, k, jnp.float32, "interpret", (8, 8, 8))
        assert explicit.blocks == (8, 8, 8)
        assert select_tiles(m, n, k, jnp.float32, "pallas_triton", (8, 8, 8)).walk == "loop"
        # The cached tiles run on a shape they do not divide.
        x, w = (jax.random.normal(key, s) for key, s in zip(jax.random.split(jax.random.key(0)),
                                                            ((m, k), (k, n))))
        assert_close(ops.fused_matmul(x, w, implementation="interpret"), matmul_reference(x, w),
                     FORWARD[jnp.float32], "cached tiles")


def test_cached_launch_parameters_reach_the_triton_kernel():
    from pallas_core.triton import backend
    entry = _entry("fused_matmul", "triton", "bfloat16", (64, 64, 64), block_m=32, block_n=64,
                   block_k=32, num_warps=2, num_stages=2, group_size=4)
    shapes = [jax.ShapeDtypeStruct((64, 48), jnp.bfloat16), jax.ShapeDtypeStruct((48, 64), jnp.bfloat16)]
    with tuning.override([entry]), backend.capturing() as records:
        jax.make_jaxpr(lambda x, w: ops.fused_matmul(x, w, implementation="triton"))(*shapes)
    (record,) = records
    assert (record["num_warps"], record["num_stages"]) == (2, 2)
    assert record["constexprs"]["GROUP"] == 4  # grouped program ordering, bands of 4


def test_matmul_config_as_block_sizes():
    """A MatmulConfig passed as block_sizes is the explicit config: its launch parameters
    reach the kernel, a walk it leaves None is the backend's, bad fields name block_sizes."""
    from pallas_core.triton import backend
    from ops.matmul.config import MatmulConfig
    config = MatmulConfig(32, 64, 32, num_warps=2, num_stages=2, group_size=4)
    assert select_tiles(64, 64, 48, jnp.bfloat16, "pallas_triton", config).walk == "loop"
    assert select_tiles(64, 64, 48, jnp.bfloat16, "triton", config).walk == "grid"
    shapes = [jax.ShapeDtypeStruct((64, 48), jnp.bfloat16), jax.ShapeDtypeStruct((48, 64), jnp.bfloat16)]
    with backend.capturing() as records:
        jax.make_jaxpr(lambda x, w: ops.fused_matmul(x, w, implementation="triton",
                                                     block_sizes=config))(*shapes)
    (record,) = records
    assert (record["num_warps"], record["num_stages"], record["constexprs"]["GROUP"]) == (2, 2, 4)
    for bad, message in ((MatmulConfig(0, 16, 16), "block_sizes.block_m must be a positive int"),
                         (MatmulConfig(16, 16, 16, num_stages=True), "num_stages must be a positive"),
                         (MatmulConfig(16, 16, 16, walk="zigzag"), "block_sizes.walk must be")):
        with pytest.raises(ValueError, match=message):
            ops.fused_matmul(np.zeros((4, 8), np.float32), np.zeros((8, 4), np.float32),
                             implementation="interpret", block_sizes=bad)


def test_row_op_precedence_and_cached_layout_runs():
    rows, features = 13, 300
    heuristic = select_row_layout("layer_norm", rows, features, jnp.float32, "interpret")
    assert heuristic.num_chunks == 1
    entry = _entry("layer_norm", "interpret", "float32", (rows, features), block_rows=8, chunk=128)
    with tuning.override([entry]):
        layout = select_row_layout("layer_norm", rows, features, jnp.float32, "interpret")
        assert (layout.block_rows, layout.chunk, layout.num_chunks) == (8, 128, 3)
        # An explicit max_chunk is the caller's choice: the cache is not consulted.
        explicit = select_row_layout("layer_norm", rows, features, jnp.float32, "interpret",
                                     max_chunk=256)
        assert (explicit.block_rows, explicit.chunk) == (heuristic.block_rows, 256)
        # Another op's key is not this one's.
        assert select_row_layout("rms_norm", rows, features, jnp.float32, "interpret") == heuristic
        kx, ks, kb = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(kx, (rows, features)) * 2 + 0.5
        scale, bias = (jax.random.normal(k, (features,)) for k in (ks, kb))
        assert_close(ops.layer_norm(x, scale, bias, implementation="interpret"),
                     layer_norm_reference(x, scale, bias), FORWARD[jnp.float32], "cached layout")


def test_attention_precedence(monkeypatch):
    # The GPU's tiles: on this host, triton outside a capture would take the
    # interpreter's (test_interpreter_tiles).
    monkeypatch.setattr(triton_backend, "_on_gpu", lambda: True)
    heuristic = attention_defaults(300, 300, 64, jnp.bfloat16, "triton")
    assert select_block_sizes(300, 300, 64, jnp.bfloat16, "triton") == heuristic
    entry = _entry("dot_product_attention", "triton", "bfloat16", (300, 300, 64), block_q=64,
                   num_warps=8)
    with tuning.override([entry]):
        tuned = select_block_sizes(300, 300, 64, jnp.bfloat16, "triton")
    assert (tuned.block_q, tuned.num_warps) == (64, 8)
    assert tuned.block_k == heuristic.block_k  # fields the entry leaves out: the heuristic's


def test_attention_key_holds_what_changes_the_kernel():
    """Two calls differing in one kernel-changing property get different keys; an entry
    left without variant fields is the plain call's."""
    plain = tuning_variant()
    assert plain == tuning.full_variant("dot_product_attention")
    bias, mask = np.zeros((1, 4, 8, 8), np.float32), np.ones((1, 1, 1, 8), bool)
    others = [tuning_variant(causal=True), tuning_variant(window=(100, 0)),
              tuning_variant(window=(300, 0)), tuning_variant(segments=True),
              tuning_variant(q_lengths=True), tuning_variant(kv_lengths=True),
              tuning_variant(bias=bias), tuning_variant(bias=bias.astype(jnp.bfloat16)),
              tuning_variant(bias=bias[:, :1]), tuning_variant(mask=mask),
              tuning_variant(dropout=True), tuning_variant(soft_cap=True), tuning_variant(group=4)]
    keys = [tuple(sorted(v.items())) for v in [plain, *others]]
    assert len(set(keys)) == len(keys)
    assert tuning_variant(window=(100, 0)) == tuning_variant(window=(128, 0))  # one bucket
    assert tuning_variant(bias=bias[:, :1])["bias"] == "TS" and tuning_variant(mask=mask)["mask"] == "S"
    # Entries for causal and non-causal calls of one shape are two keys, each found by its own.
    shape = (300, 300, 64)
    causal = tuning.make_entry("dot_product_attention", "triton", KIND, "bfloat16", shape,
                               dict(block_q=32), variant=tuning_variant(causal=True))
    full = tuning.make_entry("dot_product_attention", "triton", KIND, "bfloat16", shape,
                             dict(block_q=64))
    assert causal["variant"]["causal"] and full["variant"] == plain  # written whole
    with tuning.override([causal, full]):
        assert tuning.lookup("dot_product_attention", "triton", jnp.bfloat16, shape,
                             tuning_variant(causal=True)) == {"block_q": 32}
        assert tuning.lookup("dot_product_attention", "triton", jnp.bfloat16, shape) == {"block_q": 64}
        assert tuning.lookup("dot_product_attention", "triton", jnp.bfloat16, shape,
                             tuning_variant(group=2)) is None
    with pytest.raises(tuning.TuningCacheError, match="unknown variant field 'causal' for fused_matmul"):
        tuning.lookup("fused_matmul", "triton", jnp.bfloat16, (8, 8, 8), {"causal": True})


def test_attention_cached_entry_serves_only_its_variant(monkeypatch):
    """A tuned entry for causal calls is used by causal calls and not by non-causal ones
    of the same shape (the block sizes the op asks for, traced only)."""
    from ops.attention import attention as attention_module
    chosen = []

    def spy(*args, **kwargs):
        chosen.append(select_block_sizes(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(attention_module, "select_block_sizes", spy)
    # 96 query rows per key/value head: more than split-KV decode takes (its calls' key
    # also holds batch x key/value heads).
    q = np.zeros((1, 96, 2, 16), np.float32)
    heuristic = attention_defaults(96, 96, 16, jnp.float32, "interpret")
    entry = tuning.make_entry("dot_product_attention", "interpret", KIND, "float32", (96, 96, 16),
                              dict(block_q=16, block_k=8), variant=tuning_variant(causal=True))
    with tuning.override([entry]):
        for causal in (True, False):
            jax.make_jaxpr(lambda q: ops.dot_product_attention(
                q, q, q, is_causal=causal, implementation="interpret"))(q)
    assert [(b.block_q, b.block_k) for b in chosen] == [
        (16, 8), (heuristic.block_q, heuristic.block_k)]
    assert (heuristic.block_q, heuristic.block_k) != (16, 8)
    # The tuner's entry for a problem is the one its call looks up (self-attention: causal).
    for shape in ((32, 32, 16), (32, 64, 16)):
        problem = search.Problem("dot_product_attention", shape, "float32", "interpret")
        fn, args = problem.function()
        with tuning.override([problem.entry(dict(block_q=16, block_k=8), KIND)]):
            jax.make_jaxpr(fn)(*args)
        assert (chosen[-1].block_q, chosen[-1].block_k) == (16, 8)


def test_problem_and_candidates():
    with pytest.raises(ValueError, match="op: expected one of"):
        search.Problem("conv", (1, 2, 3))
    with pytest.raises(ValueError, match="shape: layer_norm takes 2"):
        search.Problem("layer_norm", (1, 2, 3))
    small = search.candidates(search.Problem("fused_matmul", (40, 40, 20)))
    assert small and all(c["block_m"] <= 64 and c["block_k"] <= 32 for c in small)
    assert len({tuple(sorted(c.items())) for c in small}) == len(small)
    rows = search.candidates(search.Problem("softmax", (4096, 32768)))
    assert all(c["num_stages"] == 2 for c in rows)  # several chunks: the loop is pipelined
    for problem in search.main_problems() + search.quick_problems():
        assert search.candidates(problem)


def test_compile_filter_drops_spills_and_shared_memory_overflow():
    """Built to fail: a 64x64 tile whose K step is 256 deep in 8 stages needs 512 KiB of
    shared memory; one warp holding an 8192-wide float32 softmax row spills; a whole
    128x256 tile fits the inference forward but spills in the training forward (which
    also stores the pre-activation), so the filter must compile the training step too."""
    matmul = search.Problem("fused_matmul", (256, 256, 512), "bfloat16")
    fits = dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    too_deep = dict(block_m=64, block_n=64, block_k=256, num_warps=4, num_stages=8)
    wide = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)
    kept, dropped, trains_badly = search.compile_filter(matmul, [fits, too_deep, wide],
                                                        target="sm_90")
    assert kept.kept and all(k["spill_bytes"] == 0 for k in kept.kernels), kept
    assert {(k["call"], k["name"]) for k in kept.kernels} == {
        ("forward", "fused_matmul"), ("training", "fused_matmul_bias_gelu"),
        ("training", "fused_matmul_dz"), ("training", "fused_matmul_dx"),
        ("training", "fused_matmul_dw")}
    assert not dropped.kept and dropped.reason.startswith("forward: ") \
        and "shared memory" in dropped.reason, dropped
    assert [k["call"] for k in dropped.kernels] == ["forward"]  # no training compiles after
    forward = [k for k in trains_badly.kernels if k["call"] == "forward"]
    assert forward and forward[0]["spill_bytes"] == 0, trains_badly  # inference alone fits
    assert not trains_badly.kept and trains_badly.reason.startswith(
        "training: fused_matmul_bias_gelu: spills"), trains_badly
    with pytest.raises(ValueError, match="call: expected one of"):
        search.compile_config(matmul, fits, call="backward")
    softmax = search.Problem("softmax", (64, 8192), "float32")
    (spills,) = search.compile_filter(
        softmax, [dict(block_rows=1, chunk=8192, num_warps=1, num_stages=1)], target="sm_90")
    assert not spills.kept and "spills" in spills.reason, spills
    assert np.all([k["registers"] > 0 for k in spills.kernels])


def test_compiled_calls_include_the_training_step_of_ops_that_train():
    """Every tuned op's training step, but not attention's decode step (never trained)."""
    calls = {p.op: [label for label, _, _ in p.compiled_calls()] for p in search.quick_problems()}
    for op in ("fused_matmul", "gated_linear_unit", "ragged_dot", "dot_product_attention",
               "layer_norm", "apply_rotary_embedding"):
        assert calls[op] == ["forward", "training"], (op, calls[op])
    (decode,) = [p for p in search.main_problems()
                 if p.op == "dot_product_attention" and p.shape[0] == 1]
    assert [label for label, _, _ in decode.compiled_calls()] == ["forward"]  # not trained
    step, args = search.Problem("gated_linear_unit", (64, 32, 16)).compiled_calls()[1][1:]
    out, grads = jax.eval_shape(step, *args)
    assert out.shape == (64, 32) and [g.shape for g in jax.tree.leaves(grads)] == [
        a.shape for a in args[:-1]]


def test_tune_cli_on_cpu_filters_without_timing_or_writing(tmp_path):
    from benchmarks import tune
    out, report = tmp_path / "cache.json", tmp_path / "report.json"
    assert tune.main(["--quick", "--ops", "layer_norm", "--max-candidates", "1", "--out", str(out),
                      "--report", str(report)]) == 0
    assert not out.exists()  # nothing timed on a CPU host, so no winner
    (result,) = json.loads(report.read_text())["results"]
    assert result["target"] == "sm_90" and result["timings"] == [] and result["entry"] is None
    (verdict,) = result["verdicts"]
    assert verdict["kept"] and [(k["call"], k["name"]) for k in verdict["kernels"]] == [
        ("forward", "layer_norm_fwd"), ("training", "layer_norm_fwd"), ("training", "layer_norm_bwd")]
    assert tune.main(["--quick", "--ops", "layer_norm", "--max-candidates", "1", "--out", str(out),
                      "--report", str(report), "--inference-only"]) == 0
    (result,) = json.loads(report.read_text())["results"]
    assert [k["call"] for k in result["verdicts"][0]["kernels"]] == ["forward"]
    assert tune.main(["--ops", "conv"]) == 2


def test_tune_cli_saves_each_winner_before_it_is_stopped(tmp_path, monkeypatch):
    """A tuner cut by its caller's time limit (SIGTERM) keeps the winners and the
    report of the problems it finished."""
    from benchmarks import checkpoint, tune
    out, report = tmp_path / "cache.json", tmp_path / "report.json"
    first = _entry("layer_norm", "triton", "bfloat16", (4096, 1024), block_rows=2)

    def fake_tune_problem(problem, **kwargs):
        if fake_tune_problem.calls:
            raise checkpoint.Stopped("signal 15")
        fake_tune_problem.calls += 1
        return {"problem": problem.name, "entry": first, "verdicts": [], "timings": []}

    fake_tune_problem.calls = 0
    monkeypatch.setattr(tune, "tune_problem", fake_tune_problem)
    assert tune.main(["--ops", "layer_norm,rms_norm", "--out", str(out),
                      "--report", str(report)]) == 0
    assert json.loads(out.read_text())["entries"] == [first]
    assert len(json.loads(report.read_text())["results"]) == 1


def test_tune_cli_merges_a_session_cache(tmp_path):
    from benchmarks import tune
    session, package = tmp_path / "session.json", tmp_path / "package.json"
    e = tuning.make_entry("softmax", "triton", "NVIDIA H100 80GB HBM3", "bfloat16", (4096, 4096),
                          dict(block_rows=2, chunk=4096, num_warps=8, num_stages=1),
                          measured=dict(median_ms=0.1))
    tuning.write(session, [e])
    tuning.write(package, [_entry("rms_norm", "triton", "float32", (8, 8), block_rows=1)])
    assert tune.main(["--merge", str(session), "--out", str(package)]) == 0
    assert len(tuning.load(package)) == 2


def test_interpreter_tiles():
    """On a host without a GPU, triton's tile choice is the interpreter's (few, big
    programs: its cost is per tl operation); inside a capture (pl.triton.source /
    compile, the static gate) it is the GPU heuristic's; explicit sizes and the
    other backends are untouched."""
    from ops.attention.block_sizes import interpreter_block_sizes
    from ops.matmul.tiled import interpreter_block_sizes as matmul_interpreter
    from ops.reduction.norms import default_block_rows

    assert triton_backend.runs_in_interpreter()
    assert triton_backend.wants_interpreter_tiles("triton")
    assert not any(map(triton_backend.wants_interpreter_tiles, ("interpret", "pallas_triton", "mosaic_tpu")))
    assert triton_backend.interpreter_tiles((1, 100, 5000)) == (16, 128, 512)
    tiles = select_tiles(2048, 1536, 384, jnp.float32, "triton")
    assert tiles.blocks == matmul_interpreter(2048, 1536, 384) == (512, 512, 512)
    assert select_tiles(2048, 1536, 384, jnp.float32, "triton", (64, 64, 32)).blocks == (64, 64, 32)
    assert select_block_sizes(32, 32, 32, jnp.float32, "triton") == interpreter_block_sizes(32, 32)
    assert interpreter_block_sizes(32, 1000).block_k == 128
    layout = select_row_layout("layer_norm", 2048, 384, jnp.float32, "triton")
    assert layout.block_rows * layout.chunk == triton_backend.INTERPRETER_TILE_ELEMENTS
    assert select_row_layout("layer_norm", 10, 384, jnp.float32, "triton").block_rows == 16
    with triton_backend.capturing():
        assert not triton_backend.runs_in_interpreter()
        assert not triton_backend.wants_interpreter_tiles("triton")
        assert select_tiles(2048, 1536, 384, jnp.float32, "triton").blocks == matmul_defaults(
            2048, 1536, 384, jnp.float32, "triton")
        assert select_block_sizes(32, 32, 32, jnp.float32, "triton") == attention_defaults(
            32, 32, 32, jnp.float32, "triton")
        gpu_rows = default_block_rows(2048, 384, jnp.float32, "triton")
        assert select_row_layout("layer_norm", 2048, 384, jnp.float32, "triton",
                                 heuristic_block_rows=lambda c: gpu_rows).block_rows == gpu_rows
    for impl in ("interpret", "pallas_triton"):
        assert select_tiles(2048, 1536, 384, jnp.float32, impl).blocks == matmul_defaults(
            2048, 1536, 384, jnp.float32, impl)


def test_mosaic_tpu_matmul_blocks():
    """Whole dims up to the op's caps, the caps beyond; block_k whole up to 512, else
    the largest of 512 / 256 / 128 that divides K (512 when none does)."""
    from ops._tiles import mosaic_tpu_matmul_blocks
    from ops.reduction.linear_cross_entropy import default_block_sizes as lce_defaults

    assert mosaic_tpu_matmul_blocks(100, 300, 500, max_m=256, max_n=512) == (100, 300, 500)
    assert mosaic_tpu_matmul_blocks(1000, 3000, 768, max_m=256, max_n=512) == (256, 512, 256)
    assert mosaic_tpu_matmul_blocks(8, 8, 640, max_m=256, max_n=512)[2] == 128
    assert mosaic_tpu_matmul_blocks(8, 8, 700, max_m=256, max_n=512)[2] == 512
    assert matmul_defaults(1000, 3000, 768, jnp.bfloat16, "mosaic_tpu") == (256, 512, 256)
    assert lce_defaults(1000, 768, 3000, jnp.bfloat16, "mosaic_tpu") == (256, 1024, 256)
