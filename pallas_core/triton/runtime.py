"""Loading generated Triton source and launching it.

* On CUDA: ``triton.jit`` compiles the source and ``jax_triton.triton_call``
  launches it from JAX (imported lazily: it only imports where jaxlib has GPU
  support).
* Anywhere else: the same source runs in Triton's interpreter, with torch CPU
  tensors as the bridge, inside ``jax.pure_callback`` so it works under
  ``jit`` and ``vmap``. That is how CI checks the code generator without a GPU.

Triton's JIT reads a function's source: each generated module is registered
in ``linecache`` under a unique file name before it is executed. Loaded
kernels are cached by (source, mode).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import linecache
import os
import threading
import types

import jax
import numpy as np

from pallas_core.memory import garbage_fill_value
from pallas_core.triton import descriptors, global_scratch, jit_helpers

_POINTER_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "float64": "*fp64",
                  "int8": "*i8", "int16": "*i16", "int32": "*i32", "int64": "*i64",
                  "uint8": "*u8", "uint16": "*u16", "uint32": "*u32", "uint64": "*u64",
                  "bool": "*i1"}


@functools.lru_cache(maxsize=512)
def load(source: str, name: str, mode: str):
    """The kernel ``name`` of ``source`` as a Triton function.

    Args:
      mode: "jit" (``triton.jit``: GPU launches and ahead-of-time compiles) or
        "interpret" (Triton's CPU interpreter).
    """
    import triton
    if mode == "jit":
        decorator = triton.jit
    else:
        from triton.runtime.interpreter import InterpretedFunction
        decorator = InterpretedFunction
    filename = file_name(source, name, mode)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"pallas_core_generated_{name}_{_digest(source)}")
    module.__file__ = filename
    module.jit = decorator
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    if mode == "interpret" and hasattr(module, jit_helpers.INTERPRETED):
        import triton.language as tl
        setattr(module, jit_helpers.INTERPRETED, tl.constexpr(True))  # helpers skip their PTX
    return getattr(module, name)


def _digest(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()[:12]


def file_name(source: str, name: str, mode: str) -> str:
    """The file name :func:`load` registers ``source`` under; Triton keeps it in the
    debug locations of what it compiles."""
    return f"<pallas_core triton {name} {_digest(source)} {mode}>"


def compile_kernel(source: str, name: str, pointer_dtypes, constexprs, *, num_warps: int,
                   num_stages: int, capability: int):
    """Triton's ahead-of-time compile (``triton.compile``) of kernel ``name`` for ``sm_<capability>``.

    Like ``jax_triton`` at launch: every pointer parameter (the first
    ``len(pointer_dtypes)``) 16-byte aligned (XLA's buffers are), which lets
    Triton vectorise loads and pipeline them with ``cp.async``.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = load(source, name, "jit")
    pointers = kernel.arg_names[:len(pointer_dtypes)]
    signature = {p: pointer_type(d) for p, d in zip(pointers, pointer_dtypes)}
    signature.update({c: "constexpr" for c in constexprs})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers))}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=dict(constexprs), attrs=aligned),
                          target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


@functools.lru_cache(maxsize=256)
def _scratch_requirement(source, name, pointer_dtypes, constexprs, num_warps, num_stages, capability):
    compiled = compile_kernel(source, name, pointer_dtypes, dict(constexprs), num_warps=num_warps,
                              num_stages=num_stages, capability=capability)
    return global_scratch.requirement(compiled.metadata._asdict())


def pointer_type(dtype) -> str:
    return _POINTER_TYPES[np.dtype(dtype).name]


def _to_torch(array):
    import torch
    array = np.array(array, order="C", copy=True)  # keeps rank 0, unlike ascontiguousarray
    if array.dtype.name == "bfloat16":  # torch has bfloat16 but numpy's comes from ml_dtypes
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _from_torch(tensor, dtype):
    import torch
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return tensor.view(torch.int16).numpy().view(dtype)
    return tensor.numpy().astype(dtype, copy=False)


# Triton's interpreter is process-global: a launch patches triton.language's
# functions for its duration (and puts them back at the end) and keeps the
# current program id in one shared builder. XLA's CPU runtime may run
# independent callbacks (two kernels of one jitted step) on different threads
# at once; overlapping launches would then see each other's program ids or
# unpatched functions ("Did you forget to add @triton.jit ?"). One at a time.
_INTERPRETER_LOCK = threading.RLock()


def launch_interpreted(kernel, *, grid, args, out_avals, aliases, constexprs):
    """Runs an interpreted kernel on numpy inputs; returns numpy outputs."""
    import torch  # noqa: F401 - the interpreter's tensor bridge

    from pallas_core.triton import interpreter_fixes
    interpreter_fixes.apply()
    _skip_dead_overflow_checks()
    ins = [_to_torch(np.asarray(a)) for a in args]
    outs = []
    for o, aval in enumerate(out_avals):
        aliased = [i for i, oo in aliases.items() if oo == o]
        if aliased:
            outs.append(ins[aliased[0]].clone())
        else:
            fill = garbage_fill_value(aval.dtype)
            outs.append(_to_torch(np.full(aval.shape, fill, aval.dtype)))
    with _INTERPRETER_LOCK:
        kernel[grid](*ins, *outs, **constexprs)
    return [_from_torch(t, aval.dtype).reshape(aval.shape) for t, aval in zip(outs, out_avals)]


