"""Comparisons the GPU tests share (a helper module: importing it skips nothing)."""

from __future__ import annotations

from typing import Any


def check_on_gpu(c: Any, want: Any, bound: Any, what: str) -> None:
    """Every element of the device result `c` within `bound` of the float64 `want` (a NaN left
    from the poisoning is off by infinity); the error names the worst element."""
    import torch

    got = c.double()
    err = torch.where(torch.isnan(got), torch.full_like(got, float("inf")), (got - want).abs() - bound)
    bad = int((err > 0).sum())
    if bad:
        i = tuple(int(x) for x in torch.unravel_index(torch.argmax(err), err.shape))
        raise AssertionError(f"{what}: {bad} of {err.numel()} elements off; worst at {i}: got {got[i]}, "
                             f"want {want[i]} (bound {bound[i]:.3g})")
