"""CUDA C for the Hopper statements: wgmma with shared-memory descriptors and the bulk copy, as
inline PTX (sm_90a: wgmma needs the architecture-specific target). Their fences, wait groups and
the mbarrier operations are rows of the instruction table (instructions.py).

- wgmma: each descriptor is built as 64-bit integer arithmetic from the statement's
  `MatrixDescriptor`: its constant fields (`constant_bits()`, printed as a literal) plus the
  start-address field, ((shared address of the buffer + 2 * start) & 0x3FFFF) >> 4, the formula
  of `MatrixDescriptor.encode`. The accumulator registers are "+f" operands (read and written),
  scale-d becomes a predicate, imm-scale-a/b are 1 and the transpose bits say MN-major operands.
- Buffers that descriptors address are declared `__align__(1024)` (the emitter asks
  `descriptor_buffers`), so the hardware's address swizzle is the buffer's layout.
- the bulk copy's mbarrier is addressed by its 32-bit shared-window address.
"""

from __future__ import annotations

from tecc.ir.descriptor import MatrixDescriptor
from tecc.ir.errors import CompileError
from tecc.ir.expr import index_expr
from tecc.ir.stmt import (
    BulkCopy,
    FragmentRef,
    Instruction,
    PrimFunc,
    SharedMatrix,
    WarpgroupMatrixMultiply,
    iter_stmts,
)

from .cuda_expr import ExprEmitter
from .matrix import _asm, _register, shared_address


# The line emit_source puts at the top of a translation unit that uses instructions only the
# architecture-specific target has (wgmma, setmaxnreg: PTX ISA, "sm_90a"); compile_cuda then
# compiles it for `sm_XYa` when asked for `sm_XY`, so every path to NVRTC (build, the planner's
# compile check, the tuner's workers, which see only the source) picks the same arch.
ARCH_SPECIFIC_MARK = "// tecc: needs the architecture-specific target (sm_90a: wgmma / setmaxnreg)"


def needs_arch_specific(func: PrimFunc) -> bool:
    """Whether `func` uses an instruction that only the sm_90a target has (wgmma, and the
    instruction rows marked arch_specific: wgmma's fences and groups, setmaxnreg)."""
    return any(isinstance(s, WarpgroupMatrixMultiply) or (isinstance(s, Instruction) and s.row.arch_specific)
               for s in iter_stmts(func.body))


def arch_for_source(source: str, arch: str) -> str:
    """`arch` with the architecture-specific suffix when `source` carries ARCH_SPECIFIC_MARK
    and `arch` has none ('sm_90' -> 'sm_90a'); otherwise `arch` unchanged. CompileError for a
    marked source and another plain arch: those instructions exist on sm_90a only."""
    if ARCH_SPECIFIC_MARK not in source or arch.endswith(("a", "f")):
        return arch
    if arch != "sm_90":
        raise CompileError(f"this CUDA source uses wgmma / setmaxnreg, which only sm_90a has; it cannot be "
                           f"compiled for {arch}: build it for sm_90 (arch='sm_90'), or plan for {arch} "
                           "without intrinsic='wgmma' (plan='auto' does)")
    return arch + "a"


def descriptor_buffers(func: PrimFunc) -> set[int]:
    """Ids of the shared buffers a wgmma descriptor addresses (declared 1024-byte aligned)."""
    return {id(ref.buffer) for s in iter_stmts(func.body) if isinstance(s, WarpgroupMatrixMultiply)
            for ref in (s.a, s.b) if isinstance(ref, SharedMatrix)}


def descriptor_value(expr: ExprEmitter, ref: SharedMatrix) -> str:
    """The 64-bit descriptor of `ref` as a C expression (MatrixDescriptor.encode, in C)."""
    d: MatrixDescriptor = ref.descriptor
    base = shared_address(expr, ref.buffer, tuple(index_expr(0) for _ in ref.buffer.shape))  # element 0
    address = f"{base} + {d.element_bytes}u * static_cast<unsigned>({expr.code(ref.start)})"
    return f"(0x{d.constant_bits():016x}ULL + ((static_cast<unsigned long long>({address}) & 0x3FFFFULL) >> 4))"


def warpgroup_multiply(expr: ExprEmitter, s: WarpgroupMatrixMultiply) -> list[str]:
    row = s.row
    op = row.operand("d")
    outputs = [f'"+f"({_register(expr, s.d, op, r)[1]})' for r in range(op.registers)]
    n = op.registers
    # tf32 and fp8 have no transpose immediates (their shared operands are K-major only: PTX ISA,
    # wgmma.mma_async)
    k_major_only = row.k_major_only
    refs = [ref for ref in (s.a, s.b) if isinstance(ref, SharedMatrix)]
    if k_major_only and any(ref.descriptor.major != "K" for ref in refs):
        raise CompileError(f"{row.name}: .{row.input_type} wgmma reads only K-major shared operands; "
                           f"got {', '.join(str(ref.descriptor) for ref in refs)}")
    trans_b = "" if k_major_only else f", {int(s.b.descriptor.major == 'MN')}"
    accumulators = "{" + ", ".join(f"%{r}" for r in range(n)) + "}"
    if isinstance(s.a, FragmentRef):
        # A from registers (4 .f16x2, or 4 f32 converted to tf32 inside the block like
        # mma.sync's), and no transpose bit for A (PTX ISA, wgmma.mma_async)
        a_op = row.operand("a")
        a_regs = [f'"{_register(expr, s.a, a_op, r)[0]}"({_register(expr, s.a, a_op, r)[1]})'
                  for r in range(a_op.registers)]
        inputs = a_regs + [f'"l"({descriptor_value(expr, s.b)})', f'"r"(static_cast<int>({expr.code(s.scale_d)}))']
        na = len(a_regs)
        convert: list[str] = []
        if a_op.convert is not None:
            convert = [f".reg .b32 ta<{na}>;"] + [f"{a_op.convert} ta{r}, %{n + r};" for r in range(na)]
            a_vec = "{" + ", ".join(f"ta{r}" for r in range(na)) + "}"
        else:
            a_vec = "{" + ", ".join(f"%{n + r}" for r in range(na)) + "}"
        body = ["{", ".reg .pred scale_d;", *convert, f"setp.ne.b32 scale_d, %{n + na + 1}, 0;",
                f"{row.ptx} {accumulators}, {a_vec}, %{n + na}, scale_d, 1, 1{trans_b};", "}"]
        return _asm(body, outputs, inputs, clobber_memory=True)
    inputs = [f'"l"({descriptor_value(expr, s.a)})', f'"l"({descriptor_value(expr, s.b)})',
              f'"r"(static_cast<int>({expr.code(s.scale_d)}))']
    trans = "" if k_major_only else f", {int(s.a.descriptor.major == 'MN')}{trans_b}"
    body = ["{", ".reg .pred scale_d;", f"setp.ne.b32 scale_d, %{n + 2}, 0;",
            f"{row.ptx} {accumulators}, %{n}, %{n + 1}, scale_d, 1, 1{trans};", "}"]
    return _asm(body, outputs, inputs, clobber_memory=True)


def bulk_copy(expr: ExprEmitter, s: BulkCopy) -> list[str]:
    dst = shared_address(expr, s.dst, s.dst_indices)
    src = f"&{expr.buffer_ref(s.src, s.src_indices)}"
    bar = shared_address(expr, s.bar.buffer, (s.bar.index,))
    instruction = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
    return _asm([instruction], [], [f'"r"({dst})', f'"l"({src})', f'"n"({s.bytes})', f'"r"({bar})'],
                clobber_memory=True)
