"""The loop-nest IR: buffers, statements, kernels (PrimFunc) and the kernel module. Every pass,
codegen and the emulator import its names from here.

The statements live in modules of their own, each its reference manual, layered so that none
imports one above it:
- stmt_nodes.py: buffers, loops, stores, allocations, conditions, barriers, kernels, modules;
- matrix_stmt.py: the warp's matrix fragments (mma, ldmatrix) and cp.async copies;
- warpgroup_stmt.py: wgmma and its shared-memory operands (Hopper);
- mbarrier_stmt.py: mbarriers and the bulk copies that complete on them;
- tma_stmt.py: tensor maps and TMA tile copies and stores;
- instructions.py: the statements that are one PTX instruction with a few operands (fences,
  commit and wait groups, mbarrier operations, named barriers, setmaxnreg), rows of a table
  under one statement class, `Instruction`; their old class names construct them.
"""

from __future__ import annotations

from .instructions import (
    NAMED_BARRIERS, AsyncCommit, AsyncProxyFence, AsyncWait, BarrierArrive, BarrierExpectTx, BarrierInit, BarrierWait,
    BulkCommit, BulkWait, Instruction, NamedBarrier, SetMaxRegisters, TensorMapPrefetch, WarpgroupCommit, WarpgroupFence,
    WarpgroupWait,
)
from .matrix_stmt import AsyncCopy, FragmentRef, MatrixLoad, MatrixMultiply
from .mbarrier_stmt import BarrierRef, BulkCopy
from .stmt_nodes import (
    BLOCK_KINDS, LOOP_KINDS, SCOPES, THREAD_KINDS, Allocate, Barrier, Buffer, BufferStore, Evaluate, For, IfThenElse,
    KernelCall, KernelParam, LaunchDims, LetStmt, Module, PrimFunc, Seq, Stmt, check_fragment_buffer, iter_stmts,
    launch_dims, seq,
)
from .tma_stmt import TensorCopy, TensorMap, TensorStore, tensor_maps
from .warpgroup_stmt import SharedMatrix, WarpgroupMatrixMultiply

__all__ = [
    "AsyncCommit", "AsyncCopy", "AsyncProxyFence", "AsyncWait", "Allocate", "BLOCK_KINDS", "Barrier", "BarrierArrive",
    "BarrierExpectTx", "BarrierInit", "BarrierRef", "BarrierWait", "Buffer", "BufferStore", "BulkCommit", "BulkCopy",
    "BulkWait", "Evaluate", "For", "FragmentRef", "IfThenElse", "Instruction", "KernelCall", "KernelParam",
    "LOOP_KINDS", "LaunchDims", "LetStmt", "MatrixLoad", "MatrixMultiply", "Module", "NAMED_BARRIERS", "NamedBarrier",
    "PrimFunc", "SCOPES", "Seq", "SetMaxRegisters", "SharedMatrix", "Stmt", "THREAD_KINDS", "TensorCopy", "TensorMap",
    "TensorMapPrefetch", "TensorStore", "WarpgroupCommit", "WarpgroupFence", "WarpgroupMatrixMultiply", "WarpgroupWait",
    "check_fragment_buffer", "iter_stmts", "launch_dims", "seq", "tensor_maps",
]
