"""CUDA C for the matrix-fragment statements: inline PTX printed from the intrinsic table.

Nothing here is written per instruction. For a row of tecc.ir.intrinsics:

- operand registers come from the row: register r of an operand is the 32 bits at fragment
  elements [offset + r * per_register, ...). A 16-bit or 8-bit operand (two or four elements per register) is
  passed as `*reinterpret_cast<unsigned*>(&frag[i])` with constraint "r"; an f32 one as
  `frag[i]` with "f". Fragment arrays are declared `__align__(16)`, and offsets are multiples
  of the register width (the statement's constructor checks), so the reinterpretation is aligned;
  the arrays stay in registers because every index is a constant after unrolling.
- D's registers are outputs ("=r" / "=f"), then A, B, C inputs, numbered in that order.
- an operand with a conversion (tf32: `cvt.rna.tf32.f32`) is passed as "f" and converted inside
  the asm block into `.b32` temporaries, which the instruction then reads.

ldmatrix passes each destination register as "=r" and the lane's row address as a 32-bit
shared-window address (`__cvta_generic_to_shared`). cp.async uses `cp.async.{ca,cg}.shared.global
[dst], [src], bytes[, src_size]`; the predicated form passes src_size = predicate ? bytes : 0,
which zero-fills the destination without reading the source. Addresses of swizzled buffers go
through the buffer's layout in `ExprEmitter.offset`, like every other access to them.
"""

from __future__ import annotations

from tecc.ir.expr import Const, Expr
from tecc.ir.intrinsics import FragmentOperand
from tecc.ir.stmt import AsyncCopy, Buffer, FragmentRef, MatrixLoad, MatrixMultiply

from .cuda_expr import ExprEmitter, c_type


def fragment_declaration(buffer: Buffer, name: str, count: int) -> str:
    """A fragment buffer: a per-thread array aligned so that its elements pack into registers."""
    return f"__align__(16) {c_type(buffer.dtype)} {name}[{count}];"


def _register(expr: ExprEmitter, ref: FragmentRef, op: FragmentOperand, r: int) -> tuple[str, str]:
    """(constraint letter, C lvalue) of register `r` of a fragment operand."""
    element: Expr = ref.offset + r * op.elements_per_register
    lvalue = expr.buffer_ref(ref.buffer, (element,))
    if op.elements_per_register > 1:
        return "r", f"*reinterpret_cast<unsigned*>(&{lvalue})"
    return "f", lvalue


def _asm(lines: list[str], outputs: list[str], inputs: list[str], clobber_memory: bool) -> list[str]:
    """`asm volatile("...": outputs : inputs [: "memory"]);` as C lines."""
    out = ["asm volatile("]
    out += [f'  "{line}\\n"' for line in lines]
    out.append(f"  : {', '.join(outputs)}".rstrip())
    out.append(f"  : {', '.join(inputs)}".rstrip())
    if clobber_memory:
        out.append('  : "memory"')
    out[-1] += ");"
    return out


def matrix_multiply(expr: ExprEmitter, s: MatrixMultiply) -> list[str]:
    row = s.row
    operands = [(role, getattr(s, role), row.operand(role)) for role in ("d", "a", "b", "c")]
    outputs: list[str] = []
    inputs: list[str] = []
    registers: dict[str, list[str]] = {}
    prologue: list[str] = []
    temporaries: list[str] = []
    number = 0
    for role, ref, op in operands:
        names = []
        for r in range(op.registers):
            letter, lvalue = _register(expr, ref, op, r)
            if role == "d":
                outputs.append(f'"={letter}"({lvalue})')
            else:
                inputs.append(f'"{letter}"({lvalue})')
            if op.convert is not None and role != "d":
                temp = f"t{role}{r}"
                prologue.append(f"{op.convert} {temp}, %{number};")
                names.append(temp)
            else:
                names.append(f"%{number}")
            number += 1
        if op.convert is not None and role != "d":
            temporaries.append(f"t{role}<{op.registers}>")
        registers[role] = names
    instruction = f"{row.ptx} " + ", ".join("{" + ", ".join(registers[r]) + "}" for r in ("d", "a", "b", "c")) + ";"
    if not prologue:
        return _asm([instruction], outputs, inputs, clobber_memory=False)
    body = ["{", f".reg .b32 {', '.join(temporaries)};", *prologue, instruction, "}"]
    return _asm(body, outputs, inputs, clobber_memory=False)


def shared_address(expr: ExprEmitter, buffer: Buffer, indices: tuple[Expr, ...]) -> str:
    """The 32-bit shared-window address of `buffer[indices]` (through its layout)."""
    return f"static_cast<unsigned>(__cvta_generic_to_shared(&{expr.buffer_ref(buffer, indices)}))"


def matrix_load(expr: ExprEmitter, s: MatrixLoad) -> list[str]:
    row = s.row
    op = row.operand("d")
    if s.pairs:  # 32-bit elements as b16 pairs: register r is element offset + r
        outputs = [f'"=r"(*reinterpret_cast<unsigned*>(&{expr.buffer_ref(s.dst.buffer, (s.dst.offset + r,))}))'
                   for r in range(op.registers)]
    else:
        outputs = [f'"=r"({_register(expr, s.dst, op, r)[1]})' for r in range(op.registers)]
    regs = ", ".join(f"%{r}" for r in range(op.registers))
    instruction = f"{row.ptx} {{{regs}}}, [%{op.registers}];"
    return _asm([instruction], outputs, [f'"r"({shared_address(expr, s.src, s.src_indices)})'],
                clobber_memory=True)


def launch_tested_strides(s: AsyncCopy) -> tuple[Expr, ...] | None:
    """The source strides a copy loop taken under its launch test knows: the run-time stride
    the copy runs along (`AsyncCopy.along`) is the constant 1 there (`unit_stride_at_launch`:
    the kernel tested it; the emulator checks it at every such copy), so the address drops its
    multiply by that kernel parameter. None for any other copy (its buffer's own strides)."""
    if not s.unit_stride_at_launch or s.src.strides is None:
        return None
    along = s.along % s.src.ndim
    return tuple(Const(1, st.dtype) if d == along else st for d, st in enumerate(s.src.strides))


def async_copy(expr: ExprEmitter, s: AsyncCopy) -> list[str]:
    dst = shared_address(expr, s.dst, s.dst_indices)
    strides = launch_tested_strides(s)
    src = (f"&{expr.buffer_ref(s.src, s.src_indices)}" if strides is None else
           f"&{expr.buffer_name(s.src)}[{expr.code(expr.offset(s.src, s.src_indices, strides))}]")
    inputs = [f'"r"({dst})', f'"l"({src})']
    instruction = f"cp.async.{s.cache}.shared.global [%0], [%1], {s.bytes}"
    if s.predicate is not None:
        inputs.append(f'"r"({expr.code(s.predicate)} ? {s.bytes} : 0)')
        instruction += ", %2"
    return _asm([instruction + ";"], [], inputs, clobber_memory=True)
