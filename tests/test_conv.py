"""Convolutions written as tensor expressions: implicit GEMMs on tensor cores (docs/conv.md).

Every program is an ordinary `tc.compute` with a `tc.sum` over (c, r, s) and padding by
`tc.where` on the index; nothing names a convolution. Each kernel runs in the emulator against a
float64 NumPy convolution with a bound derived from the dtypes and K = C/groups · R · S: the mma
multiplies exactly and rounds its float32 sum once per k16 step, so the sum is within
(K + 1)·2⁻²⁴·Σ|x·w| of the exact one; the float32 epilogue adds a few float32 roundings and the
16-bit output one rounding of the result. Inputs are fresh random values, outputs start as NaN.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import compile_cuda, emit_source
from tecc.ir.stmt import AsyncCopy, MatrixMultiply, iter_stmts
from tensor_core_steps import schedule_tensor_core

# the strategies that put a contraction on tensor cores (mma.sync; wgmma where a branch adds it)
TENSOR_CORE = ("gemm_tensor_core", "gemm_wgmma")
EPS = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
F32 = 2.0**-24


def np_dtype(name: str) -> Any:
    if name == "bfloat16":
        from ml_dtypes import bfloat16  # type: ignore[import-untyped]

        return bfloat16
    return np.dtype(name)


@dataclass
class Conv:
    """A convolution's sizes; `program()` writes it as a tensor expression."""

    n: int
    size: tuple[int, ...]          # input spatial extents (1, 2 or 3 of them)
    c: int
    f: int
    kernel: tuple[int, ...]
    stride: int = 1
    pad: int = 0
    dil: int = 1
    groups: int = 1
    layout: str = "NHWC"           # channels last (filters R,S,C/g,F) or "NCHW" (filters F,C/g,R,S)
    dtype: str = "float16"
    epilogue: str = ""             # "" | "bias_relu" | "bn_relu" | "bn_residual"
    tensors: list[tc.Tensor] = field(default_factory=list)

    @property
    def out(self) -> tuple[int, ...]:
        return tuple((x + 2 * self.pad - self.dil * (k - 1) - 1) // self.stride + 1
                     for x, k in zip(self.size, self.kernel))

    @property
    def k(self) -> int:
        return self.c // self.groups * int(np.prod(self.kernel))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        cg = self.c // self.groups
        if self.layout == "NHWC":
            x, w, y = (self.n, *self.size, self.c), (*self.kernel, cg, self.f), (self.n, *self.out, self.f)
        else:
            x, w, y = (self.n, self.c, *self.size), (self.f, cg, *self.kernel), (self.n, self.f, *self.out)
        out = {"X": x, "Wt": w, "Y": y}
        if self.epilogue == "bias_relu":
            out["bias"] = (self.f,)
        elif self.epilogue:
            out["scale"], out["shift"] = (self.f,), (self.f,)
        if self.epilogue == "bn_residual":
            out["res"] = y
        return out

    def program(self) -> list[tc.Tensor]:
        sh, d = self.shapes(), len(self.size)
        X = tc.placeholder(sh["X"], self.dtype, "X")
        Wt = tc.placeholder(sh["Wt"], self.dtype, "Wt")
        extra = {name: tc.placeholder(sh[name], "float32" if name != "res" else self.dtype, name)
                 for name in ("bias", "scale", "shift", "res") if name in sh}
        cg, fg = self.c // self.groups, self.f // self.groups
        c = tc.reduce_axis(cg, "c")
        taps = [tc.reduce_axis(k, "rst"[i] if d <= 3 else f"t{i}") for i, k in enumerate(self.kernel)]

        def body(*ix: Any) -> Any:
            if self.layout == "NHWC":
                n, *sp, f = ix
            else:
                n, f, *sp = ix
            pos = [p * self.stride + t * self.dil - self.pad for p, t in zip(sp, taps)]
            ch = (f // fg) * cg + c if self.groups > 1 else c
            x = X[(n, *pos, ch)] if self.layout == "NHWC" else X[(n, ch, *pos)]
            w = Wt[(*taps, c, f)] if self.layout == "NHWC" else Wt[(f, c, *taps)]
            if self.pad:
                inside = None
                for p, e in zip(pos, self.size):
                    cond = (p >= 0) & (p < e)
                    inside = cond if inside is None else inside & cond
                x = tc.where(inside, x, tc.const(0, self.dtype))
            acc = tc.sum(tc.cast(x, "float32") * tc.cast(w, "float32"), axis=[c, *taps])
            if self.epilogue == "bias_relu":
                acc = tc.maximum(acc + extra["bias"][f], 0.0)
            elif self.epilogue == "bn_relu":
                acc = tc.maximum(acc * extra["scale"][f] + extra["shift"][f], 0.0)
            elif self.epilogue == "bn_residual":
                acc = acc * extra["scale"][f] + extra["shift"][f] + tc.cast(extra["res"][ix], "float32")
            return tc.cast(acc, self.dtype)

        Y = tc.compute(sh["Y"], body, name="Y")
        self.tensors = [X, Wt, *extra.values(), Y]
        return self.tensors

    def reference(self, x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(exact, Σ|x·w|) in float64, channels-last internally."""
        x, w = x.astype(np.float64), w.astype(np.float64)
        d = len(self.size)
        if self.layout != "NHWC":
            x = np.moveaxis(x, 1, -1)
            w = np.moveaxis(np.moveaxis(w, 0, -1), 0, -2)  # (F, Cg, *k) -> (*k, Cg, F)
        pad = [(0, 0)] + [(self.pad, self.pad + self.stride)] * d + [(0, 0)]
        xp = np.pad(x, pad)
        y = np.zeros((self.n, *self.out, self.f))
        ya = np.zeros_like(y)
        cg, fg = self.c // self.groups, self.f // self.groups
        for taps in itertools.product(*(range(k) for k in self.kernel)):
            win = xp[(slice(None),) + tuple(slice(t * self.dil, t * self.dil + self.stride * (o - 1) + 1, self.stride)
                                             for t, o in zip(taps, self.out))]
            for g in range(self.groups):
                xs, ws = win[..., g * cg:(g + 1) * cg], w[taps][:, g * fg:(g + 1) * fg]
                y[..., g * fg:(g + 1) * fg] += xs @ ws
                ya[..., g * fg:(g + 1) * fg] += np.abs(xs) @ np.abs(ws)
        if self.layout != "NHWC":
            y, ya = np.moveaxis(y, -1, 1), np.moveaxis(ya, -1, 1)
        return y, ya

    def run(self, plan: Any = "auto", seed: int = 0, target: str = "sim") -> tuple[Any, np.ndarray]:
        """Build, run on fresh inputs, and check against NumPy; returns (kernel, output)."""
        tensors = self.tensors or self.program()
        g = np.random.default_rng(seed)
        sh, dtype = self.shapes(), np_dtype(self.dtype)
        arrays = {"X": g.uniform(-1, 1, sh["X"]).astype(dtype), "Wt": g.uniform(-1, 1, sh["Wt"]).astype(dtype)}
        if "bias" in sh:
            arrays["bias"] = g.uniform(-1, 1, sh["bias"]).astype(np.float32)
        if "scale" in sh:
            arrays["scale"] = g.uniform(0.5, 2, sh["scale"]).astype(np.float32)
            arrays["shift"] = g.uniform(-1, 1, sh["shift"]).astype(np.float32)
        if self.epilogue == "bn_residual":
            arrays["res"] = g.uniform(-1, 1, sh["res"]).astype(dtype)
        y = np.full(sh["Y"], np.nan, dtype=dtype)
        f = tc.build(tensors, target=target, plan=plan)
        f(*[arrays[t.name] for t in tensors[:-1]], y)
        exact, size = self.reference(arrays["X"], arrays["Wt"])
        bound = (self.k + 1) * F32 * size
        want = exact
        if self.epilogue:
            shape = [1] * exact.ndim
            shape[-1 if self.layout == "NHWC" else 1] = self.f
            scale = arrays["scale"].astype(np.float64).reshape(shape) if "scale" in arrays else np.ones(shape)
            shift = arrays["shift" if "shift" in arrays else "bias"].astype(np.float64).reshape(shape)
            want = exact * scale + shift
            bound = bound * scale
            if self.epilogue == "bn_residual":
                want = want + arrays["res"].astype(np.float64)
            # three float32 roundings (product, sum, sum) of at most |exact·scale| + |shift| + |res| + bound
            bound = bound + 3 * F32 * (np.abs(exact * scale) + np.abs(shift) + 2 + bound)
            if self.epilogue.endswith("relu"):
                want = np.maximum(want, 0.0)
        bound = bound + EPS[self.dtype] * (np.abs(want) + bound)
        got = y.astype(np.float64)
        err = np.where(np.isnan(got), np.inf, np.abs(got - want) - bound)
        if (err > 0).any():
            i = np.unravel_index(int(np.argmax(err)), err.shape)
            raise AssertionError(f"{self}: plan {f.plan.strategy}: {(err > 0).sum()} of {err.size} elements off; "
                                 f"worst at {tuple(map(int, i))}: got {got[i]!r}, want {want[i]!r} "
                                 f"(bound {bound[i]:.3g})")
        return f, y


def tensorize_plan(block: tuple[int, int] = (64, 64), warps: tuple[int, int] = (2, 2), k_tile: int = 32,
                   stages: int = 2) -> dict[str, Any]:
    return {"strategy": "manual", "reason": "test", "steps": [
        {"primitive": "tensorize", "args": {"stage": "Y", "intrinsic": "auto", "block": list(block),
                                            "warps": list(warps), "k_tile": k_tile, "stages": stages}}]}


def copies(f: Any) -> dict[str, int]:
    """Bytes per cp.async copy of each operand in the built kernel (absent: element loads)."""
    out: dict[str, int] = {}
    for k in f.module.kernels:
        for s in iter_stmts(k.body):
            if isinstance(s, AsyncCopy):
                out[s.src.name] = s.bytes
    return out


# ---- correctness of the implicit GEMM, shape by shape ---------------------------------------------

CASES = {
    "nhwc_3x3_pad1": Conv(2, (7, 7), 16, 24, (3, 3), pad=1),
    "nchw_3x3_pad1": Conv(2, (7, 7), 16, 24, (3, 3), pad=1, layout="NCHW"),
    "nhwc_stride2": Conv(2, (9, 9), 16, 16, (3, 3), stride=2, pad=1),
    "nchw_stride2": Conv(1, (9, 9), 8, 16, (3, 3), stride=2, pad=1, layout="NCHW"),
    "nhwc_dilation2": Conv(2, (9, 9), 16, 16, (3, 3), pad=2, dil=2),
    "nhwc_1x1": Conv(2, (7, 7), 32, 40, (1, 1)),
    "nchw_1x1": Conv(2, (7, 7), 32, 16, (1, 1), layout="NCHW"),
    "nhwc_c3": Conv(2, (7, 7), 3, 16, (3, 3), pad=1),          # C % 8 != 0: guarded loads of X
    "nhwc_5x5_no_pad": Conv(1, (11, 11), 8, 16, (5, 5)),
    "nhwc_groups2": Conv(2, (7, 7), 16, 32, (3, 3), pad=1, groups=2),
    "nchw_groups2": Conv(1, (7, 7), 16, 16, (3, 3), pad=1, groups=2, layout="NCHW"),
    "nhwc_f12": Conv(2, (7, 7), 16, 12, (3, 3), pad=1),         # filter rows of 12 halves: 8-byte copies
    "nchw_odd_everything": Conv(2, (11, 9), 5, 7, (3, 3), stride=2, pad=2, dil=2, layout="NCHW"),
    "conv1d": Conv(2, (33,), 16, 16, (3,), pad=1),
    "conv3d": Conv(1, (5, 5, 5), 8, 16, (3, 3, 3), pad=1),
    "bias_relu": Conv(2, (7, 7), 16, 16, (3, 3), pad=1, epilogue="bias_relu"),
    "bn_relu": Conv(2, (7, 7), 16, 16, (3, 3), pad=1, epilogue="bn_relu", stride=2),
    "bn_residual": Conv(2, (7, 7), 16, 16, (3, 3), pad=1, epilogue="bn_residual", layout="NCHW"),
    # NCHW with an even output row: the columns (n, p, q) are stored in pairs along q (output_pair)
    "nchw_even_q_residual": Conv(2, (8, 8), 16, 16, (3, 3), pad=1, epilogue="bn_residual", layout="NCHW"),
    "nhwc_stride2_residual": Conv(2, (9, 9), 16, 24, (3, 3), stride=2, pad=1, epilogue="bn_residual"),
}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_implicit_gemm_matches_numpy(case: str, dtype: str) -> None:
    conv = CASES[case]
    conv = Conv(**{**conv.__dict__, "dtype": dtype, "tensors": []})
    f, _ = conv.run(plan=tensorize_plan())
    assert any(isinstance(s, MatrixMultiply) for k in f.module.kernels for s in iter_stmts(k.body)), case


WGMMA_PLAN = {"strategy": "manual", "reason": "test", "steps": [
    {"primitive": "tensorize", "args": {"stage": "Y", "intrinsic": "wgmma", "block": [64, 64], "warps": [4, 1],
                                        "k_tile": 64, "stages": 3}}]}


@pytest.mark.parametrize("case", list(CASES))
def test_implicit_gemm_on_wgmma_matches_numpy(case: str) -> None:
    """The Hopper path (tensorize_wgmma) stages its tiles through the same gathered loads."""
    conv = Conv(**{**CASES[case].__dict__, "tensors": []})
    f, _ = conv.run(plan=WGMMA_PLAN)
    assert "wgmma" in dict(f.module.kernels[0].attrs)["tensorize"], case


def test_gathered_loads_are_16_byte_copies_when_the_channels_allow() -> None:
    """NHWC with C % 8 == 0: k = (r·S + s)·C + c, so 8 consecutive k are 16 contiguous bytes of X
    with one padding predicate; the RSCF filter's rows of F halves copy along f."""
    f, _ = Conv(2, (7, 7), 16, 16, (3, 3), pad=1).run(plan=tensorize_plan())
    assert copies(f) == {"X": 16, "Wt": 16}
    # C = 3: X's channel runs are 6 bytes, so X goes through guarded element loads; the filter,
    # read along f, still copies
    f, _ = Conv(2, (7, 7), 3, 16, (3, 3), pad=1).run(plan=tensorize_plan())
    assert copies(f) == {"Wt": 16}
    # F = 12: the filter's rows of 12 halves are 3 aligned runs of 4 (8-byte copies)
    f, _ = Conv(2, (7, 7), 16, 12, (3, 3), pad=1).run(plan=tensorize_plan())
    assert copies(f) == {"X": 16, "Wt": 8}
    # NCHW: X's contiguous axis w = q + s - 1 mixes a row and a reduction axis (element loads); the
    # KCRS filter is a plain [F][C·R·S] matrix, 144 halves per row: 16-byte copies across (c, r, s)
    f, _ = Conv(1, (7, 7), 16, 16, (3, 3), pad=1, layout="NCHW").run(plan=tensorize_plan())
    assert copies(f) == {"Wt": 16}


@pytest.mark.parametrize("intrinsic", ["auto", "wgmma"])
def test_the_epilogue_stores_column_pairs_with_one_vector_store(intrinsic: str) -> None:
    """Accumulator elements 2j, 2j + 1 are adjacent columns of one row (mma.sync's C and wgmma's
    D fragments): with an even innermost column extent the epilogue stores them with one 4-byte
    store and reads the residual the same way (codegen's vectorize loop); an odd one keeps
    scalar stores. The sums are checked against NumPy in the emulator."""
    plan = WGMMA_PLAN if intrinsic == "wgmma" else tensorize_plan()
    f, _ = Conv(2, (7, 7), 16, 16, (3, 3), pad=1, epilogue="bn_residual").run(plan=plan)
    source = f.source
    assert "*reinterpret_cast<unsigned int*>(&Y[" in source, "paired output store"
    assert "*reinterpret_cast<const unsigned int*>(&res[" in source, "paired residual load"
    f, _ = Conv(2, (7, 7), 16, 7, (3, 3), pad=1).run(plan=plan)
    assert "reinterpret_cast<unsigned int*>(&Y[" not in f.source, "F = 7: no pairs"


def staged(plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` with the tensorize step's output staged through shared memory."""
    step = plan["steps"][0]
    return {**plan, "steps": [{**step, "args": {**step["args"], "staged_output": True}}]}


STAGED_CASES = {
    "nhwc_3x3_residual": Conv(2, (7, 7), 16, 16, (3, 3), pad=1, epilogue="bn_residual"),
    "nhwc_stride2_f24": Conv(2, (9, 9), 16, 24, (3, 3), stride=2, pad=1),       # N = 24: a partial column tile
    "nhwc_1x1_odd_rows": Conv(3, (5, 7), 32, 64, (1, 1), epilogue="bias_relu"),  # M = 105: a partial row tile
    "nhwc_dilation2_c3": Conv(1, (9, 9), 3, 16, (3, 3), pad=2, dil=2),
    "conv1d": Conv(2, (33,), 16, 16, (3,), pad=1),
}


@pytest.mark.parametrize("intrinsic", ["auto", "wgmma"])
@pytest.mark.parametrize("case", list(STAGED_CASES))
def test_a_staged_output_matches_numpy(case: str, intrinsic: str) -> None:
    """staged_output: the epilogue writes the block's outputs (bias, relu, residual fused) into a
    padded shared tile, a barrier, then 16-byte chunks to the output, edges guarded; the emulator
    checks the values against NumPy and the shared tile for races."""
    conv = Conv(**{**STAGED_CASES[case].__dict__, "tensors": []})
    f, _ = conv.run(plan=staged(WGMMA_PLAN if intrinsic == "wgmma" else tensorize_plan()))
    assert "*reinterpret_cast<uint4*>(&Y[" in f.source, "16-byte output stores"


def test_a_staged_output_is_copied_by_elements_or_refused_where_chunks_do_not_fit() -> None:
    """F = 12 is no whole number of 16-byte chunks: its rows are copied out element by element
    (and match NumPy); NCHW's columns are (n, p, q): refused; the TMA ring's producer takes no
    part in the epilogue's barrier."""
    f, _ = Conv(2, (7, 7), 16, 12, (3, 3), pad=1).run(plan=staged(tensorize_plan()))
    from tecc.ir.stmt import Allocate, iter_stmts

    tiles = [s.buffer.name for s in iter_stmts(f.module.kernels[0].body) if isinstance(s, Allocate)
             and s.buffer.scope == "shared" and s.buffer.name.endswith("_out")]
    assert tiles == ["Y_out"], tiles   # the staged output tile
    with pytest.raises(tc.ScheduleError, match=r"epilogue\(.*'staged'\): the output is copied out along one column"):
        Conv(2, (8, 8), 16, 16, (3, 3), pad=1, layout="NCHW").run(plan=staged(tensorize_plan()))
    A = tc.placeholder((128, 64), "float16", "A")
    B = tc.placeholder((64, 128), "float16", "B")
    k = tc.reduce_axis(64, "k")
    C = tc.compute((128, 128), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=[k]), name="C")
    with pytest.raises(tc.ScheduleError, match="the staged epilogue is built for the cp.async ring only"):
        schedule_tensor_core(tc.Schedule([A, B, C]), "C", intrinsic="wgmma", block=(128, 128), warps=(8, 1), k_tile=64,
                                         stages=3, producer="tma", staged_output=True)


def test_the_tensor_core_spaces_offer_staged_outputs_and_no_rings_deeper_than_the_k_loop() -> None:
    """The ResNet 1x1 layer 56x56, 64 -> 256 channels (K = 64: one wgmma k tile): no wgmma or
    mma.sync ring deeper than the k loop needs (mma.sync's took 4 stages, 128 KiB); staged-output
    points where the output's rows are whole 16-byte chunks, priced with fewer L2 bytes and L1
    wavefronts than in registers; for F = 12 too (rows of 24 bytes: copied out element by element)."""
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.compiler.planner import resolve_target
    from tecc.compiler.strategies import get
    from tecc.passes.lower import lower

    target = resolve_target("sm_90")
    info = analyze_kernel(lower(Conv(32, (56, 56), 64, 256, (1, 1)).program()).kernels[0])
    wgmma, mma = get("gemm_wgmma"), get("gemm_tensor_core")
    wg_points = list(wgmma.space(info, target))
    assert wg_points and max(int(p["stages"]) for p in wg_points) == 2
    mma_points = list(mma.space(info, target))
    # mma.sync's ring loads S - 1 k tiles ahead: none deeper than one stage past the k loop's
    for p in mma_points:
        k_tiles = -(-64 // int(p["bk"]))
        assert int(p["stages"]) <= max(2, k_tiles + 1), p
    for strategy, points in ((wgmma, wg_points), (mma, mma_points)):
        staged_points = [p for p in points if p.get("staged_output")]
        assert staged_points, strategy.name
        for p in staged_points:
            plain = strategy.workload(info, {k: v for k, v in p.items() if k != "staged_output"}, target)
            staged_w = strategy.workload(info, p, target)
            assert staged_w.l2_bytes < plain.l2_bytes and staged_w.global_wavefronts < plain.global_wavefronts
            assert staged_w.smem_bytes > plain.smem_bytes
    info12 = analyze_kernel(lower(Conv(2, (7, 7), 16, 12, (3, 3), pad=1).program()).kernels[0])
    assert any(p.get("staged_output") for p in mma.space(info12, target))


def test_a_1x1_convolution_is_a_plain_gemm_over_n_p_q() -> None:
    """1x1, stride 1, no padding: no predicate beyond the matrix edges, both operands copied."""
    f, _ = Conv(2, (7, 7), 32, 40, (1, 1)).run(plan=tensorize_plan(k_tile=32, stages=3))
    assert copies(f) == {"X": 16, "Wt": 16}


# ---- the GEMM view, as data ------------------------------------------------------------------------

def test_copy_runs_follow_strides_guards_and_alignment() -> None:
    """implicit_gemm.contiguous_copy on hand-written layouts (flat strides of row-major buffers)."""
    from tecc.passes.schedule.implicit_gemm import contiguous_copy, layout_of

    # NHWC X[n, p + r - 1, q + s - 1, c] of shape (2, 7, 7, C), guarded on p, r, q, s
    def nhwc(c: int) -> Any:
        return layout_of([({"n": 1}, 0), ({"p": 1, "r": 1}, -1), ({"q": 1, "s": 1}, -1), ({"c": 1}, 0)],
                         [2, 7, 7, c], frozenset({"p", "r", "q", "s"}))
    k = [("r", 3), ("s", 3), ("c", 16)]
    assert contiguous_copy(nhwc(16), k) == 8                          # c: 16 contiguous halves
    assert contiguous_copy(nhwc(12), [("r", 3), ("s", 3), ("c", 12)]) == 4   # 12 = 3 chunks of 4
    assert contiguous_copy(nhwc(3), [("r", 3), ("s", 3), ("c", 3)]) == 0     # 3 halves: no copy
    # without the guard, (s, c) would merge into a run of 48 only if s's stride were C: it is
    assert contiguous_copy(layout_of([({"s": 1}, 0), ({"c": 1}, 0)], [3, 16]), [("s", 3), ("c", 16)]) == 8
    # KCRS W[f, c, r, s] of shape (16, 16, 3, 3): (c, r, s) is one run of 144
    kcrs = layout_of([({"f": 1}, 0), ({"c": 1}, 0), ({"r": 1}, 0), ({"s": 1}, 0)], [16, 16, 3, 3])
    assert contiguous_copy(kcrs, [("c", 16), ("r", 3), ("s", 3)]) == 8
    assert contiguous_copy(kcrs, [("r", 3), ("s", 3), ("c", 16)]) == 0    # c innermost is stride 9
    # a symbolic leading extent keeps the run: its stride is a multiple of the known extents
    assert contiguous_copy(layout_of([({"i": 1}, 0), ({"k": 1}, 0)], [None, 64]), [("k", 64)]) == 8


def test_groups_are_ordered_by_the_operands_strides() -> None:
    """K is flattened so that the activations' channel axis is innermost (NHWC) or so that the
    KCRS filter is a plain matrix (NCHW); M in the activations' memory order."""
    from tecc.passes.schedule.implicit_gemm import match_contraction
    from tecc.passes.lower import lower

    for layout, ks in (("NHWC", ["r", "s", "c"]), ("NCHW", ["c", "r", "s"])):
        conv = Conv(2, (7, 7), 16, 16, (3, 3), pad=1, layout=layout)
        c = match_contraction(lower(conv.program()).kernels[0], "Y")
        assert [v.name for v, _ in c.ks] == ks, layout
        # the output's axes are i0.. (body(*ix)): NHWC rows (n, p, q); NCHW rows f (the filter is A)
        assert [v.name for v, _ in c.rows] == (["i0", "i1", "i2"] if layout == "NHWC" else ["i1"]), layout
        assert (c.a.copy, c.b.copy) == ((8, 8) if layout == "NHWC" else (8, 0)), layout


# ---- the planner ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_auto_plan_puts_a_half_convolution_on_tensor_cores(layout: str) -> None:
    conv = Conv(4, (14, 14), 64, 64, (3, 3), pad=1, layout=layout)
    f, _ = conv.run()
    assert f.plan.strategy in TENSOR_CORE, f.plan.reason


def test_float32_convolutions_stay_on_the_simt_path() -> None:
    conv = Conv(1, (7, 7), 8, 16, (3, 3), pad=1, dtype="float32")
    f, _ = conv.run()
    assert f.plan.strategy not in TENSOR_CORE
    from tecc.compiler.planner import candidates_for
    from tecc.compiler.cost.analysis import analyze_kernel
    from tecc.passes.lower import lower

    info = analyze_kernel(lower(conv.tensors).kernels[0])
    _, declined = candidates_for(info, tc.target("sm_90"))
    assert ("gemm_tensor_core", "float16 or bfloat16 operands only") in declined


def depthwise(c: int = 16, dtype: str = "float16") -> list[tc.Tensor]:
    X = tc.placeholder((2, 9, 9, c), dtype, "X")
    Wt = tc.placeholder((3, 3, c), dtype, "Wt")
    r, s = tc.reduce_axis(3, "r"), tc.reduce_axis(3, "s")

    def body(n: Any, p: Any, q: Any, ch: Any) -> Any:
        h, w = p + r - 1, q + s - 1
        x = tc.where((h >= 0) & (h < 9) & (w >= 0) & (w < 9), X[n, h, w, ch], tc.const(0, dtype))
        return tc.cast(tc.sum(tc.cast(x, "float32") * tc.cast(Wt[r, s, ch], "float32"), axis=[r, s]), dtype)
    return [X, Wt, tc.compute((2, 9, 9, c), body, name="Y")]


def test_depthwise_convolution_is_declined_by_tensor_cores_and_correct() -> None:
    """groups == C: every output axis indexes the activations, no column axis: a memory-bound
    stencil. The tensor-core strategy declines it with that reason; a SIMT schedule runs it."""
    tensors = depthwise()
    result = tc.plan_program(tensors, "sm_90")
    declined = dict(result.kernels[0].declined)
    assert "depthwise" in declined["gemm_tensor_core"], declined
    text = tc.explain(result)
    assert "depthwise" in text
    with pytest.raises(tc.ScheduleError, match="no column axis"):
        tc.Schedule(tensors).tensorize("Y")
    f = tc.build(tensors, target="sim")
    g = np.random.default_rng(3)
    x = g.uniform(-1, 1, (2, 9, 9, 16)).astype(np.float16)
    w = g.uniform(-1, 1, (3, 3, 16)).astype(np.float16)
    y = np.full((2, 9, 9, 16), np.nan, np.float16)
    f(x, w, y)
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = sum(xp[:, r:r + 9, s:s + 9] * w[r, s].astype(np.float64) for r in range(3) for s in range(3))
    size = sum(np.abs(xp[:, r:r + 9, s:s + 9] * w[r, s].astype(np.float64)) for r in range(3) for s in range(3))
    bound = 10 * F32 * size + EPS["float16"] * (np.abs(want) + 10 * F32 * size)
    assert np.all(np.abs(y.astype(np.float64) - want) <= bound), f.plan


def test_refusals_name_the_condition() -> None:
    X = tc.placeholder((2, 9, 9, 16), "float16", "X")
    Wt = tc.placeholder((3, 3, 16, 16), "float16", "Wt")
    c, r, s = tc.reduce_axis(16, "c"), tc.reduce_axis(3, "r"), tc.reduce_axis(3, "s")
    Y = tc.compute((2, 7, 7, 16), lambda n, p, q, f: tc.sum(X[n, p * r, q + s, c] * Wt[r, s, c, f],
                                                            axis=[c, r, s]), name="Y")
    with pytest.raises(tc.ScheduleError, match="not affine"):
        tc.Schedule([X, Wt, Y]).tensorize("Y")
    X24 = tc.placeholder((2, 9, 9, 24), "float16", "X24")
    Z = tc.compute((2, 7, 7, 16), lambda n, p, q, f: tc.sum(X24[n, p + r, q + s, (f // 3) + c] * Wt[r, s, c, f],
                                                            axis=[c, r, s]), name="Z")
    with pytest.raises(tc.ScheduleError, match="divides its constant extent"):
        tc.Schedule([X24, Wt, Z]).tensorize("Z")


# ---- NVRTC -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_resnet_layer_kernels_compile_without_spills(layout: str, arch: str) -> None:
    """The ResNet-50 3x3 layer at 56x56x64 (batch 32) through NVRTC: no spills."""
    conv = Conv(32, (56, 56), 64, 64, (3, 3), pad=1, layout=layout)
    sch = tc.Schedule(conv.program())
    # NCHW's activations go through registers (element loads): a smaller block keeps them there
    block = (128, 128) if layout == "NHWC" else (128, 64)
    schedule_tensor_core(sch, "Y", block=block, warps=(2, 2), k_tile=32, stages=3)
    func = sch.mod.kernels[0]
    compiled = compile_cuda(emit_source([func]), arch=arch, name=func.name)
    res = compiled.resources[func.name]
    assert (res.spill_stores, res.spill_loads, res.stack_bytes) == (0, 0, 0), f"{arch}: {res}"
    assert res.registers <= 255
    for mnemonic in ("mma.sync.aligned.m16n8k16.row.col.f32", "ldmatrix.sync.aligned.m8n8.x4", "cp.async"):
        assert mnemonic in compiled.ptx, mnemonic


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
def test_resnet_layer_wgmma_kernels_compile_for_sm_90a_without_spills(layout: str) -> None:
    """The same layer on the Hopper path: wgmma reads the gathered tiles through descriptors."""
    conv = Conv(32, (56, 56), 64, 64, (3, 3), pad=1, layout=layout)
    sch = tc.Schedule(conv.program())
    schedule_tensor_core(sch, "Y", intrinsic="wgmma", block=(128, 64), warps=(8, 1), k_tile=64, stages=4)
    f = tc.build(sch, target="cuda", arch="sm_90")
    (r,) = f.resources.values()
    assert f.arch == "sm_90a"
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert r.registers <= 255
    assert "wgmma.mma_async.sync.aligned.m64n64k16" in f.ptx


# ---- on a GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("intrinsic", ["auto", "wgmma"])
@pytest.mark.parametrize("conv", [Conv(32, (56, 56), 64, 256, (1, 1)),
                                  Conv(32, (56, 56), 64, 64, (3, 3), pad=1, epilogue="bn_residual")],
                         ids=["resnet_1x1_56_64_256", "resnet_3x3_56_residual"])
def test_staged_output_resnet_layers_on_the_gpu(conv: Conv, intrinsic: str) -> None:
    """The staged output (and paired stores) on the device, against float64 NumPy; wgmma needs
    sm_90."""
    from tecc.compiler.planner import resolve_target

    if intrinsic == "wgmma" and resolve_target(None).sm != 90:
        pytest.skip("wgmma needs sm_90")
    plan = (staged(WGMMA_PLAN) if intrinsic == "wgmma" else
            staged(tensorize_plan(block=(128, 64), warps=(2, 2), k_tile=32, stages=3)))
    if intrinsic == "wgmma":
        plan["steps"][0]["args"].update(block=[128, 128], warps=[8, 1], stages=2)
    f, _ = Conv(**{**conv.__dict__, "tensors": []}).run(plan=plan, target="cuda")
    assert "tensorize" in dict(f.module.kernels[0].attrs)


@pytest.mark.gpu
@pytest.mark.parametrize("conv", [Conv(32, (56, 56), 64, 64, (3, 3), pad=1),
                                  Conv(32, (56, 56), 64, 256, (1, 1)),
                                  Conv(32, (56, 56), 64, 64, (3, 3), pad=1, layout="NCHW", epilogue="bias_relu")],
                         ids=["resnet_3x3_56", "resnet_1x1_56_64_256", "nchw_3x3_bias_relu"])
def test_resnet_layers_on_the_gpu(conv: Conv) -> None:
    f, _ = conv.run(target="cuda")
    if conv.layout == "NHWC":
        assert f.plan.strategy in TENSOR_CORE, f.plan.reason
