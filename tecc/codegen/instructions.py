"""CUDA C for the instruction rows of the table (tecc.ir.instructions): inline PTX printed from the
row, nothing written per instruction.

The row's `ptx` lines are the asm body, its imm and flag operands printed into them (`{pending}`,
`{increase}`); its expr and barrier operands are the asm's inputs in operand order (`%0`, `%1`,
...): an expr as `"r"(static_cast<unsigned>(value))`, a barrier as `"r"(its 32-bit shared-window
address)`, a tensor map as `"l"(its parameter's generic address)`. Every instruction clobbers
memory (it orders memory accesses or waits for them). A `one_line` row (no inputs) prints as
`asm volatile("...\\n" ::: "memory");`, the others as an asm block. After the instruction, each
register of a `pinned` operand's buffers gets an empty asm with the register as a "+f" operand,
so the C compiler does not move its reads above the instruction (wgmma.wait_group's
accumulators).
"""

from __future__ import annotations

from tecc.ir.expr import index_expr
from tecc.ir.stmt import Instruction

from .cuda_expr import ExprEmitter
from .matrix import _asm, shared_address


def instruction(expr: ExprEmitter, s: Instruction, counts: dict[int, int]) -> list[str]:
    """The C lines of `s`; `counts` gives each pinned buffer's element count (by buffer id)."""
    row = s.row
    words: dict[str, str] = {}
    inputs: list[str] = []
    pins: list[str] = []
    for o, value in zip(row.operands, s.operands):
        if o.kind == "expr":
            inputs.append(f'"r"(static_cast<unsigned>({expr.code(value)}))')
        elif o.kind == "barrier":
            inputs.append(f'"r"({shared_address(expr, value.buffer, (value.index,))})')
        elif o.kind == "flag":
            words[o.name] = o.spellings[bool(value)]
        elif o.kind == "tensormap":
            inputs.append(f'"l"(reinterpret_cast<unsigned long long>(&{value.name}))')
        elif o.kind == "pinned":
            pins += [f'asm volatile("" : "+f"({expr.buffer_ref(b, (index_expr(i),))}) :: "memory");'
                     for b in value for i in range(counts[id(b)])]
        else:
            words[o.name] = str(value)
    lines = [line.format(**words) for line in row.ptx]
    if row.one_line:
        assert not inputs and len(lines) == 1, f"{row.name}: a one-line asm has no inputs"
        return [f'asm volatile("{lines[0]}\\n" ::: "memory");'] + pins
    return _asm(lines, [], inputs, clobber_memory=True) + pins
