"""Target: the limits and rates of one GPU that the cost model and the planner reason with.

    tc.target("sm_90")          # the reference part of that architecture (H100 SXM5), from tables
    tc.target.from_device()     # the live GPU's own limits and rates, read through cuda.core

Two kinds of numbers live here, and every constant cites where it comes from:

* **Limits per compute capability** (threads, blocks, warps, registers and shared memory per SM and
  per block, allocation granularities). They are the same for every part of an architecture and
  come from the CUDA C++ Programming Guide, table "Technical Specifications per Compute
  Capability" (CUDA 12.x/13.0, section "Compute Capabilities"), and the occupancy calculator
  `cuda_occupancy.h` shipped with the CUDA toolkit (granularities). `from_device` reads the same
  limits off the device (cuda.core `DeviceProperties`), which must agree.
* **Rates of one reference part** per architecture (SM count, clock, DRAM bandwidth, L2 size,
  peak FLOP rates). They come from NVIDIA's architecture whitepapers / datasheets named next to
  each part. `from_device` replaces SM count, clocks, L2 size and DRAM bandwidth by the live
  device's, and scales the per-SM FLOP rates by its SM count and clock.

Tensor-core rates are dense (no 2:4 sparsity) with fp32 accumulation where the part has a
different fp16-accumulate rate. The rates are peaks: the cost model multiplies them by the
achievable fractions it documents (docs/cost-model.md), it never assumes them reached.

This module imports nothing else of tecc (layer rule: tecc.ir is the bottom layer).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import DeviceError

KiB = 1024
MiB = 1024 * 1024


@dataclass(frozen=True)
class Target:
    """Limits and rates of one GPU (bytes, bytes/s, FLOP/s, Hz; "per SM" = per multiprocessor).

    `smem_per_block` is what a kernel may use without opting in (static `__shared__` arrays are
    always held to it); `smem_per_block_optin` what dynamic shared memory may reach after
    cudaFuncSetAttribute(MaxDynamicSharedMemorySize). `smem_reserved_per_block` is taken by the
    system from the SM's shared memory for every resident block (sm_80+: 1 KiB).
    `tensor_flops` maps an operand dtype name to the dense tensor-core peak. `source` says where
    the numbers came from.

    `allow_tf32` is no property of the GPU but the one precision policy the planner reads with
    it: whether float32 contractions may run on tensor cores with their operands rounded to
    tf32 (10 mantissa bits). False unless the build asks (`build(..., allow_tf32=True)`), so
    a float32 result is never silently less accurate; it is part of the Target so that the
    build cache's key and explain() carry it with the figures the plan was ranked for.
    `deterministic` is the other one: no plan whose results may change from run to run, i.e. no
    float atomics (a scatter is then summed per output element in a fixed order, never by
    atomic additions: `build(..., deterministic=True)`, docs/semantics.md "Atomics")."""

    arch: str
    name: str
    sm_count: int
    clock_hz: float
    # ---- limits per compute capability ----
    warp_size: int = 32
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    max_blocks_per_sm: int = 32
    max_warps_per_sm: int = 64
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    max_registers_per_thread: int = 255
    register_alloc_unit: int = 256       # registers are allocated per warp in units of 256
    warp_alloc_granularity: int = 4      # ... for groups of 4 warps (cuda_occupancy.h)
    smem_per_block: int = 48 * KiB
    smem_per_block_optin: int = 48 * KiB
    smem_per_sm: int = 64 * KiB
    smem_reserved_per_block: int = 1 * KiB
    smem_alloc_unit: int = 128
    smem_banks: int = 32
    smem_bank_bytes: int = 4
    schedulers_per_sm: int = 4           # warp schedulers, one instruction issued per clock each
    # ---- rates of the part ----
    l2_bytes: int = 0
    dram_bandwidth: float = 0.0          # bytes/s, read + write
    fp32_flops: float = 0.0              # FLOP/s on the CUDA cores (an FMA counts 2)
    tensor_flops: Mapping[str, float] = field(default_factory=dict)
    source: str = ""
    # ---- precision policy of the build (not hardware) ----
    allow_tf32: bool = False
    deterministic: bool = False

    # ---- derived rates ----
    @property
    def fp32_lanes_per_sm(self) -> float:
        """FP32 FMA lanes per SM per clock (64 on sm_80, 128 on sm_86/89/90)."""
        return self.fp32_flops / 2.0 / self.sm_count / self.clock_hz

    @property
    def smem_bytes_per_clock_per_sm(self) -> int:
        """Shared-memory bandwidth per SM: one 4-byte word per bank per clock."""
        return self.smem_banks * self.smem_bank_bytes

    @property
    def sm(self) -> int:
        """The compute capability as a number: 80, 86, 89, 90."""
        return int(self.arch.split("_")[1].rstrip("af"))

    def replace(self, **changes: Any) -> "Target":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        tc = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in sorted(self.tensor_flops.items()))
        return (f"{self.arch} ({self.name}): {self.sm_count} SMs at {self.clock_hz / 1e9:.2f} GHz, "
                f"DRAM {self.dram_bandwidth / 1e12:.2f} TB/s, L2 {self.l2_bytes / MiB:.0f} MiB, "
                f"fp32 {self.fp32_flops / 1e12:.1f} TFLOP/s, tensor [{tc}] TFLOP/s; "
                f"smem/block {self.smem_per_block // KiB} KiB ({self.smem_per_block_optin // KiB} KiB opt-in), "
                f"smem/SM {self.smem_per_sm // KiB} KiB, regs/SM {self.registers_per_sm}, "
                f"threads/SM {self.max_threads_per_sm}, blocks/SM {self.max_blocks_per_sm}"
                + ("; TF32 allowed for float32 contractions (build(..., allow_tf32=True))" if self.allow_tf32 else "")
                + ("; deterministic: no float atomics (build(..., deterministic=True))" if self.deterministic else ""))

    def __str__(self) -> str:
        return f"Target({self.arch}, {self.name})"


# ---- limits per compute capability -------------------------------------------------------------
# CUDA C++ Programming Guide (12.x / 13.0), "Technical Specifications per Compute Capability":
#   max resident threads / warps / blocks per SM, 32-bit registers per SM and per thread, shared
#   memory per SM and per block (opt-in). All four have 64 K registers per SM and per block,
#   255 registers per thread, 1024 threads per block, 48 KiB of static shared memory per block.
#   Reserved shared memory per block: 1 KiB on 8.x and 9.0 (same guide, "Shared Memory" of
#   Compute Capability 8.x; also cudaDevAttrReservedSharedMemoryPerBlock).
# cuda_occupancy.h (CUDA toolkit): register allocation unit 256 per warp, warp allocation
#   granularity 4 (so a 64-register thread costs 64*32 = 2048 registers per warp), shared-memory
#   allocation unit 128 bytes on 8.x / 9.0.
_LIMITS: dict[int, dict[str, Any]] = {
    80: dict(max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32,
             smem_per_sm=164 * KiB, smem_per_block_optin=163 * KiB),
    86: dict(max_threads_per_sm=1536, max_warps_per_sm=48, max_blocks_per_sm=16,
             smem_per_sm=100 * KiB, smem_per_block_optin=99 * KiB),
    89: dict(max_threads_per_sm=1536, max_warps_per_sm=48, max_blocks_per_sm=24,
             smem_per_sm=100 * KiB, smem_per_block_optin=99 * KiB),
    90: dict(max_threads_per_sm=2048, max_warps_per_sm=64, max_blocks_per_sm=32,
             smem_per_sm=228 * KiB, smem_per_block_optin=227 * KiB),
}

# ---- rates of the reference part of each architecture ------------------------------------------
_PARTS: dict[int, dict[str, Any]] = {
    # NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 1 / "A100 SXM4 80GB"
    # datasheet: 108 SMs, boost 1410 MHz, 40 MB L2, HBM2e 2039 GB/s, FP32 19.5 TFLOP/s
    # (64 FP32 lanes/SM), dense TF32 156, FP16/BF16 312, INT8 624 TOPS.
    80: dict(name="A100-SXM4-80GB", sm_count=108, clock_hz=1.41e9, l2_bytes=40 * MiB,
             dram_bandwidth=2039e9, fp32_flops=19.5e12,
             tensor_flops={"tf32": 156e12, "float16": 312e12, "bfloat16": 312e12, "int8": 624e12},
             source="A100 whitepaper (2020) Table 1; A100 80GB datasheet"),
    # NVIDIA Ampere GA102 GPU Architecture whitepaper (2020), Table 9, GeForce RTX 3090: 82 SMs,
    # boost 1695 MHz, 6 MB L2, GDDR6X 936 GB/s, FP32 35.6 TFLOP/s (128 lanes/SM), dense FP16
    # tensor with FP32 accumulate 71 TFLOP/s (GeForce: half the FP16-accumulate rate), TF32 35.6.
    86: dict(name="GeForce RTX 3090", sm_count=82, clock_hz=1.695e9, l2_bytes=6 * MiB,
             dram_bandwidth=936e9, fp32_flops=35.6e12,
             tensor_flops={"tf32": 35.6e12, "float16": 71e12, "bfloat16": 71e12, "int8": 284e12},
             source="GA102 whitepaper (2020) Table 9, RTX 3090"),
    # NVIDIA Ada GPU Architecture whitepaper (2022), Appendix Table, GeForce RTX 4090: 128 SMs,
    # boost 2520 MHz, 72 MB L2, GDDR6X 1008 GB/s, FP32 82.6 TFLOP/s, dense FP16 tensor with FP32
    # accumulate 165.2 TFLOP/s, TF32 82.6, FP8 660.6, INT8 660.6 TOPS.
    89: dict(name="GeForce RTX 4090", sm_count=128, clock_hz=2.52e9, l2_bytes=72 * MiB,
             dram_bandwidth=1008e9, fp32_flops=82.6e12,
             tensor_flops={"tf32": 82.6e12, "float16": 165.2e12, "bfloat16": 165.2e12, "float8": 660.6e12,
                           "int8": 660.6e12},
             source="Ada whitepaper (2022) appendix, RTX 4090"),
    # NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022) / H100 datasheet, H100 SXM5 80GB:
    # 132 SMs, boost 1980 MHz (max), 50 MB L2, HBM3 3.35 TB/s, FP32 67 TFLOP/s (128 lanes/SM),
    # dense TF32 494.7, FP16/BF16 989.4, FP8 1978.9 TFLOP/s, INT8 1978.9 TOPS.
    90: dict(name="H100-SXM5-80GB", sm_count=132, clock_hz=1.98e9, l2_bytes=50 * MiB,
             dram_bandwidth=3.35e12, fp32_flops=66.9e12,
             tensor_flops={"tf32": 494.7e12, "float16": 989.4e12, "bfloat16": 989.4e12, "float8": 1978.9e12,
                           "int8": 1978.9e12},
             source="H100 whitepaper (2022) / H100 SXM5 datasheet"),
}

ARCHS = tuple(f"sm_{cc}" for cc in sorted(_PARTS))


def _parse_arch(arch: str) -> int:
    m = re.fullmatch(r"(?:sm_|compute_)?(\d)(\d)[af]?", arch.strip())
    if m is None:
        raise ValueError(f"target: arch must look like 'sm_90', got {arch!r}")
    return int(m.group(1)) * 10 + int(m.group(2))


def target(arch: str = "sm_90") -> Target:
    """The Target of an architecture's reference part ("sm_80", "sm_86", "sm_89", "sm_90";
    "sm_90a" is sm_90). Raises ValueError for an architecture tecc has no table for."""
    cc = _parse_arch(arch)
    if cc not in _PARTS:
        raise ValueError(f"target: no limits/rates table for sm_{cc}; known: {', '.join(ARCHS)}")
    return Target(arch=f"sm_{cc}", **_PARTS[cc], **_LIMITS[cc])


def from_properties(arch: str, props: Any, name: str = "device") -> Target:
    """The Target of a device given its cuda.core `DeviceProperties` (or any object with the same
    attribute names): limits and SM count / clock / L2 / DRAM bandwidth from the device, the
    FLOP rates of the reference part scaled per SM and clock. Attributes that are missing keep
    the table's value."""
    base = target(arch)

    def get(attr: str, default: Any) -> Any:
        try:
            value = getattr(props, attr)
        except Exception:  # noqa: BLE001 - a property the driver cannot answer keeps the table value
            return default
        return default if value in (None, 0) else value

    sm_count = int(get("multiprocessor_count", base.sm_count))
    clock = float(get("clock_rate", base.clock_hz / 1e3)) * 1e3           # kHz -> Hz
    mem_clock_khz = get("memory_clock_rate", None)
    bus_bits = get("global_memory_bus_width", None)
    dram = base.dram_bandwidth
    if mem_clock_khz and bus_bits:
        # DDR: two transfers per memory clock (as CUDA's deviceQuery computes peak bandwidth)
        dram = 2.0 * float(mem_clock_khz) * 1e3 * float(bus_bits) / 8.0
    scale = (sm_count * clock) / (base.sm_count * base.clock_hz)
    return base.replace(
        name=name, sm_count=sm_count, clock_hz=clock,
        warp_size=int(get("warp_size", base.warp_size)),
        max_threads_per_block=int(get("max_threads_per_block", base.max_threads_per_block)),
        max_threads_per_sm=int(get("max_threads_per_multiprocessor", base.max_threads_per_sm)),
        max_blocks_per_sm=int(get("max_blocks_per_multiprocessor", base.max_blocks_per_sm)),
        max_warps_per_sm=int(get("max_threads_per_multiprocessor", base.max_threads_per_sm)) // 32,
        registers_per_sm=int(get("max_registers_per_multiprocessor", base.registers_per_sm)),
        registers_per_block=int(get("max_registers_per_block", base.registers_per_block)),
        smem_per_block=int(get("max_shared_memory_per_block", base.smem_per_block)),
        smem_per_block_optin=int(get("max_shared_memory_per_block_optin", base.smem_per_block_optin)),
        smem_per_sm=int(get("max_shared_memory_per_multiprocessor", base.smem_per_sm)),
        smem_reserved_per_block=int(get("reserved_shared_memory_per_block", base.smem_reserved_per_block)),
        l2_bytes=int(get("l2_cache_size", base.l2_bytes)),
        dram_bandwidth=dram,
        fp32_flops=base.fp32_flops * scale,
        tensor_flops={k: v * scale for k, v in base.tensor_flops.items()},
        source=f"live device through cuda.core ({name}); FLOP rates: {base.source}, scaled by SMs x clock",
    )


