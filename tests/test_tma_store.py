"""The TMA ring's epilogue through shared memory (tensorize(..., producer="tma", epilogue="tma")),
without a GPU: the IR's checks of TMA stores, bulk groups and named barriers; whole GEMMs in the
emulator against NumPy float64 under tests/test_tensorize.py's bound (four orientations, both
half dtypes, sizes no multiple of any tile -- the TMA store clips the edges --, batched with a
fused bias + relu, symbolic M, float32 output, persistent grids whose tiles are no multiple of
the grid, so that the store of one tile drains while the next is computed); the races the
emulator must report when a fence, barrier or wait of the protocol is missing; the strategy's
new dimensions and prices; and the CUDA and ptxas facts of the 4096³ and 8192³ kernels."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from protocol_edits import Edit
from test_tensorize import check, contraction, run
from test_tma import needs_nvrtc, tma_plan

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.pipeline import wgmma_serialized
from tecc.compiler.planner import candidates_for
from tecc.compiler.strategies.gemm_wgmma import shared_bytes, thread_store_refusal_for, tma_store_refusal_for
from tecc.ir import dtype as dt
from tecc.ir.errors import DivergenceError, RaceError, ScheduleError
from tecc.ir.intrinsics import IntrinsicError
from tecc.ir.stmt import (
    AsyncProxyFence,
    BarrierRef,
    Buffer,
    BufferStore,
    BulkWait,
    IfThenElse,
    NamedBarrier,
    PrimFunc,
    Stmt,
    TensorCopy,
    TensorMap,
    TensorStore,
    iter_stmts,
)
from tecc.ir.tma_stmt import swizzle_layout
from tecc.passes.lower import lower
from tecc.runtime.host import HostProgram
from tecc.runtime.sim import simulate_kernel
from tensor_core_steps import tensorized

H200 = tc.target("sm_90").replace(name="H200", dram_bandwidth=4.8e12)


def store_plan(block: tuple[int, int], stages: int, persistent: int = 0) -> dict[str, Any]:
    plan = tma_plan(block, stages)
    plan["steps"][0]["args"]["epilogue"] = "tma"
    if persistent:
        plan["steps"][0]["args"]["persistent"] = persistent
    return plan


def stores_of(f: Any) -> list[Stmt]:
    return [s for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, TensorStore)]


def global_output_stores(f: Any) -> list[Stmt]:
    return [s for s in iter_stmts(f.module.kernels[0].body)
            if isinstance(s, BufferStore) and s.buffer.scope == "global"]


# ---- the IR -----------------------------------------------------------------------------------------

def test_a_tma_copy_and_a_tma_store_say_which_end_of_the_box_transfer_is_wrong() -> None:
    """TensorCopy and TensorStore check their shared end alike (TensorMap.check_transfer); each
    message names the direction: the copy's shared end is its destination, the store's its source."""
    cmap = TensorMap(Buffer("C", dt.float16, (100, 200)), (64, 64), "128B")
    bar = BarrierRef(Buffer("bar", dt.int64, (1,), "shared"), 0)
    tile = Buffer("C_s", dt.float16, (64, 64), "shared", layout=swizzle_layout("128B", 2))
    wide = Buffer("W_s", dt.float32, (64, 32), "shared", layout=swizzle_layout("128B", 4))
    local = Buffer("r", dt.float16, (64, 64), "local")
    plain = Buffer("P_s", dt.float16, (64, 64), "shared")
    transfers: list[tuple[Callable[..., Any], str, str]] = [
        (lambda b, i, c: TensorCopy(b, i, cmap, c, bar), "TMA copy C -> {}", "copies into"),
        (lambda b, i, c: TensorStore(b, i, cmap, c), "TMA store {} -> C", "stores from")]
    for make, where, verb in transfers:
        copy = verb == "copies into"
        cases: list[tuple[Buffer, tuple[int, ...], tuple[int, ...], type[Exception], str]] = [
            (local, (0, 0), (0, 0), IntrinsicError, f"{verb} shared memory, not local"),
            (wide, (0, 0), (0, 0), tc.DTypeError,
             "source is float16, destination float32" if copy else "source is float32, destination float16"),
            (tile, (0,), (0, 0), IntrinsicError, "1 indices for the 2 dimensions of C_s"),
            (tile, (0, 0), (0,), IntrinsicError, "1 coordinates for the 2-dimensional tensor"),
            (plain, (0, 0), (0, 0), IntrinsicError,
             f"the {'destination' if copy else 'source'}'s layout .* is not the 128B swizzle's"),
        ]
        for buf, indices, coords, error, message in cases:
            with pytest.raises(error, match=f"^{where.format(buf.name)}: {message}"):
                make(buf, indices, coords)
        make(tile, (0, 0), (0, 64))  # the well-formed transfer is accepted


def test_tma_stores_bulk_waits_and_named_barriers_check_their_operands() -> None:
    out = Buffer("C", dt.float16, (100, 200))
    layout = swizzle_layout("128B", 2)
    staging = Buffer("C_stage", dt.float16, (2, 64, 64), "shared", layout=layout)
    cmap = TensorMap(out, (64, 64), "128B")
    TensorStore(staging, (0, 0, 0), cmap, (0, 64))
    with pytest.raises(IntrinsicError, match="layout"):
        TensorStore(Buffer("plain", dt.float16, (64, 64), "shared"), (0, 0), cmap, (0, 0))
    with pytest.raises(tc.DTypeError):
        TensorStore(Buffer("f", dt.float32, (64, 32), "shared", layout=swizzle_layout("128B", 4)), (0, 0),
                    cmap, (0, 0))
    with pytest.raises(IntrinsicError, match="coordinates"):
        TensorStore(staging, (0, 0, 0), cmap, (0,))
    with pytest.raises(IntrinsicError, match="pending"):
        BulkWait(8)
    with pytest.raises(ScheduleError, match="1..15"):
        NamedBarrier(0, 128)
    with pytest.raises(ScheduleError, match="multiple of 32"):
        NamedBarrier(1, 100)


# ---- whole GEMMs in the emulator --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_a_staged_epilogue_matches_numpy_in_every_orientation(dtype: str, a_t: bool, b_t: bool) -> None:
    """136 x 72: a partial row tile and a partial column tile the TMA store clips; two consumer
    warpgroups, each with its own staging rows, named barrier and stores."""
    m, n, k = 136, 72, 424
    tensors, how = contraction(m, n, k, dtype, a_t=a_t, b_t=b_t, out=dtype)
    f, arrays = run(tensors, how, m, n, k, seed=11, plan=store_plan((128, 64), 3))
    check(arrays, how, f"tma-store {dtype} a_t={a_t} b_t={b_t}")
    assert f.module.kernels[0].attr("tensorize").endswith("epilogue through shared memory + TMA store)")
    assert len(stores_of(f)) == 1 and not global_output_stores(f)   # one 64 x 64 box per warpgroup
    # written only by TMA stores, the output is still one the host copies back from the device
    # (a NumPy output on the GPU is staged: a host program without it left the NaNs of the upload)
    out = tensors[-1].name
    assert f.host.outputs == (out,), f.host.outputs
    assert HostProgram.from_json(f.host.to_json()).outputs == (out,)


@pytest.mark.parametrize("m,n,k,batch,block,stages,blocks", [
    (136, 136, 130, 3, (128, 64), 2, 4),     # batched: 18 tiles over 4 blocks, each block's stores overlap
    (200, 264, 200, 0, (64, 64), 3, 7),      # 20 tiles over 7 blocks
    (70, 96, 64, 0, (64, 64), 4, 5)])        # fewer tiles (4) than blocks
def test_a_persistent_grid_with_the_staged_epilogue_matches_numpy(m: int, n: int, k: int, batch: int,
                                                                  block: tuple[int, int], stages: int,
                                                                  blocks: int) -> None:
    """A fused bias + relu applied before staging (the bias read at the column's index), and the
    staging tile of each tile rewritten only after the previous tile's store has read it."""
    tensors, how = contraction(m, n, k, "float16", batch=batch, out="float16", a_t=batch > 0,
                               epilogue=lambda acc, bias: tc.maximum(acc + bias, tc.const(0.0, "float16")))
    f, arrays = run(tensors, how, m, n, k, batch=batch, seed=m + blocks, plan=store_plan(block, stages, blocks))
    check(arrays, how, f"persistent tma-store {m}x{n}x{k} batch {batch}", epilogue=lambda e, b: np.maximum(e + b, 0.0))
    maps = {s.map.box for s in stores_of(f)}
    assert maps == {((1,) if batch else ()) + (64, 64)}
    waits = [s for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, BulkWait)]
    assert len(waits) == 2   # before a tile rewrites the staging tile, and before the block exits


