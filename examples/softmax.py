"""Softmax over rows, written as four tensor expressions (max, exp, sum, divide)."""

import numpy as np

import tecc as tc

R, C = tc.var("R"), 1000
X = tc.placeholder((R, C), "float32", name="X")
c = tc.reduce_axis(C, name="c")
c2 = tc.reduce_axis(C, name="c2")
m = tc.compute((R,), lambda r: tc.max(X[r, c], axis=c), name="m")
e = tc.compute((R, C), lambda r, j: tc.exp(X[r, j] - m[r]), name="e")
s = tc.compute((R,), lambda r: tc.sum(e[r, c2], axis=c2), name="s")
Y = tc.compute((R, C), lambda r, j: e[r, j] / s[r], name="Y")


def _softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


OPS = [tc.OpSpec("softmax", [X, Y], _softmax, sizes={"R": 64})]
