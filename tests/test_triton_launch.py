"""The CUDA launch path of ``backend="triton"``, lowered for CUDA on a host without a GPU.

On CUDA, :func:`pallas_core.triton.runtime.launch` hands the generated kernel
to ``jax_triton.triton_call``, whose CUDA lowering rule compiles it with
Triton for a compute capability (AST -> TTIR -> TTGIR -> LLIR -> PTX, all in
Python) and emits a ``stablehlo.custom_call @triton_kernel_call``. Only the
last step needs jaxlib's CUDA plugin (``jax._src.lib.gpu_triton``: the
device's compute capability and the C++ kernel-call objects serialised into
the custom call's ``backend_config``).

These tests lower jitted functions with ``lowering_platforms=("cuda",)``
through our real launch path and jax_triton's real lowering rule, with only
that C++ boundary replaced by :class:`FakeKernelCallLib`, which records what
would be launched: the compiled kernel (name, warps, shared memory, PTX,
compute capability), its grid and its parameters. What stays unchecked is
the C++ launch itself and the numbers the GPU computes (each op battery's
``test_on_gpu``, ``pytest -m gpu``).
"""
import dataclasses
import hashlib
import importlib.util
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ops
import pallas_core as pl
from pallas_core.triton import backend, runtime

pytest.importorskip("triton")
if importlib.util.find_spec("jax_triton") is None:
    pytest.skip("jax_triton is not installed", allow_module_level=True)


def _import_jax_triton():
    """Imports jax_triton, also where jaxlib has no CUDA plugin.

    ``jax_triton/__init__.py`` refuses to import unless ``gpu_triton`` offers
    ``get_compute_capability`` and ``get_serialized_metadata``; on a CPU-only
    jaxlib they are missing, so placeholders stand in for the import only.
    """
    from jax._src.lib import gpu_triton

    missing = [n for n in ("get_compute_capability", "get_serialized_metadata")
               if not hasattr(gpu_triton, n)]

    def unavailable(*args, **kwargs):
        raise RuntimeError("jaxlib has no CUDA plugin on this host")

    for n in missing:
        setattr(gpu_triton, n, unavailable)
    try:
        runtime.import_jax_triton()  # registers the triton_kernel_call lowering rules
        from jax_triton import triton_lib
    finally:
        for n in missing:
            delattr(gpu_triton, n)
    return triton_lib


triton_lib = _import_jax_triton()

CUDA_CAPABILITY = 90  # what the fake reports for "device 0": an H100


@dataclasses.dataclass
class Kernel:
    name: str
    num_warps: int
    num_ctas: int
    shared_mem_bytes: int
    ptx: str
    ttir: str
    compute_capability: int


@dataclasses.dataclass
class Param:
    kind: str  # "array" or "scalar"
    value: object  # arrays: (bytes zeroed before the launch, alignment); scalars: (value, type)


@dataclasses.dataclass
class Launch:
    kernel: Kernel
    grid: tuple[int, int, int]
    params: list[Param]
    proto_name: str | None = None


class FakeKernelCallLib:
    """Stands in for ``jax._src.lib.gpu_triton`` (jaxlib's C++ Triton helpers); records."""

    def __init__(self):
        self.kernels: list[Kernel] = []  # one per compile (jax_triton caches the rest)
        self.launches: list[Launch] = []  # one per custom call lowered
        self.requests: list[dict] = []  # filled by the `cuda` fixture
        self.metadata: list[dict] = []  # Triton's metadata, one per compile; ditto

    def get_compute_capability(self, device):
        assert device == 0
        return CUDA_CAPABILITY

    def TritonKernel(self, name, num_warps, num_ctas, shared_mem_bytes, binary, ttir,  # noqa: N802
                     compute_capability):
        kernel = Kernel(name, num_warps, num_ctas, shared_mem_bytes, binary, ttir, compute_capability)
        self.kernels.append(kernel)
        return kernel

    def create_array_parameter(self, zeroed_bytes, alignment):
        return Param("array", (zeroed_bytes, alignment))

    def create_scalar_parameter(self, value, dtype):
        return Param("scalar", (value, dtype))

    def TritonKernelCall(self, kernel, grid_x, grid_y, grid_z, params):  # noqa: N802
        launch = Launch(kernel, (grid_x, grid_y, grid_z), list(params))
        self.launches.append(launch)
        return _FakeCall(launch)


