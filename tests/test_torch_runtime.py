"""The compiled graph's per-call Python (tecc/torch/runtime.py): argument templates compiled once
give what `resolve` gives on every call, fresh lists and dicts included; outputs of static shape
are allocated at that shape; a chain of view ops becomes one as_strided after its first call."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tecc as tc  # noqa: E402
from tecc.torch.runtime import MakeView, RunAten, RunProgram, Size, Slot, compile_template, resolve  # noqa: E402


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


def _chain_result(base, chain):
    value = base
    for fn, args, kwargs in chain:
        value = fn(value, *args, **kwargs)
    return value


def test_a_view_chain_is_one_as_strided_from_its_second_call():
    """A chain of fixed view ops (reshape, select, permute: a QKV projection split into heads)
    gives the chain's sizes, strides and offset, in the base's storage, on every call; after the
    first it is one as_strided (the chain's ops are not called again for a base like the first)."""
    aten = torch.ops.aten
    ops = ((aten.reshape.default, ([4, 6, 3, 2, 5],), {}), (aten.select.int, (2, 1), {}),
           (aten.permute.default, ([0, 2, 1, 3],), {}))
    calls = []

    def counted(fn):
        def call(*a, **k):
            calls.append(fn)
            return fn(*a, **k)
        return call
    step = MakeView(0, tuple((counted(fn), a, k) for fn, a, k in ops), 1, "q")
    rng = np.random.default_rng()
    for n in range(3):
        base = torch.from_numpy(rng.standard_normal((24, 30)).astype(np.float32))
        slots = [base, None]
        step.run(slots, {})
        got, want = slots[1], _chain_result(base, ops)
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
        assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert torch.equal(got, want)
        assert len(calls) == 3, f"call {n}: the chain's ops ran {len(calls)} times in all"


def test_a_view_chain_runs_again_for_another_base_and_never_remembers_a_copy():
    """A base of other strides (a transposed one) runs the chain again; a reshape that had to
    copy (not a view of the base) is not remembered; arguments read per call (a symbolic size)
    keep the chain on every call."""
    aten = torch.ops.aten
    rng = np.random.default_rng()
    step = MakeView(0, ((aten.reshape.default, ([6, 4],), {}),), 1, "r")
    contiguous = torch.from_numpy(rng.standard_normal((4, 6)).astype(np.float32))
    transposed = torch.from_numpy(rng.standard_normal((6, 4)).astype(np.float32)).t()
    for base in (contiguous, transposed, contiguous, transposed):
        slots = [base, None]
        step.run(slots, {})
        assert torch.equal(slots[1], base.reshape(6, 4))
    # the transposed base's reshape copies: only the contiguous base's view is remembered
    assert list(step._strided) == [(contiguous.shape, contiguous.stride(), contiguous.dtype)]
    n = tc.var("n")
    sized = MakeView(0, ((aten.reshape.default, ([Size(n), -1],), {}),), 1, "s")
    for rows in (2, 3, 2):
        slots = [contiguous.reshape(-1), None]
        sized.run(slots, {n: rows})
        assert slots[1].shape == (rows, 24 // rows)
    assert not sized._strided


class _RecordingKernel:
    """A stand-in for a RunnableKernel on the GPU: `call_entry` computes y = 2x + 1 (as the
    executor's keyed path would) and hands out an entry; `relaunch` computes the same from the
    data pointers it is given, so a wrong pointer would give a wrong result."""

    def __init__(self):
        self.keyed = 0
        self.relaunched = 0

    def call_entry(self, x, y):
        self.keyed += 1
        y.copy_(x * 2 + 1)
        return ("entry", self.keyed)

    def relaunch(self, entry, ptrs, args):
        x, y = args
        assert ptrs == [x.data_ptr(), y.data_ptr()]
        self.relaunched += 1
        y.copy_(x * 2 + 1)
        return True


def _graph(kernel, steps_before=(), contiguous=True):
    from tecc.torch.runtime import CompiledGraph, RunProgram

    source = 1 if steps_before else 0
    program = RunProgram(kernel, (source,), (contiguous,), ((2, (4,), torch.float32),), False, "scale", device="cpu")
    steps = (*steps_before, program)
    frees = tuple(() for _ in steps)
    return CompiledGraph("g", 1, 3, steps, frees, [Slot(2)], [])


def test_a_program_relaunches_on_pointers_when_the_graph_inputs_keep_their_layouts():
    """The first call of a layout goes through the keyed path; later calls with inputs of the
    same sizes, strides and dtype relaunch the entry on the new pointers; another layout (a
    strided input, copied to row-major) is keyed again, and then relaunched in its turn."""
    kernel = _RecordingKernel()
    graph = _graph(kernel)
    rng = np.random.default_rng()
    fresh = [torch.from_numpy(rng.standard_normal(4).astype(np.float32)) for _ in range(3)]
    strided = [torch.from_numpy(rng.standard_normal(8).astype(np.float32))[::2] for _ in range(2)]
    for n, x in enumerate([*fresh, *strided]):
        (y,) = graph([x])
        assert torch.allclose(y, x * 2 + 1), n
    assert (kernel.keyed, kernel.relaunched) == (2, 3)


def test_a_fallback_result_of_other_sizes_is_keyed_again():
    """An input made by an ATen fallback is compared on a relaunch: the graph inputs' layouts
    alone do not vouch for it (an op whose output layout follows the values)."""
    slicer = RunAten(torch.narrow, (Slot(0), 0, 0, 4), {}, 1, "narrow")
    kernel = _RecordingKernel()
    graph = _graph(kernel, (slicer,))
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal(6).astype(np.float32))
    graph([x])
    graph([x.clone()])
    assert (kernel.keyed, kernel.relaunched) == (1, 1)
    assert graph.steps[1].watched == (0,)
    # the same graph input layout, but the fallback now gives another stride
    wide = RunAten(lambda t: t.as_strided((4,), (2,)), (Slot(0),), {}, 1, "strided")
    kernel2 = _RecordingKernel()
    graph2 = _graph(kernel2, (wide,), contiguous=False)
    x8 = torch.from_numpy(rng.standard_normal(8).astype(np.float32))
    graph2([x8])
    graph2.steps[0].fn = lambda t: t.as_strided((4,), (1,))
    (y,) = graph2([x8.clone()])
    assert torch.allclose(y, x8[:4] * 2 + 1)
    assert (kernel2.keyed, kernel2.relaunched) == (2, 0)


def test_a_programs_arguments_are_checked_once_per_layouts_number():
    """RunProgram._arguments: under a layouts number whose first call copied nothing, the inputs
    are taken as they are (the permuted ones permuted), only those an ATen fallback made
    (`watched`) are checked again; a number whose first call copied checks every call."""
    cl = torch.channels_last
    w = torch.randn(4, 3, 2, 2).to(memory_format=cl)
    x, y = torch.randn(5, 6), torch.randn(6, 5)
    program = RunProgram(kernel=None, inputs=(0, 1, 2), contiguous=(True, True, True), outputs=(), emulate=True,
                         input_orders=((0, 2, 3, 1), None, None))
    program.watched = (2,)
    first = program._arguments([w, x, y], 0)
    assert first[0].is_contiguous() and first[0].data_ptr() == w.data_ptr() and first[1] is x and first[2] is y
    # the same number: x is taken as it is (its layout is vouched for), the watched y is checked
    again = program._arguments([w, x, y.t()], 0)
    assert again[1] is x and again[2].is_contiguous() and torch.equal(again[2], y.t())
    # a number whose first call made a copy: every call checks every input
    copied = program._arguments([w, x.t(), y], 1)
    assert copied[1].is_contiguous() and torch.equal(copied[1], x.t())
    assert program._arguments([w, x.t(), y], 1)[1].is_contiguous()
    assert program._uncopied == {0}


def test_outputs_of_static_shape_are_allocated_like_an_expanded_prototype():
    """RunProgram._prototypes: per output of static shape and more than one element, a one-element
    tensor expanded to it, whose torch.empty_like is the contiguous tensor torch.empty makes;
    none for a 0-d, a one-element or a symbolic shape (allocated with the sizes)."""
    n = tc.var("n")
    outputs = ((0, (8, 3, 5), torch.bfloat16), (1, (4, 1, 6), torch.float32), (2, (), torch.float32),
               (3, (1, 1), torch.float16), (4, (n, 4), torch.float32), (5, (2, 3, 4, 5), torch.int64))
    program = RunProgram(kernel=None, inputs=(), contiguous=(), outputs=outputs,  # type: ignore[arg-type]
                         emulate=False)
    protos = program._prototypes(torch.device("cpu"))
    assert [p is not None for p in protos] == [True, True, False, False, False, True]
    for (_, shape, dtype), proto in zip(outputs, protos):
        if proto is None:
            continue
        assert proto.untyped_storage().nbytes() == proto.element_size()   # one element, expanded
        made, want = torch.empty_like(proto), torch.empty(*shape, dtype=dtype)
        assert (made.shape, made.stride(), made.dtype) == (want.shape, want.stride(), want.dtype)
        assert made.untyped_storage().data_ptr() != proto.untyped_storage().data_ptr()


def test_the_layouts_number_from_the_c_check_is_the_one_the_fields_give(monkeypatch):
    """CompiledGraph._layouts_number: the number a call gets through the last number's C++ check
    (tensor_guard) is the one reading every tensor's fields gives, over calls that keep and
    change sizes, strides, dtypes, requires_grad, the lazy negative bit and the other inputs."""
    from tecc.torch import runtime
    from tecc.torch.runtime import CompiledGraph, tensor_guard

    x, w = torch.randn(4, 6), torch.randn(6, 3)
    assert tensor_guard([x, w]) is not None, "this torch has no TensorGuards (the check is never taken)"
    changes = [
        [x, w, 3], [x, w, 4], [x.t().contiguous().t(), w, 3], [x.double(), w, 3], [x.clone().requires_grad_(), w, 3],
        [x[:, :5], w, 3], [x._neg_view(), w, 3], [3, w, x], [torch.randn(2, 6), w, 3], [x, w, 3.0], [x, w, True],
    ]
    # each layout twice (new tensors of it the second time), then back to the first
    calls = [c for args in changes for c in (args, [a.clone() if isinstance(a, torch.Tensor) else a for a in args])]
    calls.append([x, w, 3])

    def numbers() -> list[int | None]:
        graph = CompiledGraph("g", 3, 3, (), (), [], [])
        return [graph._layouts_number(list(args)) for args in calls]

    passed = []

    class Counted:
        def __init__(self, guard):
            self.guard = guard

        def check(self, *tensors):
            ok = self.guard.check(*tensors)
            passed.append(ok)
            return ok

    monkeypatch.setattr(runtime, "tensor_guard", lambda tensors: Counted(tensor_guard(tensors)))
    checked = numbers()
    assert passed.count(True) >= 4 and passed.count(False) >= 4   # both ways taken
    monkeypatch.setattr(runtime, "tensor_guard", lambda tensors: None)
    read = numbers()
    assert checked == read
    assert read[:6] == [0, 0, 1, 1, 2, 2] and read[12] is None and read[-1] == 0 and read[14] not in (0, None)
