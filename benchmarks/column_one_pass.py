"""Column sums and middle-axis means: the one-pass split reduction (combine="last_block") against
the two-kernel form, at DRAM sizes, in % of copy bandwidth.

Two steps, so the timing machine needs neither tecc's runtime nor its compiler:

    python benchmarks/column_one_pass.py prepare DIR     # here: tecc builds cubins (sm_90) + launches.json
    python benchmarks/column_one_pass.py run DIR         # on the GPU: CuPy loads the cubins and times them

For each op, shape and dtype three variants are timed: `new` (what build(plan="auto") chooses
now), `new/2k` (the same point with combine="kernel": what the one pass saves), and `old/2k`
(the two-wave point the strategy chose before, with its combine kernel); `first` is the first
kernel of `new/2k` alone. Bytes = input read once + output written once; "% copy" = those
bytes per second / (2 × input bytes per second of a device-to-device copy of the input). Every
timed call takes the next of N input sets (N × input ≥ 3 × L2), as benchmarks/memory_bound.py
does, so no launch finds its input in L2. Each variant's output is checked against float64.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES_COL = [(16384, c) for c in (1024, 4096, 8192)]
MID = 16
INNER = 10  # calls between two events


def prepare(out: Path) -> None:
    import tecc as tc
    from tecc.compiler.plan import Step
    from tecc.compiler.strategies import column_reduction as cr
    from tecc.ir.evaluate import evaluate_int

    def col_sum(R, C, dtype):
        X = tc.placeholder((R, C), dtype, name="X")
        i = tc.reduce_axis(R, name="i")
        Y = tc.compute((C,), lambda j: tc.cast(tc.sum(tc.cast(X[i, j], "float32"), axis=i), dtype), name="Y")
        return [X, Y]

    def mid_mean(A, B, C, dtype):
        X = tc.placeholder((A, B, C), dtype, name="X")
        b = tc.reduce_axis(B, name="b")
        Y = tc.compute((A, C), lambda a, c: tc.cast(tc.sum(tc.cast(X[a, b, c], "float32"), axis=b) * (1.0 / B),
                                                    dtype), name="Y")
        return [X, Y]

    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for dtype in ("bfloat16", "float32"):
        itemsize = 2 if dtype == "bfloat16" else 4
        for R, C in SHAPES_COL:
            for op, args, xshape, yshape in (("col_sum", col_sum(R, C, dtype), (R, C), (C,)),
                                             ("mid_mean", mid_mean(MID, R // MID, C, dtype), (MID, R // MID, C),
                                              (MID, C))):
                outputs, reduced = (C, R) if op == "col_sum" else (MID * C, R // MID)
                new = dict(cr.propose(args).plan.steps[0].args)
                vector = cr.choose_outputs_per_thread(outputs, C, reduced, itemsize)
                old = {"threads_x": 32, "threads_y": cr.THREADS_Y,
                       "splits": cr.choose_splits(outputs, reduced, outputs_per_thread=vector),
                       "unroll": max(1, cr.UNROLL_BYTES // (itemsize * vector))}
                if vector > 1:
                    old["outputs_per_thread"] = vector
                variants = {"new": new, "new/2k": {**new, "combine": "kernel"}, "old/2k": old}
                for label, step in variants.items():
                    if label != "new" and step.get("splits", 1) == 1:
                        continue
                    k = tc.build(args, target="cuda", arch="sm_90", plan=tc.Plan((Step("split_reduce", step),)))
                    stem = f"{op}_{dtype}_{C}_{label.replace('/', '_')}"
                    (out / f"{stem}.cubin").write_bytes(k.cubin)
                    launches = []
                    for call in k.host.calls:
                        info = k.host.kernel(call.kernel)
                        grid = [evaluate_int(g, {}) for g in info.grid]
                        launches.append({"kernel": call.kernel, "grid": grid, "block": list(info.block),
                                         "args": list(call.args)})
                    temps = [{"name": t.name, "dtype": t.dtype.name,
                              "count": int(__import__("math").prod(evaluate_int(s, {}) for s in t.shape)),
                              "zero_init": t.zero_init} for t in k.host.temps]
                    cases.append({"op": op, "dtype": dtype, "shape": list(xshape), "out": list(yshape),
                                  "label": label, "step": step, "cubin": f"{stem}.cubin", "launches": launches,
                                  "temps": temps, "registers": {n: r.registers for n, r in k.resources.items()}})
    (out / "launches.json").write_text(json.dumps(cases, indent=1))
    print(f"{len(cases)} variants in {out}")


def run(folder: Path, reps: int = 30) -> None:
    import cupy as cp
    import numpy as np

    cases = json.loads((folder / "launches.json").read_text())
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    dtypes = {"bfloat16": None, "float32": cp.float32, "int32": cp.int32}
    rows = []
    inputs: dict[tuple, list] = {}

    def timed(fn, n_sets):
        """Median over `reps` of the mean of INNER back-to-back calls between two events (so
        the host's launch cost hides behind the GPU's work, as benchmarks/memory_bound.py does)."""
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        for w in range(3):
            fn(w % n_sets)
        times, n = [], 0
        for _ in range(reps):
            start.record()
            for _ in range(INNER):
                fn(n % n_sets)
                n += 1
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3 / INNER)
        return float(np.median(times))

    for case in cases:
        key = (tuple(case["shape"]), case["dtype"])
        itemsize = 2 if case["dtype"] == "bfloat16" else 4
        nbytes = int(np.prod(case["shape"])) * itemsize
        n_sets = max(1, -(-3 * l2 // nbytes))
        if key not in inputs:
            inputs.clear()
            sets = []
            for n in range(n_sets):
                x32 = cp.random.default_rng(n).standard_normal(case["shape"], dtype=cp.float32) + 0.25
                if case["dtype"] == "bfloat16":  # bf16 bits = the top half of float32 (truncation, exact to reference)
                    bits = (x32.view(cp.uint32) >> 16).astype(cp.uint16)
                    ref = (bits.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
                    sets.append((bits, ref))
                else:
                    sets.append((x32, x32.astype(cp.float64)))
            dsts = [cp.empty_like(s[0]) for s in sets]
            t_copy = timed(lambda n: dsts[n].__setitem__(Ellipsis, sets[n][0]), n_sets)
            inputs[key] = [sets, t_copy]
        sets, t_copy = inputs[key]
        module = cp.RawModule(path=str(folder / case["cubin"]))
        funcs = {launch["kernel"]: module.get_function(launch["kernel"]) for launch in case["launches"]}
        outs = [cp.full(case["out"], 0x7FC0 if itemsize == 2 else np.nan,
                        dtype=cp.uint16 if itemsize == 2 else cp.float32) for _ in sets]
        temps = {t["name"]: (cp.zeros if t["zero_init"] else cp.empty)(max(t["count"], 1), dtype=dtypes[t["dtype"]])
                 for t in case["temps"]}

        def call(n, only_first=False):
            values = {"X": sets[n][0], "Y": outs[n], **temps}
            for launch in case["launches"][:1] if only_first else case["launches"]:
                funcs[launch["kernel"]](tuple(launch["grid"]), tuple(launch["block"]),
                                        tuple(values[a] for a in launch["args"]))

        errors = []
        for n in range(len(sets)):
            for _ in range(2):  # twice: the counter must have reset itself
                outs[n].fill(0x7FC0 if itemsize == 2 else np.nan)
                call(n)
                y = outs[n]
                got = ((y.astype(cp.uint32) << 16).view(cp.float32) if itemsize == 2 else y).astype(cp.float64)
                ref = sets[n][1]
                want = ref.sum(0) if case["op"] == "col_sum" else ref.mean(1)
                errors.append(float(cp.max(cp.abs(got - want) / (cp.abs(want) + 1.0))))
        t = timed(call, len(sets))
        t_first = timed(lambda n: call(n, True), len(sets)) if len(case["launches"]) > 1 else None
        moved = nbytes + int(np.prod(case["out"])) * itemsize
        copy_rate = 2 * nbytes / t_copy
        rows.append((case, t, t_first, moved / t / copy_rate, (moved / t_first / copy_rate) if t_first else None,
                     max(errors)))
        first = f"{100 * rows[-1][4]:.0f}%" if t_first else "-"
        print(f"| {case['op']} | {'x'.join(map(str, case['shape']))} | {case['dtype']} | {case['label']} | "
              f"{t * 1e6:.1f} | {100 * rows[-1][3]:.0f}% | {first} | {max(errors):.1e} | {case['registers']} | "
              f"{case['step']} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("prepare", "run"):
        sys.exit(__doc__)
    (prepare if sys.argv[1] == "prepare" else run)(Path(sys.argv[2]))
