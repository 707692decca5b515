"""torch.compile(model, backend="tecc") on CPU tensors: every program runs in the SIMT emulator.

Models are compared with eager PyTorch from the same weights (training steps, outputs, gradients);
the fallback reports, the error mode, dynamic shapes, the dumps and the entry point are specified
here too. tests/test_torch_opinfo.py holds the per-op checks on torch's OpInfo samples.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import tecc  # noqa: E402
from tecc.torch.report import reports  # noqa: E402

from torch_models import ConvNet, GPT, MLP, batches, fresh_dynamo, train  # noqa: E402,F401


def compiled(model, **options):
    return torch.compile(model, backend="tecc", options=options or None)


def tecc_error(excinfo) -> BaseException:
    """The TeccError inside what dynamo raised (it wraps a backend's error in BackendCompilerFailed)."""
    exc = excinfo.value
    while exc is not None and not isinstance(exc, tecc.TeccError):
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
    assert exc is not None, f"no TeccError in {excinfo.value!r}"
    return exc


def fallen_back() -> set[str]:
    return {op for r in reports() for op in r.fallback_ops}


def test_mlp_forward_and_gradients_match_eager_with_no_fallback():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(6, 16)
    y = compiled(twin, fallback="error")(x)
    ref = model(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y * y).sum().backward()
    (ref * ref).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert [r.name.split("_", 1)[1] for r in reports()] == ["forward", "backward"]
    assert all(not r.fallbacks for r in reports())


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_gpt_trains_four_steps_like_eager(attention):
    torch.manual_seed(0)
    model = GPT(attention=attention)
    twin = copy.deepcopy(model)
    data = batches(4)
    expected = train(model, data)
    got = train(compiled(twin, fallback="error"), data)
    assert max(abs(a - b) for a, b in zip(expected, got)) <= 1e-4, (expected, got)
    # embeddings, the loss's target pick and their gradients included: each graph is one program
    for r in reports():
        assert not r.fallbacks and len(r.programs) == 1, r.summary()
    if attention == "sdpa":  # the attention program inside the forward's program: one kernel per layer
        forward = reports()[0]
        online = [k for _, kernels in forward.programs for k in kernels if k.endswith("online_kernel")]
        assert len(online) == 2, forward.programs


@pytest.mark.parametrize("attention", ["masked", "sdpa"])
def test_gpt_with_dropout_trains_and_differentiates_the_masks_of_its_forward(attention):
    """Eager draws other masks, so the losses cannot be compared with eager's; instead: no
    fallback, the same generator state gives the same loss (the masks are drawn from it), a new
    call draws new masks, and the gradient is the derivative of the forward with ITS masks (a
    central difference along a random direction, each evaluation with the same seed)."""
    torch.manual_seed(0)
    model = GPT(layers=1, dropout=0.1, attention=attention)
    run = compiled(model, fallback="error")
    idx, targets = batches(1)[0]

    def loss_at(seed):
        torch.manual_seed(seed)
        return run(idx, targets)

    loss = loss_at(5)
    assert loss.item() == loss_at(5).item()
    assert loss.item() != run(idx, targets).item()
    loss = loss_at(5)
    loss.backward()
    assert not fallen_back()
    params = [p for p in model.parameters() if p.grad is not None]
    gen = torch.Generator().manual_seed(1)
    direction = [torch.randn(p.shape, generator=gen) for p in params]
    slope = sum((p.grad * d).sum() for p, d in zip(params, direction)).item()
    eps = 3e-3
    with torch.no_grad():
        for p, d in zip(params, direction):
            p += eps * d
    plus = loss_at(5).item()
    with torch.no_grad():
        for p, d in zip(params, direction):
            p -= 2 * eps * d
    minus = loss_at(5).item()
    # within 0.03% here; the derivative with another seed's masks differs by ~3%
    assert abs((plus - minus) / (2 * eps) - slope) <= 5e-3 * abs(slope), (plus, minus, slope)


class CumulativeHead(torch.nn.Module):
    """A linear layer, then a cumulative sum (an op tecc has no lowering for)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.fc(x), dim=-1) * 2


def test_fallback_error_names_the_op_and_its_node():
    torch.manual_seed(0)
    with pytest.raises(Exception) as excinfo:
        compiled(CumulativeHead(), fallback="error")(torch.randn(3, 8))
    message = str(tecc_error(excinfo))
    assert "aten.cumsum.default (FX node cumsum of graph" in message
    assert "no tecc lowering" in message and "fallback" in message


def test_fallback_report_names_ops_nodes_and_reasons():
    torch.manual_seed(0)
    model = CumulativeHead()
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(model)(x), model(x), rtol=1e-5, atol=1e-5)
    (report,) = reports()
    nodes = dict(report.fallbacks["aten.cumsum.default"])
    assert set(nodes) == {"cumsum"} and "no tecc lowering" in nodes["cumsum"]
    assert "aten.cumsum.default" in report.fallback_message()
    assert report.placement["cumsum"].startswith("ATen")
    assert len(report.programs) == 2, report.summary()  # the linear layer, then the doubling after cumsum


def test_conv_net_in_eval_matches_eager():
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        ref = model(x)
        y = compiled(model, fallback="error")(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert fallen_back() == set()


def test_conv_net_in_eval_channels_last_matches_eager():
    """channels_last: the average pool reads the NHWC stage under its logical NCHW view, over (h, w)
    as one reduced axis (a column reduction split over blocks where the planner ranks it first)."""
    torch.manual_seed(0)
    model = ConvNet().eval().to(memory_format=torch.channels_last)
    x = torch.randn(3, 3, 20, 20).to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        y = compiled(model, fallback="error")(x)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert fallen_back() == set()


def test_a_causal_softmax_of_symbolic_length_is_right_in_every_row():
    """Scores, a causal mask and softmax over a symbolic length, the probabilities an output:
    one row kernel with the online max and sum (the row's length is unknown, so it is not kept
    in registers). A thread whose columns are all masked (-inf) while its running max is still
    -inf adds exp(-inf - m) = 0, not exp(-inf + inf) = NaN: before, every row but the last
    (the only one with no masked column) came out NaN."""

    def f(q, k):
        s = (q @ k.transpose(-1, -2)) * 0.25
        positions = torch.arange(q.shape[-2])
        masked = ~((positions[None, :] - positions[:, None]) <= 0)
        return torch.softmax(torch.where(masked, float("-inf"), s), -1)

    run = torch.compile(f, backend="tecc", dynamic=True, options={"fallback": "error"})
    for length in (8, 12):
        q, k = torch.randn(2, 4, length, 16), torch.randn(2, 4, length, 16)
        torch.testing.assert_close(run(q, k), f(q, k), rtol=1e-5, atol=1e-6, msg=f"length {length}")


def test_one_dynamic_compile_serves_three_sequence_lengths():
    torch.manual_seed(0)
    model = GPT(context=32, layers=1)
    twin = copy.deepcopy(model)
    run = torch.compile(twin, backend="tecc", dynamic=True)
    for length in (8, 12, 16):
        idx, targets = batches(1, context=length, seed=length)[0]
        expected = model(idx, targets)
        got = run(idx, targets)
        assert abs(expected.item() - got.item()) <= 1e-4, (length, expected.item(), got.item())
        got.backward()
        expected.backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5)
    names = [r.name.split("_", 1)[1] for r in reports()]
    assert names == ["forward", "backward"], names  # one compile of each, whatever the length


def test_bfloat16_mlp_matches_eager_within_bfloat16_rounding():
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(model, fallback="error")(x), model(x), rtol=2e-2, atol=2e-2)


def test_views_that_leave_the_graph_are_views_not_copies():
    def f(x, w):
        y = torch.relu(x @ w)
        return y.t(), x.view(-1)

    x, w = torch.randn(4, 6), torch.randn(6, 5)
    yt, flat = compiled(f, fallback="error")(x, w)
    torch.testing.assert_close(yt, torch.relu(x @ w).t())
    assert flat.data_ptr() == x.data_ptr()          # a view of the input, made by torch
    assert yt.stride() == (1, 5)                    # the transpose of the program's [4, 5] output
    (program,) = reports()[0].programs
    assert len(program[1]) == 1, program            # one kernel: the product with its relu


def test_dump_ir_writes_the_graph_the_node_map_and_each_program(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    compiled(MLP(), dump_ir=str(tmp_path))(x)
    (graph,) = [p for p in tmp_path.iterdir() if p.name.endswith("forward")]
    assert "aten.addmm" in (graph / "graph.txt").read_text()
    nodes = (graph / "nodes.txt").read_text()
    assert "addmm" in nodes and "_kernel" in nodes
    (program,) = [p for p in graph.iterdir() if p.is_dir()]
    assert (program / "program.txt").read_text().startswith("# inputs")
    # the loop IR as lowered, or the parts' modules composed when the program was planned in regions
    assert any(p.name.endswith(("lower.txt", "compose.txt")) for p in program.iterdir())
    assert "plan" in (program / "explain.txt").read_text()


def test_unknown_options_and_fallback_modes_are_refused():
    with pytest.raises(Exception) as excinfo:
        compiled(MLP(), unroll=True)(torch.randn(2, 16))
    assert "unknown option(s) unroll" in str(tecc_error(excinfo))
    torch._dynamo.reset()
    with pytest.raises(Exception) as excinfo:
        compiled(MLP(), fallback="never")(torch.randn(2, 16))
    assert "fallback='never'" in str(tecc_error(excinfo))


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "tecc" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="tecc is installed without its torch_dynamo_backends entry "
                    "point (reinstall: pip install -e .)")
def test_backend_tecc_works_without_importing_tecc():
    code = ("import sys, torch\n"
            "assert 'tecc' not in sys.modules\n"
            "f = torch.compile(lambda x: torch.exp(x) * 2 + x.sum(), backend='tecc')\n"
            "x = torch.randn(5)\n"
            "torch.testing.assert_close(f(x), torch.exp(x) * 2 + x.sum())\n"
            "print('tecc' in sys.modules)\n")
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_the_training_example_runs_and_matches_eager(capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "docs" / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", "2", "--layers", "1"]) == 0
    assert "tecc trains like eager" in capsys.readouterr().out


def _mlp_in_the_graph_cache(tmp_path, monkeypatch):
    """(the backend module, an MLP, its input, its first output) after a first compile that stored
    the graph in a disk cache under tmp_path: programs with cubins (built for CUDA: NVRTC needs no
    GPU), run in the emulator on CPU tensors. Without the option aot_cache (on by default), which
    would compile the backward graph with the forward and keep AOTAutograd's entry beside tecc's:
    these tests are about tecc's own graph cache (test_torch_aot_cache.py has the option's)."""
    import tecc.torch.backend as backend

    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    monkeypatch.setattr(backend, "_target", lambda emulate: "cuda")
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 16)
    return backend, model, x, compiled(model, aot_cache=False)(x)


def test_a_compiled_graph_is_cached_on_disk_and_loaded_by_the_next_compile(tmp_path, monkeypatch):
    backend, model, x, first = _mlp_in_the_graph_cache(tmp_path, monkeypatch)
    entries = list((tmp_path / "graphs").rglob("graph.json"))
    assert len(entries) == 1 and list(entries[0].parent.glob("p0.cubin"))
    torch._dynamo.reset()

    def no_planning(*args, **kwargs):
        raise AssertionError("the second compile planned the graph instead of loading it")

    monkeypatch.setattr(backend, "plan_graph", no_planning)
    second = compiled(model, aot_cache=False)(x)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second, model(x), rtol=1e-5, atol=1e-5)
    assert reports()[-1].programs == reports()[0].programs


@pytest.mark.parametrize("damage", ["graph.json", "manifest", "cubin", "tecc version"])
def test_a_damaged_or_stale_graph_entry_is_compiled_again(tmp_path, monkeypatch, damage):
    """A graph entry that cannot be read (its launch list or a program's manifest cut short, a
    cubin without its ELF header) is a miss, as is one stored by another version of tecc (its
    key differs): the graph is compiled again, computes what it did, and its new entry (in
    place of the damaged one) serves the next compile."""
    from tecc.compiler import build_cache

    backend, model, x, first = _mlp_in_the_graph_cache(tmp_path, monkeypatch)
    (entry,) = [p.parent for p in (tmp_path / "graphs").rglob("graph.json")]
    if damage == "tecc version":
        monkeypatch.setattr(build_cache, "_FINGERPRINT", "another tecc")
    else:
        file = entry / {"graph.json": "graph.json", "manifest": "p0.json", "cubin": "p0.cubin"}[damage]
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2] if damage != "cubin" else b"not a cubin" + data[4:])
    torch._dynamo.reset()
    planned = []
    plan = backend.plan_graph
    monkeypatch.setattr(backend, "plan_graph", lambda *a, **kw: planned.append(1) or plan(*a, **kw))
    second = compiled(model, aot_cache=False)(x)
    assert planned, f"the {damage} damage was not noticed: the graph was loaded"
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    # the compile stored its graph in place of the damaged entry: the next one loads it
    torch._dynamo.reset()
    planned.clear()
    torch.testing.assert_close(compiled(model, aot_cache=False)(x), first, rtol=0, atol=0)
    assert not planned, "the entry written after the damage does not load"


def test_a_second_process_loads_the_cached_graph_without_the_compiler(tmp_path, monkeypatch):
    """A new process that finds the graph on disk imports neither the planner nor the passes nor
    the lowering (tecc.compiler's names, tecc.torch's ops and the backend's compile path are
    imported on first use), and computes what the first process's compile computed."""
    _, model, x, first = _mlp_in_the_graph_cache(tmp_path, monkeypatch)
    torch.save({"state": model.state_dict(), "x": x, "out": first.detach()}, tmp_path / "first.pt")
    code = (
        "import sys, torch\n"
        "from tecc.torch import backend\n"
        "backend._target = lambda emulate: 'cuda'  # as the first process: programs with cubins, run emulated\n"
        "from torch_models import MLP\n"
        f"saved = torch.load({str(tmp_path / 'first.pt')!r})\n"
        "model = MLP()\n"
        "model.load_state_dict(saved['state'])\n"
        "out = torch.compile(model, backend='tecc', options={'aot_cache': False})(saved['x'])\n"
        "torch.testing.assert_close(out, saved['out'], rtol=0, atol=0)\n"
        "heavy = sorted(m for m in sys.modules if m in ('tecc.compiler.planner', 'tecc.compiler.build', 'tecc.passes', "
        "'tecc.torch.graph', 'tecc.torch.lowering', 'tecc.torch.launch', 'tecc.torch.ops', 'islpy'))\n"
        "assert not heavy, f'a cache hit imported {heavy}'\n"
        "from tecc.torch.report import reports\n"
        "assert reports() and all(r.seconds > 0 for r in reports()), reports()  # the load's seconds\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_decomposition_table_is_built_at_its_first_read():
    from tecc.torch import decompositions

    table = decompositions._Table()
    assert not table._built
    merged = {**table}  # what AOTAutograd does with it when it traces
    assert table._built and len(merged) == len(table) > 100
    aten = torch.ops.aten
    assert aten.native_layer_norm.default in table and table.get(aten.native_layer_norm.default) is not None
    assert all(op not in table for op in decompositions.KEEP)
    assert dict(decompositions._Table()).keys() == merged.keys() == table.copy().keys()
    assert bool(decompositions._Table())
