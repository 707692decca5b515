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