class _FakeCall:
    def __init__(self, launch):
        self.launch = launch

    def to_proto(self, name, serialized_metadata):
        self.launch.proto_name = name
        return f"fake-kernel-call:{self.launch.kernel.name}".encode()


@pytest.fixture
def cuda(monkeypatch):
    """Our CUDA launch path and jax_triton's lowering, with the C++ boundary faked."""
    from triton.backends.nvidia import compiler as nvidia

    fake = FakeKernelCallLib()
    real_get_or_create = triton_lib.get_or_create_triton_kernel
    real_make_ptx = nvidia.CUDABackend.make_ptx

    def get_or_create(*args, **kwargs):  # every kernel asked of jax_triton, cached or not
        fake.requests.append(dict(arg_types=list(args[3]), num_warps=kwargs["num_warps"],
                                  num_stages=kwargs["num_stages"],
                                  compute_capability=kwargs["compute_capability"]))
        return real_get_or_create(*args, **kwargs)

    def make_ptx(self, src, metadata, options, capability):  # Triton's metadata of each compile
        ptx = real_make_ptx(self, src, metadata, options, capability)
        fake.metadata.append(dict(metadata))
        return ptx

    monkeypatch.setattr(triton_lib, "triton_kernel_call_lib", fake)
    monkeypatch.setattr(triton_lib, "_COMPILED_KERNEL_CACHE", {})
    monkeypatch.setattr(triton_lib, "get_or_create_triton_kernel", get_or_create)
    monkeypatch.setattr(nvidia.CUDABackend, "make_ptx", make_ptx)
    monkeypatch.setattr(backend, "_on_gpu", lambda: True)
    # Traces made with the interpreter's launch must not be reused here, nor
    # ours (custom calls only CUDA can lower) by later tests.
    jax.clear_caches()
    yield fake
    jax.clear_caches()


def lower_for_cuda(f, *args):
    """``(module text, records of the triton kernels traced)`` of ``jax.jit(f)`` lowered for CUDA."""
    with backend.capturing() as records:
        traced = jax.jit(f).trace(*args)
    lowered = traced.lower(lowering_platforms=("cuda",))
    return lowered.as_text(), records


def custom_calls(text):
    return [line for line in text.splitlines() if "stablehlo.custom_call @triton_kernel_call(" in line]


def jit_pointer_params(record):
    """The kernel's runtime (non-constexpr) parameters, as Triton's JIT sees them."""
    fn = runtime.load(record["source"], record["name"], "jit")
    return [p.name for p in fn.params if not p.is_constexpr]


def source_digest(source):
    return hashlib.sha1(source.encode()).hexdigest()[:12]


def digest_of(kernel):
    """The digest of the generated source a compiled kernel came from.

    :func:`runtime.load` names each source ``<pallas_core triton NAME DIGEST jit>``;
    Triton keeps that file name in the kernel's debug locations.
    """
    (digest,) = set(re.findall(rf"<pallas_core triton {kernel.name} ([0-9a-f]{{12}}) jit>", kernel.ttir))
    return digest


def ptx_entry_params(kernel) -> int:
    """How many parameters the PTX entry point of the kernel takes."""
    match = re.search(rf"\.entry {re.escape(kernel.name)}\((.*?)\)", kernel.ptx, re.S)
    assert match, f"no .entry {kernel.name} in the PTX"
    return match.group(1).count(".param ")


# jaxlib launches with the array/scalar parameters given, then two null pointers
# for the hidden parameters Triton appends (global scratch, profile scratch).
HIDDEN_PARAMS = 2
SM90_SHARED_BYTES = 232448  # opt-in shared memory per block on H100 / H200
MAX_GRID_X = 2**31 - 1


