"""The planner's memory of kernels and programs it planned: a model's layers are planned once.

A model's graph holds kernels that differ only in names (its layers), in many programs (the
parts of a plan in regions, region_search.py; the forward and the backward graph of the torch
backend). `Rankings` keeps, by structure (`structure`: the IR text with the names of its
variables, buffers and kernels numbered by first appearance, every other word as it is):

- per kernel, its ranking (`Ranking`: candidates_for's points, best first) and, per context
  (`context_key`: the roles of its parameters, the compile check and its arch), the point
  realized for the first of them and why the points before it were not;
- per program, its graph-level planning (`GroupRanking`: the rewrites' points and the one
  realized, or none).

The planner (planner.py) takes a twin's ranking instead of ranking the kernel again, tries the
twin's realized point first and does not compile it again to check for spills (the same code up
to names: the same registers); its plan and reasons are those a fresh planning gives. One
`plan_program` has its own Rankings, unless the caller shares one over several
(`shared_rankings`, what the torch backend does over a process's graphs).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

from . import options as knobs
from .candidate import Candidate, CompileCheck
from .cost.model import CostParameters
from .program import Program
from .strategies.registry import graph_strategies, strategies

T = TypeVar("T")


@dataclass
class Ranking:
    """The ranking of a kernel's candidates (candidates_for), shared by the kernels of one
    structure (its twins), and the position of the point realized for the first of them, per
    context (`context_key`: whether the point holds may depend on more than the kernel)."""

    ranked: list[Candidate]                          # valid candidates, best first
    rejected: list[Candidate]
    declined: list[tuple[str, str]]
    evaluated: int
    # context -> the position in `ranked` of the point realized, and why each point before it
    # was not (Candidate.failed, as that realization left them)
    chosen: dict[tuple[Any, ...], tuple[int, tuple[str | None, ...]]] = field(default_factory=dict)


@dataclass
class GroupRanking:
    """The graph-level planning of a program (`_plan_group`), shared by the programs of one
    structure: the ranked graph points and the position of the point realized, or None when
    none was (every point refused, or none predicted cheaper than the per-kernel plans)."""

    ranked: list[Candidate]
    rejected: list[Candidate]
    declined: list[tuple[str, str]]
    claimed: tuple[int, ...]                         # the kernels the rewrites replace, by position
    evaluated: int
    absent: bool                                     # no graph strategy was asked (_plan_group gave None)
    chosen: int | None


class Rankings:
    """The rankings of the kernels planned so far, by what they depend on (`ranking_key`): the
    kernel's structure, the Target, the sizes, the cost parameters, the strategies (registered
    and asked) and precise math. A model's layers are kernels of one structure in many programs (the
    parts of a plan in regions; the forward and the backward graph of the torch backend): the
    first is ranked and realized as any kernel, the others take its ranking and try its realized
    point first (`_realize`). One planning (`plan_program`) has its own, unless the caller shares
    one over several (`shared_rankings`). The oldest of more than `limit` rankings are forgotten."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._found: dict[tuple[Any, ...], Ranking] = {}
        self.groups: dict[tuple[Any, ...], GroupRanking] = {}   # by _group_key
        self.shared: dict[tuple[Any, ...], Any] = {}             # by_structure's answers
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[Any, ...]) -> Ranking | None:
        found = self._found.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: tuple[Any, ...], ranking: Ranking) -> Ranking:
        self._found[key] = ranking
        while len(self._found) > self.limit:
            del self._found[next(iter(self._found))]
        while len(self.groups) > self.limit:
            del self.groups[next(iter(self.groups))]
        while len(self.shared) > self.limit:
            del self.shared[next(iter(self.shared))]
        return ranking

    def clear(self) -> None:
        self._found.clear()
        self.groups.clear()
        self.shared.clear()
        self.hits = self.misses = 0


ACTIVE: ContextVar[Rankings | None] = ContextVar("tecc_planner_rankings", default=None)


@contextmanager
def shared_rankings(rankings: Rankings) -> Iterator[Rankings]:
    """Plan every program inside the block with `rankings` (what the torch backend does over the
    programs of a model, so that a layer's kernels are ranked once)."""
    token = ACTIVE.set(rankings)
    try:
        yield rankings
    finally:
        ACTIVE.reset(token)


def ranking_key(program: Program, kernel: str, params: CostParameters, only: Sequence[str] | None) -> tuple[Any, ...]:
    """What a kernel's ranking depends on (candidates_for of its KernelInfo)."""
    registered = tuple(id(s) for s in strategies())
    return (structure(program.module.kernel(kernel)), repr(program.target), tuple(sorted(program.sizes.items())),
            repr(params), None if only is None else tuple(only), registered, knobs.precise_math())


