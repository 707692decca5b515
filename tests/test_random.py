"""tc.rand: Philox4x32-10 counter-based uniforms (docs/training.md, "Random numbers").

What pins the specification:
- Random123's known-answer vectors (tests/kat_vectors of github.com/DEShawResearch/random123,
  the "philox4x32 7" and "philox4x32 10" lines) for an independent pure-Python Philox written
  here and for the NumPy Philox the emulator runs (tecc/ir/philox.py);
- the element mapping (word n mod 4, counter offset + floor(n/4) with its 64-bit carry, the seed's
  low and high words, (x >> 8)·2^-24) against that independent reference, through the emulator;
- statistics of 10^6 draws with a fixed seed (mean, variance, chi-square, Kolmogorov-Smirnov,
  lag-1 correlation);
- dropout `where(rand < p, 0, x / (1 - p))` fused into one kernel, equal to NumPy element for
  element, with seed and offset as ints and as int64 scalar tensors; its gradient regenerates
  the mask.
The CUDA side (NVRTC here, bit-exactness on a GPU) is in tests/test_random_cuda.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import tecc as tc
from tecc.ir import DTypeError, ShapeError
from tecc.ir.evaluate import evaluate
from tecc.ir.philox import RandomUniform, philox4x32, uniform_from_index
from tecc.ir.serialize import VarTable, expr_from_json, expr_to_json
from tecc.ir.visitor import VarSubstituter

from nvrtc_checks import skip_without_nvrtc

M32 = 0xFFFFFFFF

# (rounds, counter words c0..c3, key words k0 k1, expected output words): Random123 tests/kat_vectors.
KAT = [
    (7, (0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48)),
    (7, (0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662)),
    (7, (0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a)),
    (10, (0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    (10, (0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff),
     (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    (10, (0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


# ---- an independent reference: Python integers, written from Salmon et al. 2011 ---------------------

def reference_philox(counter: tuple[int, ...], key: tuple[int, ...], rounds: int = 10) -> tuple[int, ...]:
    """Philox4x32-R on Python ints: the round function S-box of the paper (two multiplies split
    into high and low words, a permutation, the key XORed in), the key bumped by the Weyl
    constants between rounds."""
    x = list(counter)
    k = list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * x[0], 0xCD9E8D57 * x[2]
        x = [(p1 >> 32) ^ x[1] ^ k[0], p1 & M32, (p0 >> 32) ^ x[3] ^ k[1], p0 & M32]
    return tuple(x)


def reference_uniform(seed: int, offset: int, n: int) -> float:
    """Element n of tc.rand(..., seed, offset), exactly as docs/training.md states it."""
    c = (offset + n // 4) % 2**64
    s = seed % 2**64
    word = reference_philox((c & M32, c >> 32, 0, 0), (s & M32, s >> 32))[n % 4]
    return (word >> 8) * 2.0**-24


def reference_rand(shape: tuple[int, ...], seed: int, offset: int = 0) -> np.ndarray:
    count = int(np.prod(shape))
    return np.array([reference_uniform(seed, offset, n) for n in range(count)], np.float64).reshape(shape)


@pytest.mark.parametrize("rounds, counter, key, want", KAT, ids=[f"R{r}-{i}" for i, (r, *_rest) in enumerate(KAT)])
def test_reference_philox_matches_random123_known_answers(rounds, counter, key, want):
    got = reference_philox(counter, key, rounds)
    assert got == want, f"philox4x32-{rounds}: got {[hex(w) for w in got]}, want {[hex(w) for w in want]}"


@pytest.mark.parametrize("rounds, counter, key, want", KAT, ids=[f"R{r}-{i}" for i, (r, *_rest) in enumerate(KAT)])
def test_emulator_philox_matches_random123_known_answers(rounds, counter, key, want):
    got = tuple(int(w) for w in philox4x32(counter, key, rounds))
    assert got == want, f"philox4x32-{rounds}: got {[hex(w) for w in got]}, want {[hex(w) for w in want]}"


def test_emulator_philox_is_vectorized_over_lanes():
    # the same answers when the KAT inputs travel as lanes of one array call
    counters = np.array([c for r, c, _k, _w in KAT if r == 10], np.uint32).T
    keys = np.array([k for r, _c, k, _w in KAT if r == 10], np.uint32).T
    got = np.stack(philox4x32(tuple(counters), tuple(keys)), axis=1)
    assert np.array_equal(got, np.array([w for r, _c, _k, w in KAT if r == 10], np.uint32))


# ---- rand through the emulator -----------------------------------------------------------------

def run_rand(shape, seed, offset=0, *, as_tensor=None):
    """tc.rand(shape, seed, offset) built for the emulator and run with a poisoned output;
    `as_tensor` = "()" / "(1,)" passes seed and offset as int64 scalar tensors of that shape."""
    if as_tensor is None:
        R = tc.rand(shape, seed, offset, name="R")
        f = tc.build([R], target="sim")
        out = np.full(shape, np.nan, np.float32)
        f(out)
        return out
    tshape = () if as_tensor == "()" else (1,)
    S = tc.placeholder(tshape, "int64", name="seed")
    O = tc.placeholder(tshape, "int64", name="offset")
    R = tc.rand(shape, S, O, name="R")
    f = tc.build([S, O, R], target="sim")
    out = np.full(shape, np.nan, np.float32)
    f(np.array(seed % 2**64, np.uint64).astype(np.int64).reshape(tshape),
      np.array(offset % 2**64, np.uint64).astype(np.int64).reshape(tshape), out)
    return out


def assert_same_draws(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.argwhere(got.astype(np.float64) != want)
    assert bad.size == 0, (f"{what}: {len(bad)} of {want.size} differ; first at {tuple(bad[0])}: "
                           f"got {got[tuple(bad[0])]!r}, want {want[tuple(bad[0])]!r}")


def test_rand_first_group_is_the_zero_known_answer():
    # seed 0, offset 0: elements 0..3 are the four words of Philox4x32-10(0, 0), top 24 bits
    got = run_rand((4,), 0)
    want = np.array([(w >> 8) * 2.0**-24 for w in (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)])
    assert_same_draws(got, want, "rand((4,), seed=0)")


SEEDS_OFFSETS = [
    (0, 0), (1, 0), (0x1234_5678_9ABC_DEF0, 5),
    (-1, 0),                      # the seed's two's complement: key (ffffffff, ffffffff)
    (2**64 - 2, 3),               # a seed given as an unsigned 64-bit int
    (7, 2**32 - 3),               # counters cross 2^32: the carry into the high word
    (7, 2**64 - 2),               # counters wrap modulo 2^64
    (2**32, 2**40 + 1),           # the seed's high word alone
]


@pytest.mark.parametrize("seed, offset", SEEDS_OFFSETS, ids=str)
@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 9)], ids=str)
def test_rand_element_mapping_matches_the_reference(shape, seed, offset):
    assert_same_draws(run_rand(shape, seed, offset), reference_rand(shape, seed, offset),
                      f"rand({shape}, seed={seed}, offset={offset})")


@pytest.mark.parametrize("as_tensor", ["()", "(1,)"])
@pytest.mark.parametrize("seed, offset", [(99, 0), (-5, 2**32 - 1), (2**63 + 11, 2**64 - 1)], ids=str)
def test_rand_reads_seed_and_offset_from_int64_tensors(as_tensor, seed, offset):
    shape = (6, 11)
    got = run_rand(shape, seed, offset, as_tensor=as_tensor)
    assert_same_draws(got, reference_rand(shape, seed, offset), f"rand with tensor seed/offset {as_tensor}")
    # and the same numbers as the constant form
    assert_same_draws(got, run_rand(shape, seed, offset).astype(np.float64), "tensor vs constant seed")


def test_offset_moves_the_stream_by_groups_of_four():
    # element n at offset o is element n + 4 at offset o - 1: the offset counts Philox calls
    base = run_rand((40,), 123, 10)
    shifted = run_rand((36,), 123, 11)
    assert_same_draws(shifted, base[4:].astype(np.float64), "offset + 1 == four elements on")


def test_rand_is_a_pure_function_of_the_linear_index():
    # a 2-D tensor is the 1-D stream reshaped (row-major), whatever the shape
    flat = run_rand((60,), 42, 3)
    assert_same_draws(run_rand((4, 15), 42, 3), flat.reshape(4, 15).astype(np.float64), "(4, 15) vs (60,)")
    assert_same_draws(run_rand((2, 5, 6), 42, 3), flat.reshape(2, 5, 6).astype(np.float64), "(2, 5, 6) vs (60,)")


def test_zero_dimensional_rand_is_element_zero():
    assert_same_draws(run_rand((), 31, 9), np.array(reference_uniform(31, 9, 0)), "rand(())")


def test_uniforms_of_the_numpy_module_match_the_reference():
    rng = np.random.default_rng(7)
    seeds = rng.integers(-2**63, 2**63, size=50, dtype=np.int64)
    offsets = rng.integers(-2**63, 2**63, size=50, dtype=np.int64)
    index = rng.integers(0, 2**40, size=50, dtype=np.int64)
    got = uniform_from_index(seeds, offsets, index)
    want = np.array([reference_uniform(int(s), int(o), int(n)) for s, o, n in zip(seeds, offsets, index)])
    assert_same_draws(got, want, "uniform_from_index on random 64-bit operands")


def test_linear_index_is_int64_for_huge_shapes():
    # 3 * 2^40 elements: the linear index leaves int32, so it is computed in int64 (host evaluator)
    shape = (3, 2**40)
    R = tc.rand(shape, 5, 1)
    i, j = R.op.axes
    node = R.op.body
    assert isinstance(node, RandomUniform) and node.index.dtype == tc.int64
    for point in [(0, 0), (2, 2**40 - 1), (1, 12345)]:
        n = point[0] * 2**40 + point[1]
        got = evaluate(node, {i: point[0], j: point[1]})
        assert got == reference_uniform(5, 1, n), (point, got)


# ---- statistics --------------------------------------------------------------------------------

def chi2_quantile(df: int, z: float) -> float:
    """The chi-square quantile at the standard normal quantile z (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def test_one_million_draws_look_uniform():
    n = 10**6
    u = run_rand((1000, 1000), seed=20240601, offset=0).ravel().astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2**24 == np.floor(u * 2**24)), "every value is a multiple of 2^-24"
    # mean 1/2 and variance 1/12, each within 5 standard errors
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n), u.mean()
    var_se = math.sqrt((1 / 80 - 1 / 144) / n)  # Var of (u - 1/2)^2 is 1/80 - 1/144
    assert abs(u.var() - 1 / 12) < 5 * var_se, u.var()
    # chi-square over 100 equal bins: inside the two-sided 1e-6 band of chi2(99)
    counts = np.bincount((u * 100).astype(int), minlength=100)
    chi2 = float(((counts - n / 100) ** 2 / (n / 100)).sum())
    assert chi2_quantile(99, -4.75) < chi2 < chi2_quantile(99, 4.75), chi2
    # Kolmogorov-Smirnov: sqrt(n)·D below 1.95 (p ~ 0.001 under uniformity)
    s = np.sort(u)
    d = max(float(np.max(np.arange(1, n + 1) / n - s)), float(np.max(s - np.arange(n) / n)))
    assert math.sqrt(n) * d < 1.95, d
    # neighbours (words of one Philox call, and across calls) are uncorrelated
    for lag in (1, 2, 3, 4):
        r = float(np.corrcoef(u[:-lag], u[lag:])[0, 1])
        assert abs(r) < 5 / math.sqrt(n), (lag, r)


