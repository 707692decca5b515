"""Compile time of programs whose kernels repeat (a model's layers): twin kernels compiled once by
NVRTC and launched under their own names (tecc/codegen/twins.py), and the planner's rankings
shared over the kernels of one structure (planner.Rankings; docs/models.md, "Compile time")."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import emit_parts, twin_entries
from tecc.codegen.twins import renames_to
from tecc.ir import dtype as dt
from tecc.ir.expr import Var
from tecc.ir.stmt import Allocate, Buffer, BufferStore, For, PrimFunc, seq
from tecc.compiler import planner
from tecc.compiler.planner import Rankings, shared_rankings
from tecc.runtime.artifact import load, manifest_version


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path / "cache"))


def _layers(count: int, prefix: str = "", shape=(96, 64)):
    """`count` independent rows of stages, each y = exp(x) * 0.5 + x over its own input, and a
    last one with log in place of exp: every layer's kernel is the first's up to names, the last
    one's is not."""
    args, outs = [], []
    for n in range(count + 1):
        x = tc.placeholder(shape, "float32", name=f"{prefix}x{n}")
        y = tc.compute(shape, _layer(x, tc.log if n == count else tc.exp), name=f"{prefix}y{n}")
        args.append(x)
        outs.append(y)
    return args + outs


def _layer(x, fn):
    return lambda i, j: fn(x[i, j]) * 0.5 + x[i, j]


def _fresh(args, rng):
    arrays = []
    for t in args:
        shape = tuple(int(d) for d in t.shape)
        arrays.append(rng.uniform(0.5, 2.0, shape).astype(np.float32) if t.is_placeholder
                      else np.full(shape, np.nan, np.float32))  # outputs poisoned
    return arrays


def test_twin_kernels_are_compiled_once_and_launched_under_their_own_names():
    count = 3
    args = _layers(count)
    k = tc.build(args, target="cuda", arch="sm_90")
    names = [info.name for info in k.host.kernels]
    entries = {info.name: info.entry for info in k.host.kernels}
    assert len(names) == count + 1, names
    log_kernel = f"y{count}_kernel"
    exp_kernels = [n for n in names if n != log_kernel]
    first = exp_kernels[0]
    assert [entries[n] for n in exp_kernels] == [""] + [first] * (count - 1)
    assert entries[log_kernel] == ""      # the log kernel is no twin
    # NVRTC compiled two kernels; the module's CUDA C still holds every kernel under its name
    assert k.ptx.count(".entry ") == 2, k.ptx.count(".entry ")
    assert all(f"void __launch_bounds__" in k.source and f" {n}(" in k.source for n in names)
    assert set(k.resources) == set(names) and k.resources[names[1]] == k.resources[first]
    # the program computes what NumPy computes (the emulator runs every kernel's own IR)
    arrays = _fresh(args, np.random.default_rng(0))
    k.sim(*arrays)
    inputs, outputs = arrays[: count + 1], arrays[count + 1:]
    for n, (x, y) in enumerate(zip(inputs, outputs)):
        x64 = x.astype(np.float64)
        expected = (np.log(x64) if n == count else np.exp(x64)) * 0.5 + x64
        np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-6)


def test_a_saved_twin_is_format_version_4_and_loads_with_its_entry(tmp_path):
    k = tc.build(_layers(2), target="cuda", arch="sm_90")
    path = k.save(tmp_path / "twins")
    manifest = k.manifest()
    assert manifest["version"] == manifest_version(k.host) == 5
    loaded = load(path)
    assert [(i.name, i.entry) for i in loaded.host.kernels] == [(i.name, i.entry) for i in k.host.kernels]
    assert any(i.entry for i in loaded.host.kernels)
    plain = tc.build(_layers(0), target="cuda", arch="sm_90")   # no twin: the format does not move
    assert plain.manifest()["version"] == manifest_version(plain.host) < 4


def _kernel(name, *params):
    return SimpleNamespace(name=name, params=[SimpleNamespace(name=p) for p in params], body=seq())


def _row_sum(name: str, a: str, out: str, acc: str) -> PrimFunc:
    """out[r] = sum_j a[r, j] (64 x 256), one thread per row, accumulating in a local buffer `acc`
    (a row kernel's registers are named after the tensor they hold, not after a parameter)."""
    A, O = Buffer(a, dt.float32, (64, 256)), Buffer(out, dt.float32, (64,))
    r_acc = Buffer(acc, dt.float32, (1,), "local")
    r, j = Var("r"), Var("j")
    body = seq(BufferStore(r_acc, (0,), 0.0),
               For(j, 0, 256, "serial", BufferStore(r_acc, (0,), r_acc[0] + A[r, j])),
               BufferStore(O, (r,), r_acc[0]))
    return PrimFunc(name, (A, O), For(r, 0, 64, "threadIdx.x", Allocate(r_acc, body)))


