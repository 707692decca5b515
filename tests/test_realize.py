"""The realization's compile checks in threads (tecc/compiler/realize.py): a point whose check is
in flight is taken provisionally and the next kernels realized after it; a refusal puts the
realization back to that point. The plan, the scheduled IR and every candidate's mark must be
those of checking one point at a time."""

from __future__ import annotations

import hashlib
import threading

import pytest

import tecc as tc
from tecc.compiler.pipeline import only_kernel
from tecc.compiler.planner import plan_program
from tecc.ir.errors import ScheduleError


def _program():
    """Two fp16 GEMMs of different shapes (tensor-core kernels: compile-checked on sm_90) with an
    elementwise stage between them, and a third GEMM of the first's shape (its twin)."""
    a = tc.placeholder((256, 512), "float16", name="a")
    b = tc.placeholder((512, 384), "float16", name="b")
    w = tc.placeholder((384, 128), "float16", name="w")
    a2 = tc.placeholder((256, 512), "float16", name="a2")
    k1, k2, k3 = tc.reduce_axis(512, name="k1"), tc.reduce_axis(384, name="k2"), tc.reduce_axis(512, name="k3")
    c = tc.compute((256, 384), lambda i, j: tc.cast(tc.sum(tc.cast(a[i, k1], "float32") * tc.cast(b[k1, j], "float32"),
                                                         axis=k1), "float16"), name="c")
    d = tc.compute((256, 384), lambda i, j: tc.cast(tc.exp(tc.cast(c[i, j], "float32")), "float16"), name="d")
    e = tc.compute((256, 128), lambda i, j: tc.sum(tc.cast(d[i, k2], "float32") * tc.cast(w[k2, j], "float32"),
                                                   axis=k2), name="e")
    f = tc.compute((256, 384), lambda i, j: tc.cast(tc.sum(tc.cast(a2[i, k3], "float32") * tc.cast(b[k3, j], "float32"),
                                                         axis=k3), "float16"), name="f")
    return [a, b, w, a2, d, e, f]


class _Check:
    """A compile check that refuses about half the points, by a hash of the kernel's scheduled
    IR (so the same point is refused whichever thread asks, and whenever). With `linger`, a
    check returns only once the next one has begun (or after 10 s): it stands for a compile that
    takes longer than the planner's work between two checks, so checks run ahead must overlap.
    It counts the checks in flight."""

    def __init__(self, linger: bool, until: threading.Event | None = None) -> None:
        self.linger = linger
        self.until = until
        self.lock = threading.Condition()
        self.running = 0
        self.most = 0
        self.calls = 0

    def __call__(self, schedule, kernel, arch):
        with self.lock:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)
            number = self.calls
            self.lock.notify_all()
            if self.linger:
                self.lock.wait_for(lambda: self.calls > number, timeout=10.0)
        if self.until is not None:   # (outside the lock: the other checks go on meanwhile)
            self.until.wait(timeout=10.0)
        try:
            text = str(only_kernel(schedule.mod, kernel) if kernel is not None else schedule.mod)
            if hashlib.sha256(text.encode()).digest()[0] % 2:
                raise ScheduleError(f"{kernel} refused by the test's check")
            return None
        finally:
            with self.lock:
                self.running -= 1


def _planned(threads: str, monkeypatch):
    monkeypatch.setenv("TECC_COMPILE_THREADS", threads)
    check = _Check(linger=threads != "1")
    result = plan_program(_program(), "sm_90", compile_check=check, regions=False)
    marks = [(kp.kernel, c.label, c.failed) for kp in result.kernels for c in kp.ranked]
    return result, marks, check


def test_checks_in_threads_choose_what_one_check_at_a_time_chooses(monkeypatch):
    serial, serial_marks, one = _planned("1", monkeypatch)
    threaded, threaded_marks, many = _planned("4", monkeypatch)
    assert one.most == 1
    assert many.most > 1, "no two compile checks ran at once"
    refused = [m for m in serial_marks if m[2] is not None and "refused by the test" in m[2]]
    assert refused, "the test's check refused no point: nothing to put back"
    assert threaded.plan.to_json() == serial.plan.to_json()
    assert str(threaded.schedule.mod) == str(serial.schedule.mod)
    assert threaded_marks == serial_marks
    assert [kp.chosen.label for kp in threaded.kernels] == [kp.chosen.label for kp in serial.kernels]


