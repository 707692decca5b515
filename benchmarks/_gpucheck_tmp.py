"""Correctness on the GPU against float64 NumPy, odd and 0-size shapes."""
import sys, numpy as np
sys.path.insert(0, "examples")
import norms, tecc as tc
from tecc.compiler.strategies.row_fused import propose
rng = np.random.default_rng(0)
fails = 0
for R, C in [(0, 1000), (1, 1), (3, 31), (7, 1000), (5, 4097), (64, 8192), (2, 33)]:
    for dtype in ("float32",):
        for name, fn, ref in [("softmax", norms.softmax, norms.np_softmax),
                              ("layer_norm", norms.layer_norm, norms.np_layer_norm),
                              ("rms_norm", norms.rms_norm, norms.np_rms_norm),
                              ("row_sum", lambda R, C, d: norms.row_reduce(R, C, d, "sum"), lambda x: x.astype(np.float64).sum(-1)),
                              ("row_max", lambda R, C, d: norms.row_reduce(R, C, d, "max"), lambda x: x.max(-1))]:
            args = fn(R, C, dtype)
            p = propose(args)
            k = tc.build(args, plan=p.plan)
            ins = [rng.standard_normal(tuple(int(s) for s in t.shape)).astype(np.float32) for t in args if t.is_placeholder]
            outs = [np.zeros(tuple(int(s) for s in t.shape), np.float32) for t in args if not t.is_placeholder]
            k(*ins, *outs)
            r = ref(*ins) if R else np.zeros_like(outs[0])
            err = float((np.abs(outs[0] - r) / (np.abs(r) + 1)).max()) if outs[0].size else 0.0
            ok = err < 1e-4
            fails += not ok
            print(f"gpu-check {name} {R}x{C}: rel err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
print("gpu-check failures:", fails)
