"""Vector memory accesses for `vectorize` loops (float4 / float2 / int4 / int2, and 4/8/16-byte
accesses of 16- and 8-bit types).

A loop `for v in range(W): B[base + v] = f(A[base' + v], ...)` with W in {2, 4} over 32-bit
buffers becomes

    const float4 A_vec = *reinterpret_cast<const float4*>(&A[base']);
    float4 B_vec;
    B_vec.x = f(A_vec.x, ...);  ...  (one line per lane, v replaced by the lane number)
    *reinterpret_cast<float4*>(&B[base]) = B_vec;

so each thread moves W elements with one 8- or 16-byte instruction (LDG.128 / STG.128), which is
what lets an elementwise kernel reach DRAM bandwidth. For 16-bit buffers (float16, bfloat16)
with W in {2, 4, 8} there is no CUDA vector type of the element, so the W elements travel as
one `unsigned int` / `uint2` / `uint4` (4, 8, 16 bytes: LDG.32/64/128) through a 16-byte aligned
register array of the element type:

    __align__(16) __nv_bfloat16 A_vec[8];
    *reinterpret_cast<uint4*>(A_vec) = *reinterpret_cast<const uint4*>(&A[base']);
    __align__(16) __nv_bfloat16 B_vec[8];
    B_vec[0] = f(A_vec[0], ...);  ...
    *reinterpret_cast<uint4*>(&B[base]) = *reinterpret_cast<const uint4*>(B_vec);

Every index into the arrays is a constant, so nvcc keeps them in registers (no local memory;
checked in tests/test_codegen.py on the PTX). A 2-byte scalar access moves 64 bytes per warp
instruction, a 16-byte one 512: without it a bf16 row cannot reach DRAM bandwidth. 8-bit
buffers (float8_e4m3, float8_e5m2, bool) move W in {4, 8, 16} elements the same way (a 1-byte
scalar access moves 32 bytes per warp instruction).
When the loop does not have that shape the
emitter falls back to a fully unrolled scalar loop (`#pragma unroll`), which is always correct.

The shape that is vectorized (anything else falls back):
- the loop starts at 0 and has the constant extent 2 or 4 (32-bit types), 2, 4 or 8 (16-bit) or
  4, 8 or 16 (8-bit);
- its body is one BufferStore to a float32, int32, 16-bit or 8-bit buffer, contiguous in `v` (the
  flat offset is `base + 1*v` with `base` free of `v`);
- every offset involved is provably a multiple of W (`ranges.divisible_by`). Shared buffers are
  declared `__align__(16)`; global buffers are assumed 16-byte aligned at their base (cudaMalloc
  gives 256), which the runtime must check for arguments that are views into larger tensors.
  A swizzled shared buffer (tecc.ir.layout) is judged by its logical offset: W elements at a
  multiple of W inside one chunk the layout keeps together (W <= its `contiguous`) stay
  consecutive, and the access starts at the layout's image of lane 0's offset.
Loads in the value that are contiguous in `v` and aligned become vector loads; other loads (a
broadcast free of `v`, a strided one) stay scalar, one per lane.
"""

from __future__ import annotations

from typing import Protocol

from tecc.ir import dtype as dt
from tecc.ir.expr import (
    Binary,
    BufferLoad,
    Cast,
    Compare,
    Const,
    Expr,
    Not,
    Select,
    Var,
    const_int,
    free_vars,
    logical_and,
    substitute,
    walk,
)
from tecc.ir.philox import RandomUniform
from tecc.ir.stmt import Buffer, BufferStore, For, IfThenElse, Stmt

from . import philox
from .cuda_expr import ExprEmitter
from .ranges import divisible_by


class Names(Protocol):
    def add(self, obj: object, name: str) -> str: ...


class StatementEmitter(Protocol):
    """What a vector loop needs of the kernel emitter (cuda.KernelEmitter is one): its C lines,
    blocks and names, the expression emitter, and the scalar statement fallback."""

    @property
    def names(self) -> Names: ...

    @property
    def expr(self) -> ExprEmitter: ...

    def line(self, text: str) -> None: ...

    def open_block(self, header: str) -> None: ...

    def close_block(self, trailer: str = "}") -> None: ...

    def buffer_name(self, b: Buffer) -> str: ...

    def stmt(self, s: Stmt) -> None: ...

_VECTOR_TYPES = {(dt.float32, 2): "float2", (dt.float32, 4): "float4", (dt.int32, 2): "int2", (dt.int32, 4): "int4"}
_LANES = "xyzw"
# 16- and 8-bit element types: W elements move as one unsigned integer container of
# itemsize·W bytes (4, 8 or 16)
_HALF_TYPES = (dt.float16, dt.bfloat16)
_BYTE_TYPES = (dt.float8_e4m3, dt.float8_e5m2, dt.bool_)
_CONTAINERS = {4: "unsigned int", 8: "uint2", 16: "uint4"}
_CONTAINER_ZERO = {4: "0u", 8: "make_uint2(0u, 0u)", 16: "make_uint4(0u, 0u, 0u, 0u)"}


