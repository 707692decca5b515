"""The cheap GELUs and the fused gelu(X·Wᵀ + b) on a real sm_90 GPU (skipped elsewhere), against
float64: the device helpers (ex2.approx / rcp.approx, which the emulator computes correctly
rounded) within tests/test_gelu_epilogue.py's bounds, and the fused GEMMs at the issue's two
shapes planned as `tc.build` plans them, outputs poisoned with NaN, fresh random inputs. Time them
with `python benchmarks/epilogue.py --quick`."""

from __future__ import annotations

import numpy as np
import pytest
from test_gelu_epilogue import UNIT_ROUNDOFF, check_fused, gelu64, gelu_expr, linear

import tecc as tc

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU")]
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_the_device_helpers_round_to_the_correct_16_bit_gelu_or_its_neighbour(form: str, dtype: str) -> None:
    """Every float32 step of 2^-12 in [-6, 8]: y = dtype(gelu(x)) elementwise, the cheap call."""
    n = 14 * 4096
    X = tc.placeholder((n,), "float32", name="X")
    Y = tc.compute((n,), lambda i: tc.cast(gelu_expr(X[i], form), dtype), name="Y")
    f = tc.build([X, Y], target="cuda")
    assert f"tecc_gelu_{form}_approx(" in f.source
    x = torch.arange(n, device="cuda", dtype=torch.float64).mul(2.0 ** -12).sub(6.0).float()
    y = torch.full((n,), float("nan"), device="cuda", dtype=TORCH[dtype])
    f(x, y)
    got = y.cpu().float().numpy().astype(np.float64)
    want = gelu64(x.cpu().numpy(), form)
    rounded = torch.from_numpy(want).to(TORCH[dtype]).float().numpy().astype(np.float64)
    # one 16-bit ulp at most: the bound (2^-17 relative) is 1/16 of half an ulp
    ulp = np.abs(want) * 2 * UNIT_ROUNDOFF[dtype] + 2.0 ** -24
    off = np.abs(got - rounded)
    i = int(np.argmax(off - ulp))
    assert off[i] <= ulp[i], f"x = {x[i].item()!r}: got {got[i]!r}, correctly rounded {rounded[i]!r}"
    assert (got == rounded).mean() > 0.99


@pytest.mark.parametrize("m,n,k,dtype", [(8192, 3072, 768, "float16"), (4096, 11008, 4096, "bfloat16")])
@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_the_fused_gelu_gemm_matches_float64_at_the_issue_shapes(m: int, n: int, k: int, dtype: str,
                                                                  form: str) -> None:
    f = tc.build(linear(m, n, k, dtype, form), target="cuda")
    g = torch.Generator(device="cuda").manual_seed(m + k)
    tdt = TORCH[dtype]
    a = (torch.randn(m, k, device="cuda", generator=g) * k ** -0.25).to(tdt)
    b = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.25).to(tdt)
    bias = (torch.rand(n, device="cuda", generator=g) * 6 - 3).to(tdt)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=tdt)
    f(a, b, bias, out)
    torch.cuda.synchronize()
    # the reference on the host in float64, for the first 128 rows (the whole product is large)
    rows = slice(0, 128)
    check_fused(a[rows].float().cpu().numpy(), b.float().cpu().numpy(), bias.float().cpu().numpy(),
                out[rows].float().cpu().numpy(), form, dtype, f"GPU fused gelu ({form}) {dtype} {m}x{n}x{k}")
    assert not torch.isnan(out).any().item()