def group_key(program: Program, params: CostParameters, only: Sequence[str] | None,
               compile_check: CompileCheck | None, weigh: bool) -> tuple[Any, ...]:
    """What a program's graph-level planning depends on: its lowered module and its arguments
    (shapes, dtypes, strides) up to names, the Target, the sizes, the cost parameters, the
    strategies, precise math, the compile check and its arch, and `weigh`."""
    registered = tuple(id(s) for s in graph_strategies()) + tuple(id(s) for s in strategies())
    return (program_structure(program), repr(program.target), tuple(sorted(program.sizes.items())),
            repr(params), None if only is None else tuple(only), registered, knobs.precise_math(),
            _check_name(compile_check), program.compile_arch, weigh, program.scatters)


def program_structure(program: Program) -> str:
    """The structure of a program's lowered module and its arguments (shapes, dtypes, strides)
    up to names (`structure`), computed once per program."""
    def compute() -> str:
        args = "; ".join(f"{t.shape} {t.dtype} {getattr(t.op, 'strides', None)}" for t in program.args)
        return structure(program.module, f"{args}\n")

    return program.memo("rankings/structure", compute)


def by_structure(program: Program, key: str, compute: Callable[[], T]) -> T:
    """`compute()` once per structure of `program` (`program_structure`), Target, sizes, compile
    arch and precise math, under the active Rankings (`ACTIVE`; without one, every time): what a
    graph strategy finds by compiling the program (row_fused's first plan that does not spill)
    holds for every program of its structure, as a kernel's realized point does for its twins.
    The value must not hold names of the program (a position, a count): it serves its twins.
    `key` names the question ("row_fused/plan")."""
    memo = ACTIVE.get()
    if memo is None:
        return compute()
    full = (key, program_structure(program), repr(program.target), tuple(sorted(program.sizes.items())),
            program.compile_arch, knobs.precise_math())
    if full not in memo.shared:
        memo.shared[full] = compute()
    return memo.shared[full]  # type: ignore[no-any-return]


def context_key(program: Program, kernel: str, compile_check: CompileCheck | None) -> tuple[Any, ...]:
    """What else whether a point is realized may depend on: the roles of the kernel's parameters
    (the program's own buffers, or temporaries), the compile check and the arch it compiles for."""
    own = {getattr(p, "name", None) for p in program.module.params}
    roles = tuple(getattr(p, "name", None) in own for p in program.module.kernel(kernel).params)
    return (roles, _check_name(compile_check), program.compile_arch)


def _check_name(compile_check: CompileCheck | None) -> str | None:
    """A compile check as a key holds it: its qualified name (the checks are module functions)."""
    return None if compile_check is None else getattr(compile_check, "__qualname__", repr(compile_check))


def structure(kernel: Any, prefix: str = "") -> str:
    """A kernel's loop nest (or a module's text, after `prefix`) with every name of its
    variables, buffers and kernels replaced by its order of first appearance: kernels that
    differ only in names (a model's layers) have the same structure, and so the same candidates,
    costs and realizable points. Every other word (a dtype, an intrinsic such as exp or log, a
    keyword) stays as it is, so kernels that differ in one are never the same structure."""
    own = _names(kernel)
    names: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        word = m.group(0)
        return names.setdefault(word, f"n{len(names)}") if word in own else word

    return _IDENTIFIER.sub(rename, f"{prefix}{kernel}")


def _names(root: Any) -> set[str]:
    """The names of every variable, buffer, kernel and module reachable from an IR object."""
    from ..ir.expr import Expr, Var, walk
    from ..ir.stmt import Buffer, Module, PrimFunc

    found: set[str] = set()
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool)):
            continue
        seen.add(id(obj))
        if isinstance(obj, Expr):
            for n in walk(obj):
                if isinstance(n, Var):
                    found.add(n.name)
                buffer = getattr(n, "buffer", None)
                if buffer is not None:
                    stack.append(buffer)
            continue
        if isinstance(obj, (tuple, list)):
            stack.extend(obj)
            continue
        if isinstance(obj, (Buffer, PrimFunc, Module)):
            found.add(obj.name)
        if hasattr(obj, "__dataclass_fields__"):
            stack.extend(getattr(obj, f) for f in obj.__dataclass_fields__)
    return found


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


__all__ = ["ACTIVE", "GroupRanking", "Ranking", "Rankings", "by_structure", "context_key", "group_key",
           "program_structure", "ranking_key", "shared_rankings", "structure"]
