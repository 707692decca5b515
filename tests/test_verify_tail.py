"""The fixed tail of the pipeline (pipeline.finish_module) is verified once before and once after
it, not after each pass; a broken result is traced back to the pass that broke it."""

from __future__ import annotations

import dataclasses

import pytest

import tecc as tc
from tecc.compiler import pipeline
from tecc.ir.errors import ScheduleError
from tecc.ir.expr import Var
from tecc.ir.stmt import Buffer, BufferStore, Module


def _scheduled() -> Module:
    n = tc.var("n")
    x = tc.placeholder((n,), "float32", name="x")
    y = tc.compute((n,), lambda i: tc.exp(x[i]) * 2.0, name="y")
    return pipeline.schedule_module([x, y], pipeline.default_plan(), name="m", dumper=None,
                                    timing=pipeline.PassTiming())


def _breaks(module: Module) -> Module:
    """The first kernel's body replaced by a store at an index no loop binds."""
    k = module.kernels[0]
    out = [p for p in k.params if isinstance(p, Buffer)][-1]
    broken = dataclasses.replace(k, body=BufferStore(out, (Var("ghost"),), 0.0))
    return dataclasses.replace(module, kernels=(broken, *module.kernels[1:]))


def test_a_pass_that_breaks_the_ir_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _scheduled()
    monkeypatch.setattr(pipeline, "approx_math", lambda m, precise: _breaks(m))
    with pytest.raises(ScheduleError, match=r"after pass approx_math: .*ghost"):
        pipeline.finish_module(module, pipeline.default_plan(), dumper=None, timing=pipeline.PassTiming())


def test_the_tail_verifies_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    from tecc.passes import verify

    module = _scheduled()
    calls = []
    inner = verify.verify_module
    monkeypatch.setattr(pipeline, "verify_module", lambda m: calls.append(m) or inner(m))
    finished = pipeline.finish_module(module, pipeline.default_plan(), dumper=None, timing=pipeline.PassTiming())
    assert len(calls) == 2 and calls[-1] is finished
