"""Kernels with in-kernel tensor descriptors (``tma``) on our GPU launch path, checked without a GPU.

A ``tma`` kernel needs Triton's global scratch, which jaxlib's launch leaves
null; :mod:`pallas_core.triton.global_scratch` gives it a declared output
instead and rewrites the compiled PTX to read it. Checked here: the library
default switch (:func:`pallas_core.triton.enable_tma`, the environment
variable), the launch as jax_triton lowers it (jaxlib's C++ faked, as in
tests/test_triton_launch.py), the rewritten PTX compiled by ptxas for sm_90
and read back in SASS, refusals, and the interpreter's results, which the
switch must not change. ``pytest -m gpu`` runs ``tma`` kernels against
pointer ones on a GPU.
"""
import functools
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from pallas_core.triton import backend, descriptors, global_scratch, runtime, sass
from tests.test_triton_launch import check_launches, cuda, custom_calls, lower_for_cuda  # noqa: F401
from tests.tolerances import FORWARD, assert_close

pytest.importorskip("triton")
pytest.importorskip("torch")

SM90_PARAM_BASE = 0x210  # constant bank 0 offset of a kernel's first parameter on sm_90 (8 bytes each)


def matmul_call(m, n, k, blocks=(64, 32, 32), dtype=jnp.bfloat16, **switches):
    """A K-loop matmul (accumulator in scratch) whose operands qualify for descriptors."""
    bm, bn, bk = blocks

    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), dtype), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), k // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)), scratch_shapes=[pl.tpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pl.triton.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                                 **switches), backend="triton")


def _described(f, *args):
    return [s.count(descriptors.MAKE) for s in pl.triton.source(f, *args)]


# ---- the default switch --------------------------------------------------------------------

