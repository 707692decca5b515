"""The warpgroup statements (wgmma and its fences) under the emulator.

- `WarpgroupMatrixMultiply` runs per warpgroup (128 consecutive threads; all of them must be
  active, else DivergenceError). It reads A and B from shared memory when issued, element
  (row, col) at `descriptor.offset(start, row, col)` of the buffer's storage (the same function
  codegen's descriptor encodes), with the checks of a shared read: inside the buffer, nothing in
  flight into it, initialized, no other thread's store since the last barrier, and no ordinary
  store since the last fence.proxy.async. D = A . B (+ C) is computed in float64 and rounded
  once to f32 (the GPU sums in f32 in its own order; tests bound the difference), C being the
  accumulator registers or, when a wgmma on the same accumulator is still in flight, its result
  (the hardware chains wgmmas on one accumulator). The result is *in flight*: it lands in the
  registers at the `WarpgroupWait` that covers its group; until then any access to those
  registers by the issuing threads is a RaceError (LocalMemory.busy). Until then its A and B
  elements may still be read by the hardware: a store or copy into them is a RaceError too
  (SharedMemory.wgmma_reading).
- tf32 rows (m64nNk8): a shared operand's float32 elements are read with their 13 low mantissa
  bits cleared (the tensor core ignores them: truncation), a register A rounded as the
  `cvt.rna.tf32.f32` codegen puts before the instruction; products exact, sums as above.
- fp8 rows (m64nNk32 .e4m3 / .e5m2): the stored fp8 values are read exactly (float64), so
  products are exact and the sum is rounded once, as for the 16-bit rows.
- A register A operand (a FragmentRef: FlashAttention-3's P for P·V) is gathered from the
  issuing threads' fragment registers at the issue, through the row's operand-'a' map (each warp
  of the warpgroup holds its 16 rows in the m16n8k16 A pattern), with the checks of a register
  read (written, no wgmma result in flight into it). A later write to those registers before the
  wgmma completes is a race on a GPU that the emulator does not report.
- `WarpgroupCommit` closes each active lane's open wgmmas into its next group;
  `WarpgroupWait(n)` lands, per lane, the groups up to `committed - n`.
- `WarpgroupFence`: needed before the first wgmma of a thread (checked); it changes no values.
  The ISA also asks for one between other register accesses to an accumulator and a wgmma
  reading it; that finer rule is not checked.
- `SetMaxRegisters` changes no values; it needs whole warpgroups.
- `AsyncProxyFence` clears the "ordinary stores not fenced" flag of every shared buffer in scope
  (a per-buffer approximation of the per-thread rule).
- A wgmma issued but never waited for when the kernel ends is a RaceError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...ir.errors import DivergenceError, OutOfBoundsError, RaceError, TeccError, UninitializedReadError
from ...ir.intrinsics import WARPGROUP_SIZE, FragmentOperand
from ...ir.stmt import FragmentRef, Instruction, SharedMatrix, WarpgroupMatrixMultiply
from .expr_compiler import Scope, compile_expr
from .matrix import round_to_tf32, truncate_to_tf32
from .memory import NEVER_WRITTEN, SAME_VALUE_WRITERS, LocalMemory, SharedMemory
from .state import LaneState

Runner = Callable[[LaneState], None]
OPEN = 0


@dataclass
class _Wgmma:
    """One wgmma statement's results in flight: per issuing lane (`lanes`), the accumulator
    elements [offset, offset + elements) of `mem` (`values`: lanes x elements) and the group."""

    mem: LocalMemory
    offset: int
    lanes: np.ndarray
    values: np.ndarray
    group: np.ndarray
    where: str
    # the shared elements it read, per warpgroup (rows of `keys`, in the order of `lanes`):
    # until it completes, a store to them is a race (SharedMemory.wgmma_reading)
    operands: list[tuple[SharedMemory, np.ndarray]]


class WarpgroupState:
    """The wgmmas in flight of one chunk, each lane's committed groups and whether it fenced."""

    def __init__(self, lanes: int) -> None:
        self.committed = np.zeros(lanes, dtype=np.int64)
        self.fenced = np.zeros(lanes, dtype=bool)
        self.ops: list[_Wgmma] = []


