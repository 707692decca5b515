"""The tensor-core primitives of `Schedule` (tecc/passes/schedule/tensor_core.py has the passes):

    k_tiles = sch.tensorize("C", "wgmma", block=(128, 256), warps=(8, 1), k_tile=64)
    for operand in sch.gemm_operands("C"):
        sch.stage_operand("C", operand)                  # cp.async copies, swizzled tiles
    sch.pipeline(k_tiles, stages=4, producer="tma")      # an mbarrier ring of TMA loads
    sch.warp_specialize("C")                             # a producer warpgroup, consumer warpgroups
    sch.split_k("C", splits=4)                           # (small grids) 4 blocks share each tile's k tiles
    sch.persistent("C", blocks=132)                      # blocks loop over the output tiles
    sch.epilogue("C", "tma")                             # the outputs staged, written by TMA stores

Each call is one Step of the plan and one dump, and emits the kernel from its record again.
Inside `deferring()` (the planner realizing a twin's point, whose every step emitted for its
twin) a step only records: the kernel is emitted once, from the last record, when the block ends
or when anything reads `mod` -- the same kernel, less five emissions of a wgmma kernel. A plan recorded before these primitives holds one
`tensorize` step with the whole kernel's parameters (stages, producer, persistent, epilogue,
staged_output, fragment_pipeline, group_m); `Schedule.replay` expands it into these steps
(`replay_legacy_tensorize`), so tuning databases and caches that keep such plans still build
the same kernels.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ..ir.errors import ScheduleError
from ..ir.stmt import KernelCall, Module, PrimFunc
from ..passes import schedule as prim
from ..passes.schedule import legality
from ..passes.simplify import simplify_func
from .plan import Step

TENSOR_CORE_PRIMITIVES = ("tensorize", "stage_operand", "pipeline", "pipeline_fragments", "warp_specialize",
                          "split_k", "tile_order", "persistent", "epilogue")
# the arguments only a plan recorded before the primitives above gives `tensorize`
LEGACY_TENSORIZE_ARGS = ("stages", "producer", "persistent", "epilogue", "staged_output", "fragment_pipeline",
                         "group_m")


# the primitives `deferring` lets wait for their emission (split_k rewrites the module: it emits)
DEFERRABLE = ("tensorize", "stage_operand", "pipeline", "pipeline_fragments", "warp_specialize", "tile_order",
              "persistent", "epilogue")


class TensorCorePrimitives:
    """The tensor-core primitives (module docstring); a part of `Schedule`."""

    _stage: Any
    _loop: Any
    _apply: Any
    _record: Any
    _dump: Any
    timing: Any

    # ---- the module, its kernels emitted (module docstring: `deferring`) ---------------------
    @property
    def mod(self) -> Module:
        if self.__dict__.get("_deferred"):
            self._emit_deferred()
        return self._mod

    @mod.setter
    def mod(self, value: Module) -> None:
        self._mod = value
        self._deferred: set[str] = set()

    @contextmanager
    def deferring(self, on: bool = True) -> Iterator[None]:
        """For a point the primitives took for a twin of the kernel (the planner's realization):
        the tensor-core steps inside the block record without emitting, the kernels emitted once
        when it ends (not when a step raises: the caller rolls back), and the dependence checks
        of the loop primitives are not computed again (legality.TRUSTED). `on` False (or a
        Schedule writing dumps, one per step): every step emits and checks, as outside."""
        if not on or self._dump is not None:
            yield
            return
        self._defer = True
        trusted = legality.TRUSTED.set(True)
        try:
            yield
        finally:
            self._defer = False
            legality.TRUSTED.reset(trusted)
        self._emit_deferred()

    def _deferred_apply(self, kernel: str, step: Step, fn: Callable[[PrimFunc], PrimFunc]) -> PrimFunc | None:
        """Schedule._apply of a step inside `deferring`: the primitive's record on the kernel,
        not emitted; None when the step emits as always."""
        if not self.__dict__.get("_defer") or step.primitive not in DEFERRABLE:
            return None
        try:
            func = self._mod.kernel(kernel)
        except KeyError:
            raise ScheduleError(f"{step.primitive}: no kernel {kernel!r}") from None
        start = time.perf_counter()
        token = prim.tensor_core.DEFER.set(True)
        try:
            new: PrimFunc = fn(func)
        finally:
            prim.tensor_core.DEFER.reset(token)
        self.timing.append((step.primitive, time.perf_counter() - start))
        self._mod = self._mod.with_kernels([new if k.name == kernel else k for k in self._mod.kernels])
        self._deferred.add(kernel)
        self._record(step)
        return new

    def _emit_deferred(self) -> None:
        """Each kernel whose steps were deferred emitted from its last record, as its last step
        would have (`simplify_func(emit(record))`)."""
        for name in sorted(self._deferred):
            record = prim.tensor_core.record_of(self._mod.kernel(name), "the deferred tensor-core steps")
            new = simplify_func(prim.tensor_core.emit(record))
            self._mod = self._mod.with_kernels([new if k.name == name else k for k in self._mod.kernels])
        self._deferred = set()

    def tensorize(self, stage: Any, intrinsic: str = "auto", block: Sequence[int] = (64, 64),
                  warps: Sequence[int] = (2, 2), k_tile: int = 32) -> Any:
        """Map the block tile of the contraction `stage` (C[b.., i, j] = epilogue(Σ_k A·B) over
        float16/bfloat16 operands, or any contraction that is such a GEMM once its axes are
        grouped: a convolution) onto a row of the intrinsic table: `block` = (BM, BN) outputs
        per block, `warps` = (rows, columns) of warps each computing a (BM/rows) × (BN/columns)
        tile of mma.m16n8k16 tiles, k tiles of `k_tile`. `intrinsic`: "auto" (the mma row of the
        operands' dtype; float32 operands take only "mma.m16n8k8.f32.tf32", named: their inputs
        are rounded to tf32), or "wgmma" (or a wgmma row) for Hopper: BM/64 warpgroups, `warps`
        = (4·BM/64, 1), k_tile 64 (128 bytes of elements). It must be the first primitive
        applied to the stage's kernel; alone it gives the simplest kernel that runs (operands
        copied element by element into plain shared tiles, one buffer). Returns the k-tile loop
        (for `pipeline`)."""
        st = self._stage(stage)
        bm, bn = (int(x) for x in block)
        wm, wn = (int(x) for x in warps)
        step = Step("tensorize", {"stage": str(st), "intrinsic": intrinsic, "block": [bm, bn], "warps": [wm, wn],
                                  "k_tile": int(k_tile)})
        self._apply(st.kernel, step, lambda f: prim.tensorize(f, st.name, intrinsic, (bm, bn), (wm, wn), int(k_tile)))
        return self._loop(f"{st.kernel}/{prim.tensor_core.K_TILE_LOOP}")

    def gemm_operands(self, stage: Any) -> tuple[str, ...]:
        """The tensors the tensorized `stage` reads as its A (rows) and B (columns) operands (one
        tensor when it multiplies a tensor by itself)."""
        st = self._stage(stage)
        return prim.gemm_operands(self._mod.kernel(st.kernel), st.name)  # (the record alone)

    def stage_operand(self, stage: Any, tensor: str, layout: str = "swizzle") -> None:
        """Stage the tensorized stage's operand `tensor` in shared memory: cp.async copies of 16,
        8 or 4 bytes where its addresses allow them (guarded element loads elsewhere), the tile
        in `layout`, "swizzle" (the XOR swizzle its fragment reads are conflict-free under) or
        "none" (tecc/passes/schedule/tile_staging.py)."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("stage_operand", {"stage": str(st), "tensor": tensor, "layout": layout}),
                    lambda f: prim.stage_operand(f, st.name, tensor, layout))

    def pipeline(self, loop: Any, stages: int, producer: str = "cp.async") -> None:
        """Make the k-tile loop `loop` (what tensorize returned) a ring of `stages` shared buffers
        loaded ahead of the compute by `producer`: "cp.async" (every thread's copies, one commit
        group per tile) or "tma" (wgmma: TMA box copies completing on an mbarrier per stage; both
        operands staged) (tecc/passes/schedule/ring.py)."""
        lp = self._loop(loop)
        step = Step("pipeline", {"loop": str(lp), "stages": int(stages), "producer": producer})
        self._apply(lp.kernel, step, lambda f: prim.pipeline(f, lp.name, int(stages), producer))

    def pipeline_fragments(self, loop: Any) -> None:
        """mma.sync: keep two fragment sets, loading the next k step's fragments (ldmatrix) while
        this step's mma run, across the k-tile boundary (the ring's wait and barrier before the
        last k step of a tile; an even number of k steps per tile)."""
        lp = self._loop(loop)
        self._apply(lp.kernel, Step("pipeline_fragments", {"loop": str(lp)}),
                    lambda f: prim.pipeline_fragments(f, lp.name))

    def warp_specialize(self, stage: Any) -> None:
        """Split the TMA ring into a producer warpgroup that issues the loads and consumer
        warpgroups that run the wgmmas and release each stage through an mbarrier; with two
        consumer warpgroups the producer gives registers to them (setmaxnreg)."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("warp_specialize", {"stage": str(st)}),
                    lambda f: prim.warp_specialize(f, st.name))

    def split_k(self, stage: Any, splits: int) -> None:
        """Divide the k tiles of each output tile of the tensorized stage among `splits` blocks
        (blockIdx.z, or consecutive work units of the persistent grid); each stores its float32
        partial tile, and the last of them to finish sums the partials in split order 0, 1, ...
        and runs the epilogue, in the same kernel (tecc/passes/schedule/split_k.py: bit-identical
        run to run). The module gains the partials and the arrival counters as temporaries."""
        st = self._stage(stage)
        mod = self.mod
        try:
            func = mod.kernel(st.kernel)
        except KeyError:
            raise ScheduleError(f"split_k: no kernel {st.kernel!r}") from None
        taken = {b.name for b in mod.temps} | {p.name for p in mod.params}
        start = time.perf_counter()
        new = simplify_func(prim.split_k(func, st.name, int(splits), taken))
        self.timing.append(("split_k", time.perf_counter() - start))
        record = new.attr(prim.tensor_core.RECORD)
        calls = tuple(KernelCall(c.kernel, new.params) if c.kernel == st.kernel else c for c in mod.calls)
        kernels = tuple(new if k.name == st.kernel else k for k in mod.kernels)
        self.mod = Module(mod.name, mod.params, kernels, calls, mod.temps + record.split_buffers)
        self._record(Step("split_k", {"stage": str(st), "splits": int(splits)}))

    def tile_order(self, stage: Any, group_m: int) -> None:
        """mma.sync: one blockIdx.x over the output tiles in the grouped order, `group_m` row tiles
        side by side sweeping the column tiles together (L2 reuse)."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("tile_order", {"stage": str(st), "group_m": int(group_m)}),
                    lambda f: prim.tile_order(f, st.name, int(group_m)))

    def persistent(self, stage: Any, blocks: int, group_m: int = 8) -> None:
        """The warp-specialized kernel as `blocks` blocks (one per SM) that loop over the output
        tiles in the grouped order of `group_m` row tiles; the ring runs on across tiles, so the
        next tile's loads overlap this one's epilogue."""
        st = self._stage(stage)
        args: dict[str, Any] = {"stage": str(st), "blocks": int(blocks)}
        if group_m != 8:
            args["group_m"] = int(group_m)
        self._apply(st.kernel, Step("persistent", args), lambda f: prim.persistent(f, st.name, int(blocks),
                                                                                   int(group_m)))

    def epilogue(self, stage: Any, kind: str) -> None:
        """How the tensorized stage's fused tail stores its outputs: "registers" (each thread its
        accumulator elements), "staged" (through a padded shared tile, copied out in 16-byte
        chunks; the cp.async kernels), "tma" (a swizzled staging tile written out by TMA
        stores; the warp-specialized kernel) or "threads" (that staging tile written out by the
        consumer threads, for outputs TMA cannot store) (tecc/passes/schedule/epilogue.py)."""
        st = self._stage(stage)
        self._apply(st.kernel, Step("epilogue", {"stage": str(st), "kind": kind}),
                    lambda f: prim.epilogue(f, st.name, kind))

    def replay_legacy_tensorize(self, stage: Any, intrinsic: str = "auto", block: Sequence[int] = (64, 64),
                                warps: Sequence[int] = (2, 2), k_tile: int = 32, stages: int = 2,
                                producer: str = "threads", persistent: int = 0, epilogue: str = "registers",
                                staged_output: bool = False, fragment_pipeline: bool = False,
                                group_m: int = 0) -> None:
        """A `tensorize` step of a plan recorded before the primitives were separate (module
        docstring), as those primitives."""
        if producer not in ("threads", "tma"):
            raise ScheduleError(f"tensorize({stage}): producer {producer!r} is not one of ('threads', 'tma')")
        stage = str(self._stage(stage))   # by kernel: the stage's stores may become TMA stores
        k_tiles = self.tensorize(stage, intrinsic, block, warps, k_tile)
        for operand in self.gemm_operands(stage):
            self.stage_operand(stage, operand)
        self.pipeline(k_tiles, stages, "tma" if producer == "tma" else "cp.async")
        if fragment_pipeline:
            self.pipeline_fragments(k_tiles)
        if producer == "tma":
            self.warp_specialize(stage)
        if group_m:
            self.tile_order(stage, group_m)
        if persistent:
            self.persistent(stage, persistent)
        if staged_output:
            self.epilogue(stage, "staged")
        if epilogue != "registers":
            self.epilogue(stage, epilogue)


def is_legacy_tensorize(step: Step) -> bool:
    """Whether `step` is a `tensorize` step of a plan recorded before the primitives were separate."""
    return step.primitive == "tensorize" and any(k in step.args for k in LEGACY_TENSORIZE_ARGS)


__all__ = ["DEFERRABLE", "TENSOR_CORE_PRIMITIVES", "TensorCorePrimitives", "is_legacy_tensorize"]
