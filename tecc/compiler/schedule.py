"""The user-facing Schedule: apply schedule primitives to the lowered loop IR, recording a Plan.

    sch = tc.Schedule([A, B, C])
    i, j, k = sch.get_loops("C")
    io, ii = sch.split(i, 64)
    ...
    sch2 = tc.Schedule([A, B, C], plan=tc.Plan.from_json(sch.plan.to_json()))   # same IR

Loops are handles (`LoopRV`) that name a kernel and a loop variable; every primitive keeps the
loop names of a kernel unique, so a handle survives the rewrites that rebuild the tree. Stages
are named by tensor ("C", and cache stages "A.shared", "C.local"). Every primitive appends a
`Step` with JSON arguments (loops as "kernel/loop") to `plan`; replaying the plan on a fresh
Schedule of the same tensors gives identical IR text. With `dump_ir=DIR`, the module is written
after every primitive (`00_lower.txt`, `01_split.txt`, ...).
"""

from __future__ import annotations


import os
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence, Union

from ..ir.errors import ScheduleError
from ..ir.layout import LayoutError, Swizzle
from ..ir.stmt import Module, PrimFunc
from ..ir.tensor import Tensor
from ..passes import schedule as prim
from ..passes.rewrite.fuse_rows import fuse_rows as fuse_rows_module
from ..passes.rewrite.online_backward_mma import online_backward_mma as online_backward_mma_module
from ..passes.rewrite.online_contraction import online_contraction as online_contraction_module
from ..passes.rewrite.online_contraction_mma import online_contraction_mma as online_contraction_mma_module
from ..passes.rewrite.scatter_atomic import scatter_atomic_module
from ..passes.rewrite.split_reduce import split_reduce as split_reduce_module
from ..passes.rewrite.split_row_group import split_row_group as split_row_group_module
from ..passes.rewrite.split_rows import split_rows as split_rows_module
from ..passes.lower import lower
from ..passes.manager import DumpIR
from ..passes.simplify import simplify_func
from .plan import Plan, Step
from .plan_replay import checked_step
from .schedule_tensor_core import TENSOR_CORE_PRIMITIVES, TensorCorePrimitives


@dataclass(frozen=True)
class LoopRV:
    """A loop of a kernel, by name (`kernel/loop` in plans)."""

    kernel: str
    name: str

    def __str__(self) -> str:
        return f"{self.kernel}/{self.name}"


@dataclass(frozen=True)
class StageRV:
    """A stage (tensor) computed in a kernel; cache stages are named "A.shared", "C.local"."""

    kernel: str
    name: str

    def __str__(self) -> str:
        return f"{self.kernel}/{self.name}"


LoopLike = Union[LoopRV, str]
StageLike = Union[StageRV, str]


@dataclass
class _PendingRead:
    tensor: str
    scope: str
    pad: int = 0
    vector: int = 1
    transpose: bool = False
    swizzle: Swizzle | None = None