def test_compile_threads_knob_is_checked(monkeypatch):
    from tecc.compiler import options

    monkeypatch.setenv("TECC_COMPILE_THREADS", "many")
    with pytest.raises(tc.TeccError, match="TECC_COMPILE_THREADS"):
        options.compile_threads()
    monkeypatch.setenv("TECC_COMPILE_THREADS", "3")
    assert options.compile_threads() == 3
    monkeypatch.delenv("TECC_SPLIT_COMPILE", raising=False)
    assert options.split_compile() == 1
    monkeypatch.setenv("TECC_SPLIT_COMPILE", "x")
    with pytest.raises(tc.TeccError, match="TECC_SPLIT_COMPILE"):
        options.split_compile()


def _gemm(a, b, name):
    (m, k), (_, n) = a.shape, b.shape
    r = tc.reduce_axis(int(k), name=f"k_{name}")
    return tc.compute((m, n), lambda i, j: tc.cast(tc.sum(tc.cast(a[i, r], "float32") * tc.cast(b[r, j], "float32"),
                                                          axis=r), "float16"), name=name)


def _softmax(x, name):
    m, n = x.shape
    j, j2 = tc.reduce_axis(int(n), name=f"j_{name}"), tc.reduce_axis(int(n), name=f"j2_{name}")
    mx = tc.compute((m,), lambda i: tc.max(tc.cast(x[i, j], "float32"), axis=j), name=f"{name}_max")
    s = tc.compute((m,), lambda i: tc.sum(tc.exp(tc.cast(x[i, j2], "float32") - mx[i]), axis=j2), name=f"{name}_sum")
    return tc.compute((m, n), lambda i, c: tc.cast(tc.exp(tc.cast(x[i, c], "float32") - mx[i]) / s[i], "float16"),
                      name=name)


def _layers(count: int):
    """`count` layers of GEMM, softmax, GEMM, softmax: planned in regions (the softmaxes row
    fused), the GEMMs per-kernel parts between them, the later layers' GEMMs twins of the
    earlier layers' (the first layer's first GEMM reads x, not a softmax: no twin)."""
    x = tc.placeholder((256, 512), "float16", name="x")
    w1 = tc.placeholder((512, 384), "float16", name="w1")
    w2 = tc.placeholder((384, 512), "float16", name="w2")
    h = x
    for layer in range(count):
        h = _softmax(_gemm(_softmax(_gemm(h, w1, f"c1_{layer}"), f"p1_{layer}"), w2, f"c2_{layer}"), f"p2_{layer}")
    return [x, w1, w2, h]


def _planned_in_regions(threads: str, monkeypatch, until_settled: bool = False, part_twins: bool = False):
    """The three layers planned with TECC_COMPILE_THREADS=`threads`; `until_settled`: every
    check returns only once the planner settles a realization (realize._Ahead.finish), so that
    the later parts are planned while the earlier parts' checks are all in flight. Without
    `part_twins` every part is planned itself (TECC_PART_TWINS=0), so that a later layer's
    kernels are realized as twins of the earlier layer's (realize.py), not renamed."""
    from tecc.compiler import realize

    monkeypatch.setenv("TECC_COMPILE_THREADS", threads)
    monkeypatch.setenv("TECC_PART_TWINS", "1" if part_twins else "0")
    settling = threading.Event()
    check = _Check(linger=threads != "1" and not until_settled, until=settling if until_settled else None)
    provisional, finish, made = [], realize._Ahead.finish, realize._Provisional

    def noted(self, *args, **kwargs):
        made.__init__(self, *args, **kwargs)
        provisional.append(self)

    def settle(self):
        settling.set()
        return finish(self)

    monkeypatch.setattr(realize, "_Provisional", type("Noted", (made,), {"__init__": noted}))
    monkeypatch.setattr(realize._Ahead, "finish", settle)
    result = plan_program(_layers(3), "sm_90", compile_check=check)
    assert result.plan.strategy == "regions" and len(result.parts) > 6
    marks = [(kp.kernel, c.label, c.failed) for part in result.parts for kp in part.kernels for c in kp.ranked]
    return result, marks, check, provisional


