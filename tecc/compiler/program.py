"""The program a build plans: its tensors, lowered once, and the one Target it is planned for.

    program = Program.of([A, B, C], target=resolve_target("sm_90", allow_tf32=True), sizes={"M": 4096})
    program.module          the naive lowered module (one kernel per stage), lowered here, once
    program.info(kernel)    what the cost model reads off one of its kernels (cost.analysis)
    program.target          the Target: the arch's limits and rates, and the build's policies
                            (allow_tf32, deterministic)
    program.compile_arch    the arch string the build hands NVRTC (compile checks use it, so the
                            compile cache serves the build the very binary a check compiled)

`build` makes one Program per build and hands it to the build cache's key, the planner, every
strategy (per-kernel and graph-level) and the pipeline, so nothing lowers the program again and
nothing builds a Target from an arch string but `resolve_target` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, TypeVar

from ..ir.errors import DeviceError
from ..ir.scatter import ScatterOp
from ..ir.stmt import Module
from ..ir.target import Target, from_device
from ..ir.target import target as target_of
from ..ir.tensor import Tensor
from ..passes.lower import Program as LoweredProgram
from ..passes.lower import collect_program, inlining, lower
from .cost.analysis import KernelInfo, analyze_kernel

T = TypeVar("T")

# Program.memo's key of the lowering's inlining (`Program.inlining`)
INLINING = "lower/inlining"

# What the planner ranks for when neither the build nor the environment names an arch and no
# device answers: the reference part of the newest architecture tecc has tables for.
FALLBACK_ARCH = "sm_90"


def resolve_target(target: Target | str | None = None, *, allow_tf32: bool | None = None,
                   deterministic: bool | None = None) -> Target:
    """The Target to plan for: a Target as given; an arch name's reference part ("sm_80"); None:
    the live device (`target.from_device`), else sm_90. An arch tecc has no table for keeps its
    own number (so guards that ask for sm_80 or sm_90 answer for it) with sm_90's limits and
    rates; a string that is no arch at all plans for sm_90 and leaves NVRTC to judge it.
    `allow_tf32` and `deterministic` (None: as the Target has them) set the build's precision and
    reproducibility policies on the Target.

    This is the one place tecc turns an arch string into a Target."""
    if isinstance(target, Target):
        resolved = target
    elif target:
        resolved = _from_arch(target)
    else:
        try:
            resolved = from_device()
        except (DeviceError, ValueError):  # no device here, or one without a table: the default
            resolved = target_of(FALLBACK_ARCH)
    if allow_tf32 is not None and resolved.allow_tf32 != allow_tf32:
        resolved = resolved.replace(allow_tf32=allow_tf32)
    if deterministic is not None and resolved.deterministic != deterministic:
        resolved = resolved.replace(deterministic=deterministic)
    return resolved


def _from_arch(arch: str) -> Target:
    try:
        return target_of(arch)
    except ValueError:
        pass
    digits = "".join(ch for ch in arch.removeprefix("sm_").removeprefix("compute_") if ch.isdigit())
    if arch.startswith(("sm_", "compute_")) and len(digits) == 2:
        # an architecture without a table: its own number, sm_90's figures (ranking only)
        return target_of(FALLBACK_ARCH).replace(
            arch=f"sm_{digits}", name=f"sm_{digits} (no table: ranked with sm_90's limits and rates)")
    return target_of(FALLBACK_ARCH)


@dataclass
class Program:
    """A program (the kernel signature `tensors`) lowered once, with the Target it is planned for
    and the sizes of its symbolic dimensions (see the module docstring)."""

    tensors: tuple[Tensor, ...]
    name: str | None
    module: Module
    target: Target
    sizes: dict[str, int] = field(default_factory=dict)
    compile_arch: str = ""
    _infos: dict[str, KernelInfo] = field(default_factory=dict, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tensors: Sequence[Tensor], *, name: str | None = None, target: Target | str | None = None,
           sizes: Mapping[str, int] | None = None, compile_arch: str | None = None) -> "Program":
        """Lower `tensors` (the only lowering of a build) and resolve the target."""
        tgt = resolve_target(target)
        args = tuple(tensors)
        chosen = inlining(list(args))
        program = cls(args, name, lower(list(args), name, chosen), tgt, dict(sizes or {}), compile_arch or tgt.arch)
        program._memo[INLINING] = chosen
        return program

    @property
    def args(self) -> list[Tensor]:
        return list(self.tensors)

    @property
    def kernels(self) -> list[str]:
        return [k.name for k in self.module.kernels]

    @property
    def scatters(self) -> bool:
        """Whether a stage of the program is a scatter (tc.scatter_add: a ScatterOp)."""
        return self.memo("program/scatters", lambda: any(isinstance(t.op, ScatterOp)
                                                           for t in collect_program(self.args).order))

    def inlining(self) -> LoweredProgram:
        """The tensor program with the computes its lowering inlined chosen (passes/lower.py
        `inlining`), as the lowering found it: the region search reads the same stages."""
        return self.memo(INLINING, lambda: inlining(self.args))

    def info(self, kernel: str) -> KernelInfo:
        """analyze_kernel of the lowered kernel `kernel` at the program's sizes (computed once)."""
        found = self._infos.get(kernel)
        if found is None:
            found = analyze_kernel(self.module.kernel(kernel), self.sizes)
            self._infos[kernel] = found
        return found

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """`compute()` once per program and key: what several declarations of a strategy read
        (a recognized row group, the online chain, a compiled tiling's registers). Keys name
        their strategy ("row_fused/choice"); a value may depend on the Target."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[no-any-return]

    def with_target(self, target: Target) -> "Program":
        """The same lowered program planned for another Target (the infos do not depend on it;
        what strategies memoized may, so that starts afresh)."""
        return Program(self.tensors, self.name, self.module, target, self.sizes, self.compile_arch or target.arch,
                       self._infos)


__all__ = ["FALLBACK_ARCH", "Program", "resolve_target"]
