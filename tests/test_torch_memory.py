"""A training step's memory from tecc's launch plan (benchmarks/model_memory.py) on the tiny GPT
(bf16 autocast, SDPA), its graphs built for sm_90 with NVRTC (no GPU): the forward leaves the
backward no more memory than the partition's saved tensors take, and the stream arena keeps one
working set (the largest program's), placed by live ranges, where executors kept one each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    from nvrtc_checks import skip_without_nvrtc

    skip_without_nvrtc("sm_90")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_kernels as mk
    import model_memory as mm
    from train_gpt import GPT

    torch.manual_seed(0)
    model = GPT(128, 64, 4, 2, 32, "sdpa")
    idx = torch.randint(0, 128, (2, 32))
    graphs = mk.trace(model, (idx, idx), train=True, autocast=torch.bfloat16)
    compiled = {kind: mm.compile_cuda(gm, f"g_{kind}", "sm_90", kind) for kind, gm in graphs.items()}
    return mm, mm.pairs_of(graphs), compiled


def _after_forward(mm, pair, runner):
    """The bytes the forward's outputs hold once it returned (saved tensors and user outputs),
    and the ledger."""
    ledger = mm.Ledger()
    inputs = [mm.Storage(ledger, mm.tensor_bytes(mm._val(n)), "inputs", n.name) for n in mm._placeholders(pair.forward)]
    held = list(inputs)
    outs = runner(ledger, 0, pair, inputs)
    for position, value in enumerate(outs):
        ledger.relabel(value, "graph outputs" if position < pair.user_outputs else "saved for backward")
    cats = ledger.categories(ledger.live)
    del held, outs
    return cats.get("saved for backward", 0) + cats.get("graph outputs", 0), cats


def test_the_forward_leaves_the_backward_what_the_partition_saves(tiny):
    """tecc's forward program returns each saved value in memory of its own or as a view of
    another output, never a copy: its saved bytes are the floor's (the ATen graph run with only
    its outputs, and the bases they view, allocated), and nothing else outlives the call but the
    stream arena."""
    mm, pairs, compiled = tiny
    (pair,) = pairs
    saved, cats = _after_forward(mm, pair, mm.compiled_runner(compiled, mm.Arenas("stream"), "forward"))
    floor, floor_cats = _after_forward(mm, pair, mm.aten_runner("forward", False))
    assert saved > 0 and saved == floor, (cats, floor_cats)
    assert set(cats) <= {"inputs", "saved for backward", "graph outputs", "temporaries (stream arena)"}, cats


def test_the_stream_arena_keeps_one_working_set(tiny):
    """One training step after a warm-up one: with temporaries kept per program the forward's
    stay through the backward; with the stream arena the peak holds one arena, as large as the
    largest program's layout, which is at least the most bytes live at one of its launches and
    at most what shared_storage's storages took."""
    mm, pairs, compiled = tiny
    from tecc.runtime import arena
    from tecc.runtime.host import temp_bytes
    from tecc.runtime.marshal import live_ranges, plan_launches, shared_storage
    from tecc.torch.runtime import RunProgram

    peaks = {}
    for mode in ("program", "stream"):
        arenas = mm.Arenas(mode)
        mm.step(mm.Ledger(), pairs, mm.compiled_runner(compiled, arenas, "forward"),
                mm.compiled_runner(compiled, arenas, "backward"))
        ledger = mm.Ledger()
        again = mm.Arenas(mode, {k: mm.Storage(ledger, s.nbytes, s.category, s.name) for k, s in arenas.kept.items()},
                          arenas.layouts)
        mm.step(ledger, pairs, mm.compiled_runner(compiled, again, "forward"),
                mm.compiled_runner(compiled, again, "backward"))
        peaks[mode] = (ledger.peak, ledger.categories())
    layouts = []
    for graph in compiled.values():
        for step in graph.steps:
            if not isinstance(step, RunProgram) or not step.kernel.host.temps:
                continue
            host = step.kernel.host
            planned = plan_launches(host)
            sizes = {t.name: temp_bytes(t, {}) for t in host.temps}
            placed = arena.layout(tuple((t.name, sizes[t.name], bool(t.zero_init)) for t in host.temps), None,
                                  live_ranges(planned)).nbytes
            storage = shared_storage(host, planned)
            kept = {}
            for name, nbytes in sizes.items():
                kept[storage[name]] = max(kept.get(storage[name], 0), nbytes)
            assert mm._most_live(host, planned, sizes) <= placed <= sum(kept.values())
            layouts.append(placed)
    assert len(layouts) == 2, "the forward's and the backward's program have temporaries"
    program, stream = peaks["program"], peaks["stream"]
    assert stream[1]["temporaries (stream arena)"] == max(layouts), stream
    assert program[1]["temporaries (forward)"] > 0 and program[1]["temporaries (backward)"] > 0, program
    assert stream[0] < program[0], (stream, program)


def test_the_recompute_partitioner_saves_less_and_trains_like_eager():
    """partitioner="recompute" (the min-cut partition recomputing the cheap values the
    backward's GEMMs read): a GPT-2 small layer's forward (bf16 autocast, batch 8 x 1024) saves
    less than under min_cut (its MLP's GELU output, the layer norms' bf16 outputs and the bf16
    weights are recomputed), and the tiny GPT in float32 trains three steps within 1e-4 of
    eager in the emulator."""
    import copy

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import model_kernels as mk
    import model_memory as mm
    from torch_models import GPT, batches, train

    from tecc.torch.backend import Options

    assert Options.parse({"partitioner": "recompute"}).partitioner == "recompute"
    saved = {}
    for partitioner in ("min_cut", "recompute"):  # one GPT-2 small layer, traced on the CPU (nothing runs)
        (pair,) = mm.pairs_of(mk.gpt2(1, partitioner))
        bases = {}
        for node in mm._outputs(pair.forward)[pair.user_outputs:]:
            while mm._is_view(node):
                node = node.args[0]
            if node.op != "placeholder":
                bases[node] = mm.tensor_bytes(mm._val(node))
        saved[partitioner] = sum(bases.values())
    # the GELU output (48 MiB), two layer norms' bf16 outputs (12 MiB each), the bf16 weights
    assert saved["recompute"] <= saved["min_cut"] - 72 * 2**20, saved

    torch.manual_seed(0)
    model = GPT(attention="sdpa")
    twin = copy.deepcopy(model)
    data = batches(3)

    torch._dynamo.reset()
    expected = train(model, data)
    got = train(torch.compile(twin, backend="tecc", options={"fallback": "error", "partitioner": "recompute"}), data)
    torch._dynamo.reset()
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-4, (expected, got)