def _state(st: LaneState) -> WarpgroupState:
    if st.warpgroup is None:
        st.warpgroup = WarpgroupState(st.layout.lanes)
    state: WarpgroupState = st.warpgroup
    return state


def _active(st: LaneState) -> np.ndarray:
    active = np.ones(st.layout.lanes, dtype=bool)
    if st.mask is not None:
        active &= st.mask
    return active


def check_whole_warpgroups(st: LaneState, what: str) -> np.ndarray:
    """The active warpgroups (a bool per warpgroup of the chunk); DivergenceError unless every
    warpgroup with an active lane has all 128 active and the block is whole warpgroups."""
    lay = st.layout
    if lay.threads % WARPGROUP_SIZE:
        raise DivergenceError(
            f"{what} in kernel {st.kernel}: the block has {lay.threads} threads; warpgroup instructions need "
            f"whole warpgroups (a multiple of {WARPGROUP_SIZE} threads)")
    groups = _active(st).reshape(-1, WARPGROUP_SIZE)
    partial = groups.any(axis=1) & ~groups.all(axis=1)
    if partial.any():
        g = int(np.argmax(partial))
        lane = g * WARPGROUP_SIZE + int(np.argmin(groups[g]))
        raise DivergenceError(
            f"{what} in kernel {st.kernel} is reached by only some threads of a warpgroup ({lay.where(lane)} is "
            f"missing); all {WARPGROUP_SIZE} threads of a warpgroup must execute it together")
    active: np.ndarray = np.asarray(groups.all(axis=1))
    return active


def _uniform(st: LaneState, value: Any, groups: np.ndarray, what: str) -> np.ndarray:
    """One value per active warpgroup; TeccError if it differs inside a warpgroup."""
    v = np.broadcast_to(np.asarray(value), (st.layout.lanes,)).reshape(-1, WARPGROUP_SIZE)[groups]
    if (v != v[:, :1]).any():
        raise TeccError(f"{what} in kernel {st.kernel}: the value must be the same in all threads of a warpgroup")
    out: np.ndarray = v[:, 0]
    return out


class _Operand:
    """A or B of a wgmma: reads each active warpgroup's rows x cols tile from shared memory."""

    def __init__(self, ref: SharedMatrix, rows: int, cols: int, name: str, scope: Scope, tf32: bool) -> None:
        self.ref, self.rows, self.cols, self.name, self.tf32 = ref, rows, cols, name, tf32
        self.slot = scope.buffer_slot(ref.buffer)
        self.start = compile_expr(ref.start, scope)
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        # the descriptor's tile layout, (row, col) -> offset from the start before the swizzle
        self.canonical = np.broadcast_to(ref.descriptor.tile(rows, cols)(r, c), (rows, cols))

    def read(self, st: LaneState, groups: np.ndarray, what: str,
             operands: list[tuple[SharedMemory, np.ndarray]]) -> np.ndarray:
        """The tiles (warpgroups, rows, cols) in float64; appends (memory, keys per warpgroup) to `operands`."""
        mem: SharedMemory = st.mems[self.slot]
        start = _uniform(st, self.start(st), groups, f"{what}: the start of operand {self.name}")
        logical = start[:, None, None] + self.canonical[None]
        layout = self.ref.descriptor.layout
        physical = logical if layout is None else layout.apply(logical)
        first_lane = np.flatnonzero(groups) * WARPGROUP_SIZE
        keys = mem.base[first_lane][:, None, None] + physical
        if st.checks:
            self._check(st, mem, physical, keys, first_lane, what)
        data = mem.data[keys]
        if self.tf32:
            data = truncate_to_tf32(data)
        values: np.ndarray = data.astype(np.float64)
        operands.append((mem, keys.reshape(keys.shape[0], -1)))
        return values

    def _check(self, st: LaneState, mem: SharedMemory, physical: np.ndarray, keys: np.ndarray,
               first_lane: np.ndarray, what: str) -> None:
        where = f"{what} operand {self.name} ({self.ref.descriptor} on {mem.name})"
        if (physical < 0).any() or (physical >= mem.size).any():
            raise OutOfBoundsError(f"{where} in kernel {st.kernel}: the tile reaches element "
                                   f"{int(physical.max())} of a buffer of {mem.size}")
        flat = keys.reshape(keys.shape[0], -1)
        if mem.pending is not None and (mem.pending[flat] > 0).any():
            raise RaceError(f"{where} in kernel {st.kernel}: reads shared memory an asynchronous copy is still "
                            "writing; wait for the copy (its mbarrier, or cp.async.wait_group) before the wgmma")
        w = mem.writer[flat]
        if (w == NEVER_WRITTEN).any():
            raise UninitializedReadError(f"{where} in kernel {st.kernel}: reads elements nothing wrote")
        if ((w >= 0) | (w == SAME_VALUE_WRITERS)).any():
            raise RaceError(f"{where} in kernel {st.kernel}: reads shared memory that threads stored since the last "
                            "barrier; __syncthreads() (and fence.proxy.async) between the stores and the wgmma")
        if mem.unfenced:
            raise RaceError(f"{where} in kernel {st.kernel}: reads shared memory written by ordinary stores with no "
                            "fence.proxy.async after them; wgmma reads through the async proxy and needs that fence")
        tid = np.repeat(st.layout.lane_thread[first_lane], flat.shape[1])
        mem.read_log.append((flat.reshape(-1), tid))
        mem.logged += tid.size


