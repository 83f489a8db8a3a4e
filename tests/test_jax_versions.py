"""What pallas_core reads from JAX's jaxprs in the form JAX 0.10.2 gives and in the
form JAX 0.11 gives (docs/pallas_core.md section 15): the tests run on the installed
JAX and, where they can, build the other version's form by hand."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_core as pl
from pallas_core import _jax_internals

REPO = pathlib.Path(__file__).resolve().parents[1]
# What ``jax.core`` still exports in JAX 0.11 (it removed its other deprecated names,
# e.g. jaxprs_in_params and new_jaxpr_eqn, which live on in jax.extend.core).
JAX_CORE_IN_0_11 = {"AbstractValue", "Atom", "ParamDict", "ShapedArray", "Trace", "Tracer", "Value",
                    "ensure_compile_time_eval", "eval_context", "eval_jaxpr", "max_dim", "min_dim"}


def _scan_eqn(jaxpr):
    return next(e for e in jaxpr.eqns if e.primitive.name == "scan")


def test_scan_sizes_of_a_traced_scan():
    w = np.arange(3, dtype=np.float32)  # a closed-over array: one const of the scan

    def f(c0, c1, xs):
        def step(carry, x):
            a, b = carry
            return (a + x * w, b * 2), a.sum()
        return lax.scan(step, (c0, c1), xs)

    jaxpr = jax.make_jaxpr(f)(np.zeros(3, np.float32), np.float32(1), np.ones((4, 3), np.float32))
    eqn = _scan_eqn(jaxpr.jaxpr)
    consts, carry = _jax_internals.scan_sizes(eqn.params)
    assert (consts, carry) == (len(eqn.invars) - 3, 2)


class _Groups:
    """Stands in for JAX 0.11's ``ft_in``: the scan operands' groups (consts, carry, xs)."""

    def __init__(self, *sizes):
        self.sizes = sizes

    def unpack(self):
        return [list(range(n)) for n in self.sizes]


def test_scan_sizes_of_jax_0_11_params():
    params = dict(ft_in=_Groups(2, 3, 1), jaxpr=None, length=4, reverse=False, unroll=1)
    assert _jax_internals.scan_sizes(params) == (2, 3)


def test_axis_index_inside_a_scan_with_consts():
    """The interpreter rewrites ``lax.axis_index`` inside a scan (its consts and carry
    counts read through ``scan_sizes``)."""
    x = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)

    def kernel(x_ref, o_ref):
        row = x_ref[...]

        def step(c, _):
            return c + row * lax.axis_index("i").astype(jnp.float32), None

        o_ref[...] = lax.scan(step, jnp.zeros_like(row), None, length=2)[0]

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         in_specs=[pl.BlockSpec((None, 8), lambda i: (i, 0))],
                         out_specs=pl.BlockSpec((None, 8), lambda i: (i, 0)),
                         grid=(("i", 3),), interpret=True)(x)
    np.testing.assert_array_equal(out, x * 2 * np.arange(3, dtype=np.float32)[:, None])


def test_only_names_jax_core_keeps_in_0_11():
    """``jax.core`` attributes the code uses: only those JAX 0.11 still exports."""
    used = set()
    for folder in ("pallas_core", "ops", "layers", "benchmarks", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            used |= {(str(path.relative_to(REPO)), n) for n in re.findall(r"\bjax\.core\.(\w+)", text)}
            used |= {(str(path.relative_to(REPO)), n.strip())
                     for names in re.findall(r"from jax\.core import ([\w, ]+)", text)
                     for n in names.split(",")}
    assert used, "the search found nothing: is the pattern right?"
    assert sorted((p, n) for p, n in used if n not in JAX_CORE_IN_0_11) == []


def test_a_called_jaxpr_under_either_name(monkeypatch):
    """JAX 0.10 and 0.11.0 stage a call of a jaxpr as ``closed_call``, later JAX as
    ``eval_jaxpr`` (same ``call_jaxpr`` param): the Triton source is the same."""
    from jax._src.lax.eval_jaxpr import eval_jaxpr_p  # staged as closed_call here
    from jax.extend import core as jex_core
    from pallas_core.triton import codegen

    inner = jax.make_jaxpr(lambda v: jnp.sin(v) * 2)(jax.ShapeDtypeStruct((8, 128), jnp.float32))

    def kernel(x_ref, o_ref):
        try:
            (o_ref[...],) = eval_jaxpr_p.bind(x_ref[...], jaxpr=inner)
        except TypeError:  # JAX after 0.11.0 names the param call_jaxpr
            (o_ref[...],) = eval_jaxpr_p.bind(x_ref[...], call_jaxpr=inner)

    def f(x):
        return pl.pallas_call(kernel, out_shape=x, backend="triton")(x)

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    (as_closed_call,) = pl.triton.source(f, x)
    assert "tl.sin" in as_closed_call
    renamed = jex_core.Primitive("eval_jaxpr")
    renamed.multiple_results = True
    traced = codegen.trace_kernel

    def with_eval_jaxpr(call):
        closed = traced(call)
        eqns = [e.replace(primitive=renamed) if e.primitive.name == "closed_call" else e
                for e in closed.jaxpr.eqns]
        assert any(e.primitive.name == "eval_jaxpr" for e in eqns), "the kernel calls no jaxpr"
        return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns))

    monkeypatch.setattr(codegen, "trace_kernel", with_eval_jaxpr)
    assert pl.triton.source(f, x) == [as_closed_call]


# ---- Primitives of later JAX (docs/pallas_core.md section 15) ---------------------------
# JAX 0.11.2 binds jnp.log2 as a primitive named "log2"; the installed JAX may have none,
# so a stand-in with JAX's semantics is bound by that name (the code generator and the
# elementwise check dispatch by name; interpret and pallas_triton run it through JAX).

def _stand_in_log2():
    from jax.extend import core as jex_core
    from jax.interpreters import batching, mlir

    p = jex_core.Primitive("log2")
    spelled = lambda x, accuracy=None: lax.div(lax.log(x), lax.log(np.array(2, x.dtype)))
    p.def_impl(spelled)
    p.def_abstract_eval(lambda x, accuracy=None: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(spelled, multiple_results=False))
    batching.defvectorized(p)
    return p, spelled


LOG2_P, _LOG2_SPELLED = _stand_in_log2()


def _log2_kernel(log2):
    def kernel(x_ref, o_ref):
        o_ref[...] = log2(x_ref[...] * x_ref[...] + 0.5)
    return kernel


def _log2_call(log2, backend):
    return lambda x: pl.pallas_call(_log2_kernel(log2), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    backend=backend)(x)


def test_a_log2_primitive_on_the_interpreter_and_our_triton_lowering():
    """Both agree with float64 log2; our Triton source for the primitive is 0.10.2's for
    jnp.log2 (log(x) / log(2)), character for character, in float32 and bfloat16."""
    from tests.tolerances import FORWARD, assert_close, for_dtype

    prim = lambda v: LOG2_P.bind(v, accuracy=None)
    rng = np.random.default_rng(7)
    for dtype in (jnp.float32, jnp.bfloat16):
        spec = jax.ShapeDtypeStruct((8, 96), dtype)  # 96: padded lanes in the Triton tensors
        assert pl.triton.source(_log2_call(prim, "triton"), spec) == \
            pl.triton.source(_log2_call(jnp.log2, "triton"), spec)
        x = rng.standard_normal((8, 96)).astype(dtype)
        expected = np.log2(np.asarray(x, np.float64) ** 2 + 0.5)
        for backend in ("interpret", "triton"):
            out = _log2_call(prim, backend)(x)
            assert out.dtype == dtype
            assert_close(out, expected, 2 * for_dtype(FORWARD, dtype), f"log2 {backend} {dtype}")


def test_a_log2_primitive_lowers_for_cuda_through_jax_pallas_triton(monkeypatch):
    """On pallas_triton the primitive reaches JAX's own lowering (here: the stand-in's
    rule, as JAX 0.11.2 registers its own)."""
    from jax._src.pallas.triton import lowering as triton_lowering

    monkeypatch.setitem(triton_lowering.triton_lowering_rules, LOG2_P,
                        triton_lowering.lower_fun(_LOG2_SPELLED, multiple_results=False))
    prim = lambda v: LOG2_P.bind(v, accuracy=None)
    spec = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    with _an_abstract_gpu():
        text = jax.jit(_log2_call(prim, "pallas_triton")).trace(spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def _an_abstract_gpu():
    """JAX after 0.11.0 lowers pallas_triton for the GPU it asks JAX about (its
    pltriton.get_gpu_info): on a host without one, an abstract H100, as its error
    message says. 0.10.2 asks nothing."""
    import contextlib

    from jax.experimental.pallas import triton as jax_pltriton

    if not hasattr(jax_pltriton, "get_gpu_info"):
        return contextlib.nullcontext()
    gpu = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=gpu))


def test_a_log2_primitive_in_a_fused_epilogue():
    """The elementwise check takes it; the fused matmul epilogue gives jnp.log2's numbers."""
    import ops
    from ops._checks import check_elementwise
    from tests.tolerances import FORWARD, assert_close

    activation = lambda z: LOG2_P.bind(z * z + 1.0, accuracy=None)
    check_elementwise(activation, "activation", "test")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 24)).astype(np.float32) / 4
    expected = np.log2((x.astype(np.float64) @ w) ** 2 + 1)
    for impl in ("interpret", "triton"):
        out = ops.fused_matmul(x, w, activation=activation, implementation=impl)
        assert_close(out, expected, 4 * FORWARD[jnp.float32], f"log2 epilogue {impl}")


