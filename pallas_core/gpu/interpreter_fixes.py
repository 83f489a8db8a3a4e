"""What pallas_core adds to JAX 0.10.2's GPU interpret mode (``jax._src.pallas.mosaic_gpu.interpret``).

JAX's interpreter runs a Mosaic GPU kernel's jaxpr on the CPU, one Python
thread per warpgroup, with GMEM / SMEM buffers, barriers and TMA copies
simulated in a shared-memory object and a vector-clock race detector. Where
it leaves out something a real kernel does, this module fills it in, each in
the hardware's meaning (NVIDIA's PTX ISA for ``cp.async.bulk.tensor``), so
that kernels are checked on the CPU as they will run:

* **Predicated TMA stores.** ``copy_smem_to_gmem(..., predicate=p)`` (JAX's
  ``emit_pipeline`` writes every output block this way) raised
  ``NotImplementedError``; it now copies when ``p`` holds.
* **TMA at the array's edge.** A TMA load of a box that runs past the array
  fills the outside with zeros (``copy_gmem_to_smem``'s default
  ``oob_mode=OOBFillMode.ZEROS``; the interpreter raised, or filled NaN);
  a TMA store writes only the part inside the array (the interpreter dropped
  the whole store). Plain loads and stores past an edge still raise.
* **Races through TMA stores and ``wgmma``.** JAX's detector sees Ref reads
  and writes and TMA loads; a TMA store's read of SMEM and write of GMEM, and
  a ``wgmma``'s reads of its SMEM operands, are now checked too, at the
  moment they are issued (the interpreter runs both eagerly; the window until
  ``wait_smem_to_gmem`` / ``wgmma_wait`` is not modelled, nor are those
  waits, nor ``commit_smem``).
* **Races fail.** JAX prints ``RACE DETECTED`` and sets a flag; for kernels
  pallas_core runs (:func:`mark`), the end of the kernel raises
  :class:`RaceError` naming the kernel, with the reports.
* **Each warpgroup's program is compiled once.** JAX runs every warpgroup of
  every block as a jitted program in its own thread, and compiled that
  program again for each (``thread_map._run_jaxpr``: ``trace().lower().compile()``
  every call, about half a second per warpgroup per block on this host); it
  is now compiled once per kernel and reused (a small cache keyed by the
  program and its argument types).
* **Trailing barrier phases may go unobserved.** JAX's interpreter raised,
  when a barrier was freed, if a warpgroup had waited on some of its phases
  but not the last ones: a producer that stops waiting on its
  "slot consumed" barriers once it has nothing left to load (JAX's own
  attention kernel) does that, and is correct on the GPU (nothing waits on
  those phases). A phase skipped before a later wait still raises, at that
  wait.
* **A failing warpgroup fails the kernel.** When one warpgroup's program
  raised, the others waited on their barriers for ever (JAX's barrier wait
  has no timeout), so the kernel hung; now the others stop at their next
  barrier wait, raising an error that carries the first one's.
* **A failed kernel does not poison the next.** JAX leaves its simulated
  GPU allocated when a kernel raises, and asks for
  ``reset_gpu_interpret_mode_state()``; the next kernel's start now resets
  such leftover state itself (one simulated device: the state can only be a
  failed kernel's).

:func:`apply` installs all of this once (idempotent); pallas_core calls it
before it traces a kernel for the interpreter. It replaces functions of JAX's
modules for the whole process, so JAX's own ``force_gpu_interpret_mode``
kernels get the edge, predicate and race-coverage fixes too (not the raising,
which is for kernels :func:`mark`\\ ed).
"""
from __future__ import annotations

import builtins
import collections
import functools
import threading
import weakref

import jax
import numpy as np


class RaceError(RuntimeError):
    """The GPU interpret mode's race detector found a data race in a kernel."""


_APPLIED = False
_LOCK = threading.Lock()
_TLS = threading.local()  # .tma_load: a TMA load is in progress on this thread
# id -> weak reference of each marked params object (by identity: params compare equal by value,
# and a user's equal params given to JAX directly are not ours).
_MARKED: dict[int, weakref.ref] = {}
_REPORTS: list[str] = []  # this kernel's race reports, as JAX's detector printed them


def mark(params):
    """Races found while interpreting with ``params`` raise :class:`RaceError`. Returns ``params``."""
    key = id(params)
    _MARKED[key] = weakref.ref(params, lambda _: _MARKED.pop(key, None))
    return params


def is_marked(params) -> bool:
    ref = _MARKED.get(id(params))
    return ref is not None and ref() is params