def test_different_seeds_and_offsets_give_unrelated_streams():
    a = run_rand((250, 400), seed=1).ravel().astype(np.float64)
    b = run_rand((250, 400), seed=2).ravel().astype(np.float64)
    c = run_rand((250, 400), seed=1, offset=25_000).ravel().astype(np.float64)  # just past a's counters
    n = a.size
    for other in (b, c):
        assert abs(float(np.corrcoef(a, other)[0, 1])) < 5 / math.sqrt(n)
        assert np.count_nonzero(a == other) < 10


# ---- dropout -----------------------------------------------------------------------------------

def dropout_program(shape, p, seed, offset, dtype="float32"):
    x = tc.placeholder(shape, dtype, name="x")
    R = tc.rand(shape, seed, offset, name="R")
    y = tc.compute(shape, lambda i, j: tc.where(R[i, j] < p, 0, x[i, j] / (1 - p)), name="y")
    return x, y


def numpy_dropout(x: np.ndarray, u: np.ndarray, p: float, dtype: str) -> np.ndarray:
    """What the kernel computes: the comparison in float32, x / (1 - p) in x's dtype (the
    constant 1 - p rounded to it; 16-bit floats computed in float32 and rounded back)."""
    npd = tc.ir.as_dtype(dtype).numpy
    keep = ~(u.astype(np.float32) < np.float32(p))
    scale = np.float32(npd.type(1 - p))
    kept = (x.astype(np.float32) / scale).astype(npd)
    return np.where(keep, kept, npd.type(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(37, 129), (16, 64)], ids=str)
