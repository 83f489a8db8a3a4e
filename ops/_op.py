"""The op layer: an :class:`Op` per public op, one typed config per implementation, a registry.

An op is made of (docs/design.md §5.1):

* its argument checks (``check``: raise ``TypeError`` / ``ValueError`` naming
  the argument before anything is traced; the shared helpers are in
  :mod:`ops._checks`);
* its XLA reference (``reference``), which is also the ``"xla"``
  implementation and what the tests compare against;
* its implementations: for every pallas_core backend it has kernels for, the
  config class those kernels take (``configs``). Several backends may share
  one class; the class is the whole contract between the op and the tuner.
  Registering the op makes an :class:`Implementation` of each (and of
  ``"xla"``): the name, the config class, the kernel entry (the op's
  ``entry(name, **args)``) and a ``supported(call)`` predicate; a later module
  adds one more (``mosaic_gpu`` kernels, cuDNN) with
  :func:`register_implementation`, with no edit in the op's body.

A **config** is a frozen (hashable) dataclass subclassing :class:`KernelConfig`:
every field is something that changes the generated kernel (tiles, warps,
stages, the walking strategy). Fields made with :func:`tunable` are what the
tuning cache stores and the tuner searches; the others are derived (a
strategy that follows from the backend, ...). The class answers:

* ``heuristic(problem, device)``: the config to run when nothing else is
  known (sized for the backend's memories; interpreter tiles when
  ``device.interpreter``);
* ``candidates(problem, device)``: the distinct configs the tuner tries
  (non-empty, clamped to the problem);
* ``from_tuned(tuned, problem, device)``: a cache entry's fields over the
  heuristic's.

A **problem** (:class:`Problem`) is what a config is chosen for: the op, its
dims (named by ``Op.dims``: fused_matmul ``(m, n, k)``, row-wise ops
``(rows, features)``, attention ``(T, S, head_dim)``), the dtype and the
variant: everything else about the call that changes its kernels (for
attention causal or not, masks, dropout, ...; a frozen :class:`Variant`
dataclass per op whose defaults are a plain call). The tuning key is
:meth:`Problem.key`: op, implementation, device kind, dtype, shape bucket
(every dim rounded up to a power of two) and the variant's fields.

:meth:`Op.select` is the one precedence every op uses: an explicit config (a
``block_sizes=`` argument made typed), else the tuning cache's entry for the
problem (:func:`ops.tuning.lookup`), else the heuristic.

How a new op registers
----------------------

In the op's module (its own folder for a family), at import time::

    @dataclasses.dataclass(frozen=True)
    class MyConfig(KernelConfig):
        block_rows: int = tunable()
        num_warps: int | None = tunable(None)
        strategy: str = "grid"

        @classmethod
        def heuristic(cls, problem, device): ...
        @classmethod
        def candidates(cls, problem, device): ...

    def _my_op_on(impl, x, explicit):     # the checked call on one implementation
        if impl == "xla":
            return my_op_reference(x)
        config = OP.select(OP.problem(x.shape, x.dtype), impl, explicit)
        ...                                # the kernels (pallas_calls) with config

    OP = register(Op(
        name="my_op", dims=("rows", "features"),
        configs={b: MyConfig for b in ("interpret", "triton", "pallas_triton", "mosaic_tpu")},
        reference=my_op_reference, check=_check, entry=_my_op_on,
        problem_of=lambda x, **_: (x.shape, x.dtype, None),  # what the default's rankings key
        supported={"pallas_triton": _powers_of_two},         # why it cannot run a call, or None
        function=my_op,
        tuning=Tuning(example=_example, shapes=((4096, 4096),), quick=((256, 1024),))))

and in the public function, after its checks::

    return OP.run(implementation, x=x, explicit=explicit)   # the entry's arguments

Another backend's kernels, in a module of their own, register with no edit
above (and the default picks them where the rankings measure them fastest)::

    register_implementation("my_op", Implementation(
        "mosaic_gpu", run=lambda call: my_op_wgmma(call.args["x"]), config=MyWgmmaConfig,
        supported=lambda call: None if call.target.sm == "sm_90" else "needs sm_90 (wgmma)",
        platforms=("gpu",)))

The op's package ``__init__`` imports the module and ``ops/__init__.py``
imports the package, so ``import ops`` (or anything under it) registers every
op. Registering is all the tuner (``ops/tuning/search.py``,
``python -m benchmarks.tune``) and the cache (``ops/tuning/cache.py``) need:
they iterate :func:`registered` ops, with no per-op tables. An op with no
``tuning`` is registered (its configs validate cache entries) but not tuned.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

import pallas_core as pl
from ops import _default
from ops._implementation import IMPLEMENTATIONS, KERNEL_BACKENDS, check_implementation
from ops.tuning import cache, rankings
from pallas_core.triton import backend as triton_backend

_R = TypeVar("_R")
_C = TypeVar("_C", bound="KernelConfig")

_TUNABLE = "tunable"


def tunable(default: Any = dataclasses.MISSING) -> Any:
    """A config field the tuning cache stores and the tuner searches (a positive int, or
    None for "the heuristic's"): ``block_q: int = tunable()``."""
    return dataclasses.field(default=default, metadata={_TUNABLE: True})


@dataclasses.dataclass(frozen=True)
class Device:
    """What a config is chosen for besides the problem.

    Attributes:
      backend: the pallas_core backend the kernels run on ("triton", "mosaic_tpu", ...).
      kind: the device kind tuning lookups use (:func:`ops.tuning.current_device_kind`).
      interpreter: the kernels run in Triton's CPU interpreter, whose cost is per
        Triton operation, not per element: heuristics give fewer, bigger tiles
        (:func:`pallas_core.triton.backend.wants_interpreter_tiles`; never inside a
        capture for :func:`pallas_core.triton.source` / ``compile``).
    """

    backend: str
    kind: str = ""
    interpreter: bool = False

    @property
    def traits(self) -> pl.BackendTraits:
        """What the backend declared about itself (:func:`pallas_core.backend_traits`):
        what heuristics ask (``device.traits.tile``, ``.triton``, ``.walk``, ...)
        instead of comparing backend names."""
        return pl.backend_traits(self.backend)

    @classmethod
    def current(cls, backend: str) -> "Device":
        """The device a call traced now on ``backend`` runs on."""
        return cls(backend, cache.current_device_kind(), triton_backend.wants_interpreter_tiles(backend))


@dataclasses.dataclass(frozen=True)
class Variant:
    """Base of an op's variant: a frozen dataclass of JSON scalars (bool, int, str, None)
    whose defaults are a plain call; each field changes the op's kernels beyond the shape
    bucket and dtype (scalar constants that leave the kernel's structure alone are not
    part of it)."""

    @classmethod
    def defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call as the op layer sees it.

    Attributes:
      op: the op's name.
      shape: its dims, as the op's ``dims`` name them.
      dtype: the input dtype's name.
      variant: the variant's fields as sorted ``(name, value)`` pairs, every
        field of the op's :class:`Variant` (empty for an op without one).
    """

    op: str
    shape: tuple[int, ...]
    dtype: str
    variant: tuple[tuple[str, Any], ...] = ()

    @property
    def bucket(self) -> tuple[int, ...]:
        """The shape bucket: every dim rounded up to a power of two."""
        return cache.shape_bucket(self.shape)

    def variant_dict(self) -> dict:
        return dict(self.variant)

    def key(self, implementation: str, device_kind: str) -> tuple:
        """The tuning key: everything that selects a tuned config."""
        return (self.op, implementation, device_kind, self.dtype, self.bucket, self.variant)

    def __getattr__(self, name):  # dims by name: problem.m, problem.features, ...
        if name.startswith("_"):
            raise AttributeError(name)
        dims = _DIMS.get(self.__dict__.get("op"))
        if dims is not None and name in dims:
            return self.shape[dims.index(name)]
        raise AttributeError(name)