def apply() -> None:
    """Installs the fixes of this module into JAX's GPU interpreter (once)."""
    global _APPLIED
    with _LOCK:
        if _APPLIED:
            return
        from jax._src.pallas.mosaic.interpret import race_detection_state
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

        from jax._src.pallas.mosaic.interpret import thread_map

        from jax._src.pallas.mosaic_gpu.interpret import shared_memory as gpu_memory

        thread_map._run_jaxpr = _run_jaxpr_compiled_once
        gpu_memory.threading = _AbortableThreading()
        gpu_memory.Barrier.deallocate = _deallocate_barrier
        gc.copy_smem_to_gmem = _copy_smem_to_gmem
        _wrap_tma_load(gc)
        gc.wgmma = _checked_wgmma(gc.wgmma)
        gc._initialize_shared_memory = _resetting_init(gc._initialize_shared_memory)
        race_detection_state.print = _recording_print  # module global shadows the builtin
        ipc.interpret_pallas_call = _race_checked_call(ipc.interpret_pallas_call)
        _APPLIED = True


# --- one compile per warpgroup program ----------------------------------------------------------

_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_COMPILE_LOCK = threading.Lock()
_COMPILED_MAX = 32


def _signature(tree):
    return tuple((np.shape(x), np.result_type(x)) for x in jax.tree.leaves(tree))


def _eval(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr_compiled_once(jaxpr, consts, *args):
    """``thread_map._run_jaxpr``: runs one warpgroup's program, compiling it the first time."""
    key = (id(jaxpr), _signature(consts), _signature(args))
    with _COMPILE_LOCK:  # the other warpgroups of the block wait for the one compile
        entry = _COMPILED.get(key)
        if entry is None or entry[0] is not jaxpr:
            compiled = jax.jit(_eval, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
            entry = _COMPILED[key] = (jaxpr, compiled)  # the jaxpr kept alive: its id stays its own
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        else:
            _COMPILED.move_to_end(key)
    try:
        entry[1](consts, *args)
    except Exception as e:
        if _ABORT_CAUSE[0] is None:
            _ABORT_CAUSE[0] = e
        _ABORT.set()
        raise


def _deallocate_barrier(self):
    """``Barrier.deallocate`` without the check that every warpgroup observed every phase."""
    with self.cv:
        self.ref_count -= 1


# --- a failing warpgroup stops the others ------------------------------------------------------

_ABORT = threading.Event()  # set when a warpgroup's program raised; cleared when a kernel starts
_ABORT_CAUSE: list = [None]


class _AbortableCondition(threading.Condition):
    """The condition a simulated barrier waits on: it wakes every 0.1 s to give up
    when another warpgroup of the kernel has failed (a spurious wake-up is allowed:
    the barrier re-checks its phase)."""

    def wait(self, timeout=None):
        if _ABORT.is_set():
            raise RuntimeError("GPU interpret mode: this warpgroup stopped at a barrier because "
                               f"another warpgroup of the kernel raised: {_ABORT_CAUSE[0]!r}")
        return super().wait(0.1 if timeout is None else min(timeout, 0.1))


class _AbortableThreading:
    """``threading`` as the GPU interpreter's barriers see it: abortable conditions."""

    Condition = _AbortableCondition

    def __getattr__(self, name):
        return getattr(threading, name)


# --- TMA stores: predicate, edge clipping, race checks -------------------------------------


def _full_range(rnge, shape):
    return tuple(rnge) + tuple(slice(0, d) for d in shape[len(rnge):])


def _clipped(rnge, shape, value):
    """``rnge`` cut to ``shape`` and the part of ``value`` that lands there (None if nothing)."""
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    clipped = interpret_utils.clip_range_to_shape(rnge, tuple(shape))
    if clipped is None:
        return None, None
    keep = tuple(slice(0, len(range(c.start, c.stop, c.step or 1))) for c in clipped
                 if isinstance(c, slice))
    return clipped, value[keep]


def _copy_smem_to_gmem(*, token, device_id, grid_point_coords, thread_id,
                       src_allocation_key_as_array, src_transforms,
                       dst_allocation_key_as_array, dst_transforms, predicate,
                       source_info, commit_group, reduction_op):
    """A TMA store (``cp.async.bulk.tensor`` shared -> global): skipped where the
    predicate is False, clipped to the array, race-checked as a read of SMEM and a
    write of GMEM by the issuing warpgroup."""
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    del commit_group, grid_point_coords
    if reduction_op is not None:
        raise NotImplementedError("GPU interpret mode: copy_smem_to_gmem with reduction_op.")
    if predicate is not None and not bool(np.asarray(predicate)):
        return token
    device_id, thread_id = int(device_id), int(thread_id)
    src_key = gc.HostAllocationKey.from_array(src_allocation_key_as_array)
    dst_key = gc.HostAllocationKey.from_array(dst_allocation_key_as_array)
    src_range = interpret_utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(src_transforms)))
    dst_range = interpret_utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(dst_transforms)))
    memory = gc._get_shared_memory()
    thread = memory.get_global_thread_id(device_id, thread_id)
    value, _, clock = memory.get_buffer_content(src_key, src_range, thread)
    if value is None:
        raise IndexError(f"GPU interpret mode: TMA store reads {src_range} outside its SMEM "
                         f"buffer {src_key}.")
    if memory.detect_races:
        gc.get_races().check_read(device_id, thread_id, clock, src_key, src_range,
                                  source_info=source_info)
    with memory.lock:
        shape = memory.mem[dst_key].logical_shape
    rnge, value = _clipped(_full_range(dst_range, shape), shape, value)
    if rnge is None:
        return token
    _, _, clock = memory.store_buffer_content(dst_key, rnge, value, thread)
    if memory.detect_races:
        gc.get_races().check_write(device_id, thread_id, clock, dst_key, rnge,
                                   source_info=source_info)
    return token