def test_a_staged_epilogue_with_a_symbolic_m_and_float32_output() -> None:
    """Float32 outputs stage 32 columns per 128-byte row: a 64 x 128 tile is four boxes."""
    m, n, k = 100, 128, 128
    tensors, how = contraction(tc.var("M"), n, k, "bfloat16")
    f, arrays = run(tensors, how, m, n, k, seed=9, plan=store_plan((64, 128), 2), sizes={"M": m})
    check(arrays, how, "tma-store symbolic M float32 out")
    assert [s.map.box for s in stores_of(f)] == [(64, 32)] * 4


def test_an_output_whose_rows_tma_cannot_stride_keeps_the_register_epilogue() -> None:
    m, n, k = 64, 100, 64      # rows of 100 halves: 200 bytes, no multiple of 16
    tensors, how = contraction(m, n, k, "float16", out="float16", b_t=True)   # B [n][k]: TMA loads it
    f, arrays = run(tensors, how, m, n, k, seed=3, plan=store_plan((64, 64), 2))
    check(arrays, how, "tma-store refused")
    assert "epilogue from registers (no TMA store: its rows of 100 elements" in f.module.kernels[0].attr("tensorize")
    assert not stores_of(f) and global_output_stores(f)
    assert "not a multiple of 16 bytes" in str(tma_store_refusal_for(analyze_kernel(lower(tensors).kernels[0])))


