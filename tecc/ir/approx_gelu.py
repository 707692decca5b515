"""The cheap GELUs behind the intrinsics `gelu_erf_approx` / `gelu_tanh_approx` (APPROX_INTRINSICS
in expr_nodes.py): the algorithms, their constants and their error bounds. The CUDA emitter prints
these constants into device helpers (tecc.codegen.cuda_expr), the SIMT emulator runs the same steps
in NumPy float32 (tecc.runtime.sim.numerics), and the approx_math pass writes the calls where a
GELU's float32 value is rounded to a 16-bit float at once (tecc/passes/approx_math.py).

Why: the precise forms cost ~40 issued instructions per element on sm_90 (erff's two ranges are
both evaluated and selected, ~22 FFMA/FSEL plus an MUFU.EX2; tanhf an MUFU.EX2, an MUFU.RCP and
its range logic: counted in the PTX of the fused GEMM's epilogue, NVRTC 13), which in a GEMM's
epilogue is issued by the consumer warps between two tiles' k loops.

gelu_tanh_approx(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  -- torch's approximate="tanh"
    The identity 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)) makes it, exactly,
        y = x / (1 + 2^t),   t = x (TANH_A + TANH_B x^2),   TANH_A = -2 sqrt(2/pi) log2(e),
                                                           TANH_B = 0.044715 TANH_A
    in float32: s = x*x; t = x * fma(s, TANH_B, TANH_A); e = ex2.approx(t); y = x * rcp.approx(1 + e)
    (5 FP32 instructions and 2 MUFU). Nothing is fitted: the error is the roundings'. t carries
    three roundings, |dt| <= 3 * 2^-24 |t|, so e's relative error is <= ln 2 * 3 * 2^-24 |t| +
    2^-22 (ex2.approx: PTX ISA, "ex2"); 1 + e, the reciprocal (rcp.approx: 1 ulp) and the product
    add 2^-24 + 2^-23 + 2^-24, and y's relative error is e / (1 + e) times e's plus those:
        |y' - y| <= (2^-21 + 2^-22.6 |t|) |y|          (TANH_RELATIVE(t))
    that is <= 2^-17.8 |y| for |x| <= 5 (|t| <= 24.4) and <= 2^-15.6 |y| wherever y is a normal
    float32 (|t| <= 126). Where 1 + e overflows or its reciprocal is subnormal (x below about -9.6)
    the result is -0 (flushed), against a true |y| < 2^-122; +inf gives +inf and -inf NaN, as the
    tanh formula does in float32.

gelu_erf_approx(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2))            -- torch's approximate="none"
    With h(x) = Phi(-|x|) = 0.5 erfc(|x| / sqrt 2):  y = x h for x < 0, y = x (1 - h) for x >= 0
    (no cancellation on either side: h <= 1/2). h = 2^q with q a polynomial in
    u = min(fma(|x|, ERF_SCALE, -1), 1) -- |x| / sqrt 2 mapped from [0, ERF_RANGE] onto [-1, 1],
    held at 1 beyond --: q(u) ~ log2(erfc(z)) - 1, z = ERF_RANGE (u + 1) / 2, ERF_POLY its
    coefficients from u^0 up (the -1 folded into the first), fitted by Lawson's algorithm
    (iteratively reweighted least squares on Chebyshev nodes, float64) for the least maximum
    absolute error in q (2^-17.7 before rounding to float32), which is h's relative error over
    ln 2. In float32: FFMA + FMNMX (u), 7 FFMA (Horner), MUFU.EX2, FADD (1 - h), FSETP + FSEL,
    FMUL: 12 FP32 instructions and one MUFU.
    Measured in float64 against x Phi(x) over 400 000 float32 arguments (tests/test_approx_gelu.py
    keeps a sweep): relative error 2^-17.4 at most for x >= -6.01 (z <= ERF_RANGE), including the
    float32 evaluation; ex2.approx adds 2^-22. Below -6.01 the argument is held at the range's end,
    y = x Phi(-6.01) = 9.3e-10 x, while the true |y| is smaller still: the error is <= 2^-29.9 |x|.
        |y' - y| <= 2^-17 |y| + 2^-29 |x|               (ERF_RELATIVE, ERF_ABSOLUTE_PER_X)
    +inf gives +inf, NaN gives NaN, -inf gives -inf (the precise formula: NaN; the limit: -0).

What that means for a 16-bit result: half an ulp is at least 2^-12 of the value for float16 and
2^-9 for bfloat16 (normal range), so both errors are below 1/16 of it where it matters (|x| <= 5):
the rounded result is the correctly rounded one, or its neighbour when the exact value lies within
1/16 ulp of a rounding boundary. The precise float32 formulas are no better at the negative tail:
1 + erff(x / sqrt 2) loses everything below erff's ulp near -1 (2^-24), an absolute 2^-25 |x| in y,
i.e. 2^-10 of y at x = -4 and all of it below x = -5.9 (y becomes -0), which the cheap form keeps to
2^-17 (it computes the tail, not 1 minus the head).
"""

from __future__ import annotations

import math

# ---- gelu_tanh_approx ----
LOG2E = 1.0 / math.log(2.0)
TANH_A = -2.0 * math.sqrt(2.0 / math.pi) * LOG2E      # -2.30220819
TANH_B = 0.044715 * TANH_A                            # -0.102943239

# ---- gelu_erf_approx ----
# |x| / sqrt 2 in [0, ERF_RANGE] maps onto u in [-1, 1]: u = |x| * ERF_SCALE - 1
ERF_RANGE = 4.25
ERF_SCALE = math.sqrt(2.0) / ERF_RANGE                # 2 / (ERF_RANGE sqrt 2), float32-rounded where used
# q(u) = log2(0.5 erfc(z)), z = ERF_RANGE (u + 1) / 2: coefficients of u^0 .. u^7 (float32 values)
ERF_POLY = (
    float.fromhex("-0x1.31d7e0p+3"),   # -9.55760193  (the fit's -8.55760193, minus 1 for the 0.5)
    float.fromhex("-0x1.c82a7cp+3"),   # -14.2551556
    float.fromhex("-0x1.839556p+2"),   # -6.05599356
    float.fromhex("-0x1.a26c30p-3"),   # -0.204309106
    float.fromhex("0x1.78af76p-4"),    # 0.0919718593
    float.fromhex("-0x1.50f76ep-5"),   # -0.0411335938
    float.fromhex("0x1.15959ep-6"),    # 0.0169433318
    float.fromhex("-0x1.0a36f6p-8"),   # -0.00405636891
)

# The bounds above, for tests and docs.
ERF_RELATIVE = 2.0 ** -17
ERF_ABSOLUTE_PER_X = 2.0 ** -29
ERF_NEGATIVE_END = -ERF_RANGE * math.sqrt(2.0)        # -6.0104: below it the argument is held


def tanh_relative(t: float) -> float:
    """gelu_tanh_approx's relative error bound at exponent t = x (TANH_A + TANH_B x^2)."""
    return float(2.0 ** -21 + 2.0 ** -22.6 * abs(t))


__all__ = ["ERF_ABSOLUTE_PER_X", "ERF_NEGATIVE_END", "ERF_POLY", "ERF_RANGE", "ERF_RELATIVE", "ERF_SCALE", "LOG2E",
           "TANH_A", "TANH_B", "tanh_relative"]
