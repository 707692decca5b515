"""The generated CUDA of the benchmark programs, written to a folder, so a refactoring can be
compared before and after (byte-identical where the schedule is the same).

    python benchmarks/cuda_snapshot.py OUT [--arch sm_90,sm_80] [--only SUBSTRING] [--quick]
    diff -r before/ after/

Each program of the corpus (the GEMM shapes of gemm.py in float32, float16, bfloat16, TF32 and
fp8, strided operands, the attention grid's shapes of attention.py, the ResNet-50 layers of
conv.py, the memory-bound ops of memory_bound.py, and the examples' ops) is planned with
plan="auto" for each arch and built for target "cuda" (NVRTC compiles it; no GPU is needed).
OUT/<arch>/<name>.cu gets the CUDA C and OUT/<arch>/<name>.plan the plan's steps (JSON, without
the reason, whose predicted times may move with the cost model). A program that fails to build
writes OUT/<arch>/<name>.error with the error's first line. The build cache is off, so every
program is planned afresh; the compile cache (TECC_CACHE_DIR) only saves NVRTC time.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (name, thunk returning the tensors, build keyword arguments)
Entry = tuple[str, Callable[[], list[Any]], dict[str, Any]]


def corpus(quick: bool) -> list[Entry]:
    from attention import attention_program
    from conv import LAYERS, conv_tensors
    from gemm import SHAPES, matmul_tensors

    norms = argparse.Namespace(**runpy.run_path(str(ROOT / "examples" / "norms.py")))

    out: list[Entry] = []
    shapes = SHAPES[2:3] + SHAPES[-1:] if quick else SHAPES
    for batch, m, n, k, _ in shapes:
        for dtype in ("float32", "float16", "bfloat16"):
            out.append((f"gemm_{dtype}_{batch}x{m}x{n}x{k}", lambda b=batch, m=m, n=n, k=k, d=dtype:
                        matmul_tensors(b, m, n, k, d), {}))
        out.append((f"gemm_tf32_{batch}x{m}x{n}x{k}", lambda b=batch, m=m, n=n, k=k:
                    matmul_tensors(b, m, n, k, "float32"), {"allow_tf32": True}))
    out.append(("gemm_fp8_e4m3_4096", lambda: fp8_tensors(4096, 4096, 4096), {}))
    out.append(("gemm_f16_strided_a_4096", lambda: strided_tensors(4096, "A"), {}))
    out.append(("gemm_f16_strided_b_4096", lambda: strided_tensors(4096, "B"), {}))
    out.append(("gemm_f16_bias_relu_4096", lambda: bias_relu_tensors(4096, 4096, 4096), {}))
    attention = [(1024, 64, False, 1), (4096, 128, False, 1), (4096, 128, True, 1), (2048, 128, False, 4)]
    if not quick:
        attention += [(1024, 64, True, 1), (8192, 64, True, 1), (16384, 128, False, 1)]
    for s, d, causal, groups in attention:
        for dtype in ("float16",) if quick else ("float16", "bfloat16"):
            out.append((f"attention_{dtype}_s{s}_d{d}{'_causal' if causal else ''}_g{groups}",
                        lambda s=s, d=d, c=causal, g=groups, t=dtype:
                        attention_program(2, 16, s, s, d, t, g, 0 if c else None), {}))
    layers = LAYERS[:1] + LAYERS[4:6] if quick else LAYERS
    for layer in layers:
        for dtype in ("float16", "float32"):
            out.append((f"conv_{dtype}_" + "x".join(map(str, layer)), lambda l=layer, t=dtype:
                        conv_tensors(*l, t), {}))
    for op in ("softmax", "layer_norm", "rms_norm"):
        for dtype in ("float32", "bfloat16"):
            out.append((f"{op}_{dtype}_8192x4096", lambda o=op, t=dtype: getattr(norms, o)(8192, 4096, t), {}))
    out.append(("row_sum_float32_8192x4096", lambda: norms.row_reduce(8192, 4096, "float32", "sum"), {}))
    for path in sorted((ROOT / "examples").glob("*.py")):
        for spec in runpy.run_path(str(path)).get("OPS", []):
            out.append((f"example_{spec.name}", lambda s=spec: list(s.args), {"sizes": spec.sizes}))
    return out


def fp8_tensors(m: int, n: int, k: int) -> list[Any]:
    import tecc as tc

    A = tc.placeholder((m, k), "float8_e4m3", name="A")
    B = tc.placeholder((n, k), "float8_e4m3", name="B")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[j, r], "float32"),
                                                       axis=r), "float16"), name="C")
    return [A, B, C]


def strided_tensors(size: int, which: str) -> list[Any]:
    import tecc as tc

    A = tc.placeholder((size, size), "float16", name="A", strides="any" if which == "A" else None)
    B = tc.placeholder((size, size), "float16", name="B", strides="any" if which == "B" else None)
    r = tc.reduce_axis(size, name="k")
    C = tc.compute((size, size), lambda i, j: tc.cast(
        tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[r, j], "float32"), axis=r), "float16"), name="C")
    return [A, B, C]


def bias_relu_tensors(m: int, n: int, k: int) -> list[Any]:
    import tecc as tc

    A = tc.placeholder((m, k), "float16", name="A")
    B = tc.placeholder((k, n), "float16", name="B")
    bias = tc.placeholder((n,), "float32", name="bias")
    r = tc.reduce_axis(k, name="k")
    C = tc.compute((m, n), lambda i, j: tc.cast(tc.maximum(
        tc.sum(tc.cast(A[i, r], "float32") * tc.cast(B[r, j], "float32"), axis=r) + bias[j], 0.0), "float16"),
        name="C")
    return [A, B, bias, C]


def plan_steps(kernel: Any) -> str:
    plan = json.loads(kernel.plan.to_json())
    plan.pop("reason", None)
    return json.dumps(plan, indent=1, sort_keys=True) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--arch", default="sm_90,sm_80")
    parser.add_argument("--only", default="")
    parser.add_argument("--quick", action="store_true", help="a few programs of each family")
    a = parser.parse_args()
    os.environ["TECC_BUILD_CACHE"] = "0"
    import tecc as tc

    failures = 0
    for arch in a.arch.split(","):
        folder = Path(a.out) / arch
        folder.mkdir(parents=True, exist_ok=True)
        for name, tensors, kwargs in corpus(a.quick):
            if a.only and a.only not in name:
                continue
            start = time.perf_counter()
            try:
                kernel = tc.build(tensors(), target="cuda", arch=arch, name=name, **kwargs)
            except Exception as exc:  # noqa: BLE001 - recorded: a snapshot names what failed to build
                failures += 1
                (folder / f"{name}.error").write_text(f"{type(exc).__name__}: {str(exc).splitlines()[0]}\n")
                print(f"{arch} {name}: FAILED {type(exc).__name__}", flush=True)
                continue
            (folder / f"{name}.cu").write_text(kernel.source)
            (folder / f"{name}.plan").write_text(plan_steps(kernel))
            print(f"{arch} {name}: {kernel.plan.strategy} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"{failures} failed")


if __name__ == "__main__":
    main()
