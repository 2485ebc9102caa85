"""A team of numba's threads that stays together for a whole CPU step, meeting at spin barriers.

A batch-1 decode step is ~45 small parallel loops (four matmuls and attention a layer), and each
``prange`` is an OpenMP fork and join (docs/perf-log/code-comments.md#fork-and-join), with
the norms, RoPE and the split attention's merge run by one thread between them while the other
waits. A step run as one ``prange(team)``, each iteration a team member that takes its share of
every op and waits for the others at a barrier where an op's output is needed whole, pays one
fork and join a step (as llama.cpp's thread pool does); a barrier between two cores is one cache
line passed back and forth.

The pieces, all compiled (numba ``@intrinsic``: LLVM atomics, the CPU's spin-wait hint):

* :func:`rendezvous`: every member arrives before any works. The threading layer is what puts
  the iterations of a ``prange`` on threads; if two landed on one thread (a layer with work
  stealing, fewer threads than asked for), the first would wait at its first barrier for a
  partner that can only start after it returns. So members first wait for each other, for a
  bounded time, and if the team is not complete by then it is called off, atomically, and no
  member does any work: the caller then runs the step another way.
* :func:`claim`: an op's work as chunks, a run of them a member, taken in order, then the chunks
  left in the others' runs, so that a member whose core runs slower for a while (another VM on its
  host core, an interrupt) does fewer: with fixed halves, one member of two spent a share of a
  batch-1 step waiting at barriers while the other finished its half
  (docs/perf-log/cpu-anchors.md#2026-11-26-thread-team).
* :func:`barrier`: a counter that only grows within a region; barrier ``k`` is passed once it
  reaches ``parties * k``. Waiting spins with the CPU's pause hint, and yields the core to the
  scheduler after a while, so that a member whose partner was preempted (more runnable threads
  than cores: the server, a load client) does not hold the core its partner needs.

A member must pass every barrier the others do: the team's code has no early exit and no check
that raises (``error_model="numpy"``) once the rendezvous is passed; only a failed allocation of
a few KB inside the region could still raise, and leave the others waiting.

A team called off is tried again later (:func:`may_try`, :func:`back_off`): after 64 regions run
another way, then twice as many after each call-off in a row, up to 65,536. A threading layer that
can never field the team then costs a rendezvous's wait every 65,536 steps; a team called off
because a member's thread was slow to start under load comes back after 64.
"""
from __future__ import annotations

import platform
import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["ARRIVED", "BACKOFF", "BARRIER", "CALLED_OFF", "SKIPS_LEFT", "SWITCHED_OFF", "TEAM_STEPS", "TICKETS",
           "back_off", "barrier", "claim", "max_parties", "may_try", "new_state", "rendezvous", "reset"]

# Slots of a team's state array (int64), each on a cache line of its own.
BARRIER = 0      # arrivals at the region's barriers so far
ARRIVED = 8      # members through the rendezvous, or CALLED_OFF_MARK once it has been called off
TEAM_STEPS = 16  # regions run as a full team (a count the caller keeps; tests read it)
CALLED_OFF = 24  # regions called off (the caller runs those another way)
SWITCHED_OFF = 32  # the owner's switch: nonzero, its caller runs no team (to compare, or by choice)
SKIPS_LEFT = 40  # regions the caller still runs another way after a call-off, before trying again
BACKOFF = 48     # that wait's length after the last call-off (doubling while teams keep failing)
TICKETS = 56     # run r's ticket counter (:func:`claim`) at TICKETS + 8 * r

# A rendezvous called off holds this (far below any count of arrivals added to it afterwards).
CALLED_OFF_MARK = -(1 << 40)
# Pauses before a waiting member first yields the core: ~20-70 us (a pause is 10-40 ns).
SPINS_BEFORE_YIELD = 2000
# How long a rendezvous waits before it is called off. A complete team meets within microseconds
# of the fork; one that cannot meet (two members on one thread) never does. The wait is a time,
# not a count of waits: a count (20,000 pauses and yields) ran out in 3 ms on the AMX Xeon (a
# yield with nobody else runnable returns at once), so a host's stall of the other vCPU called
# teams off now and then (docs/perf-log/ci-time.md#2026-11-29-xeon-amx). On Linux the wait reads
# the monotonic clock; elsewhere it counts RENDEZVOUS_WAITS.
RENDEZVOUS_NS = 100_000_000
RENDEZVOUS_WAITS = 20_000
# Regions run another way after a first call-off; doubled at each call-off in a row, up to the last.
FIRST_BACKOFF = 64
LAST_BACKOFF = 1 << 16


