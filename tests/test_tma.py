"""TMA tile copies and the warp-specialized wgmma ring (pipeline(..., producer="tma"), warp_specialize),
without a GPU: the IR's checks, the emulator's copy (zero fill, the 128B swizzle, transaction
bytes) against NumPy, whole GEMMs in the emulator against NumPy float64 under
tests/test_tensorize.py's bound, the deadlocks the emulator must report, the CUDA and ptxas
facts of the 4096³ kernel, and the runtime around the tensor-map encoding (its arguments, the
packed launch parameters, the manifest) with the driver call stubbed out."""

from __future__ import annotations

import ctypes
import json
import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_tensorize import check, contraction, run

import tecc as tc
from tecc.compiler.cost.analysis import analyze_kernel
from tecc.compiler.pipeline import wgmma_serialized
from tecc.compiler.planner import candidates_for
from tecc.compiler.strategies.gemm_wgmma import GemmWgmma, tma_refusal_for
from tecc.ir import dtype as dt
from tecc.ir.errors import DeadlockError, ScheduleError, ShapeError
from tecc.ir.expr import BufferLoad, Var
from tecc.ir.intrinsics import IntrinsicError
from tecc.ir.stmt import (
    Allocate,
    Barrier,
    BarrierArrive,
    BarrierExpectTx,
    BarrierInit,
    BarrierRef,
    BarrierWait,
    Buffer,
    BufferStore,
    BulkCopy,
    For,
    IfThenElse,
    PrimFunc,
    SetMaxRegisters,
    TensorCopy,
    TensorMap,
    iter_stmts,
    seq,
)
from tecc.ir.tma_stmt import swizzle_layout
from tecc.passes.lower import lower
from tecc.runtime.host import HostProgram
from tecc.runtime.marshal import plan_launches, tensor_map_geometry
from tecc.runtime.sim import simulate_kernel
from tecc.runtime.tensor_map import (
    TENSOR_MAP_BYTES,
    EncodedTensorMap,
    PackedParameters,
    TensorMapSpec,
    encode_arguments,
)
from nvrtc_checks import needs_nvrtc
from tensor_core_steps import schedule_tensor_core, tensorized


def tma_plan(block: tuple[int, int] = (64, 64), stages: int = 3) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "C", "intrinsic": "wgmma", "block": list(block),
                                            "warps": [4 * block[0] // 64, 1], "k_tile": 64, "stages": stages,
                                            "producer": "tma"}}]}





# ---- the IR -----------------------------------------------------------------------------------------

def test_a_tensor_map_checks_what_tma_can_copy() -> None:
    a = Buffer("A", dt.float16, (Var("M"), 256))
    with pytest.raises(IntrinsicError, match="at most 128 bytes"):
        TensorMap(a, (64, 128), "128B")          # 256-byte rows do not fit the 128-byte swizzle
    with pytest.raises(IntrinsicError, match=r"\[1, 256\]"):
        TensorMap(a, (512, 64), "128B")
    with pytest.raises(IntrinsicError, match="multiple of 16"):
        TensorMap(a, (64, 4))                    # 8 bytes innermost
    with pytest.raises(IntrinsicError, match="one box size per dimension"):
        TensorMap(a, (64,))
    with pytest.raises(IntrinsicError, match="global buffer"):
        TensorMap(Buffer("S", dt.float16, (64, 64), "shared"), (64, 64))
    m = TensorMap(a, (64, 64), "128B")
    assert m.bytes == 64 * 64 * 2 and m.name == "A_tmap"
    bars = Buffer("bar", dt.int64, (1,), "shared")
    plain = Buffer("A_s", dt.float16, (64, 64), "shared")
    with pytest.raises(IntrinsicError, match="layout"):
        TensorCopy(plain, (0, 0), m, (0, 0), BarrierRef(bars, 0))  # the swizzle must be the buffer's layout


