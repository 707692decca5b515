"""Stable, deterministic text for every IR level. `str(node)` calls these, through the table of
print rules (tecc.ir.printing) this module fills when it is imported.

Expressions print infix with C-like precedence (`&&`/`||` for bool logic, `//` and `%` floor
division and modulo, `min/max/pow` and casts as calls); statements print as an indented loop
nest that reads like the program, with each loop's kind in brackets.
"""

from __future__ import annotations

from typing import Any

from . import printing
from .expr import Binary, BufferLoad, Call, Cast, Compare, Const, Expr, Not, Reduce, Select, TensorRead, Var
from .philox import RandomUniform
from .stmt import (Allocate, AsyncCopy, Barrier, BarrierRef, BulkCopy, Buffer, BufferStore, Evaluate, For, IfThenElse,
                   Instruction, LetStmt, MatrixLoad, MatrixMultiply, Module, PrimFunc, Seq, SharedMatrix, Stmt,
                   TensorCopy, TensorStore, WarpgroupMatrixMultiply)

_HOPPER = (WarpgroupMatrixMultiply, BulkCopy, TensorCopy, TensorStore)

# Higher binds tighter.
_PREC = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, "<=": 7, ">": 7, ">=": 7,
         "+": 9, "-": 9, "*": 10, "/": 10, "//": 10, "%": 10}
_FUNC_OPS = ("min", "max", "fmin", "fmax", "pow")


def _fmt_const(c: Const) -> str:
    if c.dtype.is_bool:
        return "True" if c.value else "False"
    if c.dtype.is_int:
        text = str(c.value)
        return text if c.dtype.name == "int32" else f"{c.dtype.name}({text})"
    text = repr(float(c.value))
    return text if c.dtype.name == "float32" else f"{c.dtype.name}({text})"


def _op_text(e: Binary) -> str:
    if e.dtype.is_bool and e.op in ("&", "|"):
        return "&&" if e.op == "&" else "||"
    return e.op


def _expr(e: Expr, parent_prec: int = 0) -> str:
    if isinstance(e, Const):
        return _fmt_const(e)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Binary):
        if e.op in _FUNC_OPS:
            return f"{e.op}({_expr(e.a)}, {_expr(e.b)})"
        op = _op_text(e)
        prec = _PREC[op]
        # Left-associative: the right operand needs parentheses at equal precedence.
        text = f"{_expr(e.a, prec)} {op} {_expr(e.b, prec + 1)}"
        return f"({text})" if prec < parent_prec else text
    if isinstance(e, Compare):
        prec = _PREC[e.op]
        text = f"{_expr(e.a, prec + 1)} {e.op} {_expr(e.b, prec + 1)}"
        return f"({text})" if prec < parent_prec else text
    if isinstance(e, Not):
        return f"!{_expr(e.a, 11)}" if e.dtype.is_bool else f"~{_expr(e.a, 11)}"
    if isinstance(e, Cast):
        return f"{e.dtype.name}({_expr(e.a)})"
    if isinstance(e, Select):
        return f"where({_expr(e.cond)}, {_expr(e.a)}, {_expr(e.b)})"
    if isinstance(e, Call):
        return f"{e.name}({', '.join(_expr(a) for a in e.args)})"
    if isinstance(e, Reduce):
        axes = ", ".join(f"{a.name} in {_range(a.lo, a.extent)}" for a in e.axes)
        return f"{e.combiner}({_expr(e.source)} for {axes})"
    if isinstance(e, TensorRead):
        return f"{e.tensor.name}[{', '.join(_expr(i) for i in e.indices)}]"
    if isinstance(e, BufferLoad):
        return f"{e.buffer.name}[{', '.join(_expr(i) for i in e.indices)}]"
    if isinstance(e, RandomUniform):
        return f"rand(seed={_expr(e.seed)}, offset={_expr(e.offset)}, n={_expr(e.index)})"
    raise TypeError(f"printer: no rule for {type(e).__name__}")


def _range(lo: Expr, extent: Expr) -> str:
    if isinstance(lo, Const) and lo.value == 0:
        return f"range({_expr(extent)})"
    return f"range({_expr(lo)}, {_expr(lo + extent)})"


