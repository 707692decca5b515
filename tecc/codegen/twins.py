"""Kernels whose CUDA C is another kernel's up to names: compiled once, launched under both names.

A model's layers make kernels that differ only in the names of their tensors (`addmm_kernel`
and `addmm_5_kernel`: the same loops over buffers of the same shapes). NVRTC and ptxas spend
their time per kernel, so the translation unit given to NVRTC holds each such kernel once
(`distinct_source`); the others run the first one's entry function (`HostProgram` kernels carry
it as `entry`). The full source, every kernel under its own name, stays the module's CUDA C.

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

import re
from typing import Sequence

from tecc.ir.stmt import Allocate, PrimFunc, iter_stmts

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Differs(Exception):
    pass


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
    prefixes = sorted(names, key=len, reverse=True)
    image: dict[str, str] = {}   # a new identifier -> the identifier of `text` it replaces
    done: dict[str, str] = {}    # an identifier of `text` -> its image (an identifier recurs many times)

    def rename(match: re.Match[str]) -> str:
        t = match.group(0)
        u = done.get(t)
        if u is not None:
            return u
        u = t
        if t in fixed or t.startswith("__"):
            pass
        elif t in names:
            u = names[t]
        else:
            for p in prefixes:
                at = _segment(t, p)
                if at >= 0:
                    u = t[:at] + names[p] + t[at + len(p):]
                    break
        if image.setdefault(u, t) != t:
            raise _Differs
        done[t] = u
        return u

    try:
        return _IDENTIFIER.sub(rename, text)
    except _Differs:
        return None


def _local_names(f: PrimFunc) -> list[str]:
    """The names of the kernel's local and shared buffers, in the order of their allocations."""
    return [s.buffer.name for s in iter_stmts(f.body) if isinstance(s, Allocate)]


def _segment(t: str, p: str) -> int:
    """Where `p` is whole `_`-separated segments of identifier `t` (`copy_A_1` holds `A`), or -1."""
    at = t.find(p)
    while at >= 0:
        end = at + len(p)
        if (at == 0 or t[at - 1] == "_") and (end == len(t) or t[end] == "_"):
            return at
        at = t.find(p, at + 1)
    return -1


def distinct_source(prelude: str, funcs: Sequence[PrimFunc], texts: Sequence[str],
                    entries: dict[str, str]) -> str:
    """The translation unit NVRTC compiles: the prelude and every kernel that is no twin."""
    return prelude + "".join("\n" + t for f, t in zip(funcs, texts) if f.name not in entries)