def test_fused_dropout_matches_numpy_exactly(shape, dtype):
    p, seed, offset = 0.3, 2**40 + 17, 123
    x, y = dropout_program(shape, p, seed, offset, dtype)
    f = tc.build([x, y], target="sim")
    assert len(f.module.kernels) == 1 and not f.module.temps, "rand must fuse into the dropout kernel"
    xv = (np.random.default_rng(3).standard_normal(shape) + 0.1).astype(tc.ir.as_dtype(dtype).numpy)
    out = np.full(shape, np.nan, xv.dtype)
    f(xv, out)
    want = numpy_dropout(xv, reference_rand(shape, seed, offset), p, dtype)
    assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (
        f"dropout {dtype}{shape}: {np.count_nonzero(out != want)} elements differ")
    kept = np.count_nonzero(out != 0) / out.size
    assert abs(kept - (1 - p)) < 0.05, kept


@pytest.mark.parametrize("as_tensor", ["()", "(1,)"])
def test_fused_dropout_with_seed_and_offset_tensors(as_tensor):
    shape, p = (24, 40), 0.5
    tshape = () if as_tensor == "()" else (1,)
    S = tc.placeholder(tshape, "int64", name="seed")
    O = tc.placeholder(tshape, "int64", name="offset")
    x, y = dropout_program(shape, p, S, O)
    f = tc.build([x, S, O, y], target="sim")
    assert len(f.module.kernels) == 1 and not f.module.temps
    xv = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    for seed, offset in [(1, 0), (1, 240), (-77, 2**33)]:  # a replay with new numbers: same kernel
        out = np.full(shape, np.nan, np.float32)
        f(xv, np.array(seed, np.int64).reshape(tshape), np.array(offset, np.int64).reshape(tshape), out)
        want = numpy_dropout(xv, reference_rand(shape, seed, offset), p, "float32")
        assert np.array_equal(out, want), (seed, offset, np.count_nonzero(out != want))


