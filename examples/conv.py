"""Convolutions as tensor expressions (docs/conv.md): no conv op, just a sum over (c, r, s) with
padding by where() on the index. Half-precision ones become implicit GEMMs on tensor cores.

    Y[n, p, q, f] = Σ_{c,r,s} X[n, p·stride + r - pad, q·stride + s - pad, c] · W[r, s, c, f]
"""

import numpy as np

import tecc as tc


def conv2d_nhwc(n, h, w, c, f, k, stride=1, pad=0, dtype="float16", name="conv"):
    p_out, q_out = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    X = tc.placeholder((n, h, w, c), dtype, name="X")
    Wt = tc.placeholder((k, k, c, f), dtype, name="W")
    rc, rr, rs = tc.reduce_axis(c, "c"), tc.reduce_axis(k, "r"), tc.reduce_axis(k, "s")

    def body(b, p, q, o):
        hh, ww = p * stride + rr - pad, q * stride + rs - pad
        x = tc.where((hh >= 0) & (hh < h) & (ww >= 0) & (ww < w), X[b, hh, ww, rc], tc.const(0, dtype))
        acc = tc.sum(tc.cast(x, "float32") * tc.cast(Wt[rr, rs, rc, o], "float32"), axis=[rc, rr, rs])
        return tc.cast(acc, dtype)

    Y = tc.compute((n, p_out, q_out, f), body, name=name)

    def reference(x, wt):
        xp = np.pad(x, ((0, 0), (pad, pad + stride), (pad, pad + stride), (0, 0)))
        out = np.zeros((n, p_out, q_out, f))
        for r in range(k):
            for s in range(k):
                out += xp[:, r:r + stride * (p_out - 1) + 1:stride, s:s + stride * (q_out - 1) + 1:stride] @ wt[r, s]
        return out

    return tc.OpSpec(name, [X, Wt, Y], reference)


OPS = [conv2d_nhwc(2, 14, 14, 32, 32, 3, pad=1, name="conv3x3_nhwc_f16"),
       conv2d_nhwc(2, 9, 9, 16, 32, 3, stride=2, pad=1, name="conv3x3_s2_nhwc_f16")]
