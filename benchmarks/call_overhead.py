"""Host time per call of a tiny tecc kernel on torch tensors, against torch in the same process.
Plain launches (no CUDA graphs); wall time of N back-to-back calls / N, synchronized at the end.

Runs against whichever tecc is imported (PYTHONPATH), so an older checkout can be timed by the
same script: rows whose parts that checkout lacks are left out."""
import datetime, time
import torch
import tecc as tc
from tecc.runtime import arrays

N = 10_000
n = 4096
X = tc.placeholder((n,), "float32", name="X")
Y = tc.compute((n,), lambda i: X[i] * 2.0 + 1.0, name="Y")
f = tc.build([X, Y], name="scale")
x = torch.randn(n, device="cuda")
y = torch.empty(n, device="cuda")
f(x, y); torch.cuda.synchronize()
assert torch.allclose(y, x * 2 + 1), "wrong result"
ex = f._executor
print("tecc from", tc.__file__)
print("device:", torch.cuda.get_device_name(), "date:", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print("torch", torch.__version__, "stream handle", ex._stream_ptr, "cache entries", len(ex._calls))


def per_call(fn, reps=N):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        t = (time.perf_counter() - t0) / reps
        best = t if best is None else min(best, t)
    return best * 1e6


from cuda.core import launch
if not ex._calls:
    print("NO CACHE ENTRY; key:", arrays.device_key(x, ex._stream_ptr, ex._pointer_device),
          "argument:", arrays.as_argument(x, "x", ex._stream_ptr))
    cl, params = None, None
else:
    (cl,) = next(iter(ex._calls.values())).launches
    params = [x.data_ptr(), y.data_ptr()] + list(cl.params[2:])

side = torch.cuda.Stream()


def on_side_stream():
    with torch.cuda.stream(side):
        f(x, y)


def enter_side_stream():
    with torch.cuda.stream(side):
        pass


rows = [
    ("torch.mul(x, 2.0, out=y)", lambda: torch.mul(x, 2.0, out=y)),
    ("torch: y.copy_(x)", lambda: y.copy_(x)),
    ("tecc f(x, y), launch-cache hit", lambda: f(x, y)),
    ("tecc f(x, y) hit, torch's current stream a side stream (event record + wait per call)", on_side_stream),
    ("torch: `with torch.cuda.stream(side): pass` (part of the row above)", enter_side_stream),
    ("tecc full checked path", lambda: ex._call_checked((x, y))),
    ] + ([] if cl is None else [("cuda.core launch() alone, prepared config", lambda: launch(ex.stream, cl.config, cl.kernel, *params))]) + [
    ("  part: arrays.device_key(x) (the key reader the hit uses)", lambda: arrays.device_key(x, ex._stream_ptr, None)),
    ] + ([] if not hasattr(arrays, "_dlpack_key") else [
    ("  part: DLPack key reader (torch __dlpack__(stream) + capsule)", lambda: arrays._dlpack_key(x, ex._stream_ptr))]) + [
    ("  part: arrays.as_argument(x) (StridedMemoryView)", lambda: arrays.as_argument(x, "x", ex._stream_ptr)),
    ("  part: torch._C._cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0)),
    ("  part: device.set_current()", lambda: ex.device.set_current()),
    ("  part: x.data_ptr()", lambda: x.data_ptr()),
    ("  part: x.stride()", lambda: x.stride()),
]
print("| what | host us per call |")
print("| --- | --- |")
for label, fn in rows:
    reps = N if "full" not in label else 3000
    print(f"| {label} | {per_call(fn, reps):.1f} |", flush=True)
print("cache entries after:", len(ex._calls))
torch.cuda.synchronize()
assert torch.allclose(y, x * 2 + 1)