def check_launches(fake, text, records):
    """Every traced kernel became a custom call and a launch jaxlib can make.

    JAX lowers identical calls within one module once, so launches are
    matched with the traced kernels by source.
    """
    assert len(custom_calls(text)) == len(records)
    by_digest = {source_digest(r["source"]): r for r in records}
    assert {digest_of(l.kernel) for l in fake.launches} == set(by_digest)
    for r in records:
        # Only arrays are passed (no scalar parameters), in the kernel's order.
        assert r["params"] == jit_pointer_params(r)
    for launch in fake.launches:
        r = by_digest[digest_of(launch.kernel)]
        assert launch.kernel.name == r["name"]
        assert launch.grid == (*r["grid"], 1, 1) and 1 <= launch.grid[0] <= MAX_GRID_X
        assert len(launch.params) == len(r["params"])
        assert all(p.kind == "array" for p in launch.params)
        assert all(p.value == (0, 16) for p in launch.params)  # not zeroed; 16-byte aligned
        assert ptx_entry_params(launch.kernel) == len(launch.params) + HIDDEN_PARAMS
        assert launch.proto_name == launch.kernel.name
    assert len(fake.metadata) == len(fake.kernels)
    for k, meta in zip(fake.kernels, fake.metadata):
        assert meta["name"] == k.name  # the function jaxlib looks up in the module
        assert f".entry {k.name}(" in k.ptx
        assert k.compute_capability == CUDA_CAPABILITY
        assert f".target sm_{CUDA_CAPABILITY}" in k.ptx
        assert k.num_ctas == 1
        # jaxlib launches num_warps * 32 threads, with shared_mem_bytes of shared memory
        # and null global / profile scratch: the compiled kernel must agree.
        assert meta["num_warps"] == k.num_warps
        assert meta["shared"] == k.shared_mem_bytes <= SM90_SHARED_BYTES
        assert not meta["global_scratch_size"] and not meta["profile_scratch_size"]
        assert not meta["tmem_size"]


def _backend_configs(f, *args):
    from jax._src.interpreters import mlir

    module = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    configs = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and "backend_config" in op.attributes:
            configs.append(mlir.ir.StringAttr(op.attributes["backend_config"]).value_bytes)
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    for op in module.body.operations:
        visit(op)
    return configs


SPEC = pl.BlockSpec((8, 16), lambda i, j: (i, j))


def add_one_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...] + 1


def add_call(shape=(20, 40), dtype=jnp.float32, **kw):
    grid = (pl.cdiv(shape[0], 8), pl.cdiv(shape[1], 16))
    return pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(shape, dtype), grid=grid,
                          in_specs=[SPEC, SPEC], out_specs=SPEC, backend="triton", **kw)


def test_elementwise_kernel_with_edge_blocks(cuda):
    x = jax.ShapeDtypeStruct((20, 40), jnp.float32)  # 20 = 2*8 + 4, 40 = 2*16 + 8: edge blocks
    f = add_call(compiler_params=pl.triton.CompilerParams(num_warps=8, num_stages=2))
    text, records = lower_for_cuda(f, x, x)
    check_launches(cuda, text, records)
    (record,), (kernel,), (launch,) = records, cuda.kernels, cuda.launches
    assert record["grid"] == (9,)  # 3 x 3 parallel programs, flattened into axis 0
    assert launch.grid == (9, 1, 1)
    assert len(launch.params) == 3 == len(record["params"])  # x, y, out
    assert record["constexprs"]["A0_0"] == 20 and record["constexprs"]["B0_0"] == 8
    # num_warps / num_stages from CompilerParams reach Triton's compiler.
    (request,) = cuda.requests
    assert (request["num_warps"], request["num_stages"]) == (8, 2)
    assert request["compute_capability"] is None  # jax_triton asks the device
    assert request["arg_types"] == ["*fp32"] * 3
    assert kernel.num_warps == 8 and ".reqntid 256" in kernel.ptx  # 8 warps of 32 threads
    assert kernel.name == "add_one_kernel"
    (call,) = custom_calls(text)
    assert "(tensor<20x40xf32>, tensor<20x40xf32>) -> tensor<20x40xf32>" in call
    assert "output_operand_aliases" not in call
    # backend_config is the compressed kernel-call proto.
    config = _backend_configs(f, x, x)
    assert [zlib.decompress(c) for c in config] == [b"fake-kernel-call:add_one_kernel"]