def test_a_checkpointed_epilogue_is_elementwise_and_runs():
    """jax.checkpoint stages remat2 (0.10.2 and 0.11): its body is checked, and the Triton
    lowering writes it in place; the numbers are those of the plain activation."""
    import ops
    from ops._checks import check_elementwise

    activation = jax.checkpoint(lambda z: jnp.tanh(z) * jax.nn.sigmoid(z))
    check_elementwise(activation, "activation", "test")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 24)).astype(np.float32) / 4
    for impl in ("interpret", "triton"):
        plain = ops.fused_matmul(x, w, activation=lambda z: jnp.tanh(z) * jax.nn.sigmoid(z),
                                 implementation=impl)
        np.testing.assert_array_equal(ops.fused_matmul(x, w, activation=activation, implementation=impl),
                                      plain)
    not_elementwise = jax.checkpoint(jax.nn.softmax)
    with pytest.raises(ValueError, match="not elementwise"):
        check_elementwise(not_elementwise, "activation", "test")


def test_empty_and_unstack_in_the_elementwise_check():
    """jnp.empty binds lax.empty in JAX 0.11 (a constant block, as 0.10.2's zeros); iterating
    over the block binds unstack, which is refused by name."""
    from ops._checks import check_elementwise

    check_elementwise(lambda z: lax.empty(z.shape, z.dtype) * 0 + z, "activation", "test")
    with pytest.raises(ValueError, match="'unstack'"):
        check_elementwise(lambda z: jnp.stack(lax.unstack(z)[::-1]), "activation", "test")


