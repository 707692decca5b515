"""Row sum (the last axis) and a sum over the middle axis of a 3-D tensor."""

import numpy as np

import tecc as tc

R, C = tc.var("R"), tc.var("C")
x = tc.placeholder((R, C), "float32", name="x")
c = tc.reduce_axis(C, name="c")
row_sum = tc.compute((R,), lambda r: tc.sum(x[r, c], axis=c), name="row_sum")

B, M, N = 4, 33, 65
t = tc.placeholder((B, M, N), "float16", name="t")
m = tc.reduce_axis(M, name="m")
mid_max = tc.compute((B, N), lambda b, n: tc.max(t[b, m, n], axis=m), name="mid_max")

OPS = [
    tc.OpSpec("row_sum", [x, row_sum], lambda x: x.sum(axis=-1), sizes={"R": 257, "C": 1000}),
    tc.OpSpec("mid_max", [t, mid_max], lambda t: t.max(axis=1)),
]
