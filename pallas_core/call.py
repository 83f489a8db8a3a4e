"""``pallas_call``: run a kernel over a grid of programs (docs/design.md §2).

``pallas_call(kernel, out_shape, ...)`` returns a function of the inputs. On
each call it (1) flattens inputs, outputs and specs, (2) resolves every
BlockSpec against its operand, (3) validates everything it can before any
lowering, including index maps evaluated over the whole grid, (4) settles the
dimension semantics, and (5) hands the resolved call to one backend.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from pallas_core import _jax_internals, autodiff, backends, grid_analysis, registry, validation
from pallas_core.cost import as_cost_estimate
from pallas_core.memory import ScratchShape, as_scratch_shape
from pallas_core.params import ARBITRARY, InterpretParams, ResolvedParams, resolve_params
from pallas_core.specs import (BlockMapping, BlockSpec, GridSpec, dynamic_axes, grid_axis_names,
                               is_no_block_spec, normalize_grid, resolve_block_mapping)

@dataclasses.dataclass(frozen=True)
class ResolvedCall:
    """Everything a backend needs, already validated."""

    kernel: Callable
    name: str
    # Static dims are ints; a dim computed under jit is a traced int32 scalar
    # (specs.dynamic_axes lists them; only backends whose traits say dynamic_grid get such grids).
    grid: tuple
    in_mappings: tuple[BlockMapping, ...]
    out_mappings: tuple[BlockMapping, ...]
    scratch_shapes: tuple[ScratchShape, ...]
    input_output_aliases: Mapping[int, int]
    semantics: tuple[str, ...]
    params: ResolvedParams
    backend: str
    debug: bool
    cost_estimate: Any
    interpret_params: InterpretParams = InterpretParams()
    # Leading grid axes added by vmap (pallas_core.batching): the kernel does not see them.
    num_batch_axes: int = 0
    # pltpu.PrefetchScalarGridSpec: the first n in_mappings are the scalar-prefetch
    # operands (whole arrays), and every other index map reads them
    # (pallas_core.context.scalar_refs tells it where from).
    num_scalar_prefetch: int = 0
    # A named grid's axis names (None entries for unnamed axes), as the kernel sees the
    # grid (batch axes excluded): lax.axis_index(name) is that axis's program id.
    grid_names: tuple | None = None
    # Outputs whose block stays put along a "parallel" axis (JAX accepts them): each
    # simulated core of the interpreter starts its own copy of such a block.
    core_local_outputs: tuple[int, ...] = ()
    # pallas_call(metadata=...): string pairs JAX's Mosaic lowering attaches to the kernel.
    metadata: Mapping[str, str] | None = None
    # What a backend traced from this call (the interpreter's grid-point body), so a
    # second call with the same shapes does not trace the kernel again. Not copied
    # by dataclasses.replace: a changed call is traced afresh.
    traces: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def kernel_ids(self, ids):
        """The program ids and grid as the kernel sees them (batch axes dropped)."""
        return tuple(ids)[self.num_batch_axes:], self.grid[self.num_batch_axes:]


def _is_spec_leaf(x):
    return is_no_block_spec(x) or isinstance(x, BlockSpec)


def _is_shape_leaf(x):
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _is_none(x):
    return x is None


def _tuples(tree):
    """``tree`` with its lists made tuples (JAX lines specs and operands up that way)."""
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return tuple(_tuples(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _tuples(v) for k, v in tree.items()}
    return tree


def _flatten_specs(specs, operands, n, what, against):
    """Specs as a flat list of length ``n``, one per operand leaf (None operands
    included); None or a missing spec means a whole-array block.

    As in JAX, the specs are a pytree of the operands' structure (lists and
    tuples alike), ``None`` where an operand is None. A single BlockSpec stands
    for a single operand, and a one-spec sequence for a single array output.

    Raises:
      ValueError: the structures differ; the message lists where, as JAX does.
    """
    if is_no_block_spec(specs):
        return [None] * n
    if isinstance(specs, BlockSpec) or (
            isinstance(specs, (list, tuple)) and len(specs) == 1 and n == 1
            and _is_spec_leaf(specs[0]) and not isinstance(operands, (list, tuple))):
        if n != 1:
            raise ValueError(f"{what}: a single BlockSpec was given for {n} operands; "
                             "give one spec per operand.")
        return [specs if isinstance(specs, BlockSpec) else specs[0]]
    spec_tree = jax.tree.structure(_tuples(specs), is_leaf=_is_spec_leaf)
    operand_tree = jax.tree.structure(_tuples(operands), is_leaf=lambda x: x is None or _is_shape_leaf(x))
    if spec_tree != operand_tree:
        errors = _jax_internals.pytree_differences(spec_tree, operand_tree)
        where = "\n".join(f"  * at {jax.tree_util.keystr(path) or 'the top level'}, `{what}` is a {ours} but "
                           f"`{against}` is a {theirs}, so {why}"
                           for path, ours, theirs, why in errors[:5])
        raise ValueError(
            f"Pytree for `{what}` and `{against}` do not match. There are {len(errors)} "
            f"mismatches, including:\n{where}\nGive one BlockSpec (or None) per operand, in a "
            "pytree of the operands' structure, and None for a None operand.")
    return [None if is_no_block_spec(s) else s
            for s in jax.tree.leaves(_tuples(specs), is_leaf=_is_spec_leaf)]


def _present(specs, operands, what):
    """The specs of the operands that are not None; a None operand needs a None spec."""
    out = []
    for i, (spec, x) in enumerate(zip(specs, operands)):
        if x is None:
            if spec is not None:
                raise ValueError(f"{what}[{i}]: operand {i} is None, so its spec must be None "
                                 f"too (the kernel receives None there), got {spec!r}.")
            continue
        out.append((i, spec, x))
    return out


def _needs_structure(in_tree, in_present, out_tree, out_present) -> bool:
    """Whether the kernel takes other than one Ref per operand (None or nested operands)."""
    return not (all(in_present) and all(out_present) and _is_flat(in_tree) and _is_flat(out_tree))


def _kernel_with_nones(kernel, in_tree, in_present, out_tree, out_present, scratch_present):
    """``kernel`` called with the Refs of the present operands put back in their
    pytrees, None where an operand is None, as JAX calls it: one argument per
    input (its pytree of Refs), then one per output, then the scratch Refs (None
    where a ``scratch_shapes`` entry is None)."""
    if all(scratch_present) and not _needs_structure(in_tree, in_present, out_tree, out_present):
        return kernel

    def structured(*refs):
        ins, rest = fill(refs, in_present)
        outs, scratch = fill(rest, out_present)
        scratch, _ = fill(scratch, scratch_present)
        return kernel(*jax.tree.unflatten(in_tree, ins),
                      *_out_args(jax.tree.unflatten(out_tree, outs)), *scratch)

    structured.__name__ = getattr(kernel, "__name__", "kernel")
    return structured


def fill(refs, present):
    """``(filled, rest)``: a Ref from ``refs`` where ``present`` is true, None elsewhere."""
    refs, out = iter(refs), []
    for p in present:
        out.append(next(refs) if p else None)
    return out, list(refs)


def _checked_body(body, kernel, names_and_sizes):
    """``body`` run where a named grid's axis names are bound to their sizes, with
    its return value refused (kernels write their outputs to Refs)."""
    def checked(*refs):
        if names_and_sizes:
            with _jax_internals.named_axes(names_and_sizes):
                result = body(*refs)
        else:
            result = body(*refs)
        validation.check_kernel_result(kernel, result)

    checked.__name__ = getattr(kernel, "__name__", "kernel")
    return checked


def _is_flat(tree) -> bool:
    """One leaf, or a container of leaves (the usual case: one Ref per operand)."""
    if tree.num_nodes == 1:
        return True
    return tree.num_nodes == tree.num_leaves + 1 and tree.num_leaves == len(tree.children())


def _out_args(outs) -> tuple:
    """The kernel's output arguments: the elements of a tuple/list ``out_shape``, else itself."""
    return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)