def test_twins_may_name_their_local_buffers_differently():
    kernels = [_row_sum("k0", "x0", "y0", "add_21_row"), _row_sum("k1", "x1", "y1", "add_17_row"),
               _row_sum("k2", "x2", "y2", "x2")]   # its buffer named like its parameter: not k0's code renamed
    prelude, texts = emit_parts(kernels)
    assert "add_17_row" in texts[1]
    assert twin_entries(kernels, texts, prelude) == {"k1": "k0"}


def test_renaming_is_of_the_kernels_own_names_one_to_one():
    a = _kernel("k1", "x", "y")
    b = _kernel("k2", "p", "q")
    a_text = "void k1(float* x, float* y) { float copy_x_1 = x[0]; y[0] = expf(copy_x_1) + x_acc; }"
    assert renames_to(a, a_text, b, "void k2(float* p, float* q) { float copy_p_1 = p[0]; q[0] = expf(copy_p_1) + p_acc; }")
    # another function at the same place is another kernel, even where every name lines up
    assert not renames_to(a, a_text, b, "void k2(float* p, float* q) { float copy_p_1 = p[0]; q[0] = logf(copy_p_1) + p_acc; }")
    # two names of A may not become one of B
    c = _kernel("k3", "p", "p_acc")
    assert not renames_to(a, a_text, c, "void k3(float* p, float* p_acc) { float copy_p_1 = p[0]; p_acc[0] = expf(copy_p_1) + p_acc; }")
    # a name the prelude defines (a device helper) is never renamed
    d = _kernel("k4", "tecc")
    assert not renames_to(_kernel("k5", "x"), "void k5(float* x) { x[0] = x_max(1.0f); }", d,
                          "void k4(float* tecc) { tecc[0] = tecc_max(1.0f); }", frozenset({"x_max", "tecc_max"}))


def test_twins_need_the_same_parameters_in_the_same_order():
    args = _layers(2)
    k = tc.build(args, target="sim")
    prelude, texts = emit_parts(k.module.kernels)
    entries = twin_entries(k.module.kernels, texts, prelude)
    assert entries == {"y0_kernel": "y1_kernel"}, entries   # y2 takes the log: no twin
    y1 = [n for n, f in enumerate(k.module.kernels) if f.name == "y1_kernel"][0]
    y0 = [n for n, f in enumerate(k.module.kernels) if f.name == "y0_kernel"][0]
    y1_func = k.module.kernels[y1]
    shorter = _kernel("y0_kernel", *[p.name for p in k.module.kernels[y0].params][:-1])
    assert not renames_to(y1_func, texts[y1], shorter, texts[y0])


def _gemm_layers(count: int, prefix: str):
    """`count` fp16 GEMMs in a chain (a model's layers): X·W0, then ·W1, ... (tensor-core plans,
    checked for spills with NVRTC)."""
    x = tc.placeholder((256, 256), "float16", name=f"{prefix}x")
    args = [x]
    for n in range(count):
        w = tc.placeholder((256, 256), "float16", name=f"{prefix}w{n}")
        acc = tc.compute((256, 256), _product(x, w), name=f"{prefix}acc{n}")
        x = tc.compute((256, 256), _half(acc), name=f"{prefix}h{n}")
        args.append(w)
    return args + [x]


def _product(x, w):
    r = tc.reduce_axis(256, name="r")
    return lambda i, j: tc.sum(tc.cast(x[i, r], "float32") * tc.cast(w[r, j], "float32"), axis=r)


def _half(acc):
    return lambda i, j: tc.cast(acc[i, j], "float16")


class _Counts:
    """Kernels ranked (planner.candidates_for; `in_parts`: of the programs a plan in regions
    is made of) and compile checks (refuse_spills), counted."""

    def __init__(self, monkeypatch):
        self.ranked = 0
        self.in_parts = 0
        self.checked = 0
        self.program = ""
        self.key: object = None
        self.keys: list[object] = []       # the ranking key of every kernel ranked
        inner_rank = planner.candidates_for
        inner_key = planner.ranking_key

        def key(program, *args, **kwargs):
            self.program = program.name or ""
            self.key = inner_key(program, *args, **kwargs)
            return self.key

        def ranked(*args, **kwargs):
            self.ranked += 1
            self.in_parts += "_part" in self.program
            self.keys.append(self.key)
            return inner_rank(*args, **kwargs)

        monkeypatch.setattr(planner, "ranking_key", key)
        monkeypatch.setattr(planner, "candidates_for", ranked)
        import importlib

        build_module = importlib.import_module("tecc.compiler.build")
        inner_check = build_module.refuse_spills

        def checked(*args, **kwargs):
            self.checked += 1
            return inner_check(*args, **kwargs)

        checked.__qualname__ = "refuse_spills"
        monkeypatch.setattr(build_module, "refuse_spills", checked)