def test_dropout_gradient_regenerates_the_mask():
    shape, p, seed = (20, 33), 0.2, 5
    x, y = dropout_program(shape, p, seed, 0)
    g = tc.grad(y, [x])
    f = tc.build(g.args, target="sim")
    assert [t.name for t in g.inputs] == ["x"], "the mask is regenerated, not an input of the backward"
    assert not f.module.temps
    rng = np.random.default_rng(5)
    xv, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    dx = np.full(shape, np.nan, np.float32)
    f(xv, dy, dx)
    u = reference_rand(shape, seed, 0)
    want = np.where(u.astype(np.float32) < np.float32(p), np.float32(0), dy / np.float32(1 - p))
    assert np.array_equal(dx, want), np.count_nonzero(dx != want)


# ---- the node: printing, serialization, rebuilding, errors ---------------------------------------

def test_rand_prints_and_round_trips_through_json():
    R = tc.rand((4, 6), 9, 2, name="R")
    assert str(R) == "R[i0, i1] = rand(seed=int64(9), offset=int64(2), n=int64(i0 * 6 + i1))"
    node = R.op.body
    back = expr_from_json(expr_to_json(node), VarTable())
    assert isinstance(back, RandomUniform) and str(back) == str(node)


def test_rand_nodes_are_hash_consed_and_rebuilt_by_mutators():
    R1, R2 = tc.rand((8,), 3, name="R1"), tc.rand((8,), 3, name="R2")
    (i1,), (i2,) = R1.op.axes, R2.op.axes
    assert VarSubstituter({i1: i2}).visit(R1.op.body) is R2.op.body
    same = VarSubstituter({}).visit(R1.op.body)
    assert same is R1.op.body