def test_input_output_aliases(cuda):
    def kernel(x_ref, acc_ref, o_ref):
        o_ref[...] = acc_ref[...] + 2 * x_ref[...]

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    f = pl.pallas_call(kernel, out_shape=x, grid=(2, 2), in_specs=[SPEC, SPEC], out_specs=SPEC,
                       input_output_aliases={1: 0}, backend="triton")
    text, records = lower_for_cuda(f, x, x)
    check_launches(cuda, text, records)
    (call,) = custom_calls(text)
    assert "output_operand_aliases" in call
    assert "operand_index = 1" in call and "output_tuple_indices = []" in call


def test_bool_and_integer_arrays(cuda):
    def kernel(x_ref, m_ref, o_ref, pos_ref):
        x = x_ref[...]
        o_ref[...] = jnp.where(m_ref[...], x, 0)
        pos_ref[...] = x > 0

    x = jax.ShapeDtypeStruct((16, 32), jnp.int32)
    m = jax.ShapeDtypeStruct((16, 32), jnp.bool_)
    f = pl.pallas_call(kernel, out_shape=(x, m), grid=(2, 2), in_specs=[SPEC, SPEC],
                       out_specs=(SPEC, SPEC), backend="triton")
    text, records = lower_for_cuda(f, x, m)
    check_launches(cuda, text, records)
    (request,) = cuda.requests
    assert request["arg_types"] == ["*i32", "*i1", "*i32", "*i1"]


def test_scalar_operands_are_arrays(cuda):
    """Python and numpy scalars reach the kernel as 0-d arrays, never as scalar parameters."""
    def kernel(x_ref, a_ref, b_ref, o_ref):
        o_ref[...] = x_ref[...] * a_ref[...] + b_ref[...]

    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    f = lambda x: pl.pallas_call(kernel, out_shape=x, grid=(2, 2),
                                 in_specs=[SPEC, None, None],
                                 out_specs=SPEC, backend="triton")(x, np.float32(2.0), 3.0)
    text, records = lower_for_cuda(f, x)
    check_launches(cuda, text, records)
    (request,) = cuda.requests
    assert request["arg_types"] == ["*fp32"] * 4  # x, 2.0, 3.0, out: all pointers
    (call,) = custom_calls(text)
    assert "(tensor<16x32xf32>, tensor<f32>, tensor<f32>) -> tensor<16x32xf32>" in call


def matmul_call(m, n, k, bm=16, bn=16, bk=16, *, memory_scratch=False):
    def kernel(x_ref, y_ref, o_ref, acc_ref):
        @pl.when(pl.program_id(2) == 0)
        def _():
            acc_ref[...] = jnp.zeros_like(acc_ref)

        dot = lambda cols: jnp.dot(x_ref[...], y_ref[:, cols], preferred_element_type=jnp.float32)
        if memory_scratch:  # slices keep the accumulator in (global) memory
            half = bn // 2
            acc_ref[:, :half] += dot(slice(0, half))
            acc_ref[:, half:] += dot(slice(half, bn))
        else:  # read and written whole: a register accumulator
            acc_ref[...] += dot(slice(None))

        @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)

    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pl.tpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pl.CompilerParams(("parallel", "parallel", "arbitrary")), backend="triton")


@pytest.mark.parametrize("memory_scratch", [False, True], ids=["register_acc", "memory_acc"])
def test_scratch_and_arbitrary_grid_axis(cuda, memory_scratch):
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((64, 96), jnp.float32)
    f = matmul_call(32, 96, 64, bn=32, memory_scratch=memory_scratch)
    text, records = lower_for_cuda(f, x, y)
    check_launches(cuda, text, records)
    (record,), (launch,) = records, cuda.launches
    assert launch.grid == (2 * 3, 1, 1)  # the arbitrary (k) axis loops inside each program
    (call,) = custom_calls(text)
    if memory_scratch:
        # One private (16, 32) slice of scratch per program: an extra output, after the real one.
        assert record["params"] == ["p0", "p1", "p2", "s0"]
        assert "-> (tensor<32x96xf32>, tensor<3072xf32>)" in call
    else:
        assert record["params"] == ["p0", "p1", "p2"]
        assert "-> tensor<32x96xf32>" in call


