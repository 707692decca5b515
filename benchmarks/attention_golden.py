"""The generated CUDA of the attention kernels over many explicit configurations, written to a
folder, so a refactoring of online_contraction_mma and online_backward_mma can be compared
before and after (byte-identical where the schedule is the same):

    python benchmarks/attention_golden.py OUT [--only SUBSTRING]
    diff -r before/ after/

Each configuration is built with target "sim" and an explicit plan (one online_contraction_mma
or online_backward_mma step: no planner, no NVRTC), whose CUDA C is the same as target "cuda"'s
(`Kernel.source` comes before the compiler). The forward: float16 and bfloat16; head dims 16,
32, 64, 96, 128 (256 on wgmma); no mask, causal, bottom-right, a mask tensor, a bias; grouped
heads; odd and symbolic lengths; no head axes with m and l as outputs; the mma.sync tilings
(warp_rows 16 and 32), the wgmma form and its options (blocks_per_sm, overlap, persistent,
stages, peel_guarded, query_major, plain_order, guard_every_tile, kv_splits). The backward: the
plans of tests/test_attention_backward.py over masks, a bias and grouped heads. The SIMT kernel
(online_contraction) over a few of the programs. OUT/<name>.cu
gets the CUDA C, OUT/<name>.error the first line of an error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

Case = tuple[str, Callable[[], list[Any]], str, dict[str, Any]]


def forward(B: int, H: int, Sq: Any, Sk: Any, D: int, dtype: str, **kw: Any) -> Callable[[], list[Any]]:
    def build() -> list[Any]:
        from test_attention_tensor_core import masked_attention
        ins, outs = masked_attention(B, H, Sq, Sk, D, dtype, **kw)
        return ins + outs
    return build


def symbolic(D: int, dtype: str, **kw: Any) -> Callable[[], list[Any]]:
    def build() -> list[Any]:
        import tecc as tc
        from test_attention_tensor_core import masked_attention
        n = tc.var("n")
        ins, outs = masked_attention(1, 2, n, n, D, dtype, **kw)
        return ins + outs
    return build


def no_heads() -> list[Any]:
    import tecc as tc
    S, D = 50, 32
    Q, K, V = (tc.placeholder((S, D), "bfloat16", name=n) for n in "QKV")
    d = tc.reduce_axis(D, name="d")
    j1, j2, j3 = (tc.reduce_axis(S, name=n) for n in ("j1", "j2", "j3"))
    s = tc.compute((S, S), lambda i, j: tc.sum(Q[i, d] * K[j, d], axis=d) * 0.2, name="s")
    m = tc.compute((S,), lambda i: tc.max(s[i, j1], axis=j1), name="m")
    l = tc.compute((S,), lambda i: tc.sum(tc.exp(s[i, j2] - m[i]), axis=j2), name="l")
    O = tc.compute((S, D), lambda i, c: tc.cast(tc.sum(
        tc.exp(s[i, j3] - m[i]) * tc.cast(V[j3, c], "float32"), axis=j3) / l[i], "bfloat16"), name="O")
    return [Q, K, V, O, m, l]


def backward(B: int, H: int, Sq: int, Sk: int, D: int, dtype: str, **kw: Any) -> Callable[[], list[Any]]:
    def build() -> list[Any]:
        import tecc as tc
        from test_attention_tensor_core import masked_attention
        ins, outs = masked_attention(B, H, Sq, Sk, D, dtype, **kw)
        g = tc.grad(outs[0], [t for t in ins if t.dtype.is_float])
        return list(g.args)
    return build


def cases() -> list[Case]:
    out: list[Case] = []
    fwd = "online_contraction_mma"

    def add(name: str, program: Callable[[], list[Any]], arch: str, **args: Any) -> None:
        step = {"rows_per_block": 64, "key_tile": 64}
        step.update(args)
        out.append((name, program, arch, {fwd: step}))

    masks: list[tuple[str, dict[str, Any]]] = [
        ("plain", {"mask": None}), ("causal", {"mask": "causal"}), ("bottom_right", {"mask": "bottom_right"}),
        ("tensor", {"mask": "tensor"}), ("bias", {"mask": None, "bias": True}),
        ("grouped_causal_lse", {"mask": "causal", "groups": 2, "lse": True}),
        ("causal_bias_grouped", {"mask": "causal", "bias": True, "groups": 2})]
    for dtype in ("float16", "bfloat16"):
        for D in (64, 128):
            for label, kw in masks:
                program = forward(2, 4, 80, 112, D, dtype, **kw)
                add(f"mma_{dtype}_d{D}_{label}", program, "sm_80", rows_per_block=64, key_tile=32)
                add(f"mma2_{dtype}_d{D}_{label}", program, "sm_80", rows_per_block=128, key_tile=64, warp_rows=32)
                add(f"wgmma_{dtype}_d{D}_{label}", program, "sm_90", rows_per_block=128, key_tile=128, wgmma=True)
                add(f"wgmma64_{dtype}_d{D}_{label}", program, "sm_90", key_tile=64, wgmma=True)
    for D in (16, 32, 96):
        program = forward(1, 2, 45, 70, D, "float16", mask="bottom_right")
        add(f"mma_d{D}_odd", program, "sm_80", rows_per_block=32, key_tile=16)
        add(f"wgmma_d{D}_odd", program, "sm_90", wgmma=True)
    add("wgmma_d256", forward(1, 2, 80, 80, 256, "bfloat16", mask="causal"), "sm_90", key_tile=64, wgmma=True)
    odd = forward(3, 4, 333, 129, 64, "float16", mask="causal", groups=2)
    for rows, key_tile, warp_rows in ((16, 128, 16), (32, 16, 16), (128, 64, 32), (64, 64, 16)):
        add(f"mma_odd_{rows}_{key_tile}_{warp_rows}", odd, "sm_80", rows_per_block=rows, key_tile=key_tile,
            warp_rows=warp_rows)
    causal = forward(2, 4, 256, 256, 64, "float16", mask="causal", groups=2, lse=True)
    causal128 = forward(2, 4, 256, 256, 128, "bfloat16", mask="causal")
    for label, program in (("d64", causal), ("d128", causal128)):
        for opt, args in (("plain_order", {"plain_order": True}), ("query_major", {"query_major": True}),
                          ("every_tile", {"guard_every_tile": True}), ("peel", {"peel_guarded": True}),
                          ("split4", {"kv_splits": 4})):
            add(f"mma_{label}_{opt}", program, "sm_80", **args)
            add(f"wgmma_{label}_{opt}", program, "sm_90", rows_per_block=128, key_tile=128, wgmma=True, **args)
        for opt, args in (("bps1", {"blocks_per_sm": 1}), ("bps2", {"blocks_per_sm": 2}),
                          ("overlap", {"overlap": True}), ("overlap_bps2", {"overlap": True, "blocks_per_sm": 2}),
                          ("persistent", {"persistent": 132}), ("persistent_plain", {"persistent": 132,
                                                                                     "plain_order": True}),
                          ("stages3", {"stages": 3}), ("stages3_peel", {"stages": 3, "peel_guarded": True}),
                          ("rows192", {"rows_per_block": 192, "key_tile": 64}),
                          ("rows256", {"rows_per_block": 256, "key_tile": 64})):
            step = {"rows_per_block": 128, "key_tile": 128, "wgmma": True}
            step.update(args)
            add(f"wgmma_{label}_{opt}", program, "sm_90", **step)
    decode = forward(1, 8, 4, 1000, 128, "float16", mask="bottom_right", groups=4)
    add("mma_decode_split8", decode, "sm_80", rows_per_block=16, key_tile=64, kv_splits=8)
    add("wgmma_decode_split8", decode, "sm_90", wgmma=True, kv_splits=8)
    add("mma_decode_split8_lse", forward(1, 8, 4, 1000, 64, "bfloat16", mask=None, lse=True), "sm_80",
        rows_per_block=16, key_tile=64, kv_splits=8)
    for D in (16, 64):
        add(f"mma_symbolic_d{D}", symbolic(D, "float16", mask="causal"), "sm_80")
        add(f"wgmma_symbolic_d{D}", symbolic(D, "float16", mask="causal"), "sm_90", wgmma=True)
    add("mma_no_heads", no_heads, "sm_80")
    add("wgmma_no_heads", no_heads, "sm_90", wgmma=True)

    simt = "online_contraction"
    for label, program in (("f32_causal_bias", forward(2, 4, 45, 70, 32, "float32", mask="causal", bias=True)),
                           ("f16_tensor_lse", forward(1, 2, 33, 65, 64, "float16", mask="tensor", lse=True)),
                           ("bf16_symbolic", symbolic(16, "bfloat16", mask="bottom_right")), ("no_heads", no_heads)):
        for threads, rows in ((32, 4), (64, 2)):
            out.append((f"simt_{label}_{threads}x{rows}", program, "sm_80",
                        {simt: {"threads": threads, "rows_per_block": rows}}))

    bwd = "online_backward_mma"
    plans: list[tuple[str, str, dict[str, Any]]] = [
        ("atomic", "sm_80", {"key_tile": 32, "rows": 32, "dq_columns": 16}),
        ("atomic64", "sm_80", {"key_tile": 64, "rows": 64, "dq_columns": 32}),
        ("kernel", "sm_80", {"key_tile": 32, "rows": 32, "dq": "kernel", "dq_rows": 32, "dq_key_tile": 32}),
        ("wgmma_atomic_2wg", "sm_90", {"key_tile": 128, "rows": 64, "dq_columns": 32, "wgmma": True}),
        ("wgmma_atomic_1wg", "sm_90", {"key_tile": 64, "rows": 64, "dq_columns": 32, "wgmma": True}),
        ("wgmma_kernel", "sm_90", {"key_tile": 128, "rows": 32, "dq": "kernel", "dq_rows": 128, "dq_key_tile": 64,
                                   "wgmma": True})]
    programs: list[tuple[str, Callable[[], list[Any]]]] = [
        ("f16_d64_causal", backward(1, 2, 80, 80, 64, "float16", mask="causal")),
        ("bf16_d128_plain", backward(1, 2, 64, 96, 128, "bfloat16", mask=None)),
        ("f16_d64_bottom_right_g2", backward(1, 4, 45, 70, 64, "float16", mask="bottom_right", groups=2)),
        ("bf16_d64_bias_tensor", backward(1, 2, 33, 65, 64, "bfloat16", mask="tensor", bias=True))]
    for pname, program in programs:
        for label, arch, args in plans:
            out.append((f"backward_{pname}_{label}", program, arch, {bwd: args}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--only", default="")
    a = parser.parse_args()
    os.environ["TECC_BUILD_CACHE"] = "0"
    import tecc as tc
    from tecc.compiler.plan import Plan, Step

    folder = Path(a.out)
    folder.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name, program, arch, step in cases():
        if a.only and a.only not in name:
            continue
        ((primitive, args),) = step.items()
        plan = Plan((Step(primitive, args),), "golden", "")
        try:
            kernel = tc.build(program(), target="sim", arch=arch, plan=plan, name=name)
        except Exception as exc:  # noqa: BLE001 - recorded: the snapshot names what failed to build
            failures += 1
            (folder / f"{name}.error").write_text(f"{type(exc).__name__}: {str(exc).splitlines()[0]}\n")
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
            continue
        (folder / f"{name}.cu").write_text(kernel.source)
    print(f"{failures} failed")


if __name__ == "__main__":
    main()
