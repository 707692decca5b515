"""The torch backend's `aot_cache` option (tecc/torch/aot_cache.py): a second process gets the
forward and backward graphs from AOTAutograd's cache, without the joint trace and the
partitioner, and trains the same; an unusable entry falls back to tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tecc.torch import aot_cache
from tecc.torch.backend import Options, tecc_backend
from torch_models import GPT, fresh_dynamo  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.skipif(not aot_cache.available(), reason="this torch has no usable AOTAutograd cache")

ROOT = Path(__file__).resolve().parent.parent

# Trains the tiny GPT two SGD steps with the option; prints the losses, a gradient's sum, how
# often the min-cut partitioner ran and AOTAutograd's cache counters. FORBID=1: the partitioner
# raises (a hit must not reach it).
CHILD = r"""
import json, os, sys
import torch
from torch._functorch import partitioners
sys.path.insert(0, "tests")
from torch_models import GPT
if os.environ.get("TARGET") == "cuda":  # programs with cubins (NVRTC needs no GPU), run in the emulator
    from tecc.torch import backend
    backend._target = lambda emulate: "cuda"

calls = [0]
original = partitioners.min_cut_rematerialization_partition
def counted(*args, **kwargs):
    calls[0] += 1
    if os.environ.get("FORBID") == "1":
        raise RuntimeError("the partitioner ran")
    return original(*args, **kwargs)
partitioners.min_cut_rematerialization_partition = counted

torch.manual_seed(0)
model = GPT(layers=1)
idx, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
options = {"aot_cache": os.environ.get("AOT", "1") == "1"}
if os.environ.get("PARALLEL"):
    options["parallel_compile"] = os.environ["PARALLEL"] == "1"
step = torch.compile(model, backend="tecc", options=options)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(2):
    loss = step(idx, targets)
    loss.backward()
    grad = float(model.head.weight.grad.double().abs().sum())
    opt.step(); opt.zero_grad()
    losses.append(loss.item())
from torch._dynamo.utils import counters
from tecc.torch import background, decompositions, direct
print(json.dumps({"losses": losses, "grad": grad, "partitions": calls[0], "aot": dict(counters["aot_autograd"]),
                  "workers": background.STATS, "table_built": decompositions.decomposition_table()._built,
                  "direct": direct.STATS}))