def _tma_kernel(dtype: dt.DType, box: tuple[int, ...], swizzle: str, coords: tuple[int, ...], rows: int
                ) -> tuple[PrimFunc, Buffer]:
    """One thread loads a box of A (rank len(box)) at `coords` into a shared tile; every thread
    then copies the tile (its logical elements) out to `out` after the wait."""
    tid = Var("tid")
    shape = tuple(Var(f"D{d}") for d in range(len(box)))
    a = Buffer("A", dtype, shape)
    n = int(np.prod(box))
    out = Buffer("out", dtype, (n,))
    tile = Buffer("tile", dtype, box, "shared", layout=swizzle_layout(swizzle, dtype.bytes))
    bars = Buffer("bar", dt.int64, (1,), "shared")
    bar = BarrierRef(bars, 0)
    tmap = TensorMap(a, box, swizzle)
    i = Var("i")
    per = n // 128
    flat = tid * per + i
    index = []
    rest = flat
    for d in reversed(box):
        index.append(rest % d)
        rest = rest // d
    body = seq(IfThenElse(tid == 0, BarrierInit(bar, 1)), Barrier(),
               IfThenElse(tid == 0, seq(BarrierExpectTx(bar, tmap.bytes), TensorCopy(tile, (0,) * len(box), tmap,
                                                                                    coords, bar))),
               BarrierWait(bar, 0),
               For(i, 0, per, "serial", BufferStore(out, (flat,), BufferLoad(tile, tuple(reversed(index))))))
    params = (a, out, *shape)
    return PrimFunc("tma_box", params, Allocate(tile, Allocate(bars, For(tid, 0, 128, "threadIdx.x", body)))), a


@pytest.mark.parametrize("dtype,box,swizzle,coords,shape", [
    (dt.float16, (64, 64), "128B", (-3, 50), (40, 100)),         # rows above, columns past the end
    (dt.bfloat16, (32, 64), "128B", (10, 0), (40, 64)),
    (dt.float32, (2, 16, 32), "none", (1, -5, 8), (3, 20, 40)),   # a batch dimension, 4-byte elements
    (dt.float32, (16, 32), "128B", (0, 0), (16, 32)),           # the 128B swizzle of 4-byte elements
])
def test_the_emulated_tma_copy_is_the_box_with_zero_fill(dtype: dt.DType, box: tuple[int, ...], swizzle: str,
                                                         coords: tuple[int, ...], shape: tuple[int, ...]) -> None:
    func, _ = _tma_kernel(dtype, box, swizzle, coords, shape[0])
    g = np.random.default_rng(1)
    npd = ml_dtypes.bfloat16 if dtype == dt.bfloat16 else dtype.numpy
    a = g.standard_normal(shape).astype(npd)
    out = np.full(int(np.prod(box)), np.nan, npd)
    sizes = {f"D{d}": n for d, n in enumerate(shape)}
    simulate_kernel(func, {"A": a, "out": out, **sizes}, (1, 1, 1), (128, 1, 1))
    want = np.zeros(box, npd)
    src = tuple(slice(max(c, 0), min(c + b, n)) for c, b, n in zip(coords, box, shape))
    dst = tuple(slice(s.start - c, s.stop - c) for s, c in zip(src, coords))
    want[dst] = a[src]
    np.testing.assert_array_equal(out.reshape(box).astype(np.float64), want.astype(np.float64))


def test_announcing_fewer_bytes_than_the_box_is_a_deadlock() -> None:
    """expect_tx must announce the box's full size (out-of-bounds elements included): here the
    copy's bytes drive the transaction count below zero and the phase never completes."""
    func, _ = _tma_kernel(dt.float16, (64, 64), "128B", (-3, 50), 40)
    body = func.body

    class Fewer(tc.ir.visitor.StmtMutator):  # type: ignore[name-defined]
        def visit_BarrierExpectTx(self, s: BarrierExpectTx) -> Any:
            return BarrierExpectTx(s.bar, 4096)
    func = func.with_body(Fewer().visit(body))
    a = np.zeros((40, 100), np.float16)
    with pytest.raises(DeadlockError, match="transaction bytes"):
        simulate_kernel(func, {"A": a, "out": np.zeros(4096, np.float16), "D0": 40, "D1": 100}, (1, 1, 1), (128, 1, 1))


