"""The stream arena of kernel temporaries (tecc/runtime/arena.py): placement by live ranges, one
arena per torch stream shared by every executor following it, zero_init temporaries kept apart,
one block per call under CUDA-graph capture."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tecc.runtime import arena
from tecc.runtime.marshal import live_ranges, plan_launches

from test_runtime_fastpath import (TORCH_DTYPES, TorchLike, _chained_products, _followed_stream_stub,
                                   chained_products_on_torch)
from test_runtime_fastpath import faketorch, full_path  # noqa: F401 - fixtures


def _overlapping_pairs(temps, ranges):
    for i, (a, _, za) in enumerate(temps):
        for b, _, zb in temps[i + 1:]:
            if za or zb or a not in ranges or b not in ranges:
                continue
            (fa, la), (fb, lb) = ranges[a], ranges[b]
            if fa <= lb and fb <= la:
                yield a, b


@pytest.mark.parametrize("seed", range(40))
def test_temporaries_live_at_one_launch_never_share_bytes(seed):
    """Random temporaries and live ranges: two live at the same launch take disjoint bytes,
    every offset is aligned, and the arena is at least the most bytes live at one launch and at
    most their sum."""
    rng = random.Random(seed)
    count = rng.randint(1, 30)
    temps = tuple((f"T{i}", rng.choice([1, 7, 256, 1000, 4096, 65536 + rng.randint(0, 999)]), rng.random() < 0.1)
                  for i in range(count))
    ranges = {}
    for name, _, _ in temps:
        if rng.random() < 0.9:
            first = rng.randint(0, 20)
            ranges[name] = (first, first + rng.randint(0, 6))
    plan = arena.layout(temps, None, ranges)
    spans = {}
    for (name, nbytes, zero), offset in zip(temps, plan.offsets):
        if zero:
            assert offset is None
            continue
        assert offset is not None and offset % arena.ALIGNMENT == 0
        assert offset + nbytes <= plan.nbytes
        spans[name] = (offset, offset + nbytes)
    for a, b in _overlapping_pairs(temps, ranges):
        assert spans[a][1] <= spans[b][0] or spans[b][1] <= spans[a][0], (a, b, spans[a], spans[b], ranges)
    most = max((sum(n for name, n, z in temps if not z and name in ranges and ranges[name][0] <= p <= ranges[name][1])
                for p in range(30)), default=0)
    assert most <= plan.nbytes <= sum(arena._aligned(n) for _, n, z in temps if not z)


def test_chained_products_take_two_regions_not_three():
    """T0 (launches 0-1) and T2 (2-3) share bytes, T1 (1-2) overlaps both: the arena is two
    temporaries large."""
    import tecc as tc

    host = tc.build(_chained_products(), target="sim").host
    temps = tuple((t.name, 32 * 32 * 4, bool(t.zero_init)) for t in host.temps)
    plan = arena.layout(temps, None, live_ranges(plan_launches(host)))
    offset = dict(zip([t.name for t in host.temps], plan.offsets))
    assert offset["T0"] == offset["T2"] != offset["T1"] and plan.nbytes == 2 * 32 * 32 * 4


@pytest.fixture
def allocations(faketorch, monkeypatch):
    """Every byte tensor TorchLike.new_empty / new_zeros makes (the allocator's calls)."""
    made = []

    def new_bytes(self, shape, dtype, fill=np.nan):
        if getattr(dtype, "name", "") == "uint8":
            out = TorchLike(np.zeros(tuple(shape), np.uint8), device=self.device, dtype=dtype)
            made.append(out)
            return out
        numpy_dtype = next(k for k, v in TORCH_DTYPES.items() if v is dtype)
        return TorchLike(np.full(tuple(shape), fill, numpy_dtype), device=self.device, dtype=dtype)

    monkeypatch.setattr(TorchLike, "new_empty", new_bytes, raising=False)
    monkeypatch.setattr(TorchLike, "new_zeros", lambda self, shape, dtype: new_bytes(self, shape, dtype, 0),
                        raising=False)
    return made


def _pointers(f, host, name):
    """The pointer the last call passed for temporary `name`, at each launch that takes it."""
    found = set()
    for call, (_, _, _, params) in zip(host.calls, f.submitted[-len(host.calls):]):
        for position, arg in enumerate(call.args):
            if arg == name:
                found.add(params[position])
    return found


def test_executors_on_one_stream_share_its_arena(full_path, faketorch, monkeypatch, allocations):
    """Two programs following one torch stream: the second, larger, makes a larger arena; the
    first moves into it on its next call (its pointers inside it), and the old arena is freed
    once nothing holds it; calls after that allocate nothing."""
    import tecc as tc

    small_host = tc.build(_chained_products(32), target="sim").host
    large_host = tc.build(_chained_products(64), target="sim").host
    small = _followed_stream_stub(small_host, faketorch, monkeypatch)
    large = _followed_stream_stub(large_host, faketorch, monkeypatch)
    small_args = [TorchLike(np.ones((32, 32), np.float32)) for _ in range(3)]
    large_args = [TorchLike(np.ones((64, 64), np.float32)) for _ in range(3)]
    small(*small_args)
    assert len(allocations) == 1 and allocations[0].array.nbytes == 2 * 32 * 32 * 4
    large(*large_args)
    assert len(allocations) == 2 and allocations[1].array.nbytes == 2 * 64 * 64 * 4
    base = allocations[1].data_ptr()
    large_ptrs = {name: _pointers(large, large_host, name) for name in ("T0", "T1", "T2")}
    assert all(len(p) == 1 and base <= next(iter(p)) < base + 2 * 64 * 64 * 4 for p in large_ptrs.values())
    small(*small_args)  # a launch-cache hit: it takes the stream's (larger) arena now
    assert len(allocations) == 2 and small.calls_cached == 1
    (t1,) = _pointers(small, small_host, "T1")
    (t0,) = _pointers(small, small_host, "T0")
    assert base <= t0 < base + 2 * 64 * 64 * 4 and base <= t1 < base + 2 * 64 * 64 * 4 and t0 != t1
    assert arena.arena_bytes() == 2 * 64 * 64 * 4, "the first arena is freed once no executor holds it"
    for _ in range(2):
        large(*large_args)
        small(*small_args)
    assert len(allocations) == 2 and _pointers(large, large_host, "T1") == large_ptrs["T1"]


def test_a_zero_init_temporary_stays_with_its_executor(full_path, faketorch, monkeypatch, allocations):
    """A zero_init temporary (a counter its kernels leave zero) is not placed in the shared
    arena, which another program overwrites: each executor keeps its own, zeroed once."""
    import tecc as tc

    host = tc.build(_chained_products(32), target="sim").host
    zeroed = dataclasses.replace(host, temps=tuple(dataclasses.replace(t, zero_init=t.name == "T1")
                                                   for t in host.temps))
    one = _followed_stream_stub(zeroed, faketorch, monkeypatch)
    two = _followed_stream_stub(zeroed, faketorch, monkeypatch)
    args = [TorchLike(np.ones((32, 32), np.float32)) for _ in range(3)]
    for _ in range(2):
        one(*args)
        two(*args)
    ((a,), (b,)) = _pointers(one, zeroed, "T1"), _pointers(two, zeroed, "T1")
    assert a != b, "each executor has its own zero_init temporary"
    assert _pointers(one, zeroed, "T0") == _pointers(two, zeroed, "T0"), "the others share the stream's arena"
    counters = [t for t in allocations if t.data_ptr() in (a, b)]
    assert len(counters) == 2 and all(t.array.nbytes == 32 * 32 * 4 and not t.array.any() for t in counters)
    assert len(allocations) == 3  # two counters and one arena, over four calls


def test_under_capture_a_call_takes_one_block(full_path, faketorch, monkeypatch, allocations):
    """Under CUDA-graph capture each call takes its temporaries from the graph's pool: one
    block laid out by live ranges (T0 and T2 share), not one allocation per temporary."""
    import tecc as tc

    host = tc.build(_chained_products(32), target="sim").host
    f = _followed_stream_stub(host, faketorch, monkeypatch)
    faketorch.capturing[0] = True
    args = [TorchLike(np.ones((32, 32), np.float32)) for _ in range(3)]
    f(*args)
    f(*args)
    assert len(allocations) == 2 and all(t.array.nbytes == 2 * 32 * 32 * 4 for t in allocations)
    assert _pointers(f, host, "T0") == _pointers(f, host, "T2") == {allocations[1].data_ptr()}


@pytest.mark.gpu
def test_programs_sharing_a_stream_arena_match_float64_on_torch_tensors():
    """Two programs with temporaries (X·W⁴ at two sizes) called in turn on torch's stream, fresh
    inputs each time: both match NumPy in float64 while their temporaries share the stream's
    arena, which ends as large as the larger program's layout."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import tecc as tc

    programs = {n: tc.build(_chained_products(n), target="cuda") for n in (128, 256)}
    for seed in range(3):
        for n, f in programs.items():
            got, want = chained_products_on_torch(f, n, seed * 7 + n)
            assert np.allclose(got, want, rtol=1e-4, atol=1e-4), (seed, n, np.abs(got - want).max())
    largest = max(arena.layout(tuple((t.name, n * n * 4, False) for t in f.host.temps), None,
                               live_ranges(plan_launches(f.host))).nbytes for n, f in programs.items())
    assert arena.arena_bytes() >= largest
