"""CUDA C for TMA tile copies: the tensor-map parameters and cp.async.bulk.tensor.

- Every tensor map of a kernel (`tensor_maps(func)`, in order of first use) is a by-value
  parameter `const __grid_constant__ TeccTensorMap <buffer>_tmap` after the ordinary
  parameters. `TeccTensorMap` is declared once per translation unit with CUtensorMap's size and
  alignment (128 bytes, 64-byte aligned; NVRTC has no cuda.h): the host passes the driver's
  encoded bytes, the kernel only takes the parameter's address. `__grid_constant__` keeps the
  parameter in the parameter space, so its generic address is what the TMA unit reads.
- A store (TensorStore) is cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group with the same
  coordinate order and the source's 32-bit shared address (BulkCommit / BulkWait, and bar.sync,
  are rows of the instruction table: instructions.py).
- A copy is one inline-PTX cp.async.bulk.tensor.Nd with the coordinates innermost first (the
  PTX order; tecc's indices are outermost first), the destination's and the mbarrier's 32-bit
  shared addresses.
"""

from __future__ import annotations

from tecc.ir.expr import index_expr
from tecc.ir.stmt import PrimFunc, TensorCopy, TensorStore, iter_stmts, tensor_maps
from tecc.ir.tma_stmt import TENSOR_MAP_BYTES

from .cuda_expr import ExprEmitter
from .matrix import _asm, shared_address

TENSOR_MAP_TYPE = "TeccTensorMap"
TENSOR_MAP_DECLARATION = (f"struct __align__(64) {TENSOR_MAP_TYPE} {{ unsigned long long opaque[{TENSOR_MAP_BYTES // 8}]; }};"
                          "  // CUtensorMap's size and alignment")


def tensor_map_params(func: PrimFunc) -> list[str]:
    """The C declarations of `func`'s tensor-map parameters, in ABI order."""
    return [f"const __grid_constant__ {TENSOR_MAP_TYPE} {m.name}" for m in tensor_maps(func)]


def swizzled_destinations(func: PrimFunc) -> set[int]:
    """Ids of the shared buffers a swizzling TMA copy writes or a swizzling TMA store reads
    (declared 1024-byte aligned)."""
    out = set()
    for s in iter_stmts(func.body):
        if isinstance(s, TensorCopy) and s.map.swizzle != "none":
            out.add(id(s.dst))
        elif isinstance(s, TensorStore) and s.map.swizzle != "none":
            out.add(id(s.src))
    return out


def tensor_copy(expr: ExprEmitter, s: TensorCopy) -> list[str]:
    rank = len(s.coords)
    # the box's start before the layout: the TMA unit applies the swizzle to the addresses it
    # writes, which equals the buffer's layout because the buffer is 1024-byte aligned
    base = shared_address(expr, s.dst, tuple(index_expr(0) for _ in s.dst.shape))
    flat = index_expr(0)
    for i, n in zip(s.dst_indices, s.dst.shape):
        flat = flat * n + i
    dst = f"{base} + {s.dst.dtype.bytes}u * static_cast<unsigned>({expr.code(flat)})"
    coords = ", ".join(f"%{3 + d}" for d in range(rank))
    instruction = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes "
                   f"[%0], [%1, {{{coords}}}], [%2];")
    bar = shared_address(expr, s.bar.buffer, (s.bar.index,))
    inputs = [f'"r"({dst})', f'"l"(reinterpret_cast<unsigned long long>(&{s.map.name}))', f'"r"({bar})']
    inputs += [f'"r"(static_cast<int>({expr.code(c)}))' for c in reversed(s.coords)]
    return _asm([instruction], [], inputs, clobber_memory=True)


def tensor_store(expr: ExprEmitter, s: TensorStore) -> list[str]:
    rank = len(s.coords)
    base = shared_address(expr, s.src, tuple(index_expr(0) for _ in s.src.shape))
    flat = index_expr(0)
    for i, n in zip(s.src_indices, s.src.shape):
        flat = flat * n + i
    src = f"{base} + {s.src.dtype.bytes}u * static_cast<unsigned>({expr.code(flat)})"
    coords = ", ".join(f"%{2 + d}" for d in range(rank))
    instruction = f"cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group [%0, {{{coords}}}], [%1];"
    inputs = [f'"l"(reinterpret_cast<unsigned long long>(&{s.map.name}))', f'"r"({src})']
    inputs += [f'"r"(static_cast<int>({expr.code(c)}))' for c in reversed(s.coords)]
    return _asm([instruction], [], inputs, clobber_memory=True)