# ---- the warp-specialized GEMM in the emulator -------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_tma_gemm_matches_numpy_in_every_orientation(dtype: str, a_t: bool, b_t: bool) -> None:
    """Sizes no multiple of any tile (TMA's zero fill is the edge handling), seven k tiles
    through a 3-stage ring (the ring wraps twice), two consumer warpgroups."""
    m, n, k = 136, 72, 424
    tensors, how = contraction(m, n, k, dtype, a_t=a_t, b_t=b_t)
    f, arrays = run(tensors, how, m, n, k, seed=5, plan=tma_plan((128, 64), 3))
    check(arrays, how, f"tma {dtype} a_t={a_t} b_t={b_t}")
    body = list(iter_stmts(f.module.kernels[0].body))
    assert sum(isinstance(s, TensorCopy) for s in body) == (1 if not a_t else 2) + 1
    assert sum(isinstance(s, Barrier) for s in body) == 1   # only after the barriers' initialization


@pytest.mark.parametrize("block,stages", [((64, 64), 2), ((64, 256), 4), ((128, 128), 5)])
def test_tma_gemm_points_batched_and_with_an_epilogue(block: tuple[int, int], stages: int) -> None:
    m, n, k = 70, 136, 200   # B's rows of 136 halves: a multiple of 16 bytes, as a tensor map's stride must be
    tensors, how = contraction(m, n, k, "float16", batch=2, out="float16",
                               epilogue=lambda acc, bias: tc.maximum(acc + bias, tc.const(0.0, "float16")))
    f, arrays = run(tensors, how, m, n, k, batch=2, seed=7, plan=tma_plan(block, stages))
    check(arrays, how, f"tma batched {block} {stages}", epilogue=lambda e, b: np.maximum(e + b, 0.0))
    maps = {s.map.buffer.name: s.map.box for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, TensorCopy)}
    assert maps["A"] == (1, block[0], 64)  # a 3-d box: one batch entry


def test_tma_gemm_with_a_symbolic_m() -> None:
    m, n, k = 100, 64, 128
    tensors, how = contraction(tc.var("M"), n, k, "bfloat16")
    f, arrays = run(tensors, how, m, n, k, seed=9, plan=tma_plan((64, 64), 2), sizes={"M": m})
    check(arrays, how, "tma symbolic M")


def test_a_ring_without_the_consumers_release_is_a_deadlock() -> None:
    tensors, _ = contraction(64, 64, 320, "float16")
    kernel = lower(tensors).kernels[0]
    func = tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 2, producer="tma", release=False)
    args = {"A": np.ones((64, 320), np.float16), "B": np.ones((320, 64), np.float16),
            "C": np.zeros((64, 64), np.float32)}
    with pytest.raises(DeadlockError, match=r"empty_bar.*phase 0"):
        simulate_kernel(func, args, (1, 1, 1), (256, 1, 1))


def _roles_kernel(empty_count: int) -> PrimFunc:
    """Warp 0 produces (waits for the free slot, announces 128 bytes, bulk-copies round r's row of
    `src` into it), warp 1 consumes (waits, copies the slot out, arrives on `empty`), three rounds
    through one slot: a ring the emulator must run as concurrent roles."""
    tid, r = Var("tid"), Var("round")
    src = Buffer("src", dt.int32, (3, 32))
    slot = Buffer("slot", dt.int32, (32,), "shared")
    out = Buffer("out", dt.int32, (3, 32))
    bars = Buffer("bars", dt.int64, (2,), "shared")
    full, empty = BarrierRef(bars, 0), BarrierRef(bars, 1)
    lane = tid % 32
    producer = For(r, 0, 3, "serial", IfThenElse(lane == 0, seq(
        BarrierWait(empty, (r + 1) % 2), BarrierExpectTx(full, 128), BulkCopy(slot, (0,), src, (r, 0), 128, full))))
    r2 = Var("round_c")
    consumer = For(r2, 0, 3, "serial", seq(BarrierWait(full, r2 % 2), BufferStore(out, (r2, lane), slot[lane]),
                                           BarrierArrive(empty)))
    body = seq(IfThenElse(tid == 0, seq(BarrierInit(full, 1), BarrierInit(empty, empty_count))), Barrier(),
               IfThenElse(tid < 32, producer, consumer))
    return PrimFunc("roles", (src, out), Allocate(slot, Allocate(bars, For(tid, 0, 64, "threadIdx.x", body))))


