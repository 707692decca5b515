"""The compiled graph's per-call Python (tecc/torch/runtime.py): argument templates compiled once
give what `resolve` gives on every call, fresh lists and dicts included; outputs of static shape
are allocated at that shape."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tecc as tc  # noqa: E402
from tecc.torch.runtime import RunAten, Size, Slot, compile_template, resolve  # noqa: E402


def test_a_compiled_template_gives_what_resolve_gives():
    n = tc.var("n")
    rng = np.random.default_rng()
    slots = [torch.randn(3), "second", int(rng.integers(1, 100))]
    env = {n: int(rng.integers(1, 1000))}
    templates = [
        Slot(0), Size(n * 2 + 1), 7, None, torch.float32, (1, 2), [Slot(1), (Slot(2), Size(n))],
        {"dim": Size(n - 1), "keepdim": True, "out": [Slot(2)]}, ([3, 4], {"a": 1}), ((), []),
    ]
    for template in templates:
        compiled = compile_template(template)
        got, want = compiled(slots, env), resolve(template, slots, env)
        assert type(got) is type(want) and repr(got) == repr(want), template
        if isinstance(want, (list, dict)) or (isinstance(want, tuple) and any(isinstance(w, (list, dict)) for w in want)):
            assert compiled(slots, env) is not got, f"{template}: a list or dict must be made afresh per call"


def test_an_aten_step_resolves_its_arguments_per_call():
    n = tc.var("n")
    step = RunAten(torch.full, ((Size(n), 2), Slot(0)), {"dtype": torch.float64}, 1, "full")
    for value, size in ((1.5, 3), (-2.0, 5)):
        slots = [value, None]
        step.run(slots, {n: size})
        assert slots[1].shape == (size, 2) and slots[1].dtype == torch.float64 and bool((slots[1] == value).all())