def _run_both(kernel, x, out_shape=None):
    out_shape = out_shape or jax.ShapeDtypeStruct(x.shape, x.dtype)
    return [np.asarray(pl.pallas_call(kernel, out_shape=out_shape, backend=b)(x)) for b in ("interpret", "triton")]


def test_unstack_empty_and_checkpoint_in_a_kernel():
    """lax.unstack (JAX 0.11's iteration over a traced array), lax.empty (jnp.empty) and
    jax.checkpoint in a kernel: our Triton lowering matches the interpreter and numpy."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((4, 96)).astype(np.float32)

    def rows(x_ref, o_ref):
        r = lax.unstack(x_ref[...], axis=0)
        for i, row in enumerate((r[3], r[0] * 2, r[1] + r[2], r[1])):
            o_ref[i, :] = row

    def columns(x_ref, o_ref):  # unstack down to scalars, along the last axis
        c = lax.unstack(x_ref[0, :4], axis=0)
        o_ref[...] = x_ref[...] * (c[0] + c[3])

    def empty(x_ref, o_ref):
        o_ref[...] = lax.empty(x_ref.shape, x_ref.dtype) + x_ref[...]

    def checkpointed(x_ref, o_ref):
        o_ref[...] = jax.checkpoint(lambda v: jnp.sin(v) * v)(x_ref[...])

    expected = {rows: np.stack([x[3], x[0] * 2, x[1] + x[2], x[1]]),
                columns: x * (x[0, 0] + x[0, 3]), empty: x, checkpointed: np.sin(x) * x}
    for kernel, want in expected.items():
        for out in _run_both(kernel, x):
            np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=kernel.__name__)


def test_unstack_of_a_dim_that_is_not_a_power_of_two_raises_naming_it():
    def kernel(x_ref, o_ref):
        r = lax.unstack(x_ref[...], axis=0)
        o_ref[...] = r[0][None] + x_ref[...]

    x = jax.ShapeDtypeStruct((3, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match=r"unstacking .* dim of 3 .*'unstack'"):
        pl.triton.source(lambda x: pl.pallas_call(kernel, out_shape=x, backend="triton")(x), x)


@pytest.fixture
def scan3():
    """JAX's jax_scan3 flag (0.10.2 and 0.11: off by default): lax.scan stages a hijax
    primitive, call_hi_primitive, with its carry in Refs."""
    jax.config.update("jax_scan3", True)
    try:
        yield
    finally:
        jax.config.update("jax_scan3", False)


def test_loops_under_jax_scan3(scan3):
    """call_hi_primitive is expanded into JAX's own primitives (as JAX does before lowering):
    the interpreter and our Triton lowering run a kernel's scan / fori_loop carries, an
    accumulator over an arbitrary grid axis included."""
    def kernel(x_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(1) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        block = x_ref[...]
        acc_ref[...] += lax.fori_loop(0, 3, lambda i, c: c + block * i.astype(jnp.float32),
                                      jnp.zeros_like(block))
        total = lax.scan(lambda c, _: (c * 0.5 + 1.0, None), 0.0, None, length=4)[0]

        @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
        def _():
            o_ref[...] = acc_ref[...] + total

    jaxpr = jax.make_jaxpr(lambda v: lax.fori_loop(0, 3, lambda i, c: c + v, v))(1.0)
    assert any(e.primitive.name == "call_hi_primitive" for e in jaxpr.jaxpr.eqns)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    call = lambda backend: pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2, 2),
        in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
        out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
        scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)], backend=backend)(x)
    total = 0.0
    for _ in range(4):
        total = total * 0.5 + 1.0
    expected = 3 * (x[:, :128] + x[:, 128:]) + total
    for backend in ("interpret", "triton"):
        np.testing.assert_allclose(call(backend), expected, rtol=1e-6, atol=1e-6, err_msg=backend)


def test_a_ref_made_in_the_kernel_accessed_in_part_raises(scan3):
    def kernel(x_ref, o_ref):
        ref = jax.new_ref(x_ref[...])
        ref[0:1, :] = jnp.zeros((1, 128), jnp.float32)
        o_ref[...] = ref[...]

    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="a Ref made inside kernel kernel .* other than whole"):
        pl.triton.source(lambda x: pl.pallas_call(kernel, out_shape=x, backend="triton")(x), x)


def test_closing_a_jaxpr_in_either_form():
    """JAX 0.11 attaches consts with Jaxpr.with_consts (ClosedJaxpr(jaxpr, consts) is kept
    there only as a legacy spelling); 0.10.2 has only ClosedJaxpr."""
    closed = jax.make_jaxpr(lambda v: v * np.arange(3.0, dtype=np.float32))(np.ones(3, np.float32))
    again = _jax_internals.close(closed.jaxpr, closed.consts)
    np.testing.assert_array_equal(_jax_internals.eval_jaxpr(again, np.ones(3, np.float32))[0], [0, 1, 2])
    assert _jax_internals.as_closed(closed) is closed
    opened = _jax_internals.as_closed(jax.make_jaxpr(lambda v: v + 1)(1.0).jaxpr)  # open in 0.10.2
    assert list(opened.consts) == [] and _jax_internals.eval_jaxpr(opened, 1.0)[0] == 2.0


def test_buffered_takes_prefetched_count_at_its_default():
    """JAX after 0.11.0 adds Buffered(prefetched_count=), meaningful only to emit_pipeline."""
    assert pl.Buffered(2, prefetched_count=0) == pl.Buffered(2)
    with pytest.raises(NotImplementedError, match=r"prefetched_count=1\).*emit_pipeline"):
        pl.Buffered(3, prefetched_count=1)
    for bad in (-1, 1.0, True):
        with pytest.raises(TypeError, match="prefetched_count"):
            pl.Buffered(2, prefetched_count=bad)


def test_pltriton_names_of_later_jax():
    """GPU introspection JAX's pallas.triton gained after 0.11.0: JAX's own where this JAX
    has it, else an AttributeError naming it and the JAX version."""
    from jax.experimental.pallas import triton as jax_pltriton

    names = ("GpuInfo", "GpuVersion", "get_gpu_info", "get_gpu_info_from_version", "is_gpu_device",
             "CUSTOM_CALL_TARGET_NAME")
    for name in names:
        if hasattr(jax_pltriton, name):
            assert getattr(pl.triton, name) is getattr(jax_pltriton, name)
        else:
            with pytest.raises(AttributeError, match=rf"pallas_core\.triton\.{name} .*JAX {jax.__version__}"):
                getattr(pl.triton, name)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        pl.triton.not_a_name


# ---- The verified range (pallas_core._versions) ----------------------------------------

def test_versions_in_and_out_of_the_verified_range():
    from pallas_core import _versions

    for version in ("0.10.2", "0.11.0", "0.11.1.dev20260808", "0.11.2", "0.11.9"):
        assert _versions.is_verified(version), version
    for version in ("0.10.1", "0.9.2", "0.12.0", "0.12.0.1", "1.0"):
        assert not _versions.is_verified(version), version
    assert _versions.is_verified(jax.__version__)  # the JAX the tests run on
    with pytest.raises(ValueError, match="version"):
        _versions.version_tuple("main")


def test_a_jax_outside_the_range_warns_once_naming_the_range(monkeypatch):
    import warnings

    from pallas_core import _versions

    monkeypatch.setattr(_versions, "_warned", False)
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    with pytest.warns(_versions.JaxVersionWarning,
                      match=r"verified with JAX 0\.10\.2 up to \(not including\) 0\.12; this is JAX 0\.12\.0\.1"):
        assert not _versions.check_jax_version()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _versions.check_jax_version()  # once per process
    monkeypatch.setattr(_versions, "_warned", False)
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _versions.check_jax_version()


def test_importing_pallas_core_under_a_newer_jax_warns():
    import subprocess
    import sys

    code = "import jax; jax.__version__ = '0.12.0'; import pallas_core"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stderr.count("JaxVersionWarning") == 1, run.stderr
    assert "JAX 0.10.2 up to (not including) 0.12; this is JAX 0.12.0" in run.stderr


def test_the_dependency_has_the_range_floor_and_no_ceiling():
    """pyproject asks for jax>=<floor>: never a ceiling that would downgrade a newer JAX."""
    from pallas_core import _versions

    text = (REPO / "pyproject.toml").read_text()
    pins = re.findall(r'"jax(?:\[\w+\])?([<>=!~][^"]*)"', text)
    assert pins, "no jax dependency found"
    for pin in pins:
        assert pin == f">={_versions.VERIFIED_JAX[0]}", pin