def test_rand_errors_name_the_op():
    with pytest.raises(DTypeError, match="rand: the seed must be an integer"):
        tc.rand((4,), 1.5)
    with pytest.raises(DTypeError, match="rand: the offset must be an integer"):
        tc.rand((4,), 1, offset=True)
    with pytest.raises(ShapeError, match="rand: the seed tensor s has shape"):
        tc.rand((4,), tc.placeholder((2,), "int64", name="s"))
    with pytest.raises(DTypeError, match="rand: the offset tensor o is int32; declare it int64"):
        tc.rand((4,), 1, tc.placeholder((), "int32", name="o"))
    with pytest.raises(DTypeError, match="does not fit 64 bits"):
        tc.rand((4,), 2**64)
    with pytest.raises(ShapeError, match="cannot be negative"):
        tc.rand((-1, 3), 0)
    k = tc.reduce_axis(4, name="k")
    with pytest.raises(ShapeError, match="rand: the seed .* uses the axes k"):
        tc.rand((4,), k + 1)
    with pytest.raises(DTypeError, match="must be an int64 expression"):
        RandomUniform(tc.const(1, "int32"), tc.const(0, "int64"), tc.const(0, "int64"))


def test_rand_of_symbolic_shape_in_the_emulator():
    N = tc.var("N")
    R = tc.rand((N, 5), 77, 1, name="R")
    f = tc.build([R], target="sim")
    out = np.full((9, 5), np.nan, np.float32)
    f(out)
    assert_same_draws(out, reference_rand((9, 5), 77, 1), "rand((N, 5)) with N = 9")


def test_saved_artifact_runs_rand_in_the_emulator(tmp_path):
    # the loop IR travels in the artifact (path.ir) and the runtime alone rebuilds RandomUniform
    skip_without_nvrtc()
    shape, p = (5, 8), 0.25
    S = tc.placeholder((), "int64", name="seed")
    x, y = dropout_program(shape, p, S, 2**33)
    tc.build([x, S, y], target="cuda").save(tmp_path / "drop")  # NVRTC only: no GPU needed
    k = tc.load(tmp_path / "drop")
    xv = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    out = np.full(shape, np.nan, np.float32)
    k.sim(xv, np.array(3, np.int64), out)
    assert np.array_equal(out, numpy_dropout(xv, reference_rand(shape, 3, 2**33), p, "float32"))


def test_rand_read_inside_a_reduction_is_regenerated_per_term():
    # a random projection: y[i] = sum_k R[i, k] * x[i, k], R never stored
    shape = (13, 70)
    x = tc.placeholder(shape, "float32", name="x")
    R = tc.rand(shape, 11, 4, name="R")
    k = tc.reduce_axis(shape[1], name="k")
    y = tc.compute((shape[0],), lambda i: tc.sum(R[i, k] * x[i, k], axis=k), name="y")
    f = tc.build([x, y], target="sim")
    assert len(f.module.kernels) == 1 and not f.module.temps
    xv = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
    out = np.full(shape[0], np.nan, np.float32)
    f(xv, out)
    want = (reference_rand(shape, 11, 4) * xv.astype(np.float64)).sum(axis=1)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5), np.abs(out - want).max()
