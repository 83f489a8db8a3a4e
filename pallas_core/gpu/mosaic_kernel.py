"""``pallas_core.gpu.kernel``: a Mosaic GPU warpgroup kernel (JAX 0.10.2's ``plgpu.kernel``).

The kernel body gets one GMEM Ref per operand, one per output, then its
scratch (SMEM buffers, barriers, accumulators: allocated once per block,
shared by its warpgroups), and runs once per warpgroup (``num_threads`` of
them, indexed by ``lax.axis_index(thread_name)``) of every block of
``grid`` (``lax.axis_index(grid_names[i])``, or ``pl.program_id(i)``) and of
its ``cluster``. It moves data itself: TMA copies GMEM <-> SMEM, mbarriers,
``wgmma`` into register accumulators, usually through
:func:`pallas_core.gpu.emit_pipeline_warp_specialized` (a producer warpgroup
feeding compute warpgroups).

What is ours: every argument is checked when the kernel is made (a
``TypeError`` / ``ValueError`` naming it), the operands when it is called,
both before anything is traced; where it runs is chosen then too
(:mod:`pallas_core.gpu.target`: JAX's Mosaic GPU lowering on an sm_90+ GPU,
``NotImplementedError`` on an older one, JAX's GPU interpret mode with race
detection, failing on a race, on a host without a GPU, where the same call
still lowers for ``cuda``); and pallas_core's backend-neutral names work in
the body (:mod:`pallas_core.gpu.kernel_context`). The body itself is traced
and lowered (or interpreted) by JAX.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pallas_core import context
from pallas_core.gpu import memory, params as gpu_params, runner, target
from pallas_core.gpu.kernel_context import MosaicGPUContext
from pallas_core.signatures import function_source

_MAX_WARPGROUPS = 2048 // 128  # 2048 threads per block (CUDA), 128 per warpgroup


class _NotGiven:
    def __repr__(self):
        return "<not given>"


_NOT_GIVEN = _NotGiven()


def kernel(body: Callable | _NotGiven = _NOT_GIVEN, out_shape: Any = _NOT_GIVEN, *,
           out_type: Any = _NOT_GIVEN, scratch_types: Any = _NOT_GIVEN,
           scratch_shapes: Any = _NOT_GIVEN, compiler_params=None, grid: Sequence[int] = (),
           grid_names: Sequence[str] = (), cluster: Sequence[int] = (),
           cluster_names: Sequence[str] = (), num_threads: int | None = None,
           thread_name: str | None = None, interpret: Any = None,
           kernel_name: str | None = None):
    """A Mosaic GPU kernel over a grid of blocks of warpgroups (``plgpu.kernel``).

    Args:
      body: ``body(*operand_refs, *output_refs, *scratch_refs)`` (scratch given
        as a dict is passed by keyword); returns None. Omitted: returns a
        decorator.
      out_shape / out_type: the outputs, a pytree of ``jax.ShapeDtypeStruct``
        (one of the two; JAX 0.10.2 calls it ``out_type``, ``out_shape`` the
        older name). A single struct gives a single output.
      scratch_shapes / scratch_types: a sequence or dict (pytrees allowed) of
        ``pallas_core.gpu.SMEM(shape, dtype, transforms=...)``, ``GMEM(...)``,
        ``ACC(...)``, ``Barrier(...)``, ``ClusterBarrier(...)``, JAX's own
        types, or None.
      compiler_params: ``pallas_core.gpu.CompilerParams`` or JAX's.
      grid, grid_names: the blocks (CUDA grid) and their axis names, one name
        per dim.
      cluster, cluster_names: blocks per cluster (at most 3 dims) and names.
      num_threads, thread_name: warpgroups per block (128 CUDA threads each,
        at most 16) and their axis name; both or neither.
      interpret: None (by the device), True / ``InterpretGPUParams`` (JAX's
        GPU interpret mode, races detected by default), False (JAX's Mosaic GPU
        lowering). See :mod:`pallas_core.gpu.target`.
      kernel_name: the kernel's name (default: the body's).

    Returns:
      ``f(*operands)``: the outputs (a pytree like ``out_type``).

    Raises:
      TypeError / ValueError: a bad argument, named, when the kernel is made
        or (operands) called.
      NotImplementedError: when called with the default device a GPU older than
        sm_90 (or not CUDA).
      RaceError: in the interpret mode, a data race (inside ``jit``: JAX's
        ``JaxRuntimeError`` carrying ``pallas_core.gpu.RaceError``).
    """
    if body is _NOT_GIVEN:
        return lambda fn: kernel(fn, out_shape, out_type=out_type, scratch_types=scratch_types,
                                 scratch_shapes=scratch_shapes, compiler_params=compiler_params,
                                 grid=grid, grid_names=grid_names, cluster=cluster,
                                 cluster_names=cluster_names, num_threads=num_threads,
                                 thread_name=thread_name, interpret=interpret,
                                 kernel_name=kernel_name)
    if not callable(body):
        raise TypeError(f"kernel: body must be a function of Refs, got {body!r}.")
    spec = _KernelSpec.make(body, out_shape, out_type, scratch_types, scratch_shapes,
                            compiler_params, grid, grid_names, cluster, cluster_names,
                            num_threads, thread_name, interpret, kernel_name)
    return functools.wraps(body)(functools.partial(_call, spec))


class _KernelSpec:
    """Everything :func:`kernel` was given, checked."""

    @classmethod
    def make(cls, body, out_shape, out_type, scratch_types, scratch_shapes, compiler_params, grid,
             grid_names, cluster, cluster_names, num_threads, thread_name, interpret, kernel_name):
        self = cls()
        self.body = body
        self.name = kernel_name if kernel_name is not None else getattr(body, "__name__", "kernel")
        if not isinstance(self.name, str):
            raise TypeError(f"kernel: kernel_name must be a str, got {kernel_name!r}.")
        self.out_type, self.single_output = _outputs(out_shape, out_type)
        self.scratch = _scratch(scratch_shapes, scratch_types)
        self.jax_params = gpu_params.for_kernel(compiler_params)
        self.grid, self.grid_names = _axes(grid, grid_names, "grid", None)
        self.cluster, self.cluster_names = _axes(cluster, cluster_names, "cluster", 3)
        if (num_threads is None) != (thread_name is None):
            raise ValueError("kernel: give num_threads and thread_name together (the warpgroups "
                             f"and their axis name), got num_threads={num_threads!r}, "
                             f"thread_name={thread_name!r}.")
        if num_threads is not None:
            if (isinstance(num_threads, bool) or not isinstance(num_threads, (int, np.integer))
                    or not 1 <= num_threads <= _MAX_WARPGROUPS):
                raise ValueError(f"kernel: num_threads must be an int in [1, {_MAX_WARPGROUPS}] "
                                 f"(warpgroups of 128 threads per block), got {num_threads!r}.")
            if not isinstance(thread_name, str):
                raise TypeError(f"kernel: thread_name must be a str, got {thread_name!r}.")
        self.num_threads, self.thread_name = num_threads, thread_name
        names = [*self.grid_names, *self.cluster_names] + ([thread_name] if thread_name else [])
        if len(set(names)) != len(names):
            raise ValueError(f"kernel: grid_names, cluster_names and thread_name must be distinct, "
                             f"got {names}.")
        if interpret is not None and not isinstance(interpret, bool):
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
            if not isinstance(interpret, InterpretGPUParams):
                raise TypeError(f"kernel: interpret must be None, a bool or an InterpretGPUParams, "
                                f"got {interpret!r}.")
        self.interpret = interpret
        if isinstance(self.scratch, Sequence):
            _check_arity(body, None, len(self.out_type), len(self.scratch))
        return self

    def jax_kernel(self, interpret_params):
        """JAX's ``plgpu.kernel`` for this spec, its body traced under our context."""
        from jax.experimental.pallas import mosaic_gpu as plgpu
        user_body, grid, names = self.body, self.grid, self.grid_names
        interpreted = interpret_params is not None

        def body(*refs, **named_refs):
            with context.installed(MosaicGPUContext(grid=grid, grid_names=names,
                                                    interpret=interpreted)):
                result = user_body(*refs, **named_refs)
            if result is not None:
                raise ValueError(f"kernel: the body {function_source(user_body)} must return None "
                                 f"(it writes its outputs to the output Refs), got {result!r}.")

        body.__name__ = self.name
        out = self.out_type[0] if self.single_output else list(self.out_type)
        return plgpu.kernel(body, out_type=out, scratch_types=self.scratch,
                            compiler_params=self.jax_params, grid=self.grid,
                            grid_names=self.grid_names, cluster=self.cluster,
                            cluster_names=self.cluster_names, num_threads=self.num_threads,
                            thread_name=self.thread_name,
                            interpret=interpret_params if interpreted else False,
                            kernel_name=self.name)