def test_tma_default_switch(monkeypatch):
    x = jax.ShapeDtypeStruct((200, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
    monkeypatch.delenv(descriptors.ENV_VAR, raising=False)
    assert not pl.triton.tma_enabled() and pl.triton.CompilerParams().tma is None
    assert _described(matmul_call(200, 96, 64), x, w) == [0]
    with pl.triton.enable_tma():
        assert pl.triton.tma_enabled()
        assert _described(matmul_call(200, 96, 64), x, w) == [3]  # x, w and the output
        assert _described(matmul_call(200, 96, 64, tma=False), x, w) == [0]  # explicit wins
        with pl.triton.enable_tma(False):
            assert not pl.triton.tma_enabled()
        assert pl.triton.tma_enabled()
    assert not pl.triton.tma_enabled()
    for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv(descriptors.ENV_VAR, value)
        assert pl.triton.tma_enabled() is on
    assert _described(matmul_call(200, 96, 64), x, w) == [0]
    monkeypatch.setenv(descriptors.ENV_VAR, "1")
    assert _described(matmul_call(200, 96, 64), x, w) == [3]
    with pl.triton.enable_tma(False):  # the block beats the environment
        assert _described(matmul_call(200, 96, 64), x, w) == [0]
    monkeypatch.setenv(descriptors.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match="PALLAS_CORE_TRITON_TMA"):
        pl.triton.tma_enabled()
    with pytest.raises(TypeError, match="enabled"):
        with pl.triton.enable_tma("yes"):
            pass


# ---- which descriptors ----------------------------------------------------------------------

def _squeezed_kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(3) == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    acc_ref[...] += x_ref[...].astype(jnp.float32)

    @pl.when(pl.program_id(3) == pl.num_programs(3) - 1)
    def _():
        o_ref[...] = acc_ref[...]


def _squeezed_call(backend, stacked):
    """Sums x[b, :, h, :] blocks (batch and head squeezed, fixed per program) over a sequential
    axis: along x's dim 1 (``stacked=False``: the fixed indices do not change in the loop) or
    over a leading stack dim indexed by the loop (``stacked=True``: one of them does)."""
    if stacked:  # x: [4(loop), B=2, T=40, H=3, D=32]
        spec = pl.BlockSpec((None, None, 16, None, 32), lambda b, h, t, k: (k, b, t, h, 0))
        out = pl.BlockSpec((None, 16, None, 32), lambda b, h, t, k: (b, t, h, 0))
        grid, shape = (2, 3, 3, 4), (2, 40, 3, 32)
    else:  # x: [B=2, T=48, H=3, D=32], 3 blocks of 16 rows summed
        spec = pl.BlockSpec((None, 16, None, 32), lambda b, h, i, k: (b, k, h, 0))
        out = pl.BlockSpec((None, 16, None, 32), lambda b, h, i, k: (b, 0, h, 0))
        grid, shape = (2, 3, 1, 3), (2, 16, 3, 32)
    return pl.pallas_call(
        _squeezed_kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32), grid=grid, in_specs=[spec],
        out_specs=out, scratch_shapes=[pl.tpu.VMEM((16, 32), jnp.float32)], backend=backend,
        compiler_params=pl.triton.CompilerParams(
            dimension_semantics=("parallel",) * 3 + ("arbitrary",), tma=True) if backend == "triton"
        else pl.CompilerParams(("parallel",) * 3 + ("arbitrary",)))


@pytest.mark.parametrize("stacked", [False, True])
def test_fixed_indices_fold_into_the_descriptor_unless_a_loop_changes_them(stacked):
    """A [1, 16, 1, 32] block of a squeezed batch and head: a 2-D descriptor at the access, its
    address offset by the fixed indices, loading the tile without a reshape; a fixed index
    the loop changes (the stacked axis) keeps the full-rank descriptor made ahead of the
    loops. Results as on the interpret backend, bit for bit."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 2, 40, 3, 32) if stacked else (2, 48, 3, 32)), jnp.float32)
    source = pl.triton.source(_squeezed_call("triton", stacked), x)[0]
    described = re.findall(r"^( *)d(\d) = tl\.make_tensor_descriptor\((.*)$", source, re.M)
    if stacked:  # x: full rank (5-D) ahead of the loop; the output (fixed b, h): 2-D, folded
        assert [(len(indent), args.count("shape=[A0_0, A0_1, A0_2, A0_3, A0_4]")) for indent, _, args in
                described if args.startswith("p0,")] == [(4, 1)]
        assert "d0.load([(i3 * B0_0), (i0 * B0_1), (i2 * B0_2), (i1 * B0_3), 0])" in source
    else:
        assert [args.split(", shape=")[1] for _, _, args in described] == [
            "[A0_1, A0_3], strides=[(A0_3 * A0_2), 1], block_shape=[16, 32])",
            "[A1_1, A1_3], strides=[(A1_3 * A1_2), 1], block_shape=[16, 32])"]
        assert "p0 + ((i0 * B0_0) * ((A0_3 * A0_2) * A0_1)) + ((i1 * B0_2) * A0_3)" in source
        assert "tl.reshape" not in source
    got = _squeezed_call("triton", stacked)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_squeezed_call("interpret", stacked)(x)))


# ---- the launch as jax_triton lowers it -------------------------------------------------------

def _custom_call_types(text):
    (call,) = custom_calls(text)
    return call[call.rindex("->"):]


@pytest.mark.parametrize("persistent", [None, 3])
def test_tma_launch_declares_the_global_scratch(cuda, persistent):  # noqa: F811
    x = jax.ShapeDtypeStruct((200, 64), jnp.bfloat16)  # 200 rows: an edge block of 8
    w = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
    f = matmul_call(200, 96, 64, tma=True, persistent=persistent)
    text, (record,) = lower_for_cuda(f, x, w)
    (kernel,), (launch,), meta = cuda.kernels, cuda.launches, cuda.metadata[-1]  # jax_triton's compile
    programs = 4 * 3 if persistent is None else persistent
    assert launch.grid == (programs, 1, 1)
    # Triton's figures: three descriptors of 128 bytes per program, 128-byte aligned.
    assert (meta["global_scratch_size"], meta["global_scratch_align"]) == (384, 128)
    assert not meta["profile_scratch_size"]
    # The scratch is one more output, after the kernel's own, dropped from the results.
    size = programs * 384 + 128
    assert _custom_call_types(text) == f"-> (tensor<200x96xbf16>, tensor<{size}xui8>)"
    assert jax.eval_shape(f, x, w) == jax.ShapeDtypeStruct((200, 96), jnp.bfloat16)
    # x, w, out and the scratch: four arrays; the PTX adds Triton's two hidden pointers.
    assert len(launch.params) == 4 and all(p.value == (0, 16) for p in launch.params)
    entry = re.search(r"\.entry kernel\((.*?)\)", kernel.ptx, re.S).group(1)
    assert entry.count(".param ") == 6
    # The global scratch base is read from parameter 3 (ours), rounded up to 128 bytes;
    # the hidden parameter 4 and the profile scratch (5) are never read.
    loads = re.findall(r"ld\.param\.b64\s+(%rd\d+), \[kernel_param_(\d)\];", kernel.ptx)
    assert [n for _, n in loads] == ["0", "1", "2", "3"]
    base = loads[-1][0]
    assert f"add.s64 \t{base}, {base}, 127;\n\tand.b64 \t{base}, {base}, -128;" in kernel.ptx
    body = kernel.ptx.split(".entry kernel(")[1].split(")", 1)[1]
    assert "kernel_param_4" not in body and "kernel_param_5" not in body
    assert "cp.async.bulk.tensor" in kernel.ptx and kernel.num_warps == record["num_warps"]


def _sass_parameter_reads(ptx: str) -> set[int]:
    """The parameters (by index) the SASS of a PTX module reads, compiled by Triton's ptxas for sm_90a."""
    import os

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as fh:
            fh.write(ptx)
        subprocess.run([ptxas, "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"], check=True,
                       capture_output=True)
        with open(f"{tmp}/k.cubin", "rb") as fh:
            text = sass.disassemble(fh.read())
    offsets = {int(o, 16) for o in re.findall(r"c\[0x0\]\[(0x[0-9a-f]+)\]", text)}
    return {(o - SM90_PARAM_BASE) // 8 for o in offsets if o >= SM90_PARAM_BASE}


def test_redirected_ptx_compiles_and_reads_the_declared_parameter():
    """ptxas accepts the rewritten PTX; in its SASS the scratch base comes from the declared
    parameter (3) and the hidden one (4) is unread, where Triton's own PTX reads 4."""
    x = jax.ShapeDtypeStruct((200, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
    with backend.capturing() as records:
        jax.make_jaxpr(matmul_call(200, 96, 64, tma=True))(x, w)
    (record,) = records
    source = global_scratch.with_parameter(record["source"], record["name"], 3)
    assert f"def kernel(p0, p1, p2, {global_scratch.PARAMETER}, G0: tl.constexpr" in source
    compiled = runtime.compile_kernel(source, "kernel", ["bfloat16"] * 4, record["constexprs"],
                                      num_warps=4, num_stages=3, capability=90)
    scratch = global_scratch.requirement(compiled.metadata._asdict())
    assert scratch == global_scratch.Scratch(384, 128)
    ptx = compiled.asm["ptx"]
    assert _sass_parameter_reads(ptx) == {0, 1, 2, 4}  # Triton's: the hidden global scratch
    assert _sass_parameter_reads(global_scratch.redirect(ptx, "kernel", 4, 128)) == {0, 1, 2, 3}


def test_fused_matmul_with_tma_launches_with_its_scratch(cuda):  # noqa: F811
    """An op's kernels under the library switch: descriptors, TMA copies in the PTX, the
    scratch output; without the switch the launch is as before."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(100, 64), (64, 72), (72,)]]
    f = functools.partial(ops.fused_matmul, activation="gelu", implementation="triton", block_sizes=(64, 32, 32))
    with pl.triton.enable_tma():
        text, records = lower_for_cuda(f, *args)
    assert [r["source"].count(descriptors.MAKE) for r in records] == [4]  # x, w, the bias, out
    (kernel,), meta = cuda.kernels, cuda.metadata[-1]
    assert "cp.async.bulk.tensor" in kernel.ptx and meta["global_scratch_size"] == 4 * 128
    assert _custom_call_types(text) == f"-> (tensor<100x72xbf16>, tensor<{2 * 3 * 512 + 128}xui8>)"


def test_kernels_without_descriptors_launch_as_before(cuda):  # noqa: F811
    x = jax.ShapeDtypeStruct((200, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((64, 96), jnp.bfloat16)
    text, records = lower_for_cuda(matmul_call(200, 96, 64, tma=False), x, w)
    check_launches(cuda, text, records)  # no scratch output, no extra parameter
    assert _custom_call_types(text) == "-> tensor<200x96xbf16>"


# ---- what cannot work is refused -------------------------------------------------------------

_PTX = """.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u64 .ptr .global .align 1 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2,
\t.param .u64 .ptr .global .align 1 k_param_3
)
{
\tld.param.b64 \t%rd1, [k_param_0];
\tld.param.b64 \t%rd2, [k_param_2];
BODY
}
"""


def test_redirect_refuses_what_it_cannot_rewrite():
    ptx = _PTX.replace("BODY", "")
    redirected = global_scratch.redirect(ptx, "k", 2, 128)
    assert "ld.param.b64 \t%rd2, [k_param_1];\n\tadd.s64 \t%rd2, %rd2, 127;" in redirected
    for body, match in (("ld.param.b64 \t%rd3, [k_param_2];", "2 ld.param.b64"),  # read twice
                        ("mov.b64 \t%rd3, k_param_2;", "2 uses"),
                        ("ld.param.b64 \t%rd3, [k_param_1];", "1 uses of k_param_1"),  # the declared one
                        ("ld.param.b64 \t%rd3, [k_param_3];", "1 of the profile")):
        with pytest.raises(NotImplementedError, match=re.escape(match)):
            global_scratch.redirect(_PTX.replace("BODY", body), "k", 2, 128)
    with pytest.raises(NotImplementedError, match="expected 3 declared"):
        global_scratch.redirect(ptx, "k", 3, 128)
    with pytest.raises(ValueError, match="no .entry"):
        global_scratch.redirect(ptx, "other", 2, 128)


def test_scratch_requirements_and_refusals():
    meta = dict(name="k", global_scratch_size=256, global_scratch_align=128, profile_scratch_size=0, num_warps=4)
    scratch = global_scratch.requirement(meta)
    assert scratch == global_scratch.Scratch(256, 128) and scratch.size(132) == 132 * 256 + 128
    assert global_scratch.requirement(dict(meta, global_scratch_size=0)) is None
    with pytest.raises(NotImplementedError, match="profile scratch"):
        global_scratch.requirement(dict(meta, profile_scratch_size=64))
    with pytest.raises(NotImplementedError, match="power of two"):
        global_scratch.requirement(dict(meta, global_scratch_align=96))
    global_scratch.check_metadata(meta, scratch, num_warps=4)
    with pytest.raises(NotImplementedError, match="traced with"):
        global_scratch.check_metadata(dict(meta, global_scratch_size=384), scratch, num_warps=4)
    with pytest.raises(NotImplementedError, match="warp specialization"):
        global_scratch.check_metadata(dict(meta, num_warps=12), scratch, num_warps=4)


def test_wrapped_compile_redirects_announced_kernels_and_refuses_unannounced_scratch():
    """jax_triton's compile, wrapped: an announced kernel's PTX is redirected; a kernel needing
    global scratch that nobody declared is refused; other platforms and kernels pass through."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class Result:
        binary: str
        name: str

    def real(ttir, backend, options, capability, platform):  # Triton's stages fill the metadata
        meta = dict(name="k", global_scratch_size=ttir["scratch"], global_scratch_align=128,
                    profile_scratch_size=0, num_warps=4)
        backend.make_llir(None, meta, options, capability)
        return Result(_PTX.replace("BODY", ""), "k")

    lib = types.SimpleNamespace(compile_ttir_inplace=real)
    global_scratch.install(lib)
    global_scratch.install(lib)  # once
    assert lib.compile_ttir_inplace.__wrapped__ is real
    backend = types.SimpleNamespace(make_llir=lambda *a: None)
    options = types.SimpleNamespace(num_warps=4)
    marker = "<pallas_core triton k 0123456789ab jit>"
    global_scratch.expect(marker, global_scratch.Scratch(256, 128), declared=2)
    announced = lib.compile_ttir_inplace(dict(scratch=256, loc=marker), backend, options, 90, "cuda")
    assert "[k_param_1];\n\tadd.s64" in announced.binary
    plain = lib.compile_ttir_inplace(dict(scratch=0), backend, options, 90, "cuda")
    assert plain.binary == _PTX.replace("BODY", "")
    with pytest.raises(NotImplementedError, match="no scratch output was declared"):
        lib.compile_ttir_inplace(dict(scratch=256), backend, options, 90, "cuda")
    assert lib.compile_ttir_inplace(dict(scratch=256), backend, options, 90, "rocm").name == "k"


def test_with_parameter_refuses_unexpected_signatures():
    source = "@jit\ndef k(p0, p1, N: tl.constexpr):\n    pass\n"
    assert "def k(p0, p1, descriptor_scratch, N: tl.constexpr):" in global_scratch.with_parameter(source, "k", 2)
    with pytest.raises(ValueError, match="no 'def other"):
        global_scratch.with_parameter(source, "other", 2)
    for arrays in (1, 3):  # a pointer would follow ours; a constexpr taken for a pointer
        with pytest.raises(ValueError, match=f"do not start with {arrays} pointers"):
            global_scratch.with_parameter(source, "k", arrays)


# ---- results do not depend on the switch ---------------------------------------------------------

def _recorded_sources(monkeypatch):
    sources = []
    launch = runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda source, *a, **kw: sources.append(source) or launch(source, *a, **kw))
    return sources


def test_interpreter_results_do_not_depend_on_the_switch(monkeypatch):
    rng = np.random.default_rng(0)
    x, w, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(100, 64), (64, 72), (72,)])
    f = functools.partial(ops.fused_matmul, activation="gelu", implementation="triton", block_sizes=(32, 32, 32))
    off = np.asarray(f(x, w, b), np.float32)
    sources = _recorded_sources(monkeypatch)
    jax.clear_caches()
    with pl.triton.enable_tma():
        on = np.asarray(f(x, w, b), np.float32)
    assert [s.count(descriptors.MAKE) for s in sources] == [4]  # ran with descriptors
    np.testing.assert_array_equal(on, off)