_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


@dataclasses.dataclass(frozen=True)
class Target:
    """The device an implementation is chosen for.

    Attributes:
      platform: "cpu", "gpu" or "tpu".
      device_kind: ``jax.Device.device_kind`` (what rankings and the tuning cache
        are keyed by).
    """

    platform: str
    device_kind: str

    @classmethod
    def current(cls) -> "Target":
        """The default device (its kind as :func:`ops.tuning.current_device_kind` says,
        so :func:`ops.tuning.device_kind` renames it)."""
        platform = jax.default_backend()
        return cls(_PLATFORMS.get(platform, platform), cache.current_device_kind())

    @classmethod
    def of_kind(cls, device_kind: str) -> "Target":
        """A device by its kind alone: "cpu" is a CPU, "TPU ..." a TPU, anything else
        (``"NVIDIA H200"``, ...) a GPU.

        Raises:
          ValueError: not a non-empty string.
        """
        if not isinstance(device_kind, str) or not device_kind:
            raise ValueError(f"device_kind: expected a non-empty string such as 'NVIDIA H200', "
                             f"got {device_kind!r}.")
        kind = device_kind.lower()
        platform = "cpu" if kind == "cpu" else "tpu" if kind.startswith("tpu") else "gpu"
        return cls(platform, device_kind)

    @property
    def sm(self) -> str | None:
        """The CUDA architecture (``"sm_90"``) where known: the device's own when this
        process has it, else its family's (:func:`ops.tuning.rankings.device_family`)."""
        if self.platform != "gpu":
            return None
        device = jax.devices()[0]
        capability = getattr(device, "compute_capability", None)
        if device.device_kind == self.device_kind and capability:
            return "sm_" + "".join(str(capability).split(".")[:2])
        return rankings.device_family(self.device_kind)


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """One checked call of an op, before any implementation runs: what an
    implementation's ``run`` and ``supported`` read.

    Attributes:
      op: the :class:`Op`.
      args: the checked arguments, named as the op's ``entry`` takes them.
      target: the device the implementation is chosen for.
      pass_: "fwd" (the op alone), "fwd+bwd" (called under differentiation:
        ``jax.grad`` / ``jax.vjp`` traced it, :func:`ops._default.differentiated`)
        or "bwd" (an op's public backward function).
    """

    op: "Op"
    args: Mapping[str, Any]
    target: Target
    pass_: str = "fwd"

    @functools.cached_property
    def problem(self) -> Problem | None:
        """The call's :class:`Problem` (``op.problem_of``), or None for an op without one."""
        if self.op.problem_of is None:
            return None
        shape, dtype, variant = self.op.problem_of(**self.args)
        return self.op.problem(shape, dtype, variant)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run one op: what ``implementation=name`` runs.

    Attributes:
      name: a name from :data:`ops.IMPLEMENTATIONS`.
      run: the kernel entry, ``run(call)`` -> the op's result; it may raise
        NotImplementedError for a call it finds it cannot run after all (the
        next implementation is tried).
      config: the typed config class its kernels take (None: none, as for
        ``xla`` and ``cudnn``).
      supported: ``supported(call)`` -> None, or why this implementation cannot
        run ``call`` (read from the checked arguments and the target, before
        anything is traced: a head dim JAX's Triton lowering cannot tile, a
        feature cuDNN does not have, a GPU older than sm_90); None: every call.
      platforms: where the default may choose it ("cpu", "gpu", "tpu"); an
        explicit ``implementation=`` runs it anywhere.
      not_default: why the default never chooses it ("": it may), e.g. an
        implementation that breaks the op's memory promise.
    """

    name: str
    run: Callable[[Call], Any]
    config: type[KernelConfig] | None = None
    supported: Callable[[Call], str | None] | None = None
    platforms: tuple[str, ...] = ()
    not_default: str = ""

    @property
    def ours(self) -> bool:
        """Whether it runs this project's kernels (a pallas_core backend)."""
        return self.name in pl.BACKENDS

    def why_not(self, call: Call) -> str | None:
        """None when it can run ``call``, else why not."""
        return None if self.supported is None else self.supported(call)


