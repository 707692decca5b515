"""Realization of the per-kernel plans: each kernel's best point that the primitives take and its
compile check passes, applied on one Schedule; the compile checks' NVRTC runs in threads.

For each kernel, cheapest first (planner.py, step 5): its candidates are applied on the
Schedule; a point the primitives refuse (ScheduleError) is recorded and the next tried, and a
point of a `compile_checked` strategy is compiled (`compile_check`, NVRTC: ptxas's spills) before
it is taken. A kernel with an earlier twin (rankings.py) tries the twin's point first and does
not compile it again. A strategy refused FAILURES_PER_STRATEGY times for a kernel is not tried
further there. The naive strategy always succeeds.

A compile check is one NVRTC compile of one kernel (0.5-2 s for a tensor-core kernel), and the
checks of a program were a chain: each waited for the one before. But a check rarely decides
anything the next kernels depend on, and NVRTC releases the GIL. So the realization goes on
while a check compiles (`_Ahead`):

- a point whose check is in flight is taken *provisionally*, and the next kernels are realized
  after it; at most TECC_COMPILE_THREADS checks are in flight, and at the end each is waited
  for, oldest first. A check that refuses its point puts the realization back where that point
  was applied (the Schedule's checkpoint, and every mark left on the candidates and rankings
  since, through an undo log) and goes on with the kernel's next point, as a check that refused
  at once would have: the choices and the Schedule are those of the one-at-a-time order;
- once a check of a kernel has refused a point, its next points may be refused too (a tiling
  that spills is followed in the ranking by its neighbours): the next compile-checked points of
  that kernel are applied at once, each from the kernel's starting state, and their checks run
  together (2, then twice as many per batch refused again, up to TECC_COMPILE_THREADS); they
  are then taken in ranking order, the first that passes chosen.

A program planned in regions (planner.py, step 6) realizes each part between the regions as a
program of its own, and each would wait for its checks before the next part is planned. Within
`deferring()` (the planner's regions) a part's realization returns with its checks in flight
(`realize_later`): the region search goes on to the next parts, and each part is settled, in
order, when the composed module is built. A kernel whose twin in an earlier part was taken
provisionally (its point not compiled again) takes it provisionally too, on the twin's check:
if that check refuses (or a refusal before it cancels it), the kernel is realized again from
the start, as it would have been after the twin's settled choice.

TECC_COMPILE_THREADS=1 checks one point at a time, as before. A check's compile lands in the
compile cache (cache.py), so the one a realization undid and repeats costs no second NVRTC run.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from ..ir.errors import ScheduleError
from . import options as knobs
from .candidate import Candidate, CompileCheck
from .plan import Plan
from .rankings import Ranking

# A strategy whose primitives refused this many of its points for one kernel is not tried
# further there: the refusals that recur are the program's, not the point's (a loop whose
# dependences isl cannot rule out, e.g. over symbolic extents, refuses every parallel binding),
# and each try schedules the kernel again.
FAILURES_PER_STRATEGY = 6

_MISSING = object()

# Within `deferring()`: the checks in flight of provisional choices that later programs' twins
# take on trust, with the realization that took each (which settles it), by (id of the Ranking,
# context): see the module docstring
_SHARED: contextvars.ContextVar["dict[tuple[int, Any], tuple[Future[Any], _Ahead]] | None"] = contextvars.ContextVar(
    "tecc_realize_shared_checks", default=None)

# a point applied: (the Schedule's checkpoint after it, None, its compile check in flight or None),
# or (None, the primitives' refusal, None)
_Outcome = tuple["tuple[Any, ...] | None", "str | None", "Future[Any] | None"]


class _Undo:
    """The marks the realization leaves on shared objects (a candidate's `failed`, a
    KernelPlan's `chosen`, a Ranking's `chosen` entry), logged so that a provisional choice a
    check refused can be taken back with everything realized after it."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, Any, Any, bool]] = []   # (object, attribute or key, old value, is a key)

    def set(self, obj: Any, name: str, value: Any) -> None:
        self.log.append((obj, name, getattr(obj, name), False))
        setattr(obj, name, value)

    def put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        self.log.append((table, key, table.get(key, _MISSING), True))
        table[key] = value

    def mark(self) -> int:
        return len(self.log)

    def undo(self, mark: int) -> None:
        while len(self.log) > mark:
            obj, name, old, is_key = self.log.pop()
            if not is_key:
                setattr(obj, name, old)
            elif old is _MISSING:
                del obj[name]
            else:
                obj[name] = old


@dataclass
class _Scheduled:
    """What a compile check reads of a Schedule: its IR and its plan, as they were when the
    check was asked (the Schedule itself moves on)."""

    mod: Any
    plan: Plan


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != threads:   # (TECC_COMPILE_THREADS changed)
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tecc-compile-check")
        return _POOL


