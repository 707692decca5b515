"""How `str(node)` reaches the printer: a table of print rules, keyed by node class.

The IR's node classes (expressions, statements, kernels, modules) do not import the printer,
which needs every one of them; each class's `__str__` asks this table instead, and
`tecc.ir.printer` fills it when it is imported (`tecc/ir/__init__.py` imports it, so any use of
tecc.ir has it). A rule is looked up along the node's class hierarchy, so one rule for `Stmt`
prints every statement.
"""

from __future__ import annotations

from typing import Any, Callable

from .errors import TeccError

PrintRule = Callable[[Any], str]

_RULES: dict[type, PrintRule] = {}


def register(cls: type, rule: PrintRule) -> None:
    """Print instances of `cls` (and of its subclasses without a rule of their own) with `rule`."""
    _RULES[cls] = rule


def to_text(node: object) -> str:
    """The printed text of an IR node, by the rule registered for its class."""
    for klass in type(node).__mro__:
        rule = _RULES.get(klass)
        if rule is not None:
            return rule(node)
    raise TeccError(f"no print rule for {type(node).__name__}; tecc.ir.printer registers them when tecc.ir "
                    "is imported")