def pallas_call(kernel: Callable, out_shape: Any, *, grid=(), in_specs=None,
                out_specs=None, grid_spec: GridSpec | None = None, scratch_shapes=(),
                input_output_aliases: Mapping[int, int] | None = None,
                compiler_params=None, backend: str | None = None,
                interpret: bool | InterpretParams = False, name: str | None = None,
                cost_estimate=None, debug: bool = False,
                metadata: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """Wraps ``kernel`` into a function of arrays that runs it over ``grid``.

    Args:
      kernel: ``kernel(*in_refs, *out_refs, *scratch_refs) -> None``.
      out_shape: a pytree of objects with ``.shape`` and ``.dtype``
        (``jax.ShapeDtypeStruct`` or arrays).
      grid: an int or tuple of ints; ``()`` runs one program. As in JAX, a
        dim may be an integer scalar computed under ``jit`` (e.g. a tile count
        from data): the interpreter then runs the points in row-major order on
        one simulated core, ``mosaic_tpu`` hands it to JAX, and the other
        backends raise NotImplementedError naming the dim. A named grid
        ``(("i", 4), ("j", 2))`` names its axes: in the kernel
        ``lax.axis_size("i")`` / ``lax.psum(1, "i")`` give a size and
        ``lax.axis_index("i")`` the program id along it
        (:mod:`pallas_core.named_axes`).
      in_specs / out_specs: pytrees of :class:`BlockSpec` (or None for the whole
        array) matching the inputs / ``out_shape``. As in JAX, an operand may be
        None: its spec is None too and the kernel receives None in its place
        (and an operand that is a pytree of arrays reaches the kernel as that
        pytree of Refs). ``input_output_aliases`` count the array operands only.
      grid_spec: a :class:`GridSpec` instead of grid/in_specs/out_specs/scratch.
      scratch_shapes: e.g. ``[pallas_core.tpu.VMEM((8, 128), jnp.float32)]``;
        a None entry gives the kernel None in that position (as JAX does).
      input_output_aliases: ``{input_index: output_index}``; the output starts
        with (and may reuse the buffer of) that input.
      compiler_params: see :mod:`pallas_core.params`.
      backend: ``None`` (by platform: cpu -> interpret, gpu -> triton,
        tpu -> mosaic_tpu), "interpret", "triton" (our own Triton lowering,
        :mod:`pallas_core.triton`), "mosaic_tpu", "mosaic_gpu", "pallas_triton".
      interpret: True (or an :class:`InterpretParams`) forces the interpreter;
        by default it simulates a two-core megacore (see InterpretParams).
      name: kernel name shown in lowered modules (defaults to the kernel's).
      cost_estimate: a :class:`pallas_core.CostEstimate`, the dict
        ``{"flops", "transcendentals", "bytes_accessed"}`` or JAX's
        ``CostEstimate``, forwarded to the Mosaic backends (checked elsewhere).
      debug: print what the backend generates.
      metadata: a mapping of strings to strings (JAX's meaning): attached to
        the kernel by JAX's lowering on the ``mosaic_tpu``, ``mosaic_gpu`` and
        ``pallas_triton`` backends, for profilers; a checked no-op on
        ``interpret`` and ``triton``.

    Returns:
      A function of the inputs returning outputs shaped like ``out_shape``.
      ``jax.jvp`` runs its JVP kernel (:mod:`pallas_core.autodiff`);
      reverse mode raises TypeError: wrap the call in ``jax.custom_vjp``.

    Raises:
      ValueError / TypeError: on bad specs, before anything is lowered.
    """
    if getattr(grid_spec, "num_scalar_prefetch", 0):  # pallas_core.tpu.PrefetchScalarGridSpec
        from pallas_core import tpu_prefetch
        return tpu_prefetch.prefetching_call(
            build_call, kernel, out_shape, grid_spec, grid=grid, in_specs=in_specs,
            out_specs=out_specs, scratch_shapes=scratch_shapes,
            input_output_aliases=input_output_aliases, compiler_params=compiler_params,
            backend=backend, interpret=interpret, name=name, cost_estimate=cost_estimate,
            debug=debug, metadata=metadata)
    return build_call(kernel, out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                      grid_spec=grid_spec, scratch_shapes=scratch_shapes,
                      input_output_aliases=input_output_aliases, compiler_params=compiler_params,
                      backend=backend, interpret=interpret, name=name,
                      cost_estimate=cost_estimate, debug=debug, metadata=metadata)


def build_call(kernel: Callable, out_shape: Any, *, grid=(), in_specs=None, out_specs=None,
               grid_spec: GridSpec | None = None, scratch_shapes=(),
               input_output_aliases: Mapping[int, int] | None = None, compiler_params=None,
               backend: str | None = None, interpret: bool | InterpretParams = False,
               name: str | None = None, cost_estimate=None, debug: bool = False,
               num_scalar_prefetch: int = 0,
               metadata: Mapping[str, str] | None = None) -> Callable[..., Any]:
    """:func:`pallas_call` but for a :class:`~pallas_core.tpu.PrefetchScalarGridSpec`, which
    :mod:`pallas_core.tpu_prefetch` turns into this call with ``num_scalar_prefetch``
    leading whole-array operands (see :attr:`ResolvedCall.num_scalar_prefetch`)."""
    if grid_spec is not None:
        if grid not in ((), None) or in_specs is not None or out_specs is not None or scratch_shapes:
            raise ValueError("pallas_call: give either grid_spec or grid/in_specs/"
                             "out_specs/scratch_shapes, not both.")
        grid, in_specs, out_specs = grid_spec.grid, grid_spec.in_specs, grid_spec.out_specs
        scratch_shapes = grid_spec.scratch_shapes
    elif in_specs is not None and not isinstance(in_specs, (list, tuple)):
        # The inputs are a tuple of operands, so their specs are a sequence (GridSpec
        # keeps accepting a bare BlockSpec for a single input, as older Pallas code writes it).
        raise ValueError(f"`in_specs` must be a tuple or a list with one BlockSpec (or None) per "
                         f"input, got {in_specs!r}.")
    axis_names = grid_axis_names(grid)
    grid = normalize_grid(grid)
    metadata = _check_metadata(metadata)
    params = resolve_params(compiler_params)
    if not isinstance(interpret, (bool, InterpretParams)):
        raise TypeError(f"interpret: expected a bool or pallas_core.InterpretParams, got {interpret!r}.")
    interpret_params = interpret if isinstance(interpret, InterpretParams) else InterpretParams()
    chosen = backends.choose(backend, interpret)
    dynamic = dynamic_axes(grid)
    if dynamic and not backends.backend_traits(chosen).dynamic_grid:
        takers = [n for n in backends.BACKENDS if backends.backend_traits(n).dynamic_grid]
        raise NotImplementedError(
            f"grid: dim {dynamic[0]} is computed under jit (a traced int32 scalar); the "
            f"{chosen!r} backend needs every grid dim static (the {', '.join(takers)} "
            "backends take traced dims). Pass an upper bound and skip the extra programs "
            "with pl.when.")
    if isinstance(out_shape, list):
        out_shape = tuple(out_shape)
    out_all, out_tree = jax.tree.flatten(out_shape, is_leaf=lambda x: x is None or _is_shape_leaf(x))
    out_present = [o is not None for o in out_all]
    out_leaves = [o for o in out_all if o is not None]
    for i, o in enumerate(out_leaves):
        if not _is_shape_leaf(o):
            raise TypeError(f"out_shape: leaf {i} is {type(o).__name__}; expected "
                            "jax.ShapeDtypeStruct or an array-like with .shape and .dtype.")
    scratch_all = tuple(as_scratch_shape(s) for s in scratch_shapes or ())
    scratch_present = [s is not None for s in scratch_all]
    scratch_shapes = tuple(s for s in scratch_all if s is not None)
    for s in scratch_shapes:
        if not isinstance(s, ScratchShape):
            raise TypeError("scratch_shapes: expected e.g. pallas_core.tpu.VMEM(shape, dtype), "
                            f"got {s!r}.")
    kernel_name = name or getattr(kernel, "__name__", "kernel")
    aliases = dict(input_output_aliases or {})

    out_paths = ["outputs" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        out_shape, is_leaf=lambda x: x is None or _is_shape_leaf(x))[0]]

    def resolve(args_tree, all_args, in_tree) -> ResolvedCall:
        args = [a for a in all_args if a is not None]
        in_present = [a is not None for a in all_args]
        in_paths = ["args" + jax.tree_util.keystr(p)
                    for p, _ in jax.tree_util.tree_flatten_with_path(args_tree, is_leaf=_is_none)[0]]
        in_flat = _present(_flatten_specs(in_specs, args_tree, len(all_args), "in_specs", "inputs"),
                           all_args, "in_specs")
        out_flat = _present(_flatten_specs(out_specs, out_shape, len(out_all), "out_specs",
                                           "out_shape"), out_all, "out_specs")
        if _needs_structure(in_tree, in_present, out_tree, out_present):
            n_in, n_out = len(args_tree), len(_out_args(out_tree.unflatten(out_all)))
        else:
            n_in, n_out = len(args), len(out_leaves)
        validation.check_kernel_arity(kernel, n_in, n_out, len(scratch_all))
        in_maps = tuple(resolve_block_mapping(s, f"in_specs[{i}]", np.shape(a), a.dtype, len(grid),
                                              path=in_paths[i])
                        for i, s, a in in_flat)
        out_maps = tuple(resolve_block_mapping(s, f"out_specs[{i}]", o.shape, o.dtype, len(grid),
                                               path=out_paths[i])
                         for i, s, o in out_flat)
        body = _checked_body(_kernel_with_nones(kernel, in_tree, in_present, out_tree, out_present,
                                                scratch_present),
                             kernel, tuple(zip(axis_names or (), grid)))
        _check_aliases(aliases, args, out_leaves)
        if scratch_shapes and chosen == "pallas_triton":
            raise ValueError("scratch_shapes: the pallas_triton backend has no scratch memory.")
        for m in in_maps + out_maps:
            if m.unblocked and chosen not in ("interpret", "mosaic_tpu", "triton"):
                raise ValueError(f"{m.origin}: element offsets (Unblocked indexing, Element or "
                                 f"BoundedSlice block dims) are only supported on the "
                                 f"interpret and mosaic_tpu backends and on triton, not "
                                 f"{chosen!r}.")
            traits = registry.traits(chosen)
            if traits.tile != (1, 1):
                validation.check_tpu_tiling(m, traits.tile)
            if traits.power_of_two_blocks:
                validation.check_pow2(m, chosen)
        out_tables = []
        for m, is_output in [(m, False) for m in in_maps] + [(m, True) for m in out_maps]:
            # Index maps over a grid with traced dims cannot be evaluated before it runs.
            table = None if dynamic else grid_analysis.block_index_table(m, grid)
            if table is not None:
                grid_analysis.check_in_bounds(m, table, grid)
            if is_output:
                out_tables.append((m.origin, table))
        given = params.dimension_semantics
        if given is None and (num_scalar_prefetch or dynamic) and any(t is None for _, t in out_tables):
            # An output index map that reads prefetched scalars, or a grid whose size is
            # not known before the call runs, may revisit blocks anywhere: every axis
            # runs in order, as on JAX's TPU backend (pass dimension_semantics to say
            # otherwise).
            given = (ARBITRARY,) * len(grid)
        uses_atomics = functools.cache(
            lambda: _uses_atomics(body, in_maps + out_maps, scratch_shapes, grid))
        semantics = validation.resolve_semantics(given, out_tables, grid, chosen,
                                                 uses_atomics=uses_atomics)
        core_local = validation.outputs_kept_along_parallel_axes(out_tables, grid, semantics,
                                                                 uses_atomics)
        return ResolvedCall(kernel=body, name=kernel_name, grid=grid, in_mappings=in_maps,
                            out_mappings=out_maps, scratch_shapes=scratch_shapes,
                            input_output_aliases=aliases, semantics=semantics, params=params,
                            backend=chosen, debug=debug,
                            cost_estimate=as_cost_estimate(cost_estimate),
                            interpret_params=interpret_params,
                            num_scalar_prefetch=num_scalar_prefetch,
                            grid_names=tuple(axis_names) if axis_names else None,
                            core_local_outputs=core_local, metadata=metadata)

    resolved: dict = {}

    def wrapped(*args):
        # None operands stay in place (the kernel receives None there), as in JAX.
        all_args, in_tree = jax.tree.flatten(args, is_leaf=_is_none)
        # Python scalars take JAX's dtypes (int32 / float32 unless x64 is on), as jnp.asarray.
        all_args = [a if a is None or hasattr(a, "dtype") else
                    np.asarray(a, jax.dtypes.canonicalize_dtype(np.asarray(a).dtype))
                    for a in all_args]
        flat_args = [a for a in all_args if a is not None]
        key = (in_tree, tuple(None if a is None else (tuple(np.shape(a)), np.dtype(a.dtype))
                              for a in all_args))
        call = resolved.get(key)
        if call is None:  # validated and traced once per shapes and dtypes
            call = resolved[key] = resolve(args, all_args, in_tree)

        outs = iter(autodiff.run(call, flat_args))
        return jax.tree.unflatten(out_tree, [next(outs) if p else None for p in out_present])

    return wrapped


