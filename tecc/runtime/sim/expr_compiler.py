"""Compile loop-IR expressions into Python closures over NumPy values.

Each expression node becomes one closure `f(state) -> value` (a uniform scalar or a per-lane
array, see `numerics`), built once per kernel, so running a kernel costs one Python call and
(usually) one NumPy operation per node per statement execution, never a per-thread loop.

Laziness follows C: `Select` (`?:`) and the bool operators `&&`/`||` evaluate their second
operand only in the lanes that need it, so a guarded load is never checked in the lanes its
guard excludes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ...ir import dtype as dt
from ...ir.errors import DivergenceError, OutOfBoundsError, TeccError
from ...ir.expr import (MEMORY_INTRINSICS, OPAQUE_INTRINSICS, WARP_INTRINSICS, Binary, BufferLoad, Call, Cast, Compare,
                        Const, Expr, Not, Reduce, Select, TensorRead, Var)
from ...ir.philox import RandomUniform, uniform_from_index
from ...ir.index_checks import IndexCheck
from ...ir.stmt import Buffer
from . import numerics as nm
from .memory_intrinsics import atomic_add, atomic_add_pair, run_fence
from .state import LaneState, restrict

Closure = Callable[[LaneState], Any]
Interval = tuple[int, int]  # inclusive integer range


class Scope:
    """Compile-time bookkeeping: the slot of every bound variable and buffer, and the constant
    range of integer variables where one is known (to drop bounds checks that cannot fail)."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel
        self.var_slots: dict[Var, int] = {}
        self.mem_slots: dict[int, int] = {}  # id(Buffer) -> slot
        self.buffers: list[Buffer] = []
        self.ranges: dict[Var, Interval] = {}
        self.tracks_fences = False  # the kernel holds an atomic: note global stores (memory_intrinsics.py)
        # ids of the mbarrier buffers some statement of the kernel arrives or completes bytes on
        # (mbarrier.py: a wait on any other barrier can never complete)
        self.arrived_barriers: set[int] = set()

    def bind_var(self, v: Var, rng: Interval | None = None) -> int:
        slot = self.var_slots.get(v)
        if slot is None:
            slot = self.var_slots[v] = len(self.var_slots)
        if rng is not None:
            self.ranges[v] = rng
        else:
            self.ranges.pop(v, None)
        return slot

    def var_slot(self, v: Var) -> int:
        slot = self.var_slots.get(v)
        if slot is None:
            raise TeccError(
                f"kernel {self.kernel}: variable {v.name} is used but bound by no parameter, loop or let"
            )
        return slot

    def bind_buffer(self, b: Buffer) -> int:
        slot = self.mem_slots.get(id(b))
        if slot is None:
            slot = self.mem_slots[id(b)] = len(self.buffers)
            self.buffers.append(b)
        return slot

    def buffer_slot(self, b: Buffer) -> int:
        slot = self.mem_slots.get(id(b))
        if slot is None:
            raise TeccError(
                f"kernel {self.kernel}: buffer {b.name} ({b.scope}) is accessed but is neither a "
                "parameter nor allocated around the access"
            )
        return slot

    # ---- static ranges ----------------------------------------------------------------------
    def interval(self, e: Expr) -> Interval | None:
        """A constant range holding every value `e` can take, or None when unknown."""
        if isinstance(e, Const) and e.dtype.is_int:
            return (int(e.value), int(e.value))
        if isinstance(e, Var):
            return self.ranges.get(e)
        if not isinstance(e, Binary) or not e.dtype.is_int:
            return None
        a = self.interval(e.a)
        b = self.interval(e.b)
        if e.op == "%" and b is not None and b[0] == b[1] and b[0] > 0:
            return (0, b[0] - 1)  # floor modulo by a positive constant
        if a is None or b is None:
            return None
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if e.op == "*":
            p = (a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
            return (min(p), max(p))
        if e.op == "//" and b[0] == b[1] and b[0] > 0:
            return (a[0] // b[0], a[1] // b[0])
        if e.op == "min":
            return (min(a[0], b[0]), min(a[1], b[1]))
        if e.op == "max":
            return (max(a[0], b[0]), max(a[1], b[1]))
        return None

    def dims_to_check(self, buf: Buffer, indices: Sequence[Expr]) -> tuple[int, ...]:
        """The dimensions whose index is not provably inside a constant extent."""
        out = []
        for d, (ix, n) in enumerate(zip(indices, buf.shape)):
            rng = self.interval(ix)
            extent = n.value if isinstance(n, Const) else None
            if rng is None or extent is None or rng[0] < 0 or rng[1] >= extent:
                out.append(d)
        return tuple(out)


def compile_expr(e: Expr, scope: Scope) -> Closure:
    """The closure computing `e`; see the module docstring."""
    if isinstance(e, Const):
        value = nm.make_const(e.value, e.dtype)
        return lambda st: value
    if isinstance(e, Var):
        slot = scope.var_slot(e)
        return lambda st: st.vals[slot]
    if isinstance(e, Binary):
        return _compile_binary(e, scope)
    if isinstance(e, Compare):
        fa, fb = compile_expr(e.a, scope), compile_expr(e.b, scope)
        cmp = nm.COMPARE[e.op]
        return lambda st: cmp(fa(st), fb(st))
    if isinstance(e, Not):
        fa = compile_expr(e.a, scope)
        if e.dtype.is_bool:
            return lambda st: _logical_not(fa(st))
        return lambda st: ~fa(st)
    if isinstance(e, Cast):
        fa = compile_expr(e.a, scope)
        d = e.dtype
        return lambda st: nm.to_dtype(fa(st), d)
    if isinstance(e, Select):
        return _compile_select(e, scope)
    if isinstance(e, IndexCheck):
        return _compile_index_check(e, scope)
    if isinstance(e, Call):
        if e.name in WARP_INTRINSICS:
            return _compile_shuffle(e, scope)
        if e.name in MEMORY_INTRINSICS:
            return _compile_memory_intrinsic(e, scope)
        if e.name in OPAQUE_INTRINSICS:   # an optimization barrier for the CUDA compiler: x itself
            return compile_expr(e.args[0], scope)
        f = nm.intrinsic(e.name, e.args[0].dtype)
        fa = compile_expr(e.args[0], scope)
        return lambda st: f(fa(st))
    if isinstance(e, BufferLoad):
        return _compile_load(e, scope)
    if isinstance(e, RandomUniform):
        return _compile_random(e, scope)
    if isinstance(e, (Reduce, TensorRead)):
        raise TeccError(
            f"kernel {scope.kernel}: {type(e).__name__} {e} reached the emulator; the loop IR it runs must "
            "be lowered (reductions into loops, tensor reads into buffer loads)"
        )
    raise TeccError(f"kernel {scope.kernel}: the emulator has no rule for {type(e).__name__} {e}")


def _logical_not(v: Any) -> Any:
    return np.logical_not(v) if isinstance(v, np.ndarray) else not v


def _compile_binary(e: Binary, scope: Scope) -> Closure:
    fa, fb = compile_expr(e.a, scope), compile_expr(e.b, scope)
    if e.dtype.is_bool and e.op in ("&", "|"):
        return _compile_short_circuit(e.op, fa, fb)
    plain = e.dtype not in nm.HALF_TYPES
    # Uniform integers are Python ints, which do not wrap: an integer node whose constant range
    # (index math over known loops) may leave the dtype wraps its uniform results.
    if e.dtype.is_int and e.op in ("+", "-", "*", "//", "%") and not _fits(scope.interval(e), e.dtype):
        wrapped = nm.wrap_uniform(nm.binary_op(e.op, e.dtype), e.dtype)
        return lambda st: wrapped(fa(st), fb(st))
    # The three hottest operators inline, saving a call per node in inner loops.
    if plain and e.op == "+":
        return lambda st: fa(st) + fb(st)
    if plain and e.op == "*":
        return lambda st: fa(st) * fb(st)
    if plain and e.op == "-":
        return lambda st: fa(st) - fb(st)
    op = nm.binary_op(e.op, e.dtype)
    return lambda st: op(fa(st), fb(st))


def _fits(interval: Interval | None, d: Any) -> bool:
    if interval is None:
        return False
    lo, hi = dt.int_range(d)
    return lo <= interval[0] and interval[1] <= hi


def _compile_short_circuit(op: str, fa: Closure, fb: Closure) -> Closure:
    """C's `a && b` / `a || b`: `b` runs only in the lanes where `a` does not decide."""
    decides = (lambda a: not a) if op == "&" else (lambda a: a)

    def run(st: LaneState) -> Any:
        a = fa(st)
        if not isinstance(a, np.ndarray):
            return a if decides(a) else fb(st)
        undecided = a if op == "&" else ~a
        saved = st.mask
        m = restrict(saved, undecided)
        if m is not None and not m.any():
            return a
        st.mask = m
        try:
            b = fb(st)
        finally:
            st.mask = saved
        return (a & b) if op == "&" else (a | b)

    return run


def _compile_select(e: Select, scope: Scope) -> Closure:
    fc, fa, fb = compile_expr(e.cond, scope), compile_expr(e.a, scope), compile_expr(e.b, scope)
    npd = e.dtype.numpy

    def run(st: LaneState) -> Any:
        c = fc(st)
        if not isinstance(c, np.ndarray):
            return fa(st) if c else fb(st)
        saved = st.mask
        ma = restrict(saved, c)
        if ma is None:
            return fa(st)
        if not ma.any():
            return fb(st)
        mb = restrict(saved, ~c)
        if mb is not None and not mb.any():
            st.mask = ma
            try:
                return fa(st)
            finally:
                st.mask = saved
        try:
            st.mask = ma
            a = fa(st)
            st.mask = mb
            b = fb(st)
        finally:
            st.mask = saved
        chosen = np.asarray(np.where(c, a, b))
        return chosen.astype(npd, copy=False)

    return run


def _compile_shuffle(e: Call, scope: Scope) -> Closure:
    """Warp shuffles (WARP_INTRINSICS in tecc.ir.expr): a gather from the partner lane of the
    same warp. All 32 lanes must take part (mask 0xffffffff), so with checks on a partner that
    is masked off is a DivergenceError rather than a silent garbage value."""
    kind = e.name
    fv, fa = compile_expr(e.args[0], scope), compile_expr(e.args[1], scope)

    def run(st: LaneState) -> Any:
        v, a = fv(st), fa(st)
        lay = st.layout
        if isinstance(a, np.ndarray):
            src = lay.warp_source_lanes(kind, a)
        else:
            src, _ = lay.warp_source(kind, int(a))
        if st.checks and st.mask is not None:
            missing = st.mask & ~st.mask[src]
            if missing.any():
                lane = int(np.argmax(missing))
                raise DivergenceError(
                    f"{kind} in kernel {st.kernel} at {lay.where(lane)} reads lane {int(src[lane]) % lay.threads % 32} "
                    "of its warp, which is not active here; warp shuffles need all 32 lanes (mask 0xffffffff)"
                )
        if not isinstance(v, np.ndarray):
            return v
        return v[src]

    return run


def _compile_index_check(e: IndexCheck, scope: Scope) -> Closure:
    """A data-dependent index check (tecc.ir.index_checks.IndexCheck): true when the value of every
    active lane is in [0, extent); otherwise OutOfBoundsError naming the tensor, the dimension,
    the index expression and the bad value, whatever TECC_SIM_CHECKS says (an out-of-range index
    is an error of the program, not a check the emulator adds)."""
    fv, fe = compile_expr(e.value, scope), compile_expr(e.extent, scope)

    def run(st: LaneState) -> Any:
        v, n = fv(st), int(fe(st))
        if not isinstance(v, np.ndarray):
            if 0 <= int(v) < n:
                return True
            raise _index_out_of_range(e, st, int(v), n, None)
        bad = (v < 0) | (v >= n)
        if st.mask is not None:
            bad &= st.mask
        if bad.any():
            lane = int(np.argmax(bad))
            raise _index_out_of_range(e, st, int(v[lane]), n, lane)
        return True

    return run


def _index_out_of_range(e: IndexCheck, st: LaneState, value: int, extent: int, lane: int | None) -> OutOfBoundsError:
    lay = st.layout
    where = lay.where(lane) if lane is not None else "in every thread"
    err = OutOfBoundsError(
        f"out-of-range data-dependent index into {e.tensor} in kernel {st.kernel}: index {e.dim} of {e.tensor} is "
        f"{e.value} = {value}, outside [0, {extent}) (dimension {e.dim} of {e.tensor} has size {extent}), at "
        f"{where}; tecc does not wrap negative indices: fix the indices (or wrap them first, as torch does)")
    err.tensor = e.tensor  # type: ignore[attr-defined]
    err.dimension = e.dim  # type: ignore[attr-defined]
    err.value = value  # type: ignore[attr-defined]
    if lane is not None:
        err.block = lay.block_of(lane)  # type: ignore[attr-defined]
        err.thread = lay.thread_of(lane)  # type: ignore[attr-defined]
    return err


def _compile_memory_intrinsic(e: Call, scope: Scope) -> Closure:
    """The closure of atomic_add, load_cg or thread_fence (their semantics: memory_intrinsics.py)."""
    if e.name == "thread_fence":
        return run_fence
    element = e.args[0]
    assert isinstance(element, BufferLoad)  # Call checked it
    if e.name == "load_cg":
        return compile_expr(element, scope)  # lockstep: every earlier store is already in memory
    if e.name not in ("atomic_add", "atomic_add_pair"):
        raise TeccError(f"kernel {scope.kernel}: the emulator has no rule for {e.name}")
    slot = scope.buffer_slot(element.buffer)
    dims = scope.dims_to_check(element.buffer, element.indices)
    fidx = compile_indices(element.indices, scope)
    fval = compile_expr(e.args[1], scope)
    if e.name == "atomic_add":
        def run(st: LaneState) -> Any:
            return atomic_add(st, st.mems[slot], fidx(st), fval(st), dims)

        return run
    fsecond = compile_expr(e.args[2], scope)

    def run_pair(st: LaneState) -> Any:
        return atomic_add_pair(st, st.mems[slot], fidx(st), fval(st), fsecond(st), dims)

    return run_pair


def _compile_random(e: RandomUniform, scope: Scope) -> Closure:
    """tc.rand: the NumPy Philox4x32-10 of tecc/ir/philox.py over the lanes, bit for bit what
    the CUDA helpers compute. Operands are int64 (a uniform Python int wider than that, from
    index math the emulator does not wrap, is taken modulo 2^64 as the GPU would)."""
    fs, fo, fn = (compile_expr(x, scope) for x in (e.seed, e.offset, e.index))

    def int64(v: Any) -> Any:
        return v if isinstance(v, np.ndarray) else dt.wrap_int(int(v), dt.int64)

    def run(st: LaneState) -> Any:
        out = uniform_from_index(int64(fs(st)), int64(fo(st)), int64(fn(st)))
        return out if out.ndim else np.float32(out)

    return run


def _compile_load(e: BufferLoad, scope: Scope) -> Closure:
    slot = scope.buffer_slot(e.buffer)
    dims = scope.dims_to_check(e.buffer, e.indices)
    fidx = [compile_expr(i, scope) for i in e.indices]
    if len(fidx) == 1:
        f0 = fidx[0]
        return lambda st: st.mems[slot].load(st, (f0(st),), dims)
    if len(fidx) == 2:
        f0, f1 = fidx
        return lambda st: st.mems[slot].load(st, (f0(st), f1(st)), dims)
    return lambda st: st.mems[slot].load(st, tuple(f(st) for f in fidx), dims)


def compile_indices(indices: Sequence[Expr], scope: Scope) -> Callable[[LaneState], tuple[Any, ...]]:
    """One closure returning the tuple of index values (for stores)."""
    fidx = [compile_expr(i, scope) for i in indices]
    if len(fidx) == 1:
        f0 = fidx[0]
        return lambda st: (f0(st),)
    if len(fidx) == 2:
        f0, f1 = fidx
        return lambda st: (f0(st), f1(st))
    return lambda st: tuple(f(st) for f in fidx)