def threads_plan(block: tuple[int, int], stages: int, persistent: int = 0) -> dict[str, Any]:
    plan = store_plan(block, stages, persistent)
    plan["steps"][0]["args"]["epilogue"] = "threads"
    return plan


@pytest.mark.parametrize("dtype,out", [("bfloat16", "bfloat16"), ("float16", "float32")])
def test_an_output_with_unaligned_rows_is_copied_out_of_the_staging_tile_by_the_threads(dtype: str, out: str) -> None:
    """Rows of 100 elements (200 or 400 bytes: no tensor map): epilogue "threads" stages the
    tile as the TMA epilogue does and the warpgroups' threads store it, guarded at M and N
    (136 x 100: partial row and column tiles)."""
    m, n, k = 136, 100, 128
    tensors, how = contraction(m, n, k, dtype, out=out, b_t=True)
    f, arrays = run(tensors, how, m, n, k, seed=3, plan=threads_plan((128, 64), 2))
    check(arrays, how, f"threads {dtype} -> {out}")
    assert f.module.kernels[0].attr("tensorize").endswith("epilogue through shared memory + the threads' stores)")
    assert not stores_of(f) and len(global_output_stores(f)) == 1   # one guarded element store, unrolled


@pytest.mark.parametrize("m,n,k,blocks", [(200, 134, 96, 5),    # 2 k tiles: 8 rows of each warp per k tile
                                          (130, 70, 192, 3),     # 3 k tiles: 6, 6, then the last 4
                                          (70, 90, 64, 4)])      # 1 k tile; fewer tiles (4) than blocks
def test_a_persistent_grid_with_the_threads_epilogue_and_a_fused_bias_matches_numpy(m: int, n: int, k: int,
                                                                                    blocks: int) -> None:
    """Each block stages several tiles in turn; a tile's copy runs under the next tile's k loop
    (its rows spread over the first k tiles), the block's last tile after the tile loop, and the
    next tile's writes after the barrier that follows the copy."""
    tensors, how = contraction(m, n, k, "float16", out="float16", b_t=True,
                               epilogue=lambda acc, bias: tc.maximum(acc + bias, tc.const(0.0, "float16")))
    f, arrays = run(tensors, how, m, n, k, seed=m + k, plan=threads_plan((64, 128), 3, blocks))
    check(arrays, how, f"threads persistent {m}x{n}x{k} over {blocks}", epilogue=lambda e, b: np.maximum(e + b, 0.0))


def _threads_kernel() -> tuple[PrimFunc, dict[str, np.ndarray]]:
    """6 tiles of 64 x 64 over 2 blocks, rows of 100 halves (B stored [n][k]: TMA loads it)."""
    return _persistent_kernel(n=100, epilogue="threads", b_t=True, seed=1)


def test_the_threads_epilogue_runs_race_free_and_each_barrier_is_needed() -> None:
    func, args = _threads_kernel()
    _simulate(func, args)
    a, b = args["A"].astype(np.float64), args["B"].astype(np.float64)
    assert np.allclose(args["C"].astype(np.float64), a @ b.T, atol=0.1)
    barriers = [s for s in iter_stmts(func.body) if isinstance(s, NamedBarrier)]
    assert len(barriers) == 2   # before the tile's writes (persistent), before the copy
    for dropped in barriers:
        edited = Edit(drop=lambda prev, s, nxt, d=dropped: s is d).visit(func.body)
        with pytest.raises(RaceError):
            _simulate(PrimFunc(func.name, func.params, edited, func.attrs), _threads_kernel()[1])


