"""The host side of data-dependent index checks: reading the module's error record.

A kernel that checks a data-dependent index (`W[idx[i], j]`, a scatter's position) records the
first index it finds out of range in a `__device__` array of the module (tecc/ir/index_checks.py
fixes its symbol and layout; codegen/cuda_expr.py emits it) and skips the access. The executor
finds the record when it loads the cubin and, whenever it synchronizes a call (a call with host
arrays, `synchronize()`), copies its RECORD_WORDS words back: a nonzero first word is raised as
OutOfBoundsError naming the tensor, the dimension, the value and the kernel, and the record is
cleared for the next calls. docs/runtime.md, "Data-dependent indices", has the trade-offs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.errors import DeviceError, LaunchError, OutOfBoundsError
from ..ir.index_checks import RECORD_SYMBOL, RECORD_WORDS, describe_failure
from .host import HostProgram


def find_record(object_code: Any, host: HostProgram) -> int:
    """The device address of the error record in the loaded cubin (a cuda.core ObjectCode)."""
    from cuda.bindings import driver

    library = object_code.handle
    if not isinstance(library, driver.CUlibrary):
        library = driver.CUlibrary(int(library))
    err, pointer, size = driver.cuLibraryGetGlobal(library, RECORD_SYMBOL.encode())
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"{host.name}: the cubin has no index-check record {RECORD_SYMBOL} ({_text(err)}); "
                          "rebuild it with this version of tecc")
    if int(size) != 8 * RECORD_WORDS:
        raise DeviceError(f"{host.name}: the cubin's index-check record {RECORD_SYMBOL} has {int(size)} bytes, not "
                          f"{8 * RECORD_WORDS}; rebuild it with this version of tecc")
    return int(pointer)


def check(pointer: int, host: HostProgram) -> None:
    """OutOfBoundsError if the record at `pointer` holds a failure (then cleared). Call it only
    after the launches that may fill it have completed (a synchronized stream): one 40-byte copy
    to the host."""
    from cuda.bindings import driver

    record = np.zeros(RECORD_WORDS, dtype=np.int64)
    (err,) = driver.cuMemcpyDtoH(record.ctypes.data, pointer, record.nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{host.name}: cannot read the index-check record: {_text(err)}")
    if record[0] == 0:
        return
    (err,) = driver.cuMemsetD8(pointer, 0, record.nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"{host.name}: cannot clear the index-check record: {_text(err)}")
    raise OutOfBoundsError(describe_failure(host.name, host.index_checks, [int(x) for x in record]))


def _text(err: Any) -> str:
    try:
        from cuda.bindings import driver

        _, name = driver.cuGetErrorName(err)
        return str(name.decode())
    except Exception:  # noqa: BLE001
        return str(err)


__all__ = ["check", "find_record"]
