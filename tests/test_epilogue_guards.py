"""Where the fused tail of a tensorized GEMM checks its bounds, and how it stages its outputs,
without a GPU: each kernel in the emulator against NumPy float64 (tests/test_tensorize.py's
bound) on fresh random inputs, the output poisoned with NaN, at shapes the tiles divide and shapes
they do not; then the IR's facts.

- registers and staged epilogues: the per-element guard row < M and column < N is there exactly
  when the block tile does not divide M and N;
- the TMA-store epilogue: the TMA store clips rows and columns past M and N, so a tail that reads
  nothing but the accumulator (a plain GEMM) is staged unguarded at every shape; one that reads a
  bias keeps the guard unless the tiles divide; adjacent accumulator columns are staged by one
  4-byte shared store (a `vectorize` loop of 2), which codegen emits as one 32-bit store."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_split_k import split_run
from test_tensorize import check, contraction, run
from test_tma import needs_nvrtc
from test_tma_store import store_plan

import tecc as tc
from tecc.compiler.schedule import Schedule
from tecc.ir.stmt import BufferStore, For, IfThenElse, Stmt, iter_stmts
from tensor_core_steps import schedule_tensor_core


def stores_to(f: Any, scope: str, suffix: str = "") -> list[BufferStore]:
    return [s for s in iter_stmts(f.module.kernels[0].body)
            if isinstance(s, BufferStore) and s.buffer.scope == scope and s.buffer.name.endswith(suffix)
            and s.buffer.name != "split_arrived"]


def guarded_stores(f: Any, scope: str, suffix: str = "") -> list[Stmt]:
    """The stores to `scope` buffers (ending in `suffix`) that sit directly under an if."""
    return [s.then_case for s in iter_stmts(f.module.kernels[0].body)
            if isinstance(s, IfThenElse) and isinstance(s.then_case, BufferStore)
            and s.then_case.buffer.scope == scope and s.then_case.buffer.name.endswith(suffix)]


def bias_relu(acc: Any, bias: Any) -> Any:
    return tc.maximum(acc + bias, tc.const(0.0, "float16"))


def np_bias_relu(e: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(e + b, 0.0)


# ---- the TMA-store epilogue ---------------------------------------------------------------------------

@pytest.mark.parametrize("m,n,k,block,bias,guard", [
    (136, 72, 200, (128, 64), False, False),    # partial tiles, a plain GEMM: the TMA store clips
    (128, 128, 128, (64, 64), False, False),
    (136, 72, 200, (128, 64), True, True),      # partial tiles, a bias read at the column: guarded
    (128, 192, 128, (64, 64), True, False)])    # the tiles divide: the bias is read in range
def test_the_tma_store_epilogue_guards_only_reads_past_the_edge(m: int, n: int, k: int, block: tuple[int, int],
                                                              bias: bool, guard: bool) -> None:
    tensors, how = contraction(m, n, k, "float16", out="float16", epilogue=bias_relu if bias else None)
    f, arrays = run(tensors, how, m, n, k, seed=m + n + int(bias), plan=store_plan(block, 2))
    check(arrays, how, f"tma-store {m}x{n}x{k} bias={bias}", epilogue=np_bias_relu if bias else None)
    staged = stores_to(f, "shared", "_stage")
    assert staged and bool(guarded_stores(f, "shared", "_stage")) == guard
    # every staged store writes a pair of adjacent columns: inside a vectorize loop of 2
    pairs = [s for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, For) and s.kind == "vectorize"
             and any(isinstance(x, BufferStore) and x.buffer.name.endswith("_stage") for x in iter_stmts(s.body))]
    assert pairs and all(int(p.extent.value) == 2 for p in pairs)  # type: ignore[attr-defined]


def test_a_persistent_split_tma_store_gemm_at_1000_cubed_shape_class_matches_numpy() -> None:
    """Split-K 2 with the TMA-store epilogue on a 2-warpgroup persistent kernel, M and N no
    multiple of the tile (the 1000³ class): the summed partials staged unguarded and clipped."""
    m, n, k = 200, 136, 640
    tensors, how = contraction(m, n, k, "float16", out="float16")
    steps = dict(intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=3, producer="tma",
                 persistent=3, epilogue="tma")
    f, arrays = split_run(tensors, how, m, n, k, 2, steps, seed=5)
    check(arrays, how, f"split-K 2 TMA-store {m}x{n}x{k}")
    assert not guarded_stores(f, "shared", "_stage")


# ---- the registers and staged epilogues ------------------------------------------------------------------

@pytest.mark.parametrize("intrinsic,block,warps,k_tile,m,n", [
    ("auto", (64, 64), (2, 2), 32, 128, 192),        # mma.sync, the tiles divide
    ("auto", (64, 64), (2, 2), 32, 100, 136),        # mma.sync, partial tiles
    ("wgmma", (64, 64), (4, 1), 64, 128, 128),       # wgmma, the tiles divide
    ("wgmma", (64, 64), (4, 1), 64, 72, 136)])       # wgmma, partial tiles
def test_the_registers_epilogue_is_guarded_only_where_the_tiles_do_not_divide(
        intrinsic: str, block: tuple[int, int], warps: tuple[int, int], k_tile: int, m: int, n: int) -> None:
    k = 160
    for bias in (False, True):
        tensors, how = contraction(m, n, k, "float16", out="float16", epilogue=bias_relu if bias else None)
        sch = schedule_tensor_core(Schedule(tensors), intrinsic=intrinsic, block=block, warps=warps,
                                   k_tile=k_tile, stages=2)
        f, arrays = run(tensors, how, m, n, k, seed=m * n + int(bias), plan=sch.plan)
        check(arrays, how, f"registers {intrinsic} {m}x{n} bias={bias}", epilogue=np_bias_relu if bias else None)
        divide = m % block[0] == 0 and n % block[1] == 0
        assert stores_to(f, "global", "C")
        assert bool(guarded_stores(f, "global", "C")) == (not divide)


@pytest.mark.parametrize("m,n", [(192, 128), (200, 128)])
def test_a_persistent_registers_epilogue_over_dividing_tiles_writes_each_tile_once(m: int, n: int) -> None:
    """6 or 8 tiles of 64 x 64 over 4 persistent blocks (some run one tile more than others):
    unguarded where the tiles divide, and no block stores a tile past the last one."""
    k = 128
    tensors, how = contraction(m, n, k, "bfloat16", out="bfloat16", epilogue=bias_relu_bf16)
    sch = schedule_tensor_core(Schedule(tensors), intrinsic="wgmma", block=(64, 64), warps=(4, 1), k_tile=64,
                               stages=2, producer="tma", persistent=4)
    f, arrays = run(tensors, how, m, n, k, seed=m + 1, plan=sch.plan)
    check(arrays, how, f"persistent registers {m}x{n}", epilogue=np_bias_relu)
    assert bool(guarded_stores(f, "global", "C")) == (m % 64 != 0)


def bias_relu_bf16(acc: Any, bias: Any) -> Any:
    return tc.maximum(acc + bias, tc.const(0.0, "bfloat16"))


@pytest.mark.parametrize("m,n", [(128, 128), (130, 128)])
def test_the_staged_output_copy_is_guarded_only_where_the_tiles_do_not_divide(m: int, n: int) -> None:
    k = 96
    tensors, how = contraction(m, n, k, "float16", out="float16")
    sch = schedule_tensor_core(Schedule(tensors), intrinsic="auto", block=(64, 64), warps=(2, 2), k_tile=32,
                               stages=2, staged_output=True)
    f, arrays = run(tensors, how, m, n, k, seed=m, plan=sch.plan)
    check(arrays, how, f"staged output {m}x{n}")
    assert bool(guarded_stores(f, "global", "C")) == (m % 64 != 0)
    assert bool(guarded_stores(f, "shared", "_out")) == (m % 64 != 0)


@pytest.mark.parametrize("m,n,k", [(128, 256, 512), (200, 136, 520)])
def test_split_k_with_the_registers_epilogue_guards_only_partial_tiles(m: int, n: int, k: int) -> None:
    tensors, how = contraction(m, n, k, "float16", out="float16")
    steps = dict(intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=3, producer="tma")
    f, arrays = split_run(tensors, how, m, n, k, 3, steps, seed=k)
    check(arrays, how, f"split-K 3 registers {m}x{n}x{k}")
    assert bool(guarded_stores(f, "global", "C")) == (m % 128 != 0 or n % 128 != 0)


# ---- CUDA --------------------------------------------------------------------------------------------

@needs_nvrtc
def test_the_1000_cubed_tma_store_kernel_stages_pairs_without_branches() -> None:
    """The planner's 1000³ fp16 kernel on the H200 (64 x 128, persistent, TMA-store epilogue):
    the staging writes are 32 four-byte shared stores of two halves, with no bounds check; its
    tensor maps are prefetched at the kernel's start."""
    tensors, _ = contraction(1000, 1000, 1000, "float16", out="float16")
    plan = store_plan((64, 128), 5, 132)
    f = tc.build(tensors, target="cuda", arch="sm_90", plan=plan)
    src = f.source
    assert src.count("*reinterpret_cast<unsigned int*>(&C_stage[") == 1, src
    assert "< 1000" not in src
    # thread 0 prefetches the three tensor maps before it arms the ring's barriers
    assert src.count("prefetch.tensormap [%0]") == 3
    assert src.index("prefetch.tensormap") < src.index("mbarrier.init")
    (r,) = f.resources.values()
    assert (r.spill_stores, r.spill_loads) == (0, 0), r