def test_divergent_branches_that_wait_run_as_roles_and_their_deadlock_is_found() -> None:
    src = np.random.default_rng(2).integers(-1000, 1000, (3, 32)).astype(np.int32)
    out = np.full((3, 32), -1, np.int32)
    simulate_kernel(_roles_kernel(32), {"src": src, "out": out}, (1, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(out, src)
    # the slot is released by 32 arrivals but the barrier expects 33: the second round hangs
    with pytest.raises(DeadlockError, match=r"bars\[1\].*no other role"):
        simulate_kernel(_roles_kernel(33), {"src": src, "out": out}, (1, 1, 1), (64, 1, 1))


def test_tma_is_refused_for_gathered_operands_with_a_reason() -> None:
    x = tc.placeholder((1, 18, 18, 64), "float16", "X")
    w = tc.placeholder((3, 3, 64, 64), "float16", "W")
    r, s, c = tc.reduce_axis(3, "r"), tc.reduce_axis(3, "s"), tc.reduce_axis(64, "c")
    y = tc.compute((1, 16, 16, 64), lambda n, p, q, f: tc.sum(
        tc.cast(x[n, p + r, q + s, c], "float32") * tc.cast(w[r, s, c, f], "float32"), axis=(r, s, c)), name="C")
    kernel = lower([x, w, y]).kernels[0]
    with pytest.raises(ScheduleError, match="TMA cannot load the operands.*implicit GEMM.*producer='cp.async'"):
        tensorized(kernel, "C", "wgmma", (64, 64), (4, 1), 64, 3, producer="tma")
    info = analyze_kernel(kernel)
    assert "implicit GEMM" in (tma_refusal_for(info) or "")
    points = list(GemmWgmma().space(info, tc.target("sm_90")))
    assert points and all(p["load"] == "cp.async" for p in points)


@pytest.mark.parametrize("m,n,k,a_t,b_t,operand", [
    (520, 700, 520, False, False, "operand B .B.: its rows of 700 elements .1400 bytes."),   # B [k][n]
    (96, 64, 300, False, True, "operand A .A.: its rows of 300 elements .600 bytes."),      # A [m][k]
])
def test_tma_is_refused_for_rows_that_miss_the_16_byte_stride_alignment(m: int, n: int, k: int, a_t: bool,
                                                                        b_t: bool, operand: str) -> None:
    """A row length known at compile time that is not a multiple of 16 bytes cannot be a tensor
    map's stride (cuTensorMapEncodeTiled): the primitive refuses it when the schedule is made,
    as the strategy leaves it out of its space, rather than the launch failing to encode the map."""
    tensors, _ = contraction(m, n, k, "float16", a_t=a_t, b_t=b_t)
    kernel = lower(tensors).kernels[0]
    with pytest.raises(ScheduleError, match=f"TMA cannot load the operands: {operand}.*16 bytes.*cp.async"):
        tensorized(kernel, "C", "wgmma", (64, 128), (4, 1), 64, 3, producer="tma")
    info = analyze_kernel(kernel)
    assert "multiple of 16 bytes" in (tma_refusal_for(info) or "")
    assert all(p["load"] == "cp.async" for p in GemmWgmma().space(info, tc.target("sm_90")))
    # the same shapes padded to 16-byte rows take the TMA ring
    tensors, _ = contraction(m, n + (-n % 8), k + (-k % 8), "float16", a_t=a_t, b_t=b_t)
    tensorized(lower(tensors).kernels[0], "C", "wgmma", (64, 128), (4, 1), 64, 3, producer="tma")


def test_the_strategy_offers_and_explains_the_tma_rung() -> None:
    tensors, _ = contraction(4096, 4096, 4096, "bfloat16", out="bfloat16")
    info = analyze_kernel(lower(tensors).kernels[0])
    assert tma_refusal_for(info) is None
    cands, _ = candidates_for(info, tc.target("sm_90").replace(name="H200", dram_bandwidth=4.8e12))
    tma = [c for c in cands if c.ok and c.point.get("load") == "tma"]
    cp = [c for c in cands if c.ok and c.point.get("load") == "cp.async"]
    assert tma and cp
    assert all("rung: wgmma + TMA + mbarrier ring, warp-specialized" in c.label for c in tma)
    best = lambda cs: min(cs, key=lambda c: c.cost.total)  # noqa: E731
    # no per-thread copy instructions: fewer issued instructions for the same point
    rung = lambda c: {x: c.point[x] for x in ("bm", "bn", "stages")}  # noqa: E731
    t = best([c for c in tma if c.point["epilogue"] == "registers" and not c.point["persistent"]])
    p = next(c for c in cp if rung(c) == rung(t))
    assert t.workload.instructions < p.workload.instructions
    assert t.workload.threads == p.workload.threads + 128


# ---- CUDA and ptxas ----------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("dtype,a_t,b_t,block,stages", [
    ("float16", False, False, (128, 256), 4), ("bfloat16", True, True, (128, 128), 5),
    ("float16", False, True, (64, 256), 4)])