@pytest.mark.parametrize("until_settled", [False, True])
def test_parts_planned_in_regions_check_while_the_next_parts_are_planned(monkeypatch, until_settled):
    """A part between regions returns with its checks in flight (realize.deferring) and its
    later twins take its point on that check: the choices are still those of one check at a
    time, refusals (and twins of refused points) included."""
    serial, serial_marks, one, _ = _planned_in_regions("1", monkeypatch)
    threaded, threaded_marks, many, provisional = _planned_in_regions("4", monkeypatch, until_settled)
    assert one.most == 1
    assert many.most > 1, "no two compile checks ran at once"
    refused = [m for m in serial_marks if m[2] is not None and "refused by the test" in m[2]]
    assert refused, "the test's check refused no point: nothing to put back"
    if until_settled:   # later parts' twins took points whose checks were in flight, one of them refused
        twins = [p for p in provisional if p.twin]
        assert twins and any(p.check.exception() is not None for p in twins)
    assert threaded.plan.to_json() == serial.plan.to_json()
    assert str(threaded.composed) == str(serial.composed)
    assert threaded_marks == serial_marks
    # the later layers' parts given the first layer's plans renamed (part_twins.py): the same
    renamed, renamed_marks, _, _ = _planned_in_regions("4", monkeypatch, until_settled, part_twins=True)
    assert renamed.plan.to_json() == serial.plan.to_json()
    assert str(renamed.composed) == str(serial.composed)
    assert renamed_marks == serial_marks


def test_a_realization_is_freed_when_planned(monkeypatch):
    """No reference cycle keeps a realization (its Schedule and every checkpoint) alive after
    the planning: a refused check's exception, kept by its Future, held the frames that held the
    realization, and the deferred checks' table held the realizations (realize.py)."""
    import gc

    from tecc.compiler import realize

    monkeypatch.setenv("TECC_COMPILE_THREADS", "4")
    check = _Check(linger=False)
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        plan_program(_layers(2), "sm_90", compile_check=check)
        alive = sum(1 for o in gc.get_objects() if isinstance(o, realize._Ahead))
    finally:
        if enabled:
            gc.enable()
    assert check.calls > 0
    assert alive == 0, f"{alive} realization(s) alive after planning, held by a reference cycle"


def test_a_twin_whose_check_refuses_while_its_point_is_applied_is_realized_again(monkeypatch):
    """A later part's twin found its twin's check in flight (realize._Ahead._state), and the
    check refused while the twin's point was applied: the twin's program settles first and the
    kernel is realized again, as one check at a time would (a slow machine's CI once took the
    refused point: the check was done when asked whether it was still in flight)."""
    import concurrent.futures

    from tecc.compiler import realize

    serial, serial_marks, _, _ = _planned_in_regions("1", monkeypatch)
    monkeypatch.setenv("TECC_COMPILE_THREADS", "4")
    monkeypatch.setenv("TECC_PART_TWINS", "0")
    settling = threading.Event()   # the checks return once a realization settles, or here
    check = _Check(linger=False, until=settling)
    apply, finish, refused_meanwhile = realize._Ahead._apply, realize._Ahead.finish, []

    def applied_while_the_twin_is_checked(self, number, state, cand, base):
        out = apply(self, number, state, cand, base)
        shared = self._shared(number) if cand is state.checked else None
        if shared is not None and shared[1] is not self and not shared[0].done():
            settling.set()
            concurrent.futures.wait([shared[0]], timeout=20.0)
            refused_meanwhile.append(shared[0].exception() is not None)
        return out

    def settle(self):
        settling.set()
        return finish(self)

    monkeypatch.setattr(realize._Ahead, "_apply", applied_while_the_twin_is_checked)
    monkeypatch.setattr(realize._Ahead, "finish", settle)
    threaded = plan_program(_layers(3), "sm_90", compile_check=check)
    marks = [(kp.kernel, c.label, c.failed) for part in threaded.parts for kp in part.kernels for c in kp.ranked]
    assert any(refused_meanwhile), "no twin's check refused while the twin's point was applied"
    assert threaded.plan.to_json() == serial.plan.to_json()
    assert str(threaded.composed) == str(serial.composed)
    assert marks == serial_marks
