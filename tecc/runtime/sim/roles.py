"""Warp-specialized roles under the emulator: divergent branches that synchronize through
mbarriers run as concurrent roles, switched at the waits.

The emulator runs the lanes of a statement in lockstep and statements in program order. That
cannot run a warp-specialized kernel, `if producer: loop(wait empty, load, ...) else:
loop(wait full, compute, arrive empty)`: in program order the producer's loop would wait for
arrivals that only the consumers' loop, later in the text, makes. On the GPU the two branches
run concurrently. So an `IfThenElse` with a lane-dependent condition whose *both* branches wait
on mbarriers (`has_waits`) runs its branches as roles: each on its own lanes (a copy of the
lane state sharing every memory and the barrier, copy and wgmma states), one role at a time,
in a Python thread each so that a role can stop in the middle of its code. A role runs until an
mbarrier wait it cannot pass; then the next role that can make progress runs (round robin: a
role that has not waited yet, or one whose barrier states changed since it stopped). When no
role can make progress -- every role is finished or stopped at a wait that nothing since
changed -- the stopped role's wait is a deadlock (DeadlockError, naming the barrier and phase).

This explores one legal interleaving (the first role as far as it can, then the next, ...),
deterministically; correctness of results does not depend on the interleaving, because every
cross-role dependence goes through an mbarrier the emulator checks (a read before the wait on
the copy's barrier is a RaceError, as everywhere).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from ...ir.stmt import BarrierWait, Stmt, iter_stmts
from .state import LaneState

Runner = Callable[[LaneState], None]


def has_waits(s: Stmt | None) -> bool:
    return s is not None and any(isinstance(x, BarrierWait) for x in iter_stmts(s))


class _Abort(BaseException):
    """Unwinds a role's thread after another role failed."""


class Roles:
    """The roles of one divergent branch: whose turn it is, and what each waits for."""

    def __init__(self, n: int, events: Callable[[], int]) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False] * n
        self.seen: list[int | None] = [None] * n   # barrier events when the role stopped at a wait
        self.events = events
        self.abort = False
        self.error: BaseException | None = None

    def _runnable(self, j: int) -> bool:
        return not self.done[j] and (self.seen[j] is None or self.seen[j] != self.events())

    def _next(self, i: int) -> int | None:
        n = len(self.done)
        for step in range(1, n + 1):
            j = (i + step) % n
            if j != i and self._runnable(j):
                return j
        return None

    def _wait_turn(self, i: int) -> None:
        while self.turn != i and not self.abort:
            self.cond.wait()
        if self.abort:
            raise _Abort()

    def stop_at_wait(self, i: int) -> bool:
        """Role `i` cannot pass a wait: let another role run; True once it is `i`'s turn again
        (re-check the wait), False when no other role can make progress (a deadlock)."""
        with self.cond:
            self.seen[i] = self.events()
            j = self._next(i)
            if j is None:
                return False
            self.turn = j
            self.cond.notify_all()
            self._wait_turn(i)
            self.seen[i] = None
            return True

    def finish(self, i: int, error: BaseException | None) -> None:
        with self.cond:
            self.done[i] = True
            if error is not None and not isinstance(error, _Abort) and self.error is None:
                self.error = error
                self.abort = True
            if not self.abort:
                j = self._next(i)
                if j is None:  # hand the turn to a stopped role: its re-check reports the deadlock
                    j = next((k for k in range(len(self.done)) if not self.done[k]), None)
                if j is not None:
                    self.turn = j
            self.cond.notify_all()


def _clone(st: LaneState, mask: np.ndarray | None, roles: Roles, index: int) -> LaneState:
    c = LaneState.__new__(LaneState)
    for name in LaneState.__slots__:
        setattr(c, name, getattr(st, name))
    c.vals = list(st.vals)
    c.mask = mask
    c.roles = (roles, index)
    return c


def run_roles(st: LaneState, parts: list[tuple[np.ndarray | None, Runner]], events: Callable[[], int]) -> None:
    """Run each (mask, runner) as a role (module docstring); re-raise the first role's error."""
    roles = Roles(len(parts), events)
    states = [_clone(st, mask, roles, i) for i, (mask, _) in enumerate(parts)]

    def work(i: int) -> None:
        error: BaseException | None = None
        try:
            with roles.cond:
                roles._wait_turn(i)
            parts[i][1](states[i])
        except BaseException as e:  # noqa: BLE001 - handed to the launching thread
            error = e
        roles.finish(i, error)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if roles.error is not None:
        raise roles.error
