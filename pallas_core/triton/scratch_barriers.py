"""Where a program's memory scratch needs a barrier between its accesses.

A scratch buffer accessed other than whole (slices, masked accesses,
atomics) lives in global memory, one private slice per program
(:meth:`pallas_core.triton.codegen.KernelWriter._scratch_ref`). The threads
of a program do not hold the same elements at every access: a block stored
in one register layout and loaded back in another (whole after two sliced
stores, or feeding a dot) has each thread read elements other warps stored.
Triton orders shared memory for the kernel writer, not global memory: a
``tl.store`` then a ``tl.load`` of the same addresses compile to
``st.global`` then ``ld.global`` with no ``bar.sync`` between them, so a
thread may read an element before the warp that stores it has. Triton's
interpreter runs a program's lanes in order and cannot show the race.

The writer therefore emits ``tl.debug_barrier()`` (``bar.sync 0``: every
thread of the program waits there, and its memory accesses before it are
performed for all the program's threads after it) between two accesses to
one scratch buffer whose elements may overlap where one of them writes:

* a store, then a load (read after write);
* a load, then a store (write after read: another thread may not have read
  the element the store overwrites);
* a store, then a store (the later must win in every element);
* an atomic and a plain access either way (two atomics need none).

Elements overlap unless some array dim takes static, disjoint index ranges
in the two accesses (``scratch[:, 0:48]`` and ``scratch[:, 48:96]``); a
dynamic index may take any value. A barrier orders everything before it, so
one barrier serves every pending access.

Control flow, written in program order by the writer: the branches of an
``if`` each start from the state before it and meet in their union (a
branch's condition is a scalar, the same in every thread, so a barrier in a
branch is reached by all of them). A loop body runs after its own end: at
the end of the body, the accesses pending there are checked against those
the body makes before its first barrier (on some path), and a barrier ends
the body where they conflict; after the loop, the state is the union of the
state before it (no iteration) and at the end of the body.

Kernels without memory scratch get no barrier, so their source is unchanged.
"""
from __future__ import annotations

import dataclasses

LOAD, STORE, ATOMIC = "load", "store", "atomic"

# Per array dim, the first and last element index an access may touch, or None: any.
Region = tuple[tuple[int, int] | None, ...]


@dataclasses.dataclass(frozen=True)
class Access:
    buffer: int  # the scratch buffer's index
    kind: str  # LOAD, STORE or ATOMIC
    region: Region


def overlaps(a: Region, b: Region) -> bool:
    """Whether two accesses' elements may overlap: no dim has known, disjoint ranges."""
    return not any(x is not None and y is not None and (x[1] < y[0] or y[1] < x[0])
                   for x, y in zip(a, b))


def conflicts(earlier: Access, later: Access) -> bool:
    """Whether ``later`` must wait for ``earlier`` at a barrier (same buffer, a write
    on either side that is not atomic against atomic, overlapping elements)."""
    if earlier.buffer != later.buffer or LOAD == earlier.kind == later.kind:
        return False
    if ATOMIC == earlier.kind == later.kind:
        return False
    return overlaps(earlier.region, later.region)


@dataclasses.dataclass
class _Loop:
    exposed: list[Access]  # accesses of the body made with no barrier since its start (on some path)
    open: bool = True  # no barrier since the body's start on some path


@dataclasses.dataclass(frozen=True)
class State:
    """What :meth:`BarrierPlan.save` returns: the accesses pending since the last barrier,
    and per open loop whether a path from its body's start has no barrier."""

    pending: tuple[Access, ...]
    open: tuple[bool, ...]


class BarrierPlan:
    """The writer's record of memory-scratch accesses since the last barrier.

    The writer calls :meth:`access` before emitting each access to a memory
    scratch buffer, and emits ``tl.debug_barrier()`` first where it returns
    True; :meth:`barrier` for every barrier the kernel has anyway;
    :meth:`loop_start` / :meth:`loop_end` around a loop's body and
    :meth:`save` / :meth:`restore` / :meth:`merge` around branches.
    """

    def __init__(self):
        self.pending: list[Access] = []
        self.loops: list[_Loop] = []

    def access(self, buffer: int, kind: str, region: Region) -> bool:
        """Records an access; True: a barrier must come before it."""
        new = Access(buffer, kind, tuple(region))
        needed = any(conflicts(old, new) for old in self.pending)
        if needed:
            self.barrier()
        if new not in self.pending:
            self.pending.append(new)
        for loop in self.loops:
            if loop.open and new not in loop.exposed:
                loop.exposed.append(new)
        return needed

    def barrier(self) -> None:
        """Records a barrier: nothing is pending after it."""
        self.pending = []
        for loop in self.loops:
            loop.open = False

    def save(self) -> State:
        return State(tuple(self.pending), tuple(loop.open for loop in self.loops))

    def restore(self, state: State) -> None:
        self.pending = list(state.pending)
        for loop, was_open in zip(self.loops, state.open):
            loop.open = was_open

    def merge(self, states) -> None:
        """The state where control-flow paths meet: their union."""
        states = list(states)
        self.pending = list(dict.fromkeys(a for s in states for a in s.pending))
        for k, loop in enumerate(self.loops):
            loop.open = any(s.open[k] for s in states)

    def loop_start(self) -> State:
        """Before a loop's body: returns the state on entry, for :meth:`loop_end`."""
        entry = self.save()
        self.loops.append(_Loop(exposed=[]))
        return entry

    def loop_end(self, entry: State) -> bool:
        """At the end of a loop's body; True: a barrier must end the body (accesses pending
        there conflict with the body's accesses the next iteration makes before a barrier).
        Leaves the state after the loop."""
        loop = self.loops[-1]
        needed = any(conflicts(old, new) for old in self.pending for new in loop.exposed)
        if needed:
            self.barrier()
        self.loops.pop()
        self.merge([entry, self.save()])
        return needed
