"""docs/semantics.md in the emulator: every case of tests/semantics_cases.py (integer overflow,
division and modulo by zero, float -> int casts, rounding to bfloat16, NaN in max / min and
their reductions over every reduction path, float // and %) against its NumPy reference, on
fresh random inputs full of edge values; integers bit for bit. Then the Python-side checks:
constants that do not fit their dtype, and the C text of the device helpers compiled on the
host and compared with NumPy."""

from __future__ import annotations

import shutil
import subprocess
import zlib

import numpy as np
import pytest

import tecc as tc
from tecc.codegen.cuda_expr import FLOAT_OP_HELPERS, ExprEmitter
from tecc.codegen.ranges import RangeEnv
from tecc.ir import dtype as dt
from tecc.ir.expr import Var, binary

from semantics_cases import all_cases, same

CASES = {c.name: c for c in all_cases()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulator_implements_the_semantics(name: str) -> None:
    case = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    inputs = case.inputs(rng)
    outputs = case.outputs()
    kernel = case.build("sim")
    kernel(*inputs, *outputs)
    for k, (got, want) in enumerate(zip(outputs, case.reference(*inputs))):
        ok, why = same(got, want)
        assert ok, f"{name}, output {k} (plan {kernel.plan}): {why}"


# ---- Python constants that do not fit their dtype --------------------------------------------
def _int_tensor(d: str = "int32") -> tc.Tensor:
    return tc.placeholder((4,), d, name="A")


@pytest.mark.parametrize("make, words", [
    (lambda: tc.const(300 * 2**24, "int32"), ["5033164800", "int32", "-2147483648 .. 2147483647", "int64"]),
    (lambda: tc.const(-(2**31) - 1, "int32"), ["-2147483649", "int32"]),
    (lambda: tc.const(2**63, "int64"), ["9223372036854775808", "int64"]),
    (lambda: _int_tensor()[0] + 2**40, ["1099511627776", "int32"]),
    (lambda: _int_tensor("int64")[0] * 2**64, ["18446744073709551616", "int64"]),
    (lambda: tc.const(2.5, "int32"), ["2.5", "int32", "tc.cast"]),
    (lambda: tc.const(1e6, "float16"), ["1000000.0", "float16", "65504"]),
    (lambda: tc.placeholder((4,), "bfloat16", name="B")[0] * 1e39, ["1e+39", "bfloat16"]),
    (lambda: tc.const(1e39, "float32"), ["1e+39", "float32"]),
])
def test_a_constant_that_does_not_fit_its_dtype_is_a_dtype_error(make, words) -> None:
    with pytest.raises(tc.DTypeError) as info:
        make()
    for w in words:
        assert w in str(info.value), str(info.value)


def test_constants_that_fit_are_kept_exactly() -> None:
    assert tc.const(-(2**31), "int32").value == -(2**31)
    assert tc.const(2**63 - 1, "int64").value == 2**63 - 1
    assert tc.const(65504.0, "float16").value == 65504.0
    assert tc.const(float("inf"), "float16").value == float("inf")  # infinity asked for is fine
    assert tc.const(3.0, "int32").value == 3
    assert tc.const(0.1, "float16").value == 0.1  # rounding is fine, overflow is not


def test_constant_folds_wrap_like_the_kernel() -> None:
    big = tc.const(2**31 - 1, "int32")
    assert (big + 1).value == -(2**31)
    assert (-tc.const(-(2**31), "int32")).value == -(2**31)
    assert (tc.const(7, "int32") // 0).value == 0 and (tc.const(7, "int32") % 0).value == 0
    assert tc.cast(tc.const(2**40 + 5, "int64"), "int32").value == 5


# ---- max / min API -----------------------------------------------------------------------------
def test_nan_dropping_forms_are_plain_max_min_on_integers() -> None:
    a = _int_tensor()
    j = tc.reduce_axis(4, name="j")
    assert tc.nanmax(a[j], axis=j).combiner == "max" and tc.nanmin(a[j], axis=j).combiner == "min"
    assert tc.fmax(a[0], a[1]).op == "max"
    x = tc.placeholder((4,), "float32", name="X")
    assert tc.nanmax(x[j], axis=j).combiner == "nanmax" and tc.fmin(x[0], x[1]).op == "fmin"


# ---- the C text of the emitted helpers, compiled on the host ----------------------------------
def _host_program(body: str, tmp_path) -> list[str]:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    helpers = "".join(dict.fromkeys(FLOAT_OP_HELPERS.values())).replace("__device__ __forceinline__", "static inline")
    src = tmp_path / "helpers.cpp"
    src.write_text("#include <math.h>\n#include <cstdio>\n#include <cstdint>\n#include <cstring>\n" + helpers + body)
    exe = tmp_path / "helpers"
    # -ffp-contract=off: the GPU's float helpers have no a*b+c to contract
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-o", str(exe), str(src)], check=True, capture_output=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()


def test_float_operator_helpers_compute_what_numpy_does(tmp_path) -> None:
    """tecc_max / tecc_min / tecc_floordiv / tecc_mod as C, on every pair of edge values and on
    random pairs, bit for bit against np.maximum / np.minimum / np.floor_divide / np.remainder
    (NaN payloads and the sign of max(+0, -0) aside)."""
    rng = np.random.default_rng(5)
    edges = [np.nan, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 2.5, -2.5, 1e-3, 7.0, 0.5, 1e30, -3e-39]
    a = np.concatenate([np.repeat(edges, len(edges)), rng.standard_normal(300) * 100])
    b = np.concatenate([np.tile(edges, len(edges)), rng.standard_normal(300) * 3])
    for t, npt, bits, fmt in (("float", np.float32, np.uint32, "%08x"), ("double", np.float64, np.uint64, "%016llx")):
        x, y = a.astype(npt), b.astype(npt)
        ub = "uint32_t" if t == "float" else "unsigned long long"
        lines = [f"static void show({t} v) {{ {ub} u; std::memcpy(&u, &v, sizeof u); std::printf(\"{fmt}\\n\", u); }}",
                 "int main() {"]
        for p, q in zip(x, y):
            lit = lambda v: f"{float(v)!r}".replace("nan", "NAN").replace("inf", "INFINITY")  # noqa: E731
            args = f"({t})({lit(p)}), ({t})({lit(q)})"
            lines += [f"  show(tecc_{f}({args}));" for f in ("max", "min", "floordiv", "mod")]
        lines.append("  return 0;\n}")
        out = np.array([int(v, 16) for v in _host_program("\n".join(lines), tmp_path)], bits).view(npt).reshape(-1, 4)
        with np.errstate(all="ignore"):
            want = [np.maximum(x, y), np.minimum(x, y), np.floor_divide(x, y), np.remainder(x, y)]
        for k, w in enumerate(want):
            got = out[:, k]
            bad = ~((got == w) | (np.isnan(got) & np.isnan(w)))
            bad |= (got == 0) & (w == 0) & (np.signbit(got) != np.signbit(w)) & (k >= 2)  # // and % keep zero signs
            assert not bad.any(), (t, k, x[bad][:3], y[bad][:3], got[bad][:3], w[bad][:3])


def test_guarded_integer_division_computes_the_semantics_in_c(tmp_path) -> None:
    """`a // b` and `a % b` as the emitter prints them when nothing is known about the divisor,
    compiled on the host (with -fwrapv, the GPU's wrapping) and run on edge values: 0 for a zero
    divisor, floor otherwise."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    a, b = Var("a", dt.int32), Var("b", dt.int32)
    emitter = ExprEmitter(lambda v: v.name, lambda buf: buf.name, set(), RangeEnv())
    texts = [emitter.code(binary("//", a, b)), emitter.code(binary("%", a, b))]
    assert all("b == 0 ? 0 :" in t for t in texts), texts
    edges = [0, 1, -1, 7, -7, 2**31 - 1, -(2**31)]
    points = [(x, y) for x in edges for y in edges if not (x == -(2**31) and y == -1)]  # C traps on the host
    lines = ["#include <cstdio>", *(f"static int f{i}(int a, int b) {{ return {t}; }}" for i, t in enumerate(texts)),
             "int main() {", *(f"  std::printf(\"%d %d\\n\", f0({x}, {y}), f1({x}, {y}));" for x, y in points),
             "  return 0;\n}"]
    src = tmp_path / "div.cpp"
    src.write_text("\n".join(line.replace("(-2147483648)", "(-2147483647 - 1)") for line in lines))
    exe = tmp_path / "div"
    subprocess.run([cxx, "-O1", "-fwrapv", "-o", str(exe), str(src)], check=True, capture_output=True)
    got = [tuple(map(int, line.split())) for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                                      text=True).stdout.splitlines()]
    want = [(0, 0) if y == 0 else (x // y, x % y) for x, y in points]
    assert got == want


def test_every_case_compiles_with_nvrtc() -> None:
    """The CUDA C of the semantics kernels (helpers, conversions, guards) compiles, where NVRTC
    is installed (the GPU test runs them)."""
    try:
        from tecc.codegen.nvrtc import compile_cuda
        compile_cuda("extern \"C\" __global__ void probe() {}", arch="sm_90", name="probe")
    except Exception as exc:  # no NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    # every elementwise case, and one reduction per path (the others differ by a combiner)
    names = [n for n in CASES if not n.startswith(("max_", "min_", "nanmax_", "nanmin_"))]
    names += [n for n in CASES if n.startswith("nanmax_bfloat16_") or n.startswith("max_float32_")]
    for name in names:
        compile_cuda(CASES[name].build("sim").source, arch="sm_90", name=name)


def test_a_product_of_sizes_widens_to_int64_where_kernel_arithmetic_would_wrap() -> None:
    from tecc.ir import dtype as dt
    from tecc.ir.expr import Const, Var, const_int, size_product
    from tecc.ir.stmt import Buffer

    big = size_product([Const(2, dt.int32), Const(2**30 + 3, dt.int32)])
    assert const_int(big) == 2**31 + 6 and big.dtype == dt.int64
    assert size_product([Const(3, dt.int32), Const(5, dt.int32)]).dtype == dt.int32
    # the folding of kernel arithmetic itself still wraps (docs/semantics.md)
    assert const_int(Const(2, dt.int32) * Const(2**30 + 3, dt.int32)) == -(2**31) + 6
    n = Var("N")
    assert str(size_product([n, Const(4, dt.int32)])) == str(n * 4)
    strides = Buffer("X", dt.float32, (4, 2**29 + 1, 2)).row_major_strides()
    assert [const_int(s) for s in strides] == [2**30 + 2, 2, 1]


def test_the_default_schedule_indexes_a_tensor_of_2_31_elements_with_64_bit_offsets() -> None:
    from tecc.ir import dtype as dt
    from tecc.ir.stmt import For, iter_stmts
    from tecc.passes.default_schedule import default_schedule
    from tecc.passes.lower import lower

    X = tc.placeholder((2, 2**30 + 3), "float16", name="X")
    Y = tc.compute((2, 2**30 + 3), lambda i, j: X[i, j] * 2, name="Y")
    module = default_schedule(lower([X, Y]), 256)
    loops = [s for k in module.kernels for s in iter_stmts(k.body) if isinstance(s, For)]
    assert loops and all(lp.var.dtype == dt.int64 for lp in loops), [(lp.var, lp.var.dtype) for lp in loops]