"""


def run_child(tmp_path: Path, forbid: bool = False, aot: bool = True, target: str = "sim",
              parallel: str = "") -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keeps where tecc's entry point is
    env = dict(os.environ, PYTHONPATH=path, TECC_CACHE_DIR=str(tmp_path / "tecc"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch"), FORBID="1" if forbid else "0", AOT="1" if aot else "0",
               TECC_BUILD_CACHE="1", TARGET=target, PARALLEL=parallel)  # the suite turns tecc's caches off (conftest.py); the option needs them
    env.pop("TECC_NO_CACHE", None)
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def entries(tmp_path: Path) -> list[Path]:
    folder = tmp_path / "torch" / "aotautograd"
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_second_process_skips_trace_and_partitioner(tmp_path: Path) -> None:
    first = run_child(tmp_path)
    assert first["partitions"] == 1 and first["aot"].get("autograd_cache_saved") == 1, first
    assert len(entries(tmp_path)) == 1 and first["table_built"]
    second = run_child(tmp_path, forbid=True)  # the partitioner raises if it runs
    assert second["partitions"] == 0 and second["aot"].get("autograd_cache_hit") == 1, second
    assert not second["table_built"]  # a hit does not trace: the decomposition table is never built
    assert "autograd_cache_bypass" not in second["aot"], second
    assert second["losses"] == first["losses"] and second["grad"] == first["grad"]
    assert second["losses"][1] < second["losses"][0]  # it trains

    # a damaged entry: torch reads it as a miss, traces and partitions again, trains the same
    for path in entries(tmp_path):
        path.write_bytes(b"not a pickle")
    third = run_child(tmp_path)
    assert third["partitions"] == 1 and "autograd_cache_hit" not in third["aot"], third
    assert third["losses"] == first["losses"] and third["grad"] == first["grad"]


def test_the_entry_points_at_teccs_disk_cache(tmp_path: Path) -> None:
    """Graphs in tecc's disk cache (built for CUDA, as on a GPU): the entry holds their keys, not
    the ATen graphs; a second process loads them by key; with tecc's entries gone, the entry is
    a miss: traced and partitioned again, then stored anew and hit by the next process."""
    first = run_child(tmp_path, target="cuda")
    assert first["aot"].get("autograd_cache_saved") == 1, first
    tecc_entries = list((tmp_path / "tecc" / "graphs").rglob("graph.json"))
    assert len(tecc_entries) == 2  # forward and backward
    drop_direct_entries(tmp_path)  # else the next process skips AOTAutograd (direct.py)
    second = run_child(tmp_path, forbid=True, target="cuda")
    assert second["partitions"] == 0 and second["aot"].get("autograd_cache_hit") == 1, second
    assert second["losses"] == first["losses"] and second["grad"] == first["grad"]

    for entry in tecc_entries:
        (entry.parent / "p0.json").write_text("{")  # a damaged program manifest
    third = run_child(tmp_path, target="cuda")
    assert third["partitions"] == 1 and third["aot"].get("autograd_cache_miss") == 1, third
    assert third["aot"].get("autograd_cache_saved") == 1, third
    assert third["losses"] == first["losses"] and third["grad"] == first["grad"]
    drop_direct_entries(tmp_path)
    fourth = run_child(tmp_path, forbid=True, target="cuda")
    assert fourth["partitions"] == 0 and fourth["aot"].get("autograd_cache_hit") == 1, fourth


def drop_direct_entries(tmp_path: Path) -> None:
    for path in (tmp_path / "tecc" / "direct").rglob("*.json"):
        path.unlink()


def test_a_later_process_skips_aotautograd(tmp_path: Path) -> None:
    """direct.py: the first process records the runtime's facts beside the two graphs' keys; the
    next builds the autograd function itself (AOTAutograd not called: no cache lookup, no trace,
    no partition) and trains exactly as the first. A damaged entry goes through AOTAutograd's
    cache; graphs gone from tecc's disk cache go through AOTAutograd's trace, which records anew."""
    first = run_child(tmp_path, target="cuda")
    assert first["direct"] == {"hits": 0, "stored": 1, "not_recorded": ""}, first
    second = run_child(tmp_path, forbid=True, target="cuda")
    assert second["direct"]["hits"] == 1 and second["partitions"] == 0 and not second["aot"], second
    assert second["losses"] == first["losses"] and second["grad"] == first["grad"]
    assert second["losses"][1] < second["losses"][0]  # the gradients reached the parameters

    for path in (tmp_path / "tecc" / "direct").rglob("*.json"):
        path.write_text("{")
    damaged = run_child(tmp_path, forbid=True, target="cuda")
    assert damaged["direct"]["hits"] == 0 and damaged["aot"].get("autograd_cache_hit") == 1, damaged
    assert damaged["losses"] == first["losses"]

    for entry in (tmp_path / "tecc" / "graphs").rglob("graph.json"):
        (entry.parent / "p0.json").write_text("{")  # the graphs cannot be loaded
    gone = run_child(tmp_path, target="cuda")
    assert gone["direct"]["hits"] == 0 and gone["partitions"] == 1 and gone["direct"]["stored"] == 1, gone
    assert gone["losses"] == first["losses"] and gone["grad"] == first["grad"]
    again = run_child(tmp_path, forbid=True, target="cuda")
    assert again["direct"]["hits"] == 1 and again["losses"] == first["losses"], again


def test_forward_compiled_by_a_worker(tmp_path: Path) -> None:
    """Option parallel_compile (background.py): the forward graph compiles in a worker process
    while the backward compiles here; its first call loads the worker's entry from the disk
    cache. It trains exactly as the graphs compiled here, and a second process finds both
    graphs (no worker then)."""
    here = run_child(tmp_path / "here", target="cuda", parallel="0")
    assert here["workers"]["started"] == 0, here
    worker = run_child(tmp_path / "worker", target="cuda", parallel="1")
    assert {k: worker["workers"][k] for k in ("started", "loaded", "compiled_here")} == \
        {"started": 1, "loaded": 1, "compiled_here": 0}, worker
    assert worker["losses"] == here["losses"] and worker["grad"] == here["grad"]
    assert len(list((tmp_path / "worker" / "tecc" / "graphs").rglob("graph.json"))) == 2
    again = run_child(tmp_path / "worker", forbid=True, target="cuda", parallel="1")
    assert again["workers"]["started"] == 0 and again["losses"] == here["losses"], again


def test_a_failed_worker_compiles_here(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker that cannot compile its graph (here: a request it cannot read) exits non-zero;
    the graph's first call compiles it in this process and logs the worker's failure."""
    from tecc.torch import background

    before = dict(background.STATS)
    pending = background.start(b"not a graph", Options(), "g0_forward", "0" * 64, False, "cuda",
                               lambda key: pytest.fail("nothing was stored to load"), lambda: (lambda args: ["here", *args]))
    assert pending is not None
    with caplog.at_level("WARNING", logger="tecc.torch"):
        assert pending([1]) == ["here", 1]
    assert pending.process.returncode != 0
    assert "compiling it in this process" in caplog.text and "g0_forward" in caplog.text
    assert background.STATS["compiled_here"] == before["compiled_here"] + 1
    assert not pending.log_path.parent.exists()   # the worker's request and log are gone
    assert pending([2]) == ["here", 2]  # resolved once


