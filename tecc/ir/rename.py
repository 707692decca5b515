"""Renaming the names of IR: an identifier renaming (a name, or a name held as whole
`_`-separated segments of a derived identifier) applied one to one to identifiers, to text, and
to a loop-IR module or kernel; and `StructureText`, IR described with its names numbered, which
says when two pieces of IR are one structure under other names (the names then pair in order).

Two users: the planner gives a part of an earlier part's structure that part's scheduled module
renamed (tecc/compiler/part_twins.py), and the emitter writes a kernel of an earlier kernel's
structure from one text with the names replaced (tecc/codegen/twins.py). A renaming never makes
two identifiers one (NameClash), so what it renames is the same code under other names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from . import dtype as dt
from .expr import Const, Expr, IterVar, Var
from .index_checks import CheckSite, IndexCheck
from .stmt import Buffer, KernelCall, Module, PrimFunc

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class NameClash(Exception):
    """Two identifiers would become one (`Renaming`)."""


class Renaming:
    """The renaming `renamed` applies, one identifier at a time: a key of `names` becomes its
    image, an identifier holding a key as whole `_`-separated segments has that part replaced
    (the longest key found), `fixed` identifiers and those starting with `__` stay. Calling it
    on two identifiers that would become one raises NameClash, so what it renames stays one to
    one (a consistent renaming of code is the same code)."""

    def __init__(self, names: dict[str, str], fixed: frozenset[str] = frozenset()) -> None:
        self.names, self.fixed = names, fixed
        self._prefixes = sorted(names, key=len, reverse=True)
        self._image: dict[str, str] = {}   # a new identifier -> the identifier it replaces
        self._done: dict[str, str] = {}    # an identifier -> its image (an identifier recurs many times)

    def __call__(self, t: str) -> str:
        u = self._done.get(t)
        if u is not None:
            return u
        u = t
        if t in self.fixed or t.startswith("__"):
            pass
        elif t in self.names:
            u = self.names[t]
        else:
            for p in self._prefixes:
                at = _segment(t, p)
                if at >= 0:
                    u = t[:at] + self.names[p] + t[at + len(p):]
                    break
        if self._image.setdefault(u, t) != t:
            raise NameClash(f"{self._image[u]} and {t} would both become {u}")
        self._done[t] = u
        return u

    def text(self, text: str) -> str:
        """Every identifier of `text` renamed (NameClash as for one)."""
        return IDENTIFIER.sub(lambda match: self(match.group(0)), text)


def _segment(t: str, p: str) -> int:
    """Where `p` is whole `_`-separated segments of identifier `t` (`copy_A_1` holds `A`), or -1."""
    at = t.find(p)
    while at >= 0:
        end = at + len(p)
        if (at == 0 or t[at - 1] == "_") and (end == len(t) or t[end] == "_"):
            return at
        at = t.find(p, at + 1)
    return -1


class UnknownNode(Exception):
    """A value the IR renaming does not know (the caller renames nothing: it plans or emits the
    code itself)."""


class IRRenaming:
    """`Renaming` applied to loop IR: every variable's, buffer's, kernel's and the module's
    name, the tensor and kernel names of index checks and launches, and the strings of a
    kernel's attributes (what a primitive noted names tensors too). A node whose fields do not
    change is kept, so the program's size variables stay the same objects. NameClash and
    UnknownNode as for `Renaming` and a value that is no IR node."""

    def __init__(self, identifier: Renaming) -> None:
        self.identifier = identifier
        self._memo: dict[int, Any] = {}
        self._keep: list[Any] = []
        self._in_attrs = False

    def text(self, text: str) -> str:
        return self.identifier.text(text)

    def module(self, module: Module) -> Module:
        out = self._value(module)
        assert isinstance(out, Module)
        return out

    def kernel(self, func: PrimFunc) -> PrimFunc:
        out = self._value(func)
        assert isinstance(out, PrimFunc)
        return out

    def _value(self, v: Any) -> Any:
        kind = type(v)
        if kind is str:
            return self._text(v) if self._in_attrs else v
        if kind in _ATOMS or isinstance(v, dt.DType):
            return v
        if kind is tuple:
            items = tuple([self._value(x) for x in v])
            return v if all(a is b for a, b in zip(items, v)) else items
        if isinstance(v, dict):
            return {k: self._value(x) for k, x in v.items()}
        hit = self._memo.get(id(v))
        if hit is not None:
            return hit
        made = self._node(v)
        self._memo[id(v)] = made
        self._keep.append(v)
        return made

    def _text(self, v: str) -> str:
        new = self.text(v)
        return v if new == v else new

    def _node(self, v: Any) -> Any:
        cls = type(v)
        if isinstance(v, Var):
            new_name = self.identifier(v.name)
            if isinstance(v, IterVar):
                lo, extent = self._value(v.lo), self._value(v.extent)
                if new_name == v.name and lo is v.lo and extent is v.extent:
                    return v
                return cls(new_name, lo, extent, v.dtype, v.kind) if cls is IterVar else cls(new_name, lo, extent, v.dtype)
            return v if new_name == v.name else cls(new_name, v.dtype, v.kind)
        if isinstance(v, Expr):
            if cls is Const:
                return v
            if isinstance(v, IndexCheck):
                args = [self._value(v.value), self._value(v.extent), self.identifier(v.tensor), v.dim]
            else:
                args = [self._value(getattr(v, f)) for f in cls._fields]
            return v if all(a is getattr(v, f) for a, f in zip(args, cls._fields)) else cls(*args)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            names = _NAMED_FIELDS.get(cls, ())
            fields = {f.name: self._field(v, f.name, f.name in names) for f in dataclasses.fields(v) if f.init}
            if all(fields[k] is getattr(v, k) for k in fields):
                return v
            return cls(**fields)
        raise UnknownNode(f"a {cls.__name__} in a scheduled module")

    def _field(self, v: Any, field: str, named: bool) -> Any:
        value = getattr(v, field)
        if named and isinstance(value, str):
            new = self.identifier(value)
            return value if new == value else new
        if isinstance(v, PrimFunc) and field == "attrs":
            # what a primitive noted on the kernel (the stages a row kernel fused, a tensor-core
            # kernel's record and summary) names the part's tensors in its strings too
            outer, self._in_attrs = self._in_attrs, True
            try:
                return self._value(value)
            finally:
                self._in_attrs = outer
        return self._value(value)


# values that hold no name
_ATOMS = frozenset({type(None), bool, int, float})

# the string fields of IR nodes that hold a name (the others hold a kind, a scope, an intrinsic)
_NAMED_FIELDS: dict[type, tuple[str, ...]] = {
    Buffer: ("name", "tensor"),
    CheckSite: ("kernel", "tensor"),
    KernelCall: ("kernel",),
    Module: ("name",),
    PrimFunc: ("name",),
}


class StructureText:
    """A description of IR as text with every name replaced by its number in the order of first
    appearance (`#n`) and every variable's identity kept (`@n`): two pieces of IR with the same
    text are the same structure, their names paired in order (`names`). Each node is described
    by its class and all of its fields (an expression's `_fields`, a dataclass's init fields);
    strings are literal but in `named` fields ({class: field names}), which are numbered.
    UnknownNode for a value that is none of these (`node` may be extended for more)."""

    def __init__(self, named: dict[type, tuple[str, ...]]) -> None:
        self.named = named
        self.numbers: dict[str, int] = {}
        self.identities: dict[int, int] = {}
        self.memo: dict[int, str] = {}
        self.keep: list[Any] = []              # what `identities` and `memo` hold by id, kept alive

    @property
    def names(self) -> list[str]:
        return list(self.numbers)

    def name(self, name: str) -> str:
        return f"#{self.numbers.setdefault(name, len(self.numbers))}"

    def identity(self, obj: object) -> str:
        number = self.identities.get(id(obj))
        if number is None:
            number = self.identities[id(obj)] = len(self.identities)
            self.keep.append(obj)
        return f"@{number}"

    def value(self, v: Any) -> str:
        if v is None or isinstance(v, (bool, int, float, str)):
            return repr(v)
        if isinstance(v, dt.DType):
            return v.name
        if isinstance(v, tuple):
            return "(" + ",".join([self.value(x) for x in v]) + ")"
        hit = self.memo.get(id(v))
        if hit is not None:
            return hit
        text = self.node(v)
        self.memo[id(v)] = text
        self.keep.append(v)
        return text

    def node(self, v: Any) -> str:
        cls = type(v)
        if isinstance(v, Var):
            text = f"{self.identity(v)}={self.name(v.name)}:{cls.__name__}({v.dtype.name},{v.kind}"
            if isinstance(v, IterVar):
                text += f",{self.value(v.lo)},{self.value(v.extent)}"
            return text + ")"
        if isinstance(v, Expr):
            if isinstance(v, Const):
                return f"{v.value!r}:{v.dtype.name}"
            if isinstance(v, IndexCheck):
                return f"IndexCheck({self.value(v.value)},{self.value(v.extent)},{self.name(v.tensor)},{v.dim})"
            return f"{cls.__name__}({','.join([self.value(getattr(v, f)) for f in cls._fields])})"
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            named = self.named.get(cls, ())
            fields = []
            for f in dataclasses.fields(v):
                if f.init:
                    x = getattr(v, f.name)
                    fields.append(self.name(x) if f.name in named and isinstance(x, str) else self.value(x))
            return f"{cls.__name__}({','.join(fields)})"
        raise UnknownNode(f"a {cls.__name__} in IR")
