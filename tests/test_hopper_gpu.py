"""The Hopper kernels on a real sm_90 GPU (compiled for sm_90a), compared with NumPy float64
under the same bound as the emulator tests: this pins the wgmma accumulator map, the
descriptor layouts and swizzles, and the mbarrier / bulk-copy protocol against the hardware
(skipped without an sm_90 GPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hopper_kernels import wgmma_kernel
from test_hopper_sim import CASES, HALF

from tecc.codegen import compile_cuda, emit_source
from tecc.codegen.nvrtc import default_arch
from tecc.ir.stmt import PrimFunc

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU")]


def _to_device(a: np.ndarray) -> Any:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(a.copy()).cuda()


def _launch(func: PrimFunc, tensors: list[Any], threads: int = 128) -> None:
    from cuda.core import Device, LaunchConfig, ObjectCode, launch

    compiled = compile_cuda(emit_source([func]), arch=default_arch() + "a", name=func.name)  # wgmma: sm_90a
    device = Device()
    device.set_current()
    kernel = ObjectCode.from_cubin(compiled.cubin).get_kernel(func.name)
    torch.cuda.synchronize()
    stream = device.create_stream()
    launch(stream, LaunchConfig(grid=(1, 1, 1), block=(threads, 1, 1)), kernel, *[t.data_ptr() for t in tensors])
    stream.sync()


def test_two_warpgroups_on_gpu() -> None:
    func = wgmma_kernel(64, "bf16", "128B", "128B", "K", k_steps=2, warpgroups=2)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((128, 32)).astype(HALF["bf16"])
    b_kn = rng.standard_normal((32, 64)).astype(HALF["bf16"])
    d = torch.full((128, 64), float("nan"), device="cuda")
    _launch(func, [_to_device(a), _to_device(np.ascontiguousarray(b_kn.T)), d], 256)
    want = a.astype(np.float64) @ b_kn.astype(np.float64)
    bound = 33 * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b_kn.astype(np.float64)))
    assert (np.abs(d.cpu().numpy() - want) <= bound).all(), func.name


@pytest.mark.parametrize("n,ab,a_swizzle,b_swizzle,b_major,k_steps", CASES)
def test_one_warpgroup_wgmma_on_gpu(n: int, ab: str, a_swizzle: str, b_swizzle: str, b_major: str,
                                    k_steps: int) -> None:
    func = wgmma_kernel(n, ab, a_swizzle, b_swizzle, b_major, k_steps=k_steps)
    k = 16 * k_steps
    rng = np.random.default_rng(3)
    a = rng.standard_normal((64, k)).astype(HALF[ab])
    b_kn = rng.standard_normal((k, n)).astype(HALF[ab])
    b = np.ascontiguousarray(b_kn.T) if b_major == "K" else b_kn
    d = torch.full((64, n), float("nan"), device="cuda")
    _launch(func, [_to_device(a), _to_device(b), d])
    got = d.cpu().numpy()
    want = a.astype(np.float64) @ b_kn.astype(np.float64)
    bound = (k + 1) * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(b_kn.astype(np.float64)))
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"{func.name}: D{worst} = {got[worst]}, want {want[worst]} (bound {bound[worst]})"