class KernelConfig:
    """Base of an implementation's config: subclasses are frozen dataclasses (hashable,
    so a config can be a ``custom_vjp`` nondiff argument) whose fields are everything that
    changes the kernel; :func:`tunable` marks what the cache stores."""

    @classmethod
    def tunable_fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(_TUNABLE))

    @classmethod
    def heuristic(cls: type[_C], problem: Problem, device: Device) -> _C:
        """The config when nothing else is known."""
        raise NotImplementedError(f"{cls.__name__}.heuristic")

    @classmethod
    def candidates(cls: type[_C], problem: Problem, device: Device) -> tuple[_C, ...]:
        """The distinct configs worth timing for ``problem`` (default: the heuristic's)."""
        return (cls.heuristic(problem, device),)

    @classmethod
    def from_tuned(cls: type[_C], tuned: Mapping[str, int], problem: Problem, device: Device) -> _C:
        """A tuning cache entry's fields over the heuristic's."""
        return dataclasses.replace(cls.heuristic(problem, device), **tuned)

    def tuned(self) -> dict[str, int]:
        """The cache form: the tunable fields that are set."""
        return {name: getattr(self, name) for name in self.tunable_fields()
                if getattr(self, name) is not None}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the tuner exercises an op.

    Attributes:
      example: ``example(problem, implementation) -> (fn, args)``: a call of the op
        with ``problem``'s dims, dtype and variant as ``jax.ShapeDtypeStruct``
        arguments (integer arguments are labels below the last dim).
      shapes: the dims ``python -m benchmarks.tune`` fills the cache for.
      quick: one small problem's dims per op family (``--quick``), or none.
      variant: the variant fields an example call of given dims makes (None: plain).
      order: the tuner visits ops by ascending order (compute-bound ops first).
      training: like ``example``, a call that runs the kernels a training step
        runs with the problem's config (the forward that also stores residuals
        and the backward's products, e.g. ``jax.vjp`` of the op applied to a
        cotangent), or None (the op has no backward that takes the config). The
        compile filter (``ops/tuning/search.py``) compiles it beside ``example``,
        so a candidate whose training kernels spill registers or overflow shared
        memory is dropped.
    """

    example: Callable[[Problem, str], tuple[Callable, list]]
    shapes: tuple[tuple[int, ...], ...] = ()
    quick: tuple[tuple[int, ...], ...] = ()
    variant: Callable[[tuple[int, ...]], Mapping] | None = None
    order: int = 100
    training: Callable[[Problem, str], tuple[Callable, list] | None] | None = None


def vjp_training(example: Callable[[Problem, str], tuple[Callable, list]]
                 ) -> Callable[[Problem, str], tuple[Callable, list]]:
    """A :attr:`Tuning.training` made from an ``example``: the example's call and its
    backward, ``(*args, cotangent) -> (out, grads)`` (``jax.vjp`` over every argument,
    applied to a cotangent shaped like the output); for ops whose example call already
    keeps the residuals a training step keeps."""
    def training(problem: Problem, implementation: str):
        fn, args = example(problem, implementation)

        def step(*operands):
            *primals, cotangent = operands
            out, pullback = jax.vjp(fn, *primals)
            return out, pullback(cotangent)
        return step, [*args, jax.eval_shape(fn, *args)]

    return training


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    """One public op.

    Attributes:
      name: the public name (``ops.<name>``), the key of the registry and the cache.
      dims: names of the problem dims its configs are chosen by.
      configs: pallas_core backend -> the config class its kernels take (None: a
        kernel with no config); the backends the op has kernels for when it is
        registered (:meth:`implementations` is the live table, which later modules
        may add to).
      reference: the XLA reference (the ``"xla"`` implementation).
      check: the argument checks (None where they are part of the public function).
      variant: the op's :class:`Variant` class, or None.
      tuning: how the tuner exercises it, or None (not tuned).
      missing_reason: why an implementation it does not have is missing (for errors).
      entry: ``entry(name, **args)``: the op's checked call on implementation
        ``name`` (``"xla"`` and each backend of ``configs``), ``args`` being what its
        public function passes to :meth:`run`; None: the op is not run through
        :meth:`run` (its implementations only carry configs).
      problem_of: ``problem_of(**args) -> (shape, dtype, variant)``: the call's
        problem (its dims as ``dims`` names them, its dtype and variant fields or
        None), which the measured rankings of the default are keyed by; None: no
        ranking applies (the default takes its safe order).
      supported: implementation name -> ``supported(call)`` (see
        :class:`Implementation`) for the implementations registration makes.
      not_default: implementation name -> why the default never picks it (say
        ``{"xla": "it materialises the N x V logits"}``).
      function: the public function (``ops.<name>``), which
        :func:`ops.resolve_implementation` calls abstractly; None: not resolvable.
    """

    name: str
    dims: tuple[str, ...]
    configs: Mapping[str, type[KernelConfig] | None]
    reference: Callable
    check: Callable | None = None
    variant: type[Variant] | None = None
    tuning: Tuning | None = None
    missing_reason: str = ""
    entry: Callable[..., Any] | None = None
    problem_of: Callable[..., tuple] | None = None
    supported: Mapping[str, Callable[[Call], str | None]] = dataclasses.field(default_factory=dict)
    not_default: Mapping[str, str] = dataclasses.field(default_factory=dict)
    function: Callable | None = None

    @property
    def implementations(self) -> Mapping[str, Implementation]:
        """Every registered implementation of the op, by name (``"xla"`` first)."""
        return dict(_IMPLEMENTATIONS.get(self.name, {}))

    @property
    def kernel_backends(self) -> tuple[str, ...]:
        """The implementations that run our kernels (pallas_core backends)."""
        return tuple(name for name, impl in self.implementations.items() if impl.ours)

    def config_type(self, implementation: str) -> type[KernelConfig]:
        """The config class of ``implementation``.

        Raises:
          NotImplementedError: the op has no kernel with a config for it.
        """
        found = self.implementations.get(implementation)
        if found is None or found.config is None:
            raise NotImplementedError(f"{self.name}: no kernel for implementation="
                                      f"{implementation!r}{self.missing_reason}.")
        return found.config

    def tunable_fields(self) -> tuple[str, ...]:
        """Every tunable field of the op's config classes (what a cache entry may hold)."""
        names: dict[str, None] = {}
        classes = [impl.config for impl in self.implementations.values()] or list(self.configs.values())
        for cls in classes:
            if cls is not None:
                names.update(dict.fromkeys(cls.tunable_fields()))
        return tuple(names)

    def problem(self, shape: Sequence[int], dtype, variant: Mapping | None = None) -> Problem:
        """The :class:`Problem` of a call (``variant``: fields that differ from a plain call).

        Raises:
          ValueError: ``shape`` does not have one int per dim; a variant field the
            op does not have.
        """
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(self.dims):
            raise ValueError(f"shape: {self.name} takes {len(self.dims)} dims {self.dims}, got "
                             f"{shape!r}.")
        full = cache.full_variant(self.name, variant, f"{self.name}: variant")
        return Problem(self.name, shape, np.dtype(dtype).name, tuple(sorted(full.items())))

    def run(self, implementation, /, *, pass_: str | None = None, **args):
        """The op's checked call (``args``, as ``entry`` takes them) on the first
        implementation that runs it.

        ``implementation`` is the public ``implementation=`` (:mod:`ops._implementation`):
        a name or a sequence is tried in order; None is the default for the call and
        its device (:func:`ops._default.choose`: XLA on a CPU, the fastest measured
        implementation that can run the call on a GPU). An implementation the op
        does not have, one whose ``supported`` refuses the call, and one whose entry
        raises NotImplementedError are skipped. ``pass_``: "bwd" for an op's public
        backward function; otherwise the call is "fwd", or "fwd+bwd" when traced
        under differentiation.

        Raises:
          ValueError: a bad ``implementation``.
          NotImplementedError: the last implementation's, when none runs.
        """
        check_implementation(implementation, self.name)
        call = Call(self, args, Target.current(), pass_ or _default.pass_of(args))
        if _CAPTURE.get():
            raise CapturedCall(call)
        if implementation is None:
            names = _default.choose(self, call).order
        else:
            names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
        table, error = self.implementations, None
        for name in names:
            try:
                found = table.get(name)
                if found is None:
                    raise NotImplementedError(
                        f"{self.name}: implementation={name!r} has no kernel yet"
                        f"{self.missing_reason}; available: {', '.join(map(repr, table))}.")
                why = found.why_not(call)
                if why is not None:
                    raise NotImplementedError(f"{self.name}: implementation={name!r} cannot run "
                                              f"this call: {why}.")
                return found.run(call)
            except NotImplementedError as e:
                error = e
        raise error

    def select(self, problem: Problem, implementation: str, explicit: KernelConfig | None = None,
               **hints) -> KernelConfig:
        """The config of ``problem`` on ``implementation``: ``explicit`` when given (the
        caller's tiles), else the tuning cache's entry for the device, else the heuristic
        (``hints``: keyword arguments of the config class's ``heuristic`` beyond the
        problem and device, for an op whose heuristic takes some).

        Raises:
          NotImplementedError: no kernel for ``implementation``.
          ops.tuning.TuningCacheError: a malformed user or packaged cache file.
        """
        cls = self.config_type(implementation)
        if explicit is not None:
            return explicit
        device = Device.current(implementation)
        tuned = cache.lookup(self.name, implementation, problem.dtype, problem.shape,
                             problem.variant_dict())
        if tuned is not None:
            return cls.from_tuned(tuned, problem, device)
        return cls.heuristic(problem, device, **hints)