def test_the_4096_tma_kernels_compile_for_sm_90a_without_spills_or_serialization(
        dtype: str, a_t: bool, b_t: bool, block: tuple[int, int], stages: int) -> None:
    tensors, _ = contraction(4096, 4096, 4096, dtype, out=dtype, a_t=a_t, b_t=b_t)
    f = tc.build(tensors, target="cuda", arch="sm_90", plan=tma_plan(block, stages))
    (r,) = f.resources.values()
    assert f.arch == "sm_90a"
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert wgmma_serialized(f.compile_log) is None, f.compile_log        # no C7515 / C7518
    assert "setmaxnreg' ignored" not in f.compile_log, f.compile_log      # no C7507
    if block[0] == 128:
        assert r.registers == 168, r.registers   # __launch_bounds__(384) with setmaxnreg: the cap
    src = f.source
    assert "const __grid_constant__ TeccTensorMap A_tmap" in src and "const __grid_constant__ TeccTensorMap B_tmap" in src
    assert src.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes") >= 2
    assert src.count("__syncthreads()") == 1                            # none in the main loops
    # two consumer warpgroups take the producer's registers; one keeps the launch bound's 255
    assert ("setmaxnreg.dec.sync.aligned.u32 40" in src) == (block[0] == 128)
    assert re.search(r"\.param \.align 64 \.b8 C_kernel_param_\d+\[128\]", f.ptx)


# ---- the runtime around the encoding -----------------------------------------------------------------

def test_the_emulator_refuses_a_launch_whose_tensor_map_the_gpu_could_not_encode() -> None:
    """B's row length N is known at launch only: N = 72 (144-byte rows) runs, N = 70 (140 bytes)
    is refused with the ShapeError the CUDA executor raises when it encodes the map."""
    m, k = 64, 128
    tensors, how = contraction(m, tc.var("N"), k, "float16")
    f, arrays = run(tensors, how, m, 72, k, seed=3, plan=tma_plan((64, 64), 2), sizes={"N": 72})
    check(arrays, how, "tma symbolic N")
    b = np.ones((k, 70), np.float16)
    with pytest.raises(ShapeError, match=r"tensor map of B: stride 70 elements \(140 bytes\).*multiples of 16 bytes"):
        f(np.ones((m, k), np.float16), b, np.zeros((m, 70), np.float32))


