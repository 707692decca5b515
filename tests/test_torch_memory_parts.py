"""A backward graph's program cut into parts for memory (tecc/torch/memory_parts.py), on CPU
tensors in the emulator: where the cuts go, that only backward graphs are cut, and that a cut
model trains as one program does and as eager does."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import tecc  # noqa: E402
from tecc.torch import memory_parts  # noqa: E402
from tecc.torch.report import reports  # noqa: E402

from torch_models import GPT, batches, fresh_dynamo, train  # noqa: E402,F401


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of a few kilobytes, so that the tiny GPT's backward is cut (at GPT-2's size a part
    is 1/8 of the backward's volume, at least 64 MiB, and a cut lowers the peak by 64 MiB)."""
    monkeypatch.setattr(memory_parts, "MIN_PART_BYTES", 4096)
    monkeypatch.setattr(memory_parts, "MIN_GAIN_BYTES", 1024)
    monkeypatch.setattr(memory_parts, "PARTS", 6)


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_a_backward_cut_into_parts_trains_like_eager_and_like_one_program(small_parts, attention):
    torch.manual_seed(0)
    model = GPT(layers=3, attention=attention)
    data = batches(3)
    expected = train(copy.deepcopy(model), data)
    whole = train(torch.compile(copy.deepcopy(model), backend="tecc",
                                options={"fallback": "error", "memory_parts": False}), data)
    programs_whole = {r.name.split("_", 1)[1]: len(r.programs) for r in reports()}
    torch._dynamo.reset()
    got = train(torch.compile(copy.deepcopy(model), backend="tecc", options={"fallback": "error"}), data)
    programs = {r.name.split("_", 1)[1]: len(r.programs) for r in reports()[len(programs_whole):]}
    assert programs_whole == {"forward": 1, "backward": 1}, programs_whole
    assert programs["forward"] == 1 and 2 <= programs["backward"] <= memory_parts.PARTS, programs
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-4, (expected, got)
    assert max(abs(a - b) for a, b in zip(whole, got)) <= 1e-5, (whole, got)


def _backward_graph(layers: int = 3):
    """The tiny GPT's backward ATen graph, as AOTAutograd gives it to the backend."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from tecc.torch.backend import partition
    from tecc.torch.decompositions import decomposition_table

    graphs = {}

    def keep(kind):
        def compile_fn(gm, inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_fn

    def backend(gm, example):
        return aot_module_simplified(gm, example, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                     decompositions=decomposition_table(), **partition("recompute"))

    torch.manual_seed(0)
    model = GPT(layers=layers)
    (idx, targets), = batches(1)
    torch.compile(model, backend=backend)(idx, targets).backward()
    return graphs["backward"]


def test_the_cuts_go_where_little_crosses_and_never_through_a_tuple(small_parts):
    from tecc.torch.graph import TECC, classify, is_view_node, levels, seed_node
    from tecc.torch.lowering import RandomDraws, Sizes

    gm = _backward_graph()
    kinds, _ = classify(gm, Sizes(), set(), RandomDraws(), seed_node(gm))
    level = levels(gm, kinds)
    (lvl,) = set(level.values())   # no fallback: one level
    nodes = [n for n in gm.graph.nodes if kinds.get(n) == TECC]
    cuts = memory_parts.part_cuts(nodes, kinds, level, lvl)
    assert 1 <= len(cuts) <= memory_parts.PARTS - 1 and cuts == sorted(set(cuts)), cuts
    position = {n: i for i, n in enumerate(nodes)}
    # what crosses each cut: values computed before it, read (not through a view) after it
    for cut in cuts:
        crossing = {a for n in nodes[cut:] if not is_view_node(n, kinds) for a in n.all_input_nodes
                    if a in position and position[a] < cut}
        crossing = {memory_parts._root(a, kinds) for a in crossing}
        sizes = [memory_parts._bytes(a) for a in crossing if a in position]
        assert None not in sizes, [a.name for a in crossing]   # no tuple crosses
    # each cut was kept because the modelled peak went down
    ledger = memory_parts._Ledger(nodes, kinds, level, lvl)
    assert ledger.peak(cuts) < ledger.peak([])
    # the cut GPT's parts: the renumbered levels keep the graph's order and one level per part
    split = memory_parts.split_levels(gm, kinds, level)
    assert sorted(set(split[n] for n in nodes)) == list(range(len(cuts) + 1))
    assert [split[n] for n in nodes] == sorted(split[n] for n in nodes)


def test_forward_graphs_and_the_option_off_are_one_program(small_parts):
    torch.manual_seed(0)
    model = GPT(layers=2)
    data = batches(1)
    train(torch.compile(model, backend="tecc", options={"memory_parts": False}), data)
    assert [len(r.programs) for r in reports()] == [1, 1]
    with torch.no_grad():   # an inference graph is not cut
        torch._dynamo.reset()
        torch.compile(copy.deepcopy(model), backend="tecc")(*data[0])
    assert len(reports()[-1].programs) == 1 and reports()[-1].name.endswith("inference")


def test_a_wrong_option_names_memory_parts_among_the_options():
    with pytest.raises(Exception) as excinfo:
        torch.compile(GPT(), backend="tecc", options={"memory_part": True})(*batches(1)[0])
    exc = excinfo.value
    while exc is not None and not isinstance(exc, tecc.TeccError):
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    assert exc is not None and "unknown option(s) memory_part;" in str(exc) and "memory_parts," in str(exc), excinfo.value


def test_gpt2s_backward_is_cut_once_after_the_loss_heads_row_kernel():
    """At GPT-2 small's sizes (two layers, batch 8 x 1024, bf16 autocast, as the backend gets the
    graphs), with the default thresholds: one cut, so that the saved logits die before the head's
    GEMMs and the gradients are allocated after; no cut between layers (it would lower no peak
    and compile the layers' kernels twice)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import model_kernels

    from tecc.torch.backend import _bound_symbols, plan_graph
    from tecc.torch.lowering import Sizes

    gm = model_kernels.gpt2(2)["backward"]
    plan = plan_graph(gm, "backward", Sizes(), _bound_symbols(gm), backward=True)
    head, rest = plan.segments
    assert len(rest.nodes) > 10 * len(head.nodes)
    (out,) = head.outputs   # the logits' gradient, [8192, 50304] in bfloat16
    assert tuple(out.meta["val"].shape) == (8192, 50304) and out.meta["val"].dtype == torch.bfloat16
    logits = [n for n in head.inputs if tuple(getattr(n.meta.get("val"), "shape", ())) == (8192, 50304)]
    assert logits and not any(n in rest.inputs for n in logits), "the saved logits are read by the head's part only"