class Schedule(TensorCorePrimitives):
    """Schedule primitives over the naive lowered module of `tensors` (see the module docstring);
    the tensor-core primitives are in schedule_tensor_core.py."""

    def __init__(self, tensors: Sequence[Tensor], plan: Plan | str | dict[str, Any] | None = None, *,
                 name: str | None = None, dump_ir: str | os.PathLike[str] | DumpIR | None = None,
                 lowered: Module | None = None) -> None:
        """`lowered`: the naive lowered module of `tensors` under `name`, when the caller lowered
        it already (the build lowers a program once: tecc.compiler.program)."""
        start = time.perf_counter()
        self._tensors = list(tensors)
        self._name = name
        self.mod = lowered if lowered is not None else lower(self._tensors, name)
        self.timing: list[tuple[str, float]] = [("lower", time.perf_counter() - start)]
        self._steps: list[Step] = []
        self._pending: dict[str, _PendingRead] = {}
        # a DumpIR may be shared with the build that continues the numbering after the primitives
        self._dump = dump_ir if isinstance(dump_ir, DumpIR) else DumpIR(dump_ir) if dump_ir is not None else None
        if self._dump is not None:
            self._dump.write("lower.txt", f"# after lower\n{self._dump.text(self.mod)}")
        if plan is not None:
            self.replay(plan if isinstance(plan, Plan) else Plan.from_json(plan))

    # ---- the record -------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        return Plan(tuple(self._steps), "manual", "schedule written by hand")

    def checkpoint(self) -> tuple[Any, ...]:
        """The schedule's state now (its IR, steps and pending caches), for `rollback`: the
        planner tries a strategy's primitives and, when one refuses, returns to this state
        instead of lowering and replaying the whole program again. Any checkpoint can be
        returned to, also one taken after steps that a later rollback undid (the planner applies
        the next candidates of a kernel while a compile check of an earlier one runs)."""
        pending = {k: replace(v) for k, v in self._pending.items()}
        return (self.mod, tuple(self._steps), pending, tuple(self.timing))

    def rollback(self, state: tuple[Any, ...]) -> None:
        """Return to a `checkpoint` (the steps after it are forgotten)."""
        mod, steps, pending, timing = state
        self.mod = mod
        self._steps = list(steps)
        self._pending = {k: replace(v) for k, v in pending.items()}
        self.timing = list(timing)

    def replay(self, plan: Plan) -> None:
        """Apply every step of `plan` in order (plan_replay.checked_step says what a step may be)."""
        for number, step in enumerate(plan.steps):
            step = checked_step(self, _kernel_names(self.mod), plan, number)
            method = getattr(self, step.primitive)
            if step.primitive == "reorder":
                method(*step.args["loops"])
            else:
                method(**step.args)

    def __str__(self) -> str:
        return str(self.mod)

    # ---- addressing -------------------------------------------------------------------------
    def _kernel_of_stage(self, stage: str) -> PrimFunc:
        # (a kernel whose emission is deferred holds its stage's lowered body: it is found there)
        for k in self._mod.kernels:
            if prim.stage_leaves(k, stage):
                return k
        names = sorted({s.buffer.tensor for k in self.mod.kernels for s, _ in _stores(k)})
        raise ScheduleError(f"no kernel computes stage {stage!r}; stages: {', '.join(names)}")

    def _loop(self, loop: LoopLike) -> LoopRV:
        if isinstance(loop, LoopRV):
            return loop
        if isinstance(loop, str) and "/" in loop:
            kernel, name = loop.split("/", 1)
            return LoopRV(kernel, name)
        raise ScheduleError(f"a loop is a LoopRV from get_loops/split or 'kernel/loop', got {loop!r}")

    def _stage(self, stage: StageLike) -> StageRV:
        if isinstance(stage, StageRV):
            return stage
        if isinstance(stage, str) and "/" in stage:
            kernel, name = stage.split("/", 1)
            return StageRV(kernel, name)
        if isinstance(stage, str):
            return StageRV(self._kernel_of_stage(stage).name, stage)
        raise ScheduleError(f"a stage is a tensor name or a StageRV, got {stage!r}")

    def _same_kernel(self, what: str, loops: Sequence[LoopRV]) -> str:
        kernels = sorted({lp.kernel for lp in loops})
        if len(kernels) != 1:
            raise ScheduleError(f"{what}: the loops belong to different kernels ({', '.join(kernels)}); "
                                "a primitive works inside one kernel")
        return kernels[0]

    def get_loops(self, stage: StageLike) -> list[LoopRV]:
        """Every loop around the statements of `stage`, outermost (and earliest) first."""
        st = self._stage(stage)
        k = self.mod.kernel(st.kernel)
        return [LoopRV(k.name, lp.var.name) for lp in prim.stage_loops(k, st.name)]

    # ---- applying ---------------------------------------------------------------------------
    def _apply(self, kernel: str, step: Step, fn: Any) -> PrimFunc:
        deferred = self._deferred_apply(kernel, step, fn)   # (inside `deferring`: recorded, not emitted)
        if deferred is not None:
            return deferred
        try:
            func = self.mod.kernel(kernel)
        except KeyError:
            raise ScheduleError(f"{step.primitive}: no kernel {kernel!r}") from None
        start = time.perf_counter()
        new = simplify_func(fn(func))
        if step.primitive not in TENSOR_CORE_PRIMITIVES:
            new = prim.forget_record(new)   # the tensor-core record describes the kernel no longer
        self.timing.append((step.primitive, time.perf_counter() - start))
        self.mod = self.mod.with_kernels([new if k.name == kernel else k for k in self.mod.kernels])
        self._record(step)
        return new

    def _record(self, step: Step) -> None:
        self._steps.append(step)
        if self._dump is not None:
            args = "".join(f"  # {k} = {v}\n" for k, v in step.args.items())
            self._dump.write(f"{step.primitive}.txt", f"# after {step.primitive}\n{args}{self._dump.text(self.mod)}")

    # ---- primitives -------------------------------------------------------------------------
    def split(self, loop: LoopLike, factor: int | None = None, *, nparts: int | None = None,
              factors: Sequence[int | None] | None = None) -> tuple[LoopRV, ...]:
        """Split `loop` by `factor` (inner extent), `nparts` (outer extent) or `factors`
        (outermost first, one may be None). Returns the new loops, outermost first."""
        lp = self._loop(loop)
        given = [x is not None for x in (factor, nparts, factors)]
        if sum(given) != 1:
            raise ScheduleError(f"split of {lp.name}: give exactly one of factor, nparts, factors")
        fs: list[int | None] = ([None, factor] if factor is not None else [nparts, None] if nparts is not None
                                else list(factors or []))
        before = _loop_names(self.mod.kernel(lp.kernel)) if lp.kernel in _kernel_names(self.mod) else set()
        step = Step("split", {"loop": str(lp), "factors": fs})
        new = self._apply(lp.kernel, step, lambda f: prim.split(f, lp.name, fs))
        added = [n for n in _ordered_loop_names(new) if n not in before]
        return tuple(LoopRV(lp.kernel, n) for n in added)

    def tile(self, outer: LoopLike, inner: LoopLike, outer_factor: int, inner_factor: int) -> tuple[LoopRV, ...]:
        """split both loops and reorder to (outer_o, inner_o, outer_i, inner_i)."""
        xo, xi = self.split(outer, outer_factor)
        yo, yi = self.split(inner, inner_factor)
        self.reorder(xo, yo, xi, yi)
        return xo, yo, xi, yi

    def reorder(self, *loops: LoopLike) -> None:
        lps = [self._loop(x) for x in loops]
        kernel = self._same_kernel("reorder", lps)
        step = Step("reorder", {"loops": [str(x) for x in lps]})
        self._apply(kernel, step, lambda f: prim.reorder(f, [x.name for x in lps]))

    def fuse(self, outer: LoopLike, inner: LoopLike) -> LoopRV:
        o, i = self._loop(outer), self._loop(inner)
        kernel = self._same_kernel("fuse", [o, i])
        before = _loop_names(self.mod.kernel(kernel))
        new = self._apply(kernel, Step("fuse", {"outer": str(o), "inner": str(i)}),
                          lambda f: prim.fuse(f, o.name, i.name))
        added = [n for n in _ordered_loop_names(new) if n not in before]
        return LoopRV(kernel, added[0])

    def bind(self, loop: LoopLike, axis: str) -> None:
        lp = self._loop(loop)
        self._apply(lp.kernel, Step("bind", {"loop": str(lp), "axis": axis}), lambda f: prim.bind(f, lp.name, axis))

    def unroll(self, loop: LoopLike) -> None:
        lp = self._loop(loop)
        self._apply(lp.kernel, Step("unroll", {"loop": str(lp)}), lambda f: prim.unroll(f, lp.name))

    def vectorize(self, loop: LoopLike) -> None:
        lp = self._loop(loop)
        self._apply(lp.kernel, Step("vectorize", {"loop": str(lp)}), lambda f: prim.vectorize(f, lp.name))

    def cache_read(self, stage: StageLike, tensor: str, scope: str) -> StageRV:
        """A cache of `tensor` in `scope` ("shared" | "local") for the reads of `stage`. It is
        placed (and the IR changes) by `compute_at(cache, loop)`."""
        st = self._stage(stage)
        if scope not in ("shared", "local"):
            raise ScheduleError(f"cache_read of {tensor}: scope must be 'shared' or 'local', got {scope!r}")
        cache = StageRV(st.kernel, f"{tensor}.{scope}")
        if str(cache) in self._pending:
            raise ScheduleError(f"cache_read: {tensor} already has a {scope} cache in {st.kernel}")
        self._pending[str(cache)] = _PendingRead(tensor, scope)
        self._record(Step("cache_read", {"stage": str(st), "tensor": tensor, "scope": scope}))
        return cache

    def storage_align(self, cache: StageLike, pad: int) -> None:
        """Pad the last dimension of a pending shared cache by `pad` elements, so rows start in
        different shared-memory banks (a column walk of a 32-wide float tile is then free of
        bank conflicts). Call it before compute_at."""
        c = self._stage(cache)
        pending = self._pending.get(str(c))
        if pending is None:
            raise ScheduleError(f"storage_align({c}): not a cache_read stage that is still to be placed")
        if not isinstance(pad, int) or pad < 0:
            raise ScheduleError(f"storage_align({c}): pad must be a non-negative integer, got {pad!r}")
        pending.pad = pad
        self._record(Step("storage_align", {"cache": str(c), "pad": pad}))

    def vector_copy(self, cache: StageLike, width: int) -> None:
        """Copy a pending shared cache in chunks of `width` consecutive elements of its last
        dimension per thread (width 4 of 4-byte, 8 of 2-byte or 16 of 1-byte elements: 16-byte LDG.128 /
        STS.128 where the offsets are provably aligned; the emitter falls back to scalar accesses
        where they are not). Call it before compute_at."""
        c = self._stage(cache)
        pending = self._pending.get(str(c))
        if pending is None or pending.scope != "shared":
            raise ScheduleError(f"vector_copy({c}): not a shared cache_read stage that is still to be placed")
        if width not in (1, 2, 4, 8, 16):
            raise ScheduleError(f"vector_copy({c}): width must be 1, 2, 4, 8 (8: 16-bit elements) or 16 (8-bit "
                                f"elements), got {width!r}")
        if pending.swizzle is not None and width > pending.swizzle.contiguous:
            raise ScheduleError(f"vector_copy({c}): the cache's {pending.swizzle} keeps {pending.swizzle.contiguous} "
                                f"consecutive elements together, fewer than the width {width}")
        pending.vector = width
        self._record(Step("vector_copy", {"cache": str(c), "width": width}))

    def storage_swizzle(self, cache: StageLike, bits: int, base: int, shift: int) -> None:
        """Store a pending shared cache where the XOR layout `Swizzle(bits, base, shift)`
        (tecc.ir.layout) puts its flat offsets: chunks of 2^base consecutive elements stay
        contiguous and in order (16-byte copies into the tile stay 16-byte accesses), and the chunk
        index is XOR-ed with the offset's bits [base + shift, base + shift + bits), so that a
        column walk over rows whose row-group index sits there spreads over the banks without
        padding the rows (a padded row is not 16-byte aligned). The map is written into the
        indices of every access to the cache (cache_read.swizzled_index). Call it before
        compute_at. With storage_align too, it applies to the offsets of the padded rows (a box 56
        elements wide stored in rows of 64, so that the row-group bits sit where it reads them)."""
        c = self._stage(cache)
        pending = self._pending.get(str(c))
        if pending is None or pending.scope != "shared":
            raise ScheduleError(f"storage_swizzle({c}): not a shared cache_read stage that is still to be placed")
        try:
            layout = Swizzle(int(bits), int(base), int(shift))
        except (LayoutError, TypeError, ValueError) as exc:
            raise ScheduleError(f"storage_swizzle({c}): {exc}") from exc
        if pending.vector > layout.contiguous:
            raise ScheduleError(f"storage_swizzle({c}): {layout} keeps {layout.contiguous} consecutive elements together, "
                                f"fewer than the vector copy's width {pending.vector}; raise base")
        pending.swizzle = layout
        self._record(Step("storage_swizzle", {"cache": str(c), "bits": layout.bits, "base": layout.base,
                                              "shift": layout.shift}))

    def storage_transpose(self, cache: StageLike) -> None:
        """Store a pending two-dimensional shared cache transposed ([column][row]): the GEMM's A
        tile as [k][i], so a thread's rows of A at one k are contiguous (LDS.128) while the copy
        still reads A along its rows. Call it before compute_at."""
        c = self._stage(cache)
        pending = self._pending.get(str(c))
        if pending is None or pending.scope != "shared":
            raise ScheduleError(f"storage_transpose({c}): not a shared cache_read stage that is still to be placed")
        pending.transpose = True
        self._record(Step("storage_transpose", {"cache": str(c)}))

    def double_buffer(self, loop: LoopLike) -> None:
        """Software-pipeline the shared copies at the top of `loop` (a k-tile loop): the next
        tile is loaded into registers while the current one is computed, then stored to shared
        memory (tecc/passes/schedule/double_buffer.py)."""
        lp = self._loop(loop)
        self._apply(lp.kernel, Step("double_buffer", {"loop": str(lp)}),
                    lambda f: prim.double_buffer(f, lp.name))

    def guard_writeback_only(self, stage: StageLike) -> None:
        """Keep the split guards of a per-thread register tile (a "C.local" write cache) only on
        the statements that read it for the write-back: the init and the accumulation also run
        on the tile's out-of-range lanes, which are never stored (the proof and its checks are in
        tecc/passes/schedule/guard_writeback.py). Unchanged where every split divides."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("guard_writeback_only", {"stage": str(st)}),
                    lambda f: prim.guard_writeback_only(f, st.name))

    def unguard_reduction_tail(self, stage: StageLike) -> None:
        """Drop the k-tail guard (`k_o*BK + k_i < K`) from the accumulation of a per-thread
        register tile ("C.local") where islpy proves both shared tiles it multiplies hold the
        copy's zero fill there (the step adds 0*0). Apply it after compute_at of the shared
        caches and before double_buffer (tecc/passes/schedule/reduction_tail.py). Unchanged
        where nothing is proved (every k-tile divides K)."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("unguard_reduction_tail", {"stage": str(st)}),
                    lambda f: prim.unguard_reduction_tail(f, st.name))

    def rfactor(self, loop: LoopLike) -> StageRV:
        """Make the reduction loop `loop` (e.g. the outer loop of `split(k, [None, chunk])`) a
        parallel axis: the kernel computes partial results `C_rf[loop, ...]` into a temporary,
        summed in order by a second kernel `<kernel>_combine` that also applies the stage's
        epilogue (split-K; tecc/passes/schedule/rfactor.py). Returns the partial stage ("C.rf"),
        whose loops are `loop` first, then the output's, then the rest of the reduction. Apply
        it before any binding in the kernel; the combine kernel is left to default_schedule."""
        lp = self._loop(loop)
        step = Step("rfactor", {"loop": str(lp)})
        if lp.kernel not in _kernel_names(self.mod):
            raise ScheduleError(f"rfactor: no kernel {lp.kernel!r}")
        store = [s for s, _ in _stores(self.mod.kernel(lp.kernel)) if s.buffer.scope == "global"]
        start = time.perf_counter()
        mod = prim.rfactor(self.mod, lp.kernel, lp.name)
        self.mod = mod.with_kernels([simplify_func(k) for k in mod.kernels])
        self.timing.append(("rfactor", time.perf_counter() - start))
        self._record(step)
        return StageRV(lp.kernel, f"{store[-1].buffer.tensor}.rf")

    def compute_at(self, stage: StageLike, loop: LoopLike) -> None:
        """Place the cache stage `stage` at the top of `loop`'s body, sized to the tile read there."""
        st, lp = self._stage(stage), self._loop(loop)
        pending = self._pending.get(str(st))
        if pending is None:
            raise ScheduleError(
                f"compute_at({st}, {lp.name}): only a cache_read stage that is not placed yet can be moved; "
                "write caches sit where the accumulator is (move them with reorder)"
            )
        if lp.kernel != st.kernel:
            raise ScheduleError(f"compute_at({st}, {lp}): the loop is in kernel {lp.kernel}, the stage in {st.kernel}")
        self._apply(lp.kernel, Step("compute_at", {"stage": str(st), "loop": str(lp)}),
                    lambda f: prim.stage_read(f, pending.tensor, pending.scope, lp.name, pending.pad,
                                               pending.vector, pending.transpose, pending.swizzle))
        del self._pending[str(st)]

    def fuse_rows(self, threads: int, cache: str = "registers", vector: int = 1, rows_per_block: int = 1,
                  unroll: int = 1, row_blocks: int = 0, column_sums: str = "local", prefetch: bool = False,
                  float_rows: bool = False, whole_steps: bool = False, prefetch_into: str = "registers",
                  occupancy: bool = True) -> None:
        """Replace the module by ONE kernel computing every stage that shares the row (a
        reduce→elementwise graph: softmax, layer norm, a row sum; see tecc.passes.rewrite.fuse_rows):
        one block of `threads` threads per row, cross-thread reductions, the row kept in
        registers (`cache="registers"`) or re-read (`cache="none"`, `"online"`: in chunks of
        `unroll` vectors); `rows_per_block` > 1 puts that many rows in a block, one 32-thread
        warp each; `row_blocks` > 0 launches that many blocks, each walking rows in a loop and
        summing the group's column reductions (a normalization's dγ, dβ) in registers
        (`column_sums="local"`) or shared memory (`"shared"`), which a second kernel combines;
        `prefetch` loads each block's next row while the current one is computed; `float_rows`
        keeps 16-bit row registers converted to float32 (one conversion per element, not one per
        pass); `whole_steps` tests the row's end at the last step of a thread's walk only (the
        steps below are straight-line code); `prefetch_into="shared"` stages the prefetched row in
        shared memory by cp.async instead of registers; `occupancy=False` drops the kernel's request
        for resident blocks (`__launch_bounds__`' second argument). It must be the first step."""
        if self._steps:
            raise ScheduleError("fuse_rows rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = fuse_rows_module(self._tensors, int(threads), cache, name=self._name, vector=int(vector),
                                    rows_per_block=int(rows_per_block), unroll=int(unroll),
                                    row_blocks=int(row_blocks), column_sums=column_sums, prefetch=bool(prefetch),
                                    float_rows=bool(float_rows), whole_steps=bool(whole_steps),
                                    prefetch_into=prefetch_into, occupancy=bool(occupancy))
        self.timing.append(("fuse_rows", time.perf_counter() - start))
        args: dict[str, Any] = {"threads": int(threads), "cache": cache}
        if vector != 1:
            args["vector"] = int(vector)
        if rows_per_block != 1:
            args["rows_per_block"] = int(rows_per_block)
        if unroll != 1:
            args["unroll"] = int(unroll)
        if row_blocks:
            args["row_blocks"] = int(row_blocks)
        if column_sums != "local":
            args["column_sums"] = column_sums
        if prefetch:
            args["prefetch"] = True
        if float_rows:
            args["float_rows"] = True
        if whole_steps:
            args["whole_steps"] = True
        if prefetch_into != "registers":
            args["prefetch_into"] = prefetch_into
        if not occupancy:
            args["occupancy"] = False
        self._record(Step("fuse_rows", args))

    def online_contraction(self, threads: int = 32, rows_per_block: int = 4) -> None:
        """Replace the module by ONE kernel computing a contraction over the axis of a (max,
        Σ exp) row statistic with a running max, a rescaled sum and a rescaled partial output
        (attention, softmax then a contraction; see tecc.passes.rewrite.online_contraction):
        `rows_per_block` rows per block, `threads` lanes per row, the key axis walked in tiles
        of `threads`. It must be the first step."""
        if self._steps:
            raise ScheduleError("online_contraction rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = online_contraction_module(self._tensors, int(threads), int(rows_per_block), name=self._name)
        self.timing.append(("online_contraction", time.perf_counter() - start))
        self._record(Step("online_contraction", {"threads": int(threads), "rows_per_block": int(rows_per_block)}))

    def online_contraction_mma(self, rows_per_block: int = 64, key_tile: int = 64, warp_rows: int = 16,
                               wgmma: bool = False, blocks_per_sm: int = 0, overlap: bool = False,
                               plain_order: bool = False, persistent: int = 0, kv_splits: int = 1,
                               guard_every_tile: bool = False, stages: int = 2, peel_guarded: bool = False,
                               query_major: bool = False) -> None:
        """Replace the module by ONE tensor-core kernel for the same chain as online_contraction
        when both contractions have float16/bfloat16 operands and constant head dims (see
        tecc.passes.rewrite.online_contraction_mma): `rows_per_block` query rows per block,
        `warp_rows` (16 or 32) per warp, key tiles of `key_tile` streamed through a 2-stage
        cp.async ring. `wgmma`: the Hopper form (sm_90a: one warpgroup per 64 query rows, both
        contractions as wgmma, P from registers; `warp_rows` unused; `blocks_per_sm` > 0 asks for
        that many resident blocks through the launch bounds; `overlap` issues the next tile's
        scores and softmax while P·V is in flight, over a 3-stage ring). `plain_order` launches the
        blocks in the plain grid's order instead of grouped heads side by side and the longest
        query blocks first (for timing one against the other). `persistent` > 0 (wgmma, not
        overlapped): that many blocks (132: one per SM of an H100/H200) loop over the (query block,
        head) work items, the longest first, the next item's loads under this one's epilogue.
        `kv_splits` > 1: split-KV (a grid axis over key chunks, float32 partials, a combine
        kernel), for few query rows over many keys. `guard_every_tile` puts the per-element mask
        guard on every visited key tile, not only the partial ones (same results; for timing the
        guard). `stages` (wgmma, plain loop): the depth of the K/V cp.async ring, 2 or 3.
        `peel_guarded`: the key tiles that carry the guard run in a loop of their own after the
        whole ones (what ptxas allocates differs; the planner takes it where it fits more blocks
        per SM). `query_major`: the blocks launched query block major over all heads, the longest
        of every head first (not persistent). It must be the first step."""
        if self._steps:
            raise ScheduleError("online_contraction_mma rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = online_contraction_mma_module(self._tensors, int(rows_per_block), int(key_tile), int(warp_rows),
                                                 name=self._name, wgmma=bool(wgmma),
                                                 blocks_per_sm=int(blocks_per_sm), overlap=bool(overlap),
                                                 plain_order=bool(plain_order), persistent=int(persistent),
                                                 kv_splits=int(kv_splits), guard_every_tile=bool(guard_every_tile),
                                                 stages=int(stages), peel_guarded=bool(peel_guarded),
                                                 query_major=bool(query_major))
        self.timing.append(("online_contraction_mma", time.perf_counter() - start))
        args: dict[str, Any] = {"rows_per_block": int(rows_per_block), "key_tile": int(key_tile)}
        if wgmma:
            args["wgmma"] = True
            if blocks_per_sm:
                args["blocks_per_sm"] = int(blocks_per_sm)
            if overlap:
                args["overlap"] = True
            if persistent:
                args["persistent"] = int(persistent)
        elif warp_rows != 16:
            args["warp_rows"] = int(warp_rows)
        if plain_order:
            args["plain_order"] = True
        if kv_splits > 1:
            args["kv_splits"] = int(kv_splits)
        if guard_every_tile:
            args["guard_every_tile"] = True
        if peel_guarded:
            args["peel_guarded"] = True
        if query_major:
            args["query_major"] = True
        if stages != 2:
            args["stages"] = int(stages)
        self._record(Step("online_contraction_mma", args))

    def online_backward_mma(self, key_tile: int = 64, rows: int = 64, dq_columns: int = 32, dq: str = "atomic",
                            dq_rows: int = 64, dq_key_tile: int = 64, wgmma: bool = False, whole_tiles: bool = True,
                            stages: int = 2, overlap: bool = False) -> None:
        """Replace the module by the tensor-core kernels of the backward of an online contraction
        (the program tc.grad writes for attention; tecc.passes.rewrite.online_backward_mma): a
        pre-pass for the row statistics and one kernel over blocks of `key_tile` keys walking
        query blocks of `rows` (dK, dV in registers); dQ by float32 atomics in units of 16 rows x
        `dq_columns` and a conversion (`dq` "atomic"), or by a query-major kernel of `dq_rows`
        rows over key blocks of `dq_key_tile` ("kernel"). `wgmma`: the key-block-major kernel on
        warpgroup MMA (sm_90a). `whole_tiles` False: every tile through the guarded elementwise
        stage (one copy of it, fewer registers). `stages`: the depth (2-4) of the key-block-major
        kernel's ring of query blocks. `overlap`: its dV/dK wgmmas left in flight into the next
        step (one warpgroup per block, dQ by the query-major kernel). It must be the first step."""
        if self._steps:
            raise ScheduleError("online_backward_mma rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = online_backward_mma_module(self._tensors, int(key_tile), int(rows), int(dq_columns), name=self._name,
                                              dq=str(dq), dq_rows=int(dq_rows), dq_key_tile=int(dq_key_tile),
                                              wgmma=bool(wgmma), whole_tiles=bool(whole_tiles), stages=int(stages),
                                              overlap=bool(overlap))
        self.timing.append(("online_backward_mma", time.perf_counter() - start))
        args: dict[str, Any] = {"key_tile": int(key_tile), "rows": int(rows)}
        if dq == "atomic":
            args["dq_columns"] = int(dq_columns)
        else:
            args.update(dq=str(dq), dq_rows=int(dq_rows), dq_key_tile=int(dq_key_tile))
        if wgmma:
            args["wgmma"] = True
        if not whole_tiles:
            args["whole_tiles"] = False
        if int(stages) != 2:
            args["stages"] = int(stages)
        if overlap:
            args["overlap"] = True
        self._record(Step("online_backward_mma", args))

    def split_reduce(self, threads_x: int = 32, threads_y: int = 8, splits: int = 1, unroll: int = 4,
                     outputs_per_thread: int = 1, combine: str = "kernel") -> None:
        """Replace the module by the split reduction of its one reduction stage (a column or
        middle-axis reduction; see tecc.passes.rewrite.split_reduce): `threads_x` consecutive outputs
        per block, the reduced axis over `threads_y` threads and `splits` blocks, combined in
        shared memory and, when splits > 1, by a second kernel (`combine="kernel"`) or by the
        last block to finish, in one kernel (`combine="last_block"`); `outputs_per_thread`
        adjacent outputs per thread make its row reads vector loads. It must be the first step."""
        if self._steps:
            raise ScheduleError("split_reduce rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = split_reduce_module(self._tensors, int(threads_x), int(threads_y), int(splits), int(unroll),
                                       name=self._name, outputs_per_thread=int(outputs_per_thread),
                                       combine=str(combine))
        self.timing.append(("split_reduce", time.perf_counter() - start))
        args: dict[str, Any] = {"threads_x": int(threads_x), "threads_y": int(threads_y), "splits": int(splits),
                                "unroll": int(unroll)}
        if outputs_per_thread != 1:
            args["outputs_per_thread"] = int(outputs_per_thread)
        if combine != "kernel":  # the default is left out, so plans recorded before it read the same
            args["combine"] = str(combine)
        self._record(Step("split_reduce", args))

    def split_rows(self, threads: int = 256, splits: int = 1, vector: int = 1, unroll: int = 1,
                   combine: str = "kernel") -> None:
        """Replace the module by the two-stage grid reduction of its one reduction stage (few
        long rows, or a full reduction; see tecc.passes.rewrite.split_rows): `splits` blocks of
        `threads` threads per row over contiguous chunks, `unroll` loads of `vector` elements in
        flight per thread, the partials combined by a second kernel (`combine="kernel"`) or by
        the last of a row's blocks to finish, in one kernel (`combine="last_block"`). It must be
        the first step."""
        if self._steps:
            raise ScheduleError("split_rows rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        self.mod = split_rows_module(self._tensors, int(threads), int(splits), int(vector), int(unroll),
                                     name=self._name, combine=str(combine))
        self.timing.append(("split_rows", time.perf_counter() - start))
        args: dict[str, Any] = {"threads": int(threads), "splits": int(splits), "vector": int(vector),
                                "unroll": int(unroll)}
        if combine != "kernel":  # the default is left out, so plans recorded before it read the same
            args["combine"] = str(combine)
        self._record(Step("split_rows", args))

    def split_row_group(self, threads: int = 256, splits: int = 1, vector: int = 1, unroll: int = 1,
                        output_splits: int | None = None) -> None:
        """Replace the module by the two-kernel split form of its row group (softmax, layer
        norm, RMS norm over few long rows; see tecc.passes.rewrite.split_row_group): `splits` blocks of
        `threads` threads per row write their chunk's partial statistics, then `output_splits`
        (default: splits) blocks per row combine them and write their chunk of the outputs;
        each thread walks its chunk with `unroll` loads of `vector` columns in flight. It must
        be the first step."""
        if self._steps:
            raise ScheduleError("split_row_group rewrites the whole module: it must be the first step of a plan")
        start = time.perf_counter()
        outputs = None if output_splits is None or int(output_splits) == int(splits) else int(output_splits)
        self.mod = split_row_group_module(self._tensors, int(threads), int(splits), int(vector), int(unroll),
                                          output_splits=outputs, name=self._name)
        self.timing.append(("split_row_group", time.perf_counter() - start))
        args: dict[str, Any] = {"threads": int(threads), "splits": int(splits), "vector": int(vector),
                                "unroll": int(unroll)}
        if outputs is not None:  # the default (= splits) is left out
            args["output_splits"] = outputs
        self._record(Step("split_row_group", args))

    def flatten_contraction(self, stage: StageLike) -> None:
        """Rewrite the float32 contraction `stage` (a convolution, any grouping of axes) over its
        GEMM view: loops (b,) m, n, k reading view buffers `A_view[(b,) m, k]`, `B_view[(b,) k, n]`
        and storing `C_view[(b,) m, n]`, so the SIMT GEMM schedule applies as to a matrix product;
        `gather_views` afterwards turns the views back into gathered reads of the real tensors
        (tecc/passes/schedule/gemm_view.py). It must be the first primitive applied to the stage."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("flatten_contraction", {"stage": str(st)}),
                    lambda f: prim.flatten_contraction(f, st.name))

    def gather_views(self, stage: StageLike) -> None:
        """Replace the view buffers of a flattened contraction (flatten_contraction) by gathered,
        predicated reads of the real operands and the store to the real output, in the stage's
        kernel and in the combine kernel a split-K rfactor made of it; the last step."""
        st = self._stage(stage)
        step = Step("gather_views", {"stage": str(st)})
        if st.kernel not in _kernel_names(self.mod):
            raise ScheduleError(f"gather_views: no kernel {st.kernel!r}")
        start = time.perf_counter()
        mod = prim.gather_views(self.mod, st.kernel)
        self.mod = mod.with_kernels([simplify_func(k) for k in mod.kernels])
        self.timing.append(("gather_views", time.perf_counter() - start))
        self._record(step)

    def scatter_atomic(self, stage: str) -> tuple[str, ...]:
        """Realize the scatter `stage` (a masked sum with data-dependent matches, e.g. a
        `tc.scatter_add`) with atomic additions: its kernel becomes an init kernel, one atomic
        addition per domain point and, when the output's dtype is not the accumulator's, a finish
        kernel (tecc.passes.rewrite.scatter_atomic). Returns those kernels' names in launch order;
        they are unscheduled. Float sums then depend on the order of the atomics, which is not
        reproducible run to run."""
        kernel = self._kernel_of_stage(stage)
        start = time.perf_counter()
        self.mod, names = scatter_atomic_module(self.mod, kernel.name)
        self.timing.append(("scatter_atomic", time.perf_counter() - start))
        self._record(Step("scatter_atomic", {"stage": str(stage)}))
        return names

    def cache_write(self, stage: StageLike, scope: str = "local") -> StageRV:
        st = self._stage(stage)
        self._apply(st.kernel, Step("cache_write", {"stage": str(st), "scope": scope}),
                    lambda f: prim.cache_write(f, st.name, scope))
        return StageRV(st.kernel, f"{st.name}.{scope}")


def _stores(k: PrimFunc) -> list[Any]:
    from ..ir.stmt import BufferStore
    from ..passes.schedule.loops import iter_with_path

    return [(s, p) for s, p in iter_with_path(k.body) if isinstance(s, BufferStore)]


def _kernel_names(m: Module) -> set[str]:
    return {k.name for k in m.kernels}


def _ordered_loop_names(k: PrimFunc) -> list[str]:
    from ..ir.stmt import For
    from ..passes.schedule.loops import iter_with_path

    return [s.var.name for s, _ in iter_with_path(k.body) if isinstance(s, For)]


def _loop_names(k: PrimFunc) -> set[str]:
    return set(_ordered_loop_names(k))


__all__ = ["Schedule", "LoopRV", "StageRV"]
