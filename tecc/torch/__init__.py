"""tecc's PyTorch layer (the top floor, beside cli.py): torch is imported here and only here.

- `ops`: tecc kernels as torch custom ops (`tc.torch.op`, `tc.torch.function`; docs/pytorch.md).
- `backend`: `torch.compile(model, backend="tecc")` (docs/models.md): AOTAutograd's ATen graphs
  lowered to tensor expressions (`lowering/`), planned as programs (`graph.py`), run from one
  launch list (`launch.py`, `runtime.py`), reported and dumped (`report.py`).

`import tecc` never imports this package; `tc.torch` does, on first use. The names of `ops` are
imported on first use too (they import the compiler): the dynamo backend, the entry point
`tecc.torch.backend`, loads a graph compiled before from the disk cache without the compiler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ops import TorchOp, function, op, torch_dtype

__all__ = ["TorchOp", "function", "op", "torch_dtype"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".ops", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