def vector_widths(dtype: dt.DType) -> tuple[int, ...]:
    """The `vectorize` extents that become one vector access for buffers of `dtype`."""
    if dtype in _HALF_TYPES:
        return (2, 4, 8)
    if dtype in _BYTE_TYPES:
        return (4, 8, 16)
    if (dtype, 4) in _VECTOR_TYPES:
        return (2, 4)
    return ()


def _vectorizable(dtype: dt.DType, width: int) -> bool:
    return width in vector_widths(dtype)


class _Access:
    """How one vector access of `width` elements of `dtype` is spelled: a native vector type
    (float4: lanes `.x .y .z .w`) or a container through a register array (lanes `[k]`)."""

    def __init__(self, dtype: dt.DType, width: int) -> None:
        self.native = _VECTOR_TYPES.get((dtype, width))
        self.element = dtype.c_name
        self.width = width
        self.bytes = width * dtype.bytes
        self.container = self.native or _CONTAINERS[self.bytes]

    def lane(self, register: str, k: int) -> str:
        return f"{register}.{_LANES[k]}" if self.native else f"{register}[{k}]"

    def zero(self) -> str:
        if self.native:
            return f"make_{self.native}({', '.join(['0'] * self.width)})"
        return _CONTAINER_ZERO[self.bytes]

    def load(self, emitter: StatementEmitter, register: str, address: str, cond: str | None) -> None:
        value = f"*reinterpret_cast<const {self.container}*>({address})"
        if cond is not None:
            value = f"({cond} ? {value} : {self.zero()})"
        if self.native:
            emitter.line(f"const {self.native} {register} = {value};")
        else:
            emitter.line(f"__align__(16) {self.element} {register}[{self.width}];")
            emitter.line(f"*reinterpret_cast<{self.container}*>({register}) = {value};")

    def declare_result(self, emitter: StatementEmitter, register: str) -> None:
        if self.native:
            emitter.line(f"{self.native} {register};")
        else:
            emitter.line(f"__align__(16) {self.element} {register}[{self.width}];")

    def store(self, emitter: StatementEmitter, register: str, address: str) -> None:
        value = register if self.native else f"*reinterpret_cast<const {self.container}*>({register})"
        emitter.line(f"*reinterpret_cast<{self.container}*>({address}) = {value};")


def affine_coefficient(e: Expr, v: Var) -> int | None:
    """The integer c such that `e = c * v + rest` with `rest` free of `v`, or None when `e` is
    not affine in `v` that way."""
    if v not in free_vars(e):
        return 0
    if e is v:
        return 1
    if isinstance(e, Cast) and e.a.dtype.is_int and e.dtype.is_int:
        return affine_coefficient(e.a, v)
    if isinstance(e, Binary) and e.op in ("+", "-"):
        a, b = affine_coefficient(e.a, v), affine_coefficient(e.b, v)
        if a is None or b is None:
            return None
        return a + b if e.op == "+" else a - b
    if isinstance(e, Binary) and e.op == "*":
        for inner, factor in ((e.a, e.b), (e.b, e.a)):
            k = const_int(factor)
            if k is not None:
                c = affine_coefficient(inner, v)
                return None if c is None else c * k
    return None


def _contiguous_base(emitter: StatementEmitter, buffer: Buffer, indices: tuple[Expr, ...], v: Var,
                     width: int) -> Expr | None:
    """The offset at lane 0 when `buffer[indices]` is contiguous in `v` and aligned to `width`."""
    # registers (local arrays, mma fragments) are read per lane: a vector reinterpret of a
    # register array could make ptxas keep it in local memory
    if not _vectorizable(buffer.dtype, width) or buffer.scope in ("local", "fragment"):
        return None
    if buffer.layout is not None:
        # a swizzled shared tile: contiguous and aligned in its logical offsets, the W elements
        # lie in one chunk the layout keeps whole and in order (width <= layout.contiguous, the
        # base a multiple of the width), so the physical address of lane 0 starts them
        if width > buffer.layout.contiguous:
            return None
        logical = emitter.expr.offset(buffer, indices, through_layout=False)
        if affine_coefficient(logical, v) != 1 or not divisible_by(substitute(logical, {v: Const(0, v.dtype)}), width):
            return None
        return emitter.expr.offset(buffer, tuple(substitute(i, {v: Const(0, v.dtype)}) for i in indices))
    offset = emitter.expr.offset(buffer, indices)
    if affine_coefficient(offset, v) != 1:
        return None
    base = substitute(offset, {v: Const(0, v.dtype)})
    return base if divisible_by(base, width) else None


