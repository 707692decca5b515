"""The TMA rung on a real sm_90 GPU (skipped elsewhere): the warp-specialized wgmma kernel
(tensorize(..., producer="tma")) against torch in float64 under tests/test_tensorize_gpu.py's
bound ((K + 1)·2⁻²³·Σ|a·b|, plus one rounding of a 16-bit output); outputs start as NaN, inputs
are fresh random values. Covers the tensor-map encoding (cuTensorMapEncodeTiled) and the
by-value launch (cuLaunchKernel) that only a GPU can run, and a saved artifact reloaded by the
runtime alone for new symbolic M, and the staged epilogue (shared staging tile + TMA stores, in
the plain and the persistent grid). Time it with
`python benchmarks/gemm.py --dtype float16 --skip-shapes --sweep --sweep-strategy gemm_wgmma --load tma`
or one row per rung with `python benchmarks/gemm.py --dtype float16 --skip-shapes --ladder --sweep-size 4096`."""

from __future__ import annotations

from typing import Any

import pytest
from test_tensorize_gpu import _run

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU")]


def tma_plan(block: tuple[int, int], stages: int) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "wgmma", "block": list(block),
                                            "warps": [4 * block[0] // 64, 1], "k_tile": 64, "stages": stages,
                                            "producer": "tma"}}]}


def test_one_tensor_map_encodes_on_the_device() -> None:
    """The isolated driver call: a 128-byte map for a 1000 x 4096 half matrix."""
    from tecc.runtime.tensor_map import TensorMapSpec, encode_arguments, encode_tensor_map
    from tecc.ir import dtype as dt

    a = torch.empty((1000, 4096), device="cuda", dtype=torch.float16)
    spec = TensorMapSpec("A", dt.float16, (128, 64), "128B")
    encoded = encode_tensor_map(encode_arguments(spec, a.data_ptr(), tuple(a.shape), tuple(a.stride())))
    assert len(encoded.data) == 128 and any(encoded.data)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,block,stages", [(1000, 1000, 1000, (128, 128), 4), (4096, 4096, 4096, (128, 256), 4)])
def test_tma_gemm_on_gpu(m: int, n: int, k: int, block: tuple[int, int], stages: int, dtype: str) -> None:
    f = _run(m, n, k, dtype, plan=tma_plan(block, stages))
    assert f.arch == "sm_90a"
    assert all(k.tensor_maps for k in f.host.kernels)


@pytest.mark.parametrize("a_t,b_t", [(True, False), (False, True), (True, True)])
def test_tma_gemm_transposed_operands_on_gpu(a_t: bool, b_t: bool) -> None:
    _run(1000, 1000, 1000, "float16", a_t=a_t, b_t=b_t, plan=tma_plan((128, 128), 4))


@pytest.mark.parametrize("block,stages", [((64, 64), 2), ((64, 256), 4), ((128, 64), 5), ((128, 256), 3)])
def test_tma_points_batched_and_fused(block: tuple[int, int], stages: int) -> None:
    _run(512, 512, 512, "bfloat16", batch=8, plan=tma_plan(block, stages))
    _run(1024, 1024, 1000, "float16", out="float16", relu_bias=True, plan=tma_plan(block, stages))


def test_tma_gemm_symbolic_m_through_a_saved_artifact(tmp_path: Any) -> None:
    """Built once with M symbolic, saved, reloaded by the runtime alone: each call encodes the
    tensor maps for its own M (the manifest records what the maps need)."""
    from tecc.runtime.artifact import load

    f = _run(77, 512, 256, "float16", symbolic=True, plan=tma_plan((128, 128), 4))
    f.save(tmp_path / "tma_gemm")
    kernel = load(tmp_path / "tma_gemm")
    assert kernel.host.kernels[0].tensor_maps
    for m in (1000, 4096, 77):
        g = torch.Generator(device="cuda").manual_seed(m)
        a = torch.randn((m, 256), device="cuda", generator=g).half()
        b = torch.randn((256, 512), device="cuda", generator=g).half()
        c = torch.full((m, 512), float("nan"), device="cuda", dtype=torch.float32)
        kernel(a, b, c)
        torch.cuda.synchronize()
        exact = a.double() @ b.double()
        bound = 257 * 2.0**-23 * (a.double().abs() @ b.double().abs()) + 2.0**-24 * exact.abs()
        err = (c.double() - exact).abs() - bound
        assert not torch.isnan(c).any() and (err <= 0).all(), (m, float(err.max()))


def persistent_plan(block: tuple[int, int], stages: int, blocks: int) -> dict[str, Any]:
    plan = tma_plan(block, stages)
    plan["steps"][0]["args"]["persistent"] = blocks
    return plan


