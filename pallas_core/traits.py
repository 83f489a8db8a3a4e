"""What a backend is, as the ops ask about it: :class:`BackendTraits` (docs/design.md §10).

Kernels are written once for every backend; what differs is a handful of
facts about the code a backend makes and the hardware it runs on: whether
blocks must be powers of two, the smallest product a dot takes, the tiling
of a block's last two dims, whether a grid axis can carry an accumulator
from one step to the next, where scalar tables live. Each backend module
declares its traits when it registers itself
(:func:`pallas_core.registry.register_backend`), and the ops read them
(:func:`pallas_core.backend_traits`, ``ops._op.Device.traits``) instead of
comparing backend names: a new backend that declares its traits gets every
op's tile rules without an edit to the ops.

Each field is a constraint of the backend's lowering or a fact of its
hardware, with the source of the constraint in its description; the one
preference among them (:attr:`BackendTraits.walk`) says so.
"""
from __future__ import annotations

import dataclasses
from typing import Any

GRID = "grid"
LOOP = "loop"
HARDWARE = ("gpu", "tpu", "any")


@dataclasses.dataclass(frozen=True)
class BackendTraits:
    """The facts about one backend that decide an op's tiles and launch parameters.

    Attributes:
      name: the backend ("interpret", "triton", "pallas_triton", "mosaic_tpu",
        "mosaic_gpu").
      hardware: what the kernels run on, so what heuristics size tiles for:
        ``"gpu"`` (registers and shared memory, tensor cores; programs run
        concurrently), ``"tpu"`` (VMEM, 8 x 128 vector registers and the MXU;
        the grid runs in order on one core, or two with megacore) or ``"any"``
        (the kernel is run as JAX operations on whatever device JAX has:
        tiles are sized so tests see edge blocks, not for speed).
      interpreted: every kernel runs in pallas_core's interpreter (the
        ``interpret`` backend). Distinct from ``ops._op.Device.interpreter``,
        a fact of one call: ``triton`` traced now for Triton's CPU interpreter.
      triton: the kernels become Triton programs: ``num_warps`` /
        ``num_stages`` (:class:`pallas_core.triton.CompilerParams`) apply, and
        every tensor in a program has power-of-two dims (``tl.arange``), so row
        tiles are padded to one.
      power_of_two_blocks: every BlockSpec block dim must be a power of two or
        the whole array dim (walked in power-of-two slices): JAX's Triton
        lowering refuses other tensor shapes. Our Triton lowering pads a block
        to a power of two and masks the padding itself, so it takes any block.
        ``pallas_call`` checks it (:func:`pallas_core.validation.check_pow2`).
      min_dot: the smallest M, N and K of a ``pl.dot`` on a block: 16 on our
        Triton lowering (``tl.dot``'s minimum; it refuses smaller products),
        1 where the lowering takes any product (JAX's Triton lowering emits
        ``tt.dot`` directly, and Triton pads a small product onto ``mma.sync``:
        a 64 x 64 x 8 bf16 dot compiles for sm_90, without ``wgmma``). A legal
        bound, not a fast one: tensor-core tiles want 16 or more everywhere.
      tile: ``(sublanes, lanes)``: each of a block's last two dims is a
        multiple of this or the whole array dim (Mosaic TPU's (8, 128) vector
        register tiling; ``pallas_call`` checks it,
        :func:`pallas_core.validation.check_tpu_tiling`); (1, 1) where any
        block is laid out.
      sequential_grid: a grid axis marked ``"arbitrary"`` runs in order with
        the output block resident across it, so a kernel may accumulate over
        grid steps (the interpreter and Mosaic TPU walk the grid in order; our
        Triton lowering runs arbitrary axes as a loop inside each program).
        False on JAX's Triton lowering, which runs every grid point
        concurrently: a reduction there is a loop inside the kernel, and
        ``pallas_call`` refuses an output block revisited along a grid axis
        (:func:`pallas_core.validation.resolve_semantics`).
      walk: how a kernel with a long reduction (attention's keys, a grouped
        matmul's K) walks it by default: ``"loop"`` (one program per output
        tile, an in-kernel loop keeping the accumulator in registers: GPUs run
        programs concurrently) or ``"grid"`` (grid steps, the accumulator in
        scratch: the grid runs in order). A preference, not a constraint,
        except where ``sequential_grid`` is False (then ``"loop"``).
      dynamic_grid: the lowering takes grid dims computed under jit (traced
        int32 scalars): the interpreter walks them in a ``while_loop``, Mosaic
        TPU reads them at run time. The GPU lowerings fix the launch grid when
        they compile, so there a kernel takes an upper bound and skips the
        extra programs with ``pl.when`` (``pallas_call`` refuses a traced dim).
      scalar_prefetch: the lowering takes
        :class:`pallas_core.tpu.PrefetchScalarGridSpec` (index maps reading
        scalar operands); JAX's Triton and Mosaic GPU lowerings do not, so
        such tables are ordinary operands there.
      scalar_memory: the memory space for small scalar tables a kernel reads
        per program (block ranges, offsets): :data:`pallas_core.tpu.SMEM` on
        Mosaic TPU, whose vector memory cannot be read as scalars; None (the
        default space) elsewhere.
      through_jax: the call is handed to JAX's own Pallas
        (``jax.experimental.pallas``) to lower: its checks and limits apply.
    """

    name: str
    hardware: str
    interpreted: bool = False
    triton: bool = False
    power_of_two_blocks: bool = False
    min_dot: int = 1
    tile: tuple[int, int] = (1, 1)
    sequential_grid: bool = True
    walk: str = GRID
    dynamic_grid: bool = False
    scalar_prefetch: bool = True
    scalar_memory: Any = None
    through_jax: bool = False

    def __post_init__(self):
        if self.hardware not in HARDWARE:
            raise ValueError(f"hardware: expected one of {HARDWARE}, got {self.hardware!r}.")
        if self.walk not in (GRID, LOOP):
            raise ValueError(f"walk: expected {GRID!r} or {LOOP!r}, got {self.walk!r}.")
        if self.walk == GRID and not self.sequential_grid:
            raise ValueError(f"walk: {self.name!r} runs grid points concurrently "
                             f"(sequential_grid=False), so it walks reductions as a loop.")
        if (not isinstance(self.tile, tuple) or len(self.tile) != 2
                or not all(isinstance(t, int) and t >= 1 for t in self.tile)):
            raise ValueError(f"tile: expected a pair of positive ints, got {self.tile!r}.")
        if not isinstance(self.min_dot, int) or self.min_dot < 1:
            raise ValueError(f"min_dot: expected a positive int, got {self.min_dot!r}.")

    def fits_tile(self, block: int, dim: int, axis: int = -1) -> bool:
        """Whether a block of ``block`` along an array dim of ``dim`` is laid out:
        a multiple of :attr:`tile` on that axis (``-1`` lanes, ``-2`` sublanes),
        or the whole dim."""
        return block == dim or block % self.tile[axis] == 0
