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
from pallas_core.triton import jit_helpers

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
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    filename = f"<pallas_core triton {name} {digest} {mode}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(f"pallas_core_generated_{name}_{digest}")
    module.__file__ = filename
    module.jit = decorator
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    if mode == "interpret" and hasattr(module, jit_helpers.INTERPRETED):
        import triton.language as tl
        setattr(module, jit_helpers.INTERPRETED, tl.constexpr(True))  # helpers skip their PTX
    return getattr(module, name)


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
    not assume it zero.
    """
    if on_gpu:
        if "tl.make_tensor_descriptor(" in kernel_source:
            raise NotImplementedError(
                f"triton backend: kernel {name} was generated with CompilerParams(tma=True); its "
                "tensor descriptors are made in the kernel and need Triton's global scratch "
                "buffer, which jax_triton 0.3.1 does not allocate at launch. Use tma=False (the "
                "default) to run it; tma=True is for ahead-of-time compiles "
                "(pallas_core.triton.compile) and Triton's interpreter.")
        jt = import_jax_triton()
        kernel = load(kernel_source, name, "jit")
        # name: jax_triton's default is "", which leaves the kernel call unnamed in
        # its serialised form (what profiles and error messages show).
        return jt.triton_call(*args, kernel=kernel, out_shape=list(out_avals), grid=grid,
                              name=name, num_warps=num_warps, num_stages=num_stages,
                              input_output_aliases=dict(aliases), **constexprs)
    kernel = load(kernel_source, name, "interpret")
    run = functools.partial(launch_interpreted, kernel, grid=grid, out_avals=out_avals,
                            aliases=aliases, constexprs=constexprs)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    return jax.pure_callback(lambda *a: run(args=a), shapes, *args, vmap_method="sequential")