def test_when_a_graph_goes_to_a_worker() -> None:
    from tecc.torch import background

    small = torch.fx.symbolic_trace(lambda x: x + 1)
    assert not background.wanted(small, None, "cuda")  # auto: too few ops for a worker's start
    assert background.wanted(small, True, "cuda") and not background.wanted(small, False, "cuda")
    assert not background.wanted(small, True, "sim")  # the emulator's graphs are not in the disk cache
    with pytest.raises(Exception, match="parallel_compile"):
        Options.parse({"parallel_compile": "yes"})


def test_option_off_writes_no_entry(tmp_path: Path) -> None:
    off = run_child(tmp_path, aot=False)
    assert off["partitions"] == 1 and not entries(tmp_path) and not off["aot"], off


def test_unreadable_graph_is_a_miss() -> None:
    from torch._functorch._aot_autograd.autograd_cache import FXGraphCacheMiss

    code = aot_cache.TeccOutputCode(lambda args: args, Options(), "g0_forward", None, b"not a graph")
    code.prepare_for_serialization()
    with pytest.raises(FXGraphCacheMiss, match="cannot be read"):
        code.post_compile([], None, {})
    nothing = aot_cache.TeccOutputCode(lambda args: args, Options(), "g0_forward", None, None)
    nothing.prepare_for_serialization()
    with pytest.raises(FXGraphCacheMiss, match="not in tecc's disk cache"):
        nothing.post_compile([], None, {})
    missing = aot_cache.TeccOutputCode(lambda args: args, Options(), "g0_forward", "0" * 64, None)
    missing.prepare_for_serialization()
    with pytest.raises(FXGraphCacheMiss, match="missing or damaged"):
        missing.post_compile([], None, {})


def test_without_the_api_compiles_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A torch without the cache's names (torch 2.11 may lack some): the option changes nothing."""
    monkeypatch.setattr(aot_cache, "_AVAILABLE", False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "tecc"))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")  # only the missing API stands in the way
    torch.manual_seed(0)
    model = GPT(layers=1)
    idx, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    expected = model(idx, targets)
    got = torch.compile(model, backend=tecc_backend, options={"aot_cache": True})(idx, targets)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    assert not entries(tmp_path)


def test_symbolic_sizes_keep_the_option_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """dynamic=True: the option (tested with static shapes only) stays off -- no AOTAutograd
    entry -- and one compile serves two lengths as without it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "tecc"))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    torch.manual_seed(0)
    model = GPT(layers=1)
    step = torch.compile(model, backend=tecc_backend, dynamic=True)
    for length in (12, 16):
        idx, targets = torch.randint(0, 128, (2, length)), torch.randint(0, 128, (2, length))
        torch.testing.assert_close(step(idx, targets), model(idx, targets), rtol=2e-5, atol=2e-5)
    assert not entries(tmp_path)


def test_option_parsed() -> None:
    assert Options.parse({}).aot_cache, "on by default"
    assert Options.parse({"aot_cache": True}).aot_cache and not Options.parse({"aot_cache": False}).aot_cache


def test_a_worker_gets_the_graph_with_its_values_only() -> None:
    """The graph a worker compiles is pickled with only its nodes' values in their metadata (what
    the lowering reads; the rest may name the caller's classes or hold what GraphPickler cannot
    write); the caller's graph keeps its metadata."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from tecc.torch import backend

    with FakeTensorMode():
        x = torch.empty(8, 16)
        gm = make_fx(lambda x: (torch.relu(x) * 2,), tracing_mode="fake")(x)
    for node in gm.graph.nodes:
        node.meta["stack_trace"] = "the caller's frames"
    data = backend._values_only(gm)
    assert data is not None
    back = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    computed = [n for n in back.graph.nodes if n.op not in ("output",)]
    assert computed and all(set(n.meta) == {"val"} for n in computed)
    assert [tuple(n.meta["val"].shape) for n in computed] == [(8, 16)] * len(computed)
    assert all(n.meta["stack_trace"] == "the caller's frames" for n in gm.graph.nodes)


def _direct_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tecc.torch import backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "tecc"))
    monkeypatch.setenv("TECC_BUILD_CACHE", "1")
    monkeypatch.setattr(backend, "_target", lambda emulate: "cuda")  # graphs in the disk cache (cubins, run emulated)


