"""What a Mosaic GPU kernel lowers to for ``cuda``, read on any host: :func:`mosaic_modules`.

JAX's Mosaic GPU lowering runs in Python: it turns the kernel into an MLIR
module of the ``gpu``, ``nvvm``, ``llvm`` and ``mosaic_gpu`` dialects
(``wgmma`` as ``nvvm.wgmma.*``, TMA copies as
``nvvm.cp.async.bulk.tensor.*``, barriers as ``nvvm.mbarrier.*``, register
reallocation as ``nvvm.setmaxregister``), serializes it into the
``mosaic_gpu_v2`` custom call, and leaves the rest (LLVM, PTX, ``ptxas``) to
jaxlib's CUDA plugin when the program is compiled on a GPU. On a host
without the plugin, the lowering is the furthest a kernel goes: it checks
everything the Python lowering checks (TMA box shapes and strides against
swizzles and tilings, register layouts, ``wgmma`` operand shapes and dtypes,
SMEM use) and targets sm_90 (JAX's default when no GPU says otherwise).
:func:`mosaic_modules` reads the modules back, so tests can also check what
was emitted.
"""
from __future__ import annotations

import jax

TARGET = "mosaic_gpu_v2"


def _custom_calls(op, found):
    for region in op.regions:
        for block in region:
            for inner in block:
                if inner.operation.name == "stablehlo.custom_call":
                    found.append(inner.operation)
                _custom_calls(inner.operation, found)


def mosaic_modules(fn, *args, **kwargs) -> list[str]:
    """The Mosaic GPU modules ``fn(*args)`` lowers to for ``cuda``, as MLIR text.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct``\\ s. On a host without a
    GPU, pallas_core's Mosaic GPU calls run interpreted but lower for ``cuda``
    as JAX's Mosaic GPU kernels (:mod:`pallas_core.gpu.target`), which is what
    is read here.

    Raises:
      whatever JAX's Mosaic GPU lowering raises for the kernel.
    """
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir, passmanager
    from jax.experimental.mosaic import gpu as mgpu
    lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    calls: list = []
    _custom_calls(lowered.compiler_ir("stablehlo").operation, calls)
    texts = []
    for call in calls:
        if ir.StringAttr(call.attributes["call_target_name"]).value != TARGET:
            continue
        blob = bytes(ir.StringAttr(call.attributes["mhlo.backend_config"]["module"]).value_bytes)
        context = mlir.make_ir_context()
        with context, ir.Location.unknown():
            mgpu.dialect.register_dialect(context)
            context.allow_unregistered_dialects = True
            module = ir.Module.parse(blob)
            passmanager.PassManager.parse(
                "builtin.module(mosaic_gpu-serde{serialize=false})", context).run(module.operation)
            module.operation.verify()
            texts.append(str(module))
    return texts