def from_device(device: Any = None) -> Target:
    """The Target of the live GPU (cuda.core `Device(device)`). Raises DeviceError when there is
    no usable device or cuda.core is missing."""
    try:
        from cuda.core import Device  # type: ignore[import-untyped]

        dev = Device(device) if not hasattr(device, "properties") else device
        major, minor = dev.compute_capability
        name = getattr(dev, "name", "device")
        return from_properties(f"sm_{major}{minor}", dev.properties, name=str(name))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - no driver, no device, no cuda.core
        raise DeviceError(f"target.from_device(): no usable CUDA device ({type(exc).__name__}: {exc}); plan for "
                          "an architecture instead, e.g. tc.target('sm_90')") from exc


class _TargetFunction:
    """`tc.target(arch)` and `tc.target.from_device()` as one name."""

    ARCHS = ARCHS

    def __call__(self, arch: str = "sm_90") -> Target:
        return target(arch)

    @staticmethod
    def from_device(device: Any = None) -> Target:
        return from_device(device)

    @staticmethod
    def from_properties(arch: str, props: Any, name: str = "device") -> Target:
        return from_properties(arch, props, name)

    def __repr__(self) -> str:
        return "<tecc.target: target('sm_90') or target.from_device()>"


target_api = _TargetFunction()

__all__ = ["Target", "target", "from_device", "from_properties", "target_api", "ARCHS"]
