"""y = sin(a * x + b), with a per-column scale broadcast over rows and a strided input.

`x` is declared with strides="any", so a transposed or sliced view runs in place on the GPU
(the strides become kernel parameters)."""

import numpy as np

import tecc as tc

R, C = tc.var("R"), tc.var("C")
x = tc.placeholder((R, C), "float32", name="x", strides="any")
a = tc.placeholder((C,), "float32", name="a")
b = tc.placeholder((), "float32", name="b")
y = tc.compute((R, C), lambda i, j: tc.sin(a[j] * x[i, j] + b[()]), name="y")

OPS = [
    tc.OpSpec("sin_axpb", [x, a, b, y], lambda x, a, b: np.sin(a[None, :] * x + b), sizes={"R": 300, "C": 129}),
]