def lane_uniform_guard(cond: Expr, v: Var, width: int) -> Expr | None:
    """`cond` as a test free of the lane `v` (0 <= v < width) that holds exactly when `cond`
    holds for every lane, or None. A conjunct free of `v` stays; a split guard `base + v < n`
    with `base` and the constant `n` multiples of the width becomes `base < n`: the lanes of one
    vector are then all inside the extent or all past it (an edge tile of 112 columns in tiles
    of 64 stores its 8-wide vectors whole)."""
    if v not in free_vars(cond):
        return cond
    if isinstance(cond, Binary) and cond.op == "&" and cond.dtype == dt.bool_:
        a, b = lane_uniform_guard(cond.a, v, width), lane_uniform_guard(cond.b, v, width)
        return None if a is None or b is None else logical_and(a, b)
    if isinstance(cond, Compare) and cond.op == "<" and v not in free_vars(cond.b) and width > 1:
        n = const_int(cond.b)
        if n is None or n % width or affine_coefficient(cond.a, v) != 1:
            return None
        base = substitute(cond.a, {v: Const(0, v.dtype)})
        return base < cond.b if divisible_by(base, width) else None
    return None


def _guarded_loads(e: Expr, v: Var, conds: tuple[Expr, ...] = ()) -> list[tuple[BufferLoad, tuple[Expr, ...]]]:
    """The loads of `e` that depend on `v`, each with the conditions of the Selects that choose
    it (a Select's false branch gets the negated condition). A load under a Select whose
    condition depends on `v` is left out: its lanes are not all read or all skipped, so it stays
    a scalar load under C's `?:`."""
    if isinstance(e, BufferLoad):
        return [(e, conds)] if v in free_vars(e) else []
    if isinstance(e, Select):
        if v in free_vars(e.cond):
            return []
        return (_guarded_loads(e.cond, v, conds) + _guarded_loads(e.a, v, conds + (e.cond,))
                + _guarded_loads(e.b, v, conds + (Not(e.cond),)))
    out: list[tuple[BufferLoad, tuple[Expr, ...]]] = []
    for name in getattr(e, "_fields", ()):
        child = getattr(e, name)
        if isinstance(child, Expr):
            out += _guarded_loads(child, v, conds)
        elif isinstance(child, tuple):
            for c in child:
                if isinstance(c, Expr):
                    out += _guarded_loads(c, v, conds)
    return out


