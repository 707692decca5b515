"""Property: random schedules of random small ops give NumPy's result on the emulator.

Each example draws an op (elementwise, broadcast, or a sum/max reduction, constant or symbolic
sizes) and a random sequence of primitives (splits with random factors, reorders of random loop
permutations, fuses, binds, unrolls, staging in local/shared memory). A primitive that raises
ScheduleError is refused and skipped; everything that was accepted must compute the right answer
(illegal schedules are refused, never silently miscompiled)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tecc as tc
from tecc.compiler.schedule import Schedule
from tecc.ir.errors import ScheduleError

from test_schedule import check_close, run_sim


def make_op(kind: str, symbolic: bool, n0: int, n1: int) -> tuple[list, object, dict]:
    N = tc.var("N") if symbolic else n0
    X = tc.placeholder((N, n1), "float32", name="X")
    if kind == "elementwise":
        Y = tc.compute((N, n1), lambda i, j: X[i, j] * 3.0 - 1.0, name="Y")
        return [X, Y], lambda x: x * 3.0 - 1.0, {}
    if kind == "broadcast":
        V = tc.placeholder((n1,), "float32", name="V")
        Y = tc.compute((N, n1), lambda i, j: X[i, j] + V[j], name="Y")
        return [X, V, Y], None, {"V": n1}
    r = tc.reduce_axis(n1, name="r")
    if kind == "sum":
        Y = tc.compute((N,), lambda i: tc.sum(X[i, r] * 2.0, axis=r), name="Y")
        return [X, Y], lambda x: (x * 2.0).sum(axis=1), {}
    Y = tc.compute((N,), lambda i: tc.max(X[i, r], axis=r), name="Y")
    return [X, Y], lambda x: x.max(axis=1), {}


def apply_random(sch: Schedule, data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        loops = sch.get_loops("Y")
        if not loops:
            return
        prim = data.draw(st.sampled_from(["split", "split", "reorder", "fuse", "bind", "unroll", "stage"]),
                         label="primitive")
        try:
            if prim == "split":
                lp = data.draw(st.sampled_from(loops))
                sch.split(lp, data.draw(st.integers(1, 9), label="factor"))
            elif prim == "reorder" and len(loops) >= 2:
                picked = data.draw(st.lists(st.sampled_from(loops), min_size=2, max_size=4, unique=True))
                sch.reorder(*data.draw(st.permutations(picked)))
            elif prim == "fuse" and len(loops) >= 2:
                k = data.draw(st.integers(0, len(loops) - 2))
                sch.fuse(loops[k], loops[k + 1])
            elif prim == "bind":
                lp = data.draw(st.sampled_from(loops))
                axis = data.draw(st.sampled_from(["blockIdx.x", "blockIdx.y", "threadIdx.x", "threadIdx.y"]))
                sch.bind(lp, axis)
            elif prim == "unroll":
                sch.unroll(data.draw(st.sampled_from(loops)))
            elif prim == "stage":
                scope = data.draw(st.sampled_from(["local", "shared"]))
                cache = sch.cache_read("Y", "X", scope)
                try:
                    sch.compute_at(cache, data.draw(st.sampled_from(loops)))
                finally:
                    sch._pending.pop(str(cache), None)  # a refused placement leaves no pending cache
        except ScheduleError:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["elementwise", "broadcast", "sum", "max"]), symbolic=st.booleans(),
       n0=st.integers(1, 13), n1=st.integers(1, 11), data=st.data())
def test_random_legal_schedules_match_numpy(kind: str, symbolic: bool, n0: int, n1: int, data: st.DataObject) -> None:
    tensors, ref, extra = make_op(kind, symbolic, n0, n1)
    sch = Schedule(tensors)
    apply_random(sch, data)
    rng = np.random.default_rng(n0 * 31 + n1)
    x = rng.standard_normal((n0, n1)).astype(np.float32)
    arrays = [x]
    if kind == "broadcast":
        v = rng.standard_normal(n1).astype(np.float32)
        arrays.append(v)
        want = x.astype(np.float64) + v
    else:
        want = ref(x.astype(np.float64))
    out = np.full(want.shape, np.nan, np.float32)
    arrays.append(out)
    run_sim(sch.mod, arrays)
    check_close(out, want, f"{kind} n0={n0} n1={n1} symbolic={symbolic}\n{sch.mod}", sch.plan)
