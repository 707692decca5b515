"""Backward passes of row ops, from `tc.grad` of the forward expressions in norms.py.

Nothing here is written by hand for the backward: each gradient program is `tc.grad` of the
user's forward, and the planner builds it as few kernels as the algebra allows
(docs/training.md, "Row-op backwards"):

- layer norm, RMS norm: dX in one row kernel that also sums dγ, dβ over blocks of rows, and a
  kernel that folds those sums: two kernels;
- softmax, log-softmax: one row kernel (the row maximum passes no gradient: tc.grad proves the
  output invariant to it);
- cross-entropy over a vocabulary: the forward keeps each row's maximum and Σ exp (its
  log-sum-exp, `save=[m, s]`), so the backward is ONE elementwise pass over the logits,
  dX = dloss · (exp(x - m) / s - onehot);
- cross-entropy's forward and backward as ONE program (`Gradients.forward_backward`, for a loss
  whose upstream gradient is known before the forward runs): one row kernel reads the logits
  once and writes the loss and dX.

The target pick is a one-hot compare, `Σ_j where(j == target[i], x[i, j], 0)`: target is an int
tensor read at [i], an affine read.
"""

import sys
from pathlib import Path

import numpy as np

import tecc as tc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from norms import EPS, layer_norm, rms_norm, softmax  # noqa: E402


def layer_norm_stats(R, C, dtype="float32"):
    """Layer norm (norms.layer_norm) with its row mean and variance as tensors to save."""
    X, g, b, Y = layer_norm(R, C, dtype)
    stages = _stages(Y)
    return X, g, b, Y, stages["mu"], stages["var"]


def layer_norm_backward(R, C, dtype="float32", save=False):
    X, g, b, Y, mu, var = layer_norm_stats(R, C, dtype)
    return tc.grad(Y, [X, g, b], save=[mu, var] if save else [])


def rms_norm_backward(R, C, dtype="float32", save=False):
    X, g, Y = rms_norm(R, C, dtype)
    return tc.grad(Y, [X, g], save=[_stages(Y)["ms"]] if save else [])


def softmax_backward(R, C, dtype="float32", log=False):
    X, Y = softmax(R, C, dtype, log=log)
    return tc.grad(Y, [X])


def cross_entropy(R, V, dtype="float32"):
    """Per-row cross-entropy of logits X[R, V] against int32 targets T[R]: (X, T, m, s, loss),
    loss[i] = m[i] + log(s[i]) - X[i, T[i]] with m the row max and s = Σ exp(x - m)."""
    X = tc.placeholder((R, V), dtype, name="X")
    T = tc.placeholder((R,), "int32", name="T")
    c, c2, c3 = tc.reduce_axis(V, name="c"), tc.reduce_axis(V, name="c2"), tc.reduce_axis(V, name="c3")
    xf = tc.compute((R, V), lambda i, j: tc.cast(X[i, j], "float32"), name="xf")
    m = tc.compute((R,), lambda i: tc.max(xf[i, c], axis=c), name="m")
    s = tc.compute((R,), lambda i: tc.sum(tc.exp(xf[i, c2] - m[i]), axis=c2), name="s")
    pick = tc.compute((R,), lambda i: tc.sum(tc.where(c3 == T[i], xf[i, c3], 0.0), axis=c3), name="pick")
    loss = tc.compute((R,), lambda i: m[i] + tc.log(s[i]) - pick[i], name="loss")
    return X, T, m, s, loss


def cross_entropy_backward(R, V, dtype="float32"):
    X, T, m, s, loss = cross_entropy(R, V, dtype)
    return tc.grad(loss, [X], save=[m, s])


def cross_entropy_forward_backward(R, V, dtype="float32"):
    """[X, T, dloss, loss, dX]: the loss and its gradient for the upstream gradient dloss, in one
    program (one row kernel: the row max and Σ exp serve both)."""
    X, T, m, s, loss = cross_entropy(R, V, dtype)
    return list(tc.grad(loss, [X]).forward_backward)


def _stages(t):
    """The computes of t's program by name."""
    out, stack = {}, [t]
    while stack:
        u = stack.pop()
        if u.name in out or u.is_placeholder:
            continue
        out[u.name] = u
        stack.extend(u.op.input_tensors)
    return out


# ---- float64 references ---------------------------------------------------------------------------

def np_layer_norm_backward(x, g, b, dy):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS)
    xhat = (x - mu) * inv
    dxhat = dy * g
    dx = inv * (dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True))
    return [dx, (dy * xhat).sum(0), dy.sum(0)]


def np_rms_norm_backward(x, g, dy):
    x = x.astype(np.float64)
    inv = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
    dxhat = dy * g
    dx = inv * dxhat - x * inv**3 * (dxhat * x).mean(-1, keepdims=True)
    return [dx, (dy * x * inv).sum(0)]


def np_softmax_backward(x, dy, log=False):
    x = x.astype(np.float64)
    z = np.exp(x - x.max(-1, keepdims=True))
    y = z / z.sum(-1, keepdims=True)
    if log:
        return [dy - y * dy.sum(-1, keepdims=True)]
    return [y * (dy - (dy * y).sum(-1, keepdims=True))]


def np_cross_entropy(x, t):
    x = x.astype(np.float64)
    m = x.max(-1)
    s = np.exp(x - m[:, None]).sum(-1)
    return m + np.log(s) - x[np.arange(len(t)), t.astype(np.int64)], m, s


def np_cross_entropy_backward(x, t, dloss):
    loss, m, s = np_cross_entropy(x, t)
    p = np.exp(x.astype(np.float64) - (m + np.log(s))[:, None])
    p[np.arange(len(t)), t.astype(np.int64)] -= 1.0
    return [dloss[:, None] * p]


def _targets(rng, shapes):
    (r, v), (n,) = shapes[0], shapes[1]
    return [rng.standard_normal((r, v)).astype(np.float32) * 2, rng.integers(0, v, n).astype(np.int32)]


_R = tc.var("R")
_LN = layer_norm_backward(_R, 1000)
_RMS = rms_norm_backward(_R, 1000)
_LOGSM = softmax_backward(_R, 1000, log=True)
_CE = cross_entropy(_R, 1003)
OPS = [
    tc.OpSpec("layer_norm_backward", _LN.args, np_layer_norm_backward, sizes={"R": 33}),
    tc.OpSpec("rms_norm_backward", _RMS.args, np_rms_norm_backward, sizes={"R": 33}),
    tc.OpSpec("log_softmax_backward", _LOGSM.args, lambda x, dy: np_softmax_backward(x, dy, log=True),
              sizes={"R": 33}),
    tc.OpSpec("cross_entropy", [_CE[0], _CE[1], _CE[4], _CE[2], _CE[3]], lambda x, t: list(np_cross_entropy(x, t)),
              sizes={"R": 33}, make_inputs=_targets),
]