@pytest.mark.parametrize("m,n,k", [(1000, 1000, 1000), (4096, 4096, 4096)])
def test_a_persistent_tma_gemm_on_gpu(m: int, n: int, k: int) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _run(m, n, k, "float16", out="float16", plan=persistent_plan((128, 256), 4, sms))
    _run(m, n, k, "bfloat16", batch=2, plan=persistent_plan((128, 128), 4, sms))


# ---- the staged epilogue: a shared staging tile written out by TMA stores ----------------------------

def store_plan(block: tuple[int, int], stages: int, blocks: int = 0) -> dict[str, Any]:
    plan = persistent_plan(block, stages, blocks) if blocks else tma_plan(block, stages)
    plan["steps"][0]["args"]["epilogue"] = "tma"
    return plan


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,n,k,persistent", [(1000, 1000, 1000, False), (4096, 4096, 4096, False),
                                              (4096, 4096, 4096, True), (8192, 8192, 8192, True)])
def test_a_tma_store_epilogue_on_gpu(m: int, n: int, k: int, persistent: bool, dtype: str) -> None:
    """The output's tensor map encoded at launch, the staging tile's boxes clipped at M and N by
    the TMA unit (1000 = 7 row tiles and 3 column tiles of 128 x 256 + a partial one)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    f = _run(m, n, k, dtype, out=dtype, plan=store_plan((128, 256), 3, sms if persistent else 0))
    assert [s.name for s in f.host.kernels[0].tensor_maps] == ["A_tmap", "B_tmap", "C_tmap"]


@pytest.mark.parametrize("a_t,b_t", [(True, False), (False, True), (True, True)])
def test_a_tma_store_epilogue_with_transposed_operands_on_gpu(a_t: bool, b_t: bool) -> None:
    _run(1000, 1000, 1000, "float16", out="float16", a_t=a_t, b_t=b_t, plan=store_plan((128, 128), 4, 132))


def test_a_tma_store_epilogue_batched_fused_symbolic_and_float32_on_gpu() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    _run(512, 512, 512, "bfloat16", batch=8, out="bfloat16", plan=store_plan((128, 128), 4, sms))
    _run(1024, 1024, 1000, "float16", out="float16", relu_bias=True, plan=store_plan((128, 256), 3, sms))
    _run(1000, 1024, 1000, "float16", out="float16", relu_bias=True, plan=store_plan((64, 256), 3))
    _run(77, 512, 256, "float16", symbolic=True, plan=store_plan((128, 128), 3, sms))    # float32 output
    _run(4096, 4096, 4096, "float16", symbolic=True, plan=store_plan((64, 128), 4, sms))


def test_the_planner_takes_the_staged_persistent_rung_at_4096_on_gpu() -> None:
    """The planner's own choice at 4096^3 (the cost model ranks the TMA-store epilogue on the
    persistent grid first on sm_90), built, run and checked."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    f = _run(4096, 4096, 4096, "float16", out="float16")
    steps = {s.primitive: s.args for s in f.plan.steps}
    assert f.plan.strategy == "gemm_wgmma", f.plan.reason
    assert "warp_specialize" in steps, f.plan
    assert (steps["pipeline"]["producer"], steps["epilogue"]["kind"], steps["persistent"]["blocks"]) == ("tma", "tma", sms)


@pytest.mark.parametrize("m,n,k,block,persistent,relu_bias", [
    (1000, 1001, 768, (128, 256), True, False),    # rows of 1001 halves: odd, no tensor map for C
    (8192, 50257, 768, (128, 256), True, False),   # transformers' GPT-2 head
    (777, 300, 200, (64, 128), False, True)])      # 600-byte rows, a fused bias + relu, one block per tile
def test_an_output_with_unaligned_rows_through_the_threads_epilogue_on_gpu(
        m: int, n: int, k: int, block: tuple[int, int], persistent: bool, relu_bias: bool) -> None:
    """Epilogue "threads": the staging tile copied out by the consumer threads' guarded element
    stores, for outputs TMA cannot store (B stored [n][k] so that TMA loads it)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = store_plan(block, 3, sms if persistent else 0)
    plan["steps"][0]["args"]["epilogue"] = "threads"
    f = _run(m, n, k, "bfloat16", out="bfloat16", b_t=True, relu_bias=relu_bias, plan=plan)
    assert [s.name for s in f.host.kernels[0].tensor_maps] == ["A_tmap", "B_tmap"]
    assert "the threads' stores" in f.module.kernels[0].attr("tensorize")