def test_encode_arguments_are_the_driver_order_and_checked() -> None:
    spec = TensorMapSpec("A", dt.float16, (128, 64), "128B")
    args = encode_arguments(spec, 0x7F0000000000, (1000, 4096), (4096, 1))
    assert args.rank == 2 and args.dims == (4096, 1000) and args.strides == (8192,)
    assert args.box == (64, 128) and args.element_strides == (1, 1)
    assert (args.data_type, args.swizzle, args.oob_fill) == (6, 3, 0)  # FLOAT16, SWIZZLE_128B, zero fill
    batched = encode_arguments(TensorMapSpec("B", dt.bfloat16, (1, 64, 64), "128B"), 0x1000, (8, 512, 256),
                               (512 * 256, 256, 1))
    assert batched.dims == (256, 512, 8) and batched.strides == (512, 512 * 256 * 2) and batched.data_type == 9
    with pytest.raises(ShapeError, match="16-byte aligned base"):
        encode_arguments(spec, 0x1008, (1000, 4096), (4096, 1))
    with pytest.raises(ShapeError, match="multiples of 16 bytes"):
        encode_arguments(spec, 0x1000, (1000, 1001), (1001, 1))
    with pytest.raises(ShapeError, match="contiguous innermost"):
        encode_arguments(spec, 0x1000, (1000, 4096), (1, 1000))


def test_packed_parameters_pass_pointers_scalars_and_maps_by_value() -> None:
    blob = bytes(range(TENSOR_MAP_BYTES))
    packed = PackedParameters([0x7F00DEADBEE0, np.int32(-7), EncodedTensorMap(blob), np.float16(1.5)])
    assert packed.parameter_bytes(0) == (0x7F00DEADBEE0).to_bytes(8, "little")
    assert packed.parameter_bytes(1) == (-7).to_bytes(4, "little", signed=True)
    assert packed.parameter_bytes(2) == blob
    assert packed.pointers[2] % 64 == 0                       # CUtensorMap's alignment
    assert packed.parameter_bytes(3) == np.float16(1.5).tobytes()
    pointers = (ctypes.c_void_p * 4).from_address(packed.address)
    assert [pointers[i] for i in range(4)] == [packed.pointers[i] for i in range(4)]


def _tma_module(symbolic: bool = True) -> Any:
    tensors, _ = contraction(tc.var("M") if symbolic else 256, 256, 256, "float16", out="float16")
    sch = tc.Schedule(tensors)
    schedule_tensor_core(sch, "C", intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64, stages=4, producer="tma")
    return sch


def test_the_host_program_lists_the_maps_after_the_ordinary_parameters() -> None:
    f = tc.build(_tma_module(), target="sim")
    host = HostProgram.from_module(f.module)
    (k,) = host.kernels
    assert [(m.param, m.box, m.swizzle) for m in k.tensor_maps] == [("A", (128, 64), "128B"), ("B", (64, 64), "128B")]
    again = HostProgram.from_json(json.loads(json.dumps(host.to_json())))
    assert again.kernels[0].tensor_maps == k.tensor_maps
    (launch,) = plan_launches(host)
    kinds = [s.kind for s in launch.slots]
    assert kinds[-2:] == ["tensor_map", "tensor_map"] and "tensor_map" not in kinds[:-2]
    # what the executor would encode for M = 1000: the bound shape and strides of each array
    env = {v: 1000 for v in host.size_vars}
    assert tensor_map_geometry(host, "A", env) == ((1000, 256), (256, 1))
    assert tensor_map_geometry(host, "B", env) == ((256, 256), (256, 1))