def test_an_inference_graph_comes_back_directly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The conv net in eval under no_grad: one inference graph, recorded, then (dynamo reset, as
    in a new process) called without AOTAutograd, with the same result."""
    from tecc.torch import direct
    from torch_models import ConvNet

    _direct_env(monkeypatch, tmp_path)
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 16, 16)
    before = dict(direct.STATS)
    with torch.no_grad():
        first = torch.compile(model, backend="tecc")(x)
        assert direct.STATS["stored"] == before["stored"] + 1, direct.STATS
        torch._dynamo.reset()
        again = torch.compile(model, backend="tecc")(x)
        expected = model(x)
    assert direct.STATS["hits"] == before["hits"] + 1, direct.STATS
    assert torch.equal(first, again) and not again.requires_grad
    torch.testing.assert_close(again, expected, rtol=2e-5, atol=2e-5)


def test_a_graph_that_mutates_an_input_is_not_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Batch norm in training updates its running statistics (an input mutated in the graph):
    AOTAutograd's runtime does that, so the graph keeps going through it."""
    from tecc.torch import direct
    from torch_models import ConvNet

    _direct_env(monkeypatch, tmp_path)
    torch.manual_seed(0)
    model = ConvNet().train()
    stored = direct.STATS["stored"]
    torch.compile(model, backend="tecc")(torch.randn(2, 3, 16, 16)).sum().backward()
    assert direct.STATS["not_recorded"] == "an input is mutated" and direct.STATS["stored"] == stored
    assert not list((tmp_path / "tecc" / "direct").rglob("*.json"))


def test_a_tangent_gets_the_strides_its_graph_was_compiled_for() -> None:
    from tecc.torch.direct import _strided

    g = torch.arange(6.0).reshape(2, 3)
    same = _strided(g, (2, 3), (3, 1))
    assert same is g
    moved = _strided(g.t().contiguous().t(), (2, 3), (3, 1))
    assert moved.stride() == (3, 1) and torch.equal(moved, g)


def test_outputs_with_and_without_gradients_come_back_directly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A training graph returning two tensors that take a gradient (the second's arrives
    transposed: other strides than the compiled ones), an integer tensor and a detached one:
    after dynamo forgets the graph, the direct runtime gives the same values, the same
    requires_grad and the same parameter gradients as the first compile and as eager. An output
    that is a view of an intermediate is AOTAutograd's to regenerate: not recorded."""
    from tecc.torch import direct

    _direct_env(monkeypatch, tmp_path)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 6)
            self.view = False

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = torch.tanh(self.fc(x))
            out = (y * 2.0, y + 1.0, y.argmax(dim=1), y.detach() * 3.0)
            return out + ((y * 5.0).t(),) if self.view else out

    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 8)

    def run(fn: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        net.zero_grad()
        outs = fn(x)
        (outs[0].sum() + (outs[1].t() * torch.arange(30.0).reshape(6, 5)).sum()).backward()
        return [o.detach().clone() for o in outs] + [torch.tensor([o.requires_grad for o in outs])], \
            net.fc.weight.grad.clone()

    before = dict(direct.STATS)
    expected, expected_grad = run(net)
    first, first_grad = run(torch.compile(net, backend="tecc"))
    assert direct.STATS["stored"] == before["stored"] + 1, direct.STATS
    torch._dynamo.reset()
    again, again_grad = run(torch.compile(net, backend="tecc"))
    assert direct.STATS["hits"] == before["hits"] + 1, direct.STATS
    for got in (first, again):
        assert got[-1].tolist() == [True, True, False, False]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again_grad, expected_grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(again_grad, first_grad)

    torch._dynamo.reset()
    net.view = True
    stored = direct.STATS["stored"]
    viewed, _ = run(torch.compile(net, backend="tecc"))
    assert direct.STATS["not_recorded"] == "an output aliases an input or another output", direct.STATS
    assert direct.STATS["stored"] == stored
    torch.testing.assert_close(viewed[4], net(x)[4].detach(), rtol=1e-5, atol=1e-5)


def test_the_direct_backward_leaves_the_saved_tensors_to_the_graph() -> None:
    """The backward graph gets the saved tensors in a list it clears, and nothing else holds
    them: each is freed after its last reader (the activations' memory during the backward)."""
    import gc
    import weakref

    from tecc.torch.direct import _training

    seen: dict[str, Any] = {}

    def forward(args: list[Any]) -> list[torch.Tensor]:
        x = args[0]
        args.clear()
        saved = x * 2.0
        seen["ref"] = weakref.ref(saved)
        return [x * 3.0, saved]

    def backward(args: list[Any]) -> list[torch.Tensor]:
        saved, tangent = args
        args.clear()
        result = saved * tangent
        del saved
        gc.collect()
        seen["alive"] = seen["ref"]() is not None
        return [result]

    run = _training(forward, backward, 1, [True], [((4,), (1,))])
    x = torch.randn(4, requires_grad=True)
    (y,) = run(x)
    y.sum().backward()
    assert seen["alive"] is False
    torch.testing.assert_close(x.grad, x.detach() * 2.0)