def test_programs_sharing_rankings_rank_and_check_a_kernel_structure_once(monkeypatch):
    counts = _Counts(monkeypatch)
    with shared_rankings(Rankings()) as rankings:
        first = tc.build(_gemm_layers(2, "a"), target="cuda", arch="sm_90")
        ranked, checked = counts.ranked, counts.checked
        assert ranked >= 1 and checked >= 1 and rankings.misses == ranked, (ranked, checked)
        second = tc.build(_gemm_layers(2, "b"), target="cuda", arch="sm_90")
    # the second program's kernels are the first's up to names: nothing ranked or compiled again
    assert counts.ranked == ranked and counts.checked == checked, (counts.ranked, counts.checked)
    assert first.plan.strategy == second.plan.strategy
    assert [(c.strategy.name, c.point) for c in (kp.chosen for kp in first.planning.kernels)] == \
           [(c.strategy.name, c.point) for c in (kp.chosen for kp in second.planning.kernels)]
    prelude, a_texts = emit_parts(first.module.kernels)
    _, b_texts = emit_parts(second.module.kernels)
    assert len(a_texts) == len(b_texts)
    for fa, ta, fb, tb in zip(first.module.kernels, a_texts, second.module.kernels, b_texts):
        assert renames_to(fa, ta, fb, tb, frozenset()), (fa.name, fb.name)   # the same CUDA C up to names
    # without sharing, each build ranks its own kernels (as a build always has)
    tc.build(_gemm_layers(2, "c"), target="cuda", arch="sm_90")
    assert counts.ranked > ranked


def _tiny_gpt_compile(layers: int, monkeypatch) -> tuple["_Counts", list]:
    """Compile (and run once, forward and backward) the tiny GPT of tests/torch_models.py with
    `layers` layers through the torch backend, its programs built for CUDA (NVRTC needs no GPU;
    they run in the emulator on CPU tensors): (what was ranked and checked, the built programs)."""
    torch = pytest.importorskip("torch")
    import tecc.torch.backend as backend
    from torch_models import GPT, batches

    torch._dynamo.reset()
    backend.RANKINGS.clear()
    counts = _Counts(monkeypatch)
    built: list = []
    inner = backend.build_programs

    def keep(*args, **kwargs):
        kernels = inner(*args, **kwargs)
        built.extend(kernels)
        return kernels

    monkeypatch.setattr(backend, "build_programs", keep)
    monkeypatch.setattr(backend, "_target", lambda emulate: "cuda")
    monkeypatch.setenv("TECC_BUILD_CACHE", "0")
    torch.manual_seed(0)
    model = GPT(attention="sdpa", layers=layers)
    idx, targets = batches(1)[0]
    # under bfloat16 autocast, as GPT-2 trains: the float32 residual stream's gradient is then a
    # tensor of its own between layers (in float32 throughout, each layer's kernels would inline
    # it through all the layers after it, and no two layers' kernels would be alike)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(idx, targets)
        loss = torch.compile(model, backend="tecc", options={"fallback": "error"})(idx, targets)
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
    monkeypatch.undo()
    return counts, built


def test_a_models_layers_are_ranked_and_compiled_once(tmp_path, monkeypatch):
    """Every kernel structure of the model (its forward and backward graphs, the parts they are
    planned in) is ranked once, and every kernel NVRTC compiles is no other's twin."""
    monkeypatch.setenv("TECC_CACHE_DIR", str(tmp_path))
    counts, built = _tiny_gpt_compile(3, monkeypatch)
    launched = sum(len(k.host.kernels) for k in built)
    assert counts.in_parts > 0 and len(counts.keys) == len(set(counts.keys)), "a kernel structure was ranked twice"
    twins = sum(1 for k in built for info in k.host.kernels if info.entry)
    assert twins > 0 and launched > twins
    for k in built:
        prelude, texts = emit_parts(k.module.kernels)
        own = [n for n, info in enumerate(k.host.kernels) if not info.entry]
        assert [k.host.kernels[n].name for n in own] == [k.module.kernels[n].name for n in own]
        assert twin_entries([k.module.kernels[n] for n in own], [texts[n] for n in own], prelude) == {}


@pytest.mark.gpu
def test_twin_kernels_run_on_the_gpu_through_their_first_kernels_function():
    from tecc.runtime.cuda import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA GPU")
    count = 3
    args = _layers(count)
    k = tc.build(args, target="cuda")
    assert sum(1 for info in k.host.kernels if info.entry) == count - 1
    arrays = _fresh(args, np.random.default_rng(1))
    k(*arrays)   # NumPy arrays: copied in, run, copied back
    for n, (x, y) in enumerate(zip(arrays[: count + 1], arrays[count + 1:])):
        x64 = x.astype(np.float64)
        expected = (np.log(x64) if n == count else np.exp(x64)) * 0.5 + x64
        np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-6)
    # and saved, then loaded by the runtime alone
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        loaded = load(k.save(f"{folder}/twins"))
        again = _fresh(args, np.random.default_rng(2))
        loaded(*again)
        for n, (x, y) in enumerate(zip(again[: count + 1], again[count + 1:])):
            x64 = x.astype(np.float64)
            expected = (np.log(x64) if n == count else np.exp(x64)) * 0.5 + x64
            np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-6)
