"""Run a whole compiled module (its `HostProgram`) under the emulator, as the CUDA executor would."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ...ir.dtype import as_dtype
from ...ir.errors import ResourceError, TeccError
from ...ir.expr import Var
from ...ir.stmt import Buffer, PrimFunc
from ...ir.target import Target
from ..host import ArrayInfo, HostProgram, KernelInfo, bind_arguments, resolve_launch, temp_shape
from ..marshal import tensor_map_geometry
from ..tensor_map import encode_arguments
from .kernel import compile_kernel, simulate_kernel
from .numerics import poison


def array_info(array: np.ndarray) -> ArrayInfo:
    """What `bind_arguments` checks of an array: shape, strides in elements, dtype."""
    return ArrayInfo(tuple(array.shape), tuple(s // array.itemsize for s in array.strides), as_dtype(array.dtype))


class SimExecutor:
    """Executes `host`'s launch sequence with the kernels' loop IR on the CPU.

    Call it with NumPy arrays in the order of `host.buffer_params`; outputs are written in place.
    Temporaries are allocated per call and poisoned (NaN, or a sentinel for integers), so a read
    of a temporary nothing wrote shows in the result even with `checks=False`; a zero_init one
    is zeroed once and kept across calls, as on the GPU (`_zeroed`).

    `target`: the GPU the kernels were built for; a launch asking for more shared memory per
    block than it allows (Target.smem_per_block_optin) is refused with a ResourceError, as the
    CUDA executor refuses it on the device (None: no such check)."""

    def __init__(self, host: HostProgram, kernels: Mapping[str, PrimFunc], *, checks: bool = True,
                 target: Target | None = None) -> None:
        self.host = host
        self.kernels = dict(kernels)
        self.checks = checks
        self.target = target
        self._zero_temps: dict[str, np.ndarray] = {}  # flat storage of the zero_init temporaries
        for call in host.calls:
            if call.kernel not in self.kernels:
                raise TeccError(f"{host.name}: the host program launches {call.kernel}, which has no loop IR here")
        for func in self.kernels.values():
            compile_kernel(func)  # fail early on IR the emulator cannot run

    def __call__(self, *arrays: np.ndarray) -> None:
        host = self.host
        for pos, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise TeccError(
                    f"{host.name}: argument {pos} is a {type(a).__name__}; the emulator takes NumPy arrays "
                    "(it writes outputs in place)"
                )
        env = bind_arguments(host, [array_info(a) for a in arrays])
        outputs = set(host.outputs)
        for pos, (a, buf) in enumerate(zip(arrays, host.buffer_params)):
            if buf.name in outputs and not a.flags.writeable:
                raise TeccError(f"argument {pos} ({buf.name}) of {host.name}: the kernel writes it, but the array "
                                "is read-only; pass a writable array (e.g. a.copy())")
        values: dict[str, np.ndarray | int] = {v.name: n for v, n in env.items()}
        values.update({b.name: a for b, a in zip(host.buffer_params, arrays)})
        for t in host.temps:
            if t.zero_init:
                values[t.name] = self._zeroed(t, temp_shape(t, env))
            else:
                values[t.name] = np.full(temp_shape(t, env), poison(t.dtype), dtype=t.dtype.numpy)
        for call in host.calls:
            func, info = self.kernels[call.kernel], host.kernel(call.kernel)
            missing = [name for name in call.args if name not in values]
            if missing:
                raise TeccError(f"{host.name}: launch of {call.kernel} names {missing}, which have no value")
            # Launch dimensions are expressions over the kernel's own size parameters, which may
            # be other Var objects than the module's (a kernel loaded from a manifest): bind both.
            kernel_env: dict[Var, int] = dict(env)
            for param, name in zip(info.params, call.args):
                if isinstance(param, Var) and isinstance(values[name], int):
                    kernel_env[param] = values[name]  # type: ignore[assignment]
            grid, block = resolve_launch(info, kernel_env, host.name)
            if 0 in grid:
                continue
            self._check_shared_memory(info)
            self._check_tensor_maps(info, call.args, values, env)
            args: dict[str, np.ndarray | int] = {}
            for param, name in zip(func.params, call.args):
                value = values[name]
                if isinstance(param, Buffer) and not isinstance(value, np.ndarray):
                    raise TeccError(f"{host.name}: {call.kernel} parameter {param.name} got the scalar {name}")
                args[param.name] = value
            simulate_kernel(func, args, grid, block, checks=self.checks)

    def _check_shared_memory(self, info: KernelInfo) -> None:
        """ResourceError when the launch of `info` asks for more shared memory per block than
        the target allows (dynamic shared memory, after opting in: Target.smem_per_block_optin;
        codegen keeps static shared memory within 48 KiB)."""
        target = self.target
        if target is None or info.dynamic_smem <= target.smem_per_block_optin:
            return
        raise ResourceError(
            f"{self.host.name}: kernel {info.name} asks for {info.dynamic_smem} bytes of shared memory per block, "
            f"over the {target.smem_per_block_optin} bytes a block may have on {target.name} ({target.arch}); "
            "the GPU would refuse the launch: choose a plan with smaller shared-memory tiles (fewer stages, a "
            "smaller block, or a 16-bit output for a staged epilogue)")

    def _check_tensor_maps(self, info: KernelInfo, names: tuple[str, ...], values: Mapping[str, np.ndarray | int],
                           env: dict[Var, int]) -> None:
        """What the CUDA executor checks when it encodes the launch's tensor maps (the base
        address, the shape and strides TMA can address: tensor_map.encode_arguments), so a kernel
        the GPU would refuse to launch fails here too, with the same ShapeError."""
        by_param = {p.name: a for p, a in zip(info.params, names) if isinstance(p, Buffer)}
        for spec in info.tensor_maps:
            name = by_param[spec.param]
            array = values[name]
            assert isinstance(array, np.ndarray)
            shape, strides = tensor_map_geometry(self.host, name, env)
            encode_arguments(spec, array.__array_interface__["data"][0], shape, strides,
                             f"{self.host.name}: tensor map of {spec.param}")

    def _zeroed(self, temp: Buffer, shape: tuple[int, ...]) -> np.ndarray:
        """A zero-initialised temporary (Buffer.zero_init) as the CUDA executor keeps it: zeroed
        once when allocated, then reused by later calls while it is big enough, never zeroed
        again; so a kernel that does not leave it zero shows on the next call."""
        count = int(np.prod(shape, dtype=np.int64))
        held = self._zero_temps.get(temp.name)
        if held is None or held.size < count:
            held = self._zero_temps[temp.name] = np.zeros(max(count, 1), dtype=temp.dtype.numpy)
        return held[:count].reshape(shape)