def _call(spec: _KernelSpec, *operands):
    for i, leaf in enumerate(jax.tree.leaves(operands)):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"kernel {spec.name!r}: operand leaf {i} must be an array, got "
                            f"{type(leaf).__name__}.")
    _check_arity(spec.body, len(operands), len(spec.out_type),
                 len(spec.scratch) if isinstance(spec.scratch, Sequence) else 0,
                 named=isinstance(spec.scratch, Mapping))
    choice = target.choose(spec.interpret, f"kernel {spec.name!r}")
    return runner.run(choice, spec.jax_kernel, operands, owner=spec, what=f"kernel {spec.name!r}")


def _outputs(out_shape, out_type):
    if out_shape is not _NOT_GIVEN and out_type is not _NOT_GIVEN:
        raise ValueError("kernel: give out_shape or out_type (the same thing), not both.")
    out = out_type if out_type is not _NOT_GIVEN else out_shape
    if out is _NOT_GIVEN:
        return (), False
    single = not isinstance(out, (tuple, list))
    outs = (out,) if single else tuple(out)
    for i, leaf in enumerate(jax.tree.leaves(outs)):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"kernel: out_type leaf {i} must be a jax.ShapeDtypeStruct, got {leaf!r}.")
    return outs, single


def _scratch(scratch_shapes, scratch_types):
    if scratch_shapes is not _NOT_GIVEN and scratch_types is not _NOT_GIVEN:
        raise ValueError("kernel: give scratch_shapes or scratch_types (the same thing), not both.")
    scratch = scratch_types if scratch_types is not _NOT_GIVEN else scratch_shapes
    if scratch is _NOT_GIVEN or scratch is None:
        return ()
    if not isinstance(scratch, (Sequence, Mapping)) or isinstance(scratch, str):
        raise TypeError(f"kernel: scratch_shapes must be a sequence or a dict of scratch types, "
                        f"got {scratch!r}.")
    converted = memory.to_jax_types(scratch if isinstance(scratch, Mapping) else list(scratch),
                                    "kernel: scratch_shapes")
    return dict(converted) if isinstance(scratch, Mapping) else tuple(converted)


