"""Attention written as plain tensor expressions: scores, a causal mask, row max, exp, row sum,
the contraction with V, grouped heads through the index (K[b, h // G, j, d]) and the log-sum-exp
as a second output. Nothing here names attention: build() finds the chain from its structure
and makes it ONE kernel with a running max (tecc/passes/rewrite/online_contraction.py,
docs/attention.md)."""

import math

import numpy as np

import tecc as tc

B, H, G, D = 2, 4, 2, 64
N = tc.var("N")
Q = tc.placeholder((B, H, N, D), "float16", name="Q")
K = tc.placeholder((B, H // G, N, D), "float16", name="K")
V = tc.placeholder((B, H // G, N, D), "float16", name="V")
d = tc.reduce_axis(D, name="d")
j1, j2, j3 = tc.reduce_axis(N, name="j1"), tc.reduce_axis(N, name="j2"), tc.reduce_axis(N, name="j3")
scale = 1.0 / math.sqrt(D)
S = tc.compute((B, H, N, N), lambda b, h, i, j: tc.where(
    j <= i, tc.sum(tc.cast(Q[b, h, i, d], "float32") * tc.cast(K[b, h // G, j, d], "float32"), axis=d) * scale,
    -math.inf), name="S")
m = tc.compute((B, H, N), lambda b, h, i: tc.max(S[b, h, i, j1], axis=j1), name="m")
e = tc.compute((B, H, N, N), lambda b, h, i, j: tc.exp(S[b, h, i, j] - m[b, h, i]), name="e")
l = tc.compute((B, H, N), lambda b, h, i: tc.sum(e[b, h, i, j2], axis=j2), name="l")
O = tc.compute((B, H, N, D), lambda b, h, i, c: tc.cast(
    tc.sum(e[b, h, i, j3] * tc.cast(V[b, h // G, j3, c], "float32"), axis=j3) / l[b, h, i], "float16"), name="O")
lse = tc.compute((B, H, N), lambda b, h, i: m[b, h, i] + tc.log(l[b, h, i]), name="lse")


def _attention(q, k, v):
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    i, j = np.indices(s.shape[-2:])
    s = np.where(j <= i, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    total = p.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", p, v) / total, (mx + np.log(total))[..., 0]


OPS = [tc.OpSpec("attention", [Q, K, V, O, lse], _attention, sizes={"N": 45})]