# --- TMA loads past the edge read zeros ------------------------------------------------------


def _wrap_tma_load(gc):
    execute = gc.DeviceLocalMemoryTransfer.execute
    handle = gc._handle_out_of_bounds_read

    @functools.wraps(execute)
    def tma_execute(self, token):
        _TLS.tma_load = True
        try:
            return execute(self, token)
        finally:
            _TLS.tma_load = False

    @functools.wraps(handle)
    def zero_filled(ret, full_read_shape, shape, dtype, *args, **kwargs):
        if not getattr(_TLS, "tma_load", False):
            return handle(ret, full_read_shape, shape, dtype, *args, **kwargs)
        out = np.zeros(full_read_shape, dtype)
        if ret is not None:
            out[tuple(slice(s) for s in ret.shape)] = ret
        return out

    gc.DeviceLocalMemoryTransfer.execute = tma_execute
    gc._handle_out_of_bounds_read = zero_filled


# --- wgmma operands are reads -----------------------------------------------------------------


def _checked_wgmma(wgmma):
    @functools.wraps(wgmma)
    def checked(*, token, device_id, thread_id, a_allocation_key_as_array, a_transforms,
                b_allocation_key_as_array, b_transforms, source_info=None, **kwargs):
        from jax._src.pallas.mosaic.interpret import utils as interpret_utils
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        memory = gc._get_shared_memory()
        if memory.detect_races:
            dev, tid = int(device_id), int(thread_id)
            thread = memory.get_global_thread_id(dev, tid)
            for key, transforms in ((a_allocation_key_as_array, a_transforms),
                                    (b_allocation_key_as_array, b_transforms)):
                key = gc.HostAllocationKey.from_array(key)
                rnge = interpret_utils.to_range(jax.tree.map(int, gc._remove_noop_transforms(transforms)))
                _, _, clock = memory.get_buffer_content(key, rnge, thread)
                gc.get_races().check_read(dev, tid, clock, key, rnge, source_info=source_info)
        return wgmma(token=token, device_id=device_id, thread_id=thread_id,
                     a_allocation_key_as_array=a_allocation_key_as_array, a_transforms=a_transforms,
                     b_allocation_key_as_array=b_allocation_key_as_array, b_transforms=b_transforms,
                     source_info=source_info, **kwargs)
    return checked


# --- leftover state, race reports, raising -------------------------------------------------------


def _resetting_init(initialize):
    @functools.wraps(initialize)
    def init(*, token, num_gpus, **kwargs):
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
        if int(num_gpus) == 1 and gc._shared_memory is not None:
            gc.reset_gpu_interpret_mode_state()  # left by a kernel that raised
        _REPORTS.clear()
        _ABORT.clear()
        _ABORT_CAUSE[0] = None
        return initialize(token=token, num_gpus=num_gpus, **kwargs)
    return init


def _recording_print(*args, **kwargs):
    _REPORTS.append(" ".join(str(a) for a in args))
    builtins.print(*args, **kwargs)


def _race_checked_call(interpret_pallas_call):
    @functools.wraps(interpret_pallas_call)
    def call(*args, interpret_params, **params):
        outs = interpret_pallas_call(*args, interpret_params=interpret_params, **params)
        if not (interpret_params.detect_races and is_marked(interpret_params)):
            return outs
        from jax._src import callback
        name = params.get("name") or "kernel"
        callback.io_callback(functools.partial(_raise_on_race, name),
                             jax.ShapeDtypeStruct((), np.int32), ordered=True)
        return outs
    return call


def _raise_on_race(name):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gc
    races = gc._races
    if races is not None and races.races_found:
        reports = "\n".join(_REPORTS[:4]) or "(no report recorded)"
        more = f"\n... and {len(_REPORTS) - 4} more" if len(_REPORTS) > 4 else ""
        raise RaceError(f"pallas_core.gpu.RaceError: Mosaic GPU kernel {name!r}: the GPU interpret "
                        f"mode's race detector found a data race (accesses by different "
                        f"warpgroups or the TMA unit, not ordered by a barrier):\n{reports}{more}")
    return np.int32(0)