def new_state(parties: int) -> np.ndarray:
    """A team's state: the int64 array :func:`rendezvous`, :func:`barrier` and :func:`claim` count
    in, for teams of up to ``parties`` members (:func:`max_parties`)."""
    return np.zeros(TICKETS + 8 * max(1, parties), np.int64)


@njit(inline="always")
def max_parties(state):  # noqa: ANN001, ANN201
    """The largest team ``state`` has ticket counters for."""
    return (state.shape[0] - TICKETS) // 8


@njit(inline="always")
def reset(state, parties):  # noqa: ANN001, ANN201
    """Zero the region's counters (before the region, by the thread that forks it)."""
    state[BARRIER] = 0
    state[ARRIVED] = 0
    for run in range(parties):
        state[TICKETS + 8 * run] = 0


def _pointer(context, builder, array_type, array, index):  # noqa: ANN001, ANN202 - numba's codegen types
    return cgutils.get_item_pointer(context, builder, array_type,
                                    context.make_array(array_type)(context, builder, array), [index])


@intrinsic
def atomic_add(typingctx, array, index, value):  # noqa: ANN001, ANN201
    """``array[index] += value`` atomically (sequentially consistent); the old value."""
    sig = types.int64(array, types.intp, types.int64)

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.atomic_rmw("add", _pointer(context, builder, sig.args[0], args[0], args[1]), args[2],
                                  "seq_cst")
    return sig, codegen


@intrinsic
def atomic_load(typingctx, array, index):  # noqa: ANN001, ANN201
    """``array[index]``, an acquiring atomic load (never hoisted out of a wait loop)."""
    sig = types.int64(array, types.intp)

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        return builder.load_atomic(_pointer(context, builder, sig.args[0], args[0], args[1]), "acquire", 8)
    return sig, codegen


@intrinsic
def compare_and_swap(typingctx, array, index, expected, new):  # noqa: ANN001, ANN201
    """Set ``array[index]`` to ``new`` if it holds ``expected``, atomically; whether it did."""
    sig = types.boolean(array, types.intp, types.int64, types.int64)

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        pair = builder.cmpxchg(_pointer(context, builder, sig.args[0], args[0], args[1]), args[2], args[3],
                               "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)
    return sig, codegen


_MACHINE = platform.machine().lower()


@intrinsic
def spin_pause(typingctx):  # noqa: ANN001, ANN201
    """The CPU's spin-wait hint (x86 ``pause``, arm64 ``yield``); nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        if _MACHINE in ("x86_64", "amd64"):
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                        "llvm.x86.sse2.pause"), [])
        elif _MACHINE in ("aarch64", "arm64"):
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]),
                                                  "llvm.aarch64.hint")
            builder.call(hint, [ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()
    return sig, codegen


_POSIX = sys.platform != "win32"
# The rendezvous's clock: Linux's CLOCK_MONOTONIC (other systems number their clocks otherwise;
# there the rendezvous counts its waits).
_TIMED = sys.platform.startswith("linux")
_CLOCK_MONOTONIC = 1


@intrinsic
def yield_core(typingctx):  # noqa: ANN001, ANN201
    """POSIX ``sched_yield()``: let another runnable thread have this core (nothing on Windows,
    which has no such symbol to link: waiting members only spin there)."""
    sig = types.void()

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        if _POSIX:
            builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                                        "sched_yield"), [])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def monotonic_ns(typingctx):  # noqa: ANN001, ANN201
    """Linux's ``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds (0 elsewhere)."""
    sig = types.int64()

    def codegen(context, builder, sig, args):  # noqa: ANN001, ANN202
        i64 = ir.IntType(64)
        if not _TIMED:
            return ir.Constant(i64, 0)
        timespec = ir.LiteralStructType([i64, i64])  # tv_sec, tv_nsec: two longs on 64-bit Linux
        spec = cgutils.alloca_once(builder, timespec)
        clock_gettime = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32), timespec.as_pointer()]), "clock_gettime")
        builder.call(clock_gettime, [ir.Constant(ir.IntType(32), _CLOCK_MONOTONIC), spec])
        seconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 0))
        nanoseconds = builder.load(cgutils.gep_inbounds(builder, spec, 0, 1))
        return builder.add(builder.mul(seconds, ir.Constant(i64, 1_000_000_000)), nanoseconds)
    return sig, codegen