def test_an_unknown_epilogue_or_one_without_the_tma_ring_is_refused() -> None:
    tensors, _ = contraction(64, 64, 64, "float16", out="float16")
    kernel = lower(tensors).kernels[0]
    with pytest.raises(ScheduleError, match=r"epilogue\(C, 'smem'\): the epilogue is one of"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 2, producer="tma", epilogue="smem")
    with pytest.raises(ScheduleError, match="built for the warp-specialized TMA ring"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 2, epilogue="tma")
    with pytest.raises(ScheduleError, match="threads' staged epilogue is built for the warp-specialized TMA ring"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 2, epilogue="threads")


# ---- the races the emulator must report ---------------------------------------------------------------

def _persistent_kernel(n: int = 128, epilogue: str = "tma", b_t: bool = False,
                       seed: int = 0) -> tuple[PrimFunc, dict[str, np.ndarray]]:
    """6 tiles of 64 x n over 2 blocks: each block stages three tiles in turn."""
    m, k = 192, 64
    tensors, _ = contraction(m, n, k, "float16", out="float16", b_t=b_t)
    func = tensorized(lower(tensors).kernels[0], "C", "wgmma", (64, 64), (4, 1), 64, 2, producer="tma",
                      persistent=2, epilogue=epilogue)
    g = np.random.default_rng(seed)
    args = {"A": g.uniform(-1, 1, (m, k)).astype(np.float16),
            "B": g.uniform(-1, 1, (n, k) if b_t else (k, n)).astype(np.float16),
            "C": np.full((m, n), np.nan, np.float16)}
    return func, args


def _simulate(func: PrimFunc, args: dict[str, np.ndarray]) -> None:
    simulate_kernel(func, args, (2, 1, 1), (256, 1, 1))


def _waits_for_reads(s: Stmt) -> bool:
    return isinstance(s, IfThenElse) and isinstance(s.then_case, BulkWait)


BROKEN: dict[str, tuple[Callable[[Any, Stmt, Any], bool], type[Exception], str]] = {
    # the staged values not made visible to the async proxy
    "no proxy fence": (lambda prev, s, nxt: isinstance(s, AsyncProxyFence) and isinstance(nxt, NamedBarrier),
                       RaceError, "fence.proxy.async"),
    # the store issued while other threads of the warpgroup may still be writing
    "no barrier before the store": (lambda prev, s, nxt: isinstance(s, NamedBarrier) and
                                    isinstance(prev, AsyncProxyFence), RaceError, "other threads stored"),
    # the next tile overwrites the staging tile the previous tile's store may still read
    "no wait before rewriting": (lambda prev, s, nxt: _waits_for_reads(s) and isinstance(nxt, NamedBarrier),
                                 RaceError, "TMA store race"),
    # the block exits while its last store still reads shared memory
    "no wait before the exit": (lambda prev, s, nxt: _waits_for_reads(s) and nxt is None and
                                not isinstance(prev, IfThenElse), RaceError, "kernel ends"),
}


def test_the_intact_staged_protocol_runs_race_free() -> None:
    func, args = _persistent_kernel()
    _simulate(func, args)
    a, b = args["A"].astype(np.float64), args["B"].astype(np.float64)
    assert np.allclose(args["C"].astype(np.float64), a @ b, atol=0.1)


@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_staged_protocol_is_reported(broken: str) -> None:
    drop, error, message = BROKEN[broken]
    func, args = _persistent_kernel()
    edited = Edit(drop=drop).visit(func.body)
    assert edited is not func.body, f"{broken}: the edit found nothing to drop"
    with pytest.raises(error, match=message):
        _simulate(PrimFunc(func.name, func.params, edited, func.attrs), args)


def test_a_named_barrier_with_the_wrong_count_is_a_divergence() -> None:
    func, args = _persistent_kernel()
    edited = Edit(swap=lambda s: NamedBarrier(s.id, 256) if isinstance(s, NamedBarrier) else None).visit(func.body)
    with pytest.raises(DivergenceError, match="exactly 256 must arrive"):
        _simulate(PrimFunc(func.name, func.params, edited, func.attrs), args)


# ---- the strategy ------------------------------------------------------------------------------------

