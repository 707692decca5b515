"""SimExecutor runs a module's host program (binding, temporaries, launches) on the emulator."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_support import assert_close, loop, poisoned, random_array

from tecc.ir import dtype as dt
from tecc.ir.errors import ShapeError
from tecc.ir.expr import Var
from tecc.ir.stmt import Buffer, BufferStore, IfThenElse, KernelCall, Module, PrimFunc
from tecc.runtime.host import HostProgram
from tecc.runtime.sim import SimExecutor


def map_kernel(name: str, n: Var, fn, written: int = 1, strides: tuple = ()) -> tuple[PrimFunc, Buffer, Buffer]:  # type: ignore[no-untyped-def]
    """out[i] = fn(inp[i]) for i < n // written (so `written=2` leaves the second half alone)."""
    inp = Buffer(f"{name}_in", dt.float32, (n,), strides=strides or None)
    out = Buffer(f"{name}_out", dt.float32, (n,))
    limit = n // written

    def thread(bx: Var, tx: Var):  # type: ignore[no-untyped-def]
        i = bx * 64 + tx
        return IfThenElse(i < limit, BufferStore(out, (i,), fn(inp[i])))

    body = loop("bx", (n + 63) // 64, "blockIdx.x", lambda bx: loop("tx", 64, "threadIdx.x", lambda tx: thread(bx, tx)))
    return PrimFunc(name, (inp, out, n, *strides), body), inp, out


def two_stage_module(written: int = 1) -> tuple[Module, dict[str, PrimFunc]]:
    """T = A * 2 (into a temporary), then C = T + 1."""
    n = Var("n", kind="size")
    A, C = Buffer("A", dt.float32, (n,)), Buffer("C", dt.float32, (n,))
    T = Buffer("T", dt.float32, (n,))
    kn1, kn2 = Var("n", kind="size"), Var("n", kind="size")
    k1, _, _ = map_kernel("scale", kn1, lambda x: x * 2.0, written)
    k2, _, _ = map_kernel("shift", kn2, lambda x: x + 1.0)
    module = Module("two_stage", (A, C, n), (k1, k2), (KernelCall("scale", (A, T, n)), KernelCall("shift", (T, C, n))), (T,))
    return module, {"scale": k1, "shift": k2}


def test_module_with_a_temporary_runs_every_launch_in_order() -> None:
    module, kernels = two_stage_module()
    run = SimExecutor(HostProgram.from_module(module), kernels)
    a = random_array((1000,), np.float32, 1)
    c = poisoned((1000,), np.float32)
    run(a, c)
    assert_close(c, a * np.float32(2) + np.float32(1), 0, 0, "two-stage module")


def test_temporaries_are_poisoned_so_unwritten_elements_show() -> None:
    module, kernels = two_stage_module(written=2)
    run = SimExecutor(HostProgram.from_module(module), kernels)
    a = random_array((100,), np.float32, 2)
    c = poisoned((100,), np.float32)
    c[:] = 0
    run(a, c)
    assert_close(c[:50], a[:50] * np.float32(2) + np.float32(1), 0, 0, "written half")
    assert np.isnan(c[50:]).all()


def test_zero_sized_arguments_skip_the_launches() -> None:
    module, kernels = two_stage_module()
    run = SimExecutor(HostProgram.from_module(module), kernels)
    run(np.zeros((0,), np.float32), np.zeros((0,), np.float32))


def test_arguments_are_checked_before_anything_runs() -> None:
    module, kernels = two_stage_module()
    run = SimExecutor(HostProgram.from_module(module), kernels)
    with pytest.raises(ShapeError):
        run(random_array((10,), np.float32), poisoned((11,), np.float32))
    with pytest.raises(ShapeError):
        run(random_array((20,), np.float32)[::2], poisoned((10,), np.float32))


def test_strided_argument_binds_its_stride_variables() -> None:
    n, s = Var("n", kind="size"), Var("A_stride0", kind="stride")
    A, C = Buffer("A", dt.float32, (n,), strides=(s,)), Buffer("C", dt.float32, (n,))
    kn, ks = Var("n", kind="size"), Var("s", kind="stride")
    k, _, _ = map_kernel("neg", kn, lambda x: 0.0 - x, strides=(ks,))
    module = Module("strided", (A, C, n), (k,), (KernelCall("neg", (A, C, n, s)),))
    run = SimExecutor(HostProgram.from_module(module), {"neg": k})
    base = random_array((300,), np.float32, 3)
    c = poisoned((100,), np.float32)
    run(base[::3], c)
    np.testing.assert_array_equal(c, -base[::3])
