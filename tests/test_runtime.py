"""The CUDA runtime's host side, without a GPU: describing arrays, argument marshaling and the
errors bad arguments get, the launch plan, and saved artifacts (manifest, validation, load)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tecc.ir import dtype as dt
from tecc.ir.errors import DeviceError, DTypeError, ShapeError, TeccError
from tecc.ir.expr import Const, Var
from tecc.ir.stmt import Buffer
from tecc.runtime import arrays
from tecc.runtime.artifact import (MANIFEST_FORMAT, MANIFEST_VERSION, ArtifactError, check_arch, cubin_runs_on,
                                   load, read_manifest, source_sha256, validate_manifest, write_artifact)
from tecc.runtime.cuda import (check_device_arrays, cuda_available, cuda_unavailable_reason, plan_launches,
                               prepare_arguments, scalar_argument)
from tecc.runtime.host import ArrayInfo, Call, HostProgram, KernelInfo, bind_arguments

REPO = Path(__file__).resolve().parents[1]
FAKE_CUBIN = b"\x7fELF" + bytes(60)
ONE = Const(1, dt.int32)
CUDA_SOURCE = 'extern "C" __global__ void axpy(const float* x, const float* y, float* out, int n) {}\n'


# ---- hand-made host programs -------------------------------------------------------------------

def axpy_program(dtype: dt.DType = dt.float32, name: str = "axpy") -> HostProgram:
    """out[i] = a * x[i] + y[i] over a symbolic n: one kernel, params (x, y, out, n)."""
    n = Var("n", dt.int32, "size")
    x, y, out = (Buffer(b, dtype, (n,)) for b in ("x", "y", "out"))
    kernel = KernelInfo("axpy", (x, y, out, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    return HostProgram(name, (x, y, out, n), (), (kernel,), (Call("axpy", ("x", "y", "out", "n")),), ("out",))


def strided_copy_program() -> HostProgram:
    """out[i, j] = a[i, j] for an `a` of any strides (stride variables s0, s1 are parameters)."""
    m, n = Var("m", dt.int32, "size"), Var("n", dt.int32, "size")
    s0, s1 = Var("a_stride0", dt.int32, "stride"), Var("a_stride1", dt.int32, "stride")
    a = Buffer("a", dt.float32, (m, n), strides=(s0, s1))
    out = Buffer("out", dt.float32, (m, n))
    kernel = KernelInfo("copy2d", (a, out, m, n, s0, s1), ((m * n + 255) // 256, ONE, ONE), (256, 1, 1))
    return HostProgram("copy2d", (a, out, m, n), (), (kernel,),
                       (Call("copy2d", ("a", "out", "m", "n", "a_stride0", "a_stride1")),), ("out",))


def manifest_for(program: HostProgram, arch: str = "sm_90", **overrides: object) -> dict:
    m = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "entry": program.name,
        "arch": arch,
        "host": program.to_json(),
        "kernels": [{"name": k.name, "registers": 16, "shared_bytes": 0, "spills": 0} for k in program.kernels],
        "plan": {"strategy": "naive", "steps": []},
        "versions": {"tecc": "0.1.0", "nvrtc": "13.0", "cuda_core": "1.2.2"},
        "options": ["-std=c++17"],
        "source_sha256": source_sha256(CUDA_SOURCE),
    }
    m.update(overrides)
    return m


# ---- describe ----------------------------------------------------------------------------------

def test_describe_numpy_reports_shape_strides_in_elements_and_dtype():
    a = np.zeros((3, 5), dtype=np.float32)
    assert arrays.describe(a) == ArrayInfo((3, 5), (5, 1), dt.float32)
    assert arrays.describe(np.zeros((2, 3, 4), np.int64)) == ArrayInfo((2, 3, 4), (12, 4, 1), dt.int64)
    assert arrays.describe(np.zeros((4,), np.bool_)).dtype == dt.bool_
    assert arrays.describe(np.zeros((), np.float64)) == ArrayInfo((), (), dt.float64)


def test_describe_numpy_non_contiguous_keeps_its_strides():
    base = np.zeros((6, 8), dtype=np.float32)
    assert arrays.describe(base.T) == ArrayInfo((8, 6), (1, 8), dt.float32)
    assert arrays.describe(base[::2, 1::3]) == ArrayInfo((3, 3), (16, 3), dt.float32)
    assert arrays.describe(base[:, ::-1]).strides == (8, -1)
    assert arrays.describe(np.broadcast_to(np.float32(1), (4, 4))).strides == (0, 0)


def test_describe_bfloat16_and_float16():
    a = np.zeros((2, 3), dtype=ml_dtypes.bfloat16)
    assert arrays.describe(a) == ArrayInfo((2, 3), (3, 1), dt.bfloat16)
    assert arrays.describe(np.zeros(3, np.float16)).dtype == dt.float16


def test_describe_rejects_unsupported_dtypes_and_objects():
    with pytest.raises(DTypeError, match="uint8"):
        arrays.describe(np.zeros(3, np.uint8))
    with pytest.raises(DTypeError, match="byte order"):
        arrays.describe(np.zeros(3, dtype=">f4"))
    with pytest.raises(TeccError, match="NumPy array or an object supporting DLPack"):
        arrays.describe([1.0, 2.0])


def test_dlpack_dtype_codes_map_to_tecc_dtypes_including_bfloat16():
    assert arrays.dtype_from_dlpack(arrays.KDL_BFLOAT, 16) == dt.bfloat16
    assert arrays.dtype_from_dlpack(arrays.KDL_FLOAT, 16) == dt.float16
    assert arrays.dtype_from_dlpack(arrays.KDL_INT, 64) == dt.int64
    assert arrays.dtype_from_dlpack(arrays.KDL_BOOL, 8) == dt.bool_
    for d in dt.ALL_DTYPES.values():
        assert arrays.dtype_from_dlpack(*arrays.dlpack_dtype(d)) == d
    with pytest.raises(DTypeError, match="uint8"):
        arrays.dtype_from_dlpack(arrays.KDL_UINT, 8)
    with pytest.raises(DTypeError, match="lanes"):
        arrays.dtype_from_dlpack(arrays.KDL_FLOAT, 32, 4)


def test_numpy_arguments_are_staged_as_contiguous_copies_with_writeback():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    arg = arrays.as_argument(a)
    assert arg.is_host and arg.staged is a and arg.writeback is None
    view = a.T
    arg = arrays.as_argument(view)
    assert arg.staged is not view and arg.staged.flags.c_contiguous and arg.writeback is view
    assert arg.info == ArrayInfo((4, 3), (3, 1), dt.float32)
    np.testing.assert_array_equal(arg.staged, view)
    assert arg.nbytes == 48


# ---- binding errors through the runtime's path -------------------------------------------------

def test_wrong_dtype_is_a_dtype_error_naming_the_argument():
    host = axpy_program()
    x, y = np.zeros(10, np.float32), np.zeros(10, np.float64)
    with pytest.raises(DTypeError, match=r"argument 1 \(y\) of axpy: expected float32, got float64"):
        prepare_arguments(host, [x, y, np.zeros(10, np.float32)])


def test_wrong_rank_is_a_shape_error():
    host = axpy_program()
    with pytest.raises(ShapeError, match=r"argument 0 \(x\).*expected 1 dimensions"):
        prepare_arguments(host, [np.zeros((2, 5), np.float32), np.zeros(10, np.float32), np.zeros(10, np.float32)])


def test_mismatched_symbolic_dimension_is_a_shape_error():
    host = axpy_program()
    with pytest.raises(ShapeError, match=r"argument 2 \(out\).*n is 9 here but 10"):
        prepare_arguments(host, [np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(9, np.float32)])


def test_wrong_argument_count_is_an_error():
    with pytest.raises(TeccError, match=r"axpy takes 3 arrays \(x, y, out\), got 2"):
        prepare_arguments(axpy_program(), [np.zeros(3, np.float32)] * 2)


def outer_max_program() -> HostProgram:
    """t[i, j] = x[i] * x[j] into an (n, n) temporary, then out[i] = max_j t[i, j]: two kernels."""
    n = Var("n", dt.int32, "size")
    x, out = Buffer("x", dt.float32, (n,)), Buffer("out", dt.float32, (n,))
    t = Buffer("t", dt.float32, (n, n))
    outer = KernelInfo("outer", (x, t, n), ((n * n + 255) // 256, ONE, ONE), (256, 1, 1))
    row_max = KernelInfo("row_max", (t, out, n), ((n + 255) // 256, ONE, ONE), (256, 1, 1))
    return HostProgram("outer_max", (x, out, n), (t,), (outer, row_max),
                       (Call("outer", ("x", "t", "n")), Call("row_max", ("t", "out", "n"))), ("out",))


def test_a_temporary_past_32_bit_offsets_is_a_shape_error_naming_it():
    """46341² elements: every argument fits int32 offsets, the (n, n) temporary does not."""
    host = outer_max_program()
    fits = [ArrayInfo((46340,), (1,), dt.float32)] * 2
    assert {v.name: value for v, value in bind_arguments(host, fits).items()} == {"n": 46340}  # 46340² < 2^31
    too_big = [ArrayInfo((46341,), (1,), dt.float32)] * 2
    with pytest.raises(ShapeError, match=r"outer_max: the temporary t \[n, n\] would hold 2147488281 elements.*"
                                         r"tc.var\(name, 'int64'\)"):
        bind_arguments(host, too_big)


def test_non_contiguous_array_for_a_contiguous_buffer_is_a_shape_error_when_used_in_place():
    # Device arrays are bound as they are; describe() gives binding what it would see.
    host = axpy_program()
    strided = np.zeros(20, np.float32)[::2]
    infos = [arrays.describe(strided), arrays.describe(np.zeros(10, np.float32)),
             arrays.describe(np.zeros(10, np.float32))]
    with pytest.raises(ShapeError, match=r"argument 0 \(x\).*contiguous row-major.*strides='any'"):
        bind_arguments(host, infos)


def test_non_contiguous_numpy_array_is_accepted_because_it_is_staged():
    host = axpy_program()
    prepared, env = prepare_arguments(host, [np.zeros(20, np.float32)[::2], np.zeros(10, np.float32),
                                             np.zeros(10, np.float32)])
    assert {v.name: value for v, value in env.items()} == {"n": 10}
    assert prepared[0].writeback is not None


def test_strided_buffer_binds_stride_variables_from_the_array():
    host = strided_copy_program()
    a = np.zeros((8, 6), np.float32).T  # (6, 8), strides (1, 6)
    env = bind_arguments(host, [arrays.describe(a), arrays.describe(np.zeros((6, 8), np.float32))])
    assert {v.name: value for v, value in env.items()} == {"m": 6, "n": 8, "a_stride0": 1, "a_stride1": 6}


def test_read_only_output_is_refused():
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(TeccError, match=r"argument 2 \(out\).*read-only"):
        prepare_arguments(axpy_program(), [np.zeros(4, np.float32), np.zeros(4, np.float32), out])


def _device_argument(ptr: int, n: int = 10, device_id: int = 0) -> arrays.Argument:
    return arrays.Argument(source=None, info=ArrayInfo((n,), (1,), dt.float32), ptr=ptr, device_id=device_id)


def test_device_arrays_must_be_on_the_device_and_16_byte_aligned():
    host = axpy_program()
    aligned = [_device_argument(0x7F0000000000 + 256 * i) for i in range(3)]
    check_device_arrays(host, aligned, device_id=0)
    with pytest.raises(ShapeError, match=r"argument 1 \(y\) of axpy: its data pointer 0x7f0000000104 is not aligned to 16"):
        check_device_arrays(host, [aligned[0], _device_argument(0x7F0000000104), aligned[2]], device_id=0)
    check_device_arrays(host, [aligned[0], _device_argument(0x7F0000000104), aligned[2]], device_id=0, alignment=4)
    with pytest.raises(DeviceError, match=r"argument 2 \(out\) of axpy lives on CUDA device 1"):
        check_device_arrays(host, aligned[:2] + [_device_argument(0x7F0000000000, device_id=1)], device_id=0)
    # zero-size arrays are never dereferenced: any pointer will do
    check_device_arrays(host, aligned[:2] + [_device_argument(0x3, n=0)], device_id=0)


# ---- the launch plan and scalar marshaling -----------------------------------------------------

def test_launch_plan_maps_each_kernel_parameter_to_its_source():
    (planned,) = plan_launches(strided_copy_program())
    assert [(s.kind, s.name) for s in planned.slots] == [
        ("array", "a"), ("array", "out"), ("scalar", "m"), ("scalar", "n"), ("scalar", "a_stride0"),
        ("scalar", "a_stride1")]
    assert [s.index for s in planned.slots[:2]] == [0, 1]


def test_launch_plan_rejects_inconsistent_host_programs():
    host = axpy_program()
    bad_name = HostProgram(host.name, host.params, host.temps, host.kernels,
                           (Call("axpy", ("x", "y", "nowhere", "n")),), host.outputs)
    with pytest.raises(TeccError, match="'nowhere' is neither an array parameter nor a temporary"):
        plan_launches(bad_name)
    unknown = HostProgram(host.name, host.params, host.temps, host.kernels, (Call("gone", ()),), host.outputs)
    with pytest.raises(TeccError, match="unknown kernel 'gone'"):
        plan_launches(unknown)
    k = host.kernels[0]
    free = Var("k", dt.int32, "size")
    unbound = HostProgram(host.name, host.params, host.temps,
                          (KernelInfo(k.name, k.params[:3] + (free,), k.grid, k.block),),
                          (Call("axpy", ("x", "y", "out", "k")),), host.outputs)
    with pytest.raises(TeccError, match="variable k is not a dimension or stride"):
        plan_launches(unbound)


def test_scalars_are_marshaled_in_their_exact_c_type():
    assert type(scalar_argument(dt.int32, 7)) is np.int32
    assert type(scalar_argument(dt.int64, 2**40)) is np.int64


# ---- artifacts -----------------------------------------------------------------------------------

def test_manifest_round_trip_through_write_and_load(tmp_path):
    host = axpy_program()
    manifest = manifest_for(host)
    stem = write_artifact(tmp_path / "axpy", manifest, FAKE_CUBIN, ptx="// ptx\n", cuda_source=CUDA_SOURCE)
    assert json.loads((tmp_path / "axpy.json").read_text()) == manifest
    f = load(stem)
    assert f.name == "axpy" and f.arch == "sm_90"
    assert f.host.to_json() == host.to_json()
    assert f.cubin == FAKE_CUBIN and f.ptx == "// ptx\n" and f.cuda_source == CUDA_SOURCE
    assert f.source_matches is True
    assert f.kernel_stats[0]["registers"] == 16
    assert f.plan == {"strategy": "naive", "steps": []}
    assert load(tmp_path / "axpy.json").host.to_json() == host.to_json()


def test_load_without_ptx_and_source_keeps_none(tmp_path):
    write_artifact(tmp_path / "k", manifest_for(axpy_program()), FAKE_CUBIN)
    f = load(tmp_path / "k")
    assert f.ptx is None and f.cuda_source is None and f.source_matches is None


def test_load_rejects_a_newer_format_version(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps(manifest_for(axpy_program(), version=MANIFEST_VERSION + 1)))
    (tmp_path / "k.cubin").write_bytes(FAKE_CUBIN)
    with pytest.raises(ArtifactError, match=f"format version {MANIFEST_VERSION + 1}.*reads versions up to {MANIFEST_VERSION}"):
        load(tmp_path / "k")


@pytest.mark.parametrize("change, message", [
    ({"format": "something-else"}, "not a tecc artifact"),
    ({"version": "1"}, "malformed format version"),
    ({"arch": "hopper"}, "not of the form sm_XY"),
    ({"entry": "other"}, "'entry' is 'other' but the host program is 'axpy'"),
    ({"kernels": []}, r"'kernels' lists \[\] but the host program has kernels \['axpy'\]"),
    ({"versions": {"tecc": "0.1"}}, "'versions' must be an object with keys tecc, nvrtc, cuda_core"),
    ({"source_sha256": "abc"}, "64 lowercase hex digits"),
    ({"host": {"name": "axpy"}}, "malformed 'host' program"),
])
def test_manifest_validation_names_the_bad_key(change, message):
    with pytest.raises(ArtifactError, match=message):
        validate_manifest(manifest_for(axpy_program(), **change))


def test_manifest_missing_keys_are_listed():
    m = manifest_for(axpy_program())
    del m["plan"], m["options"]
    with pytest.raises(ArtifactError, match="missing key\\(s\\) plan, options"):
        validate_manifest(m)


def test_load_missing_files_say_which(tmp_path):
    with pytest.raises(ArtifactError, match=r"no tecc artifact at .*nothing\.json"):
        load(tmp_path / "nothing")
    (tmp_path / "k.json").write_text(json.dumps(manifest_for(axpy_program())))
    with pytest.raises(ArtifactError, match=r"k\.cubin does not exist"):
        load(tmp_path / "k")
    (tmp_path / "k.cubin").write_bytes(b"not elf")
    with pytest.raises(ArtifactError, match="not a cubin"):
        load(tmp_path / "k")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        read_manifest(tmp_path / "bad")


def test_cubin_compatibility_follows_cudas_binary_rules():
    assert cubin_runs_on("sm_80", (8, 6))
    assert cubin_runs_on("sm_90", (9, 0))
    assert not cubin_runs_on("sm_86", (8, 0))
    assert not cubin_runs_on("sm_80", (9, 0))
    assert not cubin_runs_on("sm_90a", (9, 1))
    assert cubin_runs_on("sm_90a", (9, 0))
    assert cubin_runs_on("sm_100", (10, 0))


class _FakeDevice:
    device_id = 0
    name = "NVIDIA H100 80GB HBM3"
    compute_capability = (9, 0)


def test_arch_mismatch_says_to_rebuild_with_the_device_arch():
    with pytest.raises(DeviceError, match=r"compiled for sm_80.*is sm_90.*rebuild it with arch='sm_90'"):
        check_arch("sm_80", _FakeDevice(), "out/axpy")
    check_arch("sm_90", _FakeDevice())


@pytest.mark.skipif(cuda_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_load_validates_and_calling_raises_device_error(tmp_path):
    assert cuda_available() is False
    assert cuda_unavailable_reason()
    write_artifact(tmp_path / "axpy", manifest_for(axpy_program(), arch="sm_80"), FAKE_CUBIN)
    f = load(tmp_path / "axpy")  # an arch no device here could check: still loads
    x = np.ones(4, np.float32)
    with pytest.raises(DeviceError, match="no CUDA device is available to run the artifact"):
        f(x, x, np.zeros(4, np.float32))


def test_runtime_loads_artifacts_without_importing_the_compiler(tmp_path):
    """Neither the compiler, the passes and codegen, nor what only they need (islpy, NVRTC)."""
    write_artifact(tmp_path / "axpy", manifest_for(axpy_program()), FAKE_CUBIN)
    # `tecc/__init__.py` re-exports the compiler's API; a deployment imports tecc.runtime on its
    # own, so stand in an empty `tecc` package and check what the runtime itself pulls in.
    script = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("tecc")
        pkg.__path__ = [{str(REPO / "tecc")!r}]
        sys.modules["tecc"] = pkg
        import tecc.runtime.artifact as artifact, tecc.runtime.cuda, tecc.runtime.arrays
        f = artifact.load({str(tmp_path / "axpy")!r})
        assert f.host.name == "axpy"
        assert isinstance(f, tecc.runtime.runnable.RunnableKernel)
        bad = sorted(m for m in sys.modules if m.split(".")[:2] in
                     (["tecc", "compiler"], ["tecc", "passes"], ["tecc", "codegen"])
                     or m.split(".")[0] == "islpy" or m == "cuda.bindings.nvrtc")
        print("IMPORTED", bad)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout


def test_a_producer_that_refuses_to_export_is_a_tecc_error_naming_the_argument():
    """torch refuses DLPack / __cuda_array_interface__ for a tensor that requires grad; the call
    must fail with a TeccError that names the argument, not with torch's bare RuntimeError."""
    from tecc.runtime import arrays

    class RequiresGrad:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")

        def __dlpack__(self, stream=None):
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(TeccError, match=r"argument 0 \(x\) of f: cannot view RequiresGrad .*tensor.detach\(\)"):
        arrays.as_argument(RequiresGrad(), "argument 0 (x) of f")
