"""JSON for the parts of the IR that travel in a manifest: expressions over size variables,
buffers and kernel signatures. The runtime rebuilds them without the compiler.

Variables are written by name with their dtype and kind; within one document a name stands for
one variable (the module's size, stride and index variables have distinct names)."""

from __future__ import annotations

from typing import Any

from . import dtype as dt
from .errors import TeccError
from .expr import (
    Binary,
    Call,
    Cast,
    Compare,
    Const,
    Expr,
    Not,
    Select,
    Var,
    binary,
    compare,
    select,
)
from .philox import RandomUniform
from .stmt import Buffer


class VarTable:
    """Maps names to variables while reading a document, so one name is one Var."""

    def __init__(self) -> None:
        self.vars: dict[str, Var] = {}
        # a buffer dimension's or stride's JSON (its repr) -> the expression: a document repeats
        # them (a whole-graph program's manifest: 7189 of them, 168 distinct)
        self.exprs: dict[str, Expr] = {}

    def get(self, name: str, dtype: str, kind: str) -> Var:
        v = self.vars.get(name)
        if v is None:
            v = Var(name, dt.as_dtype(dtype), kind)
            self.vars[name] = v
        return v

    def expr(self, j: Any) -> Expr:
        """`expr_from_json(j, self)`, decoded once per distinct JSON (expressions are immutable)."""
        key = repr(j)
        e = self.exprs.get(key)
        if e is None:
            e = self.exprs[key] = expr_from_json(j, self)
        return e


def expr_to_json(e: Expr) -> Any:
    if isinstance(e, Const):
        return {"const": e.value, "dtype": e.dtype.name}
    if isinstance(e, Var):
        return {"var": e.name, "dtype": e.dtype.name, "kind": e.kind}
    if isinstance(e, Binary):
        return {"op": e.op, "args": [expr_to_json(e.a), expr_to_json(e.b)]}
    if isinstance(e, Compare):
        return {"cmp": e.op, "args": [expr_to_json(e.a), expr_to_json(e.b)]}
    if isinstance(e, Not):
        return {"not": expr_to_json(e.a)}
    if isinstance(e, Cast):
        return {"cast": e.dtype.name, "arg": expr_to_json(e.a)}
    if isinstance(e, Select):
        return {"select": [expr_to_json(e.cond), expr_to_json(e.a), expr_to_json(e.b)]}
    if isinstance(e, Call):
        return {"call": e.name, "dtype": e.dtype.name, "args": [expr_to_json(a) for a in e.args]}
    if isinstance(e, RandomUniform):
        return {"rand": [expr_to_json(e.seed), expr_to_json(e.offset), expr_to_json(e.index)]}
    raise TeccError(f"cannot serialize {type(e).__name__} {e}: only scalar expressions over variables travel")


def expr_from_json(j: Any, table: VarTable) -> Expr:
    if "const" in j:
        return Const(j["const"], dt.as_dtype(j["dtype"]))
    if "var" in j:
        return table.get(j["var"], j["dtype"], j["kind"])
    if "op" in j:
        a, b = (expr_from_json(x, table) for x in j["args"])
        return binary(j["op"], a, b)
    if "cmp" in j:
        a, b = (expr_from_json(x, table) for x in j["args"])
        return compare(j["cmp"], a, b)
    if "not" in j:
        return Not(expr_from_json(j["not"], table))
    if "cast" in j:
        from .expr import cast

        return cast(expr_from_json(j["arg"], table), j["cast"])
    if "select" in j:
        c, a, b = (expr_from_json(x, table) for x in j["select"])
        return select(c, a, b)
    if "call" in j:
        return Call(j["call"], tuple(expr_from_json(x, table) for x in j["args"]), dt.as_dtype(j["dtype"]))
    if "rand" in j:
        seed, offset, index = (expr_from_json(x, table) for x in j["rand"])
        return RandomUniform(seed, offset, index)
    raise TeccError(f"malformed expression in manifest: {j!r}")


def buffer_to_json(b: Buffer) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": b.name,
        "dtype": b.dtype.name,
        "shape": [expr_to_json(s) for s in b.shape],
        "strides": None if b.strides is None else [expr_to_json(s) for s in b.strides],
        "scope": b.scope,
        "tensor": b.tensor,
    }
    if b.zero_init:  # written only when set: documents without it read as before (false)
        out["zero_init"] = True
    return out


def buffer_from_json(j: dict[str, Any], table: VarTable) -> Buffer:
    return Buffer(
        j["name"], dt.as_dtype(j["dtype"]), tuple(table.expr(s) for s in j["shape"]), j["scope"],
        None if j["strides"] is None else tuple(table.expr(s) for s in j["strides"]), j["tensor"],
        bool(j.get("zero_init", False)),
    )


def param_to_json(p: Buffer | Var) -> dict[str, Any]:
    if isinstance(p, Buffer):
        return {"buffer": buffer_to_json(p)}
    return {"scalar": expr_to_json(p)}


def param_from_json(j: dict[str, Any], table: VarTable) -> Buffer | Var:
    if "buffer" in j:
        return buffer_from_json(j["buffer"], table)
    v = expr_from_json(j["scalar"], table)
    assert isinstance(v, Var)
    return v
