"""Repeated parts of a program planned in regions: planned once, the others renamed.

A model's graph repeats its layers, so the parts that the region search cuts out of it
(region_search.py) repeat too: layer 7's attention backward is layer 1's with other tensor
names. Planning a part is a pure function of its structure (the tensor expressions, shapes and
dtypes, not their names), and what it returns, the part's plan and scheduled module, names only
what the part's program names (its tensors, their axes, the part program's name) and identifiers
derived from those (`mm_2_kernel`, `add_21_row`, `mm_2_kernel/k_tile`). So a part of an earlier
part's structure is given that part's plan and module with the names replaced, instead of being
lowered, ranked and realized again (GPT-2 small's 12-layer backward: 157 of its 175 parts).

- `signature(part)`: the part's structure as text, every name replaced by its number in the
  order of first appearance, and the names in that order. Two parts with the same text pair
  their names one to one (the n-th name of one with the n-th of the other), and their
  structures are the same up to those names: every node's class, fields, shape, dtype and
  constant, every tensor's and variable's identity.
- `PartRenaming`: that pairing as a renaming of identifiers (ir/rename.py Renaming: a name, or a
  name held as whole `_`-separated segments of a derived identifier); `module`, `plan` and
  `kernel` rename what the earlier part's planning returned. A renaming that would make two
  identifiers one raises NameClash, and an IR node this module does not know raises
  UnknownNode: the caller then plans the part itself.

The renamed module is the earlier one's code with its names consistently replaced, which is the
same code; the planner's own planning of the part gives that module too (checked on GPT-2
small's graphs: tests/test_part_twins.py compares with TECC_PART_TWINS=0).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..ir.rename import IRRenaming, NameClash, Renaming, StructureText, UnknownNode
from ..ir.stmt import Module
from ..ir.tensor import Tensor, producers_first
from .plan import Plan, Step

__all__ = ["NameClash", "PartRenaming", "UnknownNode", "signature"]


def signature(part: Sequence[Tensor], name: str | None = None) -> tuple[str, list[str]]:
    """The structure of the part program `part` (its signature: placeholders, then outputs) as
    text with names numbered, and its names in order of first appearance (module docstring).
    `name`: the part program's own name, the first name (a per-kernel part's `..._part3`).
    UnknownNode for a value it cannot describe. (A part may reach back through every layer of a
    model: the tensors are described producers first, so that each description recurses only
    through its own operation, as regions.cut rebuilds them.)"""
    return _Describer(name).part(part)


class _Describer(StructureText):
    """StructureText of tensor expressions: a tensor is described once where first reached
    (its operation's fields, shape and dtype, its name numbered), referred to by identity after."""

    def __init__(self, name: str | None) -> None:
        super().__init__({})
        self.tensors: list[str] = []           # each tensor's definition, in the order first reached
        if name is not None:
            self.name(name)

    def part(self, part: Sequence[Tensor]) -> tuple[str, list[str]]:
        for t in producers_first(part):
            self.value(t)
        signature = " ".join(self.value(t) for t in part)
        return signature + "\n" + "\n".join(self.tensors), self.names

    def node(self, v: Any) -> str:
        if not isinstance(v, Tensor):
            return super().node(v)
        ref = self.identity(v)
        op = v.op
        if not dataclasses.is_dataclass(op):
            raise UnknownNode(f"tensor {v.name}'s operation, a {type(op).__name__}")
        fields = [self.value(getattr(op, f.name)) for f in dataclasses.fields(op) if f.name != "name"]
        self.tensors.append(f"{ref}={self.name(v.name)}:{type(op).__name__}({','.join(fields)})"
                            f"[{self.value(v.shape)}]{v.dtype.name}")
        return ref


class PartRenaming:
    """The names of a part's program paired with those of an earlier part of its structure
    (`signature`: `earlier` and `later` in order), as a renaming of the earlier part's
    identifiers (module docstring). Raises NameClash when the pairing is not one to one."""

    def __init__(self, earlier: Sequence[str], later: Sequence[str]) -> None:
        pairs = {a: b for a, b in zip(earlier, later) if a != b}
        if len(set(pairs.values())) != len(pairs) or set(pairs.values()) & (set(earlier) - set(pairs)):
            raise NameClash("two names of the earlier part would become one")
        self.identifier = Renaming(pairs)

    def kernel(self, name: str) -> str:
        return self.identifier(name)

    def text(self, text: str) -> str:
        return self.identifier.text(text)

    # -- the plan ---------------------------------------------------------------------------------

    def plan(self, plan: Plan) -> Plan:
        """The plan's steps with every name in their arguments renamed: a `kernel/loop` address
        by its identifiers, a tensor's or stage's name when it is one of the part's names (a
        strategy's own words, `tma`, `registers`, are none); its reason as text."""
        steps = tuple(Step(s.primitive, {k: self._argument(v) for k, v in s.args.items()}) for s in plan.steps)
        return Plan(steps, plan.strategy, self.text(plan.reason))

    def _argument(self, v: Any) -> Any:
        if isinstance(v, str):
            if "/" in v:
                return "/".join(self.identifier(part) if part.isidentifier() else part for part in v.split("/"))
            return self.identifier(v) if v in self.identifier.names else v
        if isinstance(v, list):
            return [self._argument(x) for x in v]
        if isinstance(v, dict):
            return {k: self._argument(x) for k, x in v.items()}
        return v

    def module(self, module: Module) -> Module:
        """The module with every name renamed (ir/rename.py IRRenaming); UnknownNode for a value
        that is no IR node."""
        return IRRenaming(self.identifier).module(module)
