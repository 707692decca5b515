"""tc.rand in CUDA: the generated code compiles with NVRTC (here, no GPU needed) and shares one
Philox call among four elements where the schedule allows; on a GPU (@pytest.mark.gpu) the device
Philox reproduces Random123's known answers and every kernel is bit for bit the emulator's.
The specification and the emulator's tests are in tests/test_random.py."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import tecc as tc
from tecc.codegen import compile_cuda
from tecc.codegen.philox import DEVICE_HELPERS

from nvrtc_checks import skip_without_nvrtc
from test_random import KAT, numpy_dropout, reference_rand


def dropout_args(shape, p, dtype="float32", *, seed_tensor=True, offset=7):
    """[x, seed, y] (or [x, y] with a constant seed): y = where(rand < p, 0, x / (1 - p))."""
    x = tc.placeholder(shape, dtype, name="x")
    S = tc.placeholder((), "int64", name="seed") if seed_tensor else 2**40 + 3
    R = tc.rand(shape, S, offset, name="R")
    y = tc.compute(shape, lambda *ax: tc.where(R[ax] < p, 0, x[ax] / (1 - p)), name="y")
    return [x, S, y] if seed_tensor else [x, y]


def elementwise_schedule(args: list[Any], vector: int, threads: int = 128) -> Any:
    """The elementwise strategy's blocked schedule with a chosen vector width (1: none)."""
    sch = tc.Schedule(args)
    loops = sch.get_loops(args[-1].name)
    inner = None
    if vector > 1:
        outer, inner = sch.split(loops[-1], vector)
        loops = loops[:-1] + [outer]
    fused = loops[0]
    for lp in loops[1:]:
        fused = sch.fuse(fused, lp)
    block, thread = sch.split(fused, threads)
    sch.bind(block, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    if inner is not None:
        sch.vectorize(inner)
    return sch


def kernel_body(source: str) -> str:
    """The kernels of a translation unit without the device helpers."""
    return source[source.index('extern "C" __global__'):]


# ---- NVRTC, no GPU -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, vector, calls", [("float32", 4, 1), ("bfloat16", 8, 2), ("float16", 4, 1)])
def test_vector_loop_shares_one_philox_call_per_four_elements(dtype, vector, calls):
    skip_without_nvrtc()
    args = dropout_args((64, 256), 0.1, dtype)
    f = tc.build(elementwise_schedule(args, vector), target="cuda", arch="sm_90")
    body = kernel_body(f.source)
    assert body.count("tecc_rand_group(") == calls, body
    assert "tecc_rand_uniform(" not in body, body
    lanes = re.findall(r"tecc_uniform\(rand(?:_\d+)?\.([xyzw])\)", body)
    assert lanes == list("xyzw" * calls), lanes
    res = f.resources[f.module.kernels[0].name]
    assert (res.spill_stores, res.spill_loads) == (0, 0), res


@pytest.mark.parametrize("shape, vector", [((64, 256), 1), ((30, 333), 4), ((1, 6), 2)], ids=str)
def test_other_schedules_call_philox_per_element(shape, vector):
    # no vector loop, an innermost extent that is no multiple of 4 (no proven group), or width 2
    skip_without_nvrtc()
    args = dropout_args(shape, 0.5)
    f = tc.build(elementwise_schedule(args, vector), target="cuda", arch="sm_90")
    body = kernel_body(f.source)
    assert "tecc_rand_group(" not in body and "tecc_rand_uniform(" in body, body


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_generated_rand_compiles_with_nvrtc(arch):
    skip_without_nvrtc(arch)
    for args in (dropout_args((1000, 333), 0.2), dropout_args((4096, 4096), 0.1, "bfloat16", seed_tensor=False)):
        f = tc.build(args, target="cuda", arch=arch)
        assert "__device__ __forceinline__ uint4 tecc_philox4x32_10" in f.source
        ptx = f.ptx if isinstance(f.ptx, str) else "".join(f.ptx.values())
        assert "mul.hi.u32" in ptx, "the Philox rounds use the 32-bit high multiply (__umulhi)"
        for res in f.resources.values():
            assert (res.spill_stores, res.spill_loads) == (0, 0), res


KAT_KERNEL = DEVICE_HELPERS + """
extern "C" __global__ void philox_kat(const unsigned int* __restrict__ in, unsigned int* __restrict__ out, int n) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < n) {
    const uint4 r = tecc_philox4x32_10(make_uint4(in[6 * t], in[6 * t + 1], in[6 * t + 2], in[6 * t + 3]),
                                       make_uint2(in[6 * t + 4], in[6 * t + 5]));
    out[4 * t] = r.x;
    out[4 * t + 1] = r.y;
    out[4 * t + 2] = r.z;
    out[4 * t + 3] = r.w;
  }
}
"""


def test_device_philox_compiles_with_nvrtc():
    skip_without_nvrtc()
    compiled = compile_cuda(KAT_KERNEL, arch="sm_90", name="philox_kat")
    assert compiled.resources["philox_kat"].registers > 0


# ---- on the GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_philox_matches_random123_known_answers():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cuda.core import Device, LaunchConfig, ObjectCode, launch

    from tecc.codegen import default_arch

    vectors = [(c, k, w) for r, c, k, w in KAT if r == 10]
    words = np.array([list(c) + list(k) for c, k, _w in vectors], np.uint32).view(np.int32)
    inp = torch.from_numpy(words.ravel().copy()).cuda()
    out = torch.full((4 * len(vectors),), -1, dtype=torch.int32, device="cuda")
    compiled = compile_cuda(KAT_KERNEL, arch=default_arch(), name="philox_kat")
    device = Device()
    device.set_current()
    kernel = ObjectCode.from_cubin(compiled.cubin).get_kernel("philox_kat")
    torch.cuda.synchronize()
    stream = device.create_stream()
    launch(stream, LaunchConfig(grid=(1,), block=(32,)), kernel, inp.data_ptr(), out.data_ptr(), np.int32(len(vectors)))
    stream.sync()
    got = out.cpu().numpy().view(np.uint32).reshape(-1, 4)
    for (c, k, want), row in zip(vectors, got):
        assert tuple(int(w) for w in row) == want, (c, k, [hex(int(w)) for w in row])


GPU_CASES = [  # (shape, dtype, vector or None for the planner's choice)
    ((1, 1), "float32", None), ((3, 5), "float32", None), ((37, 129), "float32", None),
    ((1000, 333), "float32", None), ((512, 1024), "float32", None), ((4096, 4096), "float32", None),
    ((512, 1024), "float32", 4), ((512, 1024), "float32", 1), ((30, 333), "float32", 4),
    ((512, 1024), "bfloat16", 8), ((512, 1024), "bfloat16", None), ((77, 250), "float16", 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, dtype, vector", GPU_CASES, ids=[f"{s}-{d}-v{v}" for s, d, v in GPU_CASES])
def test_cuda_dropout_is_bit_exact_with_the_emulator(shape, dtype, vector):
    p = 0.3
    args = dropout_args(shape, p, dtype)
    program = elementwise_schedule(args, vector) if vector is not None else args
    gpu = tc.build(program, target="cuda")
    sim = tc.build(elementwise_schedule(dropout_args(shape, p, dtype), vector) if vector is not None
                   else dropout_args(shape, p, dtype), target="sim")
    npd = tc.ir.as_dtype(dtype).numpy
    x = (np.random.default_rng(11).standard_normal(shape) + 0.05).astype(npd)
    seeds = (0, -3, 2**62 + 5) if x.size <= 10**6 else (2**62 + 5,)  # the emulator takes ~30 s per 16M
    for seed in seeds:
        s = np.array(seed, np.int64)
        on_gpu, on_sim = np.full(shape, np.nan, npd), np.full(shape, np.nan, npd)
        gpu(x, s, on_gpu)
        sim(x, s, on_sim)
        differ = np.count_nonzero(on_gpu.view(np.uint8) != on_sim.view(np.uint8))
        assert differ == 0, f"dropout {dtype}{shape} vector={vector} seed={seed}: {differ} bytes differ\n{gpu.plan}"
        if x.size <= 50_000:
            want = numpy_dropout(x, reference_rand(shape, seed, 7), p, dtype)
            assert np.array_equal(on_gpu.view(np.uint8), want.view(np.uint8)), f"{dtype}{shape} vs NumPy"


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 2**32 - 5, 2**64 - 3, -(2**40)], ids=str)
def test_cuda_rand_matches_the_emulator_across_counter_carries(offset):
    shape = (33, 64)
    S = tc.placeholder((1,), "int64", name="seed")
    O = tc.placeholder((1,), "int64", name="offset")
    R = tc.rand(shape, S, O, name="R")
    gpu, sim = tc.build([S, O, R], target="cuda"), tc.build([S, O, R], target="sim")
    s = np.array([0x0123_4567_89AB_CDEF], np.int64)
    o = np.array([offset], np.uint64).astype(np.int64) if offset >= 0 else np.array([offset], np.int64)
    on_gpu, on_sim = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    gpu(s, o, on_gpu)
    sim(s, o, on_sim)
    assert np.array_equal(on_gpu, on_sim), np.count_nonzero(on_gpu != on_sim)
    assert np.array_equal(on_gpu, reference_rand(shape, int(s[0]), offset).astype(np.float32))
