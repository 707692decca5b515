"""Dropout written with `tc.rand`: y = where(rand < p, 0, x / (1 - p)).

`tc.rand(shape, seed, offset)` is a tensor of float32 uniforms in [0, 1) that is a pure function
of the element's index (Philox4x32-10, docs/training.md "Random numbers"), so it is computed in
the kernel that reads it and never stored. Seed and offset are int64 scalars passed at run time:
the same compiled kernel draws new numbers on every call. The second op drops out the rows of a
softmax (attention's probabilities) in the same one-kernel row pass.

The references draw the same numbers with the NumPy Philox that the emulator runs
(`tecc.ir.philox.uniform_from_index`); tests/test_random.py checks that one against Random123's
known answers and an independent implementation.
"""

import numpy as np

import tecc as tc
from tecc.ir.philox import uniform_from_index

P = 0.1

R, C = tc.var("R"), tc.var("C")
x = tc.placeholder((R, C), "float32", name="x")
seed = tc.placeholder((), "int64", name="seed")
offset = tc.placeholder((), "int64", name="offset")
keep = tc.rand((R, C), seed, offset, name="keep")
y = tc.compute((R, C), lambda i, j: tc.where(keep[i, j] < P, 0, x[i, j] / (1 - P)), name="y")


def uniforms(shape, s, o):
    """The numbers tc.rand(shape, s, o) draws, element n of the row-major order."""
    return uniform_from_index(int(s), int(o), np.arange(int(np.prod(shape)))).reshape(shape)


def dropout_reference(x, s, o):
    return np.where(uniforms(x.shape, s, o) < np.float32(P), 0.0, x / (1 - P))


def make_inputs(rng, shapes):
    """x uniform in [-1, 1); seed anywhere in 64 bits; offset past 2^32 (the counter's high word)."""
    x_shape = shapes[0]
    return [rng.uniform(-1, 1, x_shape).astype(np.float32),
            np.array(rng.integers(-2**63, 2**63, dtype=np.int64)),
            np.array(rng.integers(2**32, 2**40, dtype=np.int64))]


# softmax over each row, then dropout of the probabilities: one row-fused kernel
S = tc.placeholder((R, C), "float32", name="S")
c1, c2 = tc.reduce_axis(C, name="c1"), tc.reduce_axis(C, name="c2")
row_max = tc.compute((R,), lambda i: tc.max(S[i, c1], axis=c1), name="row_max")
e = tc.compute((R, C), lambda i, j: tc.exp(S[i, j] - row_max[i]), name="e")
row_sum = tc.compute((R,), lambda i: tc.sum(e[i, c2], axis=c2), name="row_sum")
drop = tc.rand((R, C), seed, offset, name="drop")
probs = tc.compute((R, C), lambda i, j: tc.where(drop[i, j] < P, 0, e[i, j] / row_sum[i] / (1 - P)), name="probs")


def softmax_dropout_reference(s_in, sd, o):
    z = np.exp(s_in - s_in.max(axis=1, keepdims=True))
    return np.where(uniforms(s_in.shape, sd, o) < np.float32(P), 0.0, z / z.sum(axis=1, keepdims=True) / (1 - P))


OPS = [
    tc.OpSpec("dropout", [x, seed, offset, y], dropout_reference, sizes={"R": 300, "C": 256},
              make_inputs=make_inputs),
    tc.OpSpec("softmax_dropout", [S, seed, offset, probs], softmax_dropout_reference, sizes={"R": 64, "C": 1000},
              make_inputs=make_inputs),
]