def expr_to_str(e: Expr) -> str:
    return _expr(e)


def buffer_decl(b: Buffer) -> str:
    shape = ", ".join(_expr(s) for s in b.shape)
    text = f"{b.name}: {b.dtype.name}[{shape}]"
    if b.strides is not None:
        text += f" strides({', '.join(_expr(s) for s in b.strides)})"
    if b.scope != "global":
        text += f" @{b.scope}"
    if b.fragment is not None:
        text += f"({b.fragment[0]}.{b.fragment[1]})"
    if b.layout is not None:
        text += f" {b.layout}"
    if b.zero_init:
        text += " zero_init"
    return text


def _stmt(s: Stmt, ind: int, out: list[str]) -> None:
    pad = "  " * ind
    if isinstance(s, Seq):
        for x in s.stmts:
            _stmt(x, ind, out)
    elif isinstance(s, For):
        kind = "" if s.kind == "serial" else f"  # {s.kind}"
        notes = "".join(f" {k}={v}" for k, v in s.annotations)
        if notes:
            kind = (kind or "  #") + notes
        out.append(f"{pad}for {s.var.name} in {_range(s.min, s.extent)}:{kind}")
        _stmt(s.body, ind + 1, out)
    elif isinstance(s, BufferStore):
        idx = ", ".join(_expr(i) for i in s.indices)
        out.append(f"{pad}{s.buffer.name}[{idx}] = {_expr(s.value)}")
    elif isinstance(s, Allocate):
        out.append(f"{pad}allocate {buffer_decl(s.buffer)}")
        _stmt(s.body, ind, out)
    elif isinstance(s, IfThenElse):
        out.append(f"{pad}if {_expr(s.cond)}:")
        _stmt(s.then_case, ind + 1, out)
        if s.else_case is not None:
            out.append(f"{pad}else:")
            _stmt(s.else_case, ind + 1, out)
    elif isinstance(s, LetStmt):
        out.append(f"{pad}let {s.var.name}: {s.var.dtype.name} = {_expr(s.value)}")
        _stmt(s.body, ind, out)
    elif isinstance(s, Barrier):
        out.append(f"{pad}barrier()")
    elif isinstance(s, Evaluate):
        out.append(f"{pad}{_expr(s.value)}")
    elif isinstance(s, Instruction):
        out.append(pad + instruction_text(s))
    elif isinstance(s, (MatrixMultiply, MatrixLoad, AsyncCopy)):
        out.append(pad + _matrix_stmt(s))
    elif isinstance(s, _HOPPER):
        out.append(pad + _hopper_stmt(s))
    else:
        raise TypeError(f"printer: no rule for {type(s).__name__}")


def _fragment(ref: Any, size: int) -> str:
    return f"{ref.buffer.name}[{_expr(ref.offset)}:{_expr(ref.offset + size)}]"


def _matrix_stmt(s: Stmt) -> str:
    """`mma.m16n8k16.f32.f16 D[0:4] += A[0:8] · B[0:4]`, `ldmatrix.x4 A[0:8] <- S[r, c]`, ..."""
    if isinstance(s, MatrixMultiply):
        row = s.row
        d, a, b, c = (_fragment(getattr(s, r), row.operand(r).elements) for r in ("d", "a", "b", "c"))
        if s.d.buffer is s.c.buffer and s.d.offset is s.c.offset:
            return f"{s.intrinsic} {d} += {a} · {b}"
        return f"{s.intrinsic} {d} = {a} · {b} + {c}"
    if isinstance(s, MatrixLoad):
        idx = ", ".join(_expr(i) for i in s.src_indices)
        return f"{s.intrinsic} {_fragment(s.dst, s.row.operand('d').elements)} <- {s.src.name}[{idx}]"
    if isinstance(s, AsyncCopy):
        dst = ", ".join(_expr(i) for i in s.dst_indices)
        src = ", ".join(_expr(i) for i in s.src_indices)
        text = f"cp.async.{s.cache} {s.bytes}B {s.dst.name}[{dst}] <- {s.src.name}[{src}]"
        if s.unit_stride_at_launch:
            text += (" (unit innermost stride tested at launch)" if s.along % s.src.ndim == s.src.ndim - 1
                     else f" (along dimension {s.along % s.src.ndim}, its unit stride tested at launch)")
        return text if s.predicate is None else f"{text} if {_expr(s.predicate)} else zero"
    raise TypeError(f"printer: no rule for {type(s).__name__}")