class _RegisterOperand:
    """A register A of a wgmma: each active warpgroup's 64 x 16 tile from its threads' fragments."""

    def __init__(self, ref: FragmentRef, op: FragmentOperand, scope: Scope) -> None:
        self.slot = scope.buffer_slot(ref.buffer)
        self.offset = compile_expr(ref.offset, scope)
        self.op = op
        threads = np.arange(WARPGROUP_SIZE)[:, None]
        shape = (WARPGROUP_SIZE, op.elements)
        self.rows, self.cols = (np.broadcast_to(x, shape) for x in op.layout(threads, np.arange(op.elements)[None, :]))

    def read(self, st: LaneState, groups: np.ndarray, what: str) -> np.ndarray:
        """The tiles (warpgroups, 64, 16) in float64."""
        off = int(_uniform(st, self.offset(st), groups, f"{what}: the offset of register operand A")[0])
        mem = st.mems[self.slot]
        vals = np.stack([np.broadcast_to(np.asarray(mem.load(st, (off + e,), (0,))), (st.layout.lanes,))
                         for e in range(self.op.elements)], axis=-1)
        if self.op.convert is not None:  # tf32: codegen converts each register with cvt.rna
            vals = round_to_tf32(vals)
        vals = vals.astype(np.float64).reshape(-1, WARPGROUP_SIZE, self.op.elements)[groups]
        tile = np.zeros((vals.shape[0], self.op.rows, self.op.cols))
        tile[:, self.rows, self.cols] = vals
        return tile


def compile_wgmma(s: WarpgroupMatrixMultiply, scope: Scope) -> Runner:
    return _compile_wgmma(s, scope)


# The rows of tecc.ir.instructions that run here.
def compile_fence(s: Instruction, scope: Scope) -> Runner:
    """wgmma.fence."""
    return _fence


def compile_commit(s: Instruction, scope: Scope) -> Runner:
    """wgmma.commit_group."""
    return _commit


def compile_wait(s: Instruction, scope: Scope) -> Runner:
    """wgmma.wait_group n."""
    pending = s.pending
    return lambda st: _wait(st, pending)


def compile_set_max_registers(s: Instruction, scope: Scope) -> Runner:
    """setmaxnreg: no value changes; the warpgroup acts together."""
    what = f"setmaxnreg.{'inc' if s.increase else 'dec'} {s.count}"

    def set_max_registers(st: LaneState) -> None:
        check_whole_warpgroups(st, what)

    return set_max_registers


