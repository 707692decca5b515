"""The cheap sin and cos behind the intrinsics `sin_approx` / `cos_approx` (APPROX_INTRINSICS in
expr.py): the algorithm, its constants and its error bound. The CUDA emitter prints these
constants into a device helper (tecc.codegen.cuda_expr) and the SIMT emulator runs the same steps
in NumPy float32 (tecc.runtime.sim.numerics), so both read them from here.

For |x| <= FAST_RANGE, in float32 with fused multiply-adds:

    sin:  t = fma(x, INV_PI, ROUND_MAGIC)            n = t - ROUND_MAGIC = rint(x / pi),  m = n
    cos:  t = fma(x, INV_PI, -0.5) + ROUND_MAGIC     n = t - ROUND_MAGIC,                 m = n + 1/2
          r = fma(m, -PI_HI, x);  r = fma(m, -PI_LO, r)          x = m*pi + r,  |r| <= pi/2 + 0.012
          sin x = sin((-1)^n r)      cos x = sin((-1)^(n+1) r)   (the flip is exact: n's parity is
                                                                  the low mantissa bit of t)
          sin r ~ r * (1 + r^2 (S1 + r^2 (S2 + r^2 (S3 + r^2 S4))))

and the precise sinf / cosf beyond FAST_RANGE and for inf (a branch, as libdevice's own
sinf takes for |x| > 105615). On sm_90 that is 12 FP32/logic instructions (cos 14), ~19 issued per
call with the range test, its branch and constant moves, against ~27 for sinf's fast path (both
read off the SASS of the bf16 sin benchmark kernel). Not __sinf (MUFU.SIN) after the reduction,
which would save ~5 of them: its error is absolute (2^-21.41 on [-pi, pi], CUDA Programming
Guide), as large as half a float16 ulp at 2^-10 and any multiple of a tiny result's own size,
where the polynomial's is relative.

Why each step is exact or bounded:
- ROUND_MAGIC = 1.5 * 2^23: y + ROUND_MAGIC lies in [2^23, 2^24), where float32's spacing is 1,
  so the sum rounds y to an integer (ties to even) for |y| < 2^22, and the low bit of its bits is
  n's parity. The fma rounds the exact x * INV_PI, so n = rint(x * INV_PI) with one rounding.
- |x / pi - m| <= 1/2 + |x| * |INV_PI - 1/pi| + (cos) 2^-9 (the rounding of fma(x, INV_PI, -0.5)
  below 2^16) <= 0.5037 for |x| <= 2^17, so |r| <= 1.5823; the polynomial is fitted on
  |r| <= pi/2 + 0.02.
- PI_HI is pi rounded *down* to float32 and PI_LO = float32(pi - PI_HI): both positive, so for
  m = +0 both products are -0 and sin(-0) keeps its sign. The first fma is exact: for m = 0 it
  gives x; otherwise, when |x| >= 1, x and m * PI_HI are multiples of 2^-23 and |r| < 2. The one
  case left (cos, |x| < 1, m = +-1/2) rounds once, as the second fma always does: relative 2^-24
  of |r|. What is left of pi, |pi - PI_HI - PI_LO| = 3.43e-15, times |m| <= 41724 is an absolute
  error <= 1.5e-10.
- S1..S4: the minimax polynomial for the *relative* error of sin on |r| <= pi/2 + 0.02 (Lawson's
  algorithm in float64), rounded to float32: 2^-27.1 before rounding; the float32 evaluation adds
  about three roundings of 2^-24.

Error bound, |x| <= 2^17:  |sin_approx(x) - sin(x)| <= 2^-21.9 * |sin(x)| + 1.5e-10
(derived above; tests/test_approx_math.py measures the NumPy implementation over float32 sweeps
and the GPU helper against it). For a result |y| >= 2^-10 that is below 2^-12 of half a bfloat16
ulp and 2^-9 of half a float16 ulp (at y = 2^-10 half an ulp is 2^-18 and 2^-21), and far below
what the argument already carries: a float32 x is within 2^-24 |x| of the value it stands for, a
bfloat16 one within 2^-9 |x|. Results below ~1e-7 (x within ~1e-7 of a multiple of pi) have a
larger relative error, the 1.5e-10 of the reduction; the bfloat16 result is then off by an ulp at
most (2 of the 250 000 floats nearest a multiple of pi below 2^17).
"""

from __future__ import annotations

# 1 / pi rounded to float32: 0.318309873
INV_PI = float.fromhex("0x1.45f306p-2")
# pi = PI_HI + PI_LO + 3.43e-15; PI_HI is pi rounded down to float32 (3.14159250), PI_LO = 1.50995799e-07
PI_HI = float.fromhex("0x1.921fb4p+1")
PI_LO = float.fromhex("0x1.4442d2p-23")
# adding it to a float32 |y| < 2^22 rounds y to an integer
ROUND_MAGIC = 12582912.0
# beyond it (and for inf) the precise sinf / cosf; NaN stays NaN either way. Below it |m| <= 41724,
# which keeps the reduction's error at 1.5e-10 and |m| far below ROUND_MAGIC's 2^22
FAST_RANGE = 131072.0
# sin r ~ r * (1 + S1 r^2 + S2 r^4 + S3 r^6 + S4 r^8) on |r| <= pi/2 + 0.02 (minimax relative error 2^-27.1)
SIN_POLY = (
    float.fromhex("-0x1.55554ap-3"),   # -0.166666582
    float.fromhex("0x1.110ea6p-7"),    # 0.00833304506
    float.fromhex("-0x1.9f6716p-13"),  # -0.000198079433
    float.fromhex("0x1.5d3a4cp-19"),   # 2.60194933e-06
)

# The bound above, for tests and docs: relative part and absolute part, for |x| <= FAST_RANGE.
RELATIVE_ERROR = 2.0 ** -21.9
ABSOLUTE_ERROR = 1.5e-10

__all__ = ["ABSOLUTE_ERROR", "FAST_RANGE", "INV_PI", "PI_HI", "PI_LO", "RELATIVE_ERROR", "ROUND_MAGIC",
           "SIN_POLY"]
