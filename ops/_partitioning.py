"""How every op runs on a device mesh: one partitioning mechanism for all ops (docs/design.md §5.6).

An op's Pallas kernel is opaque to XLA's SPMD partitioner: left alone, XLA
gathers every operand onto one device before the custom call (output
sharding ``{maximal device=0}``), and our interpreter's ``dynamic_slice``
walk over the grid fails outright on explicitly sharded operands. So each
op states, once, how its kernel calls partition, as an einsum-like
*signature* over named factors, and :func:`run` carries it out:

    "r f, f, f -> r f, r one, r one"      # layer_norm's forward: x, scale, bias -> y, mean, rstd

Each space-separated name is a factor of one dim; ``(k g)`` is a dim made
of two factors, major first (query heads = kv heads x group size); ``one``
is a dim of size 1. For each factor the rule is one of:

* *kept* (the default): a factor sharded on an operand stays sharded; every
  operand and result with that factor is split the same way and the kernel
  runs on the local blocks. Rows of row-wise ops, rows of x / columns of w in
  fused_matmul, batch and heads in attention.
* *gathered* (``gather=``): the kernel needs the whole dim (a row's
  features, attention's sequences); a sharded one is all-gathered before the
  call, the documented price of such a layout.
* *reduced* (``reduce=``): a factor absent from the results over which the
  op sums (fused_matmul's contraction, ``sum`` over a sharded axis,
  vocabulary-parallel cross-entropy). It stays sharded; the local function
  receives, in ``reduced``, the mesh axes each such factor is split over and
  ends in the matching collective (``psum`` / ``pmax``) itself, at the point
  the math allows (before a non-linear epilogue, say). A factor that the
  results keep may be listed too, only so that ``reduced`` names the axes
  splitting it: a local function that needs its block's global position
  (a grouped matmul's rows, a cache's pages) reads it with :func:`block_index`.

A factor's sharding is taken from the first operand that has it; an axis
already used by another factor, or one whose size does not divide the
factor's, is dropped (that dim is then gathered), so a layout is never
partitioned into something the kernel cannot compute exactly.

Two JAX mechanisms, chosen per call by what the operands' types say, carry
out the same rule:

* **Explicit sharding** (``jax.make_mesh``'s default axis type; the operands'
  avals carry their ``PartitionSpec``): the rule is applied at trace time and
  the local function runs under ``jax.shard_map`` on the local blocks, after
  ``jax.sharding.reshard`` of operands whose layout the rule changes (the
  gathers). Result shardings are the rule's.
* **Automatic sharding** (``Mesh`` axes of type ``Auto``, ``jax.jit`` with
  ``in_shardings``): the avals carry no sharding at trace time, so the call
  is a ``jax.experimental.custom_partitioning`` whose Shardy sharding rule is
  the signature (gathered factors as ``need_replication``, reduced ones as
  ``reduction`` factors) and whose ``partition`` callback applies the rule
  to the shardings XLA settled on. On one device, eagerly, and inside a
  ``shard_map`` whose axes are all manual it is the local function as is.
  ``custom_partitioning`` has no batching rule, so the call is wrapped in a
  ``jax.custom_batching.custom_vmap`` that, under ``vmap``, runs the local
  function batched (the ``pallas_call`` batching rule: a grid axis), unpartitioned.
  A local function that runs a host callback (``triton`` in Triton's CPU
  interpreter) cannot be partitioned this way: JAX crashes on a callback in a
  ``partition`` body, so the op raises NotImplementedError instead.

Inside a user's ``shard_map`` with ``check_vma``, results vary over every
manual axis an operand varies over, and a result with ``out_like`` (a
gradient) whose primal varies over fewer axes is summed over the others.

Ops call :func:`run` at their ``jax.custom_vjp`` forward and backward kernel
call sites (never around the custom_vjp: neither mechanism is differentiated
through), so gradients partition exactly as the forward does.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from pallas_core import _jax_internals

__all__ = ["run", "rowwise", "explicit_sharding", "with_sharding", "reshape", "Rule", "psum", "reduced_axes", "block_index", "ROW", "STAT", "PARAM", "PER_ROW"]

_ONE = "one"
_NAME = re.compile(r"[a-z][a-z0-9]*")


def _parse(dims: str) -> tuple[tuple[str, ...], ...]:
    """``"r (k g) one"`` -> ``(("r",), ("k", "g"), ("one",))``."""
    out, i, tokens = [], 0, dims.replace("(", " ( ").replace(")", " ) ").split()
    while i < len(tokens):
        if tokens[i] == "(":
            j = tokens.index(")", i)
            out.append(tuple(tokens[i + 1:j]))
            i = j + 1
        else:
            out.append((tokens[i],))
            i += 1
    for dim in out:
        for name in dim:
            if not _NAME.fullmatch(name):
                raise ValueError(f"bad factor name {name!r} in signature {dims!r}")
    return tuple(out)


def _axes(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One kernel call's partitioning rule (see the module docstring).

    Attributes:
      op: the public op's name, for messages.
      operands, results: per array, its dims, each a tuple of factor names.
      sizes: every factor's size.
      gather: factors the kernel needs whole.
      reduce: factors absent from the results that the local function reduces
        across devices itself.
    """

    op: str
    operands: tuple[tuple[tuple[str, ...], ...], ...]
    results: tuple[tuple[tuple[str, ...], ...], ...]
    sizes: Mapping[str, int]
    gather: frozenset[str]
    reduce: frozenset[str]

    def _shardable(self, factor: str) -> bool:
        if factor == _ONE or factor in self.gather:
            return False
        # A factor absent from the results is shardable only if the local function reduces it.
        in_results = any(factor in dim for arr in self.results for dim in arr)
        return in_results or factor in self.reduce

    def assign(self, mesh_shape: Mapping[str, int], specs: Sequence[PartitionSpec | None]
               ) -> dict[str, tuple[str, ...]]:
        """Factor -> mesh axes, from the operands' specs (first operand wins)."""
        assignment: dict[str, tuple[str, ...]] = {}
        used: set[str] = set()
        for dims, spec in zip(self.operands, specs):
            entries = tuple(spec or ()) + (None,) * (len(dims) - len(spec or ()))
            for dim, entry in zip(dims, entries):
                axes, factor = _axes(entry), dim[0]
                if not axes or factor in assignment or not self._shardable(factor):
                    continue
                if used.intersection(axes) or self.sizes[factor] % math.prod(
                        mesh_shape[a] for a in axes):
                    continue
                assignment[factor] = axes
                used.update(axes)
        return assignment

    @staticmethod
    def spec(dims, assignment) -> PartitionSpec:
        """The PartitionSpec of an array with ``dims`` under ``assignment`` (major factors only)."""
        entries = []
        for dim in dims:
            axes = assignment.get(dim[0], ())
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)

    def operand_specs(self, assignment):
        return tuple(self.spec(d, assignment) for d in self.operands)

    def result_specs(self, assignment):
        return tuple(self.spec(d, assignment) for d in self.results)

    def reduced(self, assignment) -> dict[str, tuple[str, ...]]:
        """Reduced factor -> the mesh axes its partial results must be combined over."""
        return {f: assignment[f] for f in self.reduce if f in assignment}

    def _shardy_arrays(self):
        """Operands and results as Shardy sees them: a compound dim may not hold a
        factor of size 1 (query heads ``(k g)`` with group size 1), so those are dropped."""
        def dims(arr):
            return tuple(tuple(f for f in d if self.sizes[f] != 1) or d[:1] if len(d) > 1 else d
                         for d in arr)
        return tuple(map(dims, self.operands)), tuple(map(dims, self.results))

    def shardy(self) -> str:
        def side(arrays):
            return ", ".join(" ".join(d[0] if len(d) == 1 else "(" + " ".join(d) + ")" for d in arr)
                             for arr in arrays)
        operands, results = self._shardy_arrays()
        return f"{side(operands)} -> {side(results)}"

    def shardy_kwargs(self) -> dict:
        operands, results = self._shardy_arrays()
        # Shardy wants special factors listed in the order the rule first names them.
        order = list(dict.fromkeys(f for arr in operands + results for dim in arr for f in dim))
        minor = {f for arr in operands + results for dim in arr for f in dim[1:]}
        alone = {dim[0] for arr in operands + results for dim in arr if len(dim) == 1}
        in_results = {f for arr in results for dim in arr for f in dim}
        kwargs = {f: self.sizes[f] for f in order if f not in alone}
        # Shardy's reduction factors are those absent from every result; a reduced
        # factor that some result keeps (rows, for a norm's dscale) is a plain one to it.
        kwargs.update(
            need_replication_factors=tuple(f for f in order
                                           if not self._shardable(f) or f in minor),
            reduction_factors=tuple(f for f in order if f in self.reduce and f not in in_results))
        return kwargs


