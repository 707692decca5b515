"""The CUDA runtime on a GPU: marshaling, launch, NumPy copy-in/copy-out, device arrays in
place, strides, bfloat16, zero-size arrays, launch errors, large dynamic shared memory,
temporaries and saved artifacts.

The kernels are small hand-written CUDA C compiled here with cuda.core's NVRTC `Program`, and
the host programs are built by hand, so these tests exercise the runtime alone (not lowering or
codegen). Every result is compared with a NumPy float64 reference on fresh random inputs, and
outputs are poisoned (NaN) before the call so an unwritten element shows.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tecc.ir import dtype as dt
from tecc.ir.errors import DeviceError, LaunchError, ShapeError
from tecc.ir.expr import Const, Var
from tecc.ir.stmt import Buffer
from tecc.runtime import arrays
from tecc.runtime.artifact import MANIFEST_FORMAT, MANIFEST_VERSION, load, source_sha256, write_artifact
from tecc.runtime.cuda import CudaExecutor, current_device, device_arch
from tecc.runtime.host import Call, HostProgram, KernelInfo

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]
ONE = Const(1, dt.int32)
THREADS = 256

# bfloat16 is handled as its bits (unsigned short) so the test needs no CUDA headers.
CUDA_SOURCE = r"""
__device__ float bf16_to_float(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ unsigned short float_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
    return (unsigned short)(u >> 16);
}

extern "C" __global__ void axpy(const float* x, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 2.5f * x[i] + y[i];
}

extern "C" __global__ void axpy_bf16(const unsigned short* x, const unsigned short* y, unsigned short* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = float_to_bf16(2.5f * bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

extern "C" __global__ void copy2d(const float* a, float* out, int m, int n, int s0, int s1) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < m * n) out[i] = 3.0f * a[(i / n) * s0 + (i % n) * s1];
}

extern "C" __global__ void scale_long(const double* x, double* out, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = -x[i];
}

extern "C" __global__ void twice(const float* x, float* tmp, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tmp[i] = 2.0f * x[i];
}

extern "C" __global__ void add(const float* tmp, const float* y, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = tmp[i] + y[i];
}

// Reverses each chunk of CHUNK elements through dynamic shared memory (64 KiB > 48 KiB).
#define CHUNK 16384
extern "C" __global__ void reverse_chunks(const float* x, float* out, int n) {
    extern __shared__ float chunk[];
    int base = blockIdx.x * CHUNK;
    for (int k = threadIdx.x; k < CHUNK; k += blockDim.x) chunk[k] = x[base + k];
    __syncthreads();
    for (int k = threadIdx.x; k < CHUNK; k += blockDim.x) out[base + k] = chunk[CHUNK - 1 - k];
}

