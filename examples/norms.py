"""Layer norm, RMS norm and log-softmax over rows, written as plain tensor expressions.

Each is a reduce→elementwise graph over the same rows; `tecc.passes.rewrite.fuse_rows` turns each into
ONE kernel (the row read once, kept in registers) when the planner chooses it
(tecc.compiler.strategies.row_fused). Statistics are accumulated in float32 whatever the
input dtype (the `tc.cast`s below).
"""

import numpy as np

import tecc as tc

EPS = 1e-5


def layer_norm(R, C, dtype="float32"):
    X = tc.placeholder((R, C), dtype, name="X")
    g = tc.placeholder((C,), dtype, name="g")
    b = tc.placeholder((C,), dtype, name="b")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    xf = tc.compute((R, C), lambda r, j: tc.cast(X[r, j], "float32"), name="xf")
    mu = tc.compute((R,), lambda r: tc.sum(xf[r, c], axis=c) * (1.0 / C), name="mu")
    d = tc.compute((R, C), lambda r, j: xf[r, j] - mu[r], name="d")
    var = tc.compute((R,), lambda r: tc.sum(d[r, c2] * d[r, c2], axis=c2) * (1.0 / C), name="var")
    Y = tc.compute((R, C), lambda r, j: tc.cast(d[r, j] * tc.rsqrt(var[r] + EPS) * tc.cast(g[j], "float32")
                                                 + tc.cast(b[j], "float32"), dtype), name="Y")
    return [X, g, b, Y]


def rms_norm(R, C, dtype="float32"):
    X = tc.placeholder((R, C), dtype, name="X")
    g = tc.placeholder((C,), dtype, name="g")
    c = tc.reduce_axis(C, name="c")
    xf = tc.compute((R, C), lambda r, j: tc.cast(X[r, j], "float32"), name="xf")
    ms = tc.compute((R,), lambda r: tc.sum(xf[r, c] * xf[r, c], axis=c) * (1.0 / C), name="ms")
    Y = tc.compute((R, C), lambda r, j: tc.cast(xf[r, j] * tc.rsqrt(ms[r] + EPS) * tc.cast(g[j], "float32"), dtype),
                   name="Y")
    return [X, g, Y]


def softmax(R, C, dtype="float32", log=False):
    X = tc.placeholder((R, C), dtype, name="X")
    c, c2 = tc.reduce_axis(C, name="c"), tc.reduce_axis(C, name="c2")
    xf = tc.compute((R, C), lambda r, j: tc.cast(X[r, j], "float32"), name="xf")
    m = tc.compute((R,), lambda r: tc.max(xf[r, c], axis=c), name="m")
    e = tc.compute((R, C), lambda r, j: tc.exp(xf[r, j] - m[r]), name="e")
    s = tc.compute((R,), lambda r: tc.sum(e[r, c2], axis=c2), name="s")
    if log:
        Y = tc.compute((R, C), lambda r, j: tc.cast(xf[r, j] - m[r] - tc.log(s[r]), dtype), name="Y")
    else:
        Y = tc.compute((R, C), lambda r, j: tc.cast(e[r, j] / s[r], dtype), name="Y")
    return [X, Y]


def row_reduce(R, C, dtype="float32", combiner="sum"):
    X = tc.placeholder((R, C), dtype, name="X")
    c = tc.reduce_axis(C, name="c")
    red = {"sum": tc.sum, "max": tc.max}[combiner]
    Y = tc.compute((R,), lambda r: tc.cast(red(tc.cast(X[r, c], "float32"), axis=c), dtype), name="Y")
    return [X, Y]


def np_layer_norm(x, g, b):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + EPS) * g.astype(np.float64) + b.astype(np.float64)


def np_rms_norm(x, g):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * g.astype(np.float64)


def np_softmax(x, log=False):
    x = x.astype(np.float64)
    z = x - x.max(-1, keepdims=True)
    if log:
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    z = np.exp(z)
    return z / z.sum(-1, keepdims=True)


OPS = [
    tc.OpSpec("layer_norm", layer_norm(tc.var("R"), 1000), np_layer_norm, sizes={"R": 33}),
    tc.OpSpec("rms_norm", rms_norm(tc.var("R"), 1000), np_rms_norm, sizes={"R": 33}),
    tc.OpSpec("log_softmax", softmax(tc.var("R"), 1000, log=True), lambda x: np_softmax(x, log=True),
              sizes={"R": 33}),
]