def _factor_sizes(op, arrays, operand_dims) -> dict[str, int]:
    sizes: dict[str, int] = {_ONE: 1}
    compound = []
    for a, dims in zip(arrays, operand_dims):
        if len(dims) != a.ndim:
            raise AssertionError(f"{op}: signature {dims} does not match shape {a.shape}")
        for dim, n in zip(dims, a.shape):
            if len(dim) == 1:
                if sizes.setdefault(dim[0], n) != n:
                    raise AssertionError(f"{op}: factor {dim[0]} is {sizes[dim[0]]} and {n}")
            else:
                compound.append((dim, n))
    for dim, n in compound:  # one unknown factor per compound dim, solved from its size
        known = math.prod(sizes[f] for f in dim if f in sizes)
        for f in dim:
            sizes.setdefault(f, n // known)
    return sizes


def psum(x, reduced: Mapping[str, tuple[str, ...]], *factors: str):
    """``x`` summed over the devices that split any of ``factors`` (no-op when none do)."""
    axes = reduced_axes(reduced, *factors)
    return jax.lax.psum(x, axes) if axes else x


def block_index(reduced: Mapping[str, tuple[str, ...]], *factors: str):
    """This device's index (int32) among the blocks the axes splitting ``factors`` cut
    them into, major axis first (the order of a ``PartitionSpec`` entry); 0 where no
    axis splits them. Times the local size, the block's global offset."""
    axes = reduced_axes(reduced, *factors)
    return jax.lax.axis_index(axes) if axes else jax.numpy.int32(0)


def reduced_axes(reduced: Mapping[str, tuple[str, ...]], *factors: str) -> tuple[str, ...]:
    """The mesh axes splitting any of ``factors`` (the names a collective runs over)."""
    return tuple(a for f in factors for a in reduced.get(f, ()))


def run(op: str, fn: Callable, args: Sequence, in_dims: Sequence[str], out_dims: Sequence[str], *,
        gather: Sequence[str] = (), reduce: Sequence[str] = (),
        out_like: Sequence[int | None] = ()) -> tuple:
    """Runs ``fn(*args, reduced=...)`` partitioned over the mesh the operands live on.

    Args:
      op: the public op's name (for messages).
      fn: the local computation: takes ``args`` (local blocks; None entries
        passed through) and the keyword ``reduced`` (reduced factor -> mesh
        axes, empty on one device), returns a tuple of arrays.
      args: arrays or None (an absent optional operand).
      in_dims, out_dims: each array's factor signature (``in_dims`` entries of
        None args are ignored).
      gather, reduce: factor names, as in the module docstring.
      out_like: per result, the index in ``args`` of an operand whose sharding
        the result must keep (a gradient takes its primal's type), or None.
        Only explicit sharding types make it matter: the result is resharded
        back where the rule gathered that operand.

    Returns:
      ``fn``'s results as global arrays.
    """
    present = [i for i, a in enumerate(args) if a is not None]
    arrays = [args[i] for i in present]
    operand_dims = tuple(_parse(in_dims[i]) for i in present)
    rule = Rule(op=op, operands=operand_dims, results=tuple(_parse(d) for d in out_dims),
                sizes=_factor_sizes(op, arrays, operand_dims), gather=frozenset(gather),
                reduce=frozenset(reduce))

    def local(*blocks, reduced):
        full = list(args)
        for i, b in zip(present, blocks):
            full[i] = b
        return tuple(fn(*full, reduced=reduced))

    mesh = _explicit_mesh(arrays)
    if mesh is not None:
        outs = _run_shard_map(rule, local, mesh, arrays)
        like = tuple(out_like) + (None,) * len(outs)
        return tuple(out if j is None or args[j] is None else _reshard_like(out, args[j], mesh)
                     for out, j in zip(outs, like))
    outs = _partitioned_call(rule, local)(*arrays)
    like = tuple(out_like) + (None,) * len(outs)
    return tuple(out if j is None or args[j] is None else _vary_like(out, args[j])
                 for out, j in zip(outs, like))


def _vary_like(out, target):
    """``out`` (a gradient) with the manual axes ``target`` (its primal) varies over.

    Inside a user's ``shard_map`` with ``check_vma``, a gradient computed from
    operands that vary over more axes than its primal (dx from a w split over
    "model", x the same on every "model" device) is a partial sum: summed over
    the extra axes, as JAX's own transpose of the implicit ``pvary`` does.
    Elsewhere types carry no manual axes and ``out`` is returned as is.
    """
    have, want = _jax_internals.varying_axes(out), _jax_internals.varying_axes(target)
    if have == want:
        return out
    extra = tuple(a for a in have if a not in want)
    if extra:
        out = jax.lax.psum(out, extra)
    return _jax_internals.vary(out, want)


# The row-wise family (norms, softmax family, cross_entropy): arrays are
# ``[rows, features]`` (ROW), per-row statistics ``[rows, 1]`` (STAT) or
# ``[rows]`` (PER_ROW), parameters ``[features]`` (PARAM).
ROW, STAT, PER_ROW, PARAM = "r f", "r one", "r", "f"


def rowwise(op: str, fn: Callable, args: Sequence, in_dims: Sequence[str], out_dims: Sequence[str],
            *, sums_over_rows: bool = False, out_like: Sequence[int | None] = ()) -> tuple:
    """:func:`run` for a row-wise kernel: rows ("r") run where they live, a sharded
    feature dim ("f") is gathered (a row's statistics need all of it).

    ``sums_over_rows``: some result (a parameter's gradient) sums over rows;
    ``fn`` then finishes it with ``psum(value, reduced, "r")``.
    """
    return run(op, fn, args, in_dims, out_dims, gather=("f",),
               reduce=("r",) if sums_over_rows else (), out_like=out_like)


# --------------------------------------------------------------------------
# Explicit sharding: the rule at trace time, the local function under shard_map
# --------------------------------------------------------------------------

def _explicit_mesh(arrays):
    """The mesh of the first operand whose type carries an explicit sharding, else None."""
    for a in arrays:
        sharding = getattr(jax.typeof(a), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
            continue
        if any(_axes(e) for e in sharding.spec):
            return mesh
    return None


def _run_shard_map(rule: Rule, local, mesh, arrays):
    specs = [jax.typeof(a).sharding.spec for a in arrays]
    assignment = rule.assign(dict(mesh.shape), specs)
    in_specs = rule.operand_specs(assignment)
    arrays = [a if tuple(s) == tuple(_pad(have, len(s))) else
              jax.sharding.reshard(a, NamedSharding(mesh, s))
              for a, s, have in zip(arrays, in_specs, specs)]
    body = functools.partial(local, reduced=rule.reduced(assignment))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                         out_specs=rule.result_specs(assignment), check_vma=False)(*arrays)


def explicit_sharding(x) -> NamedSharding | None:
    """``x``'s sharding when its type carries one (explicit mesh axes), else None.

    A static, hashable value: an op keeps it in its custom_vjp config so that a
    gradient built by XLA ops alone can be given its primal's type
    (:func:`with_sharding`).
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
        return None
    return sharding


def with_sharding(x, sharding: NamedSharding | None):
    """``x`` resharded to ``sharding`` (from :func:`explicit_sharding`) where it differs."""
    if sharding is None or jax.typeof(x).sharding == sharding:
        return x
    return jax.sharding.reshard(x, sharding)


def reshape(x, shape):
    """``x.reshape(shape)`` that also works on explicitly sharded ``x``.

    JAX's explicit-sharding rule refuses reshapes whose output layout it cannot
    infer (merging two sharded dims into one, say). Here each group of dims
    the reshape merges or splits keeps the sharding of its major dim (whose
    blocks stay contiguous: the layout JAX itself gives where it has a rule),
    and a sharded minor dim is gathered first: the documented price of such a
    layout, never a wrong result.
    """
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(x.size // max(known, 1) if d == -1 else d for d in shape)
    sharding = explicit_sharding(x)
    if sharding is None or tuple(x.shape) == shape:
        return x.reshape(shape)
    mesh, spec = sharding.mesh, _pad(sharding.spec, x.ndim)
    in_spec, out_spec = [None] * x.ndim, [None] * len(shape)
    for ins, outs in _reshape_groups(tuple(x.shape), shape):
        axes = _axes(spec[ins[0]]) if ins else ()
        if axes and outs and shape[outs[0]] % math.prod(mesh.shape[a] for a in axes) == 0:
            in_spec[ins[0]] = out_spec[outs[0]] = spec[ins[0]]
    x = jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*in_spec)))
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(mesh, PartitionSpec(*out_spec)))


def _reshape_groups(old, new):
    """Pairs ``(old dims, new dims)`` of equal total size, in order (size-1 dims alone)."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1 and (j >= len(new) or new[j] != 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(new) and new[j] == 1 and (i >= len(old) or old[i] != 1):
            groups.append(((), (j,)))
            j += 1
            continue
        ins, outs, a, b = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a *= old[i]
                ins.append(i)
                i += 1
            else:
                b *= new[j]
                outs.append(j)
                j += 1
        groups.append((tuple(ins), tuple(outs)))
    return groups


def _reshard_like(out, target, mesh):
    """``out`` with ``target``'s PartitionSpec (on ``mesh``), resharded only if it differs."""
    want = _pad(jax.typeof(target).sharding.spec, out.ndim)
    if _pad(jax.typeof(out).sharding.spec, out.ndim) == want:
        return out
    return jax.sharding.reshard(out, NamedSharding(mesh, PartitionSpec(*want)))


def _pad(spec, n):
    return tuple(spec) + (None,) * (n - len(tuple(spec)))


# --------------------------------------------------------------------------
# Automatic sharding: custom_partitioning with a Shardy rule
# --------------------------------------------------------------------------

def _spec_of(sharding, ndim):
    spec = getattr(sharding, "spec", None)
    return PartitionSpec() if spec is None else PartitionSpec(*_pad(spec, ndim))


def _host_callback(jaxpr) -> str | None:
    """The name of a host-callback primitive in ``jaxpr`` (nested jaxprs included), else None."""
    eqn = _jax_internals.find_eqn(jaxpr, lambda e: e.primitive.name in ("pure_callback", "io_callback"))
    return None if eqn is None else eqn.primitive.name


def _has_ordered_effects(closed) -> bool:
    from jax._src import effects  # JAX's registry of effect types that order
    return any(effects.ordered_effects.contains(e) for e in closed.effects)


def _partitioned_call(rule: Rule, local):
    def unpartitioned(*blocks):
        return local(*blocks, reduced={})

    @custom_vmap
    def batchable(*blocks):
        # custom_partitioning traces its function without closed-over constants,
        # and the kernels close over some (NaN fills, index tables): trace once
        # here and pass them in as leading, replicated operands.
        closed = jax.make_jaxpr(unpartitioned)(*blocks)
        if _has_ordered_effects(closed):
            # Ordered effects (the GPU interpret mode's callbacks, on a host without a
            # GPU): custom_partitioning's lowering threads no effect tokens, so the
            # kernels run as they are (they run on one device there anyway).
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *blocks))
        call_site = _jax_internals.current_traceback()
        callback = _host_callback(closed.jaxpr)
        consts = [jax.numpy.asarray(c) for c in closed.consts]
        n = len(consts)
        const_dims = tuple(tuple((f"c{i}x{j}",) for j in range(c.ndim)) for i, c in enumerate(consts))
        full = dataclasses.replace(
            rule, operands=const_dims + rule.operands,
            sizes={**rule.sizes, **{d[0]: s for dims, c in zip(const_dims, consts)
                                    for d, s in zip(dims, c.shape)}},
            gather=rule.gather | {d[0] for dims in const_dims for d in dims})

        def decide(mesh, arg_shapes):
            specs = [_spec_of(s.sharding, len(s.shape)) for s in arg_shapes]
            return full.assign(dict(mesh.shape), specs)

        @custom_partitioning
        def call(*operands):
            return tuple(jax.core.eval_jaxpr(closed.jaxpr, operands[:n], *operands[n:]))

        def partition(mesh, arg_shapes, result_shape):
            if callback:
                raise NotImplementedError(
                    f"{rule.op}: its kernels run through a host callback ({callback}; Triton's "
                    "CPU interpreter does), and JAX cannot partition one over automatic mesh "
                    "axes (inside custom_partitioning it crashes the process). Use explicit "
                    "axes (jax.make_mesh's default) or call the op inside jax.shard_map.")
            assignment = decide(mesh, arg_shapes)
            args = tuple(NamedSharding(mesh, s) for s in full.operand_specs(assignment))
            results = tuple(NamedSharding(mesh, s) for s in full.result_specs(assignment))
            body = functools.partial(local, reduced=full.reduced(assignment))

            def lower(*operands):
                # XLA calls this while it compiles, from deep inside the caller's
                # stack: traced there, every kernel op's location would carry that
                # whole traceback (the caller's frames + the compile's + ours).
                # XLA's cost of inlining the kernels' conditionals with their stack
                # metadata (ConditionalSimplifier -> CallInliner) grows steeply
                # with those stacks: the MLP's compile took 4 s from 12 extra
                # frames and did not end in 300 s from 16 (or from pytest). Traced
                # at the op's call site, as on every other path, it stays at 4-8 s.
                with _jax_internals.traced_at(call_site):
                    return body(*operands[n:])
            return mesh, lower, results, args

        def infer(mesh, arg_shapes, result_shape):
            assignment = decide(mesh, arg_shapes)
            return tuple(NamedSharding(mesh, s) for s in full.result_specs(assignment))

        call.def_partition(partition, infer_sharding_from_operands=infer,
                           sharding_rule=full.shardy(), **full.shardy_kwargs())
        return call(*consts, *blocks)

    @batchable.def_vmap
    def _batched(axis_size, in_batched, *blocks):
        out = jax.vmap(unpartitioned, in_axes=[0 if b else None for b in in_batched])(*blocks)
        return out, (True,) * len(out)

    return batchable