def compile_proxy_fence(s: Instruction, scope: Scope) -> Runner:
    """fence.proxy.async."""
    return _proxy_fence


def _compile_wgmma(s: WarpgroupMatrixMultiply, scope: Scope) -> Runner:
    row = s.row
    m, n, k = row.shape
    op = row.operand("d")
    tf32 = row.input_type == "tf32"
    a: _Operand | _RegisterOperand = (_Operand(s.a, m, k, "A", scope, tf32) if isinstance(s.a, SharedMatrix)
                                       else _RegisterOperand(s.a, row.operand("a"), scope))
    b = _Operand(s.b, n, k, "B", scope, tf32)
    d_slot = scope.buffer_slot(s.d.buffer)
    f_offset = compile_expr(s.d.offset, scope)
    f_scale = compile_expr(s.scale_d, scope)
    threads = np.arange(WARPGROUP_SIZE)[:, None]
    rows, cols = (np.broadcast_to(x, (WARPGROUP_SIZE, op.elements)) for x in op.layout(threads, np.arange(op.elements)[None, :]))
    what = f"{row.name} ({row.ptx})"

    def run(st: LaneState) -> None:
        groups = check_whole_warpgroups(st, what)
        if not groups.any():
            return
        state = _state(st)
        lanes = np.flatnonzero(np.repeat(groups, WARPGROUP_SIZE))
        if st.checks and not state.fenced[lanes].all():
            lane = int(lanes[np.argmin(state.fenced[lanes])])
            raise RaceError(f"{what} in kernel {st.kernel} at {st.layout.where(lane)}: no wgmma.fence before the "
                            "first wgmma of the warpgroup")
        offset = int(_uniform(st, f_offset(st), groups, f"{what}: the accumulator offset")[0])
        scale = _uniform(st, f_scale(st), groups, f"{what}: scale_d").astype(bool)
        mem: LocalMemory = st.mems[d_slot]
        operands: list[tuple[SharedMemory, np.ndarray]] = []
        a_tile = a.read(st, groups, what, operands) if isinstance(a, _Operand) else a.read(st, groups, what)
        tile = np.einsum("gmk,gnk->gmn", a_tile, b.read(st, groups, what, operands))
        c = _accumulator(st, state, mem, offset, op.elements, lanes, scale, what)
        c_tile = np.zeros_like(tile)
        c_tile[:, rows, cols] = c.reshape(-1, WARPGROUP_SIZE, op.elements)
        result = (tile + c_tile)[:, rows, cols].reshape(-1, op.elements).astype(np.float32)
        for e in range(op.elements):
            busy = mem.busy.setdefault(offset + e, np.zeros(st.layout.lanes, dtype=np.int32))
            busy[lanes] += 1
        if st.checks:
            for smem, keys in operands:
                if smem.wgmma_reading is None:
                    smem.wgmma_reading = np.zeros(smem.data.size, dtype=np.int32)
                np.add.at(smem.wgmma_reading, keys.reshape(-1), 1)
        state.ops.append(_Wgmma(mem, offset, lanes, result, np.full(lanes.size, OPEN), what, operands))

    return run