def test_vmap_is_one_launch_with_a_bigger_grid(cuda):
    x = jax.ShapeDtypeStruct((4, 20, 40), jnp.float32)
    y = jax.ShapeDtypeStruct((20, 40), jnp.float32)
    text, records = lower_for_cuda(jax.vmap(add_call(), in_axes=(0, None)), x, y)
    (call,) = custom_calls(text)
    (launch,) = cuda.launches
    assert launch.grid == (4 * 9, 1, 1)
    # The batched operand is passed whole; the unbatched one is not broadcast.
    assert "(tensor<4x20x40xf32>, tensor<20x40xf32>) -> tensor<4x20x40xf32>" in call
    # custom_vmap also traces the unbatched call (for its output types); only the batched one is lowered.
    check_launches(cuda, text, [r for r in records if r["grid"] == (36,)])


def test_vmap_sizes_memory_scratch_by_the_batched_grid(cuda):
    x = jax.ShapeDtypeStruct((4, 32, 64), jnp.float32)
    y = jax.ShapeDtypeStruct((4, 64, 96), jnp.float32)
    text, records = lower_for_cuda(jax.vmap(matmul_call(32, 96, 64, bn=32, memory_scratch=True)), x, y)
    (call,) = custom_calls(text)
    (launch,) = cuda.launches
    assert launch.grid == (4 * 6, 1, 1)
    # One private (16, 32) accumulator per program of the batched launch.
    assert "-> (tensor<4x32x96xf32>, tensor<12288xf32>)" in call
    check_launches(cuda, text, [r for r in records if r["grid"] == (24,)])


def test_importing_jax_triton_keeps_tritons_cache_usable():
    """jax_triton's import empties TRITON_CACHE_DIR; ours undoes that, so triton.compile works."""
    runtime.import_jax_triton()
    assert os.environ.get("TRITON_CACHE_DIR") != ""
    x = jax.ShapeDtypeStruct((20, 40), jnp.float32)
    (report,) = pl.triton.compile(add_call(), x, x, target="sm_90")
    assert report["name"] == "add_one_kernel" and "cubin" in report["asm"]


def test_same_kernel_is_compiled_once(cuda):
    x = jax.ShapeDtypeStruct((20, 40), jnp.float32)
    hits = runtime.load.cache_info().hits
    text1, _ = lower_for_cuda(lambda a, b: add_call()(a, b), x, x)
    text2, _ = lower_for_cuda(lambda a, b: add_call()(add_call()(a, b), b), x, x)
    assert len(custom_calls(text1)) == 1 and len(custom_calls(text2)) == 2
    assert len(cuda.requests) == len(cuda.launches) >= 2  # at least one per module
    assert len(cuda.kernels) == 1  # jax_triton's compile cache, keyed by our cached JITFunction
    assert all(launch.kernel is cuda.kernels[0] for launch in cuda.launches)
    assert runtime.load.cache_info().hits >= hits + 2


# ---- ops ---------------------------------------------------------------------------------

def _fused_matmul(x, w, b):
    return ops.fused_matmul(x, w, b, activation="gelu_exact", implementation="triton",
                            block_sizes=(16, 32, 16))


def test_fused_matmul_forward(cuda):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(37, 50), (50, 70), (70,)]]
    text, records = lower_for_cuda(_fused_matmul, *args)
    check_launches(cuda, text, records)
    assert len(records) == 1


def test_fused_matmul_gradient(cuda):
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(37, 50), (50, 70), (70,)]]
    loss = lambda *a: jnp.sum(_fused_matmul(*a) ** 2)
    text, records = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), *args)
    check_launches(cuda, text, records)
    assert len(records) == 4  # forward (keeping the pre-activation), dz, dx, dw


F32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731