def test_the_executor_encodes_each_map_from_the_launch_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaExecutor._param for a tensor-map slot, with the driver call stubbed: the arguments it
    would pass for a symbolic M, and one encoding per (array, shape)."""
    from tecc.runtime import cuda as runtime_cuda

    f = tc.build(_tma_module(), target="sim")
    host = HostProgram.from_module(f.module)
    executor = runtime_cuda.CudaExecutor.__new__(runtime_cuda.CudaExecutor)
    executor.host = host
    executor._tensor_maps = {}
    calls: list[Any] = []

    def fake_encode(args: Any, where: str = "") -> EncodedTensorMap:
        calls.append(args)
        return EncodedTensorMap(bytes(TENSOR_MAP_BYTES))
    monkeypatch.setattr(runtime_cuda, "encode_tensor_map", fake_encode)
    (launch,) = plan_launches(host)
    slots = [s for s in launch.slots if s.kind == "tensor_map"]
    for m in (1000, 1000, 4096):
        env = {v: m for v in host.size_vars}
        for s in slots:
            value = executor._param(s, [0x10000, 0x20000, 0x30000], {}, {}, env)
            assert isinstance(value, EncodedTensorMap)
    assert [(c.address, c.dims, c.box) for c in calls] == [
        (0x10000, (256, 1000), (64, 128)), (0x20000, (256, 256), (64, 64)), (0x10000, (256, 4096), (64, 128))]


@needs_nvrtc
def test_a_saved_tma_artifact_records_its_maps(tmp_path: Any) -> None:
    from tecc.runtime.artifact import load

    f = tc.build(_tma_module(), target="cuda", arch="sm_90")
    f.save(tmp_path / "gemm")
    manifest = json.loads((tmp_path / "gemm.json").read_text())
    assert manifest["version"] == 3
    (k,) = manifest["host"]["kernels"]
    assert k["tensor_maps"] == [{"param": "A", "dtype": "float16", "box": [128, 64], "swizzle": "128B"},
                                {"param": "B", "dtype": "float16", "box": [64, 64], "swizzle": "128B"}]
    loaded = load(tmp_path / "gemm")
    assert loaded.host.kernels[0].tensor_maps == HostProgram.from_module(f.module).kernels[0].tensor_maps


def test_a_cached_launch_encodes_the_maps_for_each_hits_pointers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch cache replays a TMA launch with new array pointers: its map slots are encoded
    for those pointers (once per pointer), the other parameters as cached."""
    from tecc.runtime import cuda as runtime_cuda

    spec = TensorMapSpec("A", dt.float16, (128, 64), "128B")
    encoded: list[int] = []

    def fake_encode(args: Any, where: str = "") -> EncodedTensorMap:
        encoded.append(args.address)
        return EncodedTensorMap(args.address.to_bytes(8, "little") * 16)
    monkeypatch.setattr(runtime_cuda, "encode_tensor_map", fake_encode)
    executor = runtime_cuda.CudaExecutor.__new__(runtime_cuda.CudaExecutor)
    executor.host = HostProgram("gemm", (), (), (), (), ())
    executor._tensor_maps = {}
    launch = runtime_cuda.CachedLaunch(None, None, (1, 1, 1), (384, 1, 1), None, (None, np.int32(1000), None),
                                       ((0, 0),), ((2, 0, spec, (1000, 256), (256, 1)),))
    for ptr in (0x10000, 0x20000, 0x10000):
        params = executor._with_maps(launch, [ptr])
        assert params[0] == ptr and params[1] == 1000
        assert params[2].data[:8] == ptr.to_bytes(8, "little")
    assert encoded == [0x10000, 0x20000]


# ---- rung 4: the persistent grid ---------------------------------------------------------------------

def persistent_plan(block: tuple[int, int], stages: int, blocks: int) -> dict[str, Any]:
    plan = tma_plan(block, stages)
    plan["steps"][0]["args"]["persistent"] = blocks
    return plan


@pytest.mark.parametrize("m,n,k,batch,block,stages,blocks", [   # rows of a multiple of 16 bytes (TMA strides)
    (200, 296, 200, 0, (64, 64), 3, 5),       # 20 tiles over 5 blocks, the ring running on across tiles
    (136, 136, 130, 3, (128, 64), 2, 4),      # batched: 18 tiles over 4 blocks
    (70, 72, 64, 0, (64, 64), 4, 7),          # fewer tiles (4) than blocks: three blocks idle
    (530, 72, 104, 0, (64, 64), 2, 3)])       # 9 row tiles: a full group of 8 and a group of 1
