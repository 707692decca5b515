"""Programs the differential fuzzer (tests/test_fuzz_programs.py) found failing, one named test
each, built with TECC_STRICT_PLANS=1 so that a strategy failure cannot hide behind the fallback.
(The programs of the hardening issue itself are in tests/test_build_fallback.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc


@pytest.mark.parametrize("size", [0, 1, 5, 16])
def test_column_statistic_broadcast_along_rows_of_a_square_matrix_is_no_row_group(
        size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """S0[c] = Σ_r V[c]; S1[r, c] = X[r, c] + S0[c] with as many rows as columns: row_fused's guard
    matched shapes only, so the column statistic S0 (shape (C,) == (R,)) passed for a row
    statistic and fuse_rows then failed ("S0 is read at [...] not at the row being computed").
    Found by the fuzzer at R = C = 0; the guard now checks where each statistic is read."""
    monkeypatch.setenv("TECC_STRICT_PLANS", "1")
    X = tc.placeholder((size, size), "float32", name="X")
    V = tc.placeholder((size,), "float32", name="V")
    r = tc.reduce_axis(size, name="r")
    S0 = tc.compute((size,), lambda c: tc.sum(V[c], axis=r), name="S0")
    S1 = tc.compute((size, size), lambda i, j: X[i, j] + S0[j], name="S1")
    f = tc.build([X, V, S1], target="sim")
    assert not f.fallbacks
    rng = np.random.default_rng(size)
    x = rng.uniform(-1, 1, (size, size)).astype("float32")
    v = rng.uniform(-1, 1, size).astype("float32")
    out = np.full((size, size), np.nan, "float32")
    f(x, v, out)
    np.testing.assert_allclose(out, x + size * v[None, :], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,columns", [(0, 0), (3, 0), (3, 4)])
def test_a_region_whose_tensors_do_not_carry_a_symbolic_size_is_not_planned_apart(
        rows: int, columns: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """S2 = Σ_c (-0.5 - 0.5); S3 = Σ_r Σ_c (S2 + S2) with R symbolic, beside a row sum and an
    elementwise stage of X: the region search cut {S2, S3} out as a part of its own, whose
    tensors (scalars) carry no R, and forming that part's program raised "S3 uses the size
    variable R, which no tensor ... has" out of build. Found by the fuzzer at R = C = 0; such a
    part is now declined (planner._in_regions) and the rest planned as before."""
    import program_gen as pg

    monkeypatch.setenv("TECC_STRICT_PLANS", "1")

    def x() -> pg.Read:
        return pg.Read(tensor="X", dims=("r", "c"))

    half, neg = pg.Const(value=0.5), (lambda a: pg.Unary(op="neg", a=a))
    add = (lambda a, b: pg.Binary(op="+", a=a, b=b))
    s2 = pg.Read(tensor="S2", dims=())
    prog = pg.Program(dtype="float32", sizes={"R": rows, "C": columns}, symbolic=("R",),
                      inputs={"X": (("r", "c"), "float32")},
                      stages=[pg.Stage(name="S0", dims=("r",), output=True,
                                       body=pg.Reduce(combiner="sum", axes=("c",), body=add(add(x(), x()), add(x(), x())))),
                              pg.Stage(name="S1", dims=("r", "c"), output=True,
                                       body=add(add(add(half, x()), x()), neg(add(x(), half)))),
                              pg.Stage(name="S2", dims=(), output=False,
                                       body=pg.Reduce(combiner="sum", axes=("c",), body=add(neg(half), neg(half)))),
                              pg.Stage(name="S3", dims=(), output=True,
                                       body=pg.Reduce(combiner="sum", axes=("r",),
                                                      body=pg.Reduce(combiner="sum", axes=("c",), body=add(s2, s2))))])
    args, _ = pg.to_tecc(prog)
    f = tc.build(args, target="sim", sizes={"R": rows})
    assert not f.fallbacks, f.fallbacks
    inputs = pg.make_inputs(prog, np.random.default_rng(rows))
    want = pg.interpret(prog, inputs)
    outs = [np.full(pg.output_shape(prog, st), np.nan, "float32") for st in prog.stages if st.output]
    f(*inputs.values(), *outs)
    for st, got in zip([st for st in prog.stages if st.output], outs):
        pg.compare(prog, st, got, want[st.name], lambda: str(f.plan))