extern "C" __global__ void write_null(float* out, int n) {
    volatile float* p = (volatile float*)0;  // volatile: the faulting store must stay
    p[threadIdx.x] = out[0] + n;
}
"""
CHUNK = 16384


@pytest.fixture(scope="module")
def cubin() -> bytes:
    from cuda.core import Program, ProgramOptions

    device = current_device()
    program = Program(CUDA_SOURCE, "c++", ProgramOptions(arch=device_arch(device), std="c++17"))
    return bytes(program.compile("cubin").code)


# ---- hand-made host programs ---------------------------------------------------------------------

def blocks_for(count) -> tuple:
    return ((count + THREADS - 1) // THREADS, ONE, ONE)


def elementwise_program(kernel: str, dtype: dt.DType, *, block=(THREADS, 1, 1), index=dt.int32,
                        dynamic_smem: int = 0, grid=None) -> HostProgram:
    """`kernel(x, y, out, n)` over 1-D arrays of a symbolic size n; `grid(n)` gives the grid."""
    n = Var("n", index, "size")
    x, y, out = (Buffer(b, dtype, (n,)) for b in ("x", "y", "out"))
    info = KernelInfo(kernel, (x, y, out, n), (grid or blocks_for)(n), block, dynamic_smem)
    return HostProgram(kernel, (x, y, out, n), (), (info,), (Call(kernel, ("x", "y", "out", "n")),), ("out",))


def unary_program(kernel: str, dtype: dt.DType, *, index=dt.int32, grid=None, dynamic_smem: int = 0,
                  block=(THREADS, 1, 1)) -> HostProgram:
    """`kernel(x, out, n)` over 1-D arrays of a symbolic size n; `grid(n)` gives the grid."""
    n = Var("n", index, "size")
    x, out = Buffer("x", dtype, (n,)), Buffer("out", dtype, (n,))
    info = KernelInfo(kernel, (x, out, n), (grid or blocks_for)(n), block, dynamic_smem)
    return HostProgram(kernel, (x, out, n), (), (info,), (Call(kernel, ("x", "out", "n")),), ("out",))


def strided_copy_program() -> HostProgram:
    m, n = Var("m", dt.int32, "size"), Var("n", dt.int32, "size")
    s0, s1 = Var("a_stride0", dt.int32, "stride"), Var("a_stride1", dt.int32, "stride")
    a = Buffer("a", dt.float32, (m, n), strides=(s0, s1))
    out = Buffer("out", dt.float32, (m, n))
    info = KernelInfo("copy2d", (a, out, m, n, s0, s1), blocks_for(m * n), (THREADS, 1, 1))
    return HostProgram("copy2d", (a, out, m, n), (), (info,),
                       (Call("copy2d", ("a", "out", "m", "n", "a_stride0", "a_stride1")),), ("out",))


def two_kernel_program() -> HostProgram:
    """out = 2x + y through a temporary, in two launches."""
    n = Var("n", dt.int32, "size")
    x, y, out = (Buffer(b, dt.float32, (n,)) for b in ("x", "y", "out"))
    tmp = Buffer("tmp", dt.float32, (n,))
    kx, ktmp = Buffer("x", dt.float32, (n,)), Buffer("tmp", dt.float32, (n,))
    twice = KernelInfo("twice", (kx, ktmp, n), blocks_for(n), (THREADS, 1, 1))
    add = KernelInfo("add", (Buffer("tmp", dt.float32, (n,)), Buffer("y", dt.float32, (n,)),
                             Buffer("out", dt.float32, (n,)), n), blocks_for(n), (THREADS, 1, 1))
    calls = (Call("twice", ("x", "tmp", "n")), Call("add", ("tmp", "y", "out", "n")))
    return HostProgram("twice_add", (x, y, out, n), (tmp,), (twice, add), calls, ("out",))


# ---- helpers ---------------------------------------------------------------------------------------

def assert_close(got, want, op: str, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    got64 = np.asarray(got, dtype=np.float64)
    want64 = np.asarray(want, dtype=np.float64)
    assert got64.shape == want64.shape, f"{op}: shape {got64.shape} != {want64.shape}"
    if got64.size == 0:
        return
    err = np.abs(got64 - want64) - rtol * np.abs(want64)
    err = np.where(np.isnan(got64), np.inf, err)
    worst = np.unravel_index(int(np.argmax(err)), err.shape)
    assert err[worst] <= atol, (
        f"{op}: worst element {worst}: got {got64[worst]!r}, want {want64[worst]!r} "
        f"(rtol={rtol}, atol={atol})"
    )


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


# ---- NumPy in/out --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 255, 256, 1000, 100_003])
def test_numpy_arguments_are_copied_in_and_outputs_copied_back(cubin, n):
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    x = rng(n).standard_normal(n).astype(np.float32)
    y = rng(n + 1).standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    f(x, y, out)
    assert_close(out, 2.5 * x.astype(np.float64) + y, f"axpy n={n}")
    assert f.last_launches[0].kernel == "axpy"
    assert f.last_launches[0].grid == ((n + THREADS - 1) // THREADS, 1, 1)
    assert f.last_launches[0].block == (THREADS, 1, 1)


def test_non_contiguous_numpy_output_is_written_back_into_the_callers_view(cubin):
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    n = 777
    x = rng(1).standard_normal(2 * n).astype(np.float32)[::2]
    y = rng(2).standard_normal(n).astype(np.float32)
    backing = np.full(3 * n, np.nan, np.float32)
    out = backing[::3]
    f(x, y, out)
    assert_close(out, 2.5 * x.astype(np.float64) + y, "axpy into a strided view")
    assert np.isnan(backing[1::3]).all(), "elements outside the view were written"


def test_int64_sizes_are_passed_as_long_long(cubin):
    f = CudaExecutor(unary_program("scale_long", dt.float64, index=dt.int64), cubin)
    x = rng(3).standard_normal(4099)
    out = np.full_like(x, np.nan)
    f(x, out)
    assert_close(out, -x, "scale_long")


def test_temporaries_and_several_launches(cubin):
    f = CudaExecutor(two_kernel_program(), cubin)
    for n in (1000, 300, 5000):  # the temporary is reused when big enough, regrown otherwise
        x = rng(n).standard_normal(n).astype(np.float32)
        y = rng(n + 7).standard_normal(n).astype(np.float32)
        out = np.full(n, np.nan, np.float32)
        f(x, y, out)
        assert_close(out, 2.0 * x.astype(np.float64) + y, f"twice_add n={n}")
        assert [r.kernel for r in f.last_launches] == ["twice", "add"]


def test_numpy_strided_buffer_gets_the_staged_copys_strides(cubin):
    f = CudaExecutor(strided_copy_program(), cubin)
    a = rng(4).standard_normal((40, 30)).astype(np.float32).T  # (30, 40), non-contiguous
    out = np.full((30, 40), np.nan, np.float32)
    f(a, out)
    assert_close(out, 3.0 * a.astype(np.float64), "copy2d from NumPy")


# ---- bfloat16 ------------------------------------------------------------------------------------

def test_bfloat16_numpy_arrays(cubin):
    f = CudaExecutor(elementwise_program("axpy_bf16", dt.bfloat16), cubin)
    n = 1025
    x = rng(5).standard_normal(n).astype(ml_dtypes.bfloat16)
    y = rng(6).standard_normal(n).astype(ml_dtypes.bfloat16)
    out = np.full(n, np.nan, ml_dtypes.bfloat16)
    f(x, y, out)
    want = (2.5 * x.astype(np.float64) + y.astype(np.float64)).astype(np.float32).astype(ml_dtypes.bfloat16)
    assert_close(out.astype(np.float64), want.astype(np.float64), "axpy_bf16", rtol=2**-7, atol=1e-2)


# ---- zero-size -------------------------------------------------------------------------------------

def test_zero_size_arrays_skip_the_launch(cubin):
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    empty = np.zeros(0, np.float32)
    f(empty, empty.copy(), empty.copy())
    assert f.last_launches == []


# ---- launch errors -----------------------------------------------------------------------------------

def test_block_larger_than_the_kernel_allows_is_a_launch_error(cubin):
    f = CudaExecutor(elementwise_program("axpy", dt.float32, block=(2048, 1, 1)), cubin)
    x = np.ones(10, np.float32)
    with pytest.raises(LaunchError, match=r"kernel axpy \(grid \(1, 1, 1\), block \(2048, 1, 1\).*2048 threads"):
        f(x, x.copy(), np.zeros(10, np.float32))


def test_driver_launch_failure_is_a_launch_error_with_the_cuda_error(cubin):
    # blockDim.z is limited to 64: the driver refuses the launch.
    f = CudaExecutor(elementwise_program("axpy", dt.float32, block=(1, 1, 128)), cubin)
    x = np.ones(10, np.float32)
    with pytest.raises(LaunchError, match=r"kernel axpy \(grid .*block \(1, 1, 128\).*failed to launch: .*CUDA_ERROR"):
        f(x, x.copy(), np.zeros(10, np.float32))


def test_faulting_kernel_is_reported_with_its_name_under_debug_sync():
    # A device fault poisons the CUDA context, so it runs in a process of its own.
    script = textwrap.dedent(f"""
        import numpy as np
        from cuda.core import Program, ProgramOptions
        from tecc.ir import dtype as dt
        from tecc.ir.errors import LaunchError
        from tecc.ir.expr import Const, Var
        from tecc.ir.stmt import Buffer
        from tecc.runtime.cuda import CudaExecutor, current_device, device_arch
        from tecc.runtime.host import Call, HostProgram, KernelInfo
        src = {CUDA_SOURCE!r}
        cubin = Program(src, "c++", ProgramOptions(arch=device_arch(current_device()))).compile("cubin").code
        n = Var("n", dt.int32, "size")
        out = Buffer("out", dt.float32, (n,))
        one = Const(1, dt.int32)
        info = KernelInfo("write_null", (out, n), (one, one, one), (32, 1, 1))
        host = HostProgram("fault", (out, n), (), (info,), (Call("write_null", ("out", "n")),), ("out",))
        f = CudaExecutor(host, cubin, debug_sync=True)
        try:
            f(np.zeros(4, np.float32))
        except LaunchError as exc:
            print("LAUNCH ERROR:", exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert "LAUNCH ERROR: fault: kernel write_null (grid (1, 1, 1), block (32, 1, 1)" in result.stdout, (
        result.stdout + result.stderr)
    assert "CUDA_ERROR" in result.stdout


# ---- dynamic shared memory above 48 KiB ------------------------------------------------------------

def test_dynamic_shared_memory_over_48_kib_is_opted_in(cubin):
    n = 3 * CHUNK
    host = unary_program("reverse_chunks", dt.float32, grid=lambda size: (size // CHUNK, ONE, ONE),
                         dynamic_smem=CHUNK * 4)
    f = CudaExecutor(host, cubin)
    x = rng(7).standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    f(x, out)
    want = x.reshape(3, CHUNK)[:, ::-1].reshape(-1)
    assert_close(out, want.astype(np.float64), "reverse_chunks with 64 KiB of dynamic shared memory")
    assert f.last_launches[0].dynamic_smem == 65536


# ---- device arrays in place (torch) ----------------------------------------------------------------

def test_torch_tensors_are_used_in_place(cubin):
    torch = torch_cuda()
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    n = 10_001
    x = torch.from_numpy(rng(8).standard_normal(n).astype(np.float32)).cuda()
    y = torch.from_numpy(rng(9).standard_normal(n).astype(np.float32)).cuda()
    out = torch.full((n,), float("nan"), device="cuda")
    ptr = out.data_ptr()
    f(x, y, out)
    f.synchronize()
    assert out.data_ptr() == ptr
    assert_close(out.cpu().numpy(), 2.5 * x.cpu().numpy().astype(np.float64) + y.cpu().numpy(), "axpy on torch")


def test_describe_torch_tensor_reports_element_strides_and_bfloat16():
    torch = torch_cuda()
    t = torch.zeros((6, 8), device="cuda").t()
    info = arrays.describe(t)
    assert info.shape == (8, 6) and info.strides == (1, 8) and info.dtype == dt.float32
    assert arrays.describe(torch.zeros(3, dtype=torch.bfloat16, device="cuda")).dtype == dt.bfloat16


def test_non_contiguous_torch_view_with_a_strided_buffer(cubin):
    torch = torch_cuda()
    f = CudaExecutor(strided_copy_program(), cubin)
    base = torch.from_numpy(rng(10).standard_normal((50, 64)).astype(np.float32)).cuda()
    a = base.t()[4:40:2]  # (18, 50), strides (2, 64), 16 bytes past the allocation's start
    out = torch.full((18, 50), float("nan"), device="cuda")
    f(a, out)
    f.synchronize()
    assert_close(out.cpu().numpy(), 3.0 * a.cpu().numpy().astype(np.float64), "copy2d on a torch view")


def test_non_contiguous_torch_view_for_a_contiguous_buffer_is_a_shape_error(cubin):
    torch = torch_cuda()
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    x = torch.zeros(20, device="cuda")[::2]
    y = torch.zeros(10, device="cuda")
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) of axpy: expected a contiguous"):
        f(x, y, torch.zeros(10, device="cuda"))


def test_device_view_off_the_16_byte_alignment_is_refused_before_launch(cubin):
    torch = torch_cuda()
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    x = torch.zeros(11, device="cuda")[1:]  # 4 bytes past an aligned allocation
    y = torch.zeros(10, device="cuda")
    with pytest.raises(ShapeError, match=r"argument 0 \(x\) of axpy: its data pointer .* not aligned to 16 bytes"):
        f(x, y, torch.zeros(10, device="cuda"))
    relaxed = CudaExecutor(elementwise_program("axpy", dt.float32), cubin, alignment=4)  # axpy has no vector access
    out = torch.full((10,), float("nan"), device="cuda")
    relaxed(x, y, out)
    relaxed.synchronize()
    assert torch.equal(out, torch.zeros(10, device="cuda"))


def test_bfloat16_torch_tensors(cubin):
    torch = torch_cuda()
    f = CudaExecutor(elementwise_program("axpy_bf16", dt.bfloat16), cubin)
    n = 4097
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    y = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
    f(x, y, out)
    f.synchronize()
    want = (2.5 * x.double() + y.double()).float().to(torch.bfloat16).double().cpu().numpy()
    assert_close(out.double().cpu().numpy(), want, "axpy_bf16 on torch", rtol=2**-7, atol=1e-2)


def test_zero_size_torch_tensors(cubin):
    torch = torch_cuda()
    f = CudaExecutor(elementwise_program("axpy", dt.float32), cubin)
    e = torch.empty(0, device="cuda")
    f(e, e, torch.empty(0, device="cuda"))
    f.synchronize()
    assert f.last_launches == []


# ---- artifacts -------------------------------------------------------------------------------------

def _manifest(host: HostProgram, arch: str) -> dict:
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "entry": host.name, "arch": arch,
        "host": host.to_json(),
        "kernels": [{"name": k.name, "registers": None, "shared_bytes": None, "spills": None} for k in host.kernels],
        "plan": None, "versions": {"tecc": "0.1.0", "nvrtc": "", "cuda_core": "1.2.2"}, "options": [],
        "source_sha256": source_sha256(CUDA_SOURCE),
    }


def test_saved_artifact_runs_with_the_runtime_alone(cubin, tmp_path):
    host = two_kernel_program()
    arch = device_arch(current_device())
    write_artifact(tmp_path / "twice_add", _manifest(host, arch), cubin, cuda_source=CUDA_SOURCE)
    f = load(tmp_path / "twice_add")
    n = 4321
    x = rng(11).standard_normal(n).astype(np.float32)
    y = rng(12).standard_normal(n).astype(np.float32)
    out = np.full(n, np.nan, np.float32)
    f(x, y, out)
    assert_close(out, 2.0 * x.astype(np.float64) + y, "loaded twice_add")


def test_loading_an_artifact_for_another_arch_says_to_rebuild(cubin, tmp_path):
    device = current_device()
    cc = device.compute_capability
    other = "sm_75" if int(cc[0]) != 7 else "sm_90"
    write_artifact(tmp_path / "axpy", _manifest(elementwise_program("axpy", dt.float32), other), cubin)
    with pytest.raises(DeviceError, match=rf"compiled for {other}.*rebuild it with arch='{device_arch(device)}'"):
        load(tmp_path / "axpy")