def _accumulator(st: LaneState, state: WarpgroupState, mem: LocalMemory, offset: int, elements: int,
                 lanes: np.ndarray, scale: np.ndarray, what: str) -> np.ndarray:
    """C per issuing lane (lanes x elements, float64): zero where scale_d is false, else the
    registers overlaid by the results of wgmmas on them still in flight, in issue order."""
    c = np.stack([mem.cols[offset + e][lanes] for e in range(elements)], axis=-1).astype(np.float64)
    if st.checks:
        for e in range(elements):
            w = mem.written[offset + e]
            unwritten = np.ones(lanes.size, dtype=bool) if w is None else (
                np.zeros(lanes.size, dtype=bool) if w is True else ~w[lanes])
            fresh = np.zeros(lanes.size, dtype=bool)
            for op in state.ops:
                if op.mem is mem and op.offset == offset:
                    fresh |= np.isin(lanes, op.lanes)
            bad = unwritten & ~fresh & np.repeat(scale, WARPGROUP_SIZE)
            if bad.any():
                raise UninitializedReadError(
                    f"{what} in kernel {st.kernel} at {st.layout.where(int(lanes[np.argmax(bad)]))}: accumulates onto "
                    f"{mem.name}[{offset + e}], which nothing wrote; zero it or pass scale_d = False")
    position = np.full(st.layout.lanes, -1)
    position[lanes] = np.arange(lanes.size)
    for op in state.ops:
        if op.mem is not mem:
            continue
        if op.offset != offset:
            if op.offset < offset + elements and offset < op.offset + op.values.shape[1]:
                raise TeccError(f"{what} in kernel {st.kernel}: its accumulator {mem.name}[{offset}:...] overlaps "
                                f"a wgmma in flight at another offset ({op.offset}); use whole, equal fragments")
            continue
        mine = position[op.lanes] >= 0
        c[position[op.lanes[mine]]] = op.values[mine]
    c[~np.repeat(scale, WARPGROUP_SIZE)] = 0.0
    return c


def _fence(st: LaneState) -> None:
    check_whole_warpgroups(st, "wgmma.fence")
    _state(st).fenced |= _active(st)


def _commit(st: LaneState) -> None:
    check_whole_warpgroups(st, "wgmma.commit_group")
    state = _state(st)
    active = _active(st)
    state.committed[active] += 1
    for op in state.ops:
        closing = (op.group == OPEN) & active[op.lanes]
        op.group[closing] = state.committed[op.lanes[closing]]


def _wait(st: LaneState, pending: int) -> None:
    check_whole_warpgroups(st, "wgmma.wait_group")
    state = st.warpgroup
    if state is None:
        return
    active = _active(st)
    limit = state.committed - pending
    kept: list[_Wgmma] = []
    for op in state.ops:
        land = (op.group != OPEN) & active[op.lanes] & (op.group <= limit[op.lanes])
        if land.any():
            lanes, mem = op.lanes[land], op.mem
            for e in range(op.values.shape[1]):
                col = mem.cols[op.offset + e].copy()
                col[lanes] = op.values[land, e]
                mem.cols[op.offset + e] = col
                written = mem.written[op.offset + e]
                if written is not True:
                    mask = np.zeros(st.layout.lanes, dtype=bool) if written is None else written.copy()
                    mask[lanes] = True
                    mem.written[op.offset + e] = True if mask.all() else mask
                busy = mem.busy[op.offset + e]
                busy[lanes] -= 1
                if not busy.any():
                    del mem.busy[op.offset + e]
            stay = ~land
            # warpgroups land whole (the wait is warpgroup-collective): release their operands
            landed = land.reshape(-1, WARPGROUP_SIZE)[:, 0]
            for smem, keys in op.operands:
                if smem.wgmma_reading is not None:
                    np.add.at(smem.wgmma_reading, keys[landed].reshape(-1), -1)
            operands = [(smem, keys[~landed]) for smem, keys in op.operands]
            op = _Wgmma(op.mem, op.offset, op.lanes[stay], op.values[stay], op.group[stay], op.where, operands)
        if op.lanes.size:
            kept.append(op)
    state.ops = kept


def _proxy_fence(st: LaneState) -> None:
    for mem in st.live_shared:
        mem.unfenced = False


def finish_warpgroup(st: LaneState) -> None:
    """RaceError if a wgmma of this chunk was never committed or never waited for."""
    state = st.warpgroup
    if state is None or not state.ops:
        return
    op = state.ops[0]
    status = "never committed (no wgmma.commit_group after it)" if op.group[0] == OPEN else \
        "committed but never waited for (no wgmma.wait_group covering its group)"
    raise RaceError(f"{op.where} in kernel {st.kernel}: the wgmma issued by {st.layout.where(int(op.lanes[0]))} is "
                    f"{status} when the kernel ends; its accumulator would be written at an unknown time")
