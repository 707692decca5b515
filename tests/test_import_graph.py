"""tecc's modules import each other without a circle.

The graph is read from the source (every `import` and `from ... import`, at module level or inside
a function, since a lazy import ties two modules as tightly as an eager one), one node per
module; `from package import name` points at the submodule `package.name` when there is one, else
at the package (`from . import __path__`, the package's own identity, is no arrow). A circle
means two modules cannot be understood, tested or loaded one without the other, and that the
layering of DESIGN.md has a hole; the ir level used to have one (nodes importing their printer),
which printing.py's table of print rules replaced.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tecc"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module a relative import names (level dots from `module`)."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def import_graph() -> nx.DiGraph:
    """tecc's modules and who imports whom (edges importer -> imported)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                # `from . import __path__` reads the package's identity, not its contents: no arrow
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                           if not a.name.startswith("__")]
            for target in targets:
                if target in files and target != name:
                    graph.add_edge(name, target)
    return graph


def test_the_graph_sees_the_imports_it_should() -> None:
    graph = import_graph()
    # a few arrows that exist, so an empty or broken graph cannot pass the test below
    assert graph.has_edge("tecc.ir.stmt", "tecc.ir.stmt_nodes")
    assert graph.has_edge("tecc.ir.printer", "tecc.ir.stmt")
    assert graph.has_edge("tecc.codegen.cuda", "tecc.ir.stmt")
    assert graph.has_edge("tecc.ir", "tecc.ir.printer")
    assert graph.number_of_nodes() > 100


def test_no_import_circle_among_teccs_modules() -> None:
    graph = import_graph()
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    assert not circles, "import circles among tecc's modules:\n" + "\n".join(
        f"  {' <-> '.join(c)}: e.g. {' -> '.join(nx.find_cycle(graph.subgraph(c))[0])}" for c in circles)