def _skip_dead_overflow_checks() -> None:
    """Turns off the interpreter's integer-overflow sanitizer while its asserts are off.

    With ``sanitize_overflow`` (Triton's default) every integer ``+``, ``-`` and
    ``*`` (our index and address arithmetic) is redone in int64 and compared
    with the type's range, and the result goes to ``device_assert``, which does
    nothing unless the builder's ``debug`` option is set, and the interpreter
    never sets it. On a GPU the compiler drops that dead code; the interpreter
    runs it through Triton's Python front end, op by op: it was half the time of
    a matmul kernel. Results are unchanged; with ``debug`` on, nothing is
    touched.
    """
    from triton.runtime.interpreter import interpreter_builder
    options = interpreter_builder.options
    if options.sanitize_overflow and not options.debug:
        interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


def import_jax_triton():
    """``jax_triton``, imported without breaking Triton's own compiles in this process.

    Importing jax_triton sets ``TRITON_CACHE_DIR=""``. Its lowering never uses
    Triton's cache, but every later ``triton.compile`` in the process (our
    :func:`pallas_core.triton.compile`, anyone's ``@triton.jit`` kernels)
    then fails with "Could not create or locate cache dir". An empty value is
    never usable, so it is put back as it was (or removed).
    """
    before = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    except ImportError as e:
        raise ImportError(
            f"backend='triton' launches kernels on a GPU through jax_triton, which could not "
            f"be imported ({e}): pip install 'pallas-kernels[gpu]' (or jax-triton==0.3.1), or pass "
            "backend='pallas_triton' / implementation='pallas_triton'.") from e
    if os.environ.get("TRITON_CACHE_DIR") == "":
        if before:
            os.environ["TRITON_CACHE_DIR"] = before
        else:
            del os.environ["TRITON_CACHE_DIR"]
    return jax_triton


def launch(kernel_source, name, *, grid, args, out_avals, aliases, constexprs,
           num_warps, num_stages, on_gpu):
    """Launches a generated kernel from JAX; returns the outputs.

    Outputs start as garbage (uninitialised memory on a GPU; NaN / the integer
    minimum on the interpreter), except aliased ones, which start as their
    input. So does scratch kept in memory (the trailing outputs): kernels must
    not assume it zero. On a GPU, a kernel with tensor descriptors made in the
    kernel (``tma``) that needs Triton's global scratch gets it as one more
    output, not returned (:func:`_launch_with_global_scratch`).
    """
    if on_gpu:
        jt = import_jax_triton()
        call = functools.partial(jt.triton_call, name=name, num_warps=num_warps, num_stages=num_stages,
                                 input_output_aliases=dict(aliases), grid=grid, **constexprs)
        if descriptors.MAKE in kernel_source:
            return _launch_with_global_scratch(jt, call, kernel_source, name, args=args, out_avals=out_avals,
                                               constexprs=constexprs, num_warps=num_warps,
                                               num_stages=num_stages, programs=int(np.prod(grid)))
        # name: jax_triton's default is "", which leaves the kernel call unnamed in
        # its serialised form (what profiles and error messages show).
        return call(*args, kernel=load(kernel_source, name, "jit"), out_shape=list(out_avals))
    kernel = load(kernel_source, name, "interpret")
    run = functools.partial(launch_interpreted, kernel, grid=grid, out_avals=out_avals,
                            aliases=aliases, constexprs=constexprs)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    return jax.pure_callback(lambda *a: run(args=a), shapes, *args, vmap_method="sequential")


def _launch_with_global_scratch(jt, call, source, name, *, args, out_avals, constexprs, num_warps,
                                num_stages, programs):
    """Launches a kernel with in-kernel tensor descriptors through ``jax_triton``.

    Triton's compile for the device (its compute capability, as jax_triton
    asks it) says how much global scratch the kernel needs per program; that
    many bytes for every program become a trailing ``uint8`` output, passed
    to one more declared parameter, which the compiled PTX reads instead of
    the hidden parameter jaxlib leaves null (:mod:`pallas_core.triton.global_scratch`).
    The result is dropped. A kernel that needs none (before sm_90 Triton
    rewrites descriptors into pointer accesses) launches as it is.
    """
    capability = jt.triton_lib.triton_kernel_call_lib.get_compute_capability(0)
    pointer_dtypes = tuple(np.dtype(a.dtype).name for a in (*args, *out_avals))
    scratch = _scratch_requirement(source, name, pointer_dtypes, tuple(sorted(constexprs.items())),
                                   num_warps, num_stages, capability)
    if scratch is None:
        return call(*args, kernel=load(source, name, "jit"), out_shape=list(out_avals))
    source = global_scratch.with_parameter(source, name, len(pointer_dtypes))
    global_scratch.expect(file_name(source, name, "jit"), scratch, declared=len(pointer_dtypes) + 1)
    global_scratch.install(jt.triton_lib)
    buffer = jax.ShapeDtypeStruct((scratch.size(programs),), np.uint8)
    outs = call(*args, kernel=load(source, name, "jit"), out_shape=[*out_avals, buffer])
    return list(outs)[:-1]
