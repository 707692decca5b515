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
from tecc.passes.lower import CHAIN_READS, lower

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
