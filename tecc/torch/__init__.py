"""tecc's PyTorch layer (the top floor, beside cli.py): torch is imported here and only here.

- `ops`: tecc kernels as torch custom ops (`tc.torch.op`, `tc.torch.function`; docs/pytorch.md).

`import tecc` never imports this package; `tc.torch` does, on first use.
"""

from .ops import TorchOp, function, op, torch_dtype

__all__ = ["TorchOp", "function", "op", "torch_dtype"]