def test_the_strategy_enumerates_and_prices_the_epilogue_and_the_persistent_grid() -> None:
    """Both knobs are dimensions of the TMA points; the staging tile counts in the shared
    budget (128 x 256 halves: 64 KB, so at most 3 stages of 48 KB); the per-tile fixed cost
    ranks the TMA-store epilogue and the persistent grid above the rungs below them."""
    tensors, _ = contraction(4096, 4096, 4096, "float16", out="float16")
    info = analyze_kernel(lower(tensors).kernels[0])
    cands, _ = candidates_for(info, H200)
    tma = [c for c in cands if c.ok and c.point.get("load") == "tma"]
    assert {(c.point["epilogue"], bool(c.point["persistent"])) for c in tma} == \
        {(e, p) for e in ("tma", "registers") for p in (True, False)}
    big = [c for c in tma if (c.point["bm"], c.point["bn"]) == (128, 256)]
    assert max(c.point["stages"] for c in big if c.point["epilogue"] == "tma") == 3
    assert max(c.point["stages"] for c in big if c.point["epilogue"] == "registers") == 4   # 5 x 48 KB > 227 KB
    assert all(shared_bytes(c.point) <= H200.smem_per_block_optin for c in big)

    def best(epilogue: str, persistent: bool) -> float:
        return min(c.cost.total for c in big if c.point["epilogue"] == epilogue
                   and bool(c.point["persistent"]) == persistent)
    assert best("tma", True) < best("tma", False) < best("registers", False)
    assert best("registers", True) < best("registers", False)
    top = min((c for c in cands if c.ok), key=lambda c: c.cost.total)
    assert top.point.get("epilogue") == "tma" and top.point.get("persistent") == H200.sm_count
    assert "epilogue through shared memory + TMA store" in top.label


def test_an_output_tma_cannot_store_offers_the_threads_and_the_register_epilogues() -> None:
    """Rows of 100 halves: no TMA store; the staging tile copied out by the threads instead,
    priced below the register epilogue, whose unpaired 2-byte stores fill a quarter of a sector."""
    tensors, _ = contraction(512, 100, 512, "float16", out="float16", b_t=True)   # B rows of K: TMA loads them
    info = analyze_kernel(lower(tensors).kernels[0])
    cands, _ = candidates_for(info, H200)
    tma = [c for c in cands if c.ok and c.point.get("load") == "tma"]
    assert {c.point.get("epilogue") for c in tma} == {"threads", "registers"}
    assert all(shared_bytes(c.point) > shared_bytes({**c.point, "epilogue": "registers"})
               for c in tma if c.point["epilogue"] == "threads")   # the staging tile is counted
    threads = [c for c in tma if c.point["epilogue"] == "threads"]
    assert "copied out by the threads' stores" in " ".join(threads[0].workload.notes)
    assert thread_store_refusal_for(info) is None and "not a multiple of 16 bytes" in str(tma_store_refusal_for(info))
    best = {e: min(c.cost.total for c in tma if c.point["epilogue"] == e) for e in ("threads", "registers")}
    assert best["threads"] < best["registers"], best


# ---- CUDA and ptxas ----------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("size,persistent", [(4096, 0), (4096, 132), (8192, 132)])
def test_the_staged_128x256_kernels_compile_for_sm_90a_without_spills_or_serialization(size: int,
                                                                                     persistent: int) -> None:
    tensors, _ = contraction(tc.var("M"), size, size, "float16", out="float16")
    f = tc.build(tensors, target="cuda", arch="sm_90", plan=store_plan((128, 256), 3, persistent), sizes={"M": size})
    (r,) = f.resources.values()
    assert (r.spill_stores, r.spill_loads, r.stack_bytes, r.registers) == (0, 0, 0, 168), r
    assert wgmma_serialized(f.compile_log) is None, f.compile_log            # no C7514 / C7515 / C7518
    assert "C7514" not in f.compile_log and "setmaxnreg' ignored" not in f.compile_log, f.compile_log
    src = f.source
    assert "const __grid_constant__ TeccTensorMap C_tmap" in src
    assert src.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == 4   # 4 boxes of 64 columns
    assert "cp.async.bulk.commit_group" in src and "cp.async.bulk.wait_group.read 0" in src
    assert "bar.sync %0, 128" in src and src.count("__syncthreads()") == 1
    assert [m.name for m in f.host.kernels[0].tensor_maps] == ["A_tmap", "B_tmap", "C_tmap"]