REDUCTIONS = {
    "layer_norm": (lambda x, s, b: ops.layer_norm(x, s, b, implementation="triton"),
                   [F32(6, 40), F32(40), F32(40)]),
    "rms_norm": (lambda x, s: ops.rms_norm(x, s, implementation="triton"), [F32(6, 40), F32(40)]),
    "softmax": (lambda x: ops.softmax(x, implementation="triton"), [F32(6, 40)]),
    "log_softmax": (lambda x: ops.log_softmax(x, implementation="triton"), [F32(6, 40)]),
    "logsumexp": (lambda x: ops.logsumexp(x, axis=-1, implementation="triton"), [F32(6, 40)]),
    "sum": (lambda x: ops.sum(x, axis=-1, implementation="triton"), [F32(6, 40)]),
    "mean": (lambda x: ops.mean(x, axis=0, implementation="triton"), [F32(6, 40)]),
    "max": (lambda x: ops.max(x, implementation="triton"), [F32(6, 40)]),
    "cross_entropy": (lambda x: ops.cross_entropy(x, jnp.arange(6) % 40, implementation="triton"),
                      [F32(6, 40)]),
    "linear_cross_entropy": (lambda x, w: ops.linear_cross_entropy(
        x, w, jnp.arange(6) % 40, implementation="triton"), [F32(6, 32), F32(32, 40)]),
}


@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_ops_forward_and_gradient(cuda, name):
    op, args = REDUCTIONS[name]
    loss = lambda *a: jnp.sum(op(*a))
    text, records = lower_for_cuda(jax.value_and_grad(loss, argnums=tuple(range(len(args)))), *args)
    check_launches(cuda, text, records)
    assert {r["name"] for r in records} == KERNELS.get(name, {f"{name}_fwd", f"{name}_bwd"})


# Kernels of ops other than "<op>_fwd" and "<op>_bwd". sum / mean / max differentiate in XLA.
KERNELS = {"sum": {"reduce_sum"}, "mean": {"reduce_sum"}, "max": {"reduce_max"},
           "linear_cross_entropy": {"linear_cross_entropy_fwd", "linear_cross_entropy_dz",
                                    "linear_cross_entropy_dx", "linear_cross_entropy_dw"}}


def test_shipped_fused_matmul_training_step(cuda):
    """Default tiles of a large bfloat16 matmul: the kernels fit an H100 as launched."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(4096, 4096), (4096, 8192), (8192,)]]
    loss = lambda *a: jnp.sum(ops.fused_matmul(*a, activation="gelu_exact",
                                               implementation="triton").astype(jnp.float32))
    text, records = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), *args)
    check_launches(cuda, text, records)
    assert len(records) == 4
    # The element-wise dz kernel runs at twice the matmuls' warps (16: no spills on sm_90).
    assert all(k.num_warps in (4, 8, 16) for k in cuda.kernels)


def test_paged_attention_launch(cuda):
    """Split-KV paged decode on multi-page key tiles (the query-blocked kernel, 16-token
    pages) and its merge: the page table and ranges are pointer parameters like any array."""
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 32, 16, 64), jnp.bfloat16)
    f = lambda *a: ops.paged_attention(*a, implementation="triton", block_sizes=(2, 2))
    text, records = lower_for_cuda(f, sds((2, 8, 64), jnp.bfloat16), cache, cache,
                                   sds((2, 8), jnp.int32), sds((2,), jnp.int32))
    check_launches(cuda, text, records)
    assert {r["name"] for r in records} == {"query_blocked_paged_attention", "query_blocked_paged_merge"}


def test_update_kv_pages_launch_aliases_the_cache(cuda):
    sds = jax.ShapeDtypeStruct
    new = sds((4, 2, 64), jnp.bfloat16)
    f = lambda *a: ops.update_kv_pages(*a, implementation="triton")
    text, records = lower_for_cuda(f, sds((32, 16, 4, 64), jnp.bfloat16), new, new,
                                   sds((4,), jnp.int32))
    check_launches(cuda, text, records)
    (call,) = custom_calls(text)
    assert "output_operand_aliases" in call  # written in place: no copy of the cache