def _shared_random_calls(emitter: StatementEmitter, value: Expr, v: Var, lanes: list[Const]) -> list[Expr]:
    """One Philox call per group of four lanes for each RandomUniform of `value` whose index is
    `base + v` with `base` a multiple of 4 and whose seed and offset are free of `v`
    (codegen/philox.py): the uint4 registers are declared here, and each lane's node is mapped
    to its word in `emitter.expr.overrides`. Returns the lane nodes (to drop the overrides)."""
    if len(lanes) % 4:
        return []
    lane_nodes: list[Expr] = []
    found = [n for n in walk(value) if isinstance(n, RandomUniform)]
    for node in found:
        if v in free_vars(node.seed) or v in free_vars(node.offset) or affine_coefficient(node.index, v) != 1:
            continue
        base = substitute(node.index, {v: Const(0, v.dtype)})
        if not divisible_by(base, 4):
            continue
        code = emitter.expr.code
        registers = []
        for group in range(len(lanes) // 4):
            register = emitter.names.add(object(), "rand")
            call = philox.group_call(code(node.seed), code(node.offset), code(base), group)
            emitter.line(f"const uint4 {register} = {call};")
            registers.append(register)
        for k, lane in enumerate(lanes):
            lane_node = substitute(node, {v: lane})
            emitter.expr.overrides[id(lane_node)] = philox.lane_value(registers[k // 4], k)
            lane_nodes.append(lane_node)
    return lane_nodes


# a pair of 16-bit floats in one 32-bit register, and the conversion of two float32 values into it
_PAIRS = {dt.bfloat16: ("__nv_bfloat162", "__floats2bfloat162_rn"), dt.float16: ("__half2", "__floats2half2_rn")}


def _emit_pair_conversion(emitter: StatementEmitter, store: BufferStore, v: Var, width: int) -> bool:
    """A 2-lane store of two float32 values converted to a 16-bit fragment (registers, declared
    16-byte aligned) at an even offset: one paired conversion into the 32-bit register that holds
    both, `*reinterpret_cast<__nv_bfloat162*>(&frag[base]) = __floats2bfloat162_rn(a, b)` (one
    F2FP.PACK_AB), where two scalar conversions leave ptxas packing the pair and splitting it into
    two 16-bit values that byte permutes join again where an mma operand reads the pair. False
    (nothing emitted) for any other store."""
    buffer = store.buffer
    if width != 2 or buffer.scope != "fragment" or buffer.dtype not in _PAIRS:
        return False
    offset = emitter.expr.offset(buffer, store.indices)
    if affine_coefficient(offset, v) != 1:
        return False
    base = substitute(offset, {v: Const(0, v.dtype)})
    values = [substitute(store.value, {v: Const(k, v.dtype)}) for k in range(2)]
    if not divisible_by(base, 2) or not all(isinstance(x, Cast) and x.dtype == buffer.dtype
                                             and x.a.dtype == dt.float32 for x in values):
        return False
    pair, convert = _PAIRS[buffer.dtype]
    code = emitter.expr.code
    emitter.line(f"*reinterpret_cast<{pair}*>(&{emitter.buffer_name(buffer)}[{code(base)}]) = "
                 f"{convert}({', '.join(code(x.a) for x in values)});")  # type: ignore[attr-defined]
    return True


def emit_vector_loop(emitter: StatementEmitter, loop: For) -> bool:
    """Emit `loop` (kind vectorize) with vector accesses; False (nothing emitted) when it does
    not have the shape described in the module docstring.

    Beyond a plain store, the body may be `if (c) store` with `c` free of the lane (a split guard
    on a row) or deciding all lanes at once (`lane_uniform_guard`), and the store may be per lane (a local register tile, a transposed shared tile)
    when at least one load is a vector load. A load chosen by a Select whose condition is free
    of the lane (the zero padding of a partial tile) becomes `c ? vector load : 0`, so a tile
    row outside the tensor is never read."""
    width = const_int(loop.extent)
    store = loop.body
    guard: Expr | None = None
    if isinstance(store, IfThenElse) and store.else_case is None:
        guard = lane_uniform_guard(store.cond, loop.var, width or 0)
        if guard is not None:
            store = store.then_case
    if width not in (2, 4, 8, 16) or const_int(loop.min) != 0 or not isinstance(store, BufferStore):
        return False
    v = loop.var
    if guard is None and _emit_pair_conversion(emitter, store, v, width):
        return True
    store_base = _contiguous_base(emitter, store.buffer, store.indices, v, width)
    vector_loads_found = []
    for node, conds in _guarded_loads(store.value, v):
        base = _contiguous_base(emitter, node.buffer, node.indices, v, width)
        if base is not None:
            vector_loads_found.append((node, conds, base))
    if store_base is None and not vector_loads_found:
        return False
    lanes = [Const(k, v.dtype) for k in range(width)]
    overrides = emitter.expr.overrides
    # Overrides are keyed by node identity: keep the lane nodes alive until the lanes are written.
    lane_nodes: list[Expr] = []
    if guard is not None:
        emitter.open_block(f"if ({emitter.expr.code(guard)})")

    # Vector loads: one register per distinct contiguous load, read once before the lanes.
    vector_loads: dict[int, str] = {}
    for node, conds, base in vector_loads_found:
        if id(node) in vector_loads:
            continue
        access = _Access(node.buffer.dtype, width)
        register = emitter.names.add(object(), f"{node.buffer.name}_vec")
        address = f"&{emitter.buffer_name(node.buffer)}[{emitter.expr.code(base)}]"
        cond = emitter.expr.code(logical_and(*conds)) if conds else None
        access.load(emitter, register, address, cond)
        vector_loads[id(node)] = register
        for k, lane in enumerate(lanes):
            lane_node = substitute(node, {v: lane})
            overrides[id(lane_node)] = access.lane(register, k)
            lane_nodes.append(lane_node)

    lane_nodes += _shared_random_calls(emitter, store.value, v, lanes)

    if store_base is not None:
        access = _Access(store.buffer.dtype, width)
        result = emitter.names.add(object(), f"{store.buffer.name}_vec")
        access.declare_result(emitter, result)
        for k, lane in enumerate(lanes):
            value = substitute(store.value, {v: lane})
            emitter.line(f"{access.lane(result, k)} = {emitter.expr.code(value)};")
        address = f"&{emitter.buffer_name(store.buffer)}[{emitter.expr.code(store_base)}]"
        access.store(emitter, result, address)
    else:
        for lane in lanes:
            indices = tuple(substitute(i, {v: lane}) for i in store.indices)
            emitter.stmt(BufferStore(store.buffer, indices, substitute(store.value, {v: lane})))
    if guard is not None:
        emitter.close_block()
    for node in lane_nodes:
        overrides.pop(id(node), None)
    return True
