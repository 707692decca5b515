"""tecc's PyTorch layer (the top floor, beside cli.py): torch is imported here and only here.

- `ops`: tecc kernels as torch custom ops (`tc.torch.op`, `tc.torch.function`; docs/pytorch.md).
- `backend`: `torch.compile(model, backend="tecc")` (docs/models.md): AOTAutograd's ATen graphs
  lowered to tensor expressions (`lowering/`), planned as programs (`graph.py`), run from one
  launch list (`launch.py`, `runtime.py`), reported and dumped (`report.py`).

`import tecc` never imports this package; `tc.torch` does, on first use.
"""

from .ops import TorchOp, function, op, torch_dtype

__all__ = ["TorchOp", "function", "op", "torch_dtype"]