# ---- on a GPU ---------------------------------------------------------------------------------

def _tma_against_pointers(f, *args):
    """``f(*args)`` with tensor descriptors and with pointers, on the GPU; descriptors seen."""
    jax.clear_caches()
    with pl.triton.enable_tma(False):
        pointers = jax.jit(f)(*args)
    jax.clear_caches()
    with pl.triton.enable_tma():
        described = _described(f, *args)
        jax.clear_caches()
        tma = jax.jit(f)(*args)
    assert all(described), described
    return tma, pointers


@pytest.mark.gpu
def test_fused_matmul_tma_on_gpu():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (1000, 768), jnp.bfloat16)  # edge blocks in M and N
    w = (jax.random.normal(keys[1], (768, 1544)) / 28).astype(jnp.bfloat16)
    b = jax.random.normal(keys[2], (1544,), jnp.bfloat16)
    f = functools.partial(ops.fused_matmul, activation="gelu", implementation="triton")
    tma, pointers = _tma_against_pointers(f, x, w, b)
    assert_close(tma, pointers, FORWARD[jnp.bfloat16])
    assert_close(tma, ops.fused_matmul(x, w, b, activation="gelu", implementation="xla"), FORWARD[jnp.bfloat16])
    # A persistent grid (fewer programs than tiles): one scratch slice per launched program.
    g = matmul_call(1000, 1544, 768, blocks=(128, 128, 64), persistent=132, num_warps=8)
    tma, pointers = _tma_against_pointers(g, x, w)
    assert_close(tma, pointers, FORWARD[jnp.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h", [64, 128])
def test_attention_forward_tma_on_gpu(h, causal):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, 1000, 8, h), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 1000, 2, h), jnp.bfloat16) for key in keys[1:])
    f = functools.partial(ops.dot_product_attention, is_causal=causal, implementation="triton")
    tma, pointers = _tma_against_pointers(f, q, k, v)
    assert_close(tma, pointers, FORWARD[jnp.bfloat16])
    assert_close(tma, ops.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
                 FORWARD[jnp.bfloat16])