@dataclass
class _Provisional:
    """A kernel's point taken while its compile check runs: where to return when it refuses."""

    number: int                     # the kernel's position in the program
    position: int                   # the point's position in the kernel's order of candidates
    failures: dict[str, int]        # refusals per strategy of the kernel before the point
    before: tuple[Any, ...]         # the Schedule's checkpoint before the point was applied
    mark: int                       # the undo log's length before the point was applied
    check: Future[Any]
    cand: Candidate
    twin: bool = False              # the check is an earlier program's twin's (module docstring)


@dataclass
class _Kernel:
    """Where the realization of one kernel stands: its candidates in the order tried, the first
    to try, the refusals per strategy so far."""

    order: list[Candidate]
    checked: Candidate | None       # the twin's point: compiled for the twin already
    start: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    hurried: bool = False           # a check of this kernel refused a point: check the next ones together
    batches: int = 0                # the batches of points checked together so far (_apply_ahead)


class _Ahead:
    """The realization of a program's kernels with compile checks in flight (module docstring)."""

    def __init__(self, program: Any, kernel_plans: list[Any], compile_check: CompileCheck | None,
                 rankings: Sequence[tuple[Ranking, tuple[Any, ...]]] | None) -> None:
        from .schedule import Schedule

        self.program, self.kernel_plans, self.compile_check = program, kernel_plans, compile_check
        self.rankings = rankings
        self.sch = Schedule(program.args, name=program.name, lowered=program.module)
        self.threads = knobs.compile_threads()
        self.undo = _Undo()
        self.pending: list[_Provisional] = []
        self.context = contextvars.copy_context()

    def advance(self, number: int = 0, resume: _Kernel | None = None) -> None:
        """Realize the kernels from `number` on, with at most `threads` checks in flight."""
        while number < len(self.kernel_plans):
            self._kernel(number, resume)
            resume = None
            number += 1
            if len(self.pending) >= self.threads:   # as many checks in flight as threads: wait for the oldest
                refused = self._settle(oldest=True)
                if refused is not None:
                    number, resume = refused

    def finish(self) -> Any:
        """Wait for the checks in flight, realizing again from where one refused; the Schedule."""
        while True:
            refused = self._settle()
            if refused is None:
                return self.sch
            self.advance(*refused)

    # ---- one kernel --------------------------------------------------------------------------
    def _state(self, number: int, resume: _Kernel | None) -> _Kernel:
        if resume is not None:
            return resume
        kp = self.kernel_plans[number]
        shared = self._shared(number)
        if shared is not None and shared[1] is not self and _failed(shared[0]):
            # the twin's check refused (or a refusal before it cancelled it): its program settled
            # first, so that the twin's choice here is the one checking one at a time makes
            shared[1].finish()
        ranking, context = self.rankings[number] if self.rankings is not None else (None, ())
        order = list(kp.ranked)
        checked = None  # the twin's point, which ptxas already compiled without spilling
        position = ranking.chosen[context][0] if ranking is not None and context in ranking.chosen else None
        if position is not None:
            order = order[position:] + order[:position]
            checked = order[0]
        return _Kernel(order, checked)

    def _shared(self, number: int) -> tuple[Future[Any], _Ahead] | None:
        """The check (and its realization) of the point a twin of kernel `number` took
        provisionally, while that realization is not settled (within `deferring`)."""
        slot = self._shared_slot(number)
        return None if slot is None else slot[0].get(slot[1])

    def _shared_slot(self, number: int) -> tuple[dict[tuple[int, Any], Any], tuple[int, Any]] | None:
        """The table of `deferring` and kernel `number`'s key in it (None outside `deferring`)."""
        table = _SHARED.get()
        if table is None or self.rankings is None:
            return None
        ranking, context = self.rankings[number]
        return table, (id(ranking), context)

    def _kernel(self, number: int, resume: _Kernel | None) -> None:
        ahead: dict[int, _Outcome] = {}
        try:
            self._realize_kernel(number, resume, ahead)
        finally:
            for _, _, check in ahead.values():   # points checked ahead that the kernel did not reach
                if check is not None:
                    check.cancel()

    def _realize_kernel(self, number: int, resume: _Kernel | None,
                        ahead: dict[int, _Outcome]) -> None:
        kp = self.kernel_plans[number]
        state = self._state(number, resume)
        base = self.sch.checkpoint()
        for at in range(state.start, len(state.order)):
            cand = state.order[at]
            if cand.strategy.uses_default_schedule:
                self._choose(number, cand)
                return
            if state.failures.get(cand.strategy.name, 0) >= FAILURES_PER_STRATEGY:
                self.undo.set(cand, "failed", f"not tried: {FAILURES_PER_STRATEGY} better points of "
                                              f"{cand.strategy.name} failed")
                continue
            if state.hurried and at not in ahead:
                ahead.update(self._apply_ahead(number, state, at, base))
            if at in ahead:
                after, refusal, check = ahead.pop(at)
            else:
                after, refusal, check = self._apply(number, state, cand, base)
            if refusal is None and check is not None and not state.hurried and self.threads > 1:
                # taken provisionally: the next kernels are realized while the check compiles
                assert after is not None
                self.sch.rollback(after)
                self.pending.append(_Provisional(number, at, dict(state.failures), base, self.undo.mark(),
                                                 check, cand))
                self._choose(number, cand)
                slot = self._shared_slot(number)
                if slot is not None:   # for later programs' twins
                    self.undo.put(*slot, (check, self))
                return
            if refusal is None and check is None and cand is state.checked and self.threads > 1:
                shared = self._shared(number)
                if shared is not None and shared[1] is not self and _failed(shared[0]):
                    # the twin's check refused while the point was applied here (after `_state`
                    # found it in flight): as `_state` does, its program settled first, and the
                    # kernel realized from the start (no mark left yet: the twin's point is the first)
                    assert at == 0
                    self.sch.rollback(base)
                    self._realize_kernel(number, None, ahead)
                    return
                if shared is not None and shared[1] is not self and not shared[0].done():
                    # the twin's point on the twin's check, still in flight (an earlier program's)
                    assert after is not None
                    self.sch.rollback(after)
                    self.pending.append(_Provisional(number, at, dict(state.failures), base, self.undo.mark(),
                                                     shared[0], cand, twin=True))
                    self._choose(number, cand)
                    return
            if refusal is None and check is not None:
                refusal = _refusal(check)
            if refusal is None:
                assert after is not None
                self.sch.rollback(after)
                self._choose(number, cand)
                return
            self.undo.set(cand, "failed", refusal)
            state.failures[cand.strategy.name] = state.failures.get(cand.strategy.name, 0) + 1
            if check is not None:
                state.hurried = True
            self.sch.rollback(base)  # as if the candidate had never been tried
        raise AssertionError(f"{kp.kernel}: no candidate realized (the naive strategy always is)")

    def _needs_check(self, cand: Candidate, state: _Kernel) -> bool:
        return bool(cand.strategy.compile_checked) and self.compile_check is not None and cand is not state.checked

    def _apply(self, number: int, state: _Kernel, cand: Candidate, base: tuple[Any, ...]
               ) -> _Outcome:
        """Apply `cand` from `base`: (the Schedule's state after it, None, its compile check in
        flight or None), or (None, the primitives' refusal, None). Leaves the Schedule at `base`."""
        kp = self.kernel_plans[number]
        self.sch.rollback(base)
        try:
            # the twin's point: every step of it emitted for the twin, so its tensor-core steps
            # need not emit their kernel one by one (Schedule.deferring: the same kernel at the end)
            with self.sch.deferring(cand is state.checked):
                cand.strategy.apply(self.sch, kp.info, cand.point)  # type: ignore[arg-type]
        except ScheduleError as exc:
            self.sch.rollback(base)
            return None, str(exc).splitlines()[0], None
        after = self.sch.checkpoint()
        check = None
        if self._needs_check(cand, state):
            check = self._submit(kp.kernel)
        self.sch.rollback(base)
        return after, None, check

    def _apply_ahead(self, number: int, state: _Kernel, at: int, base: tuple[Any, ...]
                     ) -> dict[int, _Outcome]:
        """The next compile-checked points of the kernel from position `at`, applied from `base`
        with their checks in flight together: 2 in the kernel's first batch, twice as many in
        each next (its points refused again), at most TECC_COMPILE_THREADS. (The point after a
        refused one mostly passes: GPT-2's backward on the H200 checked 7 at once after each of
        two refusals, and the first of them passed both times, the other 6 compiled for nothing
        beside the planning and the forward's worker.)"""
        out: dict[int, _Outcome] = {}
        failures = dict(state.failures)
        state.batches += 1
        width = min(max(1, self.threads), 2 ** state.batches)
        for n in range(at, len(state.order)):
            if len(out) >= width:
                break
            cand = state.order[n]
            if cand.strategy.uses_default_schedule:
                break
            if failures.get(cand.strategy.name, 0) >= FAILURES_PER_STRATEGY or not self._needs_check(cand, state):
                if n == at:
                    break
                continue
            out[n] = self._apply(number, state, cand, base)
            if out[n][1] is not None:   # refused by the primitives: counts as the realization counts it
                failures[cand.strategy.name] = failures.get(cand.strategy.name, 0) + 1
        return out

    def _submit(self, kernel: str) -> Future[Any]:
        assert self.compile_check is not None
        snapshot = _Scheduled(self.sch.mod, self.sch.plan)
        check, arch = self.compile_check, self.program.compile_arch
        future: Future[Any]
        if self.threads <= 1:
            future = Future()
            try:
                future.set_result(check(snapshot, kernel, arch))
            except ScheduleError as exc:
                future.set_exception(exc)
            return future
        return _pool(self.threads).submit(self.context.copy().run, check, snapshot, kernel, arch)

    def _choose(self, number: int, cand: Candidate) -> None:
        kp = self.kernel_plans[number]
        self.undo.set(kp, "chosen", cand)
        ranking, context = self.rankings[number] if self.rankings is not None else (None, ())
        if ranking is not None and context not in ranking.chosen:
            at = kp.ranked.index(cand)
            self.undo.put(ranking.chosen, context, (at, tuple(c.failed for c in kp.ranked[:at])))

    # ---- the provisional choices ------------------------------------------------------------
    def _settle(self, oldest: bool = False) -> tuple[int, _Kernel] | None:
        """Wait for every check in flight (the oldest alone with `oldest`), oldest first. The
        first that refuses its point: the realization put back to before that point, and (the
        kernel's number, where its realization goes on); None when every one passed."""
        while self.pending:
            first = self.pending[0]
            refusal = "cancelled" if first.check.cancelled() else _refusal(first.check)
            if refusal is None:
                self.pending.pop(0)
                if oldest:
                    return None
                continue
            for later in self.pending[1:]:
                if not later.twin:   # (a twin's check is an earlier program's to settle)
                    later.check.cancel()
            self.pending.clear()
            self.undo.undo(first.mark)
            self.sch.rollback(first.before)
            if first.twin:   # the twin's check: the kernel realized again, as after the twin's choice
                return first.number, self._state(first.number, None)
            self.undo.set(first.cand, "failed", refusal)
            failures = dict(first.failures)
            failures[first.cand.strategy.name] = failures.get(first.cand.strategy.name, 0) + 1
            state = self._state(first.number, None)
            return first.number, _Kernel(state.order, state.checked, first.position + 1, failures, hurried=True)
        return None


