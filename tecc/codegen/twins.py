"""Kernels whose CUDA C is another kernel's up to names: compiled once, launched under both names.

A model's layers make kernels that differ only in the names of their tensors (`addmm_kernel`
and `addmm_5_kernel`: the same loops over buffers of the same shapes). NVRTC and ptxas spend
their time per kernel, so the translation unit given to NVRTC holds each such kernel once
(`distinct_source`); the others run the first one's entry function (`HostProgram` kernels carry
it as `entry`). The full source, every kernel under its own name, stays the module's CUDA C.

The emitter writes the kernels of one structure from one text (`Templates`): `kernel_structure`
describes a kernel's loop IR with its names numbered in order of first appearance (every node's
class and fields, each variable's identity; of its attributes those the emitter reads,
`EMITTED_ATTRS`). The first kernel of a structure is emitted once with each of its names
replaced by a placeholder (`tecc_twin0`, `tecc_twin1`, ...: identifiers no CUDA, device helper or
PTX word holds), and every kernel of that structure, the first included, is that text with the
placeholders replaced by its own names (a derived identifier, `tecc_twin3_acc`, through its
segments). So no identifier the emitter writes for itself (`max`, `f32` in a PTX string) can be
taken for a name; a kernel whose names the emitter would write otherwise (a C keyword or CUDA
built-in gets a `_`), or whose replacement is not one to one, is emitted from its IR.

Kernel B is A's twin when A's text, with A's names replaced by B's, is B's text exactly. A's
names are its own name, its parameters' (paired with B's by position), its local buffers'
(paired with B's in the order of their allocations: a row kernel's registers named after the
tensor inlined into it, `add_21_row`), and the identifiers it derives from them (`addmm_acc`,
`copy_A_1`: such a name as whole `_`-separated segments of the identifier); every other
identifier (CUDA's, the device helpers', loop variables named after axes) must be the same in
both. The replacement must be one to one (no two names of A become one of B), so B is A with
its kernel-local names renamed consistently, which is the same code.
"""

from __future__ import annotations

from typing import Callable, Sequence

from tecc.ir.rename import IDENTIFIER as _IDENTIFIER
from tecc.ir.rename import IRRenaming, NameClash, Renaming, StructureText, UnknownNode
from tecc.ir.stmt import Allocate, Buffer, PrimFunc, iter_stmts


def identifiers(text: str) -> list[str]:
    """The identifiers of `text`, in order (with repeats)."""
    return _IDENTIFIER.findall(text)


def twin_entries(funcs: Sequence[PrimFunc], texts: Sequence[str], prelude: str) -> dict[str, str]:
    """Kernel name -> the earlier kernel whose code it runs, for each kernel of `funcs` (emitted
    as `texts` after `prelude`) that is an earlier one's twin (module docstring)."""
    fixed = frozenset(_IDENTIFIER.findall(prelude))
    firsts: dict[str, list[int]] = {}   # a text with its identifiers blanked -> the kernels kept with it
    entries: dict[str, str] = {}
    for index, (func, text) in enumerate(zip(funcs, texts)):
        shape = _IDENTIFIER.sub("_", text)
        kept = firsts.setdefault(shape, [])
        for first in kept:
            if renames_to(funcs[first], texts[first], func, text, fixed):
                entries[func.name] = funcs[first].name
                break
        else:
            kept.append(index)
    return entries


def renames_to(a: PrimFunc, a_text: str, b: PrimFunc, b_text: str, fixed: frozenset[str] = frozenset()) -> bool:
    """Whether kernel A's text becomes B's by renaming A's own names to B's, one to one (module
    docstring). `fixed`: identifiers never renamed (the prelude's)."""
    if len(a.params) != len(b.params):
        return False
    names = {a.name: b.name}
    local_a, local_b = _local_names(a), _local_names(b)
    if len(local_a) != len(local_b):
        return False
    for x, y in [(pa.name, pb.name) for pa, pb in zip(a.params, b.params)] + list(zip(local_a, local_b)):
        if names.setdefault(x, y) != y:
            return False
    return renamed(a_text, names, fixed) == b_text