def _axes(sizes, names, what, max_rank):
    if isinstance(sizes, (int, np.integer)):
        sizes = (sizes,)
    if isinstance(names, str):
        names = (names,)
    try:
        sizes, names = tuple(sizes), tuple(names)
    except TypeError:
        raise TypeError(f"kernel: {what} must be a tuple of ints and {what}_names a tuple of "
                        f"str, got {sizes!r} and {names!r}.") from None
    if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in sizes):
        raise ValueError(f"kernel: {what} must be ints >= 1, got {sizes!r}.")
    if max_rank is not None and len(sizes) > max_rank:
        raise ValueError(f"kernel: {what} has at most {max_rank} dims, got {sizes!r}.")
    if len(names) != len(sizes) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"kernel: {what}_names must give one str per {what} dim, got "
                         f"{what}={sizes!r}, {what}_names={names!r}.")
    return tuple(int(d) for d in sizes), names


def _check_arity(body, n_in, n_out, n_scratch, named=False):
    """The body takes every Ref (operands when known, outputs, scratch)."""
    import inspect
    try:
        sig = inspect.signature(body)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    least = n_out + (0 if named else n_scratch)
    if n_in is None:
        if len(positional) < least:
            raise TypeError(f"kernel: the body {function_source(body)} takes {len(positional)} "
                            f"positional Refs, fewer than its {n_out} output(s) and {n_scratch} "
                            "scratch buffer(s) alone.")
        return
    expected = n_in + least
    if not len(required) <= expected <= len(positional):
        raise TypeError(f"kernel: the body {function_source(body)} is called with {expected} Refs "
                        f"({n_in} operand(s), {n_out} output(s), "
                        f"{0 if named else n_scratch} positional scratch buffer(s)) but takes "
                        f"{len(required)} to {len(positional)} positional arguments.")