class CapturedCall(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by :meth:`Op.run` inside :func:`capturing`: the checked call, not run."""

    def __init__(self, call: Call):
        super().__init__(call.op.name)
        self.call = call


_CAPTURE: contextvars.ContextVar[bool] = contextvars.ContextVar("op_capture", default=False)


@contextlib.contextmanager
def capturing():
    """Within the block, an op called stops at :meth:`Op.run` and raises
    :class:`CapturedCall` with its checked call (nothing is traced or run):
    how :func:`ops.resolve_implementation` and the rankings' tools see a call."""
    token = _CAPTURE.set(True)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


def fit(block: int, dim: int, floor: int = 16) -> int:
    """``block`` clamped to ``dim`` rounded up to a power of two (at least ``floor``):
    a candidate tile no bigger than the problem needs."""
    return min(block, max(floor, 1 << max(0, int(dim) - 1).bit_length()))


_REGISTRY: dict[str, Op] = {}
_DIMS: dict[str, tuple[str, ...]] = {}
_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {}
# Where the default may choose XLA: on every platform (it is what the user already has).
_XLA_PLATFORMS = ("cpu", "gpu", "tpu")


def _check_config_class(op: str, name: str, cls) -> None:
    if cls is None:
        return
    if (not (isinstance(cls, type) and issubclass(cls, KernelConfig))
            or not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen):
        raise ValueError(f"{op}: the config of {name!r} must be a frozen dataclass "
                         f"subclassing KernelConfig, got {cls!r}.")


def _entry_runner(op: Op, name: str) -> Callable[[Call], Any]:
    def run(call: Call):
        if op.entry is None:
            raise NotImplementedError(f"{op.name}: registered without an entry; nothing to run.")
        return op.entry(name, **call.args)
    return run


def _declare(op: Op) -> None:
    cache.declare(op.name, op.tunable_fields(), {} if op.variant is None else op.variant.defaults())


def register(op: Op) -> Op:
    """Adds ``op`` to the registry (and its config fields and variant to the tuning
    cache's schema) with an :class:`Implementation` of ``"xla"`` and of each backend of
    ``op.configs``, running ``op.entry``; returns it.

    Raises:
      ValueError: another op of that name, a backend not in
        :data:`ops._implementation.KERNEL_BACKENDS`, or a config class that is not a
        frozen :class:`KernelConfig` dataclass.
    """
    if op.name in _REGISTRY and _REGISTRY[op.name] is not op:
        raise ValueError(f"op {op.name!r} is registered already.")
    for backend, cls in op.configs.items():
        if backend not in KERNEL_BACKENDS:
            raise ValueError(f"{op.name}: configs names {backend!r}; expected some of "
                             f"{KERNEL_BACKENDS}.")
        _check_config_class(op.name, backend, cls)
    table = {"xla": Implementation("xla", _entry_runner(op, "xla"),
                                   supported=op.supported.get("xla"), platforms=_XLA_PLATFORMS,
                                   not_default=op.not_default.get("xla", ""))}
    for backend, cls in op.configs.items():
        hardware = pl.backend_traits(backend).hardware
        table[backend] = Implementation(
            backend, _entry_runner(op, backend), config=cls, supported=op.supported.get(backend),
            platforms=(hardware,) if hardware in _XLA_PLATFORMS else (),
            not_default=op.not_default.get(backend, ""))
    _IMPLEMENTATIONS[op.name] = table
    _declare(op)
    _REGISTRY[op.name] = op
    _DIMS[op.name] = tuple(op.dims)
    return op


def register_implementation(op_name: str, implementation: Implementation, *,
                            replace: bool = False) -> Implementation:
    """Adds ``implementation`` to the registered op ``op_name``: how a new backend module
    (Mosaic GPU kernels, a vendor library) makes ``implementation=name`` run it, and
    lets the default choose it where the rankings measured it, with no edit in the op.

    Raises:
      KeyError: no such op.
      ValueError: a name not in :data:`ops.IMPLEMENTATIONS`, one the op has already
        (unless ``replace``), or a config class that is not a frozen
        :class:`KernelConfig` dataclass.
    """
    op = get(op_name)
    name = implementation.name
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"{op_name}: implementation name {name!r}; expected one of "
                         f"{IMPLEMENTATIONS}.")
    if name in _IMPLEMENTATIONS[op_name] and not replace:
        raise ValueError(f"{op_name}: implementation {name!r} is registered already "
                         "(replace=True replaces it).")
    _check_config_class(op_name, name, implementation.config)
    _IMPLEMENTATIONS[op_name][name] = implementation
    _declare(op)
    return implementation


def registered() -> tuple[Op, ...]:
    """Every registered op, in registration order."""
    return tuple(_REGISTRY.values())


def get(name: str) -> Op:
    """The registered op ``name``.

    Raises:
      KeyError: no such op (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no op {name!r} is registered; registered: {sorted(_REGISTRY)}.") from None
