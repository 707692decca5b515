"""The backward of the online contraction on tensor cores (mma.sync, sm_80+): the program that
online_backward.backward_chain recognises, as at most three kernels (FlashAttention-2's backward,
Dao 2023, Algorithm 2, with dQ by float32 atomics):

1. the pre-pass (`prepass_kernel`): one warp per forward row computes each row statistic the
   weights read (Δ = Σ_c dO·O: lanes over c, a shuffle sum) and zeroes the float32 accumulator
   of every row-side output (dQ);
2. the key-block-major kernel (`main_kernel`): one block per (BN keys, K/V head), warp w owning
   keys 16w .. 16w + 15 of the block. The key operands (K, V) are staged once; then for every
   query head of the block's group and every query block of BM rows (the mask's fully masked
   query blocks skipped, from a bound isl proves):

       wait; barrier; the next query block's row operands (Q, dO) and row statistics (lse, Δ)
         -> the other stage of a 2-stage cp.async ring
       Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ          each row-key contraction, mma into C fragments (16 keys x BM)
       P = exp2(s·log2 e - lse·log2 e) per element (0 past the keys or the queries), in place
       each output's w per element:     key side (dV: P, dK: dS·scale) -> the A fragment of the
                                        next mma (the C-to-A identity: no shuffle), row side
                                        (dQ: dS·scale) -> a shared [BN][BM] tile, tile outputs
                                        (dBias) -> global
       dV += Pᵀ·dO, dK += dSᵀ·Q         A from registers, B = the row tile (ldmatrix.trans)
       barrier; dQ[BM x C] += dS·K      A = the shared tile (ldmatrix.trans), B = the K tile;
                                        float32 atomics into dQ's accumulator, the tile split
                                        over the warps in units of 16 rows x `dq_columns`

   then dK, dV (the key-side accumulators) through their epilogue (the cast) to global memory;
3. the conversion (`convert_kernel`): each row-side output from its float32 accumulator; or,
   with `dq="kernel"`, no atomics in 2. and the query-major kernel of online_backward_dq instead.

The key-block-major kernel is online_backward_key_major's (its pieces: staging, contractions,
the elementwise stage, the epilogue), its Hopper form online_backward_wgmma's; what the
backward's kernels share (the pre-pass, the conversion, P and the weights of one element, the
guard) is online_backward_kernels'. This module chooses and orders them.

Memory: O(rows·C): no (rows x keys) buffer exists; P and dS live in registers and one BN x BM
tile of dS in shared memory. Precision: contractions in float32 from 16-bit operands; P and dS
are rounded to the operands' dtype before the mma that uses them (as FlashAttention), dQ is a
float32 sum in the order the atomics land.
"""

from __future__ import annotations

from ...ir.errors import ScheduleError
from ...ir.stmt import KernelCall, Module
from ...ir.tensor import Tensor
from ..names import identifier
from .online_backward import backward_chain
from .online_backward_dq import QueryMajor
from .online_backward_key_major import KeyMajor
from .online_backward_kernels import WHERE
from .online_backward_wgmma import KeyMajorWgmma, QueryMajorWgmma

DQ_FORMS = ("atomic", "kernel")


def online_backward_mma(args: list[Tensor], key_tile: int = 64, rows: int = 64, dq_columns: int = 32,
                        name: str | None = None, dq: str = "atomic", dq_rows: int = 64, dq_key_tile: int = 64,
                        wgmma: bool = False, whole_tiles: bool = True, stages: int = 2, overlap: bool = False) -> Module:
    """The kernels of the backward program `args` (module docstring): blocks of `key_tile` keys
    (16 per warp), query blocks of `rows`. `dq` "atomic": the row-side outputs (dQ) by float32
    atomics in units of 16 rows x `dq_columns`, then converted; "kernel": by the query-major kernel
    (online_backward_dq) of `dq_rows` query rows per block over key blocks of `dq_key_tile`.
    `wgmma`: the key-block-major kernel in its Hopper form (online_backward_wgmma, sm_90a).
    `whole_tiles`: the tiles isl proves whole run the elementwise stage without guards (a second,
    unguarded copy of it); False keeps one guarded copy, fewer registers. `stages`: the depth of the
    key-block-major kernel's ring of query blocks (2, 3 or 4). `overlap` (wgmma, one warpgroup
    per block, dQ by the query-major kernel): the key-block-major kernel leaves each step's dV/dK
    wgmmas in flight into the next step's scores (online_backward_wgmma)."""
    chain = backward_chain(args)
    for what, n in (("key_tile", key_tile), ("rows", rows), ("dq_columns", dq_columns), ("dq_rows", dq_rows),
                    ("dq_key_tile", dq_key_tile)):
        if n not in (16, 32, 64, 128):
            raise ScheduleError(f"{WHERE}: {what}={n} must be 16, 32, 64 or 128 (m16, n8 and k16 steps of 16 rows)")
    if dq not in DQ_FORMS:
        raise ScheduleError(f"{WHERE}: dq={dq!r} must be one of {DQ_FORMS}")
    if stages not in (2, 3, 4):
        raise ScheduleError(f"{WHERE}: stages={stages} must be 2, 3 or 4 (query blocks in the key-block-major "
                            "kernel's cp.async ring)")
    if overlap and (not wgmma or key_tile != 64 or (dq == "atomic" and chain.of_kind("row"))):
        raise ScheduleError(f"{WHERE}: overlap=True needs the Hopper form (wgmma) with one warpgroup per block "
                            f"(key_tile=64) and dQ by the query-major kernel (dq='kernel'); got wgmma={wgmma}, "
                            f"key_tile={key_tile}, dq={dq!r}")
    if wgmma:
        main: KeyMajor = KeyMajorWgmma(chain, key_tile, rows, dq == "atomic", name, overlap=overlap)
    else:
        main = KeyMajor(chain, key_tile, rows, dq_columns, dq == "atomic", name)
    main.unguarded_tiles = whole_tiles
    main.stages = stages
    kernels = [main.prepass_kernel()]
    if chain.of_kind("key") or chain.of_kind("tile") or main.row_side:
        kernels.append(main.main_kernel())
    kernels.append(main.convert_kernel())
    if dq == "kernel" and chain.of_kind("row"):
        rows_kernel = (QueryMajorWgmma if wgmma else QueryMajor)(chain, dq_rows, dq_key_tile, name, like=main)
        rows_kernel.unguarded_tiles = whole_tiles
        kernels.append(rows_kernel.kernel())
    found = [k for k in kernels if k is not None]
    prog = chain.program
    mname = identifier(name or next(a.name for a in reversed(prog.args) if not a.is_placeholder))
    module_params = tuple(main.sig.buffers[a] for a in prog.args) + tuple(main.sig.scalars)
    calls = tuple(KernelCall(k.name, k.params) for k in found)
    return Module(mname, module_params, tuple(found), calls, tuple(main.temps))


__all__ = ["online_backward_mma"]
