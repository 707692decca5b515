"""The device helpers of the cheap GELUs, `tecc_gelu_erf_approx` / `tecc_gelu_tanh_approx`
(tecc/ir/approx_gelu.py: the algorithms, constants and error bounds; the emulator runs the same
steps in tecc.runtime.sim.numerics). Printed once per translation unit, only when a kernel calls
them (cuda_expr.device_helpers). ex2 and rcp are written as inline PTX (`ex2.approx.ftz.f32`,
`rcp.approx.ftz.f32`: one MUFU each), so the instruction counts the cost model assumes are the
ones ptxas gets, whatever -use_fast_math says."""

from __future__ import annotations

from typing import Callable

from ..ir import approx_gelu

HELPER_NAMES = ("tecc_gelu_ex2", "tecc_gelu_rcp", "tecc_gelu_erf_approx", "tecc_gelu_tanh_approx")


# a float32 value as a C literal (cuda_expr's float_literal, passed in: cuda_expr imports this module)
Literal = Callable[[float], str]


_MUFU = (
    "__device__ __forceinline__ float tecc_gelu_ex2(float x) {  // one MUFU.EX2, subnormals flushed\n"
    "  float y;\n"
    "  asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x));\n"
    "  return y;\n"
    "}\n"
    "__device__ __forceinline__ float tecc_gelu_rcp(float x) {  // one MUFU.RCP (1 ulp), subnormals flushed\n"
    "  float y;\n"
    "  asm(\"rcp.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x));\n"
    "  return y;\n"
    "}\n")


def _erf_helper(_f: Literal) -> str:
    c = [_f(v) for v in approx_gelu.ERF_POLY]
    horner = "".join(f"  q = fmaf(q, u, {v});\n" for v in reversed(c[:-1]))
    return ("// gelu_erf_approx (tecc/ir/approx_gelu.py): x Phi(x) for a value rounded to a 16-bit float;\n"
            "// relative error <= 2^-17, plus 2^-29 |x| below x = -6.01.\n"
            "__device__ __forceinline__ float tecc_gelu_erf_approx(float x) {\n"
            f"  const float u = fminf(fmaf(fabsf(x), {_f(approx_gelu.ERF_SCALE)}, -1.0f), 1.0f);"
            "  // |x| / sqrt 2 onto [-1, 1], held beyond\n"
            f"  float q = {c[-1]};\n"
            + horner +
            "  const float h = tecc_gelu_ex2(q);  // Phi(-|x|)\n"
            "  return x * (x < 0.0f ? h : 1.0f - h);\n"
            "}\n")


def _tanh_helper(_f: Literal) -> str:
    return ("// gelu_tanh_approx (tecc/ir/approx_gelu.py): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))\n"
            "// = x / (1 + 2^t) exactly; relative error <= 2^-21 + 2^-22.6 |t|.\n"
            "__device__ __forceinline__ float tecc_gelu_tanh_approx(float x) {\n"
            f"  const float t = x * fmaf(x * x, {_f(approx_gelu.TANH_B)}, {_f(approx_gelu.TANH_A)});\n"
            "  return x * tecc_gelu_rcp(1.0f + tecc_gelu_ex2(t));\n"
            "}\n")


def gelu_helpers(intrinsics: set[str], literal: Literal) -> list[str]:
    """The helpers the calls in `intrinsics` need, in dependency order (none when no GELU is called)."""
    wanted = [name for name in ("gelu_erf_approx", "gelu_tanh_approx") if name in intrinsics]
    if not wanted:
        return []
    helpers = [_MUFU]
    if "gelu_erf_approx" in wanted:
        helpers.append(_erf_helper(literal))
    if "gelu_tanh_approx" in wanted:
        helpers.append(_tanh_helper(literal))
    return helpers


__all__ = ["HELPER_NAMES", "gelu_helpers"]
