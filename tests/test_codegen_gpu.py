"""The emitted kernels compute the right values on a real GPU (skipped without one).

Each kernel of tests/test_codegen.py is compiled for the live device, launched through cuda.core
with PyTorch tensors as memory, and compared with NumPy/PyTorch: exactly for integer kernels
(floor division), to float32 rounding for float kernels, and to one half-precision ulp for the
float16/bfloat16 kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tecc.codegen import compile_cuda, default_arch, emit_source
from tecc.ir.evaluate import evaluate_int
from tecc.ir.stmt import PrimFunc, launch_dims

from test_codegen import (elementwise, floor_div_mod, half_math, padded_shift, row_sum, tiled_matmul, warp_sum,
                          wide_sizes)

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def run(func: PrimFunc, *args: Any, sizes: dict[str, int] | None = None) -> None:
    """Compile `func` for this GPU and launch it once on `args` (tensors and Python ints, in
    the order of func.params); the grid comes from launch_dims with `sizes` bound."""
    from cuda.core import Device, LaunchConfig, ObjectCode, launch

    compiled = compile_cuda(emit_source([func]), arch=default_arch(), name=func.name)
    device = Device()
    device.set_current()
    kernel = ObjectCode.from_cubin(compiled.cubin).get_kernel(func.name)
    env = {p: (sizes or {})[p.name] for p in func.params if not hasattr(p, "shape")}
    dims = launch_dims(func)
    grid = tuple(evaluate_int(g, env) for g in dims.grid)
    c_args = []
    for p, a in zip(func.params, args):
        if isinstance(a, torch.Tensor):
            c_args.append(a.data_ptr())  # cuda.core passes a Python int as a pointer
        else:
            c_args.append(np.int64(a) if p.dtype.bits == 64 else np.int32(a))
    torch.cuda.synchronize()
    stream = device.create_stream()
    launch(stream, LaunchConfig(grid=grid, block=dims.block), kernel, *c_args)
    stream.sync()


def test_elementwise_on_gpu() -> None:
    n = 1000
    a = torch.randn(n, device="cuda")
    b = torch.zeros(n, device="cuda")
    run(elementwise(), a, b, n, sizes={"N": n})
    torch.testing.assert_close(b, a * 2 + torch.exp(a), rtol=1e-6, atol=1e-6)


def test_row_sum_on_gpu() -> None:
    m, k = 300, 77
    a = torch.randn(m, k, device="cuda")
    out = torch.zeros(m, device="cuda")
    run(row_sum(), a, out, m, k, sizes={"M": m, "K": k})
    torch.testing.assert_close(out, a[:, 1:].sum(dim=1), rtol=1e-5, atol=1e-5)


def test_tiled_matmul_on_gpu() -> None:
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    c = torch.zeros(1024, 1024, device="cuda")
    run(tiled_matmul(), a, b, c)
    expected = (a.double() @ b.double()).float()
    torch.testing.assert_close(c, expected, rtol=1e-4, atol=1e-3)


def test_floor_div_mod_on_gpu_matches_python() -> None:
    n, d = 1000, -3
    out = torch.zeros(n, 4, dtype=torch.int32, device="cuda")
    run(floor_div_mod(), out, n, d, sizes={"N": n, "d": d})
    i = np.arange(n)
    expected = np.stack([(i - 8) // 4 + (i - 8) % 4, (i - 8) // d + (i - 8) % d, i // 4 + (i % 256) % 32,
                         i // n], axis=1)
    np.testing.assert_array_equal(out.cpu().numpy(), expected)


def test_half_math_on_gpu_rounds_like_numpy() -> None:
    import ml_dtypes

    n = 4096
    x = (torch.randn(n, device="cuda") * 3).half()
    z = torch.rand(n, device="cuda").bfloat16()
    y, w = torch.zeros_like(x), torch.zeros_like(z)
    run(half_math(), x, z, y, w, n, sizes={"N": n})
    f16, bf16 = np.float16, ml_dtypes.bfloat16
    xh = x.cpu().numpy()
    zb = z.float().cpu().numpy().astype(bf16)
    sig = (1 / (1 + np.exp(-xh.astype(np.float32)))).astype(f16)
    y_ref = np.maximum(((sig.astype(np.float32) * xh).astype(f16).astype(np.float32) + 1.5).astype(f16),
                       (np.arange(n) % 7).astype(f16))
    t = np.tanh(zb.astype(np.float32)).astype(bf16).astype(np.float32)
    prod = (t * xh.astype(np.float32).astype(bf16).astype(np.float32)).astype(bf16).astype(np.float32)
    w_ref = (prod + np.sqrt(zb.astype(np.float32)).astype(bf16).astype(np.float32)).astype(bf16)
    np.testing.assert_allclose(y.float().cpu().numpy(), y_ref.astype(np.float32), rtol=2e-3)
    np.testing.assert_allclose(w.float().cpu().numpy(), w_ref.astype(np.float32), rtol=1.6e-2)


def test_warp_shuffles_on_gpu() -> None:
    a = torch.randn(1024, device="cuda")
    h = torch.randn(1024, device="cuda").half()
    s, hb = torch.zeros(32, device="cuda"), torch.zeros_like(h)
    run(warp_sum(), a, h, s, hb)
    torch.testing.assert_close(s, a.view(32, 32).sum(dim=1), rtol=1e-5, atol=1e-5)
    assert torch.equal(hb.view(32, 32), h.view(32, 32)[:, :1].expand(32, 32))


def test_padded_shift_and_vector_copy_on_gpu() -> None:
    n = 1000
    a = torch.randn(n, device="cuda")
    b = torch.full((n + 1,), 7.0, device="cuda")
    c, d = torch.randn(512, device="cuda"), torch.zeros(512, device="cuda")
    run(padded_shift(), a, b, c, d, n, sizes={"N": n})
    assert b[0].item() == 0.0 and torch.equal(b[1:], a)
    torch.testing.assert_close(d, c * 0.5 + c[0])


def test_64bit_offsets_on_gpu() -> None:
    dynamic, static = wide_sizes()
    m, n = 3, 5
    a = torch.randn(m, n, device="cuda")
    b = torch.zeros(m, n, device="cuda")
    run(dynamic, a, b, m, n, sizes={"M": m, "N": n})
    torch.testing.assert_close(b, a + 1)
    free, _ = torch.cuda.mem_get_info()
    if free < 20 * 2**30:
        pytest.skip("needs 17 GiB free for the 2^32-element buffer")
    big = torch.ones(65536, 65536, device="cuda")
    run(static, big)
    # The last row starts at element 65535 * 65536 > 2^31: a 32-bit offset would have wrapped.
    assert torch.count_nonzero(big[:, :256]).item() == 0
    assert big[65535, 256].item() == 1.0
    del big