def test_a_persistent_grid_matches_numpy(m: int, n: int, k: int, batch: int, block: tuple[int, int], stages: int,
                                         blocks: int) -> None:
    tensors, how = contraction(m, n, k, "bfloat16", batch=batch, a_t=batch > 0)
    f, arrays = run(tensors, how, m, n, k, batch=batch, seed=m + blocks, plan=persistent_plan(block, stages, blocks))
    check(arrays, how, f"persistent {m}x{n}x{k} batch {batch} over {blocks} blocks")
    assert f.module.kernels[0].attr("tensorize").endswith(f"persistent over {blocks} blocks in groups of 8 row tiles)")


def test_the_grouped_order_visits_every_tile_once() -> None:
    """The tile order of 13 row tiles x 5 column tiles over 6 blocks, read back from the kernel's
    let-bindings by evaluating them: a permutation of all tiles, groups of 8 row tiles."""
    from tecc.ir.evaluate import evaluate_int
    from tecc.ir.stmt import LetStmt

    tensors, _ = contraction(13 * 64, 5 * 64, 64, "float16")
    kernel = tensorized(lower(tensors).kernels[0], "C", "wgmma", (64, 64), (4, 1), 64, 2,
                             producer="tma", persistent=6)
    lets = {}
    for s in iter_stmts(kernel.body):
        if isinstance(s, LetStmt) and s.var.name in ("block_row", "block_col"):
            lets[s.var.name] = s
    block_id = next(s.var for s in iter_stmts(kernel.body) if isinstance(s, For) and s.kind == "blockIdx.x")
    tile_iter = next(s.var for s in iter_stmts(kernel.body) if isinstance(s, For) and s.var.name == "tile_iter")
    seen = []
    for tile in range(13 * 5):
        env = {block_id: tile % 6, tile_iter: tile // 6}
        seen.append((evaluate_int(lets["block_row"].value, env), evaluate_int(lets["block_col"].value, env)))
    assert sorted(seen) == [(r, c) for r in range(13) for c in range(5)]
    assert seen[:10] == [(r, 0) for r in range(8)] + [(0, 1), (1, 1)]   # the first group sweeps columns together


@needs_nvrtc
def test_the_persistent_4096_kernel_compiles_without_spills_or_serialization() -> None:
    tensors, _ = contraction(tc.var("M"), 4096, 4096, "float16", out="float16")
    f = tc.build(tensors, target="cuda", arch="sm_90", plan=persistent_plan((128, 256), 4, 132), sizes={"M": 4096})
    (r,) = f.resources.values()
    assert (r.spill_stores, r.spill_loads, r.stack_bytes, r.registers) == (0, 0, 0, 168), r
    assert wgmma_serialized(f.compile_log) is None and "setmaxnreg' ignored" not in f.compile_log, f.compile_log
    assert str(f.host.kernels[0].grid[0]) == "132"   # one block per SM, whatever M is


def test_a_repeated_tensor_map_launch_reuses_its_packed_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuLaunchKernel's packed block is kept per (configuration, stream, parameters): the same
    pointers and encoded maps relaunch the block packed before; a new pointer packs anew."""
    import types

    from tecc.runtime import cuda as rt_cuda
    from tecc.runtime.tensor_map import EncodedTensorMap

    made: list[tuple[Any, ...]] = []
    runs: list[int] = []

    def prepare(stream, handle, grid, block, shmem, params):  # noqa: ANN001, ANN202
        made.append(tuple(params))
        return lambda: runs.append(len(made))

    monkeypatch.setattr(rt_cuda, "prepare_packed", prepare)
    executor = types.SimpleNamespace(_stream_ptr=7, stream=types.SimpleNamespace(handle=7), _packed_launches={})
    config = types.SimpleNamespace(grid=(2, 1, 1), block=(384, 1, 1), shmem_size=1024)
    kernel = types.SimpleNamespace(handle=1)
    tmap = EncodedTensorMap(bytes(128))
    for _ in range(3):
        rt_cuda.CudaExecutor._submit(executor, kernel, config, [0x1000, tmap, 4096])  # type: ignore[arg-type]
    assert len(made) == 1 and runs == [1, 1, 1]
    rt_cuda.CudaExecutor._submit(executor, kernel, config, [0x2000, tmap, 4096])  # type: ignore[arg-type]
    assert len(made) == 2 and runs[-1] == 2