def renamed(text: str, names: dict[str, str], fixed: frozenset[str] = frozenset()) -> str | None:
    """`text` with each identifier that is a key of `names`, or holds one as whole `_`-separated
    segments (`copy_A_1` holds `A`: the longest key found), replaced by its image; `fixed`
    identifiers and those starting with `__` kept. None when two identifiers would become one."""
    try:
        return Renaming(names, fixed).text(text)
    except NameClash:
        return None


def _local_names(f: PrimFunc) -> list[str]:
    """The names of the kernel's local and shared buffers, in the order of their allocations."""
    return [s.buffer.name for s in iter_stmts(f.body) if isinstance(s, Allocate)]


def distinct_source(prelude: str, funcs: Sequence[PrimFunc], texts: Sequence[str],
                    entries: dict[str, str]) -> str:
    """The translation unit NVRTC compiles: the prelude and every kernel that is no twin."""
    return prelude + "".join("\n" + t for f, t in zip(funcs, texts) if f.name not in entries)


class Templates:
    """The kernels of one structure written from one text (module docstring). `emit`: the
    emitter of one kernel; `written(name)`: the identifier the emitter writes for an IR name
    (`A.shared` -> `A_shared`), None where it would not write that name with its characters
    alone (a keyword gets a `_`); `fixed`: identifiers never renamed (the prelude's)."""

    PLACEHOLDER = "tecc_twin"

    def __init__(self, emit: Callable[[PrimFunc], str], written: Callable[[str], str | None],
                 fixed: frozenset[str]) -> None:
        self.emit, self.written, self.fixed = emit, written, fixed
        self.texts: dict[str, str | None] = {}   # a structure -> its text with placeholders (None: not writable so)
        # a structure -> its first kernel (emitted from its IR) and that kernel's names
        self.firsts: dict[str, tuple[PrimFunc, list[str]]] = {}

    def text(self, func: PrimFunc) -> str | None:
        """The kernel's CUDA C from its structure's text, or None (emit it from its IR: the first
        of a structure, until a second one comes)."""
        try:
            key, names = kernel_structure(func)
        except UnknownNode:
            return None
        images: dict[str, str] = {}
        for n, name in enumerate(names):
            spelled = self.written(name)
            if spelled is None:
                return None
            images[f"{self.PLACEHOLDER}{n}"] = spelled
        if key not in self.texts:
            first, first_names = self.firsts.setdefault(key, (func, names))
            if first is func:
                return None
            self.texts[key] = self._template(first, first_names)
        template = self.texts[key]
        if template is None:
            return None
        return renamed(template, images, self.fixed)

    def _template(self, func: PrimFunc, names: list[str]) -> str | None:
        """The kernel's text with its names (`kernel_structure`'s, in order) replaced by
        placeholders (None: not one to one)."""
        try:
            generic = IRRenaming(Renaming({name: f"{self.PLACEHOLDER}{n}" for n, name in enumerate(names)})).kernel(func)
        except (NameClash, UnknownNode):
            return None
        return self.emit(generic)


# the kernel attributes the emitter reads (cuda.py KernelEmitter.signature); the others (a
# primitive's notes) do not change the code and are left out of `kernel_structure`
EMITTED_ATTRS = ("min_blocks_per_sm",)


def kernel_structure(func: PrimFunc) -> tuple[str, list[str]]:
    """The kernel's loop IR as text with its names numbered (ir/rename.py StructureText), and its
    names in order of first appearance: two kernels with the same text are the same code up to
    the names paired in order. UnknownNode for a value it cannot describe."""
    text = StructureText({Buffer: ("name", "tensor")})
    attrs = tuple((k, v) for k, v in func.attrs if k in EMITTED_ATTRS)
    described = f"{text.name(func.name)}({text.value(func.params)}){text.value(attrs)}\n{text.value(func.body)}"
    return described, text.names