@njit(inline="always")
def _wait(spins):  # noqa: ANN001, ANN202
    if spins < SPINS_BEFORE_YIELD:
        spin_pause()
    else:
        yield_core()


@njit(nogil=True, fastmath=False)
def rendezvous(state, parties):  # noqa: ANN001, ANN201
    """Arrive, and wait for the other ``parties - 1`` members: True once all have arrived; False
    if the team was called off (by this member after ``RENDEZVOUS_NS``, or by another),
    in which case no member may work. The caller zeroes the counters before the region
    (:func:`reset`)."""
    if atomic_add(state, ARRIVED, 1) < 0:
        return False
    waits = 0
    deadline = monotonic_ns() + RENDEZVOUS_NS
    while True:
        arrived = atomic_load(state, ARRIVED)
        if arrived >= parties:
            return True
        if arrived < 0:
            return False
        timed_out = monotonic_ns() >= deadline if _TIMED else waits >= RENDEZVOUS_WAITS
        if timed_out and compare_and_swap(state, ARRIVED, arrived, CALLED_OFF_MARK):
            return False
        _wait(waits)
        waits += 1


@njit(nogil=True, fastmath=False)
def barrier(state, parties, number):  # noqa: ANN001, ANN201
    """Wait until all ``parties`` have reached barrier ``number`` (1, 2, ... within a region)."""
    atomic_add(state, BARRIER, 1)
    target = parties * number
    spins = 0
    while atomic_load(state, BARRIER) < target:
        _wait(spins)
        spins += 1


@njit(inline="always")
def claim(state, member, parties, step, drawn, per_run):  # noqa: ANN001, ANN201
    """``(chunk, step)``: the next chunk of the current op for ``member`` to do (-1 once none is
    left), and the cursor to pass to the next call (0 at the op's first).

    The op is ``parties`` runs of ``per_run`` chunks, chunk ``run * per_run + i``. A member takes
    its own run's chunks in order, so that it streams its share of the weights as one long run
    (chunks drawn in turn from one shared counter streamed well below the host's read rate: each
    member's streams then jumped ahead at every chunk; docs/perf-log/cpu-anchors.md#2026-11-26-thread-team),
    then the chunks still left in the
    others' runs, the next member's first: a member whose core ran slower for a while gets help at
    the end. Each run has its own ticket counter, ``state[TICKETS + 8 * run]``. A member draws
    from a run until a ticket comes back empty, exactly once a run, so after an op every counter
    has given out ``per_run + parties`` tickets more: ``drawn`` is that sum over the ops before
    this one, which every member knows without asking. The caller zeroes the counters before the
    region (:func:`new_state` sizes them) and passes a barrier between two ops."""
    while step < parties:
        run = (member + step) % parties
        ticket = atomic_add(state, TICKETS + 8 * run, 1) - drawn
        if ticket < per_run:
            return run * per_run + ticket, step
        step += 1
    return -1, step


@njit(inline="always")
def may_try(state):  # noqa: ANN001, ANN201
    """Whether the caller may run a team in this region: not switched off, and not in the wait after
    a call-off (a region it runs another way counts down that wait)."""
    if state[SWITCHED_OFF] != 0:
        return False
    if state[SKIPS_LEFT] > 0:
        state[SKIPS_LEFT] -= 1
        return False
    return True


@njit(inline="always")
def back_off(state, called_off):  # noqa: ANN001, ANN201
    """After a region tried as a team: reset the wait if it ran, else double it (see the module's
    docstring) and start it."""
    if called_off:
        state[BACKOFF] = min(max(FIRST_BACKOFF, 2 * state[BACKOFF]), LAST_BACKOFF)
        state[SKIPS_LEFT] = state[BACKOFF]
    else:
        state[BACKOFF] = 0