def _operand_text(kind: str, value: Any, spellings: tuple[str, str]) -> str:
    if kind == "expr":
        return _expr(value)
    if kind == "barrier":
        assert isinstance(value, BarrierRef)
        return f"{value.buffer.name}[{_expr(value.index)}]"
    if kind == "flag":
        return spellings[bool(value)]
    if kind == "pinned":
        return "".join(f", {b.name}" for b in value)
    if kind == "tensormap":
        return str(value.name)
    return str(value)


def instruction_text(s: Instruction) -> str:
    """`mbarrier.wait(bar[0], parity=0)`: the row's text with the operands printed into it."""
    row = s.row
    return row.text.format(**{o.name: _operand_text(o.kind, v, o.spellings) for o, v in zip(row.operands, s.operands)})


def _shared_matrix(ref: SharedMatrix) -> str:
    return f"{ref.buffer.name}[{ref.descriptor} @ {_expr(ref.start)}]"


def _hopper_stmt(s: Stmt) -> str:
    """`wgmma.m64n64k16.f32.f16 acc[0:32] += As[desc(..) @ 0] · Bs[desc(..) @ 0]`, `tma.load ...`, ..."""
    if isinstance(s, WarpgroupMatrixMultiply):
        d = _fragment(s.d, s.row.operand("d").elements)
        a = _shared_matrix(s.a) if isinstance(s.a, SharedMatrix) else _fragment(s.a, s.row.operand("a").elements)
        product = f"{a} · {_shared_matrix(s.b)}"
        scale = s.scale_d
        if isinstance(scale, Const):
            return f"{s.intrinsic} {d} {'+=' if scale.value else '='} {product}"
        return f"{s.intrinsic} {d} = {product} + ({d} if {_expr(scale)} else 0)"
    if isinstance(s, BulkCopy):
        dst = ", ".join(_expr(i) for i in s.dst_indices)
        src = ", ".join(_expr(i) for i in s.src_indices)
        return f"cp.async.bulk {s.bytes}B {s.dst.name}[{dst}] <- {s.src.name}[{src}] completes {s.bar}"
    if isinstance(s, TensorCopy):
        dst = ", ".join(_expr(i) for i in s.dst_indices)
        coords = ", ".join(_expr(i) for i in s.coords)
        return f"tma.load {s.bytes}B {s.dst.name}[{dst}] <- {s.map}[{coords}] completes {s.bar}"
    if isinstance(s, TensorStore):
        src = ", ".join(_expr(i) for i in s.src_indices)
        coords = ", ".join(_expr(i) for i in s.coords)
        return f"tma.store {s.bytes}B {s.map}[{coords}] <- {s.src.name}[{src}]"
    raise TypeError(f"printer: no rule for {type(s).__name__}")


def stmt_to_str(s: Stmt) -> str:
    out: list[str] = []
    _stmt(s, 0, out)
    return "\n".join(out)


def _param(p: Any) -> str:
    if isinstance(p, Buffer):
        return buffer_decl(p)
    return f"{p.name}: {p.dtype.name}"


def func_to_str(f: PrimFunc) -> str:
    out = [f"kernel {f.name}({', '.join(_param(p) for p in f.params)}):"]
    for k, v in f.attrs:
        out.append(f"  # {k} = {v}")
    _stmt(f.body, 1, out)
    return "\n".join(out)


def module_to_str(m: Module) -> str:
    out = [f"module {m.name}({', '.join(_param(p) for p in m.params)}):"]
    for t in m.temps:
        out.append(f"  temp {buffer_decl(t)}")
    for c in m.calls:
        out.append(f"  launch {c.kernel}({', '.join(a.name for a in c.args)})")
    text = "\n".join(out)
    kernels = "\n\n".join(func_to_str(k) for k in m.kernels)
    return f"{text}\n\n{kernels}" if kernels else text


printing.register(Expr, expr_to_str)
printing.register(Stmt, stmt_to_str)
printing.register(PrimFunc, func_to_str)
printing.register(Module, module_to_str)
