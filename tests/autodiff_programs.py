"""Programs whose gradients the autodiff tests check (CPU emulator) and the torch tests check
(gradcheck on the GPU): each returns its placeholders, its output and a NumPy float64 forward."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import tecc as tc

EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)


@dataclass
class Program:
    name: str
    inputs: list[tc.Tensor]
    output: tc.Tensor
    numpy: Callable[..., np.ndarray]  # the forward in float64, inputs in `inputs` order
    shapes: dict[str, tuple[int, ...]]  # a concrete shape per input name


def matmul_bias_gelu(dtype: str = "float64", m: int = 5, k: int = 4, n: int = 6, erf: bool = False) -> Program:
    M = tc.var("M")
    A = tc.placeholder((M, k), dtype, name="A")
    B = tc.placeholder((k, n), dtype, name="B")
    bias = tc.placeholder((n,), dtype, name="bias")
    r = tc.reduce_axis(k, name="r")
    H = tc.compute((M, n), lambda i, j: tc.sum(A[i, r] * B[r, j], axis=r) + bias[j], name="H")
    if erf:
        Y = tc.compute((M, n), lambda i, j: 0.5 * H[i, j] * (1.0 + tc.erf(H[i, j] * (1.0 / math.sqrt(2.0)))),
                       name="Y")
    else:
        Y = tc.compute((M, n), lambda i, j: 0.5 * H[i, j] * (1.0 + tc.tanh(GELU_C * (H[i, j] + 0.044715 * H[i, j] ** 3.0))),
                       name="Y")

    def forward(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
        h = a @ b + c
        if erf:
            return 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
        return 0.5 * h * (1.0 + np.tanh(GELU_C * (h + 0.044715 * h**3)))

    return Program("matmul_bias_gelu" + ("_erf" if erf else ""), [A, B, bias], Y, forward,
                   {"A": (m, k), "B": (k, n), "bias": (n,)})


def softmax(dtype: str = "float64", rows: int = 4, cols: int = 7) -> Program:
    R = tc.var("R")
    X = tc.placeholder((R, cols), dtype, name="X")
    c, c2 = tc.reduce_axis(cols, name="c"), tc.reduce_axis(cols, name="c2")
    m = tc.compute((R,), lambda i: tc.max(X[i, c], axis=c), name="m")
    e = tc.compute((R, cols), lambda i, j: tc.exp(X[i, j] - m[i]), name="e")
    s = tc.compute((R,), lambda i: tc.sum(e[i, c2], axis=c2), name="s")
    Y = tc.compute((R, cols), lambda i, j: e[i, j] / s[i], name="Y")

    def forward(x: np.ndarray) -> np.ndarray:
        z = np.exp(x - x.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    return Program("softmax", [X], Y, forward, {"X": (rows, cols)})


def layer_norm(dtype: str = "float64", rows: int = 4, cols: int = 8) -> Program:
    R = tc.var("R")
    X = tc.placeholder((R, cols), dtype, name="X")
    g = tc.placeholder((cols,), dtype, name="g")
    b = tc.placeholder((cols,), dtype, name="b")
    c, c2 = tc.reduce_axis(cols, name="c"), tc.reduce_axis(cols, name="c2")
    mu = tc.compute((R,), lambda i: tc.sum(X[i, c], axis=c) * (1.0 / cols), name="mu")
    d = tc.compute((R, cols), lambda i, j: X[i, j] - mu[i], name="d")
    var = tc.compute((R,), lambda i: tc.sum(d[i, c2] * d[i, c2], axis=c2) * (1.0 / cols), name="var")
    Y = tc.compute((R, cols), lambda i, j: d[i, j] * tc.rsqrt(var[i] + EPS) * g[j] + b[j], name="Y")

    def forward(x: np.ndarray, gg: np.ndarray, bb: np.ndarray) -> np.ndarray:
        mean = x.mean(-1, keepdims=True)
        v = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(v + EPS) * gg + bb

    return Program("layer_norm", [X, g, b], Y, forward, {"X": (rows, cols), "g": (cols,), "b": (cols,)})


def attention(dtype: str = "float64", queries: int = 5, keys: int = 6, dim: int = 4) -> Program:
    """softmax(Q Kᵀ / √d) V for one head: scores, row max, exponentials, row sum, output."""
    Lq = tc.var("Lq")
    Q = tc.placeholder((Lq, dim), dtype, name="Q")
    K = tc.placeholder((keys, dim), dtype, name="K")
    V = tc.placeholder((keys, dim), dtype, name="V")
    d, c, c2, t = (tc.reduce_axis(dim, name="d"), tc.reduce_axis(keys, name="c"),
                   tc.reduce_axis(keys, name="c2"), tc.reduce_axis(keys, name="t"))
    scale = 1.0 / math.sqrt(dim)
    S = tc.compute((Lq, keys), lambda i, j: tc.sum(Q[i, d] * K[j, d], axis=d) * scale, name="S")
    m = tc.compute((Lq,), lambda i: tc.max(S[i, c], axis=c), name="m")
    P = tc.compute((Lq, keys), lambda i, j: tc.exp(S[i, j] - m[i]), name="P")
    z = tc.compute((Lq,), lambda i: tc.sum(P[i, c2], axis=c2), name="z")
    O = tc.compute((Lq, dim), lambda i, e: tc.sum(P[i, t] * V[t, e], axis=t) / z[i], name="O")

    def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        s = q @ k.T * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v

    return Program("attention", [Q, K, V], O, forward, {"Q": (queries, dim), "K": (keys, dim), "V": (keys, dim)})


def random_inputs(program: Program, rng: np.random.Generator, dtype: Any = np.float64) -> list[np.ndarray]:
    return [rng.standard_normal(program.shapes[t.name]).astype(dtype) for t in program.inputs]


def mlp_block(dtype: str = "float64", rows: int = 5, d: int = 4, hidden: int = 6) -> Program:
    """Y = gelu(X W1 + b1) W2 + b2 + X: two contractions, a tanh-gelu and a residual in one program."""
    R = tc.var("R")
    X = tc.placeholder((R, d), dtype, name="X")
    W1 = tc.placeholder((d, hidden), dtype, name="W1")
    b1 = tc.placeholder((hidden,), dtype, name="b1")
    W2 = tc.placeholder((hidden, d), dtype, name="W2")
    b2 = tc.placeholder((d,), dtype, name="b2")
    k, h = tc.reduce_axis(d, name="k"), tc.reduce_axis(hidden, name="h")

    def gelu(v: tc.Expr) -> tc.Expr:
        return 0.5 * v * (1.0 + tc.tanh(GELU_C * (v + 0.044715 * v * v * v)))

    H = tc.compute((R, hidden), lambda i, j: gelu(tc.sum(X[i, k] * W1[k, j], axis=k) + b1[j]), name="H")
    Y = tc.compute((R, d), lambda i, j: tc.sum(H[i, h] * W2[h, j], axis=h) + b2[j] + X[i, j], name="Y")

    def forward(x: np.ndarray, w1: np.ndarray, c1: np.ndarray, w2: np.ndarray, c2: np.ndarray) -> np.ndarray:
        a = x @ w1 + c1
        return 0.5 * a * (1.0 + np.tanh(GELU_C * (a + 0.044715 * a**3))) @ w2 + c2 + x

    return Program("mlp_block", [X, W1, b1, W2, b2], Y, forward,
                   {"X": (rows, d), "W1": (d, hidden), "b1": (hidden,), "W2": (hidden, d), "b2": (d,)})
