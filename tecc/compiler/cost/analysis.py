"""What the cost model needs to know about one kernel of the lowered (unscheduled) module.

Lowering gives every stage a kernel of the shape

    for s0 in range(S0): for s1 ...                 # the spatial nest (one loop per output axis)
      [allocate acc; acc = init; for r0 ...: acc = combine(acc, f(reads))]   # a reduction, if any
      out[s0, s1, ...] = g(acc or f(reads))

`analyze_kernel` reads that shape off the IR: the spatial and reduction loops with their extents
(symbolic sizes replaced by the sizes the caller gives, else `DEFAULT_SIZE`), every global access
as an affine map from loop variables to a flat element offset (the access relation the polyhedral
analyses use, restricted to the affine case the schedules produce), the arithmetic per innermost
iteration, and a classification the strategies' guards read:

  elementwise  -- no reduction loop;
  contraction  -- a sum of products of two reads, each reading only some of the spatial axes
                  (GEMM-like: every read is reused across the axes it does not depend on);
  reduction    -- any other reduction (row: the reduced axis is the innermost of the read;
                  column: it is not).

Footprints follow from the affine maps: the region a tile of loop extents reads from a buffer is
the box spanned along each buffer dimension (what `cache_read` allocates, tecc.passes.schedule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ...ir.evaluate import evaluate_int
from ...ir.expr import (
    Binary,
    BufferLoad,
    Call,
    Cast,
    Const,
    Expr,
    Select,
    Var,
    const_int,
    free_vars,
    walk,
)
from ...ir.philox import RandomUniform
from ...ir.stmt import (
    Allocate,
    Buffer,
    BufferStore,
    For,
    IfThenElse,
    LetStmt,
    PrimFunc,
    Seq,
    Stmt,
)
from ...passes.approx_math import approximate_expr
from ...passes.simplify import from_linear, linear_form, merged_dims
from .. import options as knobs

# The size assumed for a symbolic dimension the caller gives no value for. Plans stay valid for
# every size (schedules guard partial tiles); only the ranking assumes this size.
DEFAULT_SIZE = 1024

# Special-function operations: issued on the SFU (16 lanes per SM partition per clock on
# sm_80/90, a quarter of the FP32 rate: CUDA C++ Programming Guide, "Arithmetic Instructions"
# throughput table); sin/cos/exp also cost a range reduction in FP32 around the MUFU op.
SPECIAL_FUNCTIONS = ("exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh", "erf", "sigmoid", "exp2", "log2")

# Issued instructions (SASS, per thread) of one call of each function in its precise form, as
# nvcc emits it without --use_fast_math: a MUFU op where one exists plus the FP32 range
# reduction / polynomial around it. The MUFU rate is the CUDA C++ Programming Guide's
# "Arithmetic Instructions" table (16/clk/SM for sin/cos/ex2/lg2/rsqrt on sm_80/90); the counts
# are estimates read off libdevice's __nv_sinf & co. (fast path only: sinf's Payne-Hanek path
# for |x| > 105615 is not priced), not measured here. Anything not listed costs 1.
INSTRUCTION_COST: dict[str, float] = {
    "sin": 40.0, "cos": 40.0,        # Cody-Waite reduction, quadrant select, two polynomials
    "exp": 8.0, "exp2": 4.0,         # scale, round, MUFU.EX2, fix-up of the exponent
    "log": 16.0, "log2": 14.0,       # mantissa/exponent split, polynomial
    "tanh": 20.0, "erf": 24.0,       # two-range polynomials
    "sigmoid": 12.0,                 # exp + reciprocal (MUFU.RCP + Newton step)
    "sqrt": 8.0, "rsqrt": 4.0,       # MUFU + a correction step
    # The cheap forms the approx_math pass writes for a sin/cos rounded to a 16-bit float
    # (tecc/ir/approx.py), read off the SASS of the bf16 sin benchmark kernel on sm_90 (NVRTC
    # 13.0, nvdisasm): FFMA + FADD (rint), 2 FFMA (reduction), SHF + LOP3 (sign), FMUL + 4 FFMA +
    # FMUL (polynomial) = 12, plus FSETP + BRA + BSSY + BSYNC around the out-of-range precise
    # path and ~2 constants moved into registers per call: the kernel's fast path went from 33.0
    # to 25.25 issued instructions per element (6 without any sin), so ~19; cos adds 2 FADDs.
    # No MUFU. (The same SASS puts sinf's fast path at ~27 per element, below the 40 above.)
    "sin_approx": 19.0, "cos_approx": 21.0,
    # The cheap GELUs (tecc/ir/approx_gelu.py), FP32 instructions plus the MUFU ones' issue slots:
    # erf form FFMA + FMNMX, 7 FFMA, MUFU.EX2, FADD, FSETP + FSEL, FMUL; tanh form FMUL, FFMA,
    # FMUL, MUFU.EX2, FADD, MUFU.RCP, FMUL (counted in the PTX of the fused GEMM, NVRTC 13).
    "gelu_erf_approx": 13.0, "gelu_tanh_approx": 7.0,
}
# MUFU (special function unit) instructions per call: 16 lanes per clock per SM on sm_80/90
# (CUDA C++ Programming Guide, "Arithmetic Instructions"), an eighth of the FP32 rate, so a
# call's MUFU share can bound a kernel part that the issue count does not (a GEMM's epilogue).
# Read off the same PTX: erff's large-argument range takes an ex2 (both ranges are evaluated),
# tanhf an ex2 and a reciprocal.
MUFU_COST: dict[str, float] = {
    "exp": 1.0, "exp2": 1.0, "log": 1.0, "log2": 1.0, "sqrt": 1.0, "rsqrt": 1.0, "sin": 0.0, "cos": 0.0,
    "tanh": 2.0, "erf": 1.0, "sigmoid": 2.0, "exp2_approx": 1.0, "gelu_erf_approx": 1.0, "gelu_tanh_approx": 2.0,
}
# tc.rand (RandomUniform): one Philox4x32-10 per element as codegen/philox.py prints it: per round
# two 32x32->64-bit multiplies (IMAD.WIDE.U32, or IMAD.HI + IMAD), two three-way XORs (LOP3) and
# the key's two adds; plus the 64-bit counter, the word select and the float conversion. An
# estimate of the SASS, not a measurement. A vectorize loop of width 4 or 8 shares one call among
# four elements (codegen/philox.py), which saves RANDOM_SHARED_SAVING of it per element.
RANDOM_COST = 80.0
RANDOM_SHARED_SAVING = 0.75 * 72.0   # three quarters of the rounds' ~72 instructions
CONVERSION_COST = 1.0                # one convert per element between a 16-bit float and FP32
# Float operators that are more than one instruction (docs/semantics.md): max / min propagate
# NaN through `(a > b || a != a) ? a : b` (two FSETP and an FSEL; FMNMX alone would drop the
# NaN); // and % are NumPy's npy_divmod (fmodf's loop, a division, floor and fix-ups: an
# estimate, not read off SASS). Any other float operator costs 1.
BINARY_COST: dict[str, float] = {"max": 3.0, "min": 3.0, "//": 24.0, "%": 20.0}


@dataclass(frozen=True)
class Affine:
    """`const + Σ coeff[v] · v` over loop variables (by name); the flat element offset of an access."""

    coeff: tuple[tuple[str, int], ...]
    const: int = 0

    def get(self, var: str) -> int:
        return dict(self.coeff).get(var, 0)

    @property
    def vars(self) -> tuple[str, ...]:
        return tuple(v for v, c in self.coeff if c)


@dataclass(frozen=True)
class Access:
    """One global access: the buffer, its element size, and its flat offset (None where not affine
    in the loop variables, e.g. a strided input whose strides are kernel parameters)."""

    buffer: str
    tensor: str
    itemsize: int
    offset: Affine | None
    index_vars: tuple[frozenset[str], ...]    # per buffer dimension: the loop variables in its index
    per_dim: tuple[Affine | None, ...] = ()   # per buffer dimension: its affine index
    dims: tuple[int, ...] = ()                # the buffer's extents (sizes substituted)
    dtype: str = ""                           # the buffer's dtype name ("float16", ...)
    # a gather (`W[idx[i], j]`): the flat offset of its affine dimensions, the data-dependent ones
    # left out (each adds a base that is one unknown row per value of `gather_vars`, the loop
    # variables of those indices); None unless every dimension that is not affine reads memory
    gathered: Affine | None = None
    gather_vars: frozenset[str] = frozenset()
    # no affine offset, but every index is affine or an affine index // or % a constant (a view
    # transposing merged dimensions, O[i // T, k // D, i % T, k % D]): tensorize splits such axes
    split: bool = False
    # where `split`: per buffer dimension (its affine index, "" / "//" / "%", the constant), so
    # the cost model can place each lane's element (traffic.split_lane_offsets); row-major dims
    split_dims: tuple[tuple[Affine, str, int], ...] = ()


@dataclass(frozen=True)
class ScatterFacts:
    """A kernel that is a scatter (tecc.passes.rewrite.scatter_atomic.match_scatter): what its
    atomic form would do, for the `scatter_atomic` strategy."""

    domain: tuple[tuple[str, int], ...]   # the atomic kernel's loops (summed, then the free output axes)
    matched: int                          # output positions the matched dimensions span (product of extents)
    summed: int                           # domain points per output element's scan (product of the summed extents)
    acc_itemsize: int                     # bytes of one accumulator element
    finish: bool                          # the output's dtype is not the accumulator's: a finish kernel
    coalesced: bool                       # the innermost domain loop is the output's unit-stride axis

    @property
    def points(self) -> int:
        n = 1
        for _, e in self.domain:
            n *= e
        return n


@dataclass(frozen=True)
class KernelInfo:
    """The facts of one lowered kernel that strategies and the cost model reason with."""

    kernel: str
    stage: str
    spatial: tuple[tuple[str, int], ...]            # (loop variable, extent), outermost first
    reduction: tuple[tuple[str, int], ...]          # (loop variable, extent), outermost first
    reads: tuple[Access, ...]                       # distinct global reads of the innermost body
    write: Access
    flops_per_iteration: int                        # floating-point ops per innermost iteration
    special_per_iteration: int                      # special-function calls per innermost iteration
    epilogue_flops: int                             # ops after the reduction, per output element
    combiner: str | None                            # sum | max | min | prod, None for elementwise
    kind: str                                       # elementwise | reduction | contraction
    dtype: str                                      # the output's dtype
    symbolic: tuple[str, ...] = ()                  # symbolic sizes in the extents
    assumed: tuple[tuple[str, int], ...] = ()       # sizes assumed for them (not given by the caller)
    strided_inputs: tuple[str, ...] = ()            # buffers whose strides are kernel parameters
    notes: tuple[str, ...] = field(default=())
    # issued instructions per innermost iteration for the arithmetic (INSTRUCTION_COST for
    # calls, one per FP op, CONVERSION_COST per 16-bit float conversion); loads, stores and index
    # math are the strategies' to add. None: not counted (flops_per_iteration stands in).
    arith_instructions_per_iteration: float | None = None
    random_per_iteration: int = 0                   # RandomUniform nodes (tc.rand) per innermost iteration
    # a contraction's epilogue per output element, as it will be emitted (the approx_math
    # rewrite applied): issued instructions of its arithmetic beyond the accumulator's own
    # conversion to the output dtype, and its MUFU instructions (0 and 0 for a plain GEMM)
    epilogue_instructions: float = 0.0
    epilogue_mufu: float = 0.0
    scatter: ScatterFacts | None = None             # the kernel is a scatter (masked sum with data-dependent matches)

    @property
    def outputs(self) -> int:
        n = 1
        for _, e in self.spatial:
            n *= e
        return n

    @property
    def reduce_extent(self) -> int:
        n = 1
        for _, e in self.reduction:
            n *= e
        return n

    @property
    def iterations(self) -> int:
        return self.outputs * self.reduce_extent

    @property
    def flops(self) -> float:
        return float(self.iterations * self.flops_per_iteration + self.outputs * self.epilogue_flops)

    @property
    def reduce_kind(self) -> str:
        """'row' when the reduced loop is the innermost (unit-stride) axis of the main read,
        'column' when it is not, '' for elementwise kernels."""
        if not self.reduction:
            return ""
        inner = self.reduction[-1][0]
        big = max(self.reads, key=lambda a: _size(a.dims), default=None)
        if big is None or big.offset is None:
            return "row"
        return "row" if abs(big.offset.get(inner)) == 1 else "column"


def _size(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def affine(e: Expr, env: Mapping[Var, int]) -> Affine | None:
    """`e` as an affine function of its index variables, size variables replaced from `env`;
    None when it is not affine (a product of two variables, a division, a stride parameter)."""
    terms: dict[str, int] = {}

    def go(x: Expr, scale: int) -> int | None:
        if isinstance(x, Const):
            return int(x.value) * scale if x.dtype.is_int else None
        if isinstance(x, Var):
            if x in env:
                return int(env[x]) * scale
            if x.kind != "index":
                return None
            terms[x.name] = terms.get(x.name, 0) + scale
            return 0
        if isinstance(x, Cast) and x.dtype.is_int and x.a.dtype.is_int:
            return go(x.a, scale)
        if isinstance(x, Binary) and x.op in ("+", "-"):
            a = go(x.a, scale)
            b = go(x.b, scale if x.op == "+" else -scale)
            return None if a is None or b is None else a + b
        if isinstance(x, Binary) and x.op == "*":
            for k, other in ((x.a, x.b), (x.b, x.a)):
                if not (free_vars(k) - set(env)):
                    try:
                        factor = evaluate_int(k, env)
                    except Exception:  # noqa: BLE001 - not evaluable: not affine here
                        return None
                    return go(other, scale * factor)
            return None
        return None

    c = go(e, 1)
    if c is None:
        return None
    return Affine(tuple(sorted((v, k) for v, k in terms.items() if k)), c)


def _access(buf: Buffer, indices: tuple[Expr, ...], env: Mapping[Var, int]) -> Access:
    indices = tuple(_canonical(i, env) for i in indices)
    per_dim = tuple(affine(i, env) for i in indices)
    dims: list[int] = []
    for s in buf.shape:
        try:
            dims.append(evaluate_int(s, env))
        except Exception:  # noqa: BLE001
            dims.append(DEFAULT_SIZE)
    if buf.strides is None and any(a is None for a in per_dim):
        indices, dims = merged_dims(indices, dims)
        per_dim = tuple(affine(i, env) for i in indices)
    index_vars = tuple(frozenset(v.name for v in free_vars(i) if v.kind == "index") for i in indices)
    offset = _flat_offset(buf, per_dim, dims, env)
    gathered: Affine | None = None
    gather_vars: frozenset[str] = frozenset()
    loaded = [any(isinstance(n, BufferLoad) for n in walk(i)) for i in indices]
    if offset is None and any(loaded) and all(a is not None or ld for a, ld in zip(per_dim, loaded)):
        zero = Affine(())
        gathered = _flat_offset(buf, tuple(zero if ld else a for a, ld in zip(per_dim, loaded)), dims, env)
        gather_vars = frozenset().union(*(vs for vs, ld in zip(index_vars, loaded) if ld))
    split = offset is None and gathered is None and all(
        a is not None or (isinstance(i, Binary) and i.op in ("//", "%") and affine(i.a, env) is not None
                          and (const_int(i.b) or 0) > 0)
        for a, i in zip(per_dim, indices))
    split_dims: tuple[tuple[Affine, str, int], ...] = ()
    if split and buf.strides is None:
        parts = []
        for a, i in zip(per_dim, indices):
            if a is not None:
                parts.append((a, "", 1))
            else:
                assert isinstance(i, Binary)
                inner = affine(i.a, env)
                assert inner is not None
                parts.append((inner, i.op, const_int(i.b) or 1))
        split_dims = tuple(parts)
    return Access(buf.name, buf.tensor, buf.dtype.bytes, offset, index_vars, per_dim, tuple(dims), buf.dtype.name,
                  gathered, gather_vars, split, split_dims)


def _canonical(ix: Expr, env: Mapping[Var, int]) -> Expr:
    """An index that is not affine as written in its linear form, where (x // c)·c + x % c is x
    (a view merging the dimensions that another view split: tecc.passes.simplify.linear_form)."""
    if not ix.dtype.is_int or affine(ix, env) is not None:
        return ix
    terms, const = linear_form(ix)
    return from_linear(terms, const, ix)


def row_major_strides(dims: Sequence[int]) -> list[int]:
    """The element strides of a row-major array of extents `dims`."""
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return strides


def _flat_offset(buf: Buffer, per_dim: tuple[Affine | None, ...], dims: list[int],
                 env: Mapping[Var, int]) -> Affine | None:
    """The flat element offset of an access whose per-dimension indices are `per_dim`."""
    offset: Affine | None = None
    if all(a is not None for a in per_dim):
        strides: list[int] | None = None
        if buf.strides is not None:
            strides = []
            for s in buf.strides:
                try:
                    strides.append(evaluate_int(s, env))
                except Exception:  # noqa: BLE001 - a stride parameter: assume row-major below
                    strides = None
                    break
        if strides is None:  # row-major, or, with stride parameters, ranked by the usual call (a
            # contiguous array; vector access not provable)
            strides = row_major_strides(dims)
        coeff: dict[str, int] = {}
        const = 0
        for a, st in zip(per_dim, strides):
            assert a is not None
            const += a.const * st
            for v, c in a.coeff:
                coeff[v] = coeff.get(v, 0) + c * st
        offset = Affine(tuple(sorted((v, c) for v, c in coeff.items() if c)), const)
    return offset


def _count_ops(e: Expr) -> tuple[int, int]:
    """(floating-point ops, special-function calls) in `e`, not counting index arithmetic."""
    flops = special = 0
    for n in walk(e):
        if isinstance(n, Binary) and n.dtype.is_float:
            flops += 1
        elif isinstance(n, Call) and n.name in SPECIAL_FUNCTIONS:
            special += 1
            flops += 1
        elif isinstance(n, Select) and n.dtype.is_float:
            flops += 1
    return flops, special


def _count_instructions(e: Expr) -> float:
    """Issued instructions per thread for the arithmetic of `e` (see INSTRUCTION_COST), not
    counting index arithmetic, loads or stores. A sin/cos the approx_math pass will make cheap
    (it runs after planning, on the scheduled IR) is counted as its cheap form: the pass's own
    rewrite is applied first, unless TECC_PRECISE_MATH turns the pass off."""
    if not knobs.precise_math():
        e = approximate_expr(e)
    n_instr = 0.0
    for n in walk(e):
        if isinstance(n, Binary) and n.dtype.is_float:
            n_instr += BINARY_COST.get(n.op, 1.0)
        elif isinstance(n, Call):
            n_instr += INSTRUCTION_COST.get(n.name, 1.0)
        elif isinstance(n, Select) and n.dtype.is_float:
            n_instr += 1.0
        elif isinstance(n, RandomUniform):
            n_instr += RANDOM_COST
        elif isinstance(n, Cast) and n.dtype.is_float and n.a.dtype.is_float and min(n.dtype.bytes, n.a.dtype.bytes) == 2:
            n_instr += CONVERSION_COST
    return n_instr


def _count_mufu(e: Expr) -> float:
    """MUFU instructions per evaluation of `e` as it will be emitted (MUFU_COST)."""
    if not knobs.precise_math():
        e = approximate_expr(e)
    return sum(MUFU_COST.get(n.name, 0.0) for n in walk(e) if isinstance(n, Call))


def _epilogue_arithmetic(value: Expr) -> Expr:
    """A contraction's store value without its outermost conversion (the plain GEMM's own cast),
    the approx_math rewrite applied first so that a GELU rounded to 16 bits is priced as emitted."""
    if not knobs.precise_math():
        value = approximate_expr(value)
    return value.a if isinstance(value, Cast) else value


def approximation_notes(e: Expr) -> tuple[str, ...]:
    """What the approx_math pass will make cheap in `e`, for explain() (nothing under
    TECC_PRECISE_MATH=1)."""
    if knobs.precise_math():
        return ()
    names = {n.name for n in walk(approximate_expr(e)) if isinstance(n, Call)}
    return tuple(APPROXIMATION_NOTES[name] for name in sorted(names) if name in APPROXIMATION_NOTES)


APPROXIMATION_NOTES = {
    "gelu_erf_approx": "GELU (erf form) rounded to a 16-bit float: computed by gelu_erf_approx (x·2^q, q of degree 7, "
                       "polynomial, one MUFU.EX2; relative error <= 2^-17, plus 2^-29·|x| below x = -6.01: "
                       "tecc/ir/approx_gelu.py); TECC_PRECISE_MATH=1 keeps erff",
    "gelu_tanh_approx": "GELU (tanh form) rounded to a 16-bit float: computed by gelu_tanh_approx (x / (1 + 2^t), "
                        "exact form, ex2 + rcp; relative error <= 2^-21 + 2^-22.6·|t|, |t| <= 24.4 for |x| <= 5: "
                        "tecc/ir/approx_gelu.py); TECC_PRECISE_MATH=1 keeps tanhf",
    "sin_approx": "sin rounded to a 16-bit float: computed by sin_approx (relative error <= 2^-21.9 plus 1.5e-10; "
                  "tecc/ir/approx.py); TECC_PRECISE_MATH=1 keeps sinf",
    "cos_approx": "cos rounded to a 16-bit float: computed by cos_approx (relative error <= 2^-21.9 plus 1.5e-10; "
                  "tecc/ir/approx.py); TECC_PRECISE_MATH=1 keeps cosf",
}


def _leaves(s: Stmt, loops: tuple[For, ...], out: list[tuple[BufferStore, tuple[For, ...]]]) -> None:
    if isinstance(s, Seq):
        for x in s.stmts:
            _leaves(x, loops, out)
    elif isinstance(s, For):
        _leaves(s.body, loops + (s,), out)
    elif isinstance(s, (Allocate, LetStmt)):
        _leaves(s.body, loops, out)
    elif isinstance(s, IfThenElse):
        _leaves(s.then_case, loops, out)
        if s.else_case is not None:
            _leaves(s.else_case, loops, out)
    elif isinstance(s, BufferStore):
        out.append((s, loops))


def analyze_kernel(func: PrimFunc, sizes: Mapping[str, int] | None = None) -> KernelInfo:
    """The KernelInfo of a lowered, unscheduled kernel (see the module docstring)."""
    sizes = dict(sizes or {})
    size_vars: dict[str, Var] = {}
    for p in func.params:
        if isinstance(p, Var):
            size_vars[p.name] = p
        elif isinstance(p, Buffer):
            for e in tuple(p.shape) + tuple(p.strides or ()):
                for v in free_vars(e):
                    size_vars.setdefault(v.name, v)
    env: dict[Var, int] = {}
    assumed: list[tuple[str, int]] = []
    symbolic: list[str] = []
    strided: list[str] = []
    for name, v in size_vars.items():
        if v.kind == "stride":
            continue
        symbolic.append(name)
        if name in sizes:
            env[v] = int(sizes[name])
        else:
            env[v] = DEFAULT_SIZE
            assumed.append((name, DEFAULT_SIZE))
    for p in func.params:
        if isinstance(p, Buffer) and p.strides is not None and any(free_vars(s) for s in p.strides):
            strided.append(p.name)

    leaves: list[tuple[BufferStore, tuple[For, ...]]] = []
    _leaves(func.body, (), leaves)
    final = [(s, lps) for s, lps in leaves if s.buffer.scope == "global"]
    if not final:
        raise ValueError(f"kernel {func.name}: no store to a global buffer")
    out_store, out_loops = final[-1]
    spatial = tuple((lp.var.name, evaluate_int(lp.extent, env)) for lp in out_loops)
    updates = [(s, lps) for s, lps in leaves if s.buffer.scope == "local" and len(lps) > len(out_loops)]
    reduction: tuple[tuple[str, int], ...] = ()
    combiner: str | None = None
    body_value = out_store.value
    if updates:
        upd, upd_loops = updates[-1]
        reduction = tuple((lp.var.name, evaluate_int(lp.extent, env)) for lp in upd_loops[len(out_loops):])
        body_value = upd.value
        combiner = _combiner(upd)
    reads_seen: dict[str, Access] = {}
    for n in walk(body_value):
        if isinstance(n, BufferLoad) and n.buffer.scope == "global":
            a = _access(n.buffer, n.indices, env)
            reads_seen.setdefault(f"{n.buffer.name}{[str(i) for i in n.indices]}", a)
    flops, special = _count_ops(body_value)
    arith = _count_instructions(body_value) if not updates else None
    epilogue = 0
    if updates:
        flops = max(flops, 1)
        epilogue, special_epi = _count_ops(out_store.value)
        for n in walk(out_store.value):
            if isinstance(n, BufferLoad) and n.buffer.scope == "global":
                a = _access(n.buffer, n.indices, env)
                reads_seen.setdefault(f"{n.buffer.name}{[str(i) for i in n.indices]}", a)
    write = _access(out_store.buffer, out_store.indices, env)
    reads = tuple(reads_seen.values())
    epilogue_arith = _epilogue_arithmetic(out_store.value) if updates else None
    info = KernelInfo(
        kernel=func.name, stage=out_store.buffer.tensor, spatial=spatial, reduction=reduction, reads=reads,
        write=write, flops_per_iteration=flops, special_per_iteration=special, epilogue_flops=epilogue,
        combiner=combiner, kind="elementwise", dtype=str(out_store.buffer.dtype), symbolic=tuple(symbolic),
        assumed=tuple(assumed), strided_inputs=tuple(strided), arith_instructions_per_iteration=arith,
        random_per_iteration=sum(1 for n in walk(body_value) if isinstance(n, RandomUniform)),
        scatter=_scatter_facts(func, env) if updates else None,
        epilogue_instructions=_count_instructions(epilogue_arith) if epilogue_arith is not None else 0.0,
        epilogue_mufu=_count_mufu(epilogue_arith) if epilogue_arith is not None else 0.0,
        notes=approximation_notes(out_store.value if updates else body_value))
    return _classify(info)


def _scatter_facts(func: PrimFunc, env: Mapping[Var, int]) -> ScatterFacts | None:
    from ...passes.rewrite.scatter_atomic import match_scatter

    m = match_scatter(func)
    if m is None:
        return None
    domain = tuple((lp.var.name, evaluate_int(lp.extent, env)) for lp in m.summed + m.free)
    matched = 1
    for d in m.matched:
        matched *= evaluate_int(m.spatial[d].extent, env)
    inner = (m.summed + m.free)[-1].var
    last = m.spatial[-1].var
    coalesced = inner is last and len(m.spatial) - 1 not in m.matched and m.out.strides is None
    summed = 1
    for lp in m.summed:
        summed *= evaluate_int(lp.extent, env)
    return ScatterFacts(domain, matched, summed, m.acc_dtype.bytes, m.finish is not m.total or m.acc_dtype != m.out.dtype,
                        coalesced)


def _combiner(upd: BufferStore) -> str:
    v = upd.value
    if isinstance(v, Binary):
        return {"+": "sum", "*": "prod", "max": "max", "min": "min", "fmax": "nanmax", "fmin": "nanmin"}.get(v.op, v.op)
    if isinstance(v, Call):
        return v.name
    return "other"


def _vars_read(a: Access) -> set[str] | None:
    """The loop variables of a read whose address is affine (or splits into affine indices), else None."""
    if a.offset is not None:
        return set(a.offset.vars)
    if a.split:
        return set().union(*a.index_vars)
    return None


def _classify(info: KernelInfo) -> KernelInfo:
    from dataclasses import replace

    if not info.reduction:
        return info
    spatial = {v for v, _ in info.spatial}
    reduce_vars = {v for v, _ in info.reduction}
    used = [_vars_read(a) for a in info.reads]
    big = [vs for vs in used if vs is not None and vs & reduce_vars]
    contraction = (
        info.combiner == "sum" and len(spatial) >= 2 and len(big) >= 2
        and any(spatial - vs for vs in big)
        and all(vs & spatial for vs in big)
        and len({frozenset(vs & spatial) for vs in big}) >= 2
    )
    return replace(info, kind="contraction" if contraction else "reduction")


__all__ = ["Access", "Affine", "ScatterFacts", "BINARY_COST", "CONVERSION_COST", "INSTRUCTION_COST", "RANDOM_COST", "RANDOM_SHARED_SAVING", "KernelInfo", "analyze_kernel", "affine",
           "DEFAULT_SIZE"]