def _failed(check: Future[Any]) -> bool:
    """Whether a check is done and did not pass (refused, or cancelled)."""
    return check.done() and (check.cancelled() or check.exception() is not None)


def _refusal(check: Future[Any]) -> str | None:
    """The first line of the ScheduleError a compile check raised, or None when it passed (any
    other error is raised: a check that cannot compile is no refusal)."""
    try:
        check.result()
    except ScheduleError as exc:
        # the Future keeps the exception, whose traceback the raise here extends with this
        # frame and its callers' (the realization, its Schedule and checkpoints): a cycle that
        # kept them alive until the garbage collector's next full collection
        exc.__traceback__ = None
        return str(exc).splitlines()[0]
    return None


def realize(program: Any, kernel_plans: list[Any], compile_check: CompileCheck | None,
            rankings: Sequence[tuple[Ranking, tuple[Any, ...]]] | None = None) -> Any:
    """Apply each kernel's best realizable candidate on one Schedule, and return it (module
    docstring). A kernel with an earlier twin (`rankings`: in this program, or in an earlier one
    planned with the same `Rankings`) tries the twin's chosen point first: the points ranked
    before it were refused for the twin, and would be for the kernel; and the point is not
    compiled again to check for spills (the same code up to names, so the same registers)."""
    return realize_later(program, kernel_plans, compile_check, rankings)()


def realize_later(program: Any, kernel_plans: list[Any], compile_check: CompileCheck | None,
                  rankings: Sequence[tuple[Ranking, tuple[Any, ...]]] | None = None) -> Callable[[], Any]:
    """`realize`, in two steps: the kernels realized now, and a function that waits for the
    checks still in flight (realizing again where one refused) and returns the Schedule. Outside
    `deferring()` no check is left in flight (the function only returns the Schedule)."""
    ahead = _Ahead(program, kernel_plans, compile_check, rankings)
    ahead.advance()
    if _SHARED.get() is None or not ahead.pending:
        schedule = ahead.finish()
        return lambda: schedule
    return ahead.finish


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Within: `realize_later` returns with the checks in flight, and later programs' twins of
    a provisional point take it on its check (module docstring)."""
    table: dict[tuple[int, Any], tuple[Future[Any], _Ahead]] = {}
    token = _SHARED.set(table)
    try:
        yield
    finally:
        _SHARED.reset(token)
        # the realizations' copies of the context hold the table, and the table them: a cycle
        # that kept every part's Schedule (and its checkpoints) alive until the next full
        # collection of the garbage collector
        table.clear()


__all__ = ["FAILURES_PER_STRATEGY", "deferring", "realize", "realize_later"]