def _check_metadata(metadata):
    """``metadata`` as a dict of strings (JAX's type for it), or None."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError(f"metadata: expected a mapping of str to str, got {metadata!r}.")
    return dict(metadata)


def _aval_text(shape, dtype) -> str:
    return f"{np.dtype(dtype).name}[{','.join(str(int(d)) for d in shape)}]"


def _check_aliases(aliases, args, out_leaves):
    """Each ``{input: output}`` pair names an existing input and output of one shape and
    dtype (worded as JAX words it, so code matching JAX's messages keeps working)."""
    for i, o in aliases.items():
        for kind, index, count in (("input", i, len(args)), ("output", o, len(out_leaves))):
            if not 0 <= index < count:
                raise ValueError(
                    f"input_output_aliases contains the mapping '{i}:{o}' with {kind} index "
                    f"{index} outside the range [0, {count}): there are {len(args)} array "
                    f"input(s) and {len(out_leaves)} output(s).")
        a, out = args[i], out_leaves[o]
        if tuple(np.shape(a)) != tuple(out.shape) or np.dtype(a.dtype) != np.dtype(out.dtype):
            raise ValueError(
                f"input_output_aliases contains the mapping '{i}:{o}' referring to input[{i}] "
                f"with abstract value {_aval_text(np.shape(a), a.dtype)} and output[{o}] with a "
                f"different abstract value {_aval_text(out.shape, out.dtype)}; an aliased "
                "output must have the same shape and dtype as its input.")


def _uses_atomics(kernel, mappings, scratch_shapes, grid) -> bool:
    """Whether the kernel makes an atomic update (a named call with a prefix a backend
    registered, :func:`pallas_core.registry.atomic_prefixes`; traced only when asked)."""
    from pallas_core import context
    from pallas_core.backends.interpret import InterpretContext
    prefixes = registry.atomic_prefixes()

    def body(ids, blocks, scratch):
        refs = [jax.new_ref(v) for v in blocks] + [jax.new_ref(v) for v in scratch]
        with context.installed(InterpretContext(tuple(ids), grid)):
            kernel(*refs)

    closed = jax.make_jaxpr(body)([jax.ShapeDtypeStruct((), np.int32)] * len(grid),
                                  [jax.ShapeDtypeStruct(m.ref_shape, m.dtype) for m in mappings],
                                  [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in scratch_shapes])

    atomic = lambda eqn: str(eqn.params.get("name", "")).startswith(prefixes)
    return _jax_internals.find_eqn(closed.jaxpr, atomic) is not None
