"""The CUDA emitter's integer index arithmetic means, in C, what the IR means.

The emulator evaluates the IR, so a C text that parses differently from its IR (a dropped
parenthesis, a truncating division where the IR floors) passes every emulator test and is only
seen on a GPU. Here random integer expressions over + - * // % min max (the index arithmetic of
tiled, split and chunked kernels) are emitted by `ExprEmitter`, compiled with the host C++
compiler as the same C expressions, evaluated on a grid of variable values and compared with
the IR's own evaluation (floor semantics, Python integers). Expressions whose intermediate values
leave int32 (undefined behaviour in C) or divide by zero are left out. Skipped without g++."""

import shutil
import subprocess

import numpy as np
import pytest

from tecc.codegen.cuda_expr import ExprEmitter
from tecc.codegen.ranges import RangeEnv
from tecc.ir import dtype as dt
from tecc.ir.evaluate import evaluate_int
from tecc.ir.expr import Binary, Const, Expr, Var, binary

OPS = ("+", "-", "*", "//", "%", "min", "max")
INT32 = 2**31


def _random_expr(rng: np.random.Generator, leaves: list[Expr], depth: int) -> Expr:
    if depth == 0 or rng.random() < 0.25:
        if rng.random() < 0.6:
            return leaves[rng.integers(len(leaves))]
        return Const(int(rng.integers(1, 17)), dt.int32)
    op = OPS[rng.integers(len(OPS))]
    a = _random_expr(rng, leaves, depth - 1)
    if op in ("//", "%"):
        # index math divides by a positive constant or a positive extent
        b: Expr = Const(int(rng.integers(1, 17)), dt.int32) if rng.random() < 0.7 else leaves[0] + 1
    else:
        b = _random_expr(rng, leaves, depth - 1)
    return binary(op, a, b)


def _fits_int32(e: Expr, env: dict[Var, int]) -> bool:
    """Every intermediate value of `e` stays in int32 and no divisor is 0."""
    ok = True

    def walk(x: Expr) -> int:
        nonlocal ok
        if isinstance(x, Binary):
            a, b = walk(x.a), walk(x.b)
            if x.op in ("//", "%") and b == 0:
                ok = False
                return 0
        v = evaluate_int(x, env)
        if not -INT32 <= v < INT32:
            ok = False
        return v

    walk(e)
    return ok


def _compile_and_run(texts: list[str], names: list[str], points: list[tuple[int, ...]], tmp_path) -> np.ndarray:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++) on this machine")
    params = ", ".join(f"int {n}" for n in names)
    lines = ["#include <cstdio>", "#include <algorithm>", "using std::min; using std::max;"]
    for i, t in enumerate(texts):
        lines.append(f"static long long f{i}({params}) {{ return (long long)({t}); }}")
    lines.append("int main() {")
    for p in points:
        args = ", ".join(str(v) for v in p)
        for i in range(len(texts)):
            lines.append(f'  std::printf("%lld\\n", f{i}({args}));')
    lines.append("  return 0;\n}")
    src = tmp_path / "exprs.cpp"
    src.write_text("\n".join(lines))
    exe = tmp_path / "exprs"
    subprocess.run([cxx, "-O1", "-fwrapv", "-o", str(exe), str(src)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    return np.array([int(v) for v in out], dtype=np.int64).reshape(len(points), len(texts))


@pytest.mark.parametrize("signs", ["nonnegative", "any"])
def test_emitted_integer_expressions_compute_what_the_ir_computes(signs, tmp_path):
    rng = np.random.default_rng(7 if signs == "nonnegative" else 11)
    names = ["a", "b", "c"]
    variables = [Var(n, dt.int32) for n in names]
    ranges = RangeEnv()
    lo = 0 if signs == "nonnegative" else -50
    if signs == "nonnegative":  # what the emitter knows decides how it renders // and %
        for v in variables:
            ranges.bind(v, (0, 50))
    points = [tuple(int(x) for x in rng.integers(lo, 51, size=3)) for _ in range(12)] + [(0, 0, 0), (50, 1, 49)]
    emitter = ExprEmitter(lambda v: v.name, lambda buf: buf.name, set(), ranges)
    exprs, texts = [], []
    while len(exprs) < 400:
        e = _random_expr(rng, variables, depth=4)
        if all(_fits_int32(e, dict(zip(variables, p))) for p in points):
            exprs.append(e)
            texts.append(emitter.code(e))
    got = _compile_and_run(texts, names, points, tmp_path)
    for j, p in enumerate(points):
        env = dict(zip(variables, p))
        for i, e in enumerate(exprs):
            assert got[j, i] == evaluate_int(e, env), f"{e}  emitted as  {texts[i]}  at {dict(zip(names, p))}"
