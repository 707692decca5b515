"""A residual stream through many layers (x_(l+1) = x_l + f(x_l, a row statistic of x_l)): each
layer's value is elementwise in the previous one's and read by two stages (the next layer's
statistic and its update). Inlined everywhere, the last kernels would recompute the whole chain
(bodies growing with the depth); the lowering stores a shared chain once it reads more than
CHAIN_READS values (tecc/passes/lower.py `shared_long_chains`). In the emulator against NumPy
float64 on fresh random inputs."""

from __future__ import annotations

import numpy as np

import tecc as tc
from tecc.ir.stmt import BufferStore, iter_stmts
from tecc.passes.lower import CHAIN_READS, CHAIN_TENSORS, lower

LAYERS, ROWS, COLS = 12, 16, 24


def residual_stream() -> list[tc.Tensor]:
    x = tc.placeholder((ROWS, COLS), "float32", "x")
    h = x
    for layer in range(LAYERS):
        h = _layer(h, layer)
    return [x, h]


def _layer(prev: tc.Tensor, layer: int) -> tc.Tensor:
    r = tc.reduce_axis(COLS, f"r{layer}")
    s = tc.compute((ROWS,), lambda i: tc.sum(prev[i, r], axis=r), name=f"s{layer}")
    return tc.compute((ROWS, COLS), lambda i, j: prev[i, j] + prev[i, j] * s[i] * 0.01, name=f"h{layer}")


def reference(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float64)
    for _ in range(LAYERS):
        h = h + h * h.sum(1, keepdims=True) * 0.01
    return h


def test_a_shared_chain_is_stored_before_it_outgrows_the_bound() -> None:
    module = lower(residual_stream())
    for k in module.kernels:
        for st in iter_stmts(k.body):
            if isinstance(st, BufferStore):
                # the reads as emitted (a subexpression used twice is emitted twice): 8191 for the
                # last layer without the bound, 2^(layers+1) - 1
                loads = str(st.value).count("[")
                assert loads <= 2 * CHAIN_READS + 2, (k.name, loads)
    assert len(module.kernels) > LAYERS  # some layers' values are stored


def test_the_residual_stream_matches_numpy() -> None:
    tensors = residual_stream()
    f = tc.build(tensors, target="sim")
    x = np.random.default_rng(5).uniform(-1, 1, (ROWS, COLS)).astype(np.float32)
    out = np.full((ROWS, COLS), np.nan, dtype=np.float32)
    f(x, out)
    np.testing.assert_allclose(out, reference(x), rtol=1e-4, atol=1e-4)


def gradient_stream(layers: int = 6) -> list[tc.Tensor]:
    """A backward's residual gradient: g_l = g_(l+1) + dy_l * x_l * rstd_l, where rstd_l is a row
    statistic of x_l and g_l is read by two stages (the next layer's row sum and its update).
    Inlined, g_0 would read every layer's dy and x: each layer's kernel recomputes the later
    layers' terms (reads quadratic in the depth)."""
    g0 = tc.placeholder((ROWS, COLS), "float32", "g_top")
    args, g = [g0], g0
    for layer in range(layers):
        dy = tc.placeholder((ROWS, COLS), "float32", f"dy{layer}")
        x = tc.placeholder((ROWS, COLS), "float32", f"x{layer}")
        r = tc.reduce_axis(COLS, f"c{layer}")
        q = tc.compute((ROWS,), lambda i: tc.sum(g[i, r] * x[i, r], axis=r), name=f"q{layer}")
        prev = g
        g = tc.compute((ROWS, COLS), lambda i, j: prev[i, j] + dy[i, j] * x[i, j] * q[i] * 0.01, name=f"g{layer}")
        args += [dy, x]
    return args + [g]


def test_a_chain_reading_more_than_chain_tensors_is_stored() -> None:
    module = lower(gradient_stream())
    for k in module.kernels:
        for st in iter_stmts(k.body):
            if isinstance(st, BufferStore) and len(st.buffer.shape) == 2:
                # tensors of the gradient's size a store reads: the previous g, dy and x, and
                # up to CHAIN_TENSORS more where one layer's value stays inlined
                read = {b for b in ("g_top", *(f"{n}{layer}" for n in ("dy", "x", "g") for layer in range(6)))
                        if f"{b}[" in str(st.value)}
                assert len(read) <= 3 + CHAIN_TENSORS, (k.name, sorted(read))


def test_the_gradient_stream_matches_numpy() -> None:
    tensors = gradient_stream()
    f = tc.build(tensors, target="sim")
    rng = np.random.default_rng(7)
    inputs = [rng.uniform(-1, 1, (ROWS, COLS)).astype(np.float32) for _ in tensors[:-1]]
    out = np.full((ROWS, COLS), np.nan, dtype=np.float32)
    f(*inputs, out)
    g = inputs[0].astype(np.float64)
    for layer in range(6):
        dy, x = (a.astype(np.float64) for a in inputs[1 + 2 * layer: 3 + 2 * layer])
        g = g + dy * x * (g * x).sum(1, keepdims=True) * 0.01
    np.testing.assert_allclose(out, g, rtol=1e-4, atol=1e-4)
