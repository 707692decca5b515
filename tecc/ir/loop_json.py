"""The final loop IR of a module as JSON, so a saved artifact can run in the emulator too.

`kernel.save(path)` writes `path.ir` (this JSON) next to the cubin; `tecc.load(path).sim(...)` rebuilds
the kernels from it and runs them in the SIMT emulator without the compiler.

The encoding is structural and generic: every IR node is written once into a table of objects
(later uses refer to its index, so a Buffer or loop variable used in many places is one object
again after decoding, as the emulator expects) as its class name and constructor arguments:
an expression's `_fields` (the arguments its constructor takes, as for pickling), a statement's
or buffer's dataclass fields. Decoding calls the constructors of the IR classes named in
`_CLASSES` only, which validate their arguments as always; nothing else is ever constructed,
so reading an artifact cannot run arbitrary code.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from . import dtype as dt
from . import expr as expr_module
from . import index_checks as index_checks_module
from . import expr_nodes as expr_nodes_module
from . import instructions as instructions_module
from . import layout as layout_module
from . import descriptor as descriptor_module
from . import matrix_stmt as matrix_module
from . import mbarrier_stmt as mbarrier_module
from . import philox as philox_module
from . import stmt as stmt_module
from . import stmt_nodes as stmt_nodes_module
from . import tma_stmt as tma_module
from . import warpgroup_stmt as warpgroup_module
from .errors import TeccError

FORMAT = "tecc-loop-ir"
VERSION = 1


def _ir_classes() -> dict[str, type]:
    out: dict[str, type] = {}
    for module in (expr_nodes_module, index_checks_module, stmt_nodes_module, matrix_module, layout_module,
                   descriptor_module, warpgroup_module, mbarrier_module, tma_module, philox_module):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                if issubclass(value, expr_module.Expr) or dataclasses.is_dataclass(value):
                    out[name] = value
    out["Instruction"] = instructions_module.Instruction
    return out


# Documents written before the instructions became rows of one table name them by their old
# classes, with the operands as keyword arguments: their constructors read them.
_LEGACY: dict[str, Any] = dict(instructions_module.CONSTRUCTORS)


_CLASSES = _ir_classes()


class _Encoder:
    def __init__(self) -> None:
        self.objects: list[Any] = []
        self.index: dict[int, int] = {}
        self.keep: list[Any] = []          # keeps encoded objects alive, so ids stay unique

    def value(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"float": repr(v)}
        if isinstance(v, dt.DType):
            return {"dtype": v.name}
        if isinstance(v, (tuple, list)):
            return {"tuple": [self.value(x) for x in v]}
        if isinstance(v, dict):
            return {"dict": [[self.value(k), self.value(x)] for k, x in v.items()]}
        return {"ref": self.node(v)}

    def node(self, v: Any) -> int:
        found = self.index.get(id(v))
        if found is not None:
            return found
        cls = type(v)
        if _CLASSES.get(cls.__name__) is not cls:
            raise TeccError(f"loop IR to JSON: {cls.__name__} is not an IR node this format knows")
        if isinstance(v, expr_module.Expr):
            if isinstance(v, expr_module.Var) and cls is not expr_module.Var:
                raise TeccError(f"loop IR to JSON: a {cls.__name__} ({v}) in the final loop IR")
            args: Any = [self.value(getattr(v, f)) for f in cls._fields]
        else:
            args = {f.name: self.value(getattr(v, f.name)) for f in dataclasses.fields(v) if f.init}
        slot = len(self.objects)
        self.objects.append(None)
        self.keep.append(v)
        self.objects[slot] = {"class": cls.__name__, "args": args}
        self.index[id(v)] = slot
        return slot


def module_to_json(module: stmt_module.Module) -> str:
    """The module as JSON text (see the module docstring); written once per module object (a
    build stores its final module in the build cache, and the saved artifact holds it again)."""
    text: str | None = module.__dict__.get("_loop_json")
    if text is None:
        enc = _Encoder()
        root = enc.node(module)
        text = json.dumps({"format": FORMAT, "version": VERSION, "root": root, "objects": enc.objects},
                          separators=(",", ":"))
        object.__setattr__(module, "_loop_json", text)
    return text


def module_from_json(text: str, where: str = "loop IR") -> stmt_module.Module:
    """The module `module_to_json` wrote; TeccError naming `where` when the text is not one."""
    try:
        doc = json.loads(text)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise TeccError(f"{where}: not a {FORMAT} document of version {VERSION}")
        objects: list[Any] = doc["objects"]
        built: dict[int, Any] = {}

        def value(v: Any) -> Any:
            if isinstance(v, dict):
                if "ref" in v:
                    return node(int(v["ref"]))
                if "dtype" in v:
                    return dt.as_dtype(v["dtype"])
                if "float" in v:
                    return float(v["float"])
                if "tuple" in v:
                    return tuple(value(x) for x in v["tuple"])
                if "dict" in v:
                    return {value(k): value(x) for k, x in v["dict"]}
                raise TeccError(f"{where}: unknown value {json.dumps(v)[:60]}")
            return v

        def node(i: int) -> Any:
            if i in built:
                return built[i]
            entry = objects[i]
            cls = _CLASSES.get(entry["class"]) or _LEGACY.get(entry["class"])
            if cls is None:
                raise TeccError(f"{where}: unknown node class {entry['class']!r}")
            args = entry["args"]
            obj = cls(*[value(a) for a in args]) if isinstance(args, list) else cls(**{k: value(a) for k, a in args.items()})
            built[i] = obj
            return obj

        module = node(int(doc["root"]))
    except TeccError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise TeccError(f"{where} is damaged ({type(exc).__name__}: {exc}); save the kernel again") from exc
    if not isinstance(module, stmt_module.Module):
        raise TeccError(f"{where}: the root is a {type(module).__name__}, not a Module")
    return module


__all__ = ["module_from_json", "module_to_json"]
