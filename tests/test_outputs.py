"""Outputs allocated for the caller: `C = f(A, B)` with the outputs left out (emulator, NumPy)."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.runtime.outputs import OutputAllocator, allocator_like


def _matmul_then_scale() -> tuple[tc.Tensor, tc.Tensor, tc.Tensor, tc.Tensor]:
    M, K = tc.var("M"), tc.var("K")
    A = tc.placeholder((M, K), "float32", name="A")
    B = tc.placeholder((K, 6), "float32", name="B")
    k = tc.reduce_axis(K, name="k")
    C = tc.compute((M, 6), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    D = tc.compute((M, 6), lambda i, j: C[i, j] * 2.0 + 1.0, name="D")
    return A, B, C, D


def test_a_single_output_left_out_is_returned_bare_with_sizes_from_the_inputs() -> None:
    A, B, C, _ = _matmul_then_scale()
    f = tc.build([A, B, C], target="sim")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    c = f(a, b)
    assert isinstance(c, np.ndarray) and c.shape == (3, 6) and c.dtype == np.float32
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f.sim(a, b), c, rtol=0, atol=0)


def test_several_outputs_come_back_as_a_tuple_in_signature_order() -> None:
    A, B, C, D = _matmul_then_scale()
    f = tc.build([A, C, B, D], target="sim")  # outputs need not come last
    rng = np.random.default_rng()
    a, b = rng.standard_normal((4, 2)).astype(np.float32), rng.standard_normal((2, 6)).astype(np.float32)
    c, d = f(a, b)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, 2 * (a.astype(np.float64) @ b) + 1, rtol=1e-5, atol=1e-5)


def test_the_in_place_form_still_writes_the_callers_arrays_and_returns_none() -> None:
    A, B, C, _ = _matmul_then_scale()
    f = tc.build([A, B, C], target="sim")
    rng = np.random.default_rng()
    a, b = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((3, 6)).astype(np.float32)
    c = np.full((2, 6), np.nan, np.float32)
    assert f(a, b, c) is None
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-5)


def test_an_output_size_no_input_determines_is_a_shape_error_that_says_to_pass_it() -> None:
    N = tc.var("N")
    X = tc.placeholder((4,), "float32", name="X")
    Y = tc.compute((N,), lambda i: tc.cast(i, "float32") * 2.0, name="Y")
    f = tc.build([X, Y], target="sim")
    with pytest.raises(tc.ShapeError, match=r"cannot allocate output Y: dimension 0 \(N\) needs N.*pass Y yourself"):
        f(np.ones(4, np.float32))
    y = np.empty(3, np.float32)
    f(np.ones(4, np.float32), y)  # the in-place form binds N from Y
    np.testing.assert_array_equal(y, [0, 2, 4])


def test_a_wrong_number_of_arrays_is_still_refused_naming_the_signature() -> None:
    A, B, C, _ = _matmul_then_scale()
    f = tc.build([A, B, C], target="sim")
    with pytest.raises(tc.TeccError, match=r"takes 3 arrays \(A, B, C\), got 1"):
        f(np.ones((2, 2), np.float32))


def test_allocator_knows_inputs_outputs_and_derived_shapes() -> None:
    A, B, C, D = _matmul_then_scale()
    f = tc.build([A, B, C, D], target="sim")
    alloc = OutputAllocator(f.host)
    assert [b.name for b in alloc.inputs] == ["A", "B"] and [b.name for b in alloc.outputs] == ["C", "D"]
    assert alloc.shapes([np.empty((7, 3)), np.empty((3, 6))]) == ((7, 6), (7, 6))
    assert allocator_like(np.empty(1))((2, 3), tc.float64).shape == (2, 3)
    with pytest.raises(tc.TeccError, match="cannot allocate outputs like a list"):
        allocator_like([1, 2])


def test_torch_like_inputs_get_outputs_from_their_new_empty_with_their_packages_dtype(monkeypatch) -> None:
    import sys
    import types

    package = types.ModuleType("fakearrays")
    package.float32 = "fakearrays.float32"
    monkeypatch.setitem(sys.modules, "fakearrays", package)

    class Tensor:
        made: list = []

        def __init__(self, shape):
            self.shape = tuple(shape)

        def new_empty(self, shape, dtype):
            Tensor.made.append((tuple(shape), dtype))
            return Tensor(shape)

    Tensor.__module__ = "fakearrays"
    A, B, C, D = _matmul_then_scale()
    f = tc.build([A, B, C, D], target="sim")
    full, outputs = OutputAllocator(f.host).complete([Tensor((3, 5)), Tensor((5, 6))])
    assert Tensor.made == [((3, 6), "fakearrays.float32"), ((3, 6), "fakearrays.float32")]
    assert full[2:] == outputs and all(isinstance(o, Tensor) for o in outputs)


def test_a_loaded_artifact_is_called_like_the_built_kernel_outputs_left_out_or_given(tmp_path) -> None:
    A, B, C, D = _matmul_then_scale()
    f = tc.build([A, C, B, D], target="cuda", arch="sm_90")  # NVRTC only: no GPU needed
    g = tc.load(f.save(tmp_path / "mm"))
    rng = np.random.default_rng()
    a, b = rng.standard_normal((5, 3)).astype(np.float32), rng.standard_normal((3, 6)).astype(np.float32)
    want = a.astype(np.float64) @ b
    c, d = g.sim(a, b)  # the outputs left out: allocated and returned, as f.sim(a, b) does
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, 2 * want + 1, rtol=1e-5, atol=1e-5)
    built_c, built_d = f.sim(a, b)
    np.testing.assert_array_equal(c, built_c)
    np.testing.assert_array_equal(d, built_d)
    c2, d2 = np.full((5, 6), np.nan, np.float32), np.full((5, 6), np.nan, np.float32)
    assert g.sim(a, c2, b, d2) is None  # the in-place form, in signature order
    np.testing.assert_array_equal(c2, c)
    np.testing.assert_array_equal(d2, d)
    with pytest.raises(tc.TeccError, match=r"takes 4 arrays \(A, C, B, D\), got 1"):
        g.sim(a)


@pytest.mark.gpu
def test_a_loaded_artifact_allocates_its_outputs_on_the_gpu_like_the_built_kernel(tmp_path) -> None:
    A, B, C, D = _matmul_then_scale()
    f = tc.build([A, C, B, D], target="cuda")
    g = tc.load(f.save(tmp_path / "mm"))
    rng = np.random.default_rng()
    a, b = rng.standard_normal((37, 5)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    want = a.astype(np.float64) @ b
    c, d = g(a, b)
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, 2 * want + 1, rtol=1e-5, atol=1e-5)
    built_c, built_d = f(a, b)
    np.testing.assert_array_equal(c, built_c)
    np.testing.assert_array_equal(d, built_d)
