"""The tensor-expression front end: inference, promotion and the errors bad programs get."""

from __future__ import annotations

import numpy as np
import pytest

import tecc as tc
from tecc.ir.expr import Const


def test_matmul_expression_has_inferred_shape_dtype_and_readable_text():
    M = tc.var("M")
    A = tc.placeholder((M, 256), "float32", name="A")
    B = tc.placeholder((256, 512), "float32", name="B")
    k = tc.reduce_axis(256, name="k")
    C = tc.compute((M, 512), lambda i, j: tc.sum(A[i, k] * B[k, j], axis=k), name="C")
    assert C.dtype == tc.float32
    assert [str(s) for s in C.shape] == ["M", "512"]
    assert str(C) == "C[i, j] = sum(A[i, k] * B[k, j] for k in range(256))"


def test_expressions_are_hash_consed_so_equal_structure_is_identity():
    A = tc.placeholder((4, 4), "float32", name="A")
    i = tc.var("i")
    e1 = A[i, 0] * 2.0 + 1.0
    e2 = A[i, 0] * 2.0 + 1.0
    assert e1 is e2
    assert {e1: 1}[e2] == 1
    assert bool(e1 == e2)
    assert not bool(e1 != e2)


@pytest.mark.parametrize("a,b,want", [
    ("float16", "float32", "float32"),
    ("float16", "bfloat16", "float32"),
    ("int32", "float16", "float16"),
    ("int32", "int64", "int64"),
    ("bool", "int32", "int32"),
    ("float32", "float64", "float64"),
])
def test_promotion_table(a, b, want):
    x = tc.placeholder((2,), a, name="x")
    y = tc.placeholder((2,), b, name="y")
    z = tc.compute((2,), lambda i: x[i] + y[i])
    assert z.dtype.name == want


def test_python_scalars_take_the_tensor_dtype():
    x = tc.placeholder((2,), "float16", name="x")
    assert (x[0] * 2.0).dtype == tc.float16
    n = tc.placeholder((2,), "int32", name="n")
    assert (n[0] + 3).dtype == tc.int32
    assert (n[0] * 1.5).dtype == tc.float32


def test_wrong_index_arity_names_tensor():
    A = tc.placeholder((3, 4), "float32", name="A")
    with pytest.raises(tc.ShapeError, match=r"tensor A has 2 dimensions.*A\[i\] gives 1 index"):
        tc.compute((3,), lambda i: A[i])


def test_non_integer_index_is_a_dtype_error():
    A = tc.placeholder((3, 4), "float32", name="A")
    with pytest.raises(tc.DTypeError, match=r"index 1 of A\[i, .*float32"):
        tc.compute((3, 4), lambda i, j: A[i, tc.cast(j, "float32")])
    with pytest.raises(tc.DTypeError, match="indices must be integers"):
        A[0, 1.5]


def test_reduce_axis_outside_its_reduction():
    A = tc.placeholder((3, 4), "float32", name="A")
    k = tc.reduce_axis(4, name="k")
    with pytest.raises(tc.ShapeError, match="reduction axis k is used outside a reduction"):
        tc.compute((3,), lambda i: A[i, k] + tc.sum(A[i, k], axis=k), name="bad")


def test_static_out_of_bounds_constant_index():
    A = tc.placeholder((3, 4), "float32", name="A")
    with pytest.raises(tc.ShapeError, match="index 1 of A\\[0, 4\\] is 4, outside dimension 1"):
        A[0, 4]


def test_affine_out_of_bounds_is_proved_with_a_witness_point():
    M = tc.var("M")
    A = tc.placeholder((M, 8), "float32", name="A")
    with pytest.raises(tc.ShapeError, match=r"index 0 of A\[i \+ 1, j\].*size M.*at M=1, i=0"):
        tc.compute((M, 8), lambda i, j: A[i + 1, j], name="shift")


def test_guarded_read_is_accepted():
    M = tc.var("M")
    A = tc.placeholder((M, 8), "float32", name="A")
    T = tc.compute((M, 8), lambda i, j: tc.where(i >= 1, A[i - 1, j], 0.0), name="shift")
    assert "where(i >= 1, A[i - 1, j], 0.0)" in str(T)


def test_operator_not_supported_by_dtype():
    n = tc.placeholder((4,), "int32", name="n")
    x = tc.placeholder((4,), "float32", name="x")
    with pytest.raises(tc.DTypeError, match="'/' needs floating operands"):
        tc.compute((4,), lambda i: n[i] / n[i])
    with pytest.raises(tc.DTypeError, match="exp needs a floating argument"):
        tc.compute((4,), lambda i: tc.exp(n[i]))
    with pytest.raises(tc.DTypeError, match="operator & needs bool or integer"):
        tc.compute((4,), lambda i: x[i] & x[i])


def test_compute_function_arity_must_match_shape():
    with pytest.raises(tc.ShapeError, match="compute f has 2 dimensions but its function takes 1 argument"):
        tc.compute((2, 3), lambda i: i, name="f")


def test_reduction_identities():
    from tecc.ir.expr import reduce_identity

    assert reduce_identity("sum", tc.float32).value == 0.0
    assert reduce_identity("prod", tc.int32).value == 1
    assert reduce_identity("max", tc.float32).value == -np.inf
    assert reduce_identity("min", tc.int32).value == 2**31 - 1
    assert reduce_identity("max", tc.int64).value == -(2**63)


def test_symbolic_expression_refuses_python_truth():
    i = tc.var("i")
    with pytest.raises(tc.TeccError, match="no Python truth value"):
        if i < 3:
            pass


def test_reduce_axis_with_range():
    k = tc.reduce_axis((2, 10), name="k")
    assert isinstance(k.lo, Const) and k.lo.value == 2
    assert str(k.extent) == "8"
